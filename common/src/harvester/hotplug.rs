//! KubeVirt's hot-plug subresources (`subresources.kubevirt.io/v1`), served by virt-api through
//! the API aggregation layer: `PUT .../virtualmachines/{vm}/addvolume|removevolume`.

use serde::{Deserialize, Serialize};

use super::Rest;

pub const SUBRESOURCE_GROUP: &str = "subresources.kubevirt.io";

/// Body of `addvolume`: `{"name", "disk": {"serial", "disk": {"bus"}}, "volumeSource": {...}}`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AddVolumeOptions {
    pub name: String,
    pub disk: HotplugDisk,
    pub volume_source: HotplugVolumeSource,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct HotplugDisk {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(default)]
    pub disk: serde_json::Value,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HotplugVolumeSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<super::kubevirt::PvcVolumeSource>,
    #[serde(flatten)]
    pub rest: Rest,
}

/// Body of `removevolume`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RemoveVolumeOptions {
    pub name: String,
    #[serde(flatten)]
    pub rest: Rest,
}

impl AddVolumeOptions {
    /// A SCSI hot-plug of PVC `claim` as disk `name` with `serial` (the guest finds it by serial).
    pub fn scsi_pvc(name: &str, claim: &str, serial: &str) -> Self {
        AddVolumeOptions {
            name: name.to_string(),
            disk: HotplugDisk {
                serial: Some(serial.to_string()),
                disk: serde_json::json!({"bus": "scsi"}),
                rest: Rest::new(),
            },
            volume_source: HotplugVolumeSource {
                persistent_volume_claim: Some(super::kubevirt::PvcVolumeSource {
                    claim_name: claim.to_string(),
                    hotpluggable: Some(true),
                    rest: Rest::new(),
                }),
                rest: Rest::new(),
            },
            rest: Rest::new(),
        }
    }

    /// The PVC this body hot-plugs, if it names one.
    pub fn claim_name(&self) -> Option<&str> {
        Some(
            self.volume_source
                .persistent_volume_claim
                .as_ref()?
                .claim_name
                .as_str(),
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HotplugError {
    #[error("{verb} of volume {volume} on virtualmachine {namespace}/{vm}: {source}")]
    Request {
        verb: &'static str,
        namespace: String,
        vm: String,
        volume: String,
        #[source]
        source: kube::Error,
    },
    #[error("building the {verb} request: {0}", verb = "hot-plug")]
    Build(String),
}

/// `PUT /apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachines/{vm}/addvolume`.
pub async fn add_volume(
    client: &kube::Client,
    namespace: &str,
    vm: &str,
    body: &AddVolumeOptions,
) -> Result<(), HotplugError> {
    put_subresource(client, namespace, vm, "addvolume", &body.name, body).await
}

/// `PUT /apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachines/{vm}/removevolume`.
pub async fn remove_volume(
    client: &kube::Client,
    namespace: &str,
    vm: &str,
    body: &RemoveVolumeOptions,
) -> Result<(), HotplugError> {
    put_subresource(client, namespace, vm, "removevolume", &body.name, body).await
}

async fn put_subresource<B: Serialize>(
    client: &kube::Client,
    namespace: &str,
    vm: &str,
    verb: &'static str,
    volume: &str,
    body: &B,
) -> Result<(), HotplugError> {
    let url =
        format!("/apis/{SUBRESOURCE_GROUP}/v1/namespaces/{namespace}/virtualmachines/{vm}/{verb}");
    let bytes = serde_json::to_vec(body).map_err(|e| HotplugError::Build(e.to_string()))?;
    let req = http::Request::put(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(bytes)
        .map_err(|e| HotplugError::Build(e.to_string()))?;
    client
        .request_text(req)
        .await
        .map(|_| ())
        .map_err(|source| HotplugError::Request {
            verb,
            namespace: namespace.to_string(),
            vm: vm.to_string(),
            volume: volume.to_string(),
            source,
        })
}

/// The JSON patch (RFC 6902) that hot-plugs PVC `claim` as SCSI disk `name` with `serial` into VM
/// `vm` under KubeVirt's `DeclarativeHotplugVolumes`, as upstream sends it (harvester-csi-driver
/// `addVolumeToVM`): a `test` of the VM's resourceVersion (the API server refuses the whole patch
/// if the VM changed since it was read), then an `add` of each entry the spec lacks. `None` when
/// the spec has both already.
pub fn declarative_add_patch(
    vm: &super::VirtualMachine,
    name: &str,
    claim: &str,
    serial: &str,
) -> Option<serde_json::Value> {
    let spec = &vm.spec.template.spec;
    let mut ops = Vec::new();
    if !spec.volumes.iter().any(|v| v.name == name) {
        let volume = serde_json::json!({"name": name,
            "persistentVolumeClaim": {"claimName": claim, "hotpluggable": true}});
        ops.push(append_op(
            "/spec/template/spec/volumes",
            spec.volumes.is_empty(),
            volume,
        ));
    }
    if !spec.domain.devices.disks.iter().any(|d| d.name == name) {
        let disk = serde_json::json!({"name": name, "serial": serial, "disk": {"bus": "scsi"}});
        ops.push(append_op(
            "/spec/template/spec/domain/devices/disks",
            spec.domain.devices.disks.is_empty(),
            disk,
        ));
    }
    (!ops.is_empty()).then(|| with_version_test(vm, ops))
}

/// The JSON patch that hot-unplugs volume `name` from VM `vm` declaratively, as upstream sends it
/// (`removeVolumeFromVM`): a `test` of the resourceVersion, then a `replace` of the volume and
/// disk lists without it. `None` when the spec has neither.
pub fn declarative_remove_patch(
    vm: &super::VirtualMachine,
    name: &str,
) -> Option<serde_json::Value> {
    let spec = &vm.spec.template.spec;
    let has_volume = spec.volumes.iter().any(|v| v.name == name);
    let has_disk = spec.domain.devices.disks.iter().any(|d| d.name == name);
    if !has_volume && !has_disk {
        return None;
    }
    let volumes: Vec<_> = spec.volumes.iter().filter(|v| v.name != name).collect();
    let disks: Vec<_> = spec
        .domain
        .devices
        .disks
        .iter()
        .filter(|d| d.name != name)
        .collect();
    let ops = vec![
        serde_json::json!({"op": "replace", "path": "/spec/template/spec/volumes", "value": volumes}),
        serde_json::json!({"op": "replace", "path": "/spec/template/spec/domain/devices/disks", "value": disks}),
    ];
    Some(with_version_test(vm, ops))
}

/// `add` at the end of the list at `path`; a missing or empty list is added whole (`/-` needs an
/// existing array).
fn append_op(path: &str, list_empty: bool, item: serde_json::Value) -> serde_json::Value {
    if list_empty {
        serde_json::json!({"op": "add", "path": path, "value": [item]})
    } else {
        serde_json::json!({"op": "add", "path": format!("{path}/-"), "value": item})
    }
}

fn with_version_test(
    vm: &super::VirtualMachine,
    ops: Vec<serde_json::Value>,
) -> serde_json::Value {
    let rv = vm.metadata.resource_version.clone().unwrap_or_default();
    let mut all = vec![serde_json::json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv})];
    all.extend(ops);
    serde_json::Value::Array(all)
}

/// Whether a VM patch failed only because its resourceVersion `test` no longer held (the VM
/// changed since it was read): the API server answers 422 naming the failed test (or 409).
pub fn patch_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s)
        if s.code == 409 || (s.code == 422 && s.message.contains("/metadata/resourceVersion")))
}

/// `PATCH` VM `vm` with the JSON patch `patch` (`application/json-patch+json`).
pub async fn patch_vm(
    client: &kube::Client,
    namespace: &str,
    vm: &str,
    patch: &serde_json::Value,
) -> Result<super::VirtualMachine, kube::Error> {
    let url = format!("/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/{vm}");
    let body = serde_json::to_vec(patch).map_err(kube::Error::SerdeError)?;
    let req = http::Request::patch(url)
        .header(http::header::CONTENT_TYPE, "application/json-patch+json")
        .body(body)
        .map_err(kube::Error::HttpError)?;
    client.request(req).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(rv: &str, volumes: serde_json::Value, disks: serde_json::Value) -> super::super::VirtualMachine {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "w1", "resourceVersion": rv},
            "spec": {"template": {"spec": {"volumes": volumes, "domain": {"devices": {"disks": disks}}}}}
        }))
        .expect("vm literal")
    }

    #[test]
    fn declarative_add_tests_the_version_then_appends_what_is_missing() {
        // The shape upstream sends (harvester-csi-driver pkg/csi/controller_server.go
        // addVolumeToVM, commit 97b6c358), plus our serial in the disk entry.
        let root = json!([{"name": "rootdisk", "persistentVolumeClaim": {"claimName": "root"}}]);
        let root_disk = json!([{"name": "rootdisk", "disk": {"bus": "virtio"}}]);
        let v = vm("42", root.clone(), root_disk.clone());
        assert_eq!(
            declarative_add_patch(&v, "pvc-1", "pvc-1", "s1"),
            Some(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "42"},
                {"op": "add", "path": "/spec/template/spec/volumes/-",
                 "value": {"name": "pvc-1", "persistentVolumeClaim": {"claimName": "pvc-1", "hotpluggable": true}}},
                {"op": "add", "path": "/spec/template/spec/domain/devices/disks/-",
                 "value": {"name": "pvc-1", "serial": "s1", "disk": {"bus": "scsi"}}}
            ]))
        );
        // Only the disk is missing: only the disk is added.
        let mut vols = root.as_array().unwrap().clone();
        vols.push(json!({"name": "pvc-1", "persistentVolumeClaim": {"claimName": "pvc-1", "hotpluggable": true}}));
        let half = vm("43", json!(vols), root_disk);
        let patch = declarative_add_patch(&half, "pvc-1", "pvc-1", "s1").expect("a patch");
        assert_eq!(patch.as_array().map(Vec::len), Some(2));
        assert_eq!(patch[1]["path"], "/spec/template/spec/domain/devices/disks/-");
        // Both present: nothing to send.
        let mut disks = vec![json!({"name": "rootdisk"})];
        disks.push(json!({"name": "pvc-1", "serial": "s1"}));
        assert_eq!(declarative_add_patch(&vm("44", json!(vols), json!(disks)), "pvc-1", "pvc-1", "s1"), None);
        // No list yet: the list is added whole.
        let empty = vm("45", json!([]), json!([]));
        let patch = declarative_add_patch(&empty, "pvc-1", "pvc-1", "s1").expect("a patch");
        assert_eq!(patch[1]["path"], "/spec/template/spec/volumes");
        assert!(patch[1]["value"].is_array());
    }

    #[test]
    fn declarative_remove_replaces_both_lists_without_the_volume() {
        let v = vm(
            "7",
            json!([{"name": "rootdisk"}, {"name": "pvc-1", "persistentVolumeClaim": {"claimName": "pvc-1", "hotpluggable": true}}]),
            json!([{"name": "rootdisk", "bootOrder": 1}, {"name": "pvc-1", "serial": "s1"}]),
        );
        assert_eq!(
            declarative_remove_patch(&v, "pvc-1"),
            Some(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "7"},
                {"op": "replace", "path": "/spec/template/spec/volumes", "value": [{"name": "rootdisk"}]},
                {"op": "replace", "path": "/spec/template/spec/domain/devices/disks",
                 "value": [{"name": "rootdisk", "bootOrder": 1}]}
            ]))
        );
        assert_eq!(declarative_remove_patch(&v, "pvc-2"), None);
    }
}
