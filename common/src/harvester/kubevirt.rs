//! KubeVirt `VirtualMachine` and `VirtualMachineInstance` (kubevirt.io/v1).

use kube::CustomResource;
use serde::{Deserialize, Serialize};

use super::Rest;

/// The part of `VirtualMachine.spec` we use.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachine",
    namespaced,
    status = "VirtualMachineStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_strategy: Option<String>,
    #[serde(default)]
    pub template: VmTemplate,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct VmTemplate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
    #[serde(default)]
    pub spec: VmiSpec,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineStatus {
    #[serde(default)]
    pub ready: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub printable_status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<bool>,
    #[serde(flatten)]
    pub rest: Rest,
}

/// `VirtualMachineInstance.spec` (also the VM template's spec).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstance",
    namespaced,
    status = "VmiStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct VmiSpec {
    #[serde(default)]
    pub domain: Domain,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<Network>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Domain {
    #[serde(default)]
    pub devices: Devices,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Devices {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
    #[serde(flatten)]
    pub rest: Rest,
}

/// A disk of the domain. Hot-plugged disks carry a `serial` so the guest can find them by id.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Disk {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<PvcVolumeSource>,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PvcVolumeSource {
    pub claim_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
    #[serde(flatten)]
    pub rest: Rest,
}

/// A VMI network; only Multus networks carry node addresses.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Network {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multus: Option<MultusNetwork>,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MultusNetwork {
    pub network_name: String,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VmiStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_status: Vec<VolumeStatus>,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_addresses: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(flatten)]
    pub rest: Rest,
}

/// One entry of `vmi.status.volumeStatus`. Hot-plugged volumes have `hotplugVolume` set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStatus {
    pub name: String,
    #[serde(default)]
    pub target: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotplug_volume: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim_info: Option<serde_json::Value>,
    #[serde(flatten)]
    pub rest: Rest,
}

/// `volumeStatus.phase` of a hot-plugged volume that the guest can use.
pub const VOLUME_READY: &str = "Ready";

/// `VirtualMachine.spec.updateVolumesStrategy` under which volume changes go by live migration
/// (kubevirt/kubevirt `staging/src/kubevirt.io/api/core/v1/types.go`); KubeVirt's declarative
/// hot-plug leaves such VMs alone.
pub const UPDATE_VOLUMES_MIGRATION: &str = "Migration";

impl VirtualMachine {
    /// `spec.updateVolumesStrategy` (`Replacement`, the default, or `Migration`), if set.
    pub fn update_volumes_strategy(&self) -> Option<&str> {
        self.spec.rest.get("updateVolumesStrategy")?.as_str()
    }
}

impl VirtualMachineInstance {
    /// The hot-plug status of volume `name`, if the VMI reports one.
    pub fn volume_status(&self, name: &str) -> Option<&VolumeStatus> {
        self.status
            .as_ref()?
            .volume_status
            .iter()
            .find(|v| v.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unknown_fields_survive_a_round_trip() {
        let raw = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "w1", "namespace": "ns"},
            "spec": {"domain": {"cpu": {"cores": 2}, "devices": {"disks": [{"name": "root", "bootOrder": 1, "disk": {"bus": "virtio"}}]}},
                     "evictionStrategy": "LiveMigrate"},
            "status": {"phase": "Running", "nodeName": "h1", "guestOSInfo": {"id": "ubuntu"},
                       "volumeStatus": [{"name": "v1", "target": "sda", "phase": "Ready", "hotplugVolume": {}}]}
        });
        let vmi: VirtualMachineInstance = serde_json::from_value(raw.clone()).unwrap();
        assert_eq!(vmi.volume_status("v1").unwrap().target, "sda");
        assert_eq!(serde_json::to_value(&vmi).unwrap(), raw);
    }
}
