//! What ListVolumes and ControllerGetVolume say of a hot-plugged volume, pure (no client): the
//! nodes it is published to and its condition, from the VMs and VMIs (the watch cache) and its
//! host PVC.
//!
//! Published to node N means: VM N has the volume in its spec *and* VMI N reports it Ready. A
//! disk that left the VMI while the VM spec still names it (harvester/harvester #10588, #9761)
//! is therefore not published, so the csi-attacher's resync (external-attacher v4.13.0
//! `pkg/controller/csi_handler.go` `ReconcileVA`: a VolumeAttachment whose node is not among
//! `published_node_ids` is synced again) attaches it again.

use std::borrow::Borrow;

use harvester_common::harvester::hotplug::VolumeRequest;
use harvester_common::harvester::kubevirt::VOLUME_READY;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;

/// The VMs to which volume `id` is published (see the module doc), sorted.
pub fn published_nodes<V, I>(id: &str, vms: &[V], vmis: &[I]) -> Vec<String>
where
    V: Borrow<VirtualMachine>,
    I: Borrow<VirtualMachineInstance>,
{
    let mut nodes: Vec<String> = vms
        .iter()
        .map(Borrow::borrow)
        .filter(|vm| vm.volume(id).is_some())
        .filter_map(|vm| vm.metadata.name.clone())
        .filter(|name| {
            vmis.iter()
                .map(Borrow::borrow)
                .find(|v| v.metadata.name.as_deref() == Some(name.as_str()))
                .is_some_and(|v| ready(v, id))
        })
        .collect();
    nodes.sort();
    nodes
}

fn ready(vmi: &VirtualMachineInstance, id: &str) -> bool {
    vmi.volume_status(id)
        .is_some_and(|s| s.phase.as_deref() == Some(VOLUME_READY))
}

/// The volume's condition: `Some(message)` when abnormal, naming what is wrong; `None` when
/// normal. Abnormal: the host PVC is lost or not Bound, a VM spec names the volume while its
/// VMI does not report it Ready (or the VM is not running), or an add request for it waits in a
/// VM's status.
pub fn abnormal<V, I>(
    id: &str,
    pvc: &PersistentVolumeClaim,
    vms: &[V],
    vmis: &[I],
) -> Option<String>
where
    V: Borrow<VirtualMachine>,
    I: Borrow<VirtualMachineInstance>,
{
    let phase = pvc
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("");
    let ns = pvc.metadata.namespace.as_deref().unwrap_or("");
    match phase {
        "Bound" => {}
        "Lost" => {
            return Some(format!(
                "host PVC {ns}/{id} is Lost: its PersistentVolume is gone on Harvester"
            ));
        }
        other => {
            let other = if other.is_empty() { "no phase" } else { other };
            return Some(format!("host PVC {ns}/{id} is not Bound ({other})"));
        }
    }
    let mut problems = Vec::new();
    for vm in vms.iter().map(Borrow::borrow) {
        let name = vm.metadata.name.as_deref().unwrap_or("");
        if vm.volume(id).is_none() {
            if matches!(vm.pending_request(id), Some(VolumeRequest::Add(_))) {
                problems.push(format!(
                    "VM {ns}/{name} has an addvolume request for the volume that KubeVirt has not \
                     applied yet (it applies requests to a running VMI only): the disk attaches \
                     when it does"
                ));
            }
            continue;
        }
        let vmi = vmis
            .iter()
            .map(Borrow::borrow)
            .find(|v| v.metadata.name.as_deref() == Some(name));
        match vmi {
            None => problems.push(format!(
                "VM {ns}/{name} has the volume in its spec but is not running (no VMI)"
            )),
            Some(v) if !ready(v, id) => problems.push(format!(
                "VM {ns}/{name} has the volume in its spec but its VMI does not report it {VOLUME_READY} ({})",
                super::rules::describe_volume(Some(v), id)
            )),
            Some(_) => {}
        }
    }
    // The other way round: a VMI holds the disk its VM's spec no longer names (an unplug that
    // did not finish, or a spec edited behind the driver's back): the disk goes at the VM's
    // next restart.
    for v in vmis.iter().map(Borrow::borrow).filter(|v| v.has_volume(id)) {
        let name = v.metadata.name.as_deref().unwrap_or("");
        let named = vms
            .iter()
            .map(Borrow::borrow)
            .any(|vm| vm.metadata.name.as_deref() == Some(name) && vm.volume(id).is_some());
        if !named {
            problems.push(format!(
                "VMI {ns}/{name} holds the volume but VM {ns}/{name} does not name it in its \
                 spec: the disk leaves at the VM's next restart"
            ));
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(name: &str, volumes: &[&str]) -> VirtualMachine {
        let vols: Vec<_> = volumes
            .iter()
            .map(|v| json!({"name": v, "persistentVolumeClaim": {"claimName": v, "hotpluggable": true}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"volumes": vols}}}
        }))
        .expect("vm literal")
    }

    fn vmi(name: &str, volumes: &[(&str, &str)]) -> VirtualMachineInstance {
        let status: Vec<_> = volumes
            .iter()
            .map(|(v, phase)| json!({"name": v, "target": "sdb", "phase": phase}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name}, "spec": {},
            "status": {"phase": "Running", "volumeStatus": status}
        }))
        .expect("vmi literal")
    }

    fn pvc(phase: &str) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "pvc-1", "namespace": "ns"},
            "status": {"phase": phase}
        }))
        .expect("pvc literal")
    }

    #[test]
    fn published_only_where_the_vm_spec_has_it_and_the_vmi_reports_it_ready() {
        let vms = [vm("w1", &["pvc-1"]), vm("w2", &["pvc-1"]), vm("w3", &[])];
        let vmis = [
            vmi("w1", &[("pvc-1", "Ready")]),
            // #10588: the VM spec names it, the VMI lost it.
            vmi("w2", &[]),
            vmi("w3", &[("pvc-1", "Ready")]),
        ];
        assert_eq!(
            published_nodes("pvc-1", &vms, &vmis),
            vec!["w1".to_string()]
        );
        assert!(published_nodes("pvc-2", &vms, &vmis).is_empty());
    }

    #[test]
    fn condition_names_what_is_wrong() {
        let vms = [vm("w1", &["pvc-1"])];
        let ok = [vmi("w1", &[("pvc-1", "Ready")])];
        assert_eq!(abnormal("pvc-1", &pvc("Bound"), &vms, &ok), None);
        let lost = abnormal("pvc-1", &pvc("Lost"), &vms, &ok).expect("lost is abnormal");
        assert!(lost.contains("host PVC ns/pvc-1 is Lost"), "{lost}");
        let pending = abnormal("pvc-1", &pvc("Pending"), &vms, &ok).expect("pending");
        assert!(pending.contains("is not Bound (Pending)"), "{pending}");
        let gone = abnormal("pvc-1", &pvc("Bound"), &vms, &[vmi("w1", &[])]).expect("gone");
        assert!(
            gone.contains(
                "VM ns/w1 has the volume in its spec but its VMI does not report it Ready"
            ),
            "{gone}"
        );
        let stopped = abnormal::<_, VirtualMachineInstance>("pvc-1", &pvc("Bound"), &vms, &[])
            .expect("stopped");
        assert!(stopped.contains("is not running (no VMI)"), "{stopped}");
        // In no VM at all: normal (simply not published).
        assert_eq!(abnormal("pvc-9", &pvc("Bound"), &vms, &ok), None);
        // Only in a pending add request: about to be attached.
        let mut requested = vm("w1", &[]);
        requested.status = serde_json::from_value(json!({"volumeRequests": [
            {"addVolumeOptions": {"name": "pvc-1", "disk": {"disk": {"bus": "scsi"}},
                                  "volumeSource": {"persistentVolumeClaim": {"claimName": "pvc-1"}}}}]}))
        .expect("status literal");
        let pending =
            abnormal::<_, VirtualMachineInstance>("pvc-1", &pvc("Bound"), &[requested], &[])
                .expect("pending");
        assert!(
            pending.contains("VM ns/w1 has an addvolume request"),
            "{pending}"
        );
        // The VMI still holds it, the VM spec no longer names it.
        let behind = abnormal("pvc-1", &pvc("Bound"), &[vm("w1", &[])], &ok).expect("behind");
        assert!(
            behind.contains("VMI ns/w1 holds the volume but VM ns/w1 does not name it"),
            "{behind}"
        );
    }
}
