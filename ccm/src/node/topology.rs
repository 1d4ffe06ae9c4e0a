//! topology controller: keeps `topology.kubernetes.io/region` and `/zone` of initialised guest
//! Nodes equal to the Harvester host their VM runs on, so they follow a live migration.
//!
//! ```text
//! reconcile(node):
//!     vmi      = the Node's VMI (by providerID, name or guest hostname: inventory)
//!     topology = VMI annotations (Harvester copies them from the host), else the host's labels
//!     change   = plan(node, vmi, topology)   // labels to set or remove
//!     patch labels
//! ```
//!
//! Upstream re-taints the Node `uninitialized` and lets the framework re-initialise it, and taints
//! the Node named like the VMI, not the guest's node (bug #11580). Here the labels are patched
//! directly on the Node the VMI resolves to.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use harvester_common::harvester::{
    FAILURE_DOMAIN_REGION, FAILURE_DOMAIN_ZONE, TOPOLOGY_REGION, TOPOLOGY_ZONE,
    VirtualMachineInstance,
};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use crate::context::Shutdown;
use crate::error::Error;
use crate::node::inventory::{Lookup, is_ours};
use crate::node::patch::{self, NodeChange, UNINITIALIZED_TAINT, has_taint};
use crate::node::{NodeCtx, run_node_controller, start_node_controller};

/// Log and metrics name; enabled with the cloud-node controller unless `--disable-vmi-controller`.
pub const NAME: &str = "topology";
const ACTION: &str = "SyncTopology";

/// Region and zone of a Harvester host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    pub region: Option<String>,
    pub zone: Option<String>,
}

impl Topology {
    /// From the VMI's annotations; `None` when Harvester put neither there (then the VMI's
    /// topology is unknown, which is not the same as "no zone").
    pub fn from_annotations(vmi: &VirtualMachineInstance) -> Option<Topology> {
        let a = vmi.annotations();
        let t = Topology {
            region: a.get(TOPOLOGY_REGION).cloned(),
            zone: a.get(TOPOLOGY_ZONE).cloned(),
        };
        (t != Topology::default()).then_some(t)
    }

    pub fn from_labels(labels: &BTreeMap<String, String>) -> Topology {
        Topology {
            region: labels.get(TOPOLOGY_REGION).cloned(),
            zone: labels.get(TOPOLOGY_ZONE).cloned(),
        }
    }

    /// The label writes that make `node` carry this topology (a missing value removes the label),
    /// on the `topology.kubernetes.io/*` labels and their deprecated `failure-domain.beta.*`
    /// twins alike, so that both always agree (as k8s.io/cloud-provider's node controller keeps them).
    pub fn label_changes(&self, node: &Node) -> BTreeMap<String, Option<String>> {
        let labels = node.labels();
        [
            (TOPOLOGY_REGION, &self.region),
            (FAILURE_DOMAIN_REGION, &self.region),
            (TOPOLOGY_ZONE, &self.zone),
            (FAILURE_DOMAIN_ZONE, &self.zone),
        ]
        .into_iter()
        .filter(|(k, want)| labels.get(*k) != want.as_ref())
        .map(|(k, want)| (k.to_string(), want.clone()))
        .collect()
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "region {}, zone {}",
            self.region.as_deref().unwrap_or("(none)"),
            self.zone.as_deref().unwrap_or("(none)")
        )
    }
}

/// Whether a live migration of the VMI is under way (its topology is about to change).
pub fn migrating(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.rest.get("migrationState"))
        .is_some_and(|m| m.get("completed").and_then(|c| c.as_bool()) != Some(true))
}

/// The labels an initialised Node needs to match its VMI's host. Pure.
pub fn plan(node: &Node, vmi: &VirtualMachineInstance, topology: Option<&Topology>) -> NodeChange {
    let Some(topology) = topology else {
        return NodeChange::default();
    };
    if has_taint(node, UNINITIALIZED_TAINT) || !is_ours(node) || migrating(vmi) {
        return NodeChange::default();
    }
    NodeChange {
        labels: topology.label_changes(node),
        ..Default::default()
    }
}

/// The topology of the VMI's host: its annotations, else the host Node's labels when Harvester
/// lets us read host Nodes; `None` when unknown.
pub async fn observe(
    nctx: &NodeCtx,
    vmi: &VirtualMachineInstance,
) -> Result<Option<Topology>, Error> {
    if let Some(t) = Topology::from_annotations(vmi) {
        return Ok(Some(t));
    }
    let Some(host) = vmi.status.as_ref().and_then(|s| s.node_name.as_deref()) else {
        return Ok(None);
    };
    if !nctx.host_reads.load(Ordering::Relaxed) {
        return Ok(None);
    }
    let hosts: Api<Node> = Api::all(nctx.ctx.harvester.clone());
    match hosts.get_opt(host).await {
        Ok(Some(h)) => Ok(Some(Topology::from_labels(h.labels()))),
        Ok(None) => Ok(None),
        Err(kube::Error::Api(s)) if s.code == 401 || s.code == 403 => {
            nctx.host_reads.store(false, Ordering::Relaxed);
            tracing::info!(
                "Harvester does not let the cloud provider read host Nodes ({}); topology comes from VMI annotations only",
                s.message
            );
            Ok(None)
        }
        Err(e) => Err(Error::harvester(format!(
            "getting Harvester host Node {host}"
        ))(e)),
    }
}

pub async fn run(nctx: Arc<NodeCtx>, shutdown: Shutdown) {
    let config = &nctx.ctx.config;
    let enabled = config
        .controllers
        .enabled(crate::config::CLOUD_NODE_CONTROLLER)
        && config.node.topology;
    let Some(controller) = start_node_controller(&nctx, NAME, enabled, shutdown).await else {
        return;
    };
    let inv = nctx.inventory.clone();
    let t = nctx.triggers(NAME);
    let controller = controller.watches_shared_stream(nctx.inventory.vmi_events(), move |vmi| {
        t.note("vmi", inv.nodes_for_vmi(&vmi))
    });
    run_node_controller(nctx, NAME, controller, reconcile).await;
}

async fn reconcile(node: Arc<Node>, nctx: Arc<NodeCtx>) -> Result<Action, Error> {
    nctx.reconcile(NAME, ACTION, &node, sync(&node, &nctx))
        .await
}

async fn sync(node: &Node, nctx: &NodeCtx) -> Result<Action, Error> {
    if has_taint(node, UNINITIALIZED_TAINT) || !is_ours(node) {
        return Ok(Action::await_change());
    }
    let Lookup::Found { vmi: Some(vmi), .. } = nctx.inventory.lookup(node).await? else {
        return Ok(Action::await_change());
    };
    let topology = observe(nctx, &vmi).await?;
    let change = plan(node, &vmi, topology.as_ref());
    if change.is_empty() {
        return Ok(Action::await_change());
    }
    patch::apply(&nctx.ctx.guest, &nctx.written, node, &change).await?;
    if let Some(t) = topology {
        let host = vmi
            .status
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .unwrap_or("?");
        let note = format!("VM {} runs on Harvester host {host}: {t}", vmi.name_any());
        tracing::info!(node = %node.name_any(), "{note}");
        nctx.event(node, EventType::Normal, "TopologyUpdated", ACTION, note);
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn node(labels: Value, taints: Value, provider_id: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "w1", "labels": labels},
            "spec": {"providerID": provider_id, "taints": taints}
        }))
        .expect("test node")
    }

    fn vmi(annotations: Value, migration: Option<Value>) -> VirtualMachineInstance {
        let mut status = json!({"nodeName": "h2"});
        if let Some(m) = migration {
            status["migrationState"] = m;
        }
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm-1", "annotations": annotations},
            "spec": {}, "status": status
        }))
        .expect("test vmi")
    }

    fn labels(change: &NodeChange) -> Vec<(String, Option<String>)> {
        change.labels.clone().into_iter().collect()
    }

    /// (what, Node, VMI, expected label writes)
    type Row = (
        &'static str,
        Node,
        VirtualMachineInstance,
        Vec<(String, Option<String>)>,
    );

    /// Node labels: region and zone, under both the GA keys and their deprecated twins.
    fn both(region: &str, zone: &str) -> Value {
        json!({TOPOLOGY_REGION: region, FAILURE_DOMAIN_REGION: region,
               TOPOLOGY_ZONE: zone, FAILURE_DOMAIN_ZONE: zone})
    }

    #[test]
    fn topology_plan() {
        let z1 = both("r1", "z1");
        let a1 = json!({TOPOLOGY_REGION: "r1", TOPOLOGY_ZONE: "z1"});
        let a2 = json!({TOPOLOGY_REGION: "r1", TOPOLOGY_ZONE: "z2"});
        let ours = "harvester://u1";
        let uninit = json!([{"key": UNINITIALIZED_TAINT, "effect": "NoSchedule"}]);
        let s = |v: &str| Some(v.to_string());
        let zone = |v: Option<String>| {
            vec![
                (FAILURE_DOMAIN_ZONE.into(), v.clone()),
                (TOPOLOGY_ZONE.into(), v),
            ]
        };
        #[rustfmt::skip]
        let table: Vec<Row> = vec![
            ("host changed zone: both zone labels follow",
             node(z1.clone(), json!([]), ours), vmi(a2.clone(), Some(json!({"completed": true}))),
             zone(s("z2"))),
            ("same topology: nothing",
             node(both("r1", "z2"), json!([]), ours), vmi(a2.clone(), None),
             vec![]),
            ("region and zone both follow, GA and deprecated keys alike",
             node(z1.clone(), json!([]), ours), vmi(json!({TOPOLOGY_REGION: "r2", TOPOLOGY_ZONE: "z9"}), None),
             vec![(FAILURE_DOMAIN_REGION.into(), s("r2")), (FAILURE_DOMAIN_ZONE.into(), s("z9")),
                  (TOPOLOGY_REGION.into(), s("r2")), (TOPOLOGY_ZONE.into(), s("z9"))]),
            ("Node with the GA labels only: the deprecated twins are added",
             node(a1.clone(), json!([]), ours), vmi(a1.clone(), None),
             vec![(FAILURE_DOMAIN_REGION.into(), s("r1")), (FAILURE_DOMAIN_ZONE.into(), s("z1"))]),
            ("host lost its zone label: Harvester dropped the annotation, both labels go",
             node(z1.clone(), json!([]), ours), vmi(json!({TOPOLOGY_REGION: "r1"}), None),
             zone(None)),
            ("VMI without topology annotations: labels left alone",
             node(z1.clone(), json!([]), ours), vmi(json!({}), None),
             vec![]),
            ("migration in flight: wait for it to complete",
             node(z1.clone(), json!([]), ours), vmi(a2.clone(), Some(json!({"completed": false}))),
             vec![]),
            ("uninitialised Node: the node controller's job",
             node(z1.clone(), uninit, ours), vmi(a2.clone(), None),
             vec![]),
            ("Node of another provider: left alone",
             node(z1.clone(), json!([]), "aws:///i-1"), vmi(a2.clone(), None),
             vec![]),
        ];
        for (what, n, v, want) in table {
            let t = Topology::from_annotations(&v);
            assert_eq!(labels(&plan(&n, &v, t.as_ref())), want, "{what}");
        }
    }

    #[test]
    fn topology_from_host_labels() {
        let host = BTreeMap::from([
            (TOPOLOGY_ZONE.to_string(), "z3".to_string()),
            ("other".to_string(), "x".to_string()),
        ]);
        let t = Topology::from_labels(&host);
        assert_eq!(
            t,
            Topology {
                region: None,
                zone: Some("z3".into())
            }
        );
        assert_eq!(t.to_string(), "region (none), zone z3");
    }
}
