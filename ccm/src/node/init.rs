//! node controller (upstream's `cloud-node-controller`): initialises guest Nodes from their VMs
//! and keeps their addresses true.
//!
//! ```text
//! reconcile(node):
//!     vm, vmi  = the Node's VM and VMI (inventory: providerID, name, guest hostname)
//!     topology = the VMI's host region/zone (topology::observe)
//!     change   = plan(node, vm, vmi, topology, address rules)
//!         tainted uninitialized: providerID (if empty), addresses, region/zone, remove the taint
//!         initialised:           addresses, when the VMI reports others
//!     patch the Node (patch::apply)
//! ```
//!
//! A Node is only initialised once everything is known: its VM, a running VMI and at least one
//! usable address. Until then it keeps the taint and gets a Warning Event saying what is missing
//! (upstream removes the taint with a Hostname-only address list when the guest agent reports
//! nothing, leaving a schedulable Node that kubectl logs/exec cannot reach).

use std::collections::BTreeMap;
use std::sync::Arc;

use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use crate::config::addresses::AddressRules;
use crate::context::Shutdown;
use crate::error::Error;
use crate::node::addresses::node_addresses;
use crate::node::inventory::{Lookup, is_ours, provider_id};
use crate::node::patch::{self, NodeChange, UNINITIALIZED_TAINT, addresses, has_taint};
use crate::node::topology::{self, Topology};
use crate::node::{NodeCtx, run_node_controller, start_node_controller};

pub const NAME: &str = crate::config::CLOUD_NODE_CONTROLLER;
const ACTION: &str = "InitializeNode";

/// The change that initialises `node` from its VM (or, once initialised, refreshes its
/// addresses). Pure.
pub fn plan(
    node: &Node,
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    topology: Option<&Topology>,
    rules: &AddressRules,
) -> Result<NodeChange, Error> {
    let initialising = has_taint(node, UNINITIALIZED_TAINT);
    if !initialising && !is_ours(node) {
        return Ok(NodeChange::default());
    }
    let namespace = vm.namespace().unwrap_or_default();
    let Some(vmi) = vmi else {
        return if initialising {
            Err(Error::VmNotRunning {
                namespace,
                vm: vm.name_any(),
            })
        } else {
            // A stopped VM is the lifecycle controller's business; keep the last addresses.
            Ok(NodeChange::default())
        };
    };
    let empty = BTreeMap::new();
    let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
    let want = node_addresses(&node.name_any(), annotations, vmi, rules).map_err(|source| {
        Error::Addresses {
            namespace: namespace.clone(),
            vm: vm.name_any(),
            source,
        }
    })?;
    let mut change = NodeChange::default();
    if addresses(node) != want.as_slice() {
        change.addresses = Some(want);
    }
    if initialising {
        let has_provider_id = node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.as_deref())
            .is_some_and(|p| !p.is_empty());
        if !has_provider_id {
            let uid = vm.uid().ok_or_else(|| Error::VmWithoutUid {
                namespace: namespace.clone(),
                vm: vm.name_any(),
            })?;
            change.provider_id = Some(provider_id(&uid));
        }
        if let Some(t) = topology {
            change.labels = t.label_changes(node);
        }
        change.remove_taints.push(UNINITIALIZED_TAINT.to_string());
    }
    Ok(change)
}

pub async fn run(nctx: Arc<NodeCtx>, shutdown: Shutdown) {
    let enabled = nctx.ctx.config.controllers.enabled(NAME);
    let Some(controller) = start_node_controller(&nctx, NAME, enabled, shutdown).await else {
        return;
    };
    let (a, b) = (nctx.inventory.clone(), nctx.inventory.clone());
    let (ta, tb) = (nctx.triggers(NAME), nctx.triggers(NAME));
    let controller = controller
        .watches_shared_stream(nctx.inventory.vm_events(), move |vm| {
            ta.note("vm", a.nodes_for_vm(&vm))
        })
        .watches_shared_stream(nctx.inventory.vmi_events(), move |vmi| {
            tb.note("vmi", b.nodes_for_vmi(&vmi))
        });
    run_node_controller(nctx, NAME, controller, reconcile).await;
}

async fn reconcile(node: Arc<Node>, nctx: Arc<NodeCtx>) -> Result<Action, Error> {
    nctx.reconcile(NAME, ACTION, &node, sync(&node, &nctx))
        .await
}

async fn sync(node: &Node, nctx: &NodeCtx) -> Result<Action, Error> {
    let initialising = has_taint(node, UNINITIALIZED_TAINT);
    if !initialising && !is_ours(node) {
        return Ok(Action::await_change());
    }
    let (vm, vmi) = match nctx.inventory.lookup(node).await? {
        Lookup::Found { vm, vmi } => (vm, vmi),
        Lookup::Absent if initialising => {
            return Err(Error::VmNotFound {
                namespace: nctx.inventory.namespace().to_string(),
                node: node.name_any(),
            });
        }
        // An initialised Node whose VM is gone: the lifecycle controller deletes it.
        Lookup::Absent => return Ok(Action::await_change()),
    };
    let topology = match (&vmi, initialising) {
        (Some(vmi), true) => topology::observe(nctx, vmi).await?,
        _ => None,
    };
    let change = plan(
        node,
        &vm,
        vmi.as_deref(),
        topology.as_ref(),
        &nctx.ctx.config.node.addresses,
    )?;
    if change.is_empty() {
        return Ok(Action::await_change());
    }
    patch::apply(&nctx.ctx.guest, &nctx.written, node, &change).await?;
    if initialising {
        let note = describe(&vm, &change);
        tracing::info!(node = %node.name_any(), "initialised: {note}");
        nctx.event(node, EventType::Normal, "Initialized", ACTION, note);
    }
    Ok(Action::await_change())
}

fn describe(vm: &VirtualMachine, change: &NodeChange) -> String {
    let addresses = change
        .addresses
        .iter()
        .flatten()
        .map(|a| format!("{}={}", a.type_, a.address))
        .collect::<Vec<_>>()
        .join(", ");
    let labels = change
        .labels
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_deref().unwrap_or("(removed)")))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "from VM {}/{}: providerID {}, addresses [{addresses}], labels [{labels}]",
        vm.namespace().unwrap_or_default(),
        vm.name_any(),
        change.provider_id.as_deref().unwrap_or("(kept)"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use harvester_common::harvester::{
        FAILURE_DOMAIN_REGION, FAILURE_DOMAIN_ZONE, TOPOLOGY_REGION, TOPOLOGY_ZONE,
    };
    use serde_json::{Value, json};

    fn node(spec: Value, status: Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "worker-1", "resourceVersion": "5",
                         "annotations": {}, "labels": {"kubernetes.io/hostname": "worker-1"}},
            "spec": spec, "status": status
        }))
        .expect("test node")
    }

    fn tainted() -> Node {
        node(
            json!({"taints": [{"key": UNINITIALIZED_TAINT, "value": "true", "effect": "NoSchedule"}]}),
            json!({}),
        )
    }

    fn vm() -> VirtualMachine {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "worker-1", "namespace": "guest-vms", "uid": "uid-1"},
            "spec": {}
        }))
        .expect("test vm")
    }

    fn vmi(ips: &[&str]) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "worker-1", "namespace": "guest-vms",
                         "annotations": {TOPOLOGY_REGION: "region-a", TOPOLOGY_ZONE: "zone-1"}},
            "spec": {"networks": [{"name": "nic-1", "multus": {"networkName": "default/mgmt"}}]},
            "status": {"nodeName": "h1", "interfaces": [{"name": "nic-1", "ipAddresses": ips}]}
        }))
        .expect("test vmi")
    }

    fn rules() -> AddressRules {
        AddressRules {
            use_node_annotations: true,
            ..Default::default()
        }
    }

    fn run(node: &Node, vmi: Option<&VirtualMachineInstance>) -> Result<NodeChange, Error> {
        let topology = vmi.and_then(Topology::from_annotations);
        plan(node, &vm(), vmi, topology.as_ref(), &rules())
    }

    fn addrs(change: &NodeChange) -> Vec<String> {
        change
            .addresses
            .iter()
            .flatten()
            .map(|a| format!("{}={}", a.type_, a.address))
            .collect()
    }

    #[test]
    fn tainted_node_gets_everything_and_loses_the_taint() {
        let change = run(&tainted(), Some(&vmi(&["10.52.0.11"]))).expect("plan");
        assert_eq!(change.provider_id.as_deref(), Some("harvester://uid-1"));
        assert_eq!(
            addrs(&change),
            ["InternalIP=10.52.0.11", "Hostname=worker-1"]
        );
        assert_eq!(
            change.labels,
            BTreeMap::from([
                (TOPOLOGY_REGION.to_string(), Some("region-a".to_string())),
                (TOPOLOGY_ZONE.to_string(), Some("zone-1".to_string())),
                (
                    FAILURE_DOMAIN_REGION.to_string(),
                    Some("region-a".to_string())
                ),
                (FAILURE_DOMAIN_ZONE.to_string(), Some("zone-1".to_string())),
            ])
        );
        assert_eq!(change.remove_taints, [UNINITIALIZED_TAINT]);
        assert!(change.add_taints.is_empty());
    }

    #[test]
    fn existing_provider_id_is_kept() {
        let n = node(
            json!({"providerID": "harvester://older", "taints": [{"key": UNINITIALIZED_TAINT, "effect": "NoSchedule"}]}),
            json!({}),
        );
        let change = run(&n, Some(&vmi(&["10.52.0.11"]))).expect("plan");
        assert_eq!(change.provider_id, None);
        assert_eq!(change.remove_taints, [UNINITIALIZED_TAINT]);
    }

    #[test]
    fn tainted_node_waits_for_what_is_missing() {
        let err = run(&tainted(), None).expect_err("no VMI");
        assert_eq!(err.reason(), "VirtualMachineNotRunning");
        let err = run(&tainted(), Some(&vmi(&[]))).expect_err("no addresses");
        assert_eq!(err.reason(), "NoGuestAgentAddresses");
        let text = err.to_string();
        assert!(
            text.contains("guest-vms/worker-1")
                && text.contains("qemu-guest-agent")
                && text.contains("v0.6.3"),
            "{text}"
        );
        let mut bad = tainted();
        bad.metadata.annotations = Some(BTreeMap::from([(
            crate::config::addresses::PROVIDED_NODE_IP.to_string(),
            "10.52.0.99".to_string(),
        )]));
        let err = run(&bad, Some(&vmi(&["10.52.0.11"]))).expect_err("provided IP elsewhere");
        assert_eq!(err.reason(), "ProvidedNodeIPNotFound");
    }

    #[test]
    fn initialised_node_follows_vmi_addresses_only() {
        let n = node(
            json!({"providerID": "harvester://uid-1"}),
            json!({"addresses": [{"type": "InternalIP", "address": "10.52.0.11"}, {"type": "Hostname", "address": "worker-1"}]}),
        );
        assert!(
            run(&n, Some(&vmi(&["10.52.0.11"])))
                .expect("plan")
                .is_empty(),
            "in sync"
        );
        let change = run(&n, Some(&vmi(&["10.52.0.12", "fd00::12"]))).expect("plan");
        assert_eq!(
            addrs(&change),
            [
                "InternalIP=10.52.0.12",
                "InternalIP=fd00::12",
                "Hostname=worker-1"
            ]
        );
        assert_eq!(change.provider_id, None);
        assert!(change.labels.is_empty(), "topology controller's job");
        assert!(change.remove_taints.is_empty());
        assert!(
            run(&n, None).expect("stopped VM").is_empty(),
            "keeps the last addresses"
        );
        let err = run(&n, Some(&vmi(&[]))).expect_err("agent gone");
        assert_eq!(err.reason(), "NoGuestAgentAddresses");
    }

    #[test]
    fn node_of_another_provider_is_left_alone() {
        let n = node(json!({"providerID": "aws:///i-1"}), json!({}));
        assert!(
            run(&n, Some(&vmi(&["10.52.0.11"])))
                .expect("plan")
                .is_empty()
        );
    }
}
