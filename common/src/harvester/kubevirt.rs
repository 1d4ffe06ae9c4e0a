//! KubeVirt `VirtualMachine` and `VirtualMachineInstance` (kubevirt.io/v1).

use kube::CustomResource;
use serde::{Deserialize, Serialize};

use super::Rest;
use super::hotplug::{AddVolumeOptions, VolumeRequest};

/// The key of a VM's `status` holding its pending hot-plug requests.
pub const VOLUME_REQUESTS: &str = "volumeRequests";

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

/// KubeVirt's limit of volumes per VMI (root and cloud-init disks included).
pub const MAX_VOLUMES: i64 = 256;

/// Publish context key carrying the disk serial from ControllerPublishVolume (which names the
/// hot-plugged disk) to the node plugin (which finds the disk by it).
pub const CONTEXT_SERIAL: &str = "serial";

/// Prefix of the providerID the cloud provider sets on a guest Node: `harvester://<VM UID>`.
pub const PROVIDER_ID_PREFIX: &str = "harvester://";

/// The providerID of the guest Node of the VM with UID `vm_uid`.
pub fn provider_id(vm_uid: &str) -> String {
    format!("{PROVIDER_ID_PREFIX}{vm_uid}")
}

/// The VM UID in providerID `id`, if it is one of ours.
pub fn provider_uid(id: &str) -> Option<&str> {
    id.strip_prefix(PROVIDER_ID_PREFIX)
}

/// How many volumes can be hot-plugged into a VM with `fixed` volumes of its own (not
/// hot-plugged): KubeVirt's [`MAX_VOLUMES`] minus those, at least 1 (CSI reads a node limit of
/// 0 as "no limit"). Node plugin (NodeGetInfo) and controller (ControllerPublish) both use it.
pub fn hotplug_capacity(fixed: usize) -> i64 {
    (MAX_VOLUMES - i64::try_from(fixed).unwrap_or(MAX_VOLUMES)).max(1)
}

impl Volume {
    /// Whether the volume's claim is marked hot-pluggable.
    pub fn hotpluggable(&self) -> bool {
        self.persistent_volume_claim
            .as_ref()
            .and_then(|p| p.hotpluggable)
            == Some(true)
    }

    /// Whether the volume mounts PVC `claim`.
    pub fn uses_claim(&self, claim: &str) -> bool {
        self.persistent_volume_claim
            .as_ref()
            .is_some_and(|p| p.claim_name == claim)
    }
}

impl VirtualMachine {
    /// `spec.updateVolumesStrategy` (`Replacement`, the default, or `Migration`), if set.
    pub fn update_volumes_strategy(&self) -> Option<&str> {
        self.spec.rest.get("updateVolumesStrategy")?.as_str()
    }

    /// Whether the VM has volume `volume` in its spec, and with which disk serial.
    pub fn volume(&self, volume: &str) -> Option<Option<String>> {
        let spec = &self.spec.template.spec;
        spec.volumes.iter().find(|v| v.name == volume)?;
        Some(
            spec.domain
                .devices
                .disks
                .iter()
                .find(|d| d.name == volume)
                .and_then(|d| d.serial.clone()),
        )
    }

    /// Whether the VM mounts PVC `claim` (under any volume name), or will once KubeVirt applies
    /// a pending add request for it.
    pub fn uses_claim(&self, claim: &str) -> bool {
        self.spec
            .template
            .spec
            .volumes
            .iter()
            .any(|v| v.uses_claim(claim))
            || self.pending_adds().any(|o| o.claim_name() == Some(claim))
    }

    /// The pending add requests no later request undoes (see [`Self::pending_request`]).
    fn pending_adds(&self) -> impl Iterator<Item = AddVolumeOptions> {
        let requests = self.volume_requests();
        let last = |i: usize, name: &str| !requests[i + 1..].iter().any(|r| r.volume() == name);
        let adds: Vec<AddVolumeOptions> = requests
            .iter()
            .enumerate()
            .filter_map(|(i, r)| match r {
                VolumeRequest::Add(o) if last(i, &o.name) => Some(o.clone()),
                _ => None,
            })
            .collect();
        adds.into_iter()
    }

    /// The VM's `status.volumeRequests` that parse (under `HotplugVolumes`, the hot-plugs
    /// virt-controller has not applied yet), in order.
    pub fn volume_requests(&self) -> Vec<VolumeRequest> {
        let raw = self
            .status
            .as_ref()
            .and_then(|s| s.rest.get(VOLUME_REQUESTS))
            .and_then(|r| r.as_array());
        raw.into_iter()
            .flatten()
            .filter_map(VolumeRequest::parse)
            .collect()
    }

    /// The pending request that decides what KubeVirt will make of volume `volume`: the last one
    /// naming it, as virt-controller applies them in order (kubevirt/kubevirt v1.6.1, v1.7.0,
    /// v1.8.0 `pkg/virt-controller/watch/vm/vm.go` `handleVolumeRequests`). virt-api never
    /// queues both for one volume: a remove drops the volume's pending adds, and an add is
    /// refused while a remove is pending (`pkg/virt-api/rest/volumes.go`
    /// `addRemoveVolumeRequests`, `validateAddVolumeRequest`).
    pub fn pending_request(&self, volume: &str) -> Option<VolumeRequest> {
        self.volume_requests()
            .into_iter()
            .rfind(|r| r.volume() == volume)
    }

    /// Whether volume `volume` is in the VM spec as a hot-plugged one.
    pub fn hotplugged(&self, volume: &str) -> bool {
        self.spec
            .template
            .spec
            .volumes
            .iter()
            .any(|v| v.name == volume && v.hotpluggable())
    }

    /// `(hot-plugged, fixed)`: how many of the VM spec's volumes are hot-plugged, and how many
    /// are its own.
    pub fn volume_counts(&self) -> (usize, usize) {
        let volumes = &self.spec.template.spec.volumes;
        let hotplugged = volumes.iter().filter(|v| v.hotpluggable()).count();
        (hotplugged, volumes.len() - hotplugged)
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

    /// Whether the VMI still has volume `volume` in its spec or status.
    pub fn has_volume(&self, volume: &str) -> bool {
        self.spec.volumes.iter().any(|v| v.name == volume) || self.volume_status(volume).is_some()
    }

    /// Whether the VMI mounts PVC `claim`.
    pub fn uses_claim(&self, claim: &str) -> bool {
        self.spec.volumes.iter().any(|v| v.uses_claim(claim))
    }

    /// How many of the VMI's volumes are its own: neither marked hot-pluggable nor reported as
    /// hot-plugged in its volumeStatus.
    pub fn fixed_volumes(&self) -> usize {
        self.spec
            .volumes
            .iter()
            .filter(|v| {
                !(v.hotpluggable()
                    || self
                        .volume_status(&v.name)
                        .is_some_and(|s| s.hotplug_volume.is_some()))
            })
            .count()
    }

    /// Whether the VMI has stopped for good (phase Failed or Succeeded): KubeVirt never
    /// hot-unplugs from it, so its spec and volumeStatus keep every disk it had.
    pub fn stopped(&self) -> bool {
        matches!(
            self.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Failed" | "Succeeded")
        )
    }

    /// Whether the VMI runs (phase Running): KubeVirt changes the disks of a running VMI only
    /// (virt-api refuses the VMI's `addvolume`/`removevolume` otherwise, and the declarative
    /// gate patches only a running VMI: kubevirt/kubevirt v1.7.0 `pkg/storage/hotplug/
    /// hotplug.go` `patchHotplugVolumes`).
    pub fn running(&self) -> bool {
        self.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    }

    /// Whether the disks of the VMI may be taken although it still lists them: it does not run
    /// (it stopped, or it has not started: KubeVirt restarts the VM of a lost host as a new VMI
    /// that may wait for a host for good) and the administrator declared its guest Node out of
    /// service. A stopped VMI alone is not enough: KubeVirt also marks the VMIs of an
    /// unreachable host Failed while QEMU may still run there.
    pub fn fenced(&self, node_out_of_service: bool) -> bool {
        node_out_of_service && !self.running()
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

    #[test]
    fn pending_volume_requests_are_read_in_order_and_count_as_holding_the_claim() {
        let add = |name: &str, claim: &str| {
            json!({"addVolumeOptions": {"name": name, "disk": {"name": name, "disk": {"bus": "scsi"}},
                   "volumeSource": {"persistentVolumeClaim": {"claimName": claim, "hotpluggable": true}}}})
        };
        let vm: VirtualMachine = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "w1"}, "spec": {"template": {"spec": {}}},
            "status": {"volumeRequests": [
                add("v1", "c1"), {"removeVolumeOptions": {"name": "v2"}},
                {"unknownOptions": {}}, add("v2", "c2"), {"removeVolumeOptions": {"name": "v1"}}
            ]}
        }))
        .unwrap();
        let kinds: Vec<_> = vm
            .volume_requests()
            .iter()
            .map(|r| (matches!(r, VolumeRequest::Add(_)), r.volume().to_string()))
            .collect();
        assert_eq!(
            kinds,
            [
                (true, "v1".into()),
                (false, "v2".into()),
                (true, "v2".into()),
                (false, "v1".into())
            ],
            "in order, the malformed entry skipped"
        );
        // The last request naming a volume is what KubeVirt leaves of it.
        assert_eq!(
            vm.pending_request("v1"),
            Some(VolumeRequest::Remove("v1".into()))
        );
        assert!(matches!(vm.pending_request("v2"), Some(VolumeRequest::Add(o)) if o.name == "v2"));
        assert_eq!(vm.pending_request("v3"), None);
        // A pending add holds its claim, unless a later remove undoes it; the spec holds none.
        assert!(vm.uses_claim("c2"));
        assert!(!vm.uses_claim("c1") && !vm.uses_claim("c3"));
    }

    #[test]
    fn provider_ids_and_capacity() {
        assert_eq!(provider_id("u1"), "harvester://u1");
        assert_eq!(provider_uid("harvester://u1"), Some("u1"));
        assert_eq!(provider_uid("aws://u1"), None);
        assert_eq!(hotplug_capacity(2), 254);
        assert_eq!(hotplug_capacity(300), 1);
    }
}
