//! The cloud provider's node-side controllers against the test bed: real guest and Harvester
//! API servers, VMs and VMIs played by the stand-in, the CCM running in-process.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use harvester_cloud_provider::node::patch::{
    self, NodeChange, SHUTDOWN_TAINT, UNINITIALIZED_TAINT, node_key,
};
use harvester_cloud_provider::written::WriteLog;
use harvester_cloud_provider::{Config, Running};
use harvester_common::harvester::{
    FAILURE_DOMAIN_REGION, FAILURE_DOMAIN_ZONE, TOPOLOGY_REGION, TOPOLOGY_ZONE,
    VirtualMachineInstance,
};
use k8s_openapi::api::core::v1::{Node, NodeAddress};
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::json;
use testbed::sim::GuestVm;
use testbed::sim::virt_api::update_vmi;
use testbed::{BedOptions, TestBed, util::wait};

/// How long any one expected change may take.
const LIMIT: Duration = Duration::from_secs(20);

async fn bed() -> TestBed {
    match TestBed::start(BedOptions::default()).await {
        Ok(bed) => bed,
        Err(e) => panic!("the test bed must start for this test: {e}"),
    }
}

/// The cloud provider against the bed, with `extra` flags.
fn start_ccm(bed: &TestBed, extra: &[&str]) -> Running {
    let cloud_config = bed.cloud_config.to_string_lossy().to_string();
    let kubeconfig = bed.guest.kubeconfig.to_string_lossy().to_string();
    let mut args = vec![
        "harvester-cloud-provider",
        "--cloud-config",
        &cloud_config,
        "--kubeconfig",
        &kubeconfig,
        "--cluster-name",
        "guest-1",
    ];
    args.extend_from_slice(extra);
    let config = Config::from_args(args).expect("test flags are valid");
    harvester_cloud_provider::spawn(config)
}

async fn stop(ccm: Running) {
    assert!(!ccm.is_finished(), "the cloud provider ended early");
    ccm.stop().await.expect("the cloud provider stops cleanly");
}

fn nodes(bed: &TestBed) -> Api<Node> {
    Api::all(bed.guest.client.clone())
}

/// What a test prints about a Node when a wait times out.
fn summary(node: &Option<Node>) -> String {
    match node {
        None => "no Node".into(),
        Some(n) => format!(
            "providerID={:?} labels={:?} taints={:?} addresses={:?}",
            n.spec.as_ref().and_then(|s| s.provider_id.clone()),
            n.labels(),
            n.spec.as_ref().and_then(|s| s.taints.clone()),
            n.status.as_ref().and_then(|s| s.addresses.clone()),
        ),
    }
}

/// Waits until `check` accepts Node `name` (or its absence), panicking with what was seen last.
async fn node_until<T>(
    bed: &TestBed,
    name: &str,
    what: &str,
    check: impl Fn(&Option<Node>) -> Option<T>,
) -> T {
    let api = nodes(bed);
    let check = &check;
    wait::until(what, LIMIT, || {
        let api = api.clone();
        async move {
            let node = api.get_opt(name).await.map_err(|e| e.to_string())?;
            Ok(match check(&node) {
                Some(v) => Ok(v),
                None => Err(summary(&node)),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The keys of the cloud provider's taints (`node.cloudprovider.kubernetes.io/*`); the API
/// server's own `node.kubernetes.io/not-ready` (no kubelet in the bed) is not ours to judge.
fn taint_keys(node: &Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|t| {
            t.iter()
                .map(|t| t.key.clone())
                .filter(|k| k.starts_with("node.cloudprovider.kubernetes.io/"))
                .collect()
        })
        .unwrap_or_default()
}

fn initialised(node: &Option<Node>) -> Option<Node> {
    node.as_ref()
        .filter(|n| !taint_keys(n).iter().any(|k| k == UNINITIALIZED_TAINT))
        .cloned()
}

fn addresses(node: &Node) -> Vec<String> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|a| {
            a.iter()
                .map(|a| format!("{}={}", a.type_, a.address))
                .collect()
        })
        .unwrap_or_default()
}

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.labels().get(key).map(String::as_str)
}

/// Waits for an Event of `type_`/`reason` about Node `node`.
async fn event_until(bed: &TestBed, node: &str, type_: &str, reason: &str) -> Event {
    let events: Api<Event> = Api::namespaced(bed.guest.client.clone(), "default");
    wait_for(&format!("{type_} Event {reason} on Node {node}"), || {
        let events = events.clone();
        async move {
            let list = events
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?;
            let seen: Vec<String> = list
                .items
                .iter()
                .map(|e| format!("{:?}/{:?}", e.type_, e.reason))
                .collect();
            Ok(list
                .items
                .into_iter()
                .find(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
                        && e.type_.as_deref() == Some(type_)
                        && e.reason.as_deref() == Some(reason)
                })
                .ok_or(seen))
        }
    })
    .await
}

async fn wait_for<T, S: Debug, F, Fut>(what: &str, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Result<T, S>, String>>,
{
    wait::until(what, LIMIT, probe)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Host `harvester-1` (region-a/zone-1) and a running VM `name` on it with `ips`.
async fn vm_on_host_1(bed: &TestBed, name: &str, ips: &[&str]) -> (GuestVm, String) {
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    vm(bed, name, ips).await
}

async fn vm(bed: &TestBed, name: &str, ips: &[&str]) -> (GuestVm, String) {
    let mut spec = GuestVm::new(name).on_host("harvester-1");
    for ip in ips {
        spec = spec.ip(ip);
    }
    let (vm, _) = bed.sim.create_vm(&spec).await.expect("vm");
    (spec, vm.metadata.uid.expect("the API server sets a uid"))
}

#[tokio::test]
async fn tainted_node_is_initialised_from_its_vm_within_seconds() {
    let bed = bed().await;
    let (_, uid) = vm_on_host_1(&bed, "worker-1", &["10.52.0.11", "fd00::11", "169.254.7.7"]).await;
    let ccm = start_ccm(&bed, &[]);

    let t0 = Instant::now();
    bed.sim.create_guest_node("worker-1").await.expect("node");
    let node = node_until(&bed, "worker-1", "Node initialised", initialised).await;
    let took = t0.elapsed();
    eprintln!("Node worker-1 initialised {took:?} after it registered");
    assert!(took < Duration::from_secs(10), "took {took:?}");

    let spec = node.spec.clone().unwrap_or_default();
    assert_eq!(spec.provider_id, Some(format!("harvester://{uid}")));
    assert_eq!(
        addresses(&node),
        [
            "InternalIP=10.52.0.11",
            "InternalIP=fd00::11",
            "Hostname=worker-1"
        ],
        "dual stack, link-local dropped, hostname last"
    );
    assert_eq!(label(&node, TOPOLOGY_REGION), Some("region-a"));
    assert_eq!(label(&node, TOPOLOGY_ZONE), Some("zone-1"));
    // Upstream's framework sets the deprecated beta labels too; old manifests select on them.
    assert_eq!(label(&node, FAILURE_DOMAIN_REGION), Some("region-a"));
    assert_eq!(label(&node, FAILURE_DOMAIN_ZONE), Some("zone-1"));
    assert!(
        taint_keys(&node).is_empty(),
        "no taint left: {:?}",
        taint_keys(&node)
    );
    let event = event_until(&bed, "worker-1", "Normal", "Initialized").await;
    assert!(
        event
            .note
            .unwrap_or_default()
            .contains(&format!("harvester://{uid}")),
        "the Event tells what was set"
    );
    stop(ccm).await;
}

#[tokio::test]
async fn migration_moves_the_node_to_the_zone_of_its_new_host() {
    let bed = bed().await;
    vm_on_host_1(&bed, "worker-1", &["10.52.0.11"]).await;
    bed.sim.create_guest_node("worker-1").await.expect("node");
    let ccm = start_ccm(&bed, &[]);
    node_until(&bed, "worker-1", "Node initialised", initialised).await;

    bed.sim
        .create_host("harvester-2", Some("region-b"), Some("zone-2"))
        .await
        .expect("host 2");
    bed.sim
        .migrate_vm("worker-1", "harvester-2")
        .await
        .expect("migrate");
    let node = node_until(&bed, "worker-1", "labels of harvester-2", |n| {
        n.as_ref()
            .filter(|n| label(n, TOPOLOGY_ZONE) == Some("zone-2"))
            .cloned()
    })
    .await;
    assert_eq!(label(&node, TOPOLOGY_REGION), Some("region-b"));
    assert_eq!(label(&node, FAILURE_DOMAIN_REGION), Some("region-b"));
    assert_eq!(label(&node, FAILURE_DOMAIN_ZONE), Some("zone-2"));
    assert!(
        taint_keys(&node).is_empty(),
        "no re-taint: {:?}",
        taint_keys(&node)
    );
    event_until(&bed, "worker-1", "Normal", "TopologyUpdated").await;
    stop(ccm).await;
}

/// A VM whose guest hostname differs from the VM name (upstream #4947, #11580): the Node is found
/// by hostname, and migration relabels that Node, not one named like the VMI.
#[tokio::test]
async fn node_with_a_custom_hostname_is_initialised_and_follows_migration() {
    let bed = bed().await;
    let (_, uid) = vm_on_host_1(&bed, "vm-7f3a", &["10.52.0.17"]).await;
    let vmis: Api<VirtualMachineInstance> =
        Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    vmis.patch(
        "vm-7f3a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"hostname": "db-0"}})),
    )
    .await
    .expect("set the guest hostname");
    bed.sim.create_guest_node("db-0").await.expect("node");
    let ccm = start_ccm(&bed, &[]);
    let node = node_until(&bed, "db-0", "Node db-0 initialised", initialised).await;
    assert_eq!(
        node.spec.as_ref().and_then(|s| s.provider_id.clone()),
        Some(format!("harvester://{uid}"))
    );
    assert_eq!(addresses(&node), ["InternalIP=10.52.0.17", "Hostname=db-0"]);

    bed.sim
        .create_host("harvester-2", Some("region-a"), Some("zone-2"))
        .await
        .expect("host 2");
    bed.sim
        .migrate_vm("vm-7f3a", "harvester-2")
        .await
        .expect("migrate");
    node_until(&bed, "db-0", "db-0 in zone-2", |n| {
        n.as_ref()
            .filter(|n| label(n, TOPOLOGY_ZONE) == Some("zone-2"))
            .cloned()
    })
    .await;
    assert!(
        nodes(&bed).get_opt("vm-7f3a").await.expect("get").is_none(),
        "no Node named like the VMI was made"
    );
    stop(ccm).await;
}

#[tokio::test]
async fn deleting_the_vm_deletes_the_node() {
    let bed = bed().await;
    vm_on_host_1(&bed, "worker-1", &["10.52.0.11"]).await;
    bed.sim.create_guest_node("worker-1").await.expect("node");
    let ccm = start_ccm(&bed, &[]);
    node_until(&bed, "worker-1", "Node initialised", initialised).await;

    bed.sim.delete_vm("worker-1").await.expect("delete vm");
    node_until(&bed, "worker-1", "Node deleted", |n| {
        n.is_none().then_some(())
    })
    .await;
    event_until(&bed, "worker-1", "Normal", "DeletingNode").await;
    stop(ccm).await;
}

#[tokio::test]
async fn stopping_the_vm_taints_the_node_shutdown_and_starting_it_removes_the_taint() {
    let bed = bed().await;
    let (spec, _) = vm_on_host_1(&bed, "worker-1", &["10.52.0.11"]).await;
    bed.sim.create_guest_node("worker-1").await.expect("node");
    let ccm = start_ccm(&bed, &[]);
    node_until(&bed, "worker-1", "Node initialised", initialised).await;

    bed.sim.stop_vm("worker-1").await.expect("stop");
    let node = node_until(&bed, "worker-1", "shutdown taint", |n| {
        n.as_ref()
            .filter(|n| taint_keys(n).iter().any(|k| k == SHUTDOWN_TAINT))
            .cloned()
    })
    .await;
    let taint = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .and_then(|t| t.iter().find(|t| t.key == SHUTDOWN_TAINT).cloned())
        .expect("taint");
    assert_eq!(taint.effect, "NoSchedule");
    assert_eq!(
        addresses(&node),
        ["InternalIP=10.52.0.11", "Hostname=worker-1"],
        "kept"
    );

    bed.sim.start_vm(&spec).await.expect("start");
    let node = node_until(&bed, "worker-1", "shutdown taint removed", |n| {
        n.as_ref().filter(|n| taint_keys(n).is_empty()).cloned()
    })
    .await;
    assert_eq!(
        label(&node, TOPOLOGY_ZONE),
        Some("zone-1"),
        "the Node stays"
    );
    stop(ccm).await;
}

#[tokio::test]
async fn node_without_a_vm_gets_a_warning_event_and_stays() {
    let bed = bed().await;
    // A Node that the CCM initialises and then deletes with its VM: proof that the lifecycle
    // controller has been over the Nodes while the orphan stays.
    vm_on_host_1(&bed, "worker-2", &["10.52.0.12"]).await;
    bed.sim.create_guest_node("worker-2").await.expect("node 2");
    bed.sim.create_guest_node("orphan-1").await.expect("orphan");
    let ccm = start_ccm(&bed, &["--node-status-update-frequency", "1s"]);

    let warning = event_until(&bed, "orphan-1", "Warning", "VirtualMachineNotFound").await;
    let note = warning.note.unwrap_or_default();
    assert!(
        note.contains("orphan-1") && note.contains(&bed.vm_namespace),
        "the Event names the Node and the namespace: {note}"
    );

    node_until(&bed, "worker-2", "worker-2 initialised", initialised).await;
    bed.sim.delete_vm("worker-2").await.expect("delete vm");
    node_until(&bed, "worker-2", "worker-2 deleted", |n| {
        n.is_none().then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await; // three more resyncs

    let orphan = nodes(&bed)
        .get_opt("orphan-1")
        .await
        .expect("get")
        .expect("the Node without a VM stays");
    assert_eq!(
        taint_keys(&orphan),
        [UNINITIALIZED_TAINT],
        "still uninitialised"
    );
    assert_eq!(
        orphan.spec.as_ref().and_then(|s| s.provider_id.clone()),
        None
    );
    stop(ccm).await;
}

#[tokio::test]
async fn vm_without_guest_agent_addresses_gets_an_event_naming_qemu_guest_agent() {
    let bed = bed().await;
    vm_on_host_1(&bed, "worker-1", &[]).await;
    bed.sim.create_guest_node("worker-1").await.expect("node");
    let ccm = start_ccm(&bed, &[]);

    let warning = event_until(&bed, "worker-1", "Warning", "NoGuestAgentAddresses").await;
    let note = warning.note.unwrap_or_default();
    for says in ["qemu-guest-agent", "v0.6.3", "cloud-init"] {
        assert!(note.contains(says), "the Event says {says:?}: {note}");
    }
    let node = nodes(&bed).get("worker-1").await.expect("node");
    assert_eq!(
        taint_keys(&node),
        [UNINITIALIZED_TAINT],
        "not initialised without addresses"
    );

    // The agent starts reporting: the VMI change initialises the Node.
    let vmis = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    update_vmi(&vmis, "worker-1", |vmi| {
        if let Some(s) = vmi.status.as_mut() {
            s.interfaces[0].ip_addresses = vec!["10.52.0.11".into()];
        }
    })
    .await
    .expect("update vmi");
    let node = node_until(&bed, "worker-1", "Node initialised", initialised).await;
    assert_eq!(
        addresses(&node),
        ["InternalIP=10.52.0.11", "Hostname=worker-1"]
    );
    stop(ccm).await;
}

#[tokio::test]
async fn addresses_follow_the_vmi_after_initialisation() {
    let bed = bed().await;
    vm_on_host_1(&bed, "worker-1", &["10.52.0.11"]).await;
    bed.sim.create_guest_node("worker-1").await.expect("node");
    let ccm = start_ccm(&bed, &[]);
    node_until(&bed, "worker-1", "Node initialised", initialised).await;

    let vmis = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    update_vmi(&vmis, "worker-1", |vmi| {
        if let Some(s) = vmi.status.as_mut() {
            s.interfaces[0].ip_addresses = vec!["10.52.0.21".into(), "10.52.0.22".into()];
        }
    })
    .await
    .expect("update vmi");
    node_until(&bed, "worker-1", "new addresses", |n| {
        n.as_ref()
            .filter(|n| {
                addresses(n)
                    == [
                        "InternalIP=10.52.0.21",
                        "ExternalIP=10.52.0.22",
                        "Hostname=worker-1",
                    ]
            })
            .cloned()
    })
    .await;
    stop(ccm).await;
}

/// The node-side write log against the real API server: both writes of an initialisation are
/// recorded from the versions the server answered, so a reconcile that still sees the registered
/// Node (or the one after the status patch) waits for the watch instead of writing again, and the
/// version the watch brings last clears it.
#[tokio::test]
async fn node_writes_are_logged_until_the_cache_shows_the_last_one() {
    let bed = bed().await;
    let registered = bed.sim.create_guest_node("worker-1").await.expect("node");
    let registered_rv = registered.resource_version();
    let change = NodeChange {
        provider_id: Some("harvester://0f0e0d0c".into()),
        remove_taints: vec![UNINITIALIZED_TAINT.into()],
        addresses: Some(vec![NodeAddress {
            type_: "InternalIP".into(),
            address: "10.52.0.11".into(),
        }]),
        ..Default::default()
    };
    let log = WriteLog::default();
    patch::apply(&bed.guest.client, &log, &registered, &change)
        .await
        .expect("both patches are accepted");

    let written = nodes(&bed).get("worker-1").await.expect("node");
    assert!(
        taint_keys(&written).is_empty(),
        "{}",
        summary(&Some(written.clone()))
    );
    assert_eq!(
        written.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
        Some("harvester://0f0e0d0c")
    );
    assert_eq!(addresses(&written), ["InternalIP=10.52.0.11"]);
    // The versions the watch brings after the registered one: the status patch's, then the
    // spec patch's.
    let watch = nodes(&bed)
        .watch(
            &WatchParams::default().fields("metadata.name=worker-1"),
            registered_rv.as_deref().unwrap_or("0"),
        )
        .await
        .expect("watch")
        .filter_map(|e| async move {
            match e {
                Ok(WatchEvent::Modified(n)) => n.resource_version(),
                _ => None,
            }
        })
        .take(2)
        .collect::<Vec<String>>();
    let seen = tokio::time::timeout(LIMIT, watch)
        .await
        .expect("the two writes' watch events arrive");
    assert_eq!(seen.len(), 2, "two writes, two watch events: {seen:?}");
    assert_eq!(seen[1], written.resource_version().unwrap_or_default());
    let key = node_key("worker-1");
    for rv in [&registered_rv, &Some(seen[0].clone()), &registered_rv] {
        assert!(
            log.behind(&key, rv.as_deref()),
            "a cache at {rv:?} is behind the writes ({seen:?})"
        );
    }
    assert!(
        !log.behind(&key, Some(seen[1].as_str())),
        "the version of the last write is not behind"
    );
    assert!(
        !log.behind(&key, Some(seen[0].as_str())),
        "seeing the last write ended the entry"
    );
}
