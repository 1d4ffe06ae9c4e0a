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

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "loadbalancer.harvesterhci.io",
    version = "v1beta1",
    kind = "LoadBalancer",
    namespaced,
    status = "LoadBalancerStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
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

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
