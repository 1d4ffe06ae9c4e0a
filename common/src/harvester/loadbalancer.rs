//! Harvester `loadbalancer.harvesterhci.io/v1beta1` LoadBalancer and IPPool.
//!
//! Neither CRD has a status subresource: status is written with the object.

use std::collections::BTreeMap;

use kube::CustomResource;
use serde::{Deserialize, Serialize};

use super::Rest;

pub const GROUP: &str = "loadbalancer.harvesterhci.io";
/// IPAM sentinel Harvester records for `ipam: dhcp`: the address is leased elsewhere.
pub const DHCP_SENTINEL: &str = "0.0.0.0";
/// Finalizer the Harvester LB controller keeps on LoadBalancers (released on removal).
pub const LB_CONTROLLER_FINALIZER: &str = "wrangler.cattle.io/harvester-lb-controller";
/// Label marking the global pool.
pub const GLOBAL_POOL_LABEL: &str = "loadbalancer.harvesterhci.io/global-ip-pool";
/// LB annotations the pool requirement is built from.
pub const ANN_NETWORK: &str = "loadbalancer.harvesterhci.io/network";
pub const ANN_PROJECT: &str = "loadbalancer.harvesterhci.io/project";
pub const ANN_NAMESPACE: &str = "loadbalancer.harvesterhci.io/namespace";
pub const ANN_CLUSTER: &str = "loadbalancer.harvesterhci.io/cluster";

/// Decoded leniently (`from = Value`), as the status is: a field that is not a string reads as
/// unset, with a warning, and stays as it was in `rest`, so a write-back leaves it untouched.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "loadbalancer.harvesterhci.io",
    version = "v1beta1",
    kind = "LoadBalancer",
    namespaced,
    status = "LoadBalancerStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase", from = "serde_json::Value")]
pub struct LoadBalancerSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `vm` or `cluster`; empty means `vm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_type: Option<String>,
    /// `pool` or `dhcp`; empty means `pool`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipam: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_pool: Option<String>,
    #[serde(flatten)]
    pub rest: Rest,
}

/// Decoded leniently (`from = Value`): a field that is not what we expect is dropped with a warning
/// instead of failing the whole object, so one bad CR cannot stop a watch from listing the others.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase", from = "serde_json::Value")]
pub struct LoadBalancerStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_address: Option<AllocatedAddress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AllocatedAddress {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_pool: Option<String>,
    #[serde(default)]
    pub ip: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// A wrangler-style condition as Harvester writes it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_update_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

impl From<serde_json::Value> for LoadBalancerSpec {
    fn from(v: serde_json::Value) -> Self {
        let serde_json::Value::Object(mut map) = v else {
            tracing::warn!(
                "ignoring a LoadBalancer spec that is not an object: {}",
                short(&v)
            );
            return LoadBalancerSpec::default();
        };
        let mut string = |key: &str| match map.get(key) {
            Some(serde_json::Value::String(s)) => {
                let s = s.clone();
                map.remove(key);
                Some(s)
            }
            None | Some(serde_json::Value::Null) => {
                map.remove(key);
                None
            }
            Some(other) => {
                tracing::warn!(
                    "ignoring LoadBalancer spec.{key} (not a string): {}",
                    short(other)
                );
                None
            }
        };
        let description = string("description");
        let workload_type = string("workloadType");
        let ipam = string("ipam");
        let ip_pool = string("ipPool");
        LoadBalancerSpec {
            description,
            workload_type,
            ipam,
            ip_pool,
            rest: map,
        }
    }
}

impl From<serde_json::Value> for LoadBalancerStatus {
    fn from(v: serde_json::Value) -> Self {
        let serde_json::Value::Object(mut map) = v else {
            tracing::warn!(
                "ignoring a LoadBalancer status that is not an object: {}",
                short(&v)
            );
            return LoadBalancerStatus::default();
        };
        let mut take = |key: &str| map.remove(key).filter(|v| !v.is_null());
        let allocated_address =
            take("allocatedAddress").and_then(|v| lenient("allocatedAddress", v));
        let address = take("address").and_then(|v| lenient("address", v));
        let conditions = take("conditions")
            .and_then(|v| lenient::<Vec<Condition>>("conditions", v))
            .unwrap_or_default();
        LoadBalancerStatus {
            allocated_address,
            address,
            conditions,
            rest: map,
        }
    }
}

/// `v` as a `T`, or `None` with a warning naming the field.
fn lenient<T: serde::de::DeserializeOwned>(field: &str, v: serde_json::Value) -> Option<T> {
    match serde_json::from_value(v.clone()) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("ignoring LoadBalancer status.{field} ({e}): {}", short(&v));
            None
        }
    }
}

fn short(v: &serde_json::Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text,
    }
}

impl LoadBalancer {
    pub fn is_dhcp(&self) -> bool {
        self.spec.ipam.as_deref() == Some("dhcp")
    }

    /// The allocated IP, if Harvester has set one.
    pub fn allocated_ip(&self) -> Option<&str> {
        let ip = self
            .status
            .as_ref()?
            .allocated_address
            .as_ref()?
            .ip
            .as_str();
        (!ip.is_empty()).then_some(ip)
    }

    /// The `Ready` condition, if any.
    pub fn ready_condition(&self) -> Option<&Condition> {
        self.status
            .as_ref()?
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
    }
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "loadbalancer.harvesterhci.io",
    version = "v1beta1",
    kind = "IPPool",
    status = "IPPoolStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct IPPoolSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default)]
    pub ranges: Vec<PoolRange>,
    #[serde(default)]
    pub selector: PoolSelector,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolRange {
    pub subnet: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_start: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_end: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolSelector {
    #[serde(default)]
    pub priority: u32,
    #[serde(default)]
    pub network: String,
    #[serde(default)]
    pub scope: Vec<PoolScope>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolScope {
    #[serde(default)]
    pub project: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub guest_cluster: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IPPoolStatus {
    #[serde(default)]
    pub total: i64,
    #[serde(default)]
    pub available: i64,
    /// Always written, "" for none, as upstream's Go type (`LastAllocated string
    /// json:"lastAllocated"`) and its CRD, which requires it; "" reads as none.
    #[serde(
        default,
        serialize_with = "empty_for_none",
        deserialize_with = "none_for_empty"
    )]
    pub last_allocated: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocated: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub allocated_history: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(flatten)]
    pub rest: Rest,
}

fn empty_for_none<S: serde::Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.as_deref().unwrap_or(""))
}

/// A string, "" and null read as none; anything else too (lenient, as the rest of the status).
fn none_for_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(v.as_str().filter(|s| !s.is_empty()).map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lb(status: serde_json::Value) -> LoadBalancer {
        serde_json::from_value(json!({
            "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
            "metadata": {"name": "x", "namespace": "ns"},
            "spec": {"workloadType": "cluster", "ipam": "pool"},
            "status": status,
        }))
        .expect("a LoadBalancer decodes whatever its status holds")
    }

    /// harvester/charts `loadbalancer.harvesterhci.io_ippools.yaml` (harvester-load-balancer-1.8.2)
    /// requires `total`, `available` and `lastAllocated` in an IPPool status; upstream's Go type
    /// writes them always (`lastAllocated` "" before any allocation).
    #[test]
    fn an_ippool_status_always_carries_the_fields_the_crd_requires() {
        let empty = serde_json::to_value(IPPoolStatus::default()).unwrap();
        assert_eq!(
            empty,
            json!({"total": 0, "available": 0, "lastAllocated": ""})
        );
        let go: IPPoolStatus =
            serde_json::from_value(json!({"total": 5, "available": 5, "lastAllocated": ""}))
                .unwrap();
        assert_eq!(go.last_allocated, None, "Go's empty string reads as none");
        let some = IPPoolStatus {
            last_allocated: Some("10.0.0.2".into()),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&some).unwrap()["lastAllocated"],
            "10.0.0.2"
        );
    }

    #[test]
    fn a_well_formed_status_round_trips() {
        let status = json!({"allocatedAddress": {"ipPool": "p", "ip": "10.0.0.1", "mask": "255.255.255.0"},
                            "address": "10.0.0.1", "backendServers": ["a"],
                            "conditions": [{"type": "Ready", "status": "True"}]});
        let l = lb(status.clone());
        assert_eq!(l.allocated_ip(), Some("10.0.0.1"));
        assert_eq!(serde_json::to_value(l.status.unwrap()).unwrap(), status);
    }

    #[test]
    fn a_spec_field_of_the_wrong_type_reads_as_unset_and_is_written_back_as_it_was() {
        let spec = json!({"workloadType": "cluster", "ipam": 7, "ipPool": null,
                          "description": "d", "listeners": [{"port": 80}]});
        let l: LoadBalancer = serde_json::from_value(json!({
            "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
            "metadata": {"name": "x", "namespace": "ns"},
            "spec": spec,
        }))
        .expect("a LoadBalancer decodes whatever its spec holds");
        assert_eq!(l.spec.workload_type.as_deref(), Some("cluster"));
        assert_eq!(l.spec.description.as_deref(), Some("d"));
        assert_eq!(l.spec.ipam, None);
        assert!(!l.is_dhcp());
        assert_eq!(
            serde_json::to_value(&l.spec).unwrap(),
            json!({"workloadType": "cluster", "ipam": 7, "description": "d",
                   "listeners": [{"port": 80}]})
        );
    }

    #[test]
    fn bad_fields_are_dropped_not_fatal() {
        let l = lb(
            json!({"allocatedAddress": "10.0.0.1", "address": 7, "conditions": "Ready",
                          "backendServers": ["kept"]}),
        );
        let st = l.status.unwrap();
        assert_eq!(st.allocated_address, None);
        assert_eq!(st.address, None);
        assert!(st.conditions.is_empty());
        assert_eq!(st.rest.get("backendServers"), Some(&json!(["kept"])));
        assert_eq!(
            lb(json!("garbage")).status,
            Some(LoadBalancerStatus::default())
        );
    }
}
