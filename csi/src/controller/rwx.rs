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

use csi_proto::csi::v1::*;
use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs::{
    ENDPOINT_READY, NAMESPACE, NetworkFilesystemSpec, PROVISIONER_LONGHORN, STATE_DISABLED,
    STATE_ENABLED,
};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use super::ControllerService;
use super::volumes::{HostVolumeMode, PARAM_HOST_STORAGE_CLASS, PARAM_HOST_VOLUME_MODE, Params};
use crate::error::{ArgError, ControllerError};
use crate::naming;
use crate::request::{self, Capability, required};

/// The provisioner of a Longhorn StorageClass: upstream's `isLHRWXVolume` checks only this (with
/// the PVC's `Filesystem` mode and `ReadWriteMany`).
pub const LONGHORN_PROVISIONER: &str = "driver.longhorn.io";
/// Annotation marking a cluster's default StorageClass.
const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";

/// Why host StorageClass `class` cannot serve an RWX filesystem, if it cannot (pure). `how`
/// says where the class came from, for the message.
pub fn rwx_class_problem(class: &str, how: &str, sc: &StorageClass) -> Option<String> {
    (sc.provisioner != LONGHORN_PROVISIONER).then(|| {
        format!(
            "{how} {class:?} has provisioner {:?}; a MULTI_NODE_MULTI_WRITER (RWX) volume is \
             served over NFS by Longhorn's share manager, so it needs a Longhorn class \
             (provisioner {LONGHORN_PROVISIONER})",
            sc.provisioner
        )
    })
}

/// Whether a host PVC is shaped like a Longhorn RWX volume: `Filesystem` and `ReadWriteMany`
/// (the class is checked where it is read). Our block volumes are RWX too, but `Block`.
pub fn is_rwx_filesystem(pvc: &PersistentVolumeClaim) -> bool {
    let Some(spec) = pvc.spec.as_ref() else {
        return false;
    };
    spec.volume_mode.as_deref() == Some("Filesystem")
        && spec
            .access_modes
            .as_ref()
            .is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany"))
}

/// The PV a host PVC is bound to (`spec.volumeName`), which names its NetworkFilesystem.
pub fn volume_name(pvc: &PersistentVolumeClaim) -> Option<&str> {
    pvc.spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|v| !v.is_empty())
}

/// The NetworkFilesystem upstream creates for PV `pv` (`createNetworkFilesystem`).
pub fn network_filesystem(pv: &str) -> NetworkFilesystem {
    let mut n = NetworkFilesystem::new(
        pv,
        NetworkFilesystemSpec {
            network_fs_name: pv.to_string(),
            desired_state: STATE_DISABLED.into(),
            provisioner: Some(PROVISIONER_LONGHORN.into()),
            ..Default::default()
        },
    );
    n.metadata.namespace = Some(NAMESPACE.into());
    n
}

/// What ControllerPublish does next with a NetworkFilesystem (pure, [`enable_step`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnableStep {
    /// `desiredState` is Enabled already: wait for the endpoint.
    WaitReady,
    /// Disabled and settled: set `desiredState: Enabled` on this resourceVersion only.
    Enable { resource_version: String },
    /// A disable is under way (`desiredState: Disabled`, the state not Disabled yet): wait.
    WaitDisabled { state: String },
}

/// The publish rule for a NetworkFilesystem as it is now. networkfs-manager refuses to enable
/// one that is still `Disabling` once the share manager has stopped (v0.1.1,
/// 8d20f3e6679f0a0b484e16fbb8d05e086e183e09, `pkg/controller/networkfilesystem/controller.go`
/// `enableNetworkFS`: "wait the previous operation (disable) to finish"), and only moves
/// `Disabling` on to `Disabled` while `desiredState` is Disabled
/// (`pkg/controller/sharemanager/controller.go` `OnShareManagerChange`): an Enabled written
/// during `Disabling` is stuck for good. A later version (commit not identified; the facts file
/// is unsure which one Harvester v1.8 ships) resets a CR whose Longhorn VolumeAttachment has no
/// tickets, but still errors for a stopped share manager; the stricter rule is played. So the
/// last node's unpublish followed by another node's publish waits for `Disabled`; a fresh CR
/// (no state yet, or upstream's initial `Unknown`) is enabled at once, as upstream initialises it
/// to Disabled first.
pub fn enable_step(n: &NetworkFilesystem) -> EnableStep {
    if n.spec.desired_state == STATE_ENABLED {
        return EnableStep::WaitReady;
    }
    match n.state() {
        STATE_DISABLED | "" | "Unknown" => EnableStep::Enable {
            resource_version: n.metadata.resource_version.clone().unwrap_or_default(),
        },
        state => EnableStep::WaitDisabled {
            state: state.to_string(),
        },
    }
}

/// Who in the guest cluster still uses the volume whose guest PV is `pv` (claim `claim`) once
/// node `node` lets go (pure): Pods that are not finished and mount the claim (upstream's rule:
/// its pod index by PVC), and VolumeAttachments of this driver for the PV on another node that
/// are not being deleted. The second rule is ours: a node whose Pod is gone may still have the
/// volume staged (NodeUnstage has not run yet) and its attachment in place; disabling the export
/// under it would fail its I/O, and its own ControllerUnpublish comes later and disables it then.
pub fn holders(
    pv: &str,
    claim: Option<(&str, &str)>,
    node: &str,
    pods: &[Pod],
    vas: &[VolumeAttachment],
) -> Vec<String> {
    let mut who = Vec::new();
    if let Some((ns, name)) = claim {
        for p in pods {
            let finished = p
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
            let mounts = p.spec.as_ref().is_some_and(|s| {
                s.volumes.iter().flatten().any(|v| {
                    v.persistent_volume_claim
                        .as_ref()
                        .is_some_and(|c| c.claim_name == name)
                })
            });
            if p.metadata.namespace.as_deref() == Some(ns) && mounts && !finished {
                who.push(format!(
                    "Pod {ns}/{}",
                    p.metadata.name.as_deref().unwrap_or("")
                ));
            }
        }
    }
    for va in vas {
        let s = &va.spec;
        if s.attacher == crate::DRIVER_NAME
            && s.source.persistent_volume_name.as_deref() == Some(pv)
            && s.node_name != node
            && va.metadata.deletion_timestamp.is_none()
        {
            who.push(format!(
                "VolumeAttachment {} (node {})",
                va.metadata.name.as_deref().unwrap_or(""),
                s.node_name
            ));
        }
    }
    who
}

impl ControllerService {
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
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
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
                    Err(kube::Error::Api(s)) if s.code == 403 => {
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
            Err(kube::Error::Api(s)) if s.code == 403 => {
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
    pub(super) async fn create_rwx(
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
        let size = request::volume_size("capacity_range", req.capacity_range.as_ref())?;
        let (_, limit) = request::range_bytes("capacity_range", req.capacity_range.as_ref())?;
        let mut params = Params::parse(&req.parameters, self.host_storage_class.as_deref())?;
        params.volume_mode = HostVolumeMode::Filesystem;
        let class = self.rwx_class(&params).await?;
        params.storage_class = Some(class);
        let pvc_name = naming::host_volume_name(name);
        let _guard = self.begin(&pvc_name)?;
        let pvcs = self.pvcs();
        let existing = pvcs
            .get_opt(&pvc_name)
            .await
            .map_err(ControllerError::api(format!("getting PVC {pvc_name}")))?;
        let size = match existing {
            Some(p) => super::volumes::existing_matches(name, &p, size, limit, None)?,
            None => {
                let pvc = super::volumes::host_pvc(&pvc_name, name, size, &params, None);
                match pvcs.create(&PostParams::default(), &pvc).await {
                    Ok(_) => size,
                    Err(kube::Error::Api(s)) if s.code == 409 => {
                        let p = pvcs
                            .get(&pvc_name)
                            .await
                            .map_err(ControllerError::api(format!("getting PVC {pvc_name}")))?;
                        super::volumes::existing_matches(name, &p, size, limit, None)?
                    }
                    Err(e) => {
                        return Err(ControllerError::api(format!("creating PVC {pvc_name}"))(e));
                    }
                }
            }
        };
        // Longhorn binds the claim to a PV; the NetworkFilesystem is named after it.
        let bound = self
            .wait_for(
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

    /// The PV of volume `id` if it is an RWX volume served through a NetworkFilesystem (the
    /// host PVC is Filesystem + ReadWriteMany and the CR exists); `None` for every other volume,
    /// including a missing one (the caller's own path handles that).
    pub(super) async fn rwx_of(&self, id: &str) -> Result<Option<String>, ControllerError> {
        if !naming::is_dns1123_label(id) {
            return Ok(None);
        }
        let Some(pvc) = self
            .pvcs()
            .get_opt(id)
            .await
            .map_err(ControllerError::api(format!("getting PVC {id}")))?
        else {
            return Ok(None);
        };
        let Some(pv) = volume_name(&pvc).filter(|_| is_rwx_filesystem(&pvc)) else {
            return Ok(None);
        };
        match self.network_filesystems().get_opt(pv).await {
            Ok(Some(_)) => Ok(Some(pv.to_string())),
            Ok(None) => Ok(None),
            // No NetworkFilesystem API (old Harvester, RBAC): not an RWX volume of ours.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => Ok(None),
            Err(e) => Err(ControllerError::api(format!(
                "getting NetworkFilesystem {NAMESPACE}/{pv}"
            ))(e)),
        }
    }

    /// ControllerPublish of an RWX volume: enable its NetworkFilesystem and wait (watch,
    /// bounded by `timeouts.nfs_ready`) until the endpoint is Ready. No hot-plug.
    pub(super) async fn publish_rwx(
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
        self.wait_bound(id).await?;
        let pvc = self.existing(id).await?;
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
        let seen = match self
            .wait_for(
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
        if seen.is_none() {
            return Err(ControllerError::NotReady(format!(
                "NetworkFilesystem {NAMESPACE}/{pv} of volume {id} was deleted while it was \
                 being enabled; publish again"
            )));
        }
        Ok(ControllerPublishVolumeResponse {
            publish_context: Default::default(),
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
                        Err(kube::Error::Api(s)) if s.code == 409 => {}
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
                    let waited = self
                        .wait_for(
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
    pub(super) async fn unpublish_rwx(
        &self,
        id: &str,
        pv: &str,
        node: &str,
    ) -> Result<(), ControllerError> {
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

    /// ValidateVolumeCapabilities: why `caps` do not fit volume `id` as to RWX, if they do not.
    /// MULTI_NODE_MULTI_WRITER fits only an RWX volume (served through its NetworkFilesystem),
    /// and an RWX volume is served only that way (one node's hot-plug cannot reach it).
    pub(super) async fn rwx_mismatch(
        &self,
        id: &str,
        caps: &[Capability],
    ) -> Result<Option<String>, ControllerError> {
        let wants_rwx = caps.iter().any(Capability::is_rwx);
        let is_rwx = self.rwx_of(id).await?.is_some();
        Ok(match (wants_rwx, is_rwx) {
            (true, false) => Some(format!(
                "volume {id} is a single-node volume (hot-plugged into one VM);                  MULTI_NODE_MULTI_WRITER needs an RWX volume"
            )),
            (false, true) => Some(format!(
                "volume {id} is an RWX volume served over NFS; only MULTI_NODE_MULTI_WRITER                  mount capabilities fit it"
            )),
            _ => None,
        })
    }

    /// DeleteVolume of an RWX volume: its NetworkFilesystem first (the caller deletes the PVC).
    pub(super) async fn delete_rwx(&self, pv: &str) -> Result<(), ControllerError> {
        match self
            .network_filesystems()
            .delete(pv, &DeleteParams::default())
            .await
        {
            Ok(_) => {
                tracing::info!(pv, "deleted NetworkFilesystem");
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(ControllerError::api(format!(
                "deleting NetworkFilesystem {NAMESPACE}/{pv}"
            ))(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sc(provisioner: &str) -> StorageClass {
        StorageClass {
            provisioner: provisioner.into(),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_longhorn_class_serves_rwx() {
        // Upstream's isLHRWXVolume: `sc.Provisioner == longhornProvisioner` ("driver.longhorn.io").
        assert_eq!(
            rwx_class_problem(
                "lh",
                "parameter hostStorageClass",
                &sc("driver.longhorn.io")
            ),
            None
        );
        let p = rwx_class_problem(
            "nfs-csi",
            "parameter hostStorageClass",
            &sc("nfs.csi.k8s.io"),
        )
        .unwrap();
        assert!(
            p.contains("hostStorageClass")
                && p.contains("\"nfs-csi\"")
                && p.contains("nfs.csi.k8s.io"),
            "{p}"
        );
    }

    #[test]
    fn the_network_filesystem_is_upstreams() {
        // createNetworkFilesystem: harvester-system/<pv>, {networkFSName: <pv>,
        // desiredState: Disabled, provisioner: Longhorn}.
        let v = serde_json::to_value(network_filesystem("pvc-7")).unwrap();
        assert_eq!(v["metadata"]["name"], "pvc-7");
        assert_eq!(v["metadata"]["namespace"], "harvester-system");
        assert_eq!(
            v["spec"],
            json!({"networkFSName": "pvc-7", "desiredState": "Disabled", "provisioner": "Longhorn"})
        );
    }

    fn pvc(mode: &str, access: &str, pv: Option<&str>) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "v"},
            "spec": {"volumeMode": mode, "accessModes": [access], "volumeName": pv}
        }))
        .unwrap()
    }

    #[test]
    fn an_rwx_volume_is_a_filesystem_rwx_claim() {
        assert!(is_rwx_filesystem(&pvc(
            "Filesystem",
            "ReadWriteMany",
            Some("pv")
        )));
        assert!(!is_rwx_filesystem(&pvc(
            "Block",
            "ReadWriteMany",
            Some("pv")
        )));
        assert!(!is_rwx_filesystem(&pvc(
            "Filesystem",
            "ReadWriteOnce",
            None
        )));
        assert_eq!(
            volume_name(&pvc("Filesystem", "ReadWriteMany", Some("pv"))),
            Some("pv")
        );
        assert_eq!(
            volume_name(&pvc("Filesystem", "ReadWriteMany", Some(""))),
            None
        );
    }

    fn pod(ns: &str, name: &str, claim: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"containers": [], "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": claim}}]},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    fn va(name: &str, pv: &str, node: &str, deleting: bool) -> VolumeAttachment {
        let mut v: VolumeAttachment = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"attacher": "driver.harvesterhci.io", "nodeName": node,
                     "source": {"persistentVolumeName": pv}}
        }))
        .unwrap();
        if deleting {
            v.metadata.deletion_timestamp = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
            );
        }
        v
    }

    #[test]
    fn the_export_stays_while_a_pod_or_another_node_holds_the_volume() {
        let claim = Some(("apps", "shared"));
        let none = holders("pv1", claim, "a", &[], &[]);
        assert!(none.is_empty());
        // Upstream's rule: a Pod that mounts the claim.
        let who = holders(
            "pv1",
            claim,
            "a",
            &[pod("apps", "web", "shared", "Running")],
            &[],
        );
        assert_eq!(who, ["Pod apps/web"]);
        // Finished Pods, other claims and other namespaces do not count.
        let who = holders(
            "pv1",
            claim,
            "a",
            &[
                pod("apps", "job", "shared", "Succeeded"),
                pod("apps", "other", "data", "Running"),
                pod("ops", "web", "shared", "Running"),
            ],
            &[],
        );
        assert!(who.is_empty(), "{who:?}");
        // Ours: another node's attachment; not the node being unpublished, not one being
        // deleted, not another driver's or another PV's.
        let mut other = va("va-3", "pv1", "b", false);
        other.spec.attacher = "other.csi".into();
        let who = holders(
            "pv1",
            claim,
            "a",
            &[],
            &[
                va("va-1", "pv1", "a", false),
                va("va-2", "pv1", "b", true),
                other,
                va("va-4", "pv2", "b", false),
                va("va-5", "pv1", "c", false),
            ],
        );
        assert_eq!(who, ["VolumeAttachment va-5 (node c)"]);
    }

    fn nfs_cr(desired: &str, state: Option<&str>, rv: &str) -> NetworkFilesystem {
        let mut n = network_filesystem("pvc-7");
        n.spec.desired_state = desired.into();
        n.metadata.resource_version = Some(rv.into());
        n.status =
            state.map(
                |state| harvester_common::harvester::networkfs::NetworkFilesystemStatus {
                    state: state.into(),
                    status: "Ready".into(),
                    endpoint: "10.0.0.1".into(),
                    ..Default::default()
                },
            );
        n
    }

    #[test]
    fn publish_enables_only_a_settled_network_filesystem() {
        use harvester_common::harvester::networkfs::{STATE_DISABLING, STATE_ENABLING};
        let enable = |rv: &str| EnableStep::Enable {
            resource_version: rv.into(),
        };
        let wait = |s: &str| EnableStep::WaitDisabled { state: s.into() };
        // (desiredState, status.state) -> step; networkfs-manager v0.1.1 enableNetworkFS and
        // OnShareManagerChange.
        let rows: [(&str, Option<&str>, EnableStep); 9] = [
            // Fresh from CreateVolume: upstream initialises the state to Disabled first.
            (STATE_DISABLED, None, enable("1")),
            (STATE_DISABLED, Some("Unknown"), enable("1")),
            (STATE_DISABLED, Some(STATE_DISABLED), enable("1")),
            // The last node unpublished: Disabling until the share manager stops; enabling now
            // fails upstream ("wait the previous operation (disable) to finish") for good.
            (STATE_DISABLED, Some(STATE_DISABLING), wait(STATE_DISABLING)),
            // Disabled asked, not yet seen by networkfs-manager: it goes Disabling next.
            (STATE_DISABLED, Some(STATE_ENABLED), wait(STATE_ENABLED)),
            (STATE_DISABLED, Some(STATE_ENABLING), wait(STATE_ENABLING)),
            // Enabled already (another node's publish): wait for the endpoint.
            (STATE_ENABLED, Some(STATE_ENABLED), EnableStep::WaitReady),
            (STATE_ENABLED, Some(STATE_ENABLING), EnableStep::WaitReady),
            (STATE_ENABLED, Some(STATE_DISABLING), EnableStep::WaitReady),
        ];
        for (desired, state, want) in rows {
            assert_eq!(
                enable_step(&nfs_cr(desired, state, "1")),
                want,
                "desired {desired}, state {state:?}"
            );
        }
    }
}
