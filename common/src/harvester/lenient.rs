//! Objects from a watch that do not match our types. One undecodable object must not stop a
//! watch: kube-rs decodes a list page as a whole, so a single VMI with a field of an unexpected
//! shape would fail every list of its kind (the cache would never fill, and after a restart or a
//! relist every Node would wait on it). Such an object is read field by field instead: a field of
//! `spec` or `status` that does not decode is dropped with a warning naming the object and the
//! field, as [`LoadBalancerStatus`](super::loadbalancer::LoadBalancerStatus) does for its fields.

use kube::api::DynamicObject;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// The parts of an object whose fields are tried one by one.
const SECTIONS: [&str; 2] = ["spec", "status"];

/// `obj` (of kind `kind`, for the warning) as a `K`. When it does not decode as a whole, each
/// field of `spec` and `status` is tried on its own, against the object with both parts emptied;
/// the fields that fail are dropped, and a warning names the object, the fields and the error.
/// An object that still does not decode is an error (the caller skips it).
pub fn decode<K: DeserializeOwned>(kind: &str, obj: DynamicObject) -> Result<K, serde_json::Error> {
    let mut value = serde_json::to_value(obj)?;
    let first = match K::deserialize(&value) {
        Ok(k) => return Ok(k),
        Err(e) => e,
    };
    let object = format!(
        "{kind} {}/{}",
        value["metadata"]["namespace"].as_str().unwrap_or_default(),
        value["metadata"]["name"].as_str().unwrap_or_default()
    );
    let mut base = value.clone();
    for section in SECTIONS {
        if let Some(part) = base.get_mut(section) {
            *part = Value::Object(Map::new());
        }
    }
    let mut dropped = Vec::new();
    for section in SECTIONS {
        let Some(part) = value.get_mut(section) else {
            continue;
        };
        let Some(fields) = part.as_object_mut() else {
            // Not even an object: the whole part goes.
            if let Some(map) = value.as_object_mut() {
                map.remove(section);
            }
            dropped.push(section.to_string());
            continue;
        };
        fields.retain(|key, field| {
            let mut probe = base.clone();
            probe[section] = Value::Object(Map::from_iter([(key.clone(), field.clone())]));
            let ok = K::deserialize(&probe).is_ok();
            if !ok {
                dropped.push(format!("{section}.{key}"));
            }
            ok
        });
    }
    match K::deserialize(&value) {
        Ok(k) => {
            tracing::warn!(
                "{object}: ignoring {} that cannot be read ({first})",
                dropped.join(", ")
            );
            Ok(k)
        }
        Err(e) => {
            tracing::warn!("{object}: skipped, it cannot be read ({e})");
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harvester::{VirtualMachine, VirtualMachineInstance};
    use serde_json::json;

    fn dynamic(v: Value) -> DynamicObject {
        serde_json::from_value(v).expect("a Kubernetes object")
    }

    fn vmi(status: Value) -> DynamicObject {
        dynamic(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "w1", "namespace": "vms"},
            "spec": {"networks": [{"name": "nic-1", "multus": {"networkName": "default/vlan"}}]},
            "status": status
        }))
    }

    #[test]
    fn a_good_object_decodes_as_is() {
        let obj = vmi(json!({"phase": "Running", "nodeName": "h1"}));
        let vmi: VirtualMachineInstance = decode("VirtualMachineInstance", obj).unwrap();
        assert_eq!(vmi.status.unwrap().node_name.as_deref(), Some("h1"));
    }

    #[test]
    fn a_field_of_the_wrong_shape_is_dropped_and_the_rest_kept() {
        let obj = vmi(
            json!({"phase": "Running", "nodeName": "h1", "interfaces": "oops",
                             "volumeStatus": [{"name": 7}], "guestOSInfo": {"id": "ubuntu"}}),
        );
        let vmi: VirtualMachineInstance = decode("VirtualMachineInstance", obj).unwrap();
        assert_eq!(vmi.spec.networks[0].name, "nic-1");
        let status = vmi.status.unwrap();
        assert_eq!(status.node_name.as_deref(), Some("h1"));
        assert_eq!(status.phase.as_deref(), Some("Running"));
        assert!(status.interfaces.is_empty());
        assert!(status.volume_status.is_empty());
        assert_eq!(status.rest["guestOSInfo"], json!({"id": "ubuntu"}));
    }

    #[test]
    fn a_part_that_is_not_an_object_is_dropped() {
        let obj = dynamic(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "w1", "namespace": "vms"},
            "spec": {"running": true}, "status": "broken"
        }));
        let vm: VirtualMachine = decode("VirtualMachine", obj).unwrap();
        assert_eq!(vm.spec.running, Some(true));
        assert!(vm.status.is_none());
    }

    #[test]
    fn a_wrong_scalar_in_the_spec_is_dropped() {
        let obj = dynamic(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "w1", "namespace": "vms"},
            "spec": {"running": "yes", "runStrategy": "Always"}, "status": {"ready": "yes", "printableStatus": "Running"}
        }));
        let vm: VirtualMachine = decode("VirtualMachine", obj).unwrap();
        assert_eq!(vm.spec.running, None);
        assert_eq!(vm.spec.run_strategy.as_deref(), Some("Always"));
        let status = vm.status.unwrap();
        assert!(!status.ready);
        assert_eq!(status.printable_status.as_deref(), Some("Running"));
    }
}
