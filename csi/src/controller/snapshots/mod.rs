//! CreateSnapshot / DeleteSnapshot / ListSnapshots: a snapshot is a `VolumeSnapshot` on Harvester
//! (in the cloud-config's namespace) of the volume's PVC; Harvester's snapshot controller and
//! Longhorn take it. A volume restored from it is a PVC with that VolumeSnapshot as `dataSource`.
//!
//! Unlike upstream, a snapshot that is not ready yet is answered with `ready_to_use: false`
//! (never INTERNAL), so the external-snapshotter simply asks again.
//!
//! With VolumeSnapshotClass parameter `type: backup` the snapshot is a remote backup instead
//! ([`backup`]); its ID is `backup:<namespace>/<name>`.

pub mod backup;

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;

use csi_proto::csi::v1::*;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, ObjectMeta};

use super::context::borrows_ctx;
use super::host_pvc::{PROVISIONER_PARAM_PREFIX, requested_bytes, unknown_params};
use super::kube::{Deleting, delete_if_exists, get_or_create, wait_for};
use super::owner::Owner;
use crate::error::{ArgError, ControllerError};
use crate::naming::{self, ORIGINAL_NAME_ANNOTATION};
use crate::request::required;

pub use super::host_pvc::{LABEL_SNAP_HOST_SC, LABEL_SNAP_HOST_VOLUME_MODE};
pub use harvester_common::harvester::snapshot::{
    VolumeSnapshot, VolumeSnapshotSource, VolumeSnapshotSpec, VolumeSnapshotStatus,
};
/// CreateSnapshot parameter (the guest VolumeSnapshotClass's `parameters`) naming the Harvester
/// VolumeSnapshotClass; without it Harvester's default class for the PVC's driver applies.
pub const PARAM_HOST_SNAPSHOT_CLASS: &str = "hostVolumeSnapshotClass";
/// CreateSnapshot parameter choosing the kind of snapshot: absent (or empty) for a local
/// VolumeSnapshot, [`TYPE_BACKUP`] for a remote backup (upstream's parameter and value).
pub const PARAM_TYPE: &str = "type";
pub const TYPE_BACKUP: &str = "backup";

/// What CreateSnapshot's parameters ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotKind<'a> {
    /// A VolumeSnapshot on Harvester, of Harvester VolumeSnapshotClass `class` (else its default).
    Local { class: Option<&'a str> },
    /// A VolumeRemoteBackup to Harvester's backup target.
    Backup,
}

impl<'a> SnapshotKind<'a> {
    /// Parses the VolumeSnapshotClass `parameters`. An unknown key or `type` value is refused
    /// naming it (upstream ignores unknown keys and takes any `type` but `backup` as local); the
    /// external-snapshotter's own `csi.storage.k8s.io/*` keys pass.
    pub fn parse(params: &'a HashMap<String, String>) -> Result<SnapshotKind<'a>, ArgError> {
        if let Some(unknown) = unknown_params(params, &[PARAM_HOST_SNAPSHOT_CLASS, PARAM_TYPE]) {
            return Err(ArgError::Invalid {
                field: "parameters",
                reason: format!(
                    "unknown VolumeSnapshotClass parameter {unknown} (known: {PARAM_TYPE}, \
                     {PARAM_HOST_SNAPSHOT_CLASS}, {}*)",
                    PROVISIONER_PARAM_PREFIX
                ),
            });
        }
        let class = params
            .get(PARAM_HOST_SNAPSHOT_CLASS)
            .map(|s| s.trim())
            .filter(|s| !s.is_empty());
        match params.get(PARAM_TYPE).map(String::as_str) {
            None | Some("") => Ok(SnapshotKind::Local { class }),
            Some(TYPE_BACKUP) => match class {
                None => Ok(SnapshotKind::Backup),
                Some(c) => Err(ArgError::Invalid {
                    field: "parameters",
                    reason: format!(
                        "{PARAM_HOST_SNAPSHOT_CLASS} {c:?} does not apply to {PARAM_TYPE} \
                         {TYPE_BACKUP:?}: Harvester takes backups with its own backup class"
                    ),
                }),
            },
            Some(other) => Err(ArgError::Invalid {
                field: "parameters",
                reason: format!(
                    "{PARAM_TYPE} {other:?} is not a snapshot type: leave it out for a local \
                     snapshot, or set {TYPE_BACKUP:?} for a remote backup"
                ),
            }),
        }
    }
}

/// The VolumeSnapshot of `owner` for CSI snapshot `name` of volume `source` (whose PVC is
/// `pvc`).
pub fn host_snapshot(
    snap_name: &str,
    csi_name: &str,
    pvc: &PersistentVolumeClaim,
    class: Option<&str>,
    owner: &Owner,
) -> VolumeSnapshot {
    let spec = pvc.spec.clone().unwrap_or_default();
    let mut labels = owner.labels();
    labels.extend([
        (
            LABEL_SNAP_HOST_SC.to_string(),
            spec.storage_class_name.unwrap_or_default(),
        ),
        (
            LABEL_SNAP_HOST_VOLUME_MODE.to_string(),
            spec.volume_mode.unwrap_or_else(|| "Block".into()),
        ),
    ]);
    let annotations = (snap_name != csi_name)
        .then(|| BTreeMap::from([(ORIGINAL_NAME_ANNOTATION.to_string(), csi_name.to_string())]));
    VolumeSnapshot {
        metadata: ObjectMeta {
            name: Some(snap_name.to_string()),
            labels: Some(labels),
            annotations,
            ..Default::default()
        },
        spec: VolumeSnapshotSpec {
            source: VolumeSnapshotSource {
                persistent_volume_claim_name: pvc.metadata.name.clone(),
                volume_snapshot_content_name: None,
            },
            volume_snapshot_class_name: class.map(str::to_string),
        },
        status: None,
    }
}

/// Whether an existing VolumeSnapshot is the one CreateSnapshot asks for again.
pub fn existing_snapshot_matches(
    csi_name: &str,
    source: &str,
    snap: &VolumeSnapshot,
) -> Result<(), ControllerError> {
    let snap_name = snap.metadata.name.clone().unwrap_or_default();
    let created_for = snap
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_NAME_ANNOTATION))
        .map(String::as_str)
        .unwrap_or(&snap_name);
    let clash = |reason: String| ControllerError::AlreadyExists {
        name: csi_name.to_string(),
        pvc: format!("VolumeSnapshot {snap_name}"),
        reason,
    };
    if created_for != csi_name {
        return Err(clash(format!("for another snapshot name {created_for:?}")));
    }
    match snap.source_volume() {
        Some(s) if s == source => Ok(()),
        other => Err(clash(format!(
            "of volume {:?}, not {source}",
            other.unwrap_or("")
        ))),
    }
}

/// The CSI view of a VolumeSnapshot; `fallback_size` when Harvester has not reported one yet.
pub fn csi_snapshot(snap: &VolumeSnapshot, fallback_size: u64) -> Snapshot {
    let created = snap
        .status
        .as_ref()
        .and_then(|s| s.creation_time.as_deref())
        .and_then(|t| k8s_openapi::jiff::Timestamp::from_str(t).ok())
        .or_else(|| snap.metadata.creation_timestamp.as_ref().map(|t| t.0));
    Snapshot {
        size_bytes: i64::try_from(snap.restore_bytes().unwrap_or(fallback_size))
            .unwrap_or(i64::MAX),
        snapshot_id: snap.metadata.name.clone().unwrap_or_default(),
        source_volume_id: snap.source_volume().unwrap_or_default().to_string(),
        creation_time: created.map(|t| prost_types::Timestamp {
            seconds: t.as_second(),
            nanos: t.subsec_nanosecond(),
        }),
        ready_to_use: snap.ready(),
        group_snapshot_id: String::new(),
    }
}

/// One page of a list: entries from `start` (a decimal index token), at most `max` (0: all),
/// and the token of the next page.
pub fn page<T: Clone>(
    items: &[T],
    start: &str,
    max: i32,
) -> Result<(Vec<T>, String), ControllerError> {
    let from: usize = if start.is_empty() {
        0
    } else {
        start
            .parse()
            .ok()
            .filter(|n| *n <= items.len())
            .ok_or_else(|| ControllerError::BadToken(start.to_string()))?
    };
    let max = usize::try_from(max).map_err(|_| ArgError::Invalid {
        field: "max_entries",
        reason: format!("{max} is negative"),
    })?;
    let end = if max == 0 {
        items.len()
    } else {
        (from + max).min(items.len())
    };
    let next = if end < items.len() {
        end.to_string()
    } else {
        String::new()
    };
    Ok((items[from..end].to_vec(), next))
}

borrows_ctx!(Snapshots);

impl Snapshots<'_> {
    fn snapshots(&self) -> Api<VolumeSnapshot> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }

    /// PERMISSION_DENIED unless VolumeSnapshot `snap` is this guest cluster's.
    fn owned_snapshot(&self, snap: &VolumeSnapshot) -> Result<(), ControllerError> {
        self.owner
            .check("VolumeSnapshot", self.ns(), &snap.metadata)
    }

    /// Waits briefly (watch) for a snapshot to become ready; not ready is not an error.
    async fn settle(&self, snap: VolumeSnapshot) -> Result<VolumeSnapshot, ControllerError> {
        if snap.ready() {
            return Ok(snap);
        }
        let name = snap.metadata.name.clone().unwrap_or_default();
        let waited = wait_for(
            self.snapshots(),
            &name,
            format!("VolumeSnapshot {}/{name} to be ready", self.ns()),
            self.timeouts.snapshot_ready,
            |s: Option<&VolumeSnapshot>| s.is_none_or(|s| s.ready() || s.error().is_some()),
        )
        .await;
        let latest = match waited {
            Ok(Some(s)) => s,
            Ok(None) => {
                return Err(ControllerError::Precondition(format!(
                    "VolumeSnapshot {name} was deleted while it was being taken"
                )));
            }
            Err(ControllerError::Timeout { .. }) => snap,
            Err(e) => return Err(e),
        };
        if let Some(e) = latest.error() {
            return Err(ControllerError::Precondition(format!(
                "Harvester could not take snapshot {name}: {e}"
            )));
        }
        Ok(latest)
    }

    pub async fn create_snapshot(
        &self,
        req: CreateSnapshotRequest,
    ) -> Result<CreateSnapshotResponse, ControllerError> {
        let name = required("name", &req.name)?;
        let source = required("source_volume_id", &req.source_volume_id)?;
        let class = match SnapshotKind::parse(&req.parameters)? {
            SnapshotKind::Local { class } => class,
            SnapshotKind::Backup => return self.create_backup(name, source).await,
        };
        let snap_name = naming::host_volume_name(name);
        let _guard = self.begin(&format!("snapshot/{snap_name}"))?;
        let (snap, _) = get_or_create(
            &self.snapshots(),
            &snap_name,
            Deleting::Judge,
            |existing| {
                self.owned_snapshot(existing)?;
                existing_snapshot_matches(name, source, existing)
            },
            async {
                let pvc = self.existing(source).await?;
                Ok(host_snapshot(&snap_name, name, &pvc, class, &self.owner))
            },
        )
        .await?;
        let snap = self.settle(snap).await?;
        let fallback = match self.pvcs().get_opt(source).await {
            Ok(Some(pvc)) => requested_bytes(&pvc).unwrap_or(0),
            _ => 0,
        };
        Ok(CreateSnapshotResponse {
            snapshot: Some(csi_snapshot(&snap, fallback)),
        })
    }

    pub async fn delete_snapshot(
        &self,
        req: DeleteSnapshotRequest,
    ) -> Result<DeleteSnapshotResponse, ControllerError> {
        let id = required("snapshot_id", &req.snapshot_id)?;
        if let Some(backup) = backup::BackupId::parse("snapshot_id", id)? {
            return self.delete_backup(&backup).await;
        }
        if !naming::is_dns1123_label(id) {
            return Ok(DeleteSnapshotResponse {});
        }
        let _guard = self.begin(&format!("snapshot/{id}"))?;
        let what = format!("VolumeSnapshot {id}");
        match self.snapshots().get_opt(id).await {
            Ok(Some(snap)) => self.owned_snapshot(&snap)?,
            Ok(None) => return Ok(DeleteSnapshotResponse {}),
            Err(e) => return Err(ControllerError::api(format!("getting {what}"))(e)),
        }
        if delete_if_exists(&self.snapshots(), id, &what).await? {
            tracing::info!(snapshot = id, "deleted VolumeSnapshot");
        }
        Ok(DeleteSnapshotResponse {})
    }

    pub async fn list_snapshots(
        &self,
        req: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, ControllerError> {
        // Only snapshots this driver (or upstream's) made: they carry the restore labels.
        let mut snaps: Vec<VolumeSnapshot> = if !req.snapshot_id.is_empty() {
            if !naming::is_dns1123_label(&req.snapshot_id) {
                Vec::new()
            } else {
                self.snapshots()
                    .get_opt(&req.snapshot_id)
                    .await
                    .map_err(ControllerError::api(format!(
                        "getting VolumeSnapshot {}",
                        req.snapshot_id
                    )))?
                    .into_iter()
                    .collect()
            }
        } else {
            self.snapshots()
                .list(&kube::api::ListParams::default().labels(LABEL_SNAP_HOST_VOLUME_MODE))
                .await
                .map_err(ControllerError::api(format!(
                    "listing VolumeSnapshots in {}",
                    self.ns()
                )))?
                .items
        };
        snaps.retain(|s| self.owner.owns(&s.metadata));
        if !req.source_volume_id.is_empty() {
            snaps.retain(|s| s.source_volume() == Some(req.source_volume_id.as_str()));
        }
        // Then the remote backups, all in one order so pages never repeat or skip an entry.
        let mut all: Vec<Snapshot> = snaps.iter().map(|s| csi_snapshot(s, 0)).collect();
        all.extend(
            self.list_backups(&req.snapshot_id, &req.source_volume_id)
                .await?,
        );
        all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
        let (entries, next_token) = page(&all, &req.starting_token, req.max_entries)?;
        Ok(ListSnapshotsResponse {
            entries: entries
                .into_iter()
                .map(|s| list_snapshots_response::Entry { snapshot: Some(s) })
                .collect(),
            next_token,
        })
    }

    /// GetSnapshot: the snapshot (a VolumeSnapshot, or a remote backup by its `backup:` ID) as
    /// ListSnapshots shows it; NOT_FOUND when there is none.
    pub async fn get_snapshot(
        &self,
        req: GetSnapshotRequest,
    ) -> Result<GetSnapshotResponse, ControllerError> {
        let id = required("snapshot_id", &req.snapshot_id)?;
        let not_found = || ControllerError::SnapshotNotFound {
            namespace: self.ns().to_string(),
            snapshot: id.to_string(),
        };
        let snapshot = if backup::BackupId::parse("snapshot_id", id)?.is_some() {
            self.list_backups(id, "").await?.into_iter().next()
        } else if naming::is_dns1123_label(id) {
            let snap = self.snapshots().get_opt(id).await;
            let snap =
                snap.map_err(ControllerError::api(format!("getting VolumeSnapshot {id}")))?;
            if let Some(snap) = &snap {
                self.owned_snapshot(snap)?;
            }
            snap.map(|s| csi_snapshot(&s, 0))
        } else {
            None
        };
        Ok(GetSnapshotResponse {
            snapshot: Some(snapshot.ok_or_else(not_found)?),
        })
    }

    /// For CreateVolume from a snapshot: the VolumeSnapshot, which must exist and be ready.
    pub async fn restore_source(
        &self,
        snapshot_id: &str,
    ) -> Result<VolumeSnapshot, ControllerError> {
        let not_found = || ControllerError::SnapshotNotFound {
            namespace: self.ns().to_string(),
            snapshot: snapshot_id.to_string(),
        };
        if !naming::is_dns1123_label(snapshot_id) {
            return Err(not_found());
        }
        let snap = self
            .snapshots()
            .get_opt(snapshot_id)
            .await
            .map_err(ControllerError::api(format!(
                "getting VolumeSnapshot {snapshot_id}"
            )))?
            .ok_or_else(not_found)?;
        self.owned_snapshot(&snap)?;
        if !snap.ready() {
            return Err(ControllerError::NotReady(format!(
                "VolumeSnapshot {snapshot_id} is not ready to use yet"
            )));
        }
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pvc(name: &str) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"storageClassName": "lh", "volumeMode": "Block",
                     "resources": {"requests": {"storage": "64Mi"}}}
        }))
        .expect("pvc literal")
    }

    #[test]
    fn snapshots_carry_upstreams_restore_labels() {
        let s = host_snapshot(
            "snap-1",
            "snap-1",
            &pvc("pvc-1"),
            None,
            &Owner::new("rke2-a"),
        );
        let labels = s.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get(LABEL_SNAP_HOST_SC).map(String::as_str),
            Some("lh")
        );
        assert_eq!(
            labels.get(LABEL_SNAP_HOST_VOLUME_MODE).map(String::as_str),
            Some("Block")
        );
        assert_eq!(s.source_volume(), Some("pvc-1"));
        assert!(existing_snapshot_matches("snap-1", "pvc-1", &s).is_ok());
        assert!(matches!(
            existing_snapshot_matches("snap-1", "pvc-2", &s),
            Err(ControllerError::AlreadyExists { .. })
        ));
    }

    #[test]
    fn a_pending_snapshot_is_not_ready_rather_than_an_error() {
        let mut s = host_snapshot(
            "snap-1",
            "snap-1",
            &pvc("pvc-1"),
            None,
            &Owner::new("rke2-a"),
        );
        let c = csi_snapshot(&s, 64 << 20);
        assert!(!c.ready_to_use);
        assert_eq!(c.size_bytes, 64 << 20);
        s.status = Some(VolumeSnapshotStatus {
            ready_to_use: Some(true),
            restore_size: Some("66Mi".into()),
            creation_time: Some("2026-11-30T10:00:00Z".into()),
            ..Default::default()
        });
        let c = csi_snapshot(&s, 0);
        assert!(c.ready_to_use);
        assert_eq!(c.size_bytes, 66 << 20);
        assert_eq!(c.creation_time.map(|t| t.seconds), Some(1_796_032_800));
    }

    #[test]
    fn parameters_choose_local_or_backup_and_name_what_is_wrong() {
        let params = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        for (given, want) in [
            (params(&[]), SnapshotKind::Local { class: None }),
            (params(&[("type", "")]), SnapshotKind::Local { class: None }),
            (
                params(&[("hostVolumeSnapshotClass", "longhorn-snapshot")]),
                SnapshotKind::Local {
                    class: Some("longhorn-snapshot"),
                },
            ),
            (params(&[("type", "backup")]), SnapshotKind::Backup),
            (
                params(&[
                    ("type", "backup"),
                    ("csi.storage.k8s.io/volumesnapshot/name", "snap"),
                ]),
                SnapshotKind::Backup,
            ),
        ] {
            assert_eq!(SnapshotKind::parse(&given).unwrap(), want, "{given:?}");
        }
        for (given, says) in [
            (
                params(&[("type", "Backup")]),
                "type \"Backup\" is not a snapshot type",
            ),
            (params(&[("type", "remote")]), "type \"remote\""),
            (
                params(&[("typ", "backup")]),
                "unknown VolumeSnapshotClass parameter \"typ\"",
            ),
            (
                params(&[("type", "backup"), ("hostVolumeSnapshotClass", "lh")]),
                "hostVolumeSnapshotClass \"lh\" does not apply",
            ),
        ] {
            let e = SnapshotKind::parse(&given).unwrap_err();
            assert!(
                matches!(
                    e,
                    ArgError::Invalid {
                        field: "parameters",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains(says), "{given:?}: {e}");
        }
    }

    #[test]
    fn pages_follow_index_tokens() {
        let items: Vec<u32> = (0..5).collect();
        assert_eq!(page(&items, "", 2).unwrap(), (vec![0, 1], "2".into()));
        assert_eq!(
            page(&items, "2", 0).unwrap(),
            (vec![2, 3, 4], String::new())
        );
        assert_eq!(page(&items, "4", 2).unwrap(), (vec![4], String::new()));
        assert!(matches!(
            page(&items, "x", 0),
            Err(ControllerError::BadToken(_))
        ));
        assert!(matches!(
            page(&items, "6", 0),
            Err(ControllerError::BadToken(_))
        ));
        assert!(page(&items, "", -1).is_err());
    }
}
