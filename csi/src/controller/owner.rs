//! Which Harvester objects belong to this guest cluster. Several guest clusters may share one
//! Harvester namespace, and a volume or snapshot ID is only a name there: every host PVC,
//! VolumeSnapshot, VolumeRemoteBackup and VolumeRemoteRestore the driver makes carries the
//! label [`LABEL_GUEST_CLUSTER`] with this cluster's name (the key Harvester's node driver
//! puts on guest VMs, and upstream's driver puts on host PVCs in harvester/harvester-csi-driver
//! PR #65), and the driver acts only on objects that carry it. An unlabelled object (made by
//! upstream's driver, or a pre-existing PVC behind a static PV) is this cluster's only once a
//! Harvester admin labels it, or while `--adopt-unlabelled-volumes` is set for a switch from
//! upstream: a guest cluster can never claim an object by naming it. VMs carry the same label
//! from Rancher's node driver; a VM labelled for another cluster is never a node of this one
//! (custom clusters' VMs carry none and stay usable).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::error::ControllerError;

/// The guest cluster an object on Harvester belongs to.
pub const LABEL_GUEST_CLUSTER: &str = "guestcluster.harvesterhci.io/name";

/// This guest cluster, as the driver tells its objects apart from other clusters'.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// `--cluster-name`: the value of [`LABEL_GUEST_CLUSTER`] on this cluster's objects.
    pub cluster: String,
    /// `--adopt-unlabelled-volumes`: objects without the label count as this cluster's.
    pub adopt_unlabelled: bool,
}

/// Whose an object is, by its labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim<'a> {
    Ours,
    Unlabelled,
    Other(&'a str),
}

impl Owner {
    pub fn new(cluster: impl Into<String>) -> Owner {
        Owner {
            cluster: cluster.into(),
            adopt_unlabelled: false,
        }
    }

    /// The labels that mark a new object as this cluster's.
    pub fn labels(&self) -> BTreeMap<String, String> {
        BTreeMap::from([(LABEL_GUEST_CLUSTER.to_string(), self.cluster.clone())])
    }

    pub fn claim<'a>(&self, meta: &'a ObjectMeta) -> Claim<'a> {
        match meta
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_GUEST_CLUSTER))
        {
            None => Claim::Unlabelled,
            Some(c) if *c == self.cluster => Claim::Ours,
            Some(c) => Claim::Other(c),
        }
    }

    /// Whether the driver may act on the object with `meta`.
    pub fn owns(&self, meta: &ObjectMeta) -> bool {
        match self.claim(meta) {
            Claim::Ours => true,
            Claim::Unlabelled => self.adopt_unlabelled,
            Claim::Other(_) => false,
        }
    }

    /// PERMISSION_DENIED naming the object and the label it lacks, unless this cluster owns it.
    pub fn check(
        &self,
        kind: &'static str,
        namespace: &str,
        meta: &ObjectMeta,
    ) -> Result<(), ControllerError> {
        if self.owns(meta) {
            return Ok(());
        }
        Err(ControllerError::NotOwned {
            kind,
            namespace: namespace.to_string(),
            name: meta.name.clone().unwrap_or_default(),
            cluster: self.cluster.clone(),
            found: match self.claim(meta) {
                Claim::Other(c) => format!("it is labelled {LABEL_GUEST_CLUSTER}={c}"),
                _ => format!("it has no {LABEL_GUEST_CLUSTER} label"),
            },
        })
    }

    /// PERMISSION_DENIED when VM `meta` is labelled for another guest cluster; an unlabelled VM
    /// (a custom cluster's) may be a node of this one.
    pub fn check_vm(&self, namespace: &str, meta: &ObjectMeta) -> Result<(), ControllerError> {
        match self.claim(meta) {
            Claim::Other(c) => Err(ControllerError::NotOwned {
                kind: "VirtualMachine",
                namespace: namespace.to_string(),
                name: meta.name.clone().unwrap_or_default(),
                cluster: self.cluster.clone(),
                found: format!("it is a node of guest cluster {c:?} ({LABEL_GUEST_CLUSTER})"),
            }),
            _ => Ok(()),
        }
    }
}

/// `--cluster-name` as a label value: at most 63 characters, alphanumerics with `-`, `_` or
/// `.` inside (Kubernetes' label value syntax), so it can mark objects on Harvester.
pub fn parse_cluster_name(raw: &str) -> Result<String, String> {
    let name = raw.trim();
    let inner_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let ends_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if name.is_empty()
        || name.len() > 63
        || !name.chars().all(inner_ok)
        || !ends_ok(name.chars().next())
        || !ends_ok(name.chars().last())
    {
        return Err(format!(
            "--cluster-name {raw:?} is not a label value (1-63 letters, digits, '-', '_' or '.', \
             starting and ending with a letter or digit): it labels this cluster's volumes on \
             Harvester"
        ));
    }
    Ok(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(label: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some("pvc-1".into()),
            labels: label.map(|c| BTreeMap::from([(LABEL_GUEST_CLUSTER.into(), c.into())])),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn only_objects_labelled_for_this_cluster_are_its_own() {
        let owner = Owner::new("rke2-a");
        assert!(owner.owns(&meta(Some("rke2-a"))));
        assert!(!owner.owns(&meta(Some("rke2-b"))));
        assert!(!owner.owns(&meta(None)));
        let adopting = Owner {
            adopt_unlabelled: true,
            ..owner.clone()
        };
        assert!(adopting.owns(&meta(None)));
        assert!(
            !adopting.owns(&meta(Some("rke2-b"))),
            "adopting never takes another cluster's"
        );
        assert_eq!(owner.labels()[LABEL_GUEST_CLUSTER], "rke2-a");
    }

    #[test]
    fn a_refusal_names_the_object_and_the_label_it_lacks() {
        let owner = Owner::new("rke2-a");
        let e = owner
            .check("PersistentVolumeClaim", "vms", &meta(Some("rke2-b")))
            .unwrap_err();
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        let m = status.message();
        for part in [
            "PersistentVolumeClaim vms/pvc-1",
            "\"rke2-a\"",
            "guestcluster.harvesterhci.io/name=rke2-b",
        ] {
            assert!(m.contains(part), "{m}");
        }
        let e = owner
            .check("PersistentVolumeClaim", "vms", &meta(None))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("has no guestcluster.harvesterhci.io/name label")
        );
    }

    #[test]
    fn vms_of_other_clusters_are_refused_unlabelled_ones_allowed() {
        let owner = Owner::new("rke2-a");
        assert!(owner.check_vm("vms", &meta(None)).is_ok());
        assert!(owner.check_vm("vms", &meta(Some("rke2-a"))).is_ok());
        let e = owner.check_vm("vms", &meta(Some("rke2-b"))).unwrap_err();
        assert!(e.to_string().contains("VirtualMachine vms/pvc-1"), "{e}");
    }

    #[test]
    fn cluster_names_must_be_label_values() {
        assert_eq!(
            parse_cluster_name(" c-m-abcd1234 ").unwrap(),
            "c-m-abcd1234"
        );
        assert_eq!(parse_cluster_name("rke2_prod.1").unwrap(), "rke2_prod.1");
        for bad in ["", "-a", "a-", "a/b", "a b", &"x".repeat(64)] {
            let e = parse_cluster_name(bad).unwrap_err();
            assert!(e.contains("--cluster-name"), "{e}");
        }
    }
}
