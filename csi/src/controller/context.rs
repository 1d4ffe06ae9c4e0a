//! What every controller module is given: the Harvester client and namespace, the driver's
//! settings, the in-flight guard, and the reads all kinds share (the volume's host PVC, the
//! node's VM), and the watch cache of VMs and VMIs ([`super::vm_cache`]). A kind module borrows it (`Deref`); it never calls back into a kind module.
//! Also how the guest cluster's client is made ([`guest_client`]).

use harvester_common::cloud_config::Harvester;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use harvester_common::names::is_dns1123_label;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::Api;

use super::kube::wait_for;
use crate::Timeouts;
use crate::error::ControllerError;
use crate::inflight::InFlight;

pub struct Ctx {
    pub harvester: Harvester,
    pub host_storage_class: Option<String>,
    pub max_volumes_per_node: Option<u32>,
    pub timeouts: Timeouts,
    pub inflight: InFlight,
    /// Set once NetworkFilesystems could be listed: RWX volumes are served (`nfs`).
    pub rwx: tokio::sync::OnceCell<()>,
    /// The watched VMs and VMIs of the namespace: who may hold a claim, and the waits on them.
    pub vm_cache: super::vm_cache::VmCache,
    /// The guest cluster, for the out-of-service taint of Nodes (non-graceful shutdown) and the
    /// users of an RWX volume; `None` when none could be configured: no volume is then ever
    /// force-detached.
    pub guest: Option<kube::Client>,
    /// This guest cluster: the driver acts only on the Harvester objects it owns.
    pub owner: super::owner::Owner,
    /// Remote backups of other namespaces may be listed and restored.
    pub cross_namespace_backups: bool,
}

impl Ctx {
    pub fn ns(&self) -> &str {
        &self.harvester.namespace
    }
    pub fn pvcs(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }
    pub fn vms(&self) -> Api<VirtualMachine> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }
    pub fn vmis(&self) -> Api<VirtualMachineInstance> {
        Api::namespaced(self.harvester.client.clone(), self.ns())
    }

    /// VM `node` (the CSI node ID), NOT_FOUND when Harvester has none, PERMISSION_DENIED when
    /// it is another guest cluster's node.
    pub async fn vm_or_not_found(&self, node: &str) -> Result<VirtualMachine, ControllerError> {
        let vm = self
            .vms()
            .get_opt(node)
            .await
            .map_err(ControllerError::api(format!("getting VM {node}")))?
            .ok_or_else(|| self.node_not_found(node))?;
        self.owner.check_vm(self.ns(), &vm.metadata)?;
        Ok(vm)
    }

    pub fn node_not_found(&self, node: &str) -> ControllerError {
        ControllerError::NodeNotFound {
            namespace: self.ns().to_string(),
            node: node.to_string(),
        }
    }

    pub fn begin(&self, volume: &str) -> Result<crate::inflight::Guard<'_>, ControllerError> {
        self.inflight
            .begin(volume)
            .ok_or_else(|| ControllerError::Busy(volume.to_string()))
    }

    /// The host PVC of volume `id`, if there is one; an ID that cannot name a PVC has none (and
    /// costs no request). PERMISSION_DENIED when it is not this guest cluster's.
    pub async fn pvc(&self, id: &str) -> Result<Option<PersistentVolumeClaim>, ControllerError> {
        if !is_dns1123_label(id) {
            return Ok(None);
        }
        let pvc = self
            .pvcs()
            .get_opt(id)
            .await
            .map_err(ControllerError::api(format!("getting PVC {id}")))?;
        if let Some(pvc) = &pvc {
            self.owned_pvc(pvc)?;
        }
        Ok(pvc)
    }

    /// PERMISSION_DENIED unless host PVC `pvc` is this guest cluster's.
    pub fn owned_pvc(&self, pvc: &PersistentVolumeClaim) -> Result<(), ControllerError> {
        self.owner
            .check("PersistentVolumeClaim", self.ns(), &pvc.metadata)
    }

    /// The host PVC of volume `id`, NOT_FOUND when there is none.
    pub async fn existing(&self, id: &str) -> Result<PersistentVolumeClaim, ControllerError> {
        self.pvc(id)
            .await?
            .ok_or_else(|| ControllerError::VolumeNotFound {
                namespace: self.ns().to_string(),
                volume: id.to_string(),
            })
    }

    /// Waits (watch) until the host PVC `id` is Bound: hot-plug and resize both need that.
    /// Returns the PVC as last seen (`None` if it went away).
    pub async fn wait_bound(
        &self,
        id: &str,
    ) -> Result<Option<PersistentVolumeClaim>, ControllerError> {
        wait_for(
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
    }
}

/// The guest cluster's client: `path`, else the in-cluster config (then `KUBECONFIG`). `None`,
/// with a warning, when there is none: the controller then never force-detaches a volume from
/// a stopped VM (it cannot see the out-of-service taint).
pub async fn guest_client(
    path: Option<&std::path::Path>,
    metrics: &harvester_common::telemetry::Metrics,
) -> Option<::kube::Client> {
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

/// A kind module's view of the [`Ctx`]: `$name<'a>` borrows it and reads its fields and
/// methods as its own.
macro_rules! borrows_ctx {
    ($name:ident) => {
        pub struct $name<'a>(pub &'a $crate::controller::context::Ctx);

        impl std::ops::Deref for $name<'_> {
            type Target = $crate::controller::context::Ctx;
            fn deref(&self) -> &Self::Target {
                self.0
            }
        }
    };
}
pub(crate) use borrows_ctx;
