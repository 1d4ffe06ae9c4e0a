//! lifecycle controller (upstream's `cloud-node-lifecycle-controller`): deletes Nodes whose VM is
//! gone, taints Nodes whose VM is stopped.
//!
//! ```text
//! reconcile(node):
//!     vm     = Running | Stopped (status.ready false) | Absent (live GET said 404)
//!     change = plan(node, vm)
//!         Absent, Node initialised by us, Node not Ready -> delete the Node
//!         Stopped, Node not Ready                        -> taint shutdown:NoSchedule
//!         Running, or Node Ready                         -> remove the shutdown taint
//!     apply
//! ```
//!
//! Guards: only a Node that carries our providerID is ever deleted (a Node the cloud provider
//! never initialised, e.g. one whose VM has another name, keeps its Warning Event and stays), an
//! API error is never taken for absence, a Ready Node is never deleted or tainted (as upstream),
//! and the delete carries the Node's UID as precondition.

use std::sync::Arc;

use harvester_common::harvester::VirtualMachine;
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::ResourceExt;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use crate::context::Shutdown;
use crate::error::Error;
use crate::node::inventory::{Lookup, is_ours, provider_uid};
use crate::node::patch::{self, NodeChange, SHUTDOWN_TAINT, has_taint, is_ready};
use crate::node::{NodeCtx, run_node_controller, start_node_controller};

pub const NAME: &str = crate::config::CLOUD_NODE_LIFECYCLE_CONTROLLER;
const ACTION: &str = "NodeLifecycle";

/// The VM of a Node, as far as its lifecycle goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    Running,
    Stopped,
    /// Confirmed absent by the API server.
    Absent,
}

impl VmState {
    pub fn of(vm: &VirtualMachine) -> VmState {
        if vm.status.as_ref().is_some_and(|s| s.ready) {
            VmState::Running
        } else {
            VmState::Stopped
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum LifecycleChange {
    Nothing,
    Delete,
    Update(NodeChange),
}

pub fn shutdown_taint() -> Taint {
    Taint {
        key: SHUTDOWN_TAINT.to_string(),
        effect: "NoSchedule".to_string(),
        ..Default::default()
    }
}

/// What to do with `node` given its VM. Pure.
pub fn plan(node: &Node, vm: VmState) -> LifecycleChange {
    if !is_ours(node) {
        return LifecycleChange::Nothing;
    }
    let tainted = has_taint(node, SHUTDOWN_TAINT);
    let ready = is_ready(node);
    match vm {
        _ if ready && tainted => remove_shutdown_taint(),
        _ if ready => LifecycleChange::Nothing,
        VmState::Absent if provider_uid(node).is_some() => LifecycleChange::Delete,
        VmState::Absent => LifecycleChange::Nothing,
        VmState::Stopped if !tainted => LifecycleChange::Update(NodeChange {
            add_taints: vec![shutdown_taint()],
            ..Default::default()
        }),
        VmState::Running if tainted => remove_shutdown_taint(),
        VmState::Stopped | VmState::Running => LifecycleChange::Nothing,
    }
}

fn remove_shutdown_taint() -> LifecycleChange {
    LifecycleChange::Update(NodeChange {
        remove_taints: vec![SHUTDOWN_TAINT.to_string()],
        ..Default::default()
    })
}

pub async fn run(nctx: Arc<NodeCtx>, shutdown: Shutdown) {
    let enabled = nctx.ctx.config.controllers.enabled(NAME);
    let Some(controller) = start_node_controller(&nctx, NAME, enabled, shutdown).await else {
        return;
    };
    let inv = nctx.inventory.clone();
    let t = nctx.triggers(NAME);
    let controller = controller.watches_shared_stream(nctx.inventory.vm_events(), move |vm| {
        t.note("vm", inv.nodes_for_vm(&vm))
    });
    run_node_controller(nctx, NAME, controller, reconcile).await;
}

async fn reconcile(node: Arc<Node>, nctx: Arc<NodeCtx>) -> Result<Action, Error> {
    nctx.reconcile(NAME, ACTION, &node, sync(&node, &nctx))
        .await
}

async fn sync(node: &Node, nctx: &NodeCtx) -> Result<Action, Error> {
    if !is_ours(node) {
        return Ok(Action::await_change());
    }
    let (state, vm_name) = match nctx.inventory.lookup(node).await? {
        Lookup::Found { vm, .. } => (VmState::of(&vm), vm.name_any()),
        Lookup::Absent => (VmState::Absent, node.name_any()),
    };
    match plan(node, state) {
        LifecycleChange::Nothing => {}
        LifecycleChange::Delete => {
            let note = format!(
                "deleting Node: its VirtualMachine {}/{vm_name} is gone from Harvester",
                nctx.inventory.namespace()
            );
            tracing::info!(node = %node.name_any(), "{note}");
            nctx.event(node, EventType::Normal, "DeletingNode", ACTION, note);
            patch::delete(&nctx.ctx.guest, node).await?;
        }
        LifecycleChange::Update(change) => {
            patch::apply(&nctx.ctx.guest, &nctx.written, node, &change).await?;
            let what = if change.add_taints.is_empty() {
                "removed the shutdown taint: the VM runs"
            } else {
                "tainted shutdown:NoSchedule: the VM is stopped"
            };
            tracing::info!(node = %node.name_any(), vm = %vm_name, "{what}");
        }
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn node(provider_id: Option<&str>, taints: Value, ready: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "w1"},
            "spec": {"providerID": provider_id, "taints": taints},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}
        }))
        .expect("test node")
    }

    #[test]
    fn lifecycle_plan() {
        let ours = Some("harvester://u1");
        let shut = json!([{"key": SHUTDOWN_TAINT, "effect": "NoSchedule"}]);
        let add = LifecycleChange::Update(NodeChange {
            add_taints: vec![shutdown_taint()],
            ..Default::default()
        });
        let remove = remove_shutdown_taint();
        use LifecycleChange::{Delete, Nothing};
        #[rustfmt::skip]
        let table: Vec<(&str, Node, VmState, LifecycleChange)> = vec![
            ("VM gone, Node not Ready: delete", node(ours, json!([]), "Unknown"), VmState::Absent, Delete),
            ("VM gone, Node without conditions: delete", node(ours, json!([]), "False"), VmState::Absent, Delete),
            ("VM gone but Node Ready: keep (as upstream)", node(ours, json!([]), "True"), VmState::Absent, Nothing),
            ("VM gone, never initialised by us: keep", node(None, json!([]), "Unknown"), VmState::Absent, Nothing),
            ("Node of another provider: keep", node(Some("aws:///i-1"), json!([]), "Unknown"), VmState::Absent, Nothing),
            ("VM stopped: taint", node(ours, json!([]), "Unknown"), VmState::Stopped, add.clone()),
            ("VM stopped, never initialised: taint", node(None, json!([]), "Unknown"), VmState::Stopped, add),
            ("VM stopped, already tainted: nothing", node(ours, shut.clone(), "Unknown"), VmState::Stopped, Nothing),
            ("VM stopped but Node Ready: nothing", node(ours, json!([]), "True"), VmState::Stopped, Nothing),
            ("VM runs again: untaint", node(ours, shut.clone(), "Unknown"), VmState::Running, remove.clone()),
            ("Node Ready again: untaint", node(ours, shut.clone(), "True"), VmState::Stopped, remove),
            ("VM runs, no taint: nothing", node(ours, json!([]), "Unknown"), VmState::Running, Nothing),
        ];
        for (what, n, vm, want) in table {
            assert_eq!(plan(&n, vm), want, "{what}");
        }
    }

    #[test]
    fn vm_state_from_status() {
        let vm = |status: Value| -> VirtualMachine {
            serde_json::from_value(json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"name": "w1"}, "spec": {}, "status": status
            }))
            .expect("test vm")
        };
        assert_eq!(VmState::of(&vm(json!({"ready": true}))), VmState::Running);
        assert_eq!(VmState::of(&vm(json!({"ready": false}))), VmState::Stopped);
        assert_eq!(VmState::of(&vm(json!({}))), VmState::Stopped);
    }
}
