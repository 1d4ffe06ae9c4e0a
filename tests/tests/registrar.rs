//! The bed's kubelet plugin registrar (`registrar` binary) against the real CSI driver: a client
//! on the registration socket gets what the kubelet needs; a failed registration ends the
//! process with status 1; bad flags and a missing driver are named.

use testbed::BedOptions;
use testbed::suites::csi as common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use csi_proto::pluginregistration::registration_client::RegistrationClient;
use csi_proto::pluginregistration::{InfoRequest, RegistrationStatus};
use tokio::process::{Child, Command};

/// Upstream facts the kubelet relies on, as data:
/// - k8s.io/kubelet v0.34.4 `pkg/apis/pluginregistration/v1/constants.go`: `CSIPlugin = "CSIPlugin"`.
/// - kubernetes-csi/node-driver-registrar `cmd/csi-node-driver-registrar/main.go` (commit
///   0d8021d270bb1c98bea5348be2669ae5f2474d66): `supportedVersions = []string{"1.0.0"}`, socket
///   `<plugin-registration-path>/<driver>-reg.sock` (ours: `<driver>@reg.sock`, see
///   `testbed::real::registrar::socket_name`), probe file `registration` beside the host socket.
/// - harvester/harvester-csi-driver: the driver's name `driver.harvesterhci.io`.
const UPSTREAM_PLUGIN_TYPE: &str = "CSIPlugin";
const UPSTREAM_SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];
const UPSTREAM_DRIVER_NAME: &str = "driver.harvesterhci.io";

fn registrar(args: &[String], log: &Path) -> Child {
    let out = std::fs::File::create(log).expect("registrar log");
    Command::new(env!("CARGO_BIN_EXE_registrar"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log fd"))
        .stderr(out)
        .kill_on_drop(true)
        .spawn()
        .expect("starting the registrar binary")
}

async fn wait_socket(child: &mut Child, socket: &Path, log: &Path) {
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if let Some(status) = child.try_wait().expect("registrar status") {
            panic!(
                "the registrar exited ({status}) before serving {}; log:\n{}",
                socket.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{} did not appear within 20s; log:\n{}",
            socket.display(),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn exit_status(child: &mut Child) -> std::process::ExitStatus {
    tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("the registrar exits within 20s")
        .expect("registrar status")
}

struct Dirs {
    registry: PathBuf,
    host_socket: String,
    probe_file: PathBuf,
}

fn dirs(bed: &testbed::TestBed) -> Dirs {
    let registry = bed.dir.path().join("kubelet/plugins_registry");
    let plugin = bed
        .dir
        .path()
        .join("kubelet/plugins/driver.harvesterhci.io");
    std::fs::create_dir_all(&registry).expect("registry dir");
    std::fs::create_dir_all(&plugin).expect("plugin dir");
    Dirs {
        registry,
        host_socket: plugin.join("csi.sock").display().to_string(),
        probe_file: plugin.join("registration"),
    }
}

#[tokio::test]
async fn registrar_answers_get_info_and_exits_1_on_failed_registration() {
    let bed = common::bed_with_vm_and(BedOptions::default()).await;
    let driver = common::Driver::start(&bed, |_| {}).await;
    let d = dirs(&bed);
    let args = vec![
        format!("--csi-address={}", driver.socket.display()),
        format!("--kubelet-registration-path={}", d.host_socket),
        format!("--plugin-registration-path={}", d.registry.display()),
        "--v=2".to_string(),
    ];
    let probe_args = |mut a: Vec<String>| {
        a.push("--mode=kubelet-registration-probe".into());
        a
    };
    let log = bed.dir.path().join("registrar.log");

    // Before the kubelet asked, the probe mode fails.
    let before = std::process::Command::new(env!("CARGO_BIN_EXE_registrar"))
        .args(probe_args(args.clone()))
        .output()
        .expect("probe run");
    assert!(!before.status.success(), "probe succeeded before GetInfo");
    assert!(
        String::from_utf8_lossy(&before.stderr).contains("has not registered the plugin yet"),
        "{before:?}"
    );

    let mut child = registrar(&args, &log);
    let socket = d
        .registry
        .join(testbed::real::registrar::socket_name(UPSTREAM_DRIVER_NAME));
    wait_socket(&mut child, &socket, &log).await;

    let channel = harvester_csi_driver::connect(&socket)
        .await
        .expect("connecting to the registration socket");
    let mut client = RegistrationClient::new(channel);
    let info = client
        .get_info(InfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner();
    assert_eq!(info.r#type, UPSTREAM_PLUGIN_TYPE);
    assert_eq!(info.name, UPSTREAM_DRIVER_NAME);
    assert_eq!(info.endpoint, d.host_socket);
    assert_eq!(info.supported_versions, UPSTREAM_SUPPORTED_VERSIONS);
    assert!(
        d.probe_file.exists(),
        "GetInfo did not touch the probe file"
    );
    let after = std::process::Command::new(env!("CARGO_BIN_EXE_registrar"))
        .args(probe_args(args.clone()))
        .output()
        .expect("probe run");
    assert!(
        after.status.success(),
        "probe failed after GetInfo: {after:?}"
    );

    // A successful registration keeps it serving.
    client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .expect("NotifyRegistrationStatus(true)");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        child.try_wait().expect("status").is_none(),
        "the registrar stopped after a successful registration"
    );
    client
        .get_info(InfoRequest {})
        .await
        .expect("GetInfo again");

    // A failed one ends it with status 1, the socket removed, the error logged.
    let _ = client
        .notify_registration_status(RegistrationStatus {
            plugin_registered: false,
            error: "plugin version not supported".into(),
        })
        .await;
    let status = exit_status(&mut child).await;
    assert_eq!(status.code(), Some(1), "exit status {status}");
    assert!(!socket.exists(), "the registrar left its socket behind");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        text.contains("plugin version not supported"),
        "log does not name the kubelet's error:\n{text}"
    );
    driver.stop().await;
}

#[tokio::test]
async fn registrar_sigterm_removes_its_socket() {
    let bed = common::bed_with_vm_and(BedOptions::default()).await;
    let driver = common::Driver::start(&bed, |_| {}).await;
    let d = dirs(&bed);
    let log = bed.dir.path().join("registrar.log");
    let mut child = registrar(
        &[
            format!("--csi-address=unix://{}", driver.socket.display()),
            format!("--kubelet-registration-path={}", d.host_socket),
            format!("--plugin-registration-path={}", d.registry.display()),
        ],
        &log,
    );
    let socket = d
        .registry
        .join(testbed::real::registrar::socket_name(UPSTREAM_DRIVER_NAME));
    wait_socket(&mut child, &socket, &log).await;
    let pid = rustix::process::Pid::from_raw(child.id().expect("pid") as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let status = exit_status(&mut child).await;
    assert_eq!(status.code(), Some(0), "exit status {status}");
    assert!(!socket.exists(), "the registrar left its socket behind");
    driver.stop().await;
}

#[tokio::test]
async fn registrar_names_missing_flag_and_unreachable_driver() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |args: &[String]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_registrar"))
            .args(args)
            .output()
            .expect("registrar run")
    };
    let out = run(&[format!(
        "--plugin-registration-path={}",
        dir.path().display()
    )]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--kubelet-registration-path is a required parameter"),
        "{out:?}"
    );
    // A socket that accepts but never answers: the registrar gives up after --timeout (it
    // waits for a socket that is not there yet: see the next test).
    let mute_dir = tempfile::tempdir().expect("tempdir");
    let missing = mute_dir.path().join("mute-driver.sock");
    let _mute = std::os::unix::net::UnixListener::bind(&missing).expect("mute socket");
    let out = run(&[
        format!("--csi-address={}", missing.display()),
        "--kubelet-registration-path=/var/lib/kubelet/plugins/x/csi.sock".into(),
        format!("--plugin-registration-path={}", dir.path().display()),
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "CSI driver at {:?}",
            missing.display().to_string()
        )) && stderr.contains("no answer within 1s"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("dir").count(),
        0,
        "a registrar without a driver left files behind"
    );
}

/// The driver container may start after the registrar's: the registrar waits for the driver's
/// socket (as node-driver-registrar does through csi-lib-utils' blocking dial) instead of
/// exiting, then registers.
#[tokio::test]
async fn registrar_waits_for_a_driver_that_starts_later() {
    let bed = common::bed_with_vm_and(BedOptions::default()).await;
    let d = dirs(&bed);
    let later = bed.dir.path().join("later.sock");
    let log = bed.dir.path().join("registrar-waits.log");
    let mut child = registrar(
        &[
            format!("--csi-address={}", later.display()),
            format!("--kubelet-registration-path={}", d.host_socket),
            format!("--plugin-registration-path={}", d.registry.display()),
        ],
        &log,
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        child.try_wait().expect("registrar status").is_none(),
        "the registrar exited while the driver was not there yet; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let endpoint = format!("unix://{}", later.display());
    let _driver = common::Driver::start(&bed, |c| c.endpoint = endpoint).await;
    let socket = d
        .registry
        .join(testbed::real::registrar::socket_name(UPSTREAM_DRIVER_NAME));
    wait_socket(&mut child, &socket, &log).await;
    let _ = child.kill().await;
}
