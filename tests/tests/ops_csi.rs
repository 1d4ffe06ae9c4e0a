//! The `harvester-csi-driver` binary as an operator runs it, against the test bed: `/healthz`,
//! `/readyz` and `/metrics` (CSI RPCs by method and gRPC code with durations, Harvester API
//! requests), JSON logs with a span per RPC, and SIGTERM that lets an RPC in flight finish.

use testbed::suites::csi as common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{NODE, bed_with_vm_and, create_request, mount_cap, publish_request};
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::identity_client::IdentityClient;
use csi_proto::csi::v1::{CreateVolumeRequest, ProbeRequest};
use harvester_csi_driver::{Config, Mode};
use testbed::util::scrape::{self, http_get};
use testbed::{BedOptions, util::wait};

/// How long the stand-in takes from `addvolume` to the volume's Ready: the window in which the
/// test stops the driver.
const HOTPLUG_DELAY: Duration = Duration::from_secs(3);

#[tokio::test]
async fn the_binary_serves_probes_counts_rpcs_and_finishes_an_rpc_in_flight_on_sigterm() {
    let bed = bed_with_vm_and(BedOptions {
        hotplug_delay: HOTPLUG_DELAY,
        ..BedOptions::hotplugging()
    })
    .await;

    let socket = bed.dir.path().join("ops-csi.sock");
    let port = testbed::util::process::free_port().unwrap();
    let mut child = Command::new(testbed::util::process::built_binary("harvester-csi-driver"))
        .args(["--endpoint", &format!("unix://{}", socket.display())])
        .args(["--nodeid", NODE, "--mode", "all", "--debug"])
        .args(["--kubeconfig", &bed.cloud_config.to_string_lossy()])
        .args([
            "--disk-by-id-dir",
            &bed.sim.by_id_dir(NODE).to_string_lossy(),
        ])
        .args(["--metrics-address", &format!("127.0.0.1:{port}")])
        .args(["--log-format", "json", "--shutdown-grace-seconds", "20"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the driver binary");
    let logs = testbed::util::process::collect_lines(child.stderr.take().unwrap());

    // Ready once Harvester answered and the socket serves.
    scrape::wait_for_200(port, "/readyz", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(http_get(port, "/healthz").unwrap().0, 200);
    assert!(socket.exists());

    let channel = harvester_csi_driver::connect(&socket).await.unwrap();
    let mut identity = IdentityClient::new(channel.clone());
    let mut controller = ControllerClient::new(channel);
    let probe = identity.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
    let bad = controller
        .create_volume(CreateVolumeRequest {
            volume_capabilities: vec![mount_cap("ext4")],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    let volume = controller
        .create_volume(create_request("pvc-ops", 64 << 20, &mount_cap("ext4")))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("a volume");

    // Scraped and parsed: every RPC by method and code, with its duration.
    let samples = scrape::metrics(port).unwrap();
    let rpcs = |method, code| {
        scrape::sum(
            &samples,
            "harvester_csi_rpcs_total",
            &[("method", method), ("code", code)],
        )
    };
    assert_eq!(rpcs("Probe", "OK"), 1.0, "{samples:#?}");
    assert_eq!(rpcs("CreateVolume", "InvalidArgument"), 1.0);
    assert_eq!(rpcs("CreateVolume", "OK"), 1.0);
    assert_eq!(
        scrape::sum(
            &samples,
            "harvester_csi_rpc_duration_seconds_count",
            &[("method", "CreateVolume")]
        ),
        2.0
    );
    assert!(
        scrape::sum(
            &samples,
            "harvester_kube_api_requests_total",
            &[("verb", "create"), ("resource", "persistentvolumeclaims")]
        ) >= 1.0,
        "Harvester API requests counted: {samples:#?}"
    );

    // SIGTERM while ControllerPublishVolume waits for the hot-plug: the RPC finishes, then the
    // driver exits cleanly and removes its socket.
    let publish = tokio::spawn({
        let mut controller = controller.clone();
        let request = publish_request(&volume.volume_id, &mount_cap("ext4"));
        async move {
            let result = controller.controller_publish_volume(request).await;
            (result, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !publish.is_finished(),
        "publish must still wait for the hot-plug"
    );
    let signalled = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (result, finished) = publish.await.unwrap();
    let published = result.expect("the publish in flight at SIGTERM completes");
    assert!(
        finished > signalled,
        "the publish completed after SIGTERM, so it was in flight"
    );
    assert!(
        published
            .into_inner()
            .publish_context
            .values()
            .any(|v| !v.is_empty()),
        "publish context carries the disk serial"
    );
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "exit status {exit}");
    assert!(
        signalled.elapsed() < Duration::from_secs(20),
        "stopped within the grace period"
    );
    assert!(!socket.exists(), "socket removed on exit");

    let lines = logs.join().unwrap();
    let credentials = std::fs::read_to_string(&bed.cloud_config).unwrap();
    let create_span_seen = testbed::util::process::json_log(&lines, &credentials)
        .iter()
        .filter_map(|v| v.get("spans").map(|s| s.to_string()))
        .any(|spans| spans.contains(r#""method":"CreateVolume""#) && spans.contains("pvc-ops"));
    assert!(
        create_span_seen,
        "a log line inside CreateVolume's span naming the volume:\n{}",
        lines.join("\n")
    );
}

/// `/readyz` follows Harvester: 503 naming the check and the cloud-config while its API server is
/// down, 200 again once it is back; Probe answers ready throughout (a livenessprobe restart could
/// not bring Harvester back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_harvester_while_probe_stays_ready() {
    let mut bed = bed_with_vm_and(BedOptions::default()).await;
    let socket = bed.dir.path().join("ready-csi.sock");
    let port = testbed::util::process::free_port().unwrap();
    let mut config = Config::new(format!("unix://{}", socket.display()), &bed.cloud_config);
    config.mode = Mode::Controller;
    config.metrics_address = Some(([127, 0, 0, 1], port).into());
    config.harvester_check_period = Duration::from_millis(200);
    let driver = harvester_csi_driver::spawn(config);
    scrape::wait_for_200(port, "/readyz", Duration::from_secs(30))
        .await
        .unwrap();
    let channel = harvester_csi_driver::connect(&socket).await.unwrap();
    let mut identity = IdentityClient::new(channel);

    bed.harvester.stop();
    let cloud_config = bed.cloud_config.display().to_string();
    let body = wait::until("/readyz 503", Duration::from_secs(30), || async {
        Ok(match scrape::get(port, "/readyz").await {
            Ok((503, body)) => Ok(body),
            other => Err(other),
        })
    })
    .await
    .unwrap();
    assert!(
        body.contains("harvester:") && body.contains(&cloud_config),
        "names the check and the cloud-config: {body}"
    );
    let probe = identity.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true), "Probe while Harvester is down");
    assert_eq!(scrape::get(port, "/healthz").await.unwrap().0, 200);

    bed.harvester.start_again().await.unwrap();
    scrape::wait_for_200(port, "/readyz", Duration::from_secs(30))
        .await
        .unwrap();
    driver.stop().await.unwrap();
    assert!(!socket.exists());
}

/// A node plugin whose cloud-config may not read VirtualMachineInstances (a missing Harvester
/// role) serves, but `/readyz` says why its node ID could not be looked up, naming the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_plugin_refused_its_vmi_lookup_says_so_on_readyz() {
    let bed = bed_with_vm_and(BedOptions::default()).await;
    let yaml = format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: csi-blind, namespace: {}}}\n",
        bed.vm_namespace
    );
    testbed::bed::apply::apply_yaml(&bed.harvester.client, &yaml, &bed.vm_namespace)
        .await
        .unwrap();
    let cloud_config = bed.dir.path().join("blind-cloud-config");
    testbed::bed::rbac::account_kubeconfig(
        &bed.harvester.client,
        &bed.harvester.url,
        &bed.pki,
        (&bed.vm_namespace, "csi-blind"),
        &bed.vm_namespace,
        &cloud_config,
    )
    .await
    .unwrap();
    let socket = bed.dir.path().join("blind-csi.sock");
    let port = testbed::util::process::free_port().unwrap();
    let mut config = Config::new(format!("unix://{}", socket.display()), &cloud_config);
    config.mode = Mode::Node;
    config.node_id = Some(NODE.into());
    config.disk_by_id_dir = bed.sim.by_id_dir(NODE);
    config.metrics_address = Some(([127, 0, 0, 1], port).into());
    config.harvester_check_period = Duration::from_millis(200);
    let driver = harvester_csi_driver::spawn(config);
    let body = wait::until(
        "/readyz 503 for the node check alone",
        Duration::from_secs(30),
        || async {
            Ok(match scrape::get(port, "/readyz").await {
                Ok((503, body)) if !body.contains("harvester:") && !body.contains("csi:") => {
                    Ok(body)
                }
                other => Err(other),
            })
        },
    )
    .await
    .unwrap();
    assert!(
        body.contains("node:")
            && body.contains("Forbidden")
            && body.contains(&cloud_config.display().to_string())
            && body.contains("virtualmachineinstances"),
        "names the refusal, the file and the missing permission: {body}"
    );
    assert!(socket.exists(), "it still serves");
    driver.stop().await.unwrap();
}
