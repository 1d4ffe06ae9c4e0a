//! Harvester's remote backups (`harvesterhci.io/v1beta1`): a `VolumeRemoteBackup` (VRB) of a PVC,
//! which Harvester's controller backs up to the cluster's backup target, and a
//! `VolumeRemoteRestore` (VRR), for which Harvester creates a PVC of the same name, owned by it
//! (harvester/harvester `pkg/apis/harvesterhci.io/v1beta1/volumeremotebackup.go`).

use k8s_openapi::api::core::v1::PersistentVolumeClaimSpec;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

use crate::quantity;

/// Label upstream puts on a VolumeRemoteBackup: the volume (Harvester PVC) it backs up.
pub const LABEL_BACKUP_SOURCE_VOLUME: &str = "harvesterhci.io/backupSourceVolume";
/// `spec.type` of VRBs and VRRs: Longhorn's backup target, the only type Harvester has.
pub const TYPE_LONGHORN: &str = "lh";

/// `harvesterhci.io/v1beta1` VolumeRemoteBackup: only the fields this driver reads or writes.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "harvesterhci.io",
    version = "v1beta1",
    kind = "VolumeRemoteBackup",
    namespaced,
    status = "VolumeRemoteBackupStatus",
    schema = "disabled"
)]
pub struct VolumeRemoteBackupSpec {
    #[serde(rename = "type")]
    pub kind: String,
    /// The backed-up PVC, in the VRB's namespace.
    pub source: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRemoteBackupStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
    /// The source PVC's spec when it was backed up: a restore gets its size and class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_spec: Option<PersistentVolumeClaimSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success: Option<bool>,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

/// `harvesterhci.io/v1beta1` VolumeRemoteRestore: only the fields this driver reads or writes.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "harvesterhci.io",
    version = "v1beta1",
    kind = "VolumeRemoteRestore",
    namespaced,
    status = "VolumeRemoteRestoreStatus",
    schema = "disabled"
)]
pub struct VolumeRemoteRestoreSpec {
    #[serde(rename = "type")]
    pub kind: String,
    /// The VolumeRemoteBackup restored, `<namespace>/<name>`.
    pub from: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRemoteRestoreStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success: Option<bool>,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

impl VolumeRemoteBackup {
    pub fn ready(&self) -> bool {
        self.status.as_ref().and_then(|s| s.success) == Some(true)
    }
    /// The backed-up size: `status.sourceSpec.resources.requests.storage` (upstream's restore
    /// makes the PVC with exactly that request).
    pub fn size_bytes(&self) -> Option<u64> {
        quantity::storage_request(self.status.as_ref()?.source_spec.as_ref()?)
    }
}

impl VolumeRemoteRestore {
    pub fn ready(&self) -> bool {
        self.status.as_ref().and_then(|s| s.success) == Some(true)
    }
}
