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
