//! The `harvester-cloud-provider` binary as an operator runs it, against the test bed: health,
//! readiness and metrics endpoints, JSON logs, leader election with a Lease, graceful SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use testbed::sim::GuestVm;
use testbed::{BedOptions, TestBed, wait};

/// The binary cargo built next to this test (`cargo test --workspace` builds every binary).
fn binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let bin = dir.join("harvester-cloud-provider");
    assert!(
        bin.is_file(),
        "{} is not built: run `cargo build --bin harvester-cloud-provider`",
        bin.display()
    );
    bin
}

fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    let code = out
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or(out.clone())?;
    Ok((code, out))
}

#[tokio::test]
async fn the_binary_serves_probes_and_metrics_leads_with_a_lease_and_stops_on_sigterm() {
    let bed = TestBed::start(BedOptions::default())
        .await
        .unwrap_or_else(|e| panic!("bed: {e}"));
    bed.sim
        .create_host("h1", Some("r1"), Some("z1"))
        .await
        .unwrap();
    bed.sim
        .create_vm(&GuestVm::new("w1").on_host("h1").ip("10.0.0.7"))
        .await
        .unwrap();
    let port = testbed::process::free_port().unwrap();
    let mut child = Command::new(binary())
        .args(["--cloud-config", &bed.cloud_config.to_string_lossy()])
        .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
        .args(["--cluster-name", "ops", "--log-format", "json"])
        .args(["--metrics-address", &format!("127.0.0.1:{port}")])
        .args(["--leader-elect-resource-namespace", "kube-system"])
        .env("POD_NAME", "ccm-0")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the binary");
    let stderr = child.stderr.take().unwrap();
    let logs = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });

    wait::until("/readyz 200", Duration::from_secs(30), || async {
        Ok(match http_get(port, "/readyz") {
            Ok((200, _)) => Ok(()),
            other => Err(other),
        })
    })
    .await
    .unwrap();
    assert_eq!(http_get(port, "/healthz").unwrap().0, 200);

    // It leads and works: the Node gets initialised.
    let leases: Api<Lease> = Api::namespaced(bed.guest.client.clone(), "kube-system");
    let lease = leases
        .get("harvester-cloud-provider")
        .await
        .expect("lease created");
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("ccm-0")
    );
    bed.sim.create_guest_node("w1").await.unwrap();
    let nodes: Api<Node> = Api::all(bed.guest.client.clone());
    wait::until("Node w1 initialised", Duration::from_secs(30), || {
        let nodes = nodes.clone();
        async move {
            let n = nodes.get("w1").await.map_err(|e| e.to_string())?;
            let id = n.spec.as_ref().and_then(|s| s.provider_id.clone());
            Ok(if id.is_some() { Ok(()) } else { Err(n.spec) })
        }
    })
    .await
    .unwrap();
    let (_, metrics) = http_get(port, "/metrics").unwrap();
    assert!(
        metrics.contains("harvester_kube_api_requests_total{"),
        "API requests counted:\n{metrics}"
    );
    assert!(metrics.contains(r#"resource="nodes""#), "{metrics}");

    // SIGTERM: a clean exit that releases the lease.
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "exit status {exit}");
    let lease = leases.get("harvester-cloud-provider").await.unwrap();
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity),
        None,
        "lease released on SIGTERM"
    );
    let lines = logs.join().unwrap();
    assert!(!lines.is_empty());
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}"));
        assert!(v.get("level").is_some(), "{l}");
        assert!(
            !l.contains("BEGIN") && !l.contains("client-key-data"),
            "no key material in logs: {l}"
        );
    }
}
