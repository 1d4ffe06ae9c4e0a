//! The `harvester-cloud-provider` binary as an operator runs it, against the test bed: health,
//! readiness and metrics endpoints, JSON logs, leader election with a Lease, graceful SIGTERM.

use std::process::{Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use testbed::sim::GuestVm;
use testbed::util::scrape::{self, http_get};
use testbed::{TestBed, util::wait};

#[tokio::test]
async fn the_binary_serves_probes_and_metrics_leads_with_a_lease_and_stops_on_sigterm() {
    let bed = TestBed::started().await;
    bed.sim
        .create_host("h1", Some("r1"), Some("z1"))
        .await
        .unwrap();
    bed.sim
        .create_vm(&GuestVm::new("w1").on_host("h1").ip("10.0.0.7"))
        .await
        .unwrap();
    let port = testbed::util::process::free_port().unwrap();
    let mut child = Command::new(testbed::util::process::built_binary(
        "harvester-cloud-provider",
    ))
    .args(["--cloud-config", &bed.cloud_config.to_string_lossy()])
    .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
    .args(["--cluster-name", "ops", "--log-format", "json"])
    .args(["--metrics-address", &format!("127.0.0.1:{port}")])
    // Plain HTTP only: two providers of one test would both want the HTTPS default 10258.
    .arg("--secure-port=0")
    .args(["--leader-elect-resource-namespace", "kube-system"])
    .env("POD_NAME", "ccm-0")
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start the binary");
    let logs = testbed::util::process::collect_lines(child.stderr.take().unwrap());
    scrape::wait_for_200(port, "/readyz", Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(http_get(port, "/healthz").unwrap().0, 200);

    // It leads and works: the Node gets initialised. Ready is not leading (a standby is ready
    // too, as upstream's), so the Lease is waited for, not read once.
    let leases: Api<Lease> = Api::namespaced(bed.guest.client.clone(), "kube-system");
    wait::lease_held_by(&leases, LEASE, "ccm-0", Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
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
    // Scraped and parsed as Prometheus would: API requests by verb/resource/code, and the node
    // controllers' reconciles with their durations.
    let samples = scrape::metrics(port).unwrap();
    let api = |verb, resource| {
        scrape::sum(
            &samples,
            "harvester_kube_api_requests_total",
            &[("verb", verb), ("resource", resource)],
        )
    };
    assert!(api("patch", "nodes") >= 1.0, "{samples:#?}");
    assert!(api("get", "virtualmachines") + api("list", "virtualmachines") >= 1.0);
    for controller in [
        "cloud-node-controller",
        "cloud-node-lifecycle-controller",
        "topology",
    ] {
        let labels = [("controller", controller)];
        let reconciles = scrape::sum(&samples, "harvester_reconciles_total", &labels);
        let timed = scrape::sum(
            &samples,
            "harvester_reconcile_duration_seconds_count",
            &labels,
        );
        let waits = scrape::sum(&samples, "harvester_reconcile_queue_seconds_count", &labels);
        assert!(reconciles >= 1.0, "{controller} reconciles counted");
        assert!(timed >= 1.0, "{controller} reconciles timed");
        assert!(waits >= 1.0, "{controller} reconciles' waits timed");
    }

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
    let lease = leases.get(LEASE).await.unwrap();
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity),
        None,
        "lease released on SIGTERM"
    );
    let credentials = std::fs::read_to_string(&bed.cloud_config).unwrap();
    testbed::util::process::json_log(&logs.join().unwrap(), &credentials);
}

/// The provider's Lease (`--leader-elect-resource-name`'s default): upstream's, so that upstream
/// pods and ours share one election during a rolling switch.
const LEASE: &str = "cloud-controller-manager";

/// A provider binary with a short lease, for the hand-over test.
fn provider(bed: &TestBed, name: &str, port: u16) -> std::process::Child {
    Command::new(testbed::util::process::built_binary(
        "harvester-cloud-provider",
    ))
    .args(["--cloud-config", &bed.cloud_config.to_string_lossy()])
    .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
    .args(["--cluster-name", "ops", "--v", "4"])
    .args(["--metrics-address", &format!("127.0.0.1:{port}")])
    // Plain HTTP only: two providers of one test would both want the HTTPS default 10258.
    .arg("--secure-port=0")
    .args(["--leader-elect-lease-duration", "4s"])
    .args(["--leader-elect-renew-deadline", "3s"])
    .args(["--leader-elect-retry-period", "500ms"])
    .env("POD_NAME", name)
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start the binary")
}

/// Write requests (create, update, patch, delete) a provider made, but for its Lease.
fn writes(port: u16) -> u64 {
    let Ok(samples) = scrape::metrics(port) else {
        return u64::MAX;
    };
    let label = |s: &scrape::Sample, k: &str| s.labels.get(k).cloned().unwrap_or_default();
    samples
        .iter()
        .filter(|s| s.name == "harvester_kube_api_requests_total")
        .filter(|s| !matches!(label(s, "resource").as_str(), "leases" | "events"))
        .filter(|s| {
            matches!(
                label(s, "verb").as_str(),
                "create" | "update" | "patch" | "delete"
            )
        })
        .map(|s| s.value as u64)
        .sum()
}

async fn wait_initialised(bed: &TestBed, node: &str) {
    wait::node_initialised(&bed.guest.client, node)
        .await
        .unwrap();
}

#[tokio::test]
async fn two_providers_have_one_writer_and_kill_9_hands_over_within_the_lease() {
    let bed = TestBed::started().await;
    bed.sim
        .create_host("h1", Some("r1"), Some("z1"))
        .await
        .unwrap();
    let leases: Api<Lease> = Api::namespaced(bed.guest.client.clone(), "kube-system");
    let (pa, pb) = (
        testbed::util::process::free_port().unwrap(),
        testbed::util::process::free_port().unwrap(),
    );
    let mut a = provider(&bed, "ccm-a", pa);
    wait::lease_held_by(&leases, LEASE, "ccm-a", Duration::from_secs(30))
        .await
        .unwrap();
    let mut b = provider(&bed, "ccm-b", pb);
    let b_logs = testbed::util::process::collect_lines(b.stderr.take().unwrap());
    // The standby is ready (it can take over) although its controllers do not run.
    scrape::wait_for_200(pb, "/readyz", Duration::from_secs(30))
        .await
        .unwrap();
    bed.sim
        .create_vm(&GuestVm::new("w1").on_host("h1").ip("10.0.0.8"))
        .await
        .unwrap();
    bed.sim.create_guest_node("w1").await.unwrap();
    wait_initialised(&bed, "w1").await;
    assert!(writes(pa) > 0, "the leader wrote");
    assert_eq!(writes(pb), 0, "the standby never writes");

    // kill -9 the leader: the standby takes over once the lease (4 s) has run out, and converges.
    let t0 = tokio::time::Instant::now();
    a.kill().unwrap();
    let _ = a.wait();
    wait::lease_held_by(&leases, LEASE, "ccm-b", Duration::from_secs(15))
        .await
        .unwrap();
    let took = t0.elapsed();
    assert!(
        took <= Duration::from_secs(6),
        "hand-over took {took:?} (lease 4 s, retry 0.5 s)"
    );
    bed.sim
        .create_vm(&GuestVm::new("w2").on_host("h1").ip("10.0.0.9"))
        .await
        .unwrap();
    bed.sim.create_guest_node("w2").await.unwrap();
    wait_initialised(&bed, "w2").await;
    assert!(writes(pb) > 0, "the new leader writes");

    let _ = Command::new("kill")
        .args(["-TERM", &b.id().to_string()])
        .status();
    let exit = tokio::task::spawn_blocking(move || b.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit}");
    // Debug logs of a whole flow carry no credentials: no key or certificate from the cloud-config.
    let logs = b_logs.join().unwrap().join("\n");
    assert!(logs.contains("DEBUG"), "ran at debug level");
    for secret in [&bed.pki.admin.key_pem, &bed.pki.admin.cert_pem] {
        use base64::Engine;
        let body: String = secret.lines().filter(|l| !l.starts_with("-----")).collect();
        // As PEM, and base64-encoded as the kubeconfig carries it.
        let encoded = base64::engine::general_purpose::STANDARD.encode(secret);
        for needle in [&body[..40], &encoded[..40]] {
            assert!(!logs.contains(needle), "key material in the logs: {needle}");
        }
    }
}

/// A cloud-config whose token expires within `--token-expiry-warning-days`: the provider stays
/// ready, exports the expiry, and puts a Warning Event on its own Pod naming the file.
#[tokio::test]
async fn an_expiring_token_gives_a_warning_event_on_the_provider_pod() {
    let bed = TestBed::started().await;
    let yaml = format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata: {{name: ccm-expiring, namespace: {ns}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: ccm-expiring}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin}}
subjects: [{{kind: ServiceAccount, name: ccm-expiring, namespace: {ns}}}]
"#,
        ns = bed.vm_namespace
    );
    testbed::bed::apply::apply_yaml(&bed.harvester.client, &yaml, &bed.vm_namespace)
        .await
        .unwrap();
    let two_days = 2 * 86_400;
    let token = testbed::bed::rbac::token_for(
        &bed.harvester.client,
        &bed.vm_namespace,
        "ccm-expiring",
        two_days,
    )
    .await
    .unwrap();
    let cloud_config = bed.dir.path().join("expiring-cloud-config");
    std::fs::write(
        &cloud_config,
        testbed::bed::rbac::token_kubeconfig_text(
            &bed.harvester.url,
            &bed.pki,
            &token,
            &bed.vm_namespace,
        ),
    )
    .unwrap();

    let port = testbed::util::process::free_port().unwrap();
    let mut child = Command::new(testbed::util::process::built_binary(
        "harvester-cloud-provider",
    ))
    .args(["--cloud-config", &cloud_config.to_string_lossy()])
    .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
    .args(["--cluster-name", "ops", "--token-expiry-warning-days", "7"])
    .args(["--metrics-address", &format!("127.0.0.1:{port}")])
    // Plain HTTP only: two providers of one test would both want the HTTPS default 10258.
    .arg("--secure-port=0")
    .args(["--leader-elect-resource-namespace", "kube-system"])
    .env("POD_NAME", "ccm-expiring-0")
    .env("POD_NAMESPACE", "kube-system")
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("start the binary");

    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(bed.guest.client.clone(), "kube-system");
    let event = wait::until(
        "a CloudConfigTokenExpiring Event on the Pod",
        Duration::from_secs(30),
        || async {
            let list = events
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?;
            Ok(list
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("CloudConfigTokenExpiring"))
                .ok_or("none yet"))
        },
    )
    .await
    .unwrap();
    let regarding = event.regarding.clone().unwrap_or_default();
    assert_eq!(regarding.kind.as_deref(), Some("Pod"));
    assert_eq!(regarding.name.as_deref(), Some("ccm-expiring-0"));
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    let note = event.note.clone().unwrap_or_default();
    assert!(
        note.contains(&cloud_config.display().to_string()) && note.contains("expires"),
        "{note}"
    );
    // Still ready (the credentials work), and the expiry is exported.
    scrape::wait_for_200(port, "/readyz", Duration::from_secs(30))
        .await
        .unwrap();
    let left = scrape::sum(
        &scrape::metrics(port).unwrap(),
        "harvester_cloud_config_token_expiry_seconds",
        &[],
    );
    assert!(
        ((two_days - 300) as f64..=two_days as f64).contains(&left),
        "expiry exported: {left} s"
    );
    child.kill().unwrap();
    let _ = child.wait();
}

/// A rolling switch from upstream: an upstream (client-go) pod holds and renews the default Lease
/// `kube-system/cloud-controller-manager`. Ours, started with upstream's defaults, stays a
/// standby that writes nothing (the Node stays tainted), and takes over within the lease once the
/// holder stops renewing.
#[tokio::test]
async fn a_lease_held_by_upstream_keeps_ours_standby_until_it_expires() {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use kube::api::{ObjectMeta, PostParams};

    let bed = TestBed::started().await;
    bed.sim
        .create_host("h1", Some("r1"), Some("z1"))
        .await
        .unwrap();
    bed.sim
        .create_vm(&GuestVm::new("w1").on_host("h1").ip("10.0.0.7"))
        .await
        .unwrap();
    bed.sim.create_guest_node("w1").await.unwrap();
    // What client-go's LeaseLock writes for upstream's pod: identity `<hostname>_<uuid>`, 15 s.
    const UPSTREAM: &str =
        "harvester-cloud-provider-7d4b9c-x2x9q_5f0c7c1e-6a1b-4a4e-9b59-1b1f3b2c9d10";
    let leases: Api<Lease> = Api::namespaced(bed.guest.client.clone(), "kube-system");
    let now = || MicroTime(jiff::Timestamp::now());
    let held = Lease {
        metadata: ObjectMeta {
            name: Some(LEASE.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(UPSTREAM.into()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(now()),
            renew_time: Some(now()),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    };
    leases.create(&PostParams::default(), &held).await.unwrap();
    let renewing = tokio::spawn({
        let leases = leases.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let Ok(mut l) = leases.get(LEASE).await else {
                    continue;
                };
                if let Some(spec) = l.spec.as_mut() {
                    spec.renew_time = Some(now());
                }
                let _ = leases.replace(LEASE, &PostParams::default(), &l).await;
            }
        }
    });

    // Upstream's chart args: no Lease flags at all, so the default Lease is the one above.
    let port = testbed::util::process::free_port().unwrap();
    let mut ours = Command::new(testbed::util::process::built_binary(
        "harvester-cloud-provider",
    ))
    .args(["--cloud-config", &bed.cloud_config.to_string_lossy()])
    .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
    .args(["--cluster-name=switch", "--leader-elect"])
    .args(["--metrics-address", &format!("127.0.0.1:{port}")])
    // Plain HTTP only: two providers of one test would both want the HTTPS default 10258.
    .arg("--secure-port=0")
    .env("POD_NAME", "ours-0")
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("start the binary");
    scrape::wait_for_200(port, "/readyz", Duration::from_secs(30))
        .await
        .unwrap();
    // Well past a lease duration of renewals by upstream: ours must not have moved.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        wait::lease_holder(&leases, LEASE).await.as_deref(),
        Some(UPSTREAM),
        "upstream keeps the Lease while it renews"
    );
    assert_eq!(writes(port), 0, "a standby writes nothing");
    let samples = scrape::metrics(port).unwrap();
    let lease_writes: f64 = ["create", "update", "patch"]
        .iter()
        .map(|verb| {
            scrape::sum(
                &samples,
                "harvester_kube_api_requests_total",
                &[("verb", verb), ("resource", "leases")],
            )
        })
        .sum();
    assert_eq!(lease_writes, 0.0, "not even a write to the held Lease");
    let nodes: Api<Node> = Api::all(bed.guest.client.clone());
    let w1 = nodes.get("w1").await.unwrap();
    assert!(
        w1.spec.and_then(|s| s.provider_id).is_none(),
        "the standby initialised nothing"
    );

    // Upstream's pod is gone: ours takes over once 15 s pass without a renewal.
    renewing.abort();
    let stopped = tokio::time::Instant::now();
    wait::lease_held_by(&leases, LEASE, "ours-0", Duration::from_secs(30))
        .await
        .unwrap();
    let took = stopped.elapsed();
    assert!(
        took <= Duration::from_secs(15 + 2 + 2 + 3),
        "took over {took:?} after renewals stopped (lease 15 s, renewals and retries every 2 s)"
    );
    wait_initialised(&bed, "w1").await;
    ours.kill().unwrap();
    let _ = ours.wait();
}

/// The provider's Event recorder against the real API server: a repeat is counted on the first
/// Event (`series.count`, also when queued at once), and a repeat after that Event was deleted
/// (expired or cleaned up) creates a new one instead of failing on the gone Event.
#[tokio::test]
async fn a_repeated_event_is_counted_in_its_series_and_one_whose_event_is_gone_starts_anew() {
    use harvester_cloud_provider::event_recorder::EventRecorder;
    use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
    use k8s_openapi::api::events::v1::Event as K8sEvent;
    use kube::api::{DeleteParams, ListParams, PostParams};
    use kube::runtime::events::{Event, EventType};

    let bed = TestBed::started().await;
    let client = bed.guest.client.clone();
    let cm = Api::<ConfigMap>::namespaced(client.clone(), "default")
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": "regarded"}})).unwrap(),
        )
        .await
        .unwrap();
    let regarding = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("ConfigMap".into()),
        namespace: Some("default".into()),
        name: Some("regarded".into()),
        uid: cm.metadata.uid.clone(),
        ..ObjectReference::default()
    };
    let event = || Event {
        type_: EventType::Warning,
        reason: "Tested".into(),
        note: Some("the same occurrence".into()),
        action: "Test".into(),
        secondary: None,
    };
    let recorder = EventRecorder::new(client.clone(), "ops-test", Some("ops-0".into()));
    let events = Api::<K8sEvent>::namespaced(client, "default");
    let ours = || async {
        let mut list = events.list(&ListParams::default()).await.unwrap().items;
        list.retain(|e| e.reason.as_deref() == Some("Tested"));
        list
    };

    // Queued at once: the one task writes them in order, so the repeats find their series.
    for _ in 0..3 {
        recorder.record(event(), regarding.clone());
    }
    let first = wait::until(
        "three occurrences counted",
        Duration::from_secs(30),
        || async {
            let list = ours().await;
            let counted = list
                .iter()
                .any(|e| e.series.as_ref().map(|s| s.count) == Some(3));
            Ok(if counted { Ok(list) } else { Err(list) })
        },
    )
    .await
    .unwrap();
    assert_eq!(first.len(), 1, "three occurrences, one Event: {first:?}");
    assert_eq!(first[0].series.as_ref().map(|s| s.count), Some(3));
    assert_eq!(first[0].reporting_controller.as_deref(), Some("ops-test"));
    assert_eq!(first[0].reporting_instance.as_deref(), Some("ops-0"));
    assert_eq!(first[0].note.as_deref(), Some("the same occurrence"));

    let name = first[0].metadata.name.clone().unwrap();
    events
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    recorder.record(event(), regarding);
    let after = wait::until("a new Event", Duration::from_secs(30), || async {
        let list = ours().await;
        Ok(if list.is_empty() { Err(list) } else { Ok(list) })
    })
    .await
    .unwrap();
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(after[0].metadata.name.as_deref(), Some(name.as_str()));
    assert!(after[0].series.is_none(), "a new series: {after:?}");
}
