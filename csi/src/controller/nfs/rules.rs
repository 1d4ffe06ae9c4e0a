//! The RWX (NFS) rules, pure (no client): which host StorageClass can serve an RWX volume,
//! which host PVC is one, the NetworkFilesystem upstream makes for it, when publish may enable
//! it ([`enable_step`]), who still uses it on unpublish ([`holders`]), and which capabilities
//! fit which kind of volume ([`kind_mismatch`]).

use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs::{
    NAMESPACE, NetworkFilesystemSpec, PROVISIONER_LONGHORN, STATE_DISABLED, STATE_ENABLED,
};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};

/// The provisioner of a Longhorn StorageClass: upstream's `isLHRWXVolume` checks only this (with
/// the PVC's `Filesystem` mode and `ReadWriteMany`).
pub const LONGHORN_PROVISIONER: &str = "driver.longhorn.io";
/// Annotation marking a cluster's default StorageClass.
pub const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";

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

/// ValidateVolumeCapabilities: why capabilities that do (`wants_rwx`) or do not ask for
/// MULTI_NODE_MULTI_WRITER fit volume `id`, which is (`is_rwx`) or is not an RWX volume, if they
/// do not. MULTI_NODE_MULTI_WRITER fits only an RWX volume (served through its
/// NetworkFilesystem), and an RWX volume is served only that way (one node's hot-plug cannot
/// reach it).
pub fn kind_mismatch(id: &str, wants_rwx: bool, is_rwx: bool) -> Option<String> {
    match (wants_rwx, is_rwx) {
        (true, false) => Some(format!(
            "volume {id} is a single-node volume (hot-plugged into one VM);                  MULTI_NODE_MULTI_WRITER needs an RWX volume"
        )),
        (false, true) => Some(format!(
            "volume {id} is an RWX volume served over NFS; only MULTI_NODE_MULTI_WRITER                  mount capabilities fit it"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
