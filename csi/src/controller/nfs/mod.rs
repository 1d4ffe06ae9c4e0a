//! Longhorn RWX volumes, as upstream serves them (harvester-csi-driver `controller_server.go`:
//! `isLHRWXVolume`, `createNetworkFilesystem`, `publishRWXVolume`, `unpublishRWXVolume`): a
//! MULTI_NODE_MULTI_WRITER mount volume is a host PVC `ReadWriteMany` + `Filesystem` on a Longhorn
//! StorageClass, whose Longhorn share manager serves it over NFS once the NetworkFilesystem
//! `harvester-system/<pv>` (networkfs-manager; `<pv>` = the PVC's `spec.volumeName`) is enabled.
//! Nothing is hot-plugged: every node mounts the NFS export (`crate::node::nfs`).
//!
//! Where this differs from upstream: errors are typed (a missing CR is UNAVAILABLE while it is
//! recreated, not INTERNAL; a class that is not Longhorn is INVALID_ARGUMENT naming it, where
//! upstream created a PVC that could never be served); publish waits (watch, bounded) for the
//! endpoint to be Ready instead of returning at once, and before enabling a NetworkFilesystem
//! that the last node's unpublish is disabling it waits (watch, bounded) until it is `Disabled`
//! (see [`enable_step`]); unpublish also keeps the export while another node still has a
//! VolumeAttachment for the volume (see [`holders`]).
//!
//! The pure rules are in [`rules`]; this module does the I/O. It is reached from the dispatcher
//! only, and calls nothing but the toolbox and the host-PVC rules.

mod rules;

use csi_proto::csi::v1::*;
use harvester_common::api_error::{is_conflict, is_forbidden, is_not_found};
use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs::{
    ENDPOINT_READY, NAMESPACE, STATE_DISABLED, STATE_ENABLED,
};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

pub use self::rules::*;
use super::context::borrows_ctx;
use super::host_pvc::{
    HostVolumeMode, PARAM_HOST_STORAGE_CLASS, PARAM_HOST_VOLUME_MODE, Params, existing_matches,
    host_pvc,
};
use super::kube::{Deleting, delete_if_exists, get_or_create, wait_for};
use crate::error::{ArgError, ControllerError};
use crate::naming;
use crate::request::{self, Capability, required};

/// ControllerExpandVolume of an RWX volume. Upstream refuses too ("rwx volume expansion is not
/// supported"): the share manager's filesystem would have to grow under its NFS clients.
pub fn expand_refused(id: &str) -> ControllerError {
    ControllerError::Precondition(format!(
        "volume {id} is an RWX volume served over NFS by Longhorn's share manager; \
         expanding it is not supported"
    ))
}

borrows_ctx!(Nfs);

impl Nfs<'_> {
    fn network_filesystems(&self) -> Api<NetworkFilesystem> {
        Api::namespaced(self.harvester.client.clone(), NAMESPACE)
    }

    /// Creates upstream's NetworkFilesystem of PV `pv` (Disabled); one already there is kept.
    async fn create_network_filesystem(
        &self,
        pv: &str,
        doing: &str,
    ) -> Result<(), ControllerError> {
        match self
            .network_filesystems()
            .create(&PostParams::default(), &network_filesystem(pv))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_conflict(&e) => Ok(()),
            Err(e) => Err(ControllerError::api(format!(
                "{doing} NetworkFilesystem {NAMESPACE}/{pv}"
            ))(e)),
        }
    }

    /// Upstream serves MULTI_NODE_MULTI_WRITER only where NetworkFilesystems can be listed in
    /// `harvester-system` (Harvester >= 1.4 with networkfs-manager, and RBAC that allows it).
    /// A success is remembered; a failure is asked again next time.
    async fn rwx_supported(&self) -> Result<(), ControllerError> {
        if self.rwx.get().is_some() {
            return Ok(());
        }
        match self
            .network_filesystems()
            .list(&kube::api::ListParams::default().limit(1))
            .await
        {
            Ok(_) => {
                let _ = self.rwx.set(());
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => Err(ArgError::Invalid {
                field: "volume_capabilities",
                reason: format!(
                    "access mode MULTI_NODE_MULTI_WRITER is not served here: NetworkFilesystems \
                     in {NAMESPACE} cannot be listed on Harvester ({}: {}); RWX volumes need \
                     Harvester 1.4+ (networkfs-manager) and RBAC to list them",
                    s.code, s.message
                ),
            }
            .into()),
            Err(e) => Err(ControllerError::api(format!(
                "listing NetworkFilesystems in {NAMESPACE}"
            ))(e)),
        }
    }

    /// The host StorageClass an RWX volume gets: the parameter, the flag, else Harvester's
    /// default class; it must be a Longhorn class (unless the class may not be read: upstream
    /// then skips the check).
    async fn rwx_class(&self, params: &Params) -> Result<String, ControllerError> {
        let api: Api<StorageClass> = Api::all(self.harvester.client.clone());
        let (class, how) = match &params.storage_class {
            Some(c) if params.storage_class_from_param => {
                (c.clone(), format!("parameter {PARAM_HOST_STORAGE_CLASS}"))
            }
            Some(c) => (c.clone(), "--host-storage-class".to_string()),
            None => {
                let default = match api.list(&Default::default()).await {
                    Ok(list) => list.items.into_iter().find(|sc| {
                        sc.metadata
                            .annotations
                            .as_ref()
                            .and_then(|a| a.get(DEFAULT_CLASS_ANNOTATION))
                            .is_some_and(|v| v == "true")
                    }),
                    Err(e) if is_forbidden(&e) => {
                        return Err(ArgError::Invalid {
                            field: "parameters",
                            reason: format!(
                                "an RWX volume needs a Longhorn StorageClass: set parameter \
                                 {PARAM_HOST_STORAGE_CLASS} (Harvester's default class may not \
                                 be read with this cloud-config)"
                            ),
                        }
                        .into());
                    }
                    Err(e) => {
                        return Err(ControllerError::api("listing StorageClasses")(e));
                    }
                };
                let Some(sc) = default else {
                    return Err(ArgError::Invalid {
                        field: "parameters",
                        reason: format!(
                            "an RWX volume needs a Longhorn StorageClass: no parameter \
                             {PARAM_HOST_STORAGE_CLASS}, no --host-storage-class and no default \
                             StorageClass on Harvester"
                        ),
                    }
                    .into());
                };
                let name = sc.metadata.name.clone().unwrap_or_default();
                if let Some(problem) =
                    rwx_class_problem(&name, "Harvester's default StorageClass", &sc)
                {
                    return Err(ArgError::Invalid {
                        field: "parameters",
                        reason: format!("{problem}; set parameter {PARAM_HOST_STORAGE_CLASS}"),
                    }
                    .into());
                }
                return Ok(name);
            }
        };
        match api.get_opt(&class).await {
            Ok(Some(sc)) => match rwx_class_problem(&class, &how, &sc) {
                None => Ok(class),
                Some(problem) => Err(ArgError::Invalid {
                    field: "parameters",
                    reason: problem,
                }
                .into()),
            },
            Ok(None) => Err(ArgError::Invalid {
                field: "parameters",
                reason: format!("{how} {class:?}: no such StorageClass on Harvester"),
            }
            .into()),
            Err(e) if is_forbidden(&e) => {
                tracing::warn!(
                    class,
                    "may not read StorageClass {class} on Harvester: assuming a Longhorn class, as upstream does"
                );
                Ok(class)
            }
            Err(e) => Err(ControllerError::api(format!(
                "getting StorageClass {class}"
            ))(e)),
        }
    }

    /// CreateVolume of an RWX (MULTI_NODE_MULTI_WRITER) mount volume.
    pub async fn create(
        &self,
        req: &CreateVolumeRequest,
        caps: &[Capability],
    ) -> Result<CreateVolumeResponse, ControllerError> {
        let name = required("name", &req.name)?;
        if let Some(c) = caps.iter().find(|c| c.is_block()) {
            return Err(ArgError::Invalid {
                field: "volume_capabilities",
                reason: format!(
                    "a MULTI_NODE_MULTI_WRITER volume is a filesystem served over NFS; it \
                     cannot also be a block volume ({c:?})"
                ),
            }
            .into());
        }
        if req.volume_content_source.is_some() {
            // Upstream: "Creating RWX volumes from snapshots is not supported".
            return Err(ArgError::Invalid {
                field: "volume_content_source",
                reason: "an RWX (MULTI_NODE_MULTI_WRITER) volume cannot be made from a \
                         snapshot or another volume"
                    .into(),
            }
            .into());
        }
        if let Some(mode) = req
            .parameters
            .get(PARAM_HOST_VOLUME_MODE)
            .filter(|m| m.trim().eq_ignore_ascii_case("block"))
        {
            return Err(ArgError::Invalid {
                field: "parameters",
                reason: format!(
                    "{PARAM_HOST_VOLUME_MODE} {mode:?}: an RWX volume's host PVC is a Filesystem \
                     (Longhorn's share manager exports it)"
                ),
            }
            .into());
        }
        self.rwx_supported().await?;
        let request::Capacity { limit, size, .. } =
            request::capacity("capacity_range", req.capacity_range.as_ref(), None)?;
        let mut params = Params::parse(&req.parameters, self.host_storage_class.as_deref())?;
        params.volume_mode = HostVolumeMode::Filesystem;
        let class = self.rwx_class(&params).await?;
        params.storage_class = Some(class);
        let pvc_name = naming::host_volume_name(name);
        let _guard = self.begin(&pvc_name)?;
        let pvcs = self.pvcs();
        let (_, found) = get_or_create(
            &pvcs,
            &pvc_name,
            Deleting::Judge,
            |p| {
                self.owned_pvc(p)?;
                existing_matches(name, p, size, limit, None)
            },
            async { Ok(host_pvc(&pvc_name, name, size, &params, None, &self.owner)) },
        )
        .await?;
        let size = found.unwrap_or(size);
        // Longhorn binds the claim to a PV; the NetworkFilesystem is named after it.
        let bound = wait_for(
            pvcs,
            &pvc_name,
            format!("PVC {}/{pvc_name} to get a spec.volumeName", self.ns()),
            self.timeouts.bind,
            |p: Option<&PersistentVolumeClaim>| p.and_then(volume_name).is_some(),
        )
        .await?;
        let pv = bound
            .as_ref()
            .and_then(volume_name)
            .ok_or_else(|| {
                ControllerError::Precondition(format!("PVC {pvc_name} went away while created"))
            })?
            .to_string();
        self.create_network_filesystem(&pv, "creating").await?;
        tracing::info!(volume = %pvc_name, pv, size, class = ?params.storage_class, "created RWX volume (Harvester PVC and NetworkFilesystem)");
        Ok(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
                volume_id: pvc_name,
                ..Default::default()
            }),
        })
    }

    /// The PV of the volume whose host PVC is `pvc` if it is an RWX volume served through a
    /// NetworkFilesystem (the host PVC is Filesystem + ReadWriteMany and the CR exists); `None`
    /// for every other volume.
    pub async fn serving(
        &self,
        pvc: &PersistentVolumeClaim,
    ) -> Result<Option<String>, ControllerError> {
        let Some(pv) = volume_name(pvc).filter(|_| is_rwx_filesystem(pvc)) else {
            return Ok(None);
        };
        match self.network_filesystems().get_opt(pv).await {
            Ok(Some(_)) => Ok(Some(pv.to_string())),
            Ok(None) => Ok(None),
            // No NetworkFilesystem API (old Harvester, RBAC): not an RWX volume of ours.
            Err(e) if is_not_found(&e) || is_forbidden(&e) => Ok(None),
            Err(e) => Err(ControllerError::api(format!(
                "getting NetworkFilesystem {NAMESPACE}/{pv}"
            ))(e)),
        }
    }

    /// ControllerPublish of an RWX volume: enable its NetworkFilesystem and wait (watch,
    /// bounded by `timeouts.nfs_ready`) until the endpoint is Ready; the publish context carries
    /// the export and its mount options. No hot-plug.
    pub async fn publish(
        &self,
        id: &str,
        node: &str,
    ) -> Result<ControllerPublishVolumeResponse, ControllerError> {
        let pvc = self.existing(id).await?;
        self.vm_or_not_found(node).await?;
        if !is_rwx_filesystem(&pvc) {
            return Err(ControllerError::Precondition(format!(
                "volume {id} is not an RWX filesystem volume (its Harvester PVC is not \
                 Filesystem + ReadWriteMany): it is hot-plugged into one VM and cannot be \
                 published MULTI_NODE_MULTI_WRITER"
            )));
        }
        let _guard = self.begin(id)?;
        // The bound claim as the wait saw it last: it names the PV.
        let pvc = match self.wait_bound(id).await? {
            Some(pvc) => pvc,
            None => self.existing(id).await?,
        };
        let pv = volume_name(&pvc)
            .ok_or_else(|| {
                ControllerError::NotReady(format!(
                    "PVC {}/{id} is Bound but has no spec.volumeName yet",
                    self.ns()
                ))
            })?
            .to_string();
        let api = self.network_filesystems();
        let Some(nfs) = api
            .get_opt(&pv)
            .await
            .map_err(ControllerError::api(format!(
                "getting NetworkFilesystem {NAMESPACE}/{pv}"
            )))?
        else {
            if pvc.metadata.deletion_timestamp.is_some() {
                return Err(ControllerError::Precondition(format!(
                    "volume {id} is being deleted and has no NetworkFilesystem"
                )));
            }
            // Upstream recreates it and asks for a retry (with INTERNAL); the retry is the
            // point, so the code says so.
            self.create_network_filesystem(&pv, "recreating").await?;
            return Err(ControllerError::NotReady(format!(
                "NetworkFilesystem {NAMESPACE}/{pv} of volume {id} was missing and has been \
                 recreated; publish again"
            )));
        };
        self.enable(&api, &pv, nfs, id, node).await?;
        let seen = match wait_for(
            api.clone(),
            &pv,
            format!("NetworkFilesystem {NAMESPACE}/{pv} to be {ENDPOINT_READY}"),
            self.timeouts.nfs_ready,
            |n: Option<&NetworkFilesystem>| n.is_none_or(|n| n.ready_endpoint().is_ok()),
        )
        .await
        {
            Err(ControllerError::Timeout { what, after }) => {
                // Name what it is doing instead, if networkfs-manager said anything.
                let why = api
                    .get_opt(&pv)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|n| n.ready_endpoint().err());
                return Err(match why {
                    Some(why) => ControllerError::NotReady(format!(
                        "NetworkFilesystem {NAMESPACE}/{pv} of volume {id} is not serving after \
                         {after:?}: {why}"
                    )),
                    None => ControllerError::Timeout { what, after },
                });
            }
            other => other?,
        };
        let Some(nfs) = seen else {
            return Err(ControllerError::NotReady(format!(
                "NetworkFilesystem {NAMESPACE}/{pv} of volume {id} was deleted while it was \
                 being enabled; publish again"
            )));
        };
        // What NodeStage mounts travels with the attachment: the node plugin needs no
        // Harvester credential to look it up.
        let source = nfs.source().map_err(|why| {
            ControllerError::NotReady(format!(
                "NetworkFilesystem {NAMESPACE}/{pv} of volume {id}: {why}"
            ))
        })?;
        Ok(ControllerPublishVolumeResponse {
            publish_context: source.to_context().into_iter().collect(),
        })
    }

    /// Sets `desiredState: Enabled` on NetworkFilesystem `pv` once [`enable_step`] allows it:
    /// after a disable under way has reached `Disabled` (watch, bounded by
    /// `timeouts.nfs_disabled`; past it UNAVAILABLE naming the state), and only on the
    /// resourceVersion seen Disabled (a merge patch carrying it is refused with 409 if the CR
    /// moved meanwhile; then it is read again). Never writes Enabled onto a `Disabling` CR.
    async fn enable(
        &self,
        api: &Api<NetworkFilesystem>,
        pv: &str,
        mut nfs: NetworkFilesystem,
        id: &str,
        node: &str,
    ) -> Result<(), ControllerError> {
        for _ in 0..8 {
            match enable_step(&nfs) {
                EnableStep::WaitReady => return Ok(()),
                EnableStep::Enable { resource_version } => {
                    let patch = json!({
                        "metadata": {"resourceVersion": resource_version},
                        "spec": {"desiredState": STATE_ENABLED},
                    });
                    match api
                        .patch(pv, &PatchParams::default(), &Patch::Merge(patch))
                        .await
                    {
                        Ok(_) => {
                            tracing::info!(volume = id, pv, node, "enabled NetworkFilesystem");
                            return Ok(());
                        }
                        Err(e) if is_conflict(&e) => {}
                        Err(e) => {
                            return Err(ControllerError::api(format!(
                                "enabling NetworkFilesystem {NAMESPACE}/{pv}"
                            ))(e));
                        }
                    }
                }
                EnableStep::WaitDisabled { state } => {
                    tracing::info!(
                        volume = id,
                        pv,
                        node,
                        state,
                        "waiting for the NetworkFilesystem to be Disabled before enabling it"
                    );
                    let waited = wait_for(
                        api.clone(),
                        pv,
                        format!("NetworkFilesystem {NAMESPACE}/{pv} to be {STATE_DISABLED}"),
                        self.timeouts.nfs_disabled,
                        |n: Option<&NetworkFilesystem>| {
                            n.is_none_or(|n| {
                                !matches!(enable_step(n), EnableStep::WaitDisabled { .. })
                            })
                        },
                    )
                    .await;
                    match waited {
                        Ok(_) => {}
                        Err(ControllerError::Timeout { after, .. }) => {
                            let now = api.get_opt(pv).await.ok().flatten();
                            let state = now.as_ref().map_or("gone", |n| n.state()).to_string();
                            return Err(ControllerError::NotReady(format!(
                                "NetworkFilesystem {NAMESPACE}/{pv} of volume {id} is still \
                                 {state:?} after {after:?} (desiredState Disabled: the last node \
                                 unpublished it and Longhorn's share manager has not stopped); \
                                 networkfs-manager cannot enable it before it is \
                                 {STATE_DISABLED:?}, so it is left alone; publish again"
                            )));
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            nfs = api
                .get_opt(pv)
                .await
                .map_err(ControllerError::api(format!(
                    "getting NetworkFilesystem {NAMESPACE}/{pv}"
                )))?
                .ok_or_else(|| {
                    ControllerError::NotReady(format!(
                        "NetworkFilesystem {NAMESPACE}/{pv} of volume {id} was deleted while \
                         it was being enabled; publish again"
                    ))
                })?;
        }
        Err(ControllerError::NotReady(format!(
            "NetworkFilesystem {NAMESPACE}/{pv} of volume {id} kept changing while it was being \
             enabled (state {:?}); publish again",
            nfs.state()
        )))
    }

    /// ControllerUnpublish of RWX volume `id` (PV `pv`) from `node`: disable the NetworkFilesystem
    /// only when nobody in the guest cluster uses the volume any more ([`holders`]).
    pub async fn unpublish(&self, id: &str, pv: &str, node: &str) -> Result<(), ControllerError> {
        let api = self.network_filesystems();
        let Some(nfs) = api.get_opt(pv).await.map_err(ControllerError::api(format!(
            "getting NetworkFilesystem {NAMESPACE}/{pv}"
        )))?
        else {
            return Ok(());
        };
        if nfs.spec.desired_state == STATE_DISABLED {
            return Ok(());
        }
        let who = self.rwx_holders(id, node).await?;
        if !who.is_empty() {
            tracing::info!(
                volume = id,
                node,
                ?who,
                "unpublished from {node}; the NetworkFilesystem stays enabled for the others"
            );
            return Ok(());
        }
        api.patch(
            pv,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"desiredState": STATE_DISABLED}})),
        )
        .await
        .map_err(ControllerError::api(format!(
            "disabling NetworkFilesystem {NAMESPACE}/{pv}"
        )))?;
        tracing::info!(
            volume = id,
            pv,
            "disabled NetworkFilesystem: no guest Pod or other node uses it"
        );
        Ok(())
    }

    /// [`holders`] from the guest cluster: the PV whose CSI volume handle is `id`, its claim,
    /// the Pods in the claim's namespace, the VolumeAttachments. Without a guest client the
    /// controller cannot know, so the export is kept (a leaked export is harmless; a disabled
    /// one under a running Pod is not).
    async fn rwx_holders(&self, id: &str, node: &str) -> Result<Vec<String>, ControllerError> {
        let Some(guest) = self.guest.clone() else {
            return Ok(vec![
                "unknown: the controller has no guest cluster client to look for Pods".into(),
            ]);
        };
        let pvs: Api<PersistentVolume> = Api::all(guest.clone());
        let pv = pvs
            .list(&Default::default())
            .await
            .map_err(ControllerError::guest_api("listing PersistentVolumes"))?
            .items
            .into_iter()
            .find(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.csi.as_ref())
                    .is_some_and(|c| c.driver == crate::DRIVER_NAME && c.volume_handle == id)
            });
        let pv_name = pv
            .as_ref()
            .and_then(|p| p.metadata.name.clone())
            .unwrap_or_else(|| id.to_string());
        let claim = pv
            .as_ref()
            .and_then(|p| p.spec.as_ref())
            .and_then(|s| s.claim_ref.as_ref())
            .and_then(|c| Some((c.namespace.clone()?, c.name.clone()?)));
        let pods = match &claim {
            Some((ns, _)) => {
                Api::<Pod>::namespaced(guest.clone(), ns)
                    .list(&Default::default())
                    .await
                    .map_err(ControllerError::guest_api(format!("listing Pods in {ns}")))?
                    .items
            }
            None => Vec::new(),
        };
        let vas = Api::<VolumeAttachment>::all(guest)
            .list(&Default::default())
            .await
            .map_err(ControllerError::guest_api("listing VolumeAttachments"))?
            .items;
        Ok(holders(
            &pv_name,
            claim.as_ref().map(|(n, c)| (n.as_str(), c.as_str())),
            node,
            &pods,
            &vas,
        ))
    }

    /// DeleteVolume of an RWX volume: its NetworkFilesystem first (the dispatcher then has the
    /// host PVC deleted).
    pub async fn delete(&self, pv: &str) -> Result<(), ControllerError> {
        let what = format!("NetworkFilesystem {NAMESPACE}/{pv}");
        if delete_if_exists(&self.network_filesystems(), pv, &what).await? {
            tracing::info!(pv, "deleted NetworkFilesystem");
        }
        Ok(())
    }
}
