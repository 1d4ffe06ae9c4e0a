//! A change to a guest Node, as the plan functions compute it, and how it is written: at most one
//! merge patch of `status.addresses` (a subresource) and one merge patch of labels, providerID
//! and taints, under the field manager [`FIELD_MANAGER`](crate::context::FIELD_MANAGER).
//!
//! Taints are a list that kubelet and admins also write, so a patch that changes them carries the
//! Node's `resourceVersion` (optimistic concurrency: a concurrent change makes it fail with 409 and
//! the reconcile runs again on the fresh Node). Labels are merged key by key; providerID is only
//! ever set when empty; addresses are owned by the cloud provider.
//!
//! Each write is recorded in the node-side [`WriteLog`] under [`node_key`]: until the watch shows
//! it, a reconcile of the Node (any of the three controllers) would plan from the version the
//! write was based on and repeat it (a 409 on the taint guard), so it waits for that watch event
//! instead ([`crate::node::NodeCtx::reconcile`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeAddress, Taint};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use serde_json::{Map, Value, json};

use crate::context::FIELD_MANAGER;
use crate::error::Error;
use crate::written::WriteLog;

/// Kubelet registers Nodes with it under `--cloud-provider=external`; removed once initialised.
pub const UNINITIALIZED_TAINT: &str = "node.cloudprovider.kubernetes.io/uninitialized";
/// Put on a Node whose VM is stopped.
pub const SHUTDOWN_TAINT: &str = "node.cloudprovider.kubernetes.io/shutdown";

#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeChange {
    /// Set when the Node has none (never changed once set).
    pub provider_id: Option<String>,
    /// `Some(v)` sets a label, `None` removes it.
    pub labels: BTreeMap<String, Option<String>>,
    pub add_taints: Vec<Taint>,
    /// Taint keys to remove.
    pub remove_taints: Vec<String>,
    /// The full new `status.addresses`.
    pub addresses: Option<Vec<NodeAddress>>,
}

impl NodeChange {
    pub fn is_empty(&self) -> bool {
        self == &NodeChange::default()
    }

    /// The merge patch of metadata and spec against `node` as it is now; `None` if it would change
    /// nothing.
    pub fn spec_patch(&self, node: &Node) -> Option<Value> {
        let mut metadata = Map::new();
        let mut spec = Map::new();

        let current = node.labels();
        let labels: Map<String, Value> = self
            .labels
            .iter()
            .filter(|(k, v)| current.get(*k) != v.as_ref())
            .map(|(k, v)| (k.clone(), v.clone().map_or(Value::Null, Value::String)))
            .collect();
        if !labels.is_empty() {
            metadata.insert("labels".into(), Value::Object(labels));
        }

        let has_provider_id = node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.as_deref())
            .is_some_and(|p| !p.is_empty());
        if let Some(p) = &self.provider_id
            && !has_provider_id
        {
            spec.insert("providerID".into(), Value::String(p.clone()));
        }

        let before = taints(node);
        let after = self.taints_after(before);
        if after != before {
            spec.insert("taints".into(), json!(after));
            if let Some(rv) = node.resource_version() {
                metadata.insert("resourceVersion".into(), Value::String(rv));
            }
        }

        if metadata.is_empty() && spec.is_empty() {
            return None;
        }
        let mut patch = Map::new();
        if !metadata.is_empty() {
            patch.insert("metadata".into(), Value::Object(metadata));
        }
        if !spec.is_empty() {
            patch.insert("spec".into(), Value::Object(spec));
        }
        Some(Value::Object(patch))
    }

    /// The merge patch of `status.addresses`, if the change sets them.
    pub fn status_patch(&self) -> Option<Value> {
        self.addresses
            .as_ref()
            .map(|a| json!({"status": {"addresses": a}}))
    }

    fn taints_after(&self, before: &[Taint]) -> Vec<Taint> {
        let mut after: Vec<Taint> = before
            .iter()
            .filter(|t| !self.remove_taints.contains(&t.key))
            .cloned()
            .collect();
        for t in &self.add_taints {
            if !after
                .iter()
                .any(|have| have.key == t.key && have.effect == t.effect)
            {
                after.push(t.clone());
            }
        }
        after
    }
}

pub fn taints(node: &Node) -> &[Taint] {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
}

pub fn has_taint(node: &Node, key: &str) -> bool {
    taints(node).iter().any(|t| t.key == key)
}

pub fn addresses(node: &Node) -> &[NodeAddress] {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_deref())
        .unwrap_or_default()
}

/// Whether kubelet reports the Node Ready (condition Ready=True).
pub fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..Default::default()
    }
}

/// The [`WriteLog`] key of the Node `name`.
pub fn node_key(name: &str) -> String {
    format!("node/{name}")
}

/// Writes `change` to `node`: addresses first (so the Node is never schedulable without them),
/// then labels, providerID and taints against the Node the first patch returned; each write
/// recorded in `written`.
pub async fn apply(
    client: &kube::Client,
    written: &WriteLog,
    node: &Node,
    change: &NodeChange,
) -> Result<(), Error> {
    let api: Api<Node> = Api::all(client.clone());
    let name = node.name_any();
    let key = node_key(&name);
    let mut current = None;
    if let Some(p) = change.status_patch() {
        let stored = api
            .patch_status(&name, &params(), &Patch::Merge(p))
            .await
            .map_err(Error::guest(
                &name,
                format!("patching status.addresses of Node {name}"),
            ))?;
        written.wrote(
            &key,
            node.resource_version().as_deref(),
            stored.resource_version().as_deref(),
        );
        current = Some(stored);
    }
    let base = current.as_ref().unwrap_or(node);
    if let Some(p) = change.spec_patch(base) {
        let stored = api
            .patch(&name, &params(), &Patch::Merge(p))
            .await
            .map_err(Error::guest(&name, format!("patching Node {name}")))?;
        written.wrote(
            &key,
            base.resource_version().as_deref(),
            stored.resource_version().as_deref(),
        );
    }
    Ok(())
}

/// Deletes this very Node (UID precondition: never a Node re-registered under the same name).
/// (A [`WriteLog`] entry of a deleted Node is harmless: the next Node of that name has other
/// versions, and the first reconcile of it clears the entry.)
pub async fn delete(client: &kube::Client, node: &Node) -> Result<(), Error> {
    let api: Api<Node> = Api::all(client.clone());
    let name = node.name_any();
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: node.uid(),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(&name, &dp).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(Error::guest(&name, format!("deleting Node {name}"))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(v: Value) -> Node {
        serde_json::from_value(v).expect("test node")
    }

    fn taint(key: &str, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            effect: effect.into(),
            ..Default::default()
        }
    }

    #[test]
    fn empty_change_patches_nothing() {
        let n = node(json!({"metadata": {"name": "w1", "resourceVersion": "7"}}));
        assert!(NodeChange::default().is_empty());
        assert_eq!(NodeChange::default().spec_patch(&n), None);
        assert_eq!(NodeChange::default().status_patch(), None);
    }

    #[test]
    fn spec_patch_writes_only_differences() {
        let n = node(json!({
            "metadata": {"name": "w1", "resourceVersion": "7",
                         "labels": {"topology.kubernetes.io/region": "r1", "keep": "me"}},
            "spec": {"taints": [
                {"key": UNINITIALIZED_TAINT, "value": "true", "effect": "NoSchedule"},
                {"key": "dedicated", "value": "db", "effect": "NoSchedule"}
            ]}
        }));
        let change = NodeChange {
            provider_id: Some("harvester://u1".into()),
            labels: BTreeMap::from([
                ("topology.kubernetes.io/region".into(), Some("r1".into())),
                ("topology.kubernetes.io/zone".into(), Some("z1".into())),
                ("gone".into(), None),
            ]),
            remove_taints: vec![UNINITIALIZED_TAINT.into()],
            ..Default::default()
        };
        assert_eq!(
            change.spec_patch(&n),
            Some(json!({
                "metadata": {"labels": {"topology.kubernetes.io/zone": "z1"}, "resourceVersion": "7"},
                "spec": {"providerID": "harvester://u1",
                         "taints": [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]}
            }))
        );
    }

    #[test]
    fn existing_provider_id_is_never_changed() {
        let n =
            node(json!({"metadata": {"name": "w1"}, "spec": {"providerID": "harvester://old"}}));
        let change = NodeChange {
            provider_id: Some("harvester://new".into()),
            ..Default::default()
        };
        assert_eq!(change.spec_patch(&n), None);
    }

    #[test]
    fn label_removal_only_when_present() {
        let n = node(json!({"metadata": {"name": "w1", "labels": {"a": "1"}}}));
        let change = NodeChange {
            labels: BTreeMap::from([("a".into(), None), ("b".into(), None)]),
            ..Default::default()
        };
        assert_eq!(
            change.spec_patch(&n),
            Some(json!({"metadata": {"labels": {"a": null}}}))
        );
    }

    #[test]
    fn taints_are_added_once_and_guarded_by_resource_version() {
        let n = node(json!({"metadata": {"name": "w1", "resourceVersion": "9"},
                            "spec": {"taints": [{"key": SHUTDOWN_TAINT, "effect": "NoSchedule"}]}}));
        let add = NodeChange {
            add_taints: vec![taint(SHUTDOWN_TAINT, "NoSchedule")],
            ..Default::default()
        };
        assert_eq!(add.spec_patch(&n), None, "already there");
        let bare = node(json!({"metadata": {"name": "w1", "resourceVersion": "3"}}));
        assert_eq!(
            add.spec_patch(&bare),
            Some(json!({"metadata": {"resourceVersion": "3"},
                        "spec": {"taints": [{"key": SHUTDOWN_TAINT, "effect": "NoSchedule"}]}}))
        );
        let remove = NodeChange {
            remove_taints: vec![SHUTDOWN_TAINT.into()],
            ..Default::default()
        };
        assert_eq!(
            remove.spec_patch(&n),
            Some(json!({"metadata": {"resourceVersion": "9"}, "spec": {"taints": []}}))
        );
    }

    #[test]
    fn status_patch_replaces_addresses() {
        let change = NodeChange {
            addresses: Some(vec![NodeAddress {
                address: "10.0.0.5".into(),
                type_: "InternalIP".into(),
            }]),
            ..Default::default()
        };
        assert_eq!(
            change.status_patch(),
            Some(json!({"status": {"addresses": [{"address": "10.0.0.5", "type": "InternalIP"}]}}))
        );
    }

    #[test]
    fn readiness() {
        assert!(!is_ready(&node(json!({"metadata": {"name": "w1"}}))));
        assert!(is_ready(&node(json!({"metadata": {"name": "w1"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))));
        assert!(!is_ready(&node(json!({"metadata": {"name": "w1"},
            "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}))));
    }
}
