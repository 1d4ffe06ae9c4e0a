//! The binary's start-up edge: bad input ends it at once with one line naming what to fix.

use std::process::{Command, Output};

fn ccm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_harvester-cloud-provider"))
        .args(args)
        .env_remove("KUBECONFIG")
        .env_remove("CLOUD_CONFIG")
        .env("RUST_LOG", "off")
        .output()
        .expect("the binary runs")
}

fn one_error_line(out: &Output) -> String {
    assert!(!out.status.success(), "must fail: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one line on stderr: {stderr:?}");
    lines[0].to_string()
}

#[test]
fn missing_cloud_config_fails_with_one_line_naming_the_file() {
    let line = one_error_line(&ccm(&["--cloud-config", "/nonexistent/cloud-config"]));
    assert!(
        line.contains("/nonexistent/cloud-config") && line.contains("No such file"),
        "{line}"
    );
}

#[test]
fn malformed_cloud_config_fails_with_one_line_naming_the_file() {
    let path = std::env::temp_dir().join(format!("ccm-cli-test-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Config\nclusters: {not: [a list\n",
    )
    .expect("write");
    let line = one_error_line(&ccm(&["--cloud-config", &path.to_string_lossy()]));
    let _ = std::fs::remove_file(&path);
    assert!(line.contains(&*path.to_string_lossy()), "{line}");
    assert!(line.contains("cloud-config"), "{line}");
}

#[test]
fn bad_flag_value_fails_naming_flag_and_value() {
    let line = one_error_line(&ccm(&["--node-ip-cidr", "127.0.0.0/8"]));
    assert!(
        line.contains("--node-ip-cidr")
            && line.contains("127.0.0.0/8")
            && line.contains("loopback"),
        "{line}"
    );
    let line = one_error_line(&ccm(&["--management-network", "a/b/c"]));
    assert!(
        line.contains("--management-network") && line.contains("a/b/c"),
        "{line}"
    );
}

#[test]
fn help_lists_the_upstream_flags() {
    let out = ccm(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--cloud-config",
        "--cluster-name",
        "--kubeconfig",
        "--node-ip-cidr",
        "--node-exclude-ip-ranges",
        "--management-network",
        "--disable-annotation-alpha-provided-ip-addr",
        "--disable-vmi-controller",
        "--concurrent-node-syncs",
        "--node-status-update-frequency",
        "--controllers",
        "--v",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}
