//! Which guest VM this node is, and how many volumes it can take: the VMI found by this
//! machine's MAC addresses when the hostname is not the VM name (upstream's discovery), the
//! KubeVirt volume capacity NodeGetInfo reports, and the readiness error for a refused lookup.

use std::path::Path;

use harvester_common::api_error::{Describe, is_forbidden};
use harvester_common::cloud_config::Harvester;
use harvester_common::harvester::VirtualMachineInstance;
use harvester_common::harvester::kubevirt;

/// The VMI whose interfaces carry one of this machine's MAC addresses (upstream's discovery
/// when the hostname is not the VM name).
pub fn vmi_by_mac<'a>(
    vmis: &'a [VirtualMachineInstance],
    macs: &[String],
) -> Option<&'a VirtualMachineInstance> {
    vmis.iter().find(|vmi| {
        vmi.status.as_ref().is_some_and(|s| {
            s.interfaces.iter().any(|i| {
                i.mac
                    .as_deref()
                    .is_some_and(|m| macs.iter().any(|l| l.eq_ignore_ascii_case(m)))
            })
        })
    })
}

/// This machine's MAC addresses, without the placeholders upstream ignores (Calico's
/// `ee:ee:ee:ee:ee:ee`, all zeroes).
pub fn local_macs(sysfs: &Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(sysfs.join("class/net")) else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("address")).ok())
        .map(|m| m.trim().to_ascii_lowercase())
        .filter(|m| !m.is_empty() && m != "ee:ee:ee:ee:ee:ee" && m != "00:00:00:00:00:00")
        .collect()
}

/// Volumes this node can still take: [`kubevirt::hotplug_capacity`] of the VMI's own (not
/// hot-plugged) disks; without a VMI, assume a root and a cloud-init disk.
pub fn max_volumes(vmi: Option<&VirtualMachineInstance>) -> i64 {
    kubevirt::hotplug_capacity(vmi.map_or(2, VirtualMachineInstance::fixed_volumes))
}

/// The readiness error for a node ID lookup Harvester refused (403); `Ok` for other errors.
pub fn refused(e: &kube::Error, harvester: &Harvester, verb: &str) -> Result<(), String> {
    match e {
        e if is_forbidden(e) => Err(format!(
            "the identity of cloud-config {} may not {verb} VirtualMachineInstances in {} ({}): the node ID falls back to the hostname; grant get and list on virtualmachineinstances (deploy/harvester-rbac)",
            harvester.path.display(),
            harvester.namespace,
            Describe(e)
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(v: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(v).expect("vmi literal")
    }

    #[test]
    fn node_is_found_by_mac_when_the_hostname_differs() {
        let vmis = [
            vmi(
                json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": "vm-a"}, "spec": {},
                "status": {"interfaces": [{"name": "nic-1", "mac": "52:54:00:00:00:0A"}]}}),
            ),
            vmi(
                json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": "vm-b"}, "spec": {},
                "status": {"interfaces": [{"name": "nic-1", "mac": "52:54:00:00:00:0b"}]}}),
            ),
        ];
        let found = vmi_by_mac(&vmis, &["52:54:00:00:00:0b".into()]);
        assert_eq!(found.and_then(|v| v.metadata.name.as_deref()), Some("vm-b"));
        let found = vmi_by_mac(&vmis, &["52:54:00:00:00:0a".into()]);
        assert_eq!(
            found.and_then(|v| v.metadata.name.as_deref()),
            Some("vm-a"),
            "case-insensitive"
        );
        assert!(vmi_by_mac(&vmis, &["02:00:00:00:00:01".into()]).is_none());
    }

    #[test]
    fn max_volumes_leaves_room_for_the_vms_own_disks() {
        assert_eq!(max_volumes(None), 254);
        let v = vmi(
            json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "w"},
            "spec": {"volumes": [
                {"name": "root", "persistentVolumeClaim": {"claimName": "root"}},
                {"name": "cloudinit", "cloudInitNoCloud": {}},
                {"name": "pvc-1", "persistentVolumeClaim": {"claimName": "pvc-1", "hotpluggable": true}}
            ]}}),
        );
        assert_eq!(max_volumes(Some(&v)), 254);
    }
}
