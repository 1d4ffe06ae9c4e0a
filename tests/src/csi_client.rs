//! CSI requests as the suites, the demo and the bench send them: one builder per request shape,
//! so a caller writes only what differs (a content source, parameters) and not the whole literal.

use std::collections::HashMap;
use std::path::Path;

use csi_proto::csi::v1::volume_capability::access_mode::Mode;
use csi_proto::csi::v1::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use csi_proto::csi::v1::*;

/// A single-node-writer filesystem volume of type `fs`.
pub fn mount_cap(fs: &str) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

/// A single-node-writer raw block volume.
pub fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

/// CreateVolume `name` of `size` bytes (required, no limit) with capability `cap`.
pub fn create_request(name: &str, size: u64, cap: &VolumeCapability) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: size as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    }
}

/// CreateSnapshot `name` of volume `source`: a local snapshot (no parameters).
pub fn snapshot_request(name: &str, source: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: source.into(),
        ..Default::default()
    }
}

/// CreateSnapshot `name` of volume `source` as a remote backup (class parameter `type: backup`).
pub fn backup_request(name: &str, source: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        parameters: HashMap::from([("type".to_string(), "backup".to_string())]),
        ..snapshot_request(name, source)
    }
}

/// `request` restoring snapshot `snapshot_id`.
pub fn from_snapshot(request: CreateVolumeRequest, snapshot_id: &str) -> CreateVolumeRequest {
    CreateVolumeRequest {
        volume_content_source: Some(VolumeContentSource {
            r#type: Some(volume_content_source::Type::Snapshot(
                volume_content_source::SnapshotSource {
                    snapshot_id: snapshot_id.into(),
                },
            )),
        }),
        ..request
    }
}

/// `request` cloning volume `volume_id`.
pub fn from_volume(request: CreateVolumeRequest, volume_id: &str) -> CreateVolumeRequest {
    CreateVolumeRequest {
        volume_content_source: Some(VolumeContentSource {
            r#type: Some(volume_content_source::Type::Volume(
                volume_content_source::VolumeSource {
                    volume_id: volume_id.into(),
                },
            )),
        }),
        ..request
    }
}

/// ControllerPublishVolume of `id` to `node` with capability `cap`.
pub fn publish_request(
    id: &str,
    node: &str,
    cap: &VolumeCapability,
) -> ControllerPublishVolumeRequest {
    ControllerPublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    }
}

/// ControllerUnpublishVolume of `id` from `node`.
pub fn unpublish_request(id: &str, node: &str) -> ControllerUnpublishVolumeRequest {
    ControllerUnpublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        ..Default::default()
    }
}

/// NodeStageVolume of `id`, with the publish context the controller answered, at `staging`.
pub fn stage_request(
    id: &str,
    ctx: &HashMap<String, String>,
    staging: &Path,
    cap: &VolumeCapability,
) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: id.into(),
        publish_context: ctx.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    }
}

/// NodePublishVolume of `id` staged at `staging` onto `target`.
pub fn node_publish_request(
    id: &str,
    ctx: &HashMap<String, String>,
    staging: &Path,
    target: &Path,
    cap: &VolumeCapability,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: id.into(),
        publish_context: ctx.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    }
}
