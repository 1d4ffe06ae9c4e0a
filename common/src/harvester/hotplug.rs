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

/// One entry of a VM's `status.volumeRequests` (KubeVirt's `VirtualMachineVolumeRequest`), which
/// virt-api writes under the `HotplugVolumes` gate and virt-controller applies, in order, to the VM
/// spec and a running VMI.
#[derive(Clone, Debug, PartialEq)]
pub enum VolumeRequest {
    Add(AddVolumeOptions),
    Remove(String),
}

impl VolumeRequest {
    /// The request in `raw`, if it is a well-formed add or remove.
    pub fn parse(raw: &serde_json::Value) -> Option<VolumeRequest> {
        if let Some(add) = raw.get("addVolumeOptions") {
            return serde_json::from_value(add.clone())
                .ok()
                .map(VolumeRequest::Add);
        }
        let name = raw.get("removeVolumeOptions")?.get("name")?.as_str()?;
        Some(VolumeRequest::Remove(name.to_string()))
    }

    /// The volume the request adds or removes.
    pub fn volume(&self) -> &str {
        match self {
            VolumeRequest::Add(o) => &o.name,
            VolumeRequest::Remove(name) => name,
        }
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

/// The JSON patch (RFC 6902) that hot-plugs PVC `claim` as SCSI disk `name` with `serial` into the
/// VM whose `spec.template.spec` (as stored, raw JSON) is `spec`, under KubeVirt's
/// `DeclarativeHotplugVolumes`: an `add` of the volume and the disk entry the spec lacks (the
/// entries upstream's `addVolumeToVM` adds, plus our serial), after a `test` of each list as read.
/// The API server refuses the whole patch if either list changed since (optimistic concurrency on
/// exactly what is edited: upstream tests the VM's resourceVersion, which any status or label
/// write breaks). `None` when both entries exist.
pub fn declarative_add_patch(
    spec: &serde_json::Value,
    name: &str,
    claim: &str,
    serial: &str,
) -> Option<serde_json::Value> {
    let (volumes, disks) = hotplug_lists(spec);
    let mut ops = Vec::new();
    if !has_entry(&volumes, name) {
        let volume = serde_json::json!({"name": name,
            "persistentVolumeClaim": {"claimName": claim, "hotpluggable": true}});
        ops.push(append_op(VOLUMES, &volumes, volume));
    }
    if !has_entry(&disks, name) {
        let disk = serde_json::json!({"name": name, "serial": serial, "disk": {"bus": "scsi"}});
        ops.push(append_op(DISKS, &disks, disk));
    }
    (!ops.is_empty()).then(|| with_list_tests(volumes, disks, ops))
}

/// The JSON patch that hot-unplugs volume `name` declaratively, as upstream's
/// `removeVolumeFromVM`: a `replace` of the volume and disk lists without it, after a `test` of
/// each list as read. `None` when the spec has neither entry.
pub fn declarative_remove_patch(spec: &serde_json::Value, name: &str) -> Option<serde_json::Value> {
    let (volumes, disks) = hotplug_lists(spec);
    if !has_entry(&volumes, name) && !has_entry(&disks, name) {
        return None;
    }
    let without = |list: &serde_json::Value| -> Vec<serde_json::Value> {
        list.as_array()
            .map(|l| l.iter().filter(|e| e["name"] != name).cloned().collect())
            .unwrap_or_default()
    };
    let ops = vec![
        serde_json::json!({"op": "replace", "path": VOLUMES, "value": without(&volumes)}),
        serde_json::json!({"op": "replace", "path": DISKS, "value": without(&disks)}),
    ];
    Some(with_list_tests(volumes, disks, ops))
}

const VOLUMES: &str = "/spec/template/spec/volumes";
const DISKS: &str = "/spec/template/spec/domain/devices/disks";

/// The volume and disk lists of a VM's `spec.template.spec` as stored (`null` where missing): the
/// values the declarative patches test.
pub fn hotplug_lists(spec: &serde_json::Value) -> (serde_json::Value, serde_json::Value) {
    (
        spec.pointer("/volumes").cloned().unwrap_or_default(),
        spec.pointer("/domain/devices/disks")
            .cloned()
            .unwrap_or_default(),
    )
}

fn has_entry(list: &serde_json::Value, name: &str) -> bool {
    list.as_array()
        .is_some_and(|l| l.iter().any(|e| e["name"] == name))
}

/// `add` at the end of the list at `path`; a missing or empty list is added whole (`/-` needs an
/// existing array).
fn append_op(path: &str, list: &serde_json::Value, item: serde_json::Value) -> serde_json::Value {
    if list.as_array().is_some_and(|l| !l.is_empty()) {
        serde_json::json!({"op": "add", "path": format!("{path}/-"), "value": item})
    } else {
        serde_json::json!({"op": "add", "path": path, "value": [item]})
    }
}

/// A `test` of each list as read (`null` for a missing list, which the API server's json-patch
/// passes only while it is still missing), then `ops`.
fn with_list_tests(
    volumes: serde_json::Value,
    disks: serde_json::Value,
    ops: Vec<serde_json::Value>,
) -> serde_json::Value {
    let mut all = vec![
        serde_json::json!({"op": "test", "path": VOLUMES, "value": volumes}),
        serde_json::json!({"op": "test", "path": DISKS, "value": disks}),
    ];
    all.extend(ops);
    serde_json::Value::Array(all)
}

/// The `spec.template.spec` of VM `vm`, raw as stored (a typed read would not tell a missing
/// list from an empty one, and the declarative patches test them as they are).
pub async fn vm_template_spec(
    client: &kube::Client,
    namespace: &str,
    vm: &str,
) -> Result<Option<serde_json::Value>, kube::Error> {
    let resource = kube::api::ApiResource::erase::<super::VirtualMachine>(&());
    let api: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(client.clone(), namespace, &resource);
    Ok(api.get_opt(vm).await?.map(|o| {
        o.data
            .pointer("/spec/template/spec")
            .cloned()
            .unwrap_or_default()
    }))
}

/// Whether the API server refused a VM patch as it refuses one whose `test` failed: 422 with a
/// generic message (the failed operation is not named), or 409. Whether a test was the reason is
/// known only by reading the VM again: its [`hotplug_lists`] changed.
pub fn patch_refused(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 || s.code == 422)
}

/// `PATCH` VM `vm` with the JSON patch `patch` (`application/json-patch+json`).
pub async fn patch_vm(
    client: &kube::Client,
    namespace: &str,
    vm: &str,
    patch: &serde_json::Value,
) -> Result<super::VirtualMachine, kube::Error> {
    patch_vm_at(client, namespace, vm, None, patch).await
}

/// [`patch_vm`] of the VM or of its `subresource` (`status`).
pub async fn patch_vm_at(
    client: &kube::Client,
    namespace: &str,
    vm: &str,
    subresource: Option<&str>,
    patch: &serde_json::Value,
) -> Result<super::VirtualMachine, kube::Error> {
    let mut url = format!("/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/{vm}");
    if let Some(sub) = subresource {
        url = format!("{url}/{sub}");
    }
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

    fn vm(_rv: &str, volumes: serde_json::Value, disks: serde_json::Value) -> serde_json::Value {
        json!({"volumes": volumes, "domain": {"devices": {"disks": disks}}})
    }

    #[test]
    fn declarative_add_tests_both_lists_then_appends_what_is_missing() {
        // The entries upstream adds (harvester-csi-driver pkg/csi/controller_server.go
        // addVolumeToVM, commit 97b6c358), plus our serial in the disk entry.
        let root = json!([{"name": "rootdisk", "persistentVolumeClaim": {"claimName": "root"}}]);
        let root_disk = json!([{"name": "rootdisk", "disk": {"bus": "virtio"}}]);
        let v = vm("42", root.clone(), root_disk.clone());
        assert_eq!(
            declarative_add_patch(&v, "pvc-1", "pvc-1", "s1"),
            Some(json!([
                {"op": "test", "path": "/spec/template/spec/volumes", "value": root},
                {"op": "test", "path": "/spec/template/spec/domain/devices/disks", "value": root_disk},
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
        assert_eq!(patch.as_array().map(Vec::len), Some(3));
        assert_eq!(
            patch[2]["path"],
            "/spec/template/spec/domain/devices/disks/-"
        );
        // Both present: nothing to send.
        let mut disks = vec![json!({"name": "rootdisk"})];
        disks.push(json!({"name": "pvc-1", "serial": "s1"}));
        assert_eq!(
            declarative_add_patch(&vm("44", json!(vols), json!(disks)), "pvc-1", "pvc-1", "s1"),
            None
        );
        // No lists yet: each is tested to be missing (null) and added whole; an empty list is
        // tested to be empty.
        let missing = json!({"domain": {"devices": {}}});
        let patch = declarative_add_patch(&missing, "pvc-1", "pvc-1", "s1").expect("a patch");
        assert_eq!(
            patch[0],
            json!({"op": "test", "path": "/spec/template/spec/volumes", "value": null})
        );
        assert_eq!(patch[2]["path"], "/spec/template/spec/volumes");
        assert_eq!(patch[2]["op"], "add");
        assert!(patch[2]["value"].is_array());
        let empty = vm("46", json!([]), json!([]));
        let patch = declarative_add_patch(&empty, "pvc-1", "pvc-1", "s1").expect("a patch");
        assert_eq!(
            patch[0],
            json!({"op": "test", "path": "/spec/template/spec/volumes", "value": []})
        );
        assert_eq!(patch[2]["path"], "/spec/template/spec/volumes");
    }

    #[test]
    fn declarative_remove_replaces_both_lists_without_the_volume() {
        let vols = json!([{"name": "rootdisk"}, {"name": "pvc-1", "persistentVolumeClaim": {"claimName": "pvc-1", "hotpluggable": true}}]);
        let disks =
            json!([{"name": "rootdisk", "bootOrder": 1}, {"name": "pvc-1", "serial": "s1"}]);
        let v = vm("7", vols.clone(), disks.clone());
        assert_eq!(
            declarative_remove_patch(&v, "pvc-1"),
            Some(json!([
                {"op": "test", "path": "/spec/template/spec/volumes", "value": vols},
                {"op": "test", "path": "/spec/template/spec/domain/devices/disks", "value": disks},
                {"op": "replace", "path": "/spec/template/spec/volumes", "value": [{"name": "rootdisk"}]},
                {"op": "replace", "path": "/spec/template/spec/domain/devices/disks",
                 "value": [{"name": "rootdisk", "bootOrder": 1}]}
            ]))
        );
        assert_eq!(declarative_remove_patch(&v, "pvc-2"), None);
    }
}
