//! The bed's livenessprobe (`livenessprobe` binary) against the real CSI driver binary on the
//! bed: it waits for the driver before serving, answers `/healthz` with 200 `ok` while the
//! driver answers Probe, 500 with the error when the driver hangs (past `--probe-timeout`) or is
//! gone, recovers when the driver does, and exits 0 on SIGTERM; bad flags are named.
//!
//! Upstream facts, as data (kubernetes-csi/livenessprobe `cmd/livenessprobe/main.go`, commit
//! f3b0982dcec9e3293a7549c25d7266ca028fac01): the healthy body is `ok`, a failed check is HTTP
//! 500 with the error's text, and the two flag conflicts are refused with status 1.

use testbed::TestBed;
use testbed::suites::csi as common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use testbed::util::process::{Proc, free_port};

const UPSTREAM_OK_BODY: &str = "ok";
const UPSTREAM_FAILED_STATUS: u16 = 500;

async fn get(port: u16, path: &'static str) -> Result<(u16, String), String> {
    tokio::task::spawn_blocking(move || testbed::util::scrape::http_get(port, path))
        .await
        .expect("http_get task")
}

fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill");
    assert!(st.success(), "kill -{sig} {pid} failed");
}

/// Polls `/healthz` until `want(code, body)` holds (20 s); returns the last answer.
async fn wait_health(
    port: u16,
    probe: &mut Proc,
    what: &str,
    want: impl Fn(u16, &str) -> bool,
) -> (u16, String) {
    let start = Instant::now();
    loop {
        if let Err(e) = probe.check_alive() {
            panic!("the livenessprobe died waiting for {what}: {e}");
        }
        let got = get(port, "/healthz").await;
        if let Ok((code, body)) = &got
            && want(*code, body)
        {
            return (*code, body.clone());
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "/healthz never showed {what} within 20s; last: {got:?}; log:\n{}",
            testbed::util::process::tail(&probe.log, 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn livenessprobe(dir: &Path, args: &[String]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_livenessprobe"));
    cmd.args(args);
    Proc::spawn("livenessprobe", cmd, dir).expect("starting the livenessprobe")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn livenessprobe_follows_the_driver() {
    let bed = TestBed::started().await;
    let socket = bed.dir.path().join("csi.sock");
    let port = free_port().expect("port");
    let timeout = Duration::from_secs(2);
    let mut probe = livenessprobe(
        bed.dir.path(),
        &[
            format!("--csi-address={}", socket.display()),
            format!("--http-endpoint=127.0.0.1:{port}"),
            format!("--probe-timeout={}s", timeout.as_secs()),
            "--v=5".into(),
        ],
    );

    // No driver yet: it waits without serving (the kubelet's probe sees a refused connection).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    probe
        .check_alive()
        .expect("the livenessprobe must wait for the driver, not exit");
    assert!(
        get(port, "/healthz").await.is_err(),
        "/healthz served before the driver was there"
    );

    let driver = common::DriverProc::controller(&bed, "csi-driver", &socket).await;
    let (code, body) = wait_health(port, &mut probe, "ok", |c, _| c == 200).await;
    assert_eq!((code, body.as_str()), (200, UPSTREAM_OK_BODY));
    let log = std::fs::read_to_string(&probe.log).unwrap_or_default();
    assert!(
        log.contains("driver.harvesterhci.io"),
        "the driver's name is not in the log:\n{log}"
    );
    let (code, _) = get(port, "/metrics").await.expect("GET /metrics");
    assert_eq!(code, 404, "only /healthz is served");

    // A hung driver: Probe gets no answer within --probe-timeout.
    signal(driver.proc.pid(), "STOP");
    let t = Instant::now();
    let hung = get(port, "/healthz").await;
    let took = t.elapsed();
    signal(driver.proc.pid(), "CONT");
    let (code, body) = hung.expect("an answer while the driver hangs");
    assert_eq!(code, UPSTREAM_FAILED_STATUS, "{body}");
    assert!(body.contains("DeadlineExceeded"), "{body}");
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(2),
        "answered after {took:?}, not after --probe-timeout {timeout:?}"
    );
    wait_health(port, &mut probe, "ok after SIGCONT", |c, _| c == 200).await;

    // The driver is gone (SIGKILL leaves its socket file): 500 naming the socket.
    driver.kill();
    let (code, body) = wait_health(port, &mut probe, "a failure", |c, _| c != 200).await;
    assert_eq!(code, UPSTREAM_FAILED_STATUS, "{body}");
    assert!(body.contains(&socket.display().to_string()), "{body}");
    probe
        .check_alive()
        .expect("the livenessprobe never crashes");

    // It comes back.
    let _driver = common::DriverProc::controller(&bed, "csi-driver-2", &socket).await;
    wait_health(port, &mut probe, "ok again", |c, _| c == 200).await;

    signal(probe.pid(), "TERM");
    let start = Instant::now();
    loop {
        match probe.check_alive() {
            Ok(()) => assert!(
                start.elapsed() < Duration::from_secs(10),
                "the livenessprobe ignored SIGTERM"
            ),
            Err(testbed::BedError::Died { status, .. }) => {
                assert_eq!(status, "exit status: 0", "SIGTERM must end it with 0");
                break;
            }
            Err(e) => panic!("{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn bad_flags_are_named_and_exit_1() {
    for (args, want) in [
        (
            &["--health-port=9809", "--http-endpoint=:9808"][..],
            "only one of `--health-port` and `--http-endpoint` can be explicitly set",
        ),
        (
            &["--metrics-address=:8080", "--http-endpoint=:9808"][..],
            "only one of `--metrics-address` and `--http-endpoint` can be explicitly set",
        ),
        (&["--http-endpoint=nowhere"][..], "\"nowhere\""),
        (&["--csi-address=tcp://h:1"][..], "\"tcp://h:1\""),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_livenessprobe"))
            .args(args)
            .output()
            .expect("running the livenessprobe");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_livenessprobe"))
        .arg("--probe-timeout=soon")
        .output()
        .expect("running the livenessprobe");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("\"soon\" is not a duration"),
        "{out:?}"
    );
}
