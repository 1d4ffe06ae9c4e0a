//! What a user reads when a binary cannot start: one line on stderr naming the flag or the file,
//! exit code 2 for a bad flag (as pflag and Go's flag package) and 1 for a bad configuration;
//! and text logs without terminal colour codes when stderr is not a terminal (`kubectl logs`).

use std::process::{Command, Output};

fn run(binary: &str, args: &[&str]) -> Output {
    Command::new(testbed::util::process::built_binary(binary))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap_or_else(|e| panic!("running {binary}: {e}"))
}

/// The stderr lines that are not log records (log records carry a level).
fn error_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !["INFO", "WARN", "DEBUG"].iter().any(|lvl| l.contains(lvl)))
        .map(str::to_string)
        .collect()
}

fn assert_one_line(binary: &str, args: &[&str], code: i32, names: &[&str]) {
    let out = run(binary, args);
    assert_eq!(out.status.code(), Some(code), "{binary} {args:?}: {out:?}");
    let lines = error_lines(&out);
    assert_eq!(
        lines.len(),
        1,
        "{binary} {args:?}: one line, got {lines:#?}"
    );
    assert!(lines[0].starts_with(&format!("{binary}: ")), "{lines:?}");
    for n in names {
        assert!(
            lines[0].contains(n),
            "{binary} {args:?}: {lines:?} must name {n}"
        );
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes off a terminal: {stderr:?}"
    );
}

#[test]
fn the_cloud_provider_says_what_is_wrong_in_one_line() {
    let ccm = "harvester-cloud-provider";
    assert_one_line(ccm, &["--no-such-flag"], 2, &["--no-such-flag"]);
    assert_one_line(
        ccm,
        &["--leader-elect=maybe"],
        2,
        &["--leader-elect", "maybe"],
    );
    assert_one_line(
        ccm,
        &["--node-ip-cidr=10.0.0.0/33"],
        2,
        &["--node-ip-cidr", "10.0.0.0/33"],
    );
    assert_one_line(
        ccm,
        &["--metrics-address=nowhere"],
        2,
        &["--metrics-address", "nowhere"],
    );
    assert_one_line(
        ccm,
        &["--secure-port=70000"],
        2,
        &["--secure-port", "70000"],
    );
    assert_one_line(
        ccm,
        &["--authorization-always-allow-paths=/a*b"],
        2,
        &["--authorization-always-allow-paths", "/a*b"],
    );
    // The serving certificate is read before the cloud-config: a bad one stops the start (1).
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, body: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).unwrap();
        p.display().to_string()
    };
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (cert, key) = (
        file("tls.crt", &cert.pem()),
        file("tls.key", &key.serialize_pem()),
    );
    let other_key = file(
        "other.key",
        &rcgen::KeyPair::generate().unwrap().serialize_pem(),
    );
    let junk = file("junk.pem", "not PEM\n");
    let missing = dir.path().join("missing.crt").display().to_string();
    let tls = |c: &str, k: &str| {
        [
            format!("--tls-cert-file={c}"),
            format!("--tls-private-key-file={k}"),
        ]
    };
    for (args, names) in [
        (tls(&junk, &key), vec!["--tls-cert-file", junk.as_str()]),
        (
            tls(&cert, &junk),
            vec!["--tls-private-key-file", junk.as_str()],
        ),
        (
            tls(&missing, &key),
            vec!["--tls-cert-file", missing.as_str()],
        ),
        (
            tls(&cert, &other_key),
            vec!["--tls-private-key-file", other_key.as_str(), cert.as_str()],
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_one_line(ccm, &args, 1, &names);
    }
    assert_one_line(
        ccm,
        &[&format!("--tls-cert-file={cert}")],
        1,
        &["--tls-cert-file", "--tls-private-key-file"],
    );
    // A flag without effect is logged (text, no colour) before the bad cloud-config stops it.
    let missing = "/nonexistent/cloud-config";
    assert_one_line(
        ccm,
        &[
            &format!("--cloud-config={missing}"),
            "--show-full-help-on-error",
            "--kubeconfig=/dev/null",
        ],
        1,
        &[missing],
    );
    let out = run(
        ccm,
        &[
            &format!("--cloud-config={missing}"),
            "--show-full-help-on-error",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("INFO") && stderr.contains("--show-full-help-on-error=true"),
        "the info line names the flag: {stderr}"
    );
}

#[test]
fn the_csi_driver_says_what_is_wrong_in_one_line() {
    let csi = "harvester-csi-driver";
    assert_one_line(csi, &["--no-such-flag"], 2, &["--no-such-flag"]);
    assert_one_line(csi, &["-debug=maybe"], 2, &["--debug", "maybe"]);
    assert_one_line(csi, &["--mode=sideways"], 2, &["--mode", "sideways"]);
    assert_one_line(
        csi,
        &["--metrics-address=nowhere"],
        2,
        &["--metrics-address", "nowhere"],
    );
    let missing = "/nonexistent/cloud-provider-config";
    assert_one_line(
        csi,
        &[
            &format!("--kubeconfig={missing}"),
            "--endpoint=unix:///tmp/never.sock",
        ],
        1,
        &[missing],
    );
}
