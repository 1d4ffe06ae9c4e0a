//! Fault test: a KubeVirt VirtualMachine and VirtualMachineInstance in the VM namespace that the
//! provider's types cannot read (`status.ready` a string instead of a bool, `status.interfaces` a
//! string instead of a list). Real KubeVirt's schema refuses such a write, so they are put straight
//! into etcd, as a KubeVirt upgrade, a restore or a hand edit of storage could leave them. The
//! node-side controllers must ignore the bad fields with a log line naming the objects, and keep
//! initialising the other Nodes, following their migrations and tainting a stopped VM's Node:
//! when the objects are there as the provider starts and lists, and when they arrive in its
//! running watches.

use testbed::suites::chaos as common;

use std::time::Duration;

use common::{LIMIT, bed, etcd_put, start_provider};
use harvester_cloud_provider::node::patch::{SHUTDOWN_TAINT, UNINITIALIZED_TAINT};
use harvester_common::harvester::TOPOLOGY_ZONE;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;
use testbed::sim::GuestVm;
use testbed::{TestBed, util::wait};

const BAD: &str = "bad-1";

fn kubevirt(bed: &TestBed, kind: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("kubevirt.io", "v1", kind));
    Api::namespaced_with(bed.harvester.client.clone(), &bed.vm_namespace, &ar)
}

/// Hosts h1 (zone z1) and h2 (zone z2).
async fn hosts(bed: &TestBed) {
    for (h, z) in [("h1", "z1"), ("h2", "z2")] {
        bed.sim
            .create_host(h, Some("r1"), Some(z))
            .await
            .expect("host");
    }
}

/// A running VM on h1 and its guest Node (tainted uninitialized, as kubelet registers it).
async fn guest(bed: &TestBed, name: &str, ip: &str) -> GuestVm {
    let spec = GuestVm::new(name).on_host("h1").ip(ip);
    bed.sim.create_vm(&spec).await.expect("vm");
    bed.sim.create_guest_node(name).await.expect("node");
    spec
}

/// VM and VMI `bad-1`, made valid by the stand-in, then overwritten in etcd with a string where
/// our types want a bool (VM `status.ready`) and a list (VMI `status.interfaces`).
async fn plant_malformed(bed: &TestBed) {
    bed.sim
        .create_vm(&GuestVm::new(BAD).on_host("h1").ip("10.60.0.99"))
        .await
        .expect("vm bad-1");
    for (kind, plural, field, value) in [
        ("VirtualMachine", "virtualmachines", "ready", json!("yes")),
        (
            "VirtualMachineInstance",
            "virtualmachineinstances",
            "interfaces",
            json!("oops"),
        ),
    ] {
        let api = kubevirt(bed, kind);
        let obj = api.get(BAD).await.expect("get the object to break");
        let mut raw = serde_json::to_value(&obj).unwrap();
        raw["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("resourceVersion");
        raw["status"][field] = value.clone();
        let key = format!("/harvester/kubevirt.io/{plural}/{}/{BAD}", bed.vm_namespace);
        etcd_put(&bed.etcd.url, &key, raw.to_string().as_bytes());
        wait::until(
            &format!("kube-apiserver serves the malformed {kind}"),
            LIMIT,
            || {
                let api = api.clone();
                let value = value.clone();
                async move {
                    let obj = api.get(BAD).await.map_err(|e| e.to_string())?;
                    let got = obj.data["status"][field].clone();
                    Ok(if got == value { Ok(()) } else { Err(got) })
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

fn taint_keys(node: &Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|t| t.iter().map(|t| t.key.clone()).collect())
        .unwrap_or_default()
}

/// Waits until `check` accepts Node `name`.
async fn node_until(bed: &TestBed, name: &str, what: &str, check: impl Fn(&Node) -> bool) {
    let api: Api<Node> = Api::all(bed.guest.client.clone());
    let check = &check;
    wait::until(&format!("Node {name}: {what}"), LIMIT, || {
        let api = api.clone();
        async move {
            let node = api.get(name).await.map_err(|e| e.to_string())?;
            Ok(if check(&node) {
                Ok(())
            } else {
                Err(format!(
                    "taints {:?}, labels {:?}",
                    taint_keys(&node),
                    node.labels()
                ))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

async fn initialised(bed: &TestBed, name: &str) {
    node_until(bed, name, "initialised", |n| {
        !taint_keys(n).iter().any(|k| k == UNINITIALIZED_TAINT)
            && n.spec
                .as_ref()
                .and_then(|s| s.provider_id.as_ref())
                .is_some()
    })
    .await;
}

/// The other Nodes keep being served: `moving` follows a migration to h2 (zone z2), `stopping`
/// gets the shutdown taint when its VM stops.
async fn others_keep_reconciling(bed: &TestBed, moving: &str, stopping: &str) {
    bed.sim.migrate_vm(moving, "h2").await.expect("migrate");
    node_until(bed, moving, "zone z2 after migration", |n| {
        n.labels().get(TOPOLOGY_ZONE).map(String::as_str) == Some("z2")
    })
    .await;
    bed.sim.stop_vm(stopping).await.expect("stop");
    node_until(bed, stopping, "shutdown taint", |n| {
        taint_keys(n).iter().any(|k| k == SHUTDOWN_TAINT)
    })
    .await;
}

/// The provider's log names both objects it could not fully read.
fn assert_logged(log: &std::path::Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    for kind in ["VirtualMachine ", "VirtualMachineInstance "] {
        assert!(
            text.lines().any(|l| l.contains(kind) && l.contains(BAD)),
            "the provider's log names the {kind}{BAD} it cannot read:\n{}",
            testbed::util::process::tail(log, 30)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_vm_and_vmi_present_at_start_do_not_stop_the_node_controllers() {
    let bed = bed().await;
    hosts(&bed).await;
    plant_malformed(&bed).await;
    guest(&bed, "worker-1", "10.60.0.11").await;
    guest(&bed, "worker-2", "10.60.0.12").await;

    let ccm = start_provider(&bed, "ccm");
    initialised(&bed, "worker-1").await;
    initialised(&bed, "worker-2").await;
    others_keep_reconciling(&bed, "worker-1", "worker-2").await;
    assert_logged(&ccm.log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_vm_and_vmi_arriving_in_the_watch_do_not_stop_the_node_controllers() {
    let bed = bed().await;
    hosts(&bed).await;
    guest(&bed, "worker-1", "10.60.0.11").await;
    let ccm = start_provider(&bed, "ccm");
    initialised(&bed, "worker-1").await;

    plant_malformed(&bed).await;
    // Let the watches deliver them before anything else changes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    guest(&bed, "worker-2", "10.60.0.12").await;
    initialised(&bed, "worker-2").await;
    others_keep_reconciling(&bed, "worker-2", "worker-1").await;
    assert_logged(&ccm.log);
}
