//! Remote backups: a CSI snapshot taken with VolumeSnapshotClass parameter `type: backup` is a
//! Harvester `VolumeRemoteBackup` (VRB) of the volume's PVC, which Harvester's controller backs
//! up to the cluster's backup target; a volume made from it is a `VolumeRemoteRestore` (VRR),
//! for which Harvester creates a PVC of the same name, owned by the VRR.
//!
//! Names, labels, the snapshot ID `backup:<namespace>/<name>` and the CR shapes are upstream's
//! (harvester/harvester-csi-driver `pkg/csi/controller_server.go`; the types in harvester/harvester
//! `pkg/apis/harvesterhci.io/v1beta1/volumeremotebackup.go`), so backups made by either driver
//! restore with the other. Unlike upstream, a backup or restore still running is answered with
//! `ready_to_use: false` (CreateSnapshot) or UNAVAILABLE (CreateVolume), never INTERNAL, after
//! the same bounded watch as local snapshots; an unknown backup is NOT_FOUND; the same name
//! asked again for another source is ALREADY_EXISTS.

use std::collections::BTreeMap;

use csi_proto::csi::v1::*;
use harvester_common::api_error::{is_forbidden, is_not_found};
pub use harvester_common::harvester::backup::{
    LABEL_BACKUP_SOURCE_VOLUME, TYPE_LONGHORN, VolumeRemoteBackup, VolumeRemoteBackupSpec,
    VolumeRemoteRestore, VolumeRemoteRestoreSpec,
};
use kube::api::{Api, ListParams, ObjectMeta};

use super::Snapshots;
use crate::controller::host_pvc::{Source, out_of_range, requested_bytes, volume_labels};
use crate::controller::kube::{Deleting, delete_if_exists, get_or_create, wait_for};
use crate::controller::owner::{Claim, Owner};
use crate::error::{ArgError, ControllerError};
use crate::naming::{self, ORIGINAL_NAME_ANNOTATION};

/// Prefix of a backup's snapshot ID: `backup:<namespace>/<name>` of its VolumeRemoteBackup.
pub const BACKUP_ID_PREFIX: &str = "backup:";

/// A backup's snapshot ID, `backup:<namespace>/<name>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupId {
    pub namespace: String,
    pub name: String,
}

impl BackupId {
    /// The ID of backup `vrb`.
    pub fn of(vrb: &VolumeRemoteBackup) -> BackupId {
        BackupId {
            namespace: vrb.metadata.namespace.clone().unwrap_or_default(),
            name: vrb.metadata.name.clone().unwrap_or_default(),
        }
    }

    /// The backup a CreateVolume restores from, when its snapshot source is a `backup:` ID.
    pub fn of_source(source: Option<Source>) -> Result<Option<BackupId>, ArgError> {
        match source {
            Some(Source::Snapshot(id)) => {
                BackupId::parse("volume_content_source.snapshot.snapshot_id", id)
            }
            _ => Ok(None),
        }
    }

    /// `None` when `id` is not a backup ID (a local snapshot's); INVALID_ARGUMENT naming `field`
    /// when it starts with `backup:` but is not `backup:<namespace>/<name>`.
    pub fn parse(field: &'static str, id: &str) -> Result<Option<BackupId>, ArgError> {
        let Some(rest) = id.strip_prefix(BACKUP_ID_PREFIX) else {
            return Ok(None);
        };
        let bad = |reason: String| ArgError::Invalid {
            field,
            reason: format!(
                "{id:?} is not a backup ID {BACKUP_ID_PREFIX}<namespace>/<name>: {reason}"
            ),
        };
        let Some((namespace, name)) = rest.split_once('/') else {
            return Err(bad("it names no namespace".into()));
        };
        if !naming::is_dns1123_label(namespace) {
            return Err(bad(format!(
                "namespace {namespace:?} is not a Kubernetes namespace name"
            )));
        }
        if !naming::is_dns1123_label(name) {
            return Err(bad(format!(
                "name {name:?} is not a VolumeRemoteBackup name (lowercase letters, digits, '-')"
            )));
        }
        Ok(Some(BackupId {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }))
    }

    /// The VRR's `spec.from`: `<namespace>/<name>`.
    pub fn reference(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

impl std::fmt::Display for BackupId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{BACKUP_ID_PREFIX}{}/{}", self.namespace, self.name)
    }
}

/// The CSI name an object was made for: its [`ORIGINAL_NAME_ANNOTATION`], else its own name.
fn created_for(meta: &ObjectMeta) -> &str {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_NAME_ANNOTATION))
        .or(meta.name.as_ref())
        .map_or("", String::as_str)
}

fn original_name(host_name: &str, csi_name: &str) -> Option<BTreeMap<String, String>> {
    (host_name != csi_name)
        .then(|| BTreeMap::from([(ORIGINAL_NAME_ANNOTATION.to_string(), csi_name.to_string())]))
}

/// The VRB of `owner` for CSI snapshot `csi_name` (host name `vrb_name`) of volume `source`.
pub fn host_backup(
    vrb_name: &str,
    csi_name: &str,
    source: &str,
    owner: &Owner,
) -> VolumeRemoteBackup {
    let mut vrb = VolumeRemoteBackup::new(
        vrb_name,
        VolumeRemoteBackupSpec {
            kind: TYPE_LONGHORN.into(),
            source: source.into(),
        },
    );
    let mut labels = owner.labels();
    labels.insert(LABEL_BACKUP_SOURCE_VOLUME.to_string(), source.to_string());
    vrb.metadata.labels = Some(labels);
    vrb.metadata.annotations = original_name(vrb_name, csi_name);
    vrb
}

/// Whether an existing VRB is the backup CreateSnapshot asks for again.
pub fn existing_backup_matches(
    csi_name: &str,
    source: &str,
    vrb: &VolumeRemoteBackup,
) -> Result<(), ControllerError> {
    let clash = |reason: String| ControllerError::AlreadyExists {
        name: csi_name.to_string(),
        pvc: format!("VolumeRemoteBackup {}", BackupId::of(vrb).reference()),
        reason,
    };
    let made_for = created_for(&vrb.metadata);
    if made_for != csi_name {
        return Err(clash(format!("for another snapshot name {made_for:?}")));
    }
    if vrb.spec.source != source {
        return Err(clash(format!(
            "of volume {:?}, not {source}",
            vrb.spec.source
        )));
    }
    Ok(())
}

/// The CSI view of a VRB; `fallback_size` while Harvester has not recorded the source's spec.
pub fn csi_backup(vrb: &VolumeRemoteBackup, fallback_size: u64) -> Snapshot {
    Snapshot {
        size_bytes: i64::try_from(vrb.size_bytes().unwrap_or(fallback_size)).unwrap_or(i64::MAX),
        snapshot_id: BackupId::of(vrb).to_string(),
        source_volume_id: vrb.spec.source.clone(),
        creation_time: vrb
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| prost_types::Timestamp {
                seconds: t.0.as_second(),
                nanos: t.0.subsec_nanosecond(),
            }),
        ready_to_use: vrb.ready(),
        group_snapshot_id: String::new(),
    }
}

/// The VRR of `owner` restoring `from` into volume `vol_name` (CSI name `csi_name`).
pub fn host_restore(
    vol_name: &str,
    csi_name: &str,
    from: &BackupId,
    owner: &Owner,
) -> VolumeRemoteRestore {
    let mut vrr = VolumeRemoteRestore::new(
        vol_name,
        VolumeRemoteRestoreSpec {
            kind: TYPE_LONGHORN.into(),
            from: from.reference(),
        },
    );
    vrr.metadata.annotations = original_name(vol_name, csi_name);
    vrr.metadata.labels = Some(owner.labels());
    vrr
}

/// Whether an existing VRR is the restore CreateVolume asks for again.
pub fn existing_restore_matches(
    csi_name: &str,
    from: &BackupId,
    vrr: &VolumeRemoteRestore,
) -> Result<(), ControllerError> {
    let clash = |reason: String| ControllerError::AlreadyExists {
        name: csi_name.to_string(),
        pvc: format!(
            "VolumeRemoteRestore {}",
            vrr.metadata.name.as_deref().unwrap_or_default()
        ),
        reason,
    };
    let made_for = created_for(&vrr.metadata);
    if made_for != csi_name {
        return Err(clash(format!("for another volume name {made_for:?}")));
    }
    if vrr.spec.from != from.reference() {
        return Err(clash(format!("from {:?}, not {from}", vrr.spec.from)));
    }
    Ok(())
}

/// The size of a volume restored from a backup of `backup_bytes`: Harvester makes the PVC with
/// the backed-up request, so a larger `required_bytes` (`asked`) or a `limit` below it cannot be
/// met: OUT_OF_RANGE (expand the volume after the restore instead).
pub fn restore_size(
    asked: u64,
    limit: u64,
    from: &BackupId,
    backup_bytes: u64,
) -> Result<u64, ArgError> {
    if asked > backup_bytes {
        return Err(out_of_range(format!(
            "required_bytes {asked} is above backup {from} ({backup_bytes} bytes); a volume \
             restored from a backup has the backed-up size: restore, then expand it"
        )));
    }
    if limit > 0 && backup_bytes > limit {
        return Err(out_of_range(format!(
            "backup {from} is {backup_bytes} bytes, above limit_bytes {limit}"
        )));
    }
    Ok(backup_bytes)
}

impl Snapshots<'_> {
    fn backups(&self, namespace: &str) -> Api<VolumeRemoteBackup> {
        Api::namespaced(self.harvester.client.clone(), namespace)
    }
    fn restores(&self) -> Api<VolumeRemoteRestore> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }

    /// CreateSnapshot with `type: backup`: get or create the VRB, then wait (watch, bounded)
    /// for `status.success`; still running is `ready_to_use: false`.
    pub async fn create_backup(
        &self,
        name: &str,
        source: &str,
    ) -> Result<CreateSnapshotResponse, ControllerError> {
        let vrb_name = naming::host_volume_name(name);
        let _guard = self.begin(&format!("snapshot/{vrb_name}"))?;
        let api = self.backups(self.ns());
        let (vrb, _) = get_or_create(
            &api,
            &vrb_name,
            Deleting::Judge,
            |existing| {
                self.owned_backup(existing)?;
                existing_backup_matches(name, source, existing)
            },
            async {
                self.existing(source).await?;
                Ok(host_backup(&vrb_name, name, source, &self.owner))
            },
        )
        .await?;
        let vrb = if vrb.ready() {
            vrb
        } else {
            let waited = wait_for(
                api.clone(),
                &vrb_name,
                format!("VolumeRemoteBackup {}/{vrb_name} to succeed", self.ns()),
                self.timeouts.snapshot_ready,
                |b: Option<&VolumeRemoteBackup>| b.is_none_or(VolumeRemoteBackup::ready),
            )
            .await;
            match waited {
                Ok(Some(b)) => b,
                Ok(None) => {
                    return Err(ControllerError::Precondition(format!(
                        "VolumeRemoteBackup {vrb_name} was deleted while it was being taken"
                    )));
                }
                Err(ControllerError::Timeout { .. }) => vrb,
                Err(e) => return Err(e),
            }
        };
        let fallback = match self.pvcs().get_opt(source).await {
            Ok(Some(pvc)) => requested_bytes(&pvc).unwrap_or(0),
            _ => 0,
        };
        Ok(CreateSnapshotResponse {
            snapshot: Some(csi_backup(&vrb, fallback)),
        })
    }

    /// DeleteSnapshot of a backup: delete the VRB; gone already is success.
    pub async fn delete_backup(
        &self,
        id: &BackupId,
    ) -> Result<DeleteSnapshotResponse, ControllerError> {
        if id.namespace != self.ns() {
            // Never another namespace's: even an opted-in cluster only reads those.
            return Err(ControllerError::NotOwned {
                kind: "VolumeRemoteBackup",
                namespace: id.namespace.clone(),
                name: id.name.clone(),
                cluster: self.owner.cluster.clone(),
                found: format!("it is in another namespace than {:?}", self.ns()),
            });
        }
        let _guard = self.begin(&format!("snapshot/{}", id.name))?;
        let what = format!("VolumeRemoteBackup {}", id.reference());
        match self.backups(&id.namespace).get_opt(&id.name).await {
            Ok(Some(vrb)) => self.owned_backup(&vrb)?,
            Ok(None) => return Ok(DeleteSnapshotResponse {}),
            Err(e) => return Err(ControllerError::api(format!("getting {what}"))(e)),
        }
        if delete_if_exists(&self.backups(&id.namespace), &id.name, &what).await? {
            tracing::info!(backup = %id, "deleted VolumeRemoteBackup");
        }
        Ok(DeleteSnapshotResponse {})
    }

    /// The backups ListSnapshots reports: by ID, else this cluster's VRBs of its namespace
    /// carrying the source label (of `source_volume_id` when given). With
    /// `--allow-cross-namespace-backups` (as upstream) the VRBs of every namespace too; without
    /// the cluster-wide read that needs (an optional binding) the own namespace's.
    pub async fn list_backups(
        &self,
        snapshot_id: &str,
        source_volume_id: &str,
    ) -> Result<Vec<Snapshot>, ControllerError> {
        let mut vrbs = if !snapshot_id.is_empty() {
            // A local snapshot's ID or a malformed backup ID names no backup.
            let Ok(Some(id)) = BackupId::parse("snapshot_id", snapshot_id) else {
                return Ok(Vec::new());
            };
            if id.namespace != self.ns() && !self.cross_namespace_backups {
                return Ok(Vec::new());
            }
            self.backups(&id.namespace)
                .get_opt(&id.name)
                .await
                .map_err(ControllerError::api(format!(
                    "getting VolumeRemoteBackup {}",
                    id.reference()
                )))?
                .into_iter()
                .collect()
        } else {
            let params = ListParams::default().labels(&if source_volume_id.is_empty() {
                LABEL_BACKUP_SOURCE_VOLUME.to_string()
            } else {
                format!("{LABEL_BACKUP_SOURCE_VOLUME}={source_volume_id}")
            });
            let all: Api<VolumeRemoteBackup> = Api::all(self.harvester.client.clone());
            let listed = if self.cross_namespace_backups {
                all.list(&params).await
            } else {
                self.backups(self.ns()).list(&params).await
            };
            match listed {
                Ok(l) => l.items,
                Err(e) if is_forbidden(&e) => {
                    self.backups(self.ns())
                        .list(&params)
                        .await
                        .map_err(ControllerError::api(format!(
                            "listing VolumeRemoteBackups in {}",
                            self.ns()
                        )))?
                        .items
                }
                Err(e) => {
                    return Err(ControllerError::api("listing VolumeRemoteBackups")(e));
                }
            }
        };
        // This namespace's backups only where they are this cluster's; another namespace's
        // were listed only when opted in.
        vrbs.retain(|b| {
            b.metadata.namespace.as_deref() != Some(self.ns()) || self.owner.owns(&b.metadata)
        });
        if !source_volume_id.is_empty() {
            vrbs.retain(|b| b.spec.source == source_volume_id);
        }
        Ok(vrbs.iter().map(|b| csi_backup(b, 0)).collect())
    }

    /// CreateVolume from a backup: get or create the VRR named like the volume, then wait
    /// (watch, bounded like the snapshot wait) for `status.success`; a restore still running is
    /// UNAVAILABLE so the provisioner asks again. Returns the volume ID and size.
    pub async fn restore_from_backup(
        &self,
        name: &str,
        from: &BackupId,
        asked: u64,
        limit: u64,
    ) -> Result<(String, u64), ControllerError> {
        let vol = naming::host_volume_name(name);
        if from.namespace != self.ns() && !self.cross_namespace_backups {
            return Err(ControllerError::CrossNamespaceBackup {
                backup: from.to_string(),
                namespace: from.namespace.clone(),
                own: self.ns().to_string(),
                action: "restoring",
            });
        }
        let _guard = self.begin(&vol)?;
        let vrb = self
            .backups(&from.namespace)
            .get_opt(&from.name)
            .await
            .map_err(ControllerError::api(format!(
                "getting VolumeRemoteBackup {}",
                from.reference()
            )))?
            .ok_or_else(|| ControllerError::BackupNotFound {
                namespace: from.namespace.clone(),
                name: from.name.clone(),
            })?;
        if from.namespace == self.ns() {
            self.owned_backup(&vrb)?;
        }
        if !vrb.ready() {
            return Err(ControllerError::NotReady(format!(
                "backup {from} is not ready to use yet (VolumeRemoteBackup status.success is not true)"
            )));
        }
        let bytes = vrb.size_bytes().ok_or_else(|| {
            ControllerError::Precondition(format!(
                "backup {from}: VolumeRemoteBackup has no status.sourceSpec.resources.requests.storage"
            ))
        })?;
        let size = restore_size(asked, limit, from, bytes)?;
        let api = self.restores();
        let (vrr, _) = get_or_create(
            &api,
            &vol,
            Deleting::Judge,
            |existing| {
                self.owner
                    .check("VolumeRemoteRestore", self.ns(), &existing.metadata)?;
                existing_restore_matches(name, from, existing)
            },
            async {
                // A volume of that name made another way is a clash, not a restore.
                let pvc = self
                    .pvcs()
                    .get_opt(&vol)
                    .await
                    .map_err(ControllerError::api(format!("getting PVC {vol}")))?;
                match pvc {
                    Some(_) => Err(ControllerError::AlreadyExists {
                        name: name.to_string(),
                        pvc: vol.clone(),
                        reason: format!("no VolumeRemoteRestore: it was not restored from {from}"),
                    }),
                    None => Ok(host_restore(&vol, name, from, &self.owner)),
                }
            },
        )
        .await?;
        if !vrr.ready() {
            let waited = wait_for(
                api.clone(),
                &vol,
                format!("VolumeRemoteRestore {}/{vol} to succeed", self.ns()),
                self.timeouts.snapshot_ready,
                |r: Option<&VolumeRemoteRestore>| r.is_none_or(VolumeRemoteRestore::ready),
            )
            .await;
            match waited {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(ControllerError::Precondition(format!(
                        "VolumeRemoteRestore {vol} was deleted while restoring {from}"
                    )));
                }
                Err(ControllerError::Timeout { after, .. }) => {
                    return Err(ControllerError::NotReady(format!(
                        "volume {vol} is still being restored from {from} (VolumeRemoteRestore \
                         {}/{vol} not successful after {after:?}); ask again",
                        self.ns()
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        self.label_restored(&vol).await?;
        Ok((vol, size))
    }

    /// Harvester makes a restored volume's PVC without the driver's labels: they are added
    /// once the restore succeeded, so the volume is this cluster's like any other.
    async fn label_restored(&self, vol: &str) -> Result<(), ControllerError> {
        let pvc = self
            .pvcs()
            .get_opt(vol)
            .await
            .map_err(ControllerError::api(format!("getting PVC {vol}")))?
            .ok_or_else(|| {
                ControllerError::NotReady(format!(
                    "volume {vol}: Harvester has not made the restored PVC yet; ask again"
                ))
            })?;
        // Never take a PVC another cluster's label claims (there should be none by this name).
        if matches!(self.owner.claim(&pvc.metadata), Claim::Other(_)) {
            self.owned_pvc(&pvc)?;
        }
        let labels = volume_labels(&self.owner);
        let have = pvc.metadata.labels.unwrap_or_default();
        if labels.iter().all(|(k, v)| have.get(k) == Some(v)) {
            return Ok(());
        }
        let patch = serde_json::json!({"metadata": {"labels": labels}});
        self.pvcs()
            .patch(
                vol,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .map_err(ControllerError::api(format!(
                "labelling restored PVC {vol}"
            )))?;
        Ok(())
    }

    /// PERMISSION_DENIED unless VRB `vrb` (of this namespace) is this guest cluster's.
    fn owned_backup(&self, vrb: &VolumeRemoteBackup) -> Result<(), ControllerError> {
        self.owner
            .check("VolumeRemoteBackup", self.ns(), &vrb.metadata)
    }

    /// DeleteVolume of a restored volume: delete its VRR (Harvester's garbage collector then
    /// deletes the PVC it owns). Whether there was one; a role that may not delete VRRs (one
    /// granted before backups existed) is logged and taken as none.
    pub async fn delete_restore(&self, id: &str) -> Result<bool, ControllerError> {
        match self
            .restores()
            .delete(id, &kube::api::DeleteParams::default())
            .await
        {
            Ok(_) => {
                tracing::info!(volume = id, "deleted VolumeRemoteRestore");
                Ok(true)
            }
            Err(e) if is_not_found(&e) => Ok(false),
            // A role from before backups (no volumeremoterestores) must not stop every delete.
            Err(e) if is_forbidden(&e) => {
                tracing::warn!(
                    volume = id,
                    "may not delete VolumeRemoteRestores (grant volumeremoterestores, see docs/install.md); deleting the PVC only"
                );
                Ok(false)
            }
            Err(e) => Err(ControllerError::api(format!(
                "deleting VolumeRemoteRestore {id}"
            ))(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner() -> Owner {
        Owner::new("rke2-a")
    }
    use serde_json::json;

    fn id(ns: &str, name: &str) -> BackupId {
        BackupId {
            namespace: ns.into(),
            name: name.into(),
        }
    }

    #[test]
    fn backup_ids_are_upstreams_namespaced_form() {
        assert_eq!(BackupId::parse("f", "snap-1").unwrap(), None);
        let got = BackupId::parse("f", "backup:guest-vms/snap-1").unwrap();
        assert_eq!(got, Some(id("guest-vms", "snap-1")));
        assert_eq!(got.unwrap().to_string(), "backup:guest-vms/snap-1");
        for (bad, says) in [
            ("backup:foo", "no namespace"),
            ("backup:/foo", "namespace \"\""),
            ("backup:ns/", "name \"\""),
            ("backup:ns/a/b", "name \"a/b\""),
            ("backup:NS/foo", "namespace \"NS\""),
        ] {
            let e = BackupId::parse("volume_content_source.snapshot.snapshot_id", bad)
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("volume_content_source.snapshot.snapshot_id: ")
                    && e.contains(&format!("{bad:?}"))
                    && e.contains(says),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_backup_is_a_labelled_vrb_of_the_volume() {
        let vrb = host_backup("snap-1", "snap-1", "pvc-1", &owner());
        let v = serde_json::to_value(&vrb).unwrap();
        assert_eq!(v["apiVersion"], "harvesterhci.io/v1beta1");
        assert_eq!(v["kind"], "VolumeRemoteBackup");
        assert_eq!(v["spec"], json!({"type": "lh", "source": "pvc-1"}));
        assert_eq!(
            v["metadata"]["labels"],
            json!({
                "harvesterhci.io/backupSourceVolume": "pvc-1",
                "guestcluster.harvesterhci.io/name": "rke2-a"
            })
        );
        assert!(existing_backup_matches("snap-1", "pvc-1", &vrb).is_ok());
        assert!(matches!(
            existing_backup_matches("snap-1", "pvc-2", &vrb),
            Err(ControllerError::AlreadyExists { .. })
        ));
        let mapped = naming::host_volume_name("Snap-A");
        let vrb = host_backup(&mapped, "Snap-A", "pvc-1", &owner());
        assert!(existing_backup_matches("Snap-A", "pvc-1", &vrb).is_ok());
        assert!(existing_backup_matches("snap-a", "pvc-1", &vrb).is_err());
    }

    #[test]
    fn a_pending_backup_is_not_ready_and_a_done_one_has_the_source_size() {
        let mut vrb = host_backup("snap-1", "snap-1", "pvc-1", &owner());
        vrb.metadata.namespace = Some("guest-vms".into());
        let s = csi_backup(&vrb, 64 << 20);
        assert_eq!(
            (s.snapshot_id.as_str(), s.source_volume_id.as_str()),
            ("backup:guest-vms/snap-1", "pvc-1")
        );
        assert!(!s.ready_to_use);
        assert_eq!(s.size_bytes, 64 << 20);
        // The status as Harvester's VRB controller writes it (UpdateSourceSpec copies the PVC spec).
        vrb.status = Some(
            serde_json::from_value(json!({
                "handle": "bs://backup-1", "csiProvider": "driver.longhorn.io", "success": true,
                "sourceSpec": {"accessModes": ["ReadWriteMany"], "volumeMode": "Block",
                               "resources": {"requests": {"storage": "66Mi"}}}
            }))
            .unwrap(),
        );
        let s = csi_backup(&vrb, 0);
        assert!(s.ready_to_use);
        assert_eq!(s.size_bytes, 66 << 20);
    }

    #[test]
    fn a_restore_is_a_vrr_from_the_backup_with_its_size() {
        let from = id("other-ns", "snap-1");
        let vrr = host_restore("pvc-9", "pvc-9", &from, &owner());
        let v = serde_json::to_value(&vrr).unwrap();
        assert_eq!(v["kind"], "VolumeRemoteRestore");
        assert_eq!(v["spec"], json!({"type": "lh", "from": "other-ns/snap-1"}));
        assert!(existing_restore_matches("pvc-9", &from, &vrr).is_ok());
        assert!(existing_restore_matches("pvc-9", &id("other-ns", "snap-2"), &vrr).is_err());
        const MI: u64 = 1 << 20;
        assert_eq!(restore_size(0, 0, &from, 64 * MI).unwrap(), 64 * MI);
        assert_eq!(restore_size(64 * MI, 0, &from, 64 * MI).unwrap(), 64 * MI);
        assert_eq!(
            restore_size(10 * MI, 128 * MI, &from, 64 * MI).unwrap(),
            64 * MI
        );
        for (asked, limit) in [(65 * MI, 0), (0, 32 * MI)] {
            let e = restore_size(asked, limit, &from, 64 * MI).unwrap_err();
            assert!(matches!(e, ArgError::OutOfRange { .. }), "{e}");
            assert!(e.to_string().contains("backup:other-ns/snap-1"), "{e}");
        }
    }
}
