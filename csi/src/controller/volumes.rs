//! CreateVolume, DeleteVolume, ValidateVolumeCapabilities, ControllerExpandVolume: the volume is
//! a PVC in the cloud-config's namespace on Harvester, named by [`crate::naming`].

use std::collections::{BTreeMap, HashMap};

use csi_proto::csi::v1::validate_volume_capabilities_response::Confirmed;
use csi_proto::csi::v1::*;
use harvester_common::quantity;
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, TypedLocalObjectReference,
    VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use super::ControllerService;
use crate::error::{ArgError, ControllerError};
use crate::naming::{self, ORIGINAL_NAME_ANNOTATION};
use crate::request::{self, required};

/// StorageClass parameter naming the Harvester StorageClass of the host PVC.
pub const PARAM_HOST_STORAGE_CLASS: &str = "hostStorageClass";
/// StorageClass parameter choosing the host PVC's volumeMode (`block`, the default, or `filesystem`).
pub const PARAM_HOST_VOLUME_MODE: &str = "hostVolumeMode";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostVolumeMode {
    Block,
    Filesystem,
}

impl HostVolumeMode {
    fn as_k8s(self) -> &'static str {
        match self {
            HostVolumeMode::Block => "Block",
            HostVolumeMode::Filesystem => "Filesystem",
        }
    }
}

/// CreateVolume parameters (the guest StorageClass's `parameters`). Unknown keys are ignored,
/// as upstream does (the provisioner passes its own `csi.storage.k8s.io/*` keys through).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    /// `hostStorageClass`, else `--host-storage-class`, else the Harvester default class.
    pub storage_class: Option<String>,
    /// Whether the class came from the parameter (only then is it checked, as upstream).
    pub storage_class_from_param: bool,
    pub volume_mode: HostVolumeMode,
}

impl Params {
    pub fn parse(
        params: &HashMap<String, String>,
        default_class: Option<&str>,
    ) -> Result<Params, ArgError> {
        let from_param = params
            .get(PARAM_HOST_STORAGE_CLASS)
            .map(|s| s.trim())
            .filter(|s| !s.is_empty());
        let volume_mode = match params.get(PARAM_HOST_VOLUME_MODE).map(|s| s.trim()) {
            None | Some("") => HostVolumeMode::Block,
            Some(m) if m.eq_ignore_ascii_case("block") => HostVolumeMode::Block,
            Some(m) if m.eq_ignore_ascii_case("filesystem") => HostVolumeMode::Filesystem,
            Some(other) => {
                return Err(ArgError::Invalid {
                    field: "parameters",
                    reason: format!(
                        "{PARAM_HOST_VOLUME_MODE} {other:?} is not one of block, filesystem"
                    ),
                });
            }
        };
        Ok(Params {
            storage_class: from_param
                .or(default_class.filter(|s| !s.is_empty()))
                .map(str::to_string),
            storage_class_from_param: from_param.is_some(),
            volume_mode,
        })
    }
}

/// The Harvester PVC for a new volume: RWX (so the VM can live-migrate), block mode unless
/// `hostVolumeMode: filesystem`, the size already rounded; restored from `snapshot` if given.
pub fn host_pvc(
    pvc_name: &str,
    csi_name: &str,
    size: u64,
    params: &Params,
    snapshot: Option<&str>,
) -> PersistentVolumeClaim {
    let annotations = (pvc_name != csi_name)
        .then(|| BTreeMap::from([(ORIGINAL_NAME_ANNOTATION.to_string(), csi_name.to_string())]));
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(pvc_name.to_string()),
            annotations,
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteMany".into()]),
            volume_mode: Some(params.volume_mode.as_k8s().into()),
            storage_class_name: params.storage_class.clone(),
            data_source: snapshot.map(|name| TypedLocalObjectReference {
                api_group: Some("snapshot.storage.k8s.io".into()),
                kind: "VolumeSnapshot".into(),
                name: name.to_string(),
            }),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    Quantity(quantity::from_bytes(size)),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// The requested size of a host PVC, in bytes.
pub fn requested_bytes(pvc: &PersistentVolumeClaim) -> Option<u64> {
    let q = pvc
        .spec
        .as_ref()?
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get("storage")?;
    quantity::to_bytes(&q.0)
}

/// The capacity Harvester reports for a host PVC, in bytes.
pub fn capacity_bytes(pvc: &PersistentVolumeClaim) -> Option<u64> {
    let q = pvc.status.as_ref()?.capacity.as_ref()?.get("storage")?;
    quantity::to_bytes(&q.0)
}

/// Whether an existing host PVC is the volume CreateVolume asks for again: it was created for
/// the same CSI name and its size fits the request. Returns the volume's size.
pub fn existing_matches(
    csi_name: &str,
    pvc: &PersistentVolumeClaim,
    size: u64,
    limit: u64,
    snapshot: Option<&str>,
) -> Result<u64, ControllerError> {
    let pvc_name = pvc.metadata.name.clone().unwrap_or_default();
    let clash = |reason: String| ControllerError::AlreadyExists {
        name: csi_name.to_string(),
        pvc: pvc_name.clone(),
        reason,
    };
    let created_for = pvc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_NAME_ANNOTATION))
        .map(String::as_str)
        .unwrap_or(&pvc_name);
    if created_for != csi_name {
        return Err(clash(format!("for another volume name {created_for:?}")));
    }
    let restored_from = pvc
        .spec
        .as_ref()
        .and_then(|s| s.data_source.as_ref())
        .filter(|d| d.kind == "VolumeSnapshot")
        .map(|d| d.name.as_str());
    if restored_from != snapshot {
        return Err(clash(format!(
            "restored from snapshot {restored_from:?}, not {snapshot:?}"
        )));
    }
    let have = requested_bytes(pvc).unwrap_or(0);
    if have < size || (limit > 0 && have > limit) {
        return Err(clash(format!(
            "size {have} bytes, incompatible with the requested {size} bytes (limit {limit})"
        )));
    }
    Ok(have)
}

fn volume(id: &str, size: u64, source: Option<VolumeContentSource>) -> Volume {
    Volume {
        capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
        volume_id: id.to_string(),
        volume_context: Default::default(),
        content_source: source,
        accessible_topology: Vec::new(),
    }
}

impl ControllerService {
    pub(super) async fn create(
        &self,
        req: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, ControllerError> {
        let name = required("name", &req.name)?;
        request::capabilities("volume_capabilities", &req.volume_capabilities)?;
        let size = request::volume_size("capacity_range", req.capacity_range.as_ref())?;
        let limit = req
            .capacity_range
            .as_ref()
            .map_or(0, |r| u64::try_from(r.limit_bytes).unwrap_or(0));
        let mut params = Params::parse(&req.parameters, self.host_storage_class.as_deref())?;
        let snapshot_id = match req
            .volume_content_source
            .as_ref()
            .and_then(|s| s.r#type.as_ref())
        {
            None => None,
            Some(volume_content_source::Type::Snapshot(s)) => Some(required(
                "volume_content_source.snapshot.snapshot_id",
                &s.snapshot_id,
            )?),
            Some(volume_content_source::Type::Volume(_)) => {
                return Err(ArgError::Invalid {
                    field: "volume_content_source",
                    reason: "cloning a volume is not supported; restore from a snapshot".into(),
                }
                .into());
            }
        };
        let pvc_name = naming::host_volume_name(name);
        let _guard = self.begin(&pvc_name)?;
        let pvcs = self.pvcs();
        let get = |pvcs: Api<PersistentVolumeClaim>, n: String| async move {
            pvcs.get_opt(&n)
                .await
                .map_err(ControllerError::api(format!("getting PVC {n}")))
        };
        let source = req.volume_content_source.clone();
        let mut existing = get(pvcs.clone(), pvc_name.clone()).await?;
        if existing
            .as_ref()
            .is_some_and(|p| p.metadata.deletion_timestamp.is_some())
        {
            // A volume of that name is still being deleted: wait until it is gone, then create.
            self.wait_for(
                pvcs.clone(),
                &pvc_name,
                format!("the deleted PVC {}/{pvc_name} to go away", self.ns()),
                self.timeouts.bind,
                |p: Option<&PersistentVolumeClaim>| p.is_none(),
            )
            .await?;
            existing = None;
        }
        if let Some(existing) = existing {
            let have = existing_matches(name, &existing, size, limit, snapshot_id)?;
            return Ok(CreateVolumeResponse {
                volume: Some(volume(&pvc_name, have, source)),
            });
        }
        let mut size = size;
        if let Some(snapshot_id) = snapshot_id {
            // Restore like upstream: the snapshot's class and volume mode, at least its size.
            let snap = self.restore_source(snapshot_id).await?;
            size = size.max(
                snap.restore_bytes()
                    .unwrap_or(0)
                    .next_multiple_of(crate::request::SIZE_ALIGN),
            );
            if limit > 0 && size > limit {
                return Err(ArgError::OutOfRange {
                    field: "capacity_range",
                    reason: format!(
                        "snapshot {snapshot_id} needs {size} bytes, above limit_bytes {limit}"
                    ),
                }
                .into());
            }
            let labels = snap.metadata.labels.clone().unwrap_or_default();
            if let Some(sc) = labels
                .get(super::snapshots::LABEL_SNAP_HOST_SC)
                .filter(|s| !s.is_empty())
            {
                params.storage_class = Some(sc.clone());
                params.storage_class_from_param = false;
            }
            if let Some(mode) = labels.get(super::snapshots::LABEL_SNAP_HOST_VOLUME_MODE) {
                params.volume_mode = if mode.eq_ignore_ascii_case("filesystem") {
                    HostVolumeMode::Filesystem
                } else {
                    HostVolumeMode::Block
                };
            }
        }
        if let Some(class) = params
            .storage_class
            .as_deref()
            .filter(|_| params.storage_class_from_param)
        {
            self.check_storage_class(class).await?;
        }
        let pvc = host_pvc(&pvc_name, name, size, &params, snapshot_id);
        match pvcs.create(&PostParams::default(), &pvc).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                // Created concurrently (another replica, a retry): judge it like any existing one.
                let existing = get(pvcs, pvc_name.clone()).await?.ok_or_else(|| {
                    ControllerError::Precondition(format!(
                        "PVC {pvc_name} was created and deleted concurrently"
                    ))
                })?;
                existing_matches(name, &existing, size, limit, snapshot_id)?;
            }
            Err(e) => {
                return Err(ControllerError::api(format!("creating PVC {pvc_name}"))(e));
            }
        }
        tracing::info!(volume = %pvc_name, name, size, class = ?params.storage_class, snapshot = ?snapshot_id, "created Harvester PVC");
        Ok(CreateVolumeResponse {
            volume: Some(volume(&pvc_name, size, source)),
        })
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
            Err(kube::Error::Api(s)) if s.code == 403 => Ok(()),
            Err(e) => Err(ControllerError::api(format!(
                "getting StorageClass {class}"
            ))(e)),
        }
    }

    pub(super) async fn delete(
        &self,
        req: DeleteVolumeRequest,
    ) -> Result<DeleteVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        if !naming::is_dns1123_label(id) {
            // No PVC can have this name: it was never created, so it is deleted.
            return Ok(DeleteVolumeResponse {});
        }
        let _guard = self.begin(id)?;
        match self.pvcs().delete(id, &DeleteParams::default()).await {
            Ok(_) => {
                tracing::info!(volume = id, "deleted Harvester PVC");
                Ok(DeleteVolumeResponse {})
            }
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(DeleteVolumeResponse {}),
            Err(e) => Err(ControllerError::api(format!("deleting PVC {id}"))(e)),
        }
    }

    pub(super) async fn existing(
        &self,
        id: &str,
    ) -> Result<PersistentVolumeClaim, ControllerError> {
        let not_found = || ControllerError::VolumeNotFound {
            namespace: self.ns().to_string(),
            volume: id.to_string(),
        };
        if !naming::is_dns1123_label(id) {
            return Err(not_found());
        }
        self.pvcs()
            .get_opt(id)
            .await
            .map_err(ControllerError::api(format!("getting PVC {id}")))?
            .ok_or_else(not_found)
    }

    pub(super) async fn validate(
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
        self.existing(id).await?;
        // Unsupported capabilities are not an error here: the answer is "not confirmed".
        if let Err(e) = request::capabilities("volume_capabilities", &req.volume_capabilities) {
            return Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.to_string(),
            });
        }
        if let Err(e) = Params::parse(&req.parameters, self.host_storage_class.as_deref()) {
            return Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.to_string(),
            });
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

    /// Raises the host PVC's request and waits (watch) until Harvester reports the capacity.
    /// A request at or below the current size is a no-op that reports the current size, so the
    /// 2 MiB rounding never turns a small expansion into a "shrink" (upstream bug #11716).
    pub(super) async fn expand(
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
            .map(|c| request::Capability::parse("volume_capability", c))
            .transpose()?;
        let node_expansion_required = !cap.is_some_and(|c| c.is_block());
        let _guard = self.begin(id)?;
        let pvc = self.existing(id).await?;
        let have = requested_bytes(&pvc).unwrap_or(0);
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
        self.wait_for(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parameters_choose_class_and_mode() {
        let p = Params::parse(&params(&[]), None).unwrap();
        assert_eq!(
            (p.storage_class, p.volume_mode),
            (None, HostVolumeMode::Block)
        );
        let p = Params::parse(&params(&[]), Some("flag-class")).unwrap();
        assert_eq!(p.storage_class.as_deref(), Some("flag-class"));
        assert!(!p.storage_class_from_param);
        let p = Params::parse(
            &params(&[("hostStorageClass", "lh"), ("hostVolumeMode", "Filesystem")]),
            Some("flag-class"),
        )
        .unwrap();
        assert_eq!(p.storage_class.as_deref(), Some("lh"));
        assert!(p.storage_class_from_param);
        assert_eq!(p.volume_mode, HostVolumeMode::Filesystem);
        let e = Params::parse(&params(&[("hostVolumeMode", "tape")]), None).unwrap_err();
        assert!(e.to_string().contains("hostVolumeMode"), "{e}");
        assert!(Params::parse(&params(&[("csi.storage.k8s.io/fstype", "xfs")]), None).is_ok());
    }

    #[test]
    fn host_pvc_is_rwx_block_with_the_original_name_when_mapped() {
        let p = Params::parse(&params(&[]), None).unwrap();
        let pvc = host_pvc("pvc-1", "pvc-1", 64 << 20, &p, None);
        let spec = pvc.spec.clone().unwrap();
        assert_eq!(spec.access_modes.unwrap(), vec!["ReadWriteMany"]);
        assert_eq!(spec.volume_mode.as_deref(), Some("Block"));
        assert_eq!(spec.storage_class_name, None);
        assert_eq!(requested_bytes(&pvc), Some(64 << 20));
        assert!(
            pvc.metadata.annotations.is_none(),
            "kept names need no annotation"
        );
        let mapped = naming::host_volume_name("Sanity-X");
        let pvc = host_pvc(&mapped, "Sanity-X", 64 << 20, &p, Some("snap-1"));
        let source = pvc
            .spec
            .as_ref()
            .and_then(|s| s.data_source.clone())
            .unwrap();
        assert_eq!(
            (source.kind.as_str(), source.name.as_str()),
            ("VolumeSnapshot", "snap-1")
        );
        assert_eq!(
            pvc.metadata
                .annotations
                .unwrap()
                .get(ORIGINAL_NAME_ANNOTATION)
                .map(String::as_str),
            Some("Sanity-X")
        );
    }

    #[test]
    fn create_is_idempotent_for_compatible_requests_only() {
        let p = Params::parse(&params(&[]), None).unwrap();
        let mapped = naming::host_volume_name("Vol-A");
        let pvc = host_pvc(&mapped, "Vol-A", 64 << 20, &p, None);
        assert_eq!(
            existing_matches("Vol-A", &pvc, 64 << 20, 0, None).unwrap(),
            64 << 20
        );
        assert_eq!(
            existing_matches("Vol-A", &pvc, 10 << 20, 64 << 20, None).unwrap(),
            64 << 20
        );
        assert!(matches!(
            existing_matches("Vol-A", &pvc, 64 << 20, 0, Some("snap-1")),
            Err(ControllerError::AlreadyExists { .. })
        ));
        for (name, size, limit) in [
            ("Vol-A", 128 << 20, 0),       // bigger than what exists
            ("Vol-A", 10 << 20, 32 << 20), // existing is above the limit
            ("vol-a", 64 << 20, 0),        // a different name mapping to the same PVC
        ] {
            assert!(
                matches!(
                    existing_matches(name, &pvc, size, limit, None),
                    Err(ControllerError::AlreadyExists { .. })
                ),
                "{name} {size} {limit}"
            );
        }
    }
}
