//! The `harvester-csi-driver` binary: answers on its socket (0600, a stale socket replaced) and
//! stops gracefully on SIGTERM, removing the socket. Controller mode needs no API server to start.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KUBECONFIG: &str = "apiVersion: v1
kind: Config
clusters:
- name: h
  cluster: {server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}
users:
- name: u
  user: {token: t}
contexts:
- name: c
  context: {cluster: h, user: u, namespace: guest-vms}
current-context: c
";

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn serves_on_a_private_socket_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("cloud-config");
    std::fs::write(&kubeconfig, KUBECONFIG).expect("kubeconfig");
    let socket = dir.path().join("csi/csi.sock");
    std::fs::create_dir_all(socket.parent().expect("parent")).expect("socket dir");
    // A stale socket from a previous run.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("stale socket"));

    let mut child = Command::new(env!("CARGO_BIN_EXE_harvester-csi-driver"))
        .arg(format!("--endpoint=unix://{}", socket.display()))
        .arg("--mode=controller")
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the driver");
    wait_until("the driver to listen", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
            || child.try_wait().ok().flatten().is_some()
    });
    assert!(
        child.try_wait().expect("child").is_none(),
        "the driver exited early"
    );
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no exit within 10s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(!Path::new(&socket).exists(), "socket removed on shutdown");
}

/// A bad endpoint is a bad flag value: refused before anything else (the cloud-config is not
/// even read), one line naming it, exit 2.
#[test]
fn a_bad_endpoint_is_one_clear_line() {
    for (endpoint, why) in [
        (
            "http://127.0.0.1:10000",
            "only unix:// and tcp:// endpoints",
        ),
        ("tcp://127.0.0.1", "needs a port"),
        ("csi.sock", "must be absolute"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_harvester-csi-driver"))
            .args([&format!("--endpoint={endpoint}"), "--mode=controller"])
            .args(["--kubeconfig=/nonexistent/cloud-config"])
            .output()
            .expect("running the driver");
        assert_eq!(out.status.code(), Some(2), "{endpoint}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(endpoint) && err.contains(why),
            "{endpoint}: {err}"
        );
    }
}
