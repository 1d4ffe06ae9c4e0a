//! ControllerPublishVolume / ControllerUnpublishVolume: KubeVirt `addvolume` / `removevolume`
//! through the Harvester API server (virt-api behind the aggregation layer), then a bounded
//! watch until the VMI says the disk is Ready (or gone).

use std::collections::HashMap;

use csi_proto::csi::v1::*;
use harvester_common::harvester::hotplug::{self, AddVolumeOptions, HotplugError};
use harvester_common::harvester::kubevirt::VOLUME_READY;
use harvester_common::harvester::{
    RemoveVolumeOptions, Rest, VirtualMachine, VirtualMachineInstance,
};

use super::ControllerService;
use crate::error::ControllerError;
use crate::naming;
use crate::request::{self, required};

/// Publish context key carrying the disk serial to the node plugin.
pub const CONTEXT_SERIAL: &str = "serial";
/// Publish context key carrying the VMI's target (`sdb`), for information.
pub const CONTEXT_TARGET: &str = "target";

/// Whether VM `vm` has volume `volume` in its spec, and with which disk serial.
pub fn vm_volume(vm: &VirtualMachine, volume: &str) -> Option<Option<String>> {
    let spec = &vm.spec.template.spec;
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

/// Whether VM `vm` mounts PVC `claim` (under any volume name).
pub fn vm_uses_claim(vm: &VirtualMachine, claim: &str) -> bool {
    vm.spec.template.spec.volumes.iter().any(|v| {
        v.persistent_volume_claim
            .as_ref()
            .is_some_and(|p| p.claim_name == claim)
    })
}

/// Whether VMI `vmi` still has volume `volume` in its spec or status.
pub fn vmi_has_volume(vmi: &VirtualMachineInstance, volume: &str) -> bool {
    vmi.spec.volumes.iter().any(|v| v.name == volume) || vmi.volume_status(volume).is_some()
}

/// Whether VMI `vmi` mounts PVC `claim`.
pub fn vmi_uses_claim(vmi: &VirtualMachineInstance, claim: &str) -> bool {
    vmi.spec.volumes.iter().any(|v| {
        v.persistent_volume_claim
            .as_ref()
            .is_some_and(|p| p.claim_name == claim)
    })
}

/// The VM, other than `node`, that already holds a single-node volume, if any.
pub fn attached_elsewhere(
    claim: &str,
    node: &str,
    vms: &[VirtualMachine],
    vmis: &[VirtualMachineInstance],
) -> Option<String> {
    let name = |m: &kube::api::ObjectMeta| m.name.clone().unwrap_or_default();
    vms.iter()
        .filter(|vm| name(&vm.metadata) != node && vm_uses_claim(vm, claim))
        .map(|vm| name(&vm.metadata))
        .chain(
            vmis.iter()
                .filter(|vmi| name(&vmi.metadata) != node && vmi_uses_claim(vmi, claim))
                .map(|vmi| name(&vmi.metadata)),
        )
        .next()
}

/// `(hot-plugged volumes, limit)` of VM `vm` when it cannot take another volume. The limit is
/// `configured` (`--max-volumes-per-node`, as NodeGetInfo reports it), else KubeVirt's 256
/// volumes per VMI minus the VM's own (not hot-plugged) volumes.
pub fn attach_limit_reached(vm: &VirtualMachine, configured: Option<u32>) -> Option<(i64, i64)> {
    let volumes = &vm.spec.template.spec.volumes;
    let hotplugged = volumes
        .iter()
        .filter(|v| {
            v.persistent_volume_claim
                .as_ref()
                .and_then(|p| p.hotpluggable)
                == Some(true)
        })
        .count() as i64;
    let fixed = volumes.len() as i64 - hotplugged;
    let limit = configured.map_or(crate::node::KUBEVIRT_MAX_VOLUMES - fixed, i64::from);
    (hotplugged >= limit).then_some((hotplugged, limit))
}

/// A hot-plug error virt-api gives for a volume that is already in the VM spec.
fn already_added(e: &HotplugError) -> bool {
    matches!(e, HotplugError::Request { source: kube::Error::Api(s), .. }
        if s.code == 400 && s.message.contains("already exists"))
}

/// A hot-plug error virt-api gives for a volume that is not in the VM spec.
fn already_removed(e: &HotplugError) -> bool {
    matches!(e, HotplugError::Request { source: kube::Error::Api(s), .. }
        if (s.code == 400 && s.message.contains("does not exist")) || s.code == 404)
}

fn describe_volume(vmi: Option<&VirtualMachineInstance>, volume: &str) -> String {
    match vmi.and_then(|v| v.volume_status(volume)) {
        None => "no volumeStatus yet".into(),
        Some(s) => format!(
            "phase {:?}, reason {:?}, message {:?}",
            s.phase.as_deref().unwrap_or(""),
            s.reason.as_deref().unwrap_or(""),
            s.message.as_deref().unwrap_or("")
        ),
    }
}

impl ControllerService {
    pub(super) async fn publish(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> Result<ControllerPublishVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        let node = required("node_id", &req.node_id)?;
        request::capability("volume_capability", req.volume_capability.as_ref())?;
        let ns = self.ns().to_string();
        self.existing(id).await?;
        let vm = self
            .vms()
            .get_opt(node)
            .await
            .map_err(ControllerError::api(format!("getting VM {node}")))?
            .ok_or_else(|| ControllerError::NodeNotFound {
                namespace: ns.clone(),
                node: node.to_string(),
            })?;
        let _guard = self.begin(id)?;

        // The hot-plug pod needs a bound claim; Harvester binds it shortly after creation.
        self.wait_bound(id).await?;

        let (vms, vmis) = self.vms_and_vmis().await?;
        if let Some(other) = attached_elsewhere(id, node, &vms, &vmis) {
            return Err(ControllerError::AttachedElsewhere {
                volume: id.to_string(),
                node: node.to_string(),
                other,
            });
        }
        if !vmis
            .iter()
            .any(|v| v.metadata.name.as_deref() == Some(node))
        {
            return Err(ControllerError::Precondition(format!(
                "VM {ns}/{node} is not running (no VirtualMachineInstance); a disk can only be hot-plugged into a running VM"
            )));
        }

        let serial = match vm_volume(&vm, id) {
            // Already in the VM spec (a retry, or attached by the upstream driver): keep its serial.
            Some(existing) => existing,
            None => {
                if let Some((used, limit)) = attach_limit_reached(&vm, self.max_volumes_per_node) {
                    return Err(ControllerError::TooManyVolumes {
                        node: node.to_string(),
                        used,
                        limit,
                    });
                }
                let serial = naming::disk_serial(id);
                let body = AddVolumeOptions::scsi_pvc(id, id, &serial);
                match hotplug::add_volume(&self.harvester.client, &ns, node, &body).await {
                    Ok(()) => tracing::info!(volume = id, node, serial, "addvolume sent"),
                    Err(e) if already_added(&e) => {}
                    Err(e) => return Err(e.into()),
                }
                Some(serial)
            }
        };

        let ready = |v: Option<&VirtualMachineInstance>| {
            v.and_then(|v| v.volume_status(id))
                .is_some_and(|s| s.phase.as_deref() == Some(VOLUME_READY))
        };
        let waited = self
            .wait_for(
                self.vmis(),
                node,
                format!("volume {id} to become {VOLUME_READY} on VMI {ns}/{node}"),
                self.timeouts.attach,
                ready,
            )
            .await;
        let vmi = match waited {
            Ok(vmi) => vmi,
            Err(ControllerError::Timeout { what, after }) => {
                let last = self.vmis().get_opt(node).await.ok().flatten();
                return Err(ControllerError::Timeout {
                    what: format!("{what} (last seen: {})", describe_volume(last.as_ref(), id)),
                    after,
                });
            }
            Err(e) => return Err(e),
        };
        let mut publish_context = HashMap::new();
        if let Some(serial) = serial {
            publish_context.insert(CONTEXT_SERIAL.to_string(), serial);
        }
        if let Some(s) = vmi.as_ref().and_then(|v| v.volume_status(id)) {
            publish_context.insert(CONTEXT_TARGET.to_string(), s.target.clone());
        }
        Ok(ControllerPublishVolumeResponse { publish_context })
    }

    pub(super) async fn unpublish(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> Result<ControllerUnpublishVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        let _guard = self.begin(id)?;
        let nodes: Vec<String> = if req.node_id.is_empty() {
            // No node: unpublish from every VM that has it.
            let (vms, vmis) = self.vms_and_vmis().await?;
            let mut names: Vec<String> = vms
                .iter()
                .filter(|vm| vm_volume(vm, id).is_some())
                .filter_map(|vm| vm.metadata.name.clone())
                .chain(
                    vmis.iter()
                        .filter(|v| vmi_has_volume(v, id))
                        .filter_map(|v| v.metadata.name.clone()),
                )
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec![req.node_id.clone()]
        };
        for node in nodes {
            self.detach(id, &node).await?;
        }
        Ok(ControllerUnpublishVolumeResponse {})
    }

    /// Every VM and VMI of the namespace.
    async fn vms_and_vmis(
        &self,
    ) -> Result<(Vec<VirtualMachine>, Vec<VirtualMachineInstance>), ControllerError> {
        let ns = self.ns();
        let list = |e: &'static str| ControllerError::api(format!("listing {e} in {ns}"));
        let vms = self
            .vms()
            .list(&Default::default())
            .await
            .map_err(list("VMs"))?;
        let vmis = self
            .vmis()
            .list(&Default::default())
            .await
            .map_err(list("VMIs"))?;
        Ok((vms.items, vmis.items))
    }

    /// Removes volume `id` from VM `node` and waits until neither VM nor VMI has it. A VM or
    /// volume that does not exist is already unpublished.
    async fn detach(&self, id: &str, node: &str) -> Result<(), ControllerError> {
        let ns = self.ns().to_string();
        let vm = self
            .vms()
            .get_opt(node)
            .await
            .map_err(ControllerError::api(format!("getting VM {node}")))?;
        if let Some(vm) = &vm {
            let hotplugged = vm.spec.template.spec.volumes.iter().any(|v| {
                v.name == id
                    && v.persistent_volume_claim
                        .as_ref()
                        .and_then(|p| p.hotpluggable)
                        == Some(true)
            });
            if vm_volume(vm, id).is_some() && !hotplugged {
                return Err(ControllerError::Precondition(format!(
                    "volume {id} is a static (not hot-plugged) disk of VM {ns}/{node}; refusing to remove it"
                )));
            }
            if hotplugged {
                let body = RemoveVolumeOptions {
                    name: id.to_string(),
                    rest: Rest::new(),
                };
                match hotplug::remove_volume(&self.harvester.client, &ns, node, &body).await {
                    Ok(()) => tracing::info!(volume = id, node, "removevolume sent"),
                    Err(e) if already_removed(&e) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        self.wait_for(
            self.vmis(),
            node,
            format!("volume {id} to leave VMI {ns}/{node}"),
            self.timeouts.detach,
            move |v: Option<&VirtualMachineInstance>| v.is_none_or(|v| !vmi_has_volume(v, id)),
        )
        .await?;
        if vm.is_some() {
            self.wait_for(
                self.vms(),
                node,
                format!("volume {id} to leave VM {ns}/{node}"),
                self.timeouts.detach,
                move |v: Option<&VirtualMachine>| v.is_none_or(|v| vm_volume(v, id).is_none()),
            )
            .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(name: &str, volumes: &[(&str, &str, Option<&str>)]) -> VirtualMachine {
        let vols: Vec<_> = volumes
            .iter()
            .map(|(n, c, _)| json!({"name": n, "persistentVolumeClaim": {"claimName": c, "hotpluggable": true}}))
            .collect();
        let disks: Vec<_> = volumes
            .iter()
            .map(|(n, _, s)| json!({"name": n, "serial": s, "disk": {"bus": "scsi"}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"volumes": vols, "domain": {"devices": {"disks": disks}}}}}
        }))
        .expect("vm literal")
    }

    fn vmi(name: &str, claims: &[&str]) -> VirtualMachineInstance {
        let vols: Vec<_> = claims
            .iter()
            .map(|c| json!({"name": c, "persistentVolumeClaim": {"claimName": c}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name}, "spec": {"volumes": vols}
        }))
        .expect("vmi literal")
    }

    #[test]
    fn a_single_node_volume_held_by_another_vm_is_found() {
        let vms = [vm("w1", &[("v1", "v1", Some("s1"))]), vm("w2", &[])];
        assert_eq!(attached_elsewhere("v1", "w2", &vms, &[]), Some("w1".into()));
        assert_eq!(
            attached_elsewhere("v1", "w1", &vms, &[]),
            None,
            "same node is fine"
        );
        assert_eq!(attached_elsewhere("v2", "w2", &vms, &[]), None);
        // A VMI still holding it (VM spec already cleaned up) counts too.
        assert_eq!(
            attached_elsewhere("v9", "w2", &vms, &[vmi("w3", &["v9"])]),
            Some("w3".into())
        );
    }

    #[test]
    fn the_attach_limit_counts_hot_plugged_volumes() {
        let w = vm("w1", &[("v1", "v1", Some("a")), ("v2", "v2", Some("b"))]);
        assert_eq!(attach_limit_reached(&w, Some(2)), Some((2, 2)));
        assert_eq!(attach_limit_reached(&w, Some(3)), None);
        assert_eq!(attach_limit_reached(&w, None), None, "KubeVirt's 256");
    }

    #[test]
    fn vm_volume_reports_the_existing_serial() {
        let w = vm("w1", &[("v1", "v1", Some("abc")), ("v2", "v2", None)]);
        assert_eq!(vm_volume(&w, "v1"), Some(Some("abc".into())));
        assert_eq!(vm_volume(&w, "v2"), Some(None));
        assert_eq!(vm_volume(&w, "v3"), None);
    }
}
