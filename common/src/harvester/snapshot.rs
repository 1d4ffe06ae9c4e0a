//! `snapshot.storage.k8s.io/v1` VolumeSnapshot on Harvester: the local snapshots the CSI driver
//! takes of a volume's host PVC (Harvester's snapshot controller and Longhorn take them).

use kube::CustomResource;
use serde::{Deserialize, Serialize};

use crate::quantity;

/// `snapshot.storage.k8s.io/v1` VolumeSnapshot: only the fields this driver reads or writes.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "snapshot.storage.k8s.io",
    version = "v1",
    kind = "VolumeSnapshot",
    namespaced,
    status = "VolumeSnapshotStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSpec {
    pub source: VolumeSnapshotSource,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_content_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_size: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<serde_json::Value>,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

impl VolumeSnapshot {
    pub fn source_volume(&self) -> Option<&str> {
        self.spec.source.persistent_volume_claim_name.as_deref()
    }
    pub fn ready(&self) -> bool {
        self.status.as_ref().and_then(|s| s.ready_to_use) == Some(true)
    }
    pub fn restore_bytes(&self) -> Option<u64> {
        quantity::to_bytes(self.status.as_ref()?.restore_size.as_deref()?)
    }
    /// The snapshot controller's error message, if it reported one.
    pub fn error(&self) -> Option<String> {
        let e = self.status.as_ref()?.error.as_ref()?;
        Some(
            e.get("message")
                .and_then(|m| m.as_str())
                .map_or_else(|| e.to_string(), str::to_string),
        )
    }
}
