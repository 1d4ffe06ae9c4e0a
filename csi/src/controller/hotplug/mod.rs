//! Hot-plugged volumes (every volume but RWX): the host PVC is made, resized and deleted here,
//! and hot-plugged into one VM at a time by `publish`. Restores from a snapshot or backup
//! ask [`crate::controller::snapshots`] for their source; nothing here calls back into the
//! dispatcher or into the NFS kind.

mod listing;
pub mod mode;
mod publish;
pub mod rules;
pub mod status;
mod unplug;

use csi_proto::csi::v1::*;
use harvester_common::api_error::is_forbidden;
use harvester_common::quantity;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use self::mode::HotplugModes;
use super::context::Ctx;
use super::host_pvc::{
    PARAM_HOST_STORAGE_CLASS, Params, Source, capacity_bytes, clone_size, csi_volume,
    existing_matches, host_pvc, requested_bytes, snapshot_restore_size,
};
use super::kube::{Deleting, delete_if_exists, get_or_create, wait_for};
use super::snapshots::Snapshots;
use super::snapshots::backup::BackupId;
use crate::error::{ArgError, ControllerError};
use crate::naming;
use crate::request::{self, Capability, required};

pub use publish::CONTEXT_TARGET;

/// The hot-plug kind: the [`Ctx`] every kind borrows (read through `Deref`), and how volumes
/// are hot-plugged (Harvester's `server-version`, followed while serving).
pub struct Hotplug<'a> {
    pub ctx: &'a Ctx,
    pub modes: &'a HotplugModes,
}

impl std::ops::Deref for Hotplug<'_> {
    type Target = Ctx;
    fn deref(&self) -> &Ctx {
        self.ctx
    }
}

impl Hotplug<'_> {
    /// CreateVolume of a hot-plugged volume: a host PVC, empty or from a snapshot, a backup or
    /// another volume.
    pub async fn create(
        &self,
        req: &CreateVolumeRequest,
        caps: &[Capability],
    ) -> Result<CreateVolumeResponse, ControllerError> {
        let name = required("name", &req.name)?;
        // A filesystem with a minimum size (xfs) raises the request to it when the limit allows.
        let capacity = request::capacity(
            "capacity_range",
            req.capacity_range.as_ref(),
            request::caps_floor(caps),
        )?;
        let request::Capacity { asked, limit, size } = capacity;
        let params = Params::parse(&req.parameters, self.host_storage_class.as_deref())?;
        let source = Source::of(req)?;
        let content_source = req.volume_content_source.clone();
        if let Some(from) = BackupId::of_source(source)? {
            let snapshots = Snapshots(self.ctx);
            let (id, size) = snapshots
                .restore_from_backup(name, &from, asked, limit)
                .await?;
            return Ok(CreateVolumeResponse {
                volume: Some(csi_volume(&id, size, content_source)),
            });
        }
        let pvc_name = naming::host_volume_name(name);
        let _guard = self.begin(&pvc_name)?;
        let deleting = Deleting::WaitGone {
            what: format!("the deleted PVC {}/{pvc_name} to go away", self.ns()),
            limit: self.timeouts.bind,
        };
        let (pvc, found) = get_or_create(
            &self.pvcs(),
            &pvc_name,
            deleting,
            |existing| {
                self.owned_pvc(existing)?;
                existing_matches(name, existing, size, limit, source)
            },
            self.new_pvc(&pvc_name, name, capacity, params, source),
        )
        .await?;
        let size = match found {
            Some(have) => have,
            None => {
                let size = requested_bytes(&pvc).unwrap_or(size);
                tracing::info!(volume = %pvc_name, name, size, class = ?pvc.spec.as_ref().and_then(|s| s.storage_class_name.clone()), source = ?source, "created Harvester PVC");
                size
            }
        };
        Ok(CreateVolumeResponse {
            volume: Some(csi_volume(&pvc_name, size, content_source)),
        })
    }

    /// The host PVC for a new volume of (rounded) `size`: a clone gets its source's class,
    /// mode and at least its size, a restore its snapshot's.
    async fn new_pvc(
        &self,
        pvc_name: &str,
        name: &str,
        capacity: request::Capacity,
        mut params: Params,
        source: Option<Source<'_>>,
    ) -> Result<PersistentVolumeClaim, ControllerError> {
        let request::Capacity {
            asked,
            limit,
            mut size,
        } = capacity;
        match source {
            Some(Source::Volume(source_id)) => {
                // Clone like Longhorn does: the source's class and volume mode, at least its size.
                let from = self.existing(source_id).await?;
                let from_bytes = requested_bytes(&from).unwrap_or(0);
                size = clone_size(size, asked, limit, source_id, from_bytes)?;
                params.clone_of(&from.spec.clone().unwrap_or_default());
            }
            Some(Source::Snapshot(snapshot_id)) => {
                // Restore like upstream: the snapshot's class and volume mode, at least its size.
                let snap = Snapshots(self.ctx).restore_source(snapshot_id).await?;
                let bytes = snap.restore_bytes().unwrap_or(0);
                size = snapshot_restore_size(size, limit, snapshot_id, bytes)?;
                params.restore_of(&snap.metadata.labels.clone().unwrap_or_default());
            }
            None => {}
        }
        if let Some(class) = params
            .storage_class
            .as_deref()
            .filter(|_| params.storage_class_from_param)
        {
            self.check_storage_class(class).await?;
        }
        Ok(host_pvc(pvc_name, name, size, &params, source, &self.owner))
    }

    /// The named Harvester StorageClass must exist; a forbidden read skips the check (upstream).
    async fn check_storage_class(&self, class: &str) -> Result<(), ControllerError> {
        let api: Api<StorageClass> = Api::all(self.harvester.client.clone());
        match api.get_opt(class).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(ArgError::Invalid {
                field: "parameters",
                reason: format!(
                    "{PARAM_HOST_STORAGE_CLASS} {class:?}: no such StorageClass on Harvester"
                ),
            }
            .into()),
            Err(e) if is_forbidden(&e) => Ok(()),
            Err(e) => Err(ControllerError::api(format!(
                "getting StorageClass {class}"
            ))(e)),
        }
    }

    /// The last step of every DeleteVolume: the host PVC goes, unless a VM still has it. The
    /// caller holds the volume's in-flight guard.
    pub async fn delete_host_pvc(&self, id: &str) -> Result<DeleteVolumeResponse, ControllerError> {
        // Deleting a published volume would leave its PVC Terminating while the disk stays
        // hot-plugged (the hot-plug pod holds the claim): refuse, naming the node.
        let (vms, vmis) = self.holders(id).await?;
        let fenced = self.fenced_vmis(id, "", &vms, &vmis).await?;
        if let Some(node) = rules::attached_elsewhere(id, "", &vms, &vmis, &fenced) {
            return Err(ControllerError::StillPublished {
                volume: id.to_string(),
                namespace: self.ns().to_string(),
                node,
            });
        }
        // A volume restored from a backup: its VolumeRemoteRestore goes first; the PVC it owns
        // is deleted below too, without waiting for Harvester's garbage collector.
        Snapshots(self.ctx).delete_restore(id).await?;
        if delete_if_exists(&self.pvcs(), id, &format!("PVC {id}")).await? {
            tracing::info!(volume = id, "deleted Harvester PVC");
        }
        Ok(DeleteVolumeResponse {})
    }

    /// Raises host PVC `pvc`'s request to `size` and waits (watch) until Harvester reports the
    /// capacity. A request at or below the current size is a no-op that reports the current
    /// size, so the 2 MiB rounding never turns a small expansion into a "shrink" (upstream bug
    /// #11716). The caller holds the volume's in-flight guard.
    pub async fn expand(
        &self,
        id: &str,
        pvc: &PersistentVolumeClaim,
        size: u64,
        node_expansion_required: bool,
    ) -> Result<ControllerExpandVolumeResponse, ControllerError> {
        let have = requested_bytes(pvc).unwrap_or(0);
        let target = size.max(have);
        if size > have {
            // Kubernetes only lets a bound claim grow.
            self.wait_bound(id).await?;
            let patch = json!({"spec": {"resources": {"requests": {"storage": quantity::from_bytes(size)}}}});
            self.pvcs()
                .patch(id, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(ControllerError::api(format!("resizing PVC {id}")))?;
            tracing::info!(
                volume = id,
                from = have,
                to = size,
                "expanding Harvester PVC"
            );
        }
        wait_for(
            self.pvcs(),
            id,
            format!(
                "PVC {}/{id} to report a capacity of {target} bytes",
                self.ns()
            ),
            self.timeouts.resize,
            move |p: Option<&PersistentVolumeClaim>| {
                p.and_then(capacity_bytes).is_some_and(|c| c >= target)
            },
        )
        .await?;
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: i64::try_from(target).unwrap_or(i64::MAX),
            node_expansion_required,
        })
    }
}
