//! The host PVC of a volume, as pure rules (no client): the StorageClass parameters
//! ([`Params`]), where the data comes from ([`Source`]), the PVC CreateVolume makes
//! ([`host_pvc`]), whether an existing one is the same volume ([`existing_matches`]), sizes,
//! and the one rule that turns a Kubernetes volume mode into a [`HostVolumeMode`].

use std::collections::{BTreeMap, HashMap};

use csi_proto::csi::v1::*;
use harvester_common::quantity;
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, TypedLocalObjectReference,
    VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::owner::Owner;
use crate::error::{ArgError, ControllerError};
use crate::naming::ORIGINAL_NAME_ANNOTATION;
use crate::request::required;

/// Labels upstream puts on a Harvester snapshot so a restore can recreate the PVC the same way:
/// written by `snapshots`, read by the restore here.
pub const LABEL_SNAP_HOST_SC: &str = "harvesterhci.io/snapHostSC";
pub const LABEL_SNAP_HOST_VOLUME_MODE: &str = "harvesterhci.io/snapHostVolumeMode";

/// Label on every host PVC this driver creates (value: the driver name), which ListVolumes
/// selects by; upstream's driver sets none, so its volumes are listed while hot-plugged only.
pub const LABEL_DRIVER: &str = "csi.harvesterhci.io/driver";

/// StorageClass parameter naming the Harvester StorageClass of the host PVC.
pub const PARAM_HOST_STORAGE_CLASS: &str = "hostStorageClass";
/// StorageClass parameter choosing the host PVC's volumeMode (`block`, the default, or `filesystem`).
pub const PARAM_HOST_VOLUME_MODE: &str = "hostVolumeMode";
/// The external-provisioner's own parameter keys (`--extra-create-metadata` adds
/// `csi.storage.k8s.io/pvc/name` and the like).
pub const PROVISIONER_PARAM_PREFIX: &str = "csi.storage.k8s.io/";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostVolumeMode {
    Block,
    Filesystem,
}

impl HostVolumeMode {
    /// The one reading of a Kubernetes `volumeMode` (a source PVC's, a snapshot label's):
    /// `Filesystem` in any case is a filesystem, anything else block.
    pub fn from_k8s(mode: Option<&str>) -> HostVolumeMode {
        match mode {
            Some(m) if m.eq_ignore_ascii_case("filesystem") => HostVolumeMode::Filesystem,
            _ => HostVolumeMode::Block,
        }
    }

    fn as_k8s(self) -> &'static str {
        match self {
            HostVolumeMode::Block => "Block",
            HostVolumeMode::Filesystem => "Filesystem",
        }
    }
}

/// The keys of `params` that are neither `known` nor the sidecars' own `csi.storage.k8s.io/*`,
/// quoted, sorted and joined with ", "; `None` when there are none.
pub fn unknown_params(params: &HashMap<String, String>, known: &[&str]) -> Option<String> {
    let mut unknown: Vec<String> = params
        .keys()
        .filter(|k| !known.contains(&k.as_str()) && !k.starts_with(PROVISIONER_PARAM_PREFIX))
        .map(|k| format!("{k:?}"))
        .collect();
    unknown.sort_unstable();
    (!unknown.is_empty()).then(|| unknown.join(", "))
}

/// CreateVolume parameters (the guest StorageClass's `parameters`). An unknown key is refused
/// naming it (upstream ignores it, so a typo such as `hostStorageClas` silently gave the default
/// class); the provisioner's own `csi.storage.k8s.io/*` keys pass.
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
        if let Some(unknown) =
            unknown_params(params, &[PARAM_HOST_STORAGE_CLASS, PARAM_HOST_VOLUME_MODE])
        {
            return Err(ArgError::Invalid {
                field: "parameters",
                reason: format!(
                    "unknown StorageClass parameter {unknown} (known: {PARAM_HOST_STORAGE_CLASS}, \
                     {PARAM_HOST_VOLUME_MODE}, {PROVISIONER_PARAM_PREFIX}*)"
                ),
            });
        }
        let from_param = params
            .get(PARAM_HOST_STORAGE_CLASS)
            .map(|s| s.trim())
            .filter(|s| !s.is_empty());
        let volume_mode = match params.get(PARAM_HOST_VOLUME_MODE).map(|s| s.trim()) {
            None | Some("") => HostVolumeMode::Block,
            Some(m) if m.eq_ignore_ascii_case("block") || m.eq_ignore_ascii_case("filesystem") => {
                HostVolumeMode::from_k8s(Some(m))
            }
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

impl Params {
    /// A clone, like Longhorn makes one: the source PVC's class and volume mode.
    pub fn clone_of(&mut self, source: &PersistentVolumeClaimSpec) {
        self.storage_class = source.storage_class_name.clone().filter(|s| !s.is_empty());
        self.storage_class_from_param = false;
        self.volume_mode = HostVolumeMode::from_k8s(source.volume_mode.as_deref());
    }

    /// A restore, like upstream makes one: the class and volume mode the snapshot's labels
    /// ([`LABEL_SNAP_HOST_SC`], [`LABEL_SNAP_HOST_VOLUME_MODE`]) name, where they name one.
    pub fn restore_of(&mut self, labels: &BTreeMap<String, String>) {
        if let Some(sc) = labels.get(LABEL_SNAP_HOST_SC).filter(|s| !s.is_empty()) {
            self.storage_class = Some(sc.clone());
            self.storage_class_from_param = false;
        }
        if let Some(mode) = labels.get(LABEL_SNAP_HOST_VOLUME_MODE) {
            self.volume_mode = HostVolumeMode::from_k8s(Some(mode));
        }
    }
}

/// Where a new volume's data comes from: a Harvester VolumeSnapshot (restore) or another
/// volume's Harvester PVC (clone). Both become the host PVC's `dataSource`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source<'a> {
    Snapshot(&'a str),
    Volume(&'a str),
}

impl<'a> Source<'a> {
    /// `(kind, name)` as the host PVC's `dataSource` names it.
    pub fn kind_and_name(self) -> (&'static str, &'a str) {
        match self {
            Source::Snapshot(n) => ("VolumeSnapshot", n),
            Source::Volume(n) => ("PersistentVolumeClaim", n),
        }
    }

    fn reference(self) -> TypedLocalObjectReference {
        let (kind, name) = self.kind_and_name();
        TypedLocalObjectReference {
            api_group: matches!(self, Source::Snapshot(_))
                .then(|| "snapshot.storage.k8s.io".to_string()),
            kind: kind.to_string(),
            name: name.to_string(),
        }
    }

    /// The source a CreateVolume request names, if any.
    pub fn of(req: &'a CreateVolumeRequest) -> Result<Option<Source<'a>>, ArgError> {
        Ok(
            match req
                .volume_content_source
                .as_ref()
                .and_then(|s| s.r#type.as_ref())
            {
                None => None,
                Some(volume_content_source::Type::Snapshot(s)) => Some(Source::Snapshot(required(
                    "volume_content_source.snapshot.snapshot_id",
                    &s.snapshot_id,
                )?)),
                Some(volume_content_source::Type::Volume(v)) => Some(Source::Volume(required(
                    "volume_content_source.volume.volume_id",
                    &v.volume_id,
                )?)),
            },
        )
    }
}

/// The Harvester PVC for a new volume of `owner`: RWX (so the VM can live-migrate), block mode
/// unless `hostVolumeMode: filesystem`, the size already rounded; restored or cloned from
/// `source`.
pub fn host_pvc(
    pvc_name: &str,
    csi_name: &str,
    size: u64,
    params: &Params,
    source: Option<Source>,
    owner: &Owner,
) -> PersistentVolumeClaim {
    let annotations = (pvc_name != csi_name)
        .then(|| BTreeMap::from([(ORIGINAL_NAME_ANNOTATION.to_string(), csi_name.to_string())]));
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(pvc_name.to_string()),
            annotations,
            labels: Some(volume_labels(owner)),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteMany".into()]),
            volume_mode: Some(params.volume_mode.as_k8s().into()),
            storage_class_name: params.storage_class.clone(),
            data_source: source.map(Source::reference),
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

/// The labels of every host PVC the driver makes: the driver's and the guest cluster's.
pub fn volume_labels(owner: &Owner) -> BTreeMap<String, String> {
    let mut labels = owner.labels();
    labels.insert(LABEL_DRIVER.to_string(), crate::DRIVER_NAME.to_string());
    labels
}

/// The requested size of a host PVC, in bytes.
pub fn requested_bytes(pvc: &PersistentVolumeClaim) -> Option<u64> {
    quantity::storage_request(pvc.spec.as_ref()?)
}

/// The capacity Harvester reports for a host PVC, in bytes.
pub fn capacity_bytes(pvc: &PersistentVolumeClaim) -> Option<u64> {
    let q = pvc.status.as_ref()?.capacity.as_ref()?.get("storage")?;
    quantity::to_bytes(&q.0)
}

/// The CSI volume of host PVC `id`.
pub fn csi_volume(id: &str, size: u64, source: Option<VolumeContentSource>) -> Volume {
    Volume {
        capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
        volume_id: id.to_string(),
        volume_context: Default::default(),
        content_source: source,
        accessible_topology: Vec::new(),
    }
}

/// Whether an existing host PVC is the volume CreateVolume asks for again: it was created for
/// the same CSI name and its size fits the request. Returns the volume's size.
pub fn existing_matches(
    csi_name: &str,
    pvc: &PersistentVolumeClaim,
    size: u64,
    limit: u64,
    source: Option<Source>,
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
    let made_from = pvc
        .spec
        .as_ref()
        .and_then(|s| s.data_source.as_ref())
        .map(|d| (d.kind.as_str(), d.name.as_str()));
    let wanted = source.map(Source::kind_and_name);
    if made_from != wanted {
        return Err(clash(format!("made from {made_from:?}, not {wanted:?}")));
    }
    let have = requested_bytes(pvc).unwrap_or(0);
    if have < size || (limit > 0 && have > limit) {
        return Err(clash(format!(
            "size {have} bytes, incompatible with the requested {size} bytes (limit {limit})"
        )));
    }
    Ok(have)
}

/// OUT_OF_RANGE for the request's `capacity_range`, saying why.
pub fn out_of_range(reason: String) -> ArgError {
    ArgError::OutOfRange {
        field: "capacity_range",
        reason,
    }
}

/// The size of a restore of a snapshot of `restore_bytes`: the request `size` (already
/// rounded), raised to the snapshot's size in 2 MiB steps; OUT_OF_RANGE above `limit`.
pub fn snapshot_restore_size(
    size: u64,
    limit: u64,
    snapshot: &str,
    restore_bytes: u64,
) -> Result<u64, ArgError> {
    let size = size.max(restore_bytes.next_multiple_of(crate::request::SIZE_ALIGN));
    if limit > 0 && size > limit {
        return Err(out_of_range(format!(
            "snapshot {snapshot} needs {size} bytes, above limit_bytes {limit}"
        )));
    }
    Ok(size)
}

/// The size of a clone of a `from_bytes` source: the request `size` (already rounded) when it
/// holds the source; the source's size when no size was asked for (`asked` 0); OUT_OF_RANGE
/// when a clone would be smaller than its source or the source is above `limit`.
pub fn clone_size(
    size: u64,
    asked: u64,
    limit: u64,
    source: &str,
    from_bytes: u64,
) -> Result<u64, ArgError> {
    if size >= from_bytes {
        return Ok(size);
    }
    if asked > 0 {
        return Err(out_of_range(format!(
            "required_bytes {asked} is smaller than source volume {source} ({from_bytes} bytes); \
             a clone holds all of its source"
        )));
    }
    if limit > 0 && from_bytes > limit {
        return Err(out_of_range(format!(
            "source volume {source} is {from_bytes} bytes, above limit_bytes {limit}"
        )));
    }
    Ok(from_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::naming;

    fn owner() -> Owner {
        Owner::new("rke2-a")
    }

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
        assert!(Params::parse(&params(&[("csi.storage.k8s.io/pvc/name", "data")]), None).is_ok());
        let e = Params::parse(
            &params(&[
                ("hostStorageClas", "lh"),
                ("zz", "1"),
                ("hostVolumeMode", "block"),
            ]),
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unknown StorageClass parameter \"hostStorageClas\", \"zz\""),
            "{e}"
        );
    }

    #[test]
    fn host_pvc_is_rwx_block_with_the_original_name_when_mapped() {
        let p = Params::parse(&params(&[]), None).unwrap();
        let pvc = host_pvc("pvc-1", "pvc-1", 64 << 20, &p, None, &owner());
        let spec = pvc.spec.clone().unwrap();
        assert_eq!(spec.access_modes.unwrap(), vec!["ReadWriteMany"]);
        let labels = pvc.metadata.labels.clone().unwrap();
        assert_eq!(labels[LABEL_DRIVER], crate::DRIVER_NAME);
        assert_eq!(labels[super::super::owner::LABEL_GUEST_CLUSTER], "rke2-a");
        assert_eq!(spec.volume_mode.as_deref(), Some("Block"));
        assert_eq!(spec.storage_class_name, None);
        assert_eq!(requested_bytes(&pvc), Some(64 << 20));
        assert!(
            pvc.metadata.annotations.is_none(),
            "kept names need no annotation"
        );
        let mapped = naming::host_volume_name("Sanity-X");
        let pvc = host_pvc(
            &mapped,
            "Sanity-X",
            64 << 20,
            &p,
            Some(Source::Snapshot("snap-1")),
            &owner(),
        );
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
    fn a_clone_is_a_pvc_with_its_source_pvc_as_data_source() {
        let p = Params::parse(&params(&[]), None).unwrap();
        let pvc = host_pvc(
            "pvc-2",
            "pvc-2",
            64 << 20,
            &p,
            Some(Source::Volume("pvc-1")),
            &owner(),
        );
        let ds = pvc
            .spec
            .as_ref()
            .and_then(|s| s.data_source.clone())
            .unwrap();
        // A PVC data source is in the core group: no apiGroup (Kubernetes' TypedLocalObjectReference).
        assert_eq!(
            (ds.api_group, ds.kind.as_str(), ds.name.as_str()),
            (None, "PersistentVolumeClaim", "pvc-1")
        );
        // The same name again with the same source is the same volume; another source is not.
        assert!(
            existing_matches("pvc-2", &pvc, 64 << 20, 0, Some(Source::Volume("pvc-1"))).is_ok()
        );
        for other in [
            None,
            Some(Source::Volume("pvc-9")),
            Some(Source::Snapshot("pvc-1")),
        ] {
            assert!(
                matches!(
                    existing_matches("pvc-2", &pvc, 64 << 20, 0, other),
                    Err(ControllerError::AlreadyExists { .. })
                ),
                "{other:?}"
            );
        }
    }

    #[test]
    fn a_clone_is_at_least_as_large_as_its_source() {
        const MI: u64 = 1 << 20;
        // (rounded size, required_bytes, limit_bytes, source bytes) -> size or OUT_OF_RANGE
        for (size, asked, limit, from, want) in [
            (64 * MI, 64 * MI, 0, 64 * MI, Some(64 * MI)),
            (128 * MI, 128 * MI, 0, 64 * MI, Some(128 * MI)),
            (10 * MI, 0, 0, 64 * MI, Some(64 * MI)),
            (32 * MI, 32 * MI, 0, 64 * MI, None),
            (10 * MI, 0, 32 * MI, 64 * MI, None),
        ] {
            let got = clone_size(size, asked, limit, "pvc-1", from);
            assert_eq!(
                got.as_ref().ok().copied(),
                want,
                "{size} {asked} {limit} {from}"
            );
            if let Err(e) = got {
                assert!(matches!(e, ArgError::OutOfRange { .. }), "{e}");
                assert!(e.to_string().contains("pvc-1"), "{e}");
            }
        }
    }

    #[test]
    fn create_is_idempotent_for_compatible_requests_only() {
        let p = Params::parse(&params(&[]), None).unwrap();
        let mapped = naming::host_volume_name("Vol-A");
        let pvc = host_pvc(&mapped, "Vol-A", 64 << 20, &p, None, &owner());
        assert_eq!(
            existing_matches("Vol-A", &pvc, 64 << 20, 0, None).unwrap(),
            64 << 20
        );
        assert_eq!(
            existing_matches("Vol-A", &pvc, 10 << 20, 64 << 20, None).unwrap(),
            64 << 20
        );
        assert!(matches!(
            existing_matches("Vol-A", &pvc, 64 << 20, 0, Some(Source::Snapshot("snap-1"))),
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
