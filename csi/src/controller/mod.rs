//! Controller service: Harvester PVCs for volumes (`volumes`), KubeVirt hot-plug for
//! publish/unpublish (`publish`).
//!
//! Capabilities are exactly what is implemented: create/delete (also from a snapshot or, as a
//! clone, from another volume), publish/unpublish, expand, and create/delete/list snapshots
//! (`snapshots`). ListVolumes, GetCapacity, GetSnapshot, ControllerGetVolume and ModifyVolume are not offered
//! (the generated stubs answer UNIMPLEMENTED); see docs/csi.md.

pub mod hotplug_mode;
mod publish;
mod rwx;
pub mod snapshots;
mod volumes;

use std::time::Duration;

use csi_proto::csi::v1::controller_server::Controller;
use csi_proto::csi::v1::controller_service_capability::{self, rpc};
use csi_proto::csi::v1::*;
use harvester_common::cloud_config::Harvester;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::Api;
use kube::runtime::wait::{Condition, await_condition};
use tonic::{Request, Response, Status};

pub use volumes::{HostVolumeMode, Params};

use crate::error::ControllerError;
use crate::inflight::InFlight;
use crate::rpc::rpc;
use crate::{Config, Timeouts};

pub struct ControllerService {
    harvester: Harvester,
    host_storage_class: Option<String>,
    max_volumes_per_node: Option<u32>,
    timeouts: Timeouts,
    inflight: InFlight,
    /// Set once NetworkFilesystems could be listed: RWX volumes are served (`rwx`).
    rwx: tokio::sync::OnceCell<()>,
    /// The guest cluster, for the out-of-service taint of Nodes (non-graceful shutdown); `None`
    /// when none could be configured: no volume is then ever force-detached.
    guest: Option<kube::Client>,
    /// How volumes are hot-plugged (Harvester's `server-version`), followed while serving.
    hotplug: hotplug_mode::HotplugModes,
}

/// The controller RPCs this driver implements.
pub const CAPABILITIES: [rpc::Type; 6] = [
    rpc::Type::CreateDeleteVolume,
    rpc::Type::PublishUnpublishVolume,
    rpc::Type::ExpandVolume,
    rpc::Type::CreateDeleteSnapshot,
    rpc::Type::ListSnapshots,
    rpc::Type::CloneVolume,
];

/// Labels upstream puts on a Harvester snapshot so a restore can recreate the PVC the same way:
/// written by `snapshots`, read by `volumes` (here, so neither module imports the other both ways).
pub const LABEL_SNAP_HOST_SC: &str = "harvesterhci.io/snapHostSC";
pub const LABEL_SNAP_HOST_VOLUME_MODE: &str = "harvesterhci.io/snapHostVolumeMode";

/// The guest cluster's client: `path`, else the in-cluster config (then `KUBECONFIG`). `None`,
/// with a warning, when there is none: the controller then never force-detaches a volume from
/// a stopped VM (it cannot see the out-of-service taint).
pub async fn guest_client(
    path: Option<&std::path::Path>,
    metrics: &harvester_common::telemetry::Metrics,
) -> Option<kube::Client> {
    let client = harvester_common::guest::config(path)
        .await
        .and_then(|c| harvester_common::guest::client(c, Some(metrics)));
    match client {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(
                kubeconfig = ?path,
                "no guest cluster client ({e}): the out-of-service taint of guest Nodes is not seen, so no volume is force-detached from a stopped VM"
            );
            None
        }
    }
}

impl ControllerService {
    pub fn new(
        harvester: Harvester,
        guest: Option<kube::Client>,
        hotplug: hotplug_mode::HotplugModes,
        config: &Config,
    ) -> Self {
        ControllerService {
            guest,
            hotplug,
            harvester,
            host_storage_class: config.host_storage_class.clone(),
            max_volumes_per_node: config.max_volumes_per_node,
            timeouts: config.timeouts.clone(),
            inflight: InFlight::default(),
            rwx: tokio::sync::OnceCell::new(),
        }
    }

    fn ns(&self) -> &str {
        &self.harvester.namespace
    }
    fn pvcs(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }
    fn vms(&self) -> Api<VirtualMachine> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }
    fn vmis(&self) -> Api<VirtualMachineInstance> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }

    /// VM `node` (the CSI node ID), NOT_FOUND when Harvester has none.
    async fn vm_or_not_found(&self, node: &str) -> Result<VirtualMachine, ControllerError> {
        self.vms()
            .get_opt(node)
            .await
            .map_err(ControllerError::api(format!("getting VM {node}")))?
            .ok_or_else(|| self.node_not_found(node))
    }

    fn node_not_found(&self, node: &str) -> ControllerError {
        ControllerError::NodeNotFound {
            namespace: self.ns().to_string(),
            node: node.to_string(),
        }
    }

    fn begin(&self, volume: &str) -> Result<crate::inflight::Guard<'_>, ControllerError> {
        self.inflight
            .begin(volume)
            .ok_or_else(|| ControllerError::Busy(volume.to_string()))
    }

    /// Waits (watch) until the host PVC `id` is Bound: hot-plug and resize both need that.
    async fn wait_bound(&self, id: &str) -> Result<(), ControllerError> {
        self.wait_for(
            self.pvcs(),
            id,
            format!("PVC {}/{id} to be Bound", self.ns()),
            self.timeouts.bind,
            |p: Option<&PersistentVolumeClaim>| {
                p.and_then(|p| p.status.as_ref())
                    .and_then(|s| s.phase.as_deref())
                    == Some("Bound")
            },
        )
        .await
        .map(|_| ())
    }

    /// Watches `name` until `cond` holds, for at most `limit`.
    async fn wait_for<K>(
        &self,
        api: Api<K>,
        name: &str,
        what: String,
        limit: Duration,
        cond: impl Condition<K>,
    ) -> Result<Option<K>, ControllerError>
    where
        K: kube::Resource + Clone + std::fmt::Debug + Send + serde::de::DeserializeOwned + 'static,
    {
        match tokio::time::timeout(limit, await_condition(api, name, cond)).await {
            Ok(Ok(obj)) => Ok(obj),
            Ok(Err(e)) => Err(ControllerError::Precondition(format!(
                "watching {what}: {e}"
            ))),
            Err(_) => Err(ControllerError::Timeout { what, after: limit }),
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
        rpc("CreateSnapshot", &id, self.create_snapshot(req)).await
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        let id = req.snapshot_id.clone();
        rpc("DeleteSnapshot", &id, self.delete_snapshot(req)).await
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        let id = req.source_volume_id.clone();
        rpc("ListSnapshots", &id, self.list_snapshots(req)).await
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
