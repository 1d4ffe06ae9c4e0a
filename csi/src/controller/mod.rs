//! Controller service: the CSI trait and the dispatcher. Each RPC finds the volume's kind once
//! ([`VolumeKind`]: from the request's capabilities where it has them, else from one read of
//! the host PVC) and hands the request to that kind's module:
//!
//! - [`hotplug`]: a host PVC hot-plugged into one VM at a time (KubeVirt `addvolume`); also the
//!   host PVC's creation, expansion and deletion for every volume.
//! - [`nfs`]: an RWX (MULTI_NODE_MULTI_WRITER) volume, served over NFS by Longhorn's share
//!   manager through a NetworkFilesystem; never hot-plugged.
//! - [`snapshots`]: snapshots (a Harvester VolumeSnapshot) and remote backups (a
//!   VolumeRemoteBackup), and the restores from them.
//!
//! Below them: [`host_pvc`] (pure rules of the host PVC), [`kube`] (get-or-create, bounded
//! waits, delete-if-exists) and [`context`] (the client, settings and shared reads every
//! module borrows). The arrows go down only: this module calls the kinds, `hotplug` calls
//! `snapshots` for a restore's source, and no module calls back up.
//!
//! Capabilities are exactly what is implemented: create/delete (also from a snapshot or a
//! backup, or as a clone of another volume), publish/unpublish, list volumes with their
//! published nodes, get a volume with its condition, expand (not RWX), and create/delete/list
//! snapshots and backups, and get one snapshot. GetCapacity and
//! ModifyVolume are not offered (the generated stubs answer UNIMPLEMENTED); see docs/csi.md.

mod context;
pub mod host_pvc;
pub mod hotplug;
mod kube;
pub mod nfs;
pub mod owner;
pub mod snapshots;
mod vm_cache;

use csi_proto::csi::v1::controller_server::Controller;
use csi_proto::csi::v1::controller_service_capability::{self, rpc};
use csi_proto::csi::v1::validate_volume_capabilities_response::Confirmed;
use csi_proto::csi::v1::*;
use harvester_common::cloud_config::Harvester;
use harvester_common::names::is_dns1123_label;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use tonic::{Request, Response, Status};

pub use host_pvc::{HostVolumeMode, Params};

use self::context::Ctx;
pub use self::context::guest_client;
use self::hotplug::Hotplug;
use self::nfs::Nfs;
use self::snapshots::Snapshots;
use crate::Config;
use crate::error::{ArgError, ControllerError};
use crate::inflight::InFlight;
use crate::request::{self, Capability, required};
use crate::rpc::rpc;

pub struct ControllerService {
    ctx: Ctx,
    /// How volumes are hot-plugged (Harvester's `server-version`), followed while serving.
    modes: hotplug::mode::HotplugModes,
}

/// The controller RPCs this driver implements.
pub const CAPABILITIES: [rpc::Type; 11] = [
    rpc::Type::CreateDeleteVolume,
    rpc::Type::PublishUnpublishVolume,
    rpc::Type::ListVolumes,
    rpc::Type::ListVolumesPublishedNodes,
    rpc::Type::GetVolume,
    rpc::Type::VolumeCondition,
    rpc::Type::ExpandVolume,
    rpc::Type::CreateDeleteSnapshot,
    rpc::Type::ListSnapshots,
    rpc::Type::GetSnapshot,
    rpc::Type::CloneVolume,
];

/// How a volume is served, which decides the module that handles it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeKind {
    /// Hot-plugged into one VM at a time ([`hotplug`]).
    Hotplug,
    /// RWX, served over NFS through the NetworkFilesystem of PV `pv` ([`nfs`]).
    Nfs { pv: String },
}

/// Whether `caps` ask for an RWX (MULTI_NODE_MULTI_WRITER) volume: the kind of a volume that
/// CreateVolume and ControllerPublish are about, known before any read.
fn wants_rwx(caps: &[Capability]) -> bool {
    caps.iter().any(Capability::is_rwx)
}

impl ControllerService {
    pub fn new(
        harvester: Harvester,
        guest: Option<::kube::Client>,
        hotplug: hotplug::mode::HotplugModes,
        config: &Config,
    ) -> Self {
        let vm_cache = vm_cache::VmCache::start(&harvester.client, &harvester.namespace);
        if config.cluster_name == crate::DEFAULT_CLUSTER_NAME {
            tracing::warn!(
                "--cluster-name is {:?}: every guest cluster left at this default shares its volumes on Harvester with the others; set the chart's clusterName (docs/security.md)",
                crate::DEFAULT_CLUSTER_NAME
            );
        }
        if config.adopt_unlabelled_volumes {
            tracing::warn!(
                "--adopt-unlabelled-volumes: host PVCs, snapshots and backups without the {} label are taken as this cluster's, so a volume ID can reach another guest cluster's unlabelled volumes in namespace {}; unset it once the switch from upstream is done (docs/install.md)",
                owner::LABEL_GUEST_CLUSTER,
                harvester.namespace
            );
        }
        ControllerService {
            modes: hotplug,
            ctx: Ctx {
                vm_cache,
                guest,
                harvester,
                host_storage_class: config.host_storage_class.clone(),
                max_volumes_per_node: config.max_volumes_per_node,
                timeouts: config.timeouts.clone(),
                inflight: InFlight::default(),
                rwx: tokio::sync::OnceCell::new(),
                owner: owner::Owner {
                    cluster: config.cluster_name.clone(),
                    adopt_unlabelled: config.adopt_unlabelled_volumes,
                },
                cross_namespace_backups: config.cross_namespace_backups,
            },
        }
    }

    fn hotplug(&self) -> Hotplug<'_> {
        Hotplug {
            ctx: &self.ctx,
            modes: &self.modes,
        }
    }

    /// The kind of the volume whose host PVC is `pvc` (none: hot-plug, whose path answers a
    /// missing volume). Asks for its NetworkFilesystem only when the PVC is shaped like RWX.
    async fn kind_of(
        &self,
        pvc: Option<&PersistentVolumeClaim>,
    ) -> Result<VolumeKind, ControllerError> {
        let pv = match pvc {
            Some(pvc) => Nfs(&self.ctx).serving(pvc).await?,
            None => None,
        };
        Ok(pv.map_or(VolumeKind::Hotplug, |pv| VolumeKind::Nfs { pv }))
    }

    async fn create(
        &self,
        req: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, ControllerError> {
        required("name", &req.name)?;
        let caps = request::capabilities("volume_capabilities", &req.volume_capabilities)?;
        if wants_rwx(&caps) {
            Nfs(&self.ctx).create(&req, &caps).await
        } else {
            self.hotplug().create(&req, &caps).await
        }
    }

    async fn delete(
        &self,
        req: DeleteVolumeRequest,
    ) -> Result<DeleteVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        if !is_dns1123_label(id) {
            // No PVC can have this name: it was never created, so it is deleted.
            return Ok(DeleteVolumeResponse {});
        }
        let _guard = self.ctx.begin(id)?;
        let pvc = self.ctx.pvc(id).await?;
        if let VolumeKind::Nfs { pv } = self.kind_of(pvc.as_ref()).await? {
            // An RWX volume: its NetworkFilesystem goes first, then the PVC (below).
            Nfs(&self.ctx).delete(&pv).await?;
        }
        self.hotplug().delete_host_pvc(id).await
    }

    async fn publish(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> Result<ControllerPublishVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        let node = request::node_id("node_id", &req.node_id)?;
        let cap = request::capability("volume_capability", req.volume_capability.as_ref())?;
        if wants_rwx(&[cap]) {
            Nfs(&self.ctx).publish(id, node).await
        } else {
            self.hotplug().publish(id, node).await
        }
    }

    async fn unpublish(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> Result<ControllerUnpublishVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        if !req.node_id.is_empty() {
            request::node_id("node_id", &req.node_id)?;
        }
        let pvc = self.ctx.pvc(id).await?;
        let kind = self.kind_of(pvc.as_ref()).await?;
        let _guard = self.ctx.begin(id)?;
        match kind {
            VolumeKind::Nfs { pv } => Nfs(&self.ctx).unpublish(id, &pv, &req.node_id).await?,
            VolumeKind::Hotplug => self.hotplug().unpublish(id, &req.node_id).await?,
        }
        Ok(ControllerUnpublishVolumeResponse {})
    }

    async fn validate(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
    ) -> Result<ValidateVolumeCapabilitiesResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(ArgError::Missing {
                field: "volume_capabilities",
            }
            .into());
        }
        let pvc = self.ctx.existing(id).await?;
        let not_confirmed = |message: String| ValidateVolumeCapabilitiesResponse {
            confirmed: None,
            message,
        };
        // Unsupported capabilities are not an error here: the answer is "not confirmed".
        let caps = match request::capabilities("volume_capabilities", &req.volume_capabilities) {
            Ok(caps) => caps,
            Err(e) => return Ok(not_confirmed(e.to_string())),
        };
        let is_rwx = self.kind_of(Some(&pvc)).await? != VolumeKind::Hotplug;
        if let Some(why) = nfs::kind_mismatch(id, wants_rwx(&caps), is_rwx) {
            return Ok(not_confirmed(why));
        }
        if let Err(e) = Params::parse(&req.parameters, self.ctx.host_storage_class.as_deref()) {
            return Ok(not_confirmed(e.to_string()));
        }
        Ok(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: Default::default(),
            }),
            message: String::new(),
        })
    }

    async fn expand(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpandVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        let range = req.capacity_range.as_ref().ok_or(ArgError::Missing {
            field: "capacity_range",
        })?;
        let size = request::volume_size("capacity_range", Some(range))?;
        let cap = req
            .volume_capability
            .as_ref()
            .map(|c| Capability::parse("volume_capability", c))
            .transpose()?;
        let node_expansion_required = !cap.is_some_and(|c| c.is_block());
        let _guard = self.ctx.begin(id)?;
        let pvc = self.ctx.existing(id).await?;
        match self.kind_of(Some(&pvc)).await? {
            VolumeKind::Nfs { .. } => Err(nfs::expand_refused(id)),
            VolumeKind::Hotplug => {
                self.hotplug()
                    .expand(id, &pvc, size, node_expansion_required)
                    .await
            }
        }
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let name = req.name.clone();
        rpc("CreateVolume", &name, self.create(req)).await
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("DeleteVolume", &id, self.delete(req)).await
    }

    async fn controller_publish_volume(
        &self,
        request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("ControllerPublishVolume", &id, self.publish(req)).await
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("ControllerUnpublishVolume", &id, self.unpublish(req)).await
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("ValidateVolumeCapabilities", &id, self.validate(req)).await
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: CAPABILITIES
                .iter()
                .map(|t| ControllerServiceCapability {
                    r#type: Some(controller_service_capability::Type::Rpc(
                        controller_service_capability::Rpc { r#type: *t as i32 },
                    )),
                })
                .collect(),
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        let id = req.source_volume_id.clone();
        rpc(
            "CreateSnapshot",
            &id,
            Snapshots(&self.ctx).create_snapshot(req),
        )
        .await
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        let id = req.snapshot_id.clone();
        rpc(
            "DeleteSnapshot",
            &id,
            Snapshots(&self.ctx).delete_snapshot(req),
        )
        .await
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        let id = req.source_volume_id.clone();
        rpc(
            "ListSnapshots",
            &id,
            Snapshots(&self.ctx).list_snapshots(req),
        )
        .await
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let req = request.into_inner();
        let token = req.starting_token.clone();
        rpc("ListVolumes", &token, self.hotplug().list_volumes(&req)).await
    }

    async fn controller_get_volume(
        &self,
        request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("ControllerGetVolume", &id, self.hotplug().get_volume(&req)).await
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        let req = request.into_inner();
        let id = req.snapshot_id.clone();
        rpc("GetSnapshot", &id, Snapshots(&self.ctx).get_snapshot(req)).await
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("ControllerExpandVolume", &id, self.expand(req)).await
    }
}
