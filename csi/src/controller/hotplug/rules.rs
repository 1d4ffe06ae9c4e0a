//! The hot-plug rules, pure (no client): who else holds a single-node volume, when a stopped
//! VM's disks may be taken (the out-of-service taint), the attach limit, and what virt-api's
//! answers to `addvolume`/`removevolume` mean.
//!
//! Its test of virt-api's answers runs just over 100 lines: one row per upstream text, kept in
//! one table so it reads beside `pkg/virt-api/rest/volumes.go`.

use std::time::Duration;

use harvester_common::harvester::hotplug::{HotplugError, VolumeRequest};
use harvester_common::harvester::kubevirt::{hotplug_capacity, provider_id};
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::Node;

/// The VM, other than `node`, that already holds a single-node volume, if any (`node` empty:
/// any VM). The VMIs named in `fenced` are ignored: VMIs that do not run, whose guest Node is
/// out of service (see [`VirtualMachineInstance::fenced`]), whose disks no guest can use any
/// more; so is such a VM whose spec still names the volume with a remove request queued for
/// KubeVirt to apply should its VMI start.
pub fn attached_elsewhere(
    claim: &str,
    node: &str,
    vms: &[VirtualMachine],
    vmis: &[VirtualMachineInstance],
    fenced: &[String],
) -> Option<String> {
    let name = |m: &kube::api::ObjectMeta| m.name.clone().unwrap_or_default();
    let leaving = |vm: &VirtualMachine| {
        fenced.contains(&name(&vm.metadata))
            && vm
                .spec
                .template
                .spec
                .volumes
                .iter()
                .filter(|v| v.uses_claim(claim))
                .all(|v| matches!(vm.pending_request(&v.name), Some(VolumeRequest::Remove(_))))
    };
    vms.iter()
        .filter(|vm| name(&vm.metadata) != node && vm.uses_claim(claim) && !leaving(vm))
        .map(|vm| name(&vm.metadata))
        .chain(
            vmis.iter()
                .filter(|vmi| {
                    let n = name(&vmi.metadata);
                    n != node && !fenced.contains(&n) && vmi.uses_claim(claim)
                })
                .map(|vmi| name(&vmi.metadata)),
        )
        .next()
}

/// The taint an administrator puts on a guest Node that is shut down for good (Kubernetes'
/// non-graceful node shutdown): its pods are force-deleted and its volumes force-detached.
pub const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// Whether guest Node `node` carries [`OUT_OF_SERVICE_TAINT`] (any value and effect).
pub fn out_of_service(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_TAINT))
}

/// The guest Node of VM `vm`: the Node named like the VM, else the one whose providerID is
/// `harvester://<VM UID>` (guest hostname differs from the VM name).
pub fn guest_node_of<'a>(vm: &str, vm_uid: Option<&str>, nodes: &'a [Node]) -> Option<&'a Node> {
    nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(vm))
        .or_else(|| {
            let uid = vm_uid?;
            let want = provider_id(uid);
            nodes.iter().find(|n| {
                n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(want.as_str())
            })
        })
}

/// `(hot-plugged volumes, limit)` of VM `vm` when it cannot take another volume. The limit is
/// `configured` (`--max-volumes-per-node`, as NodeGetInfo reports it), else KubeVirt's
/// [`hotplug_capacity`] of the VM's own (not hot-plugged) volumes, as the node plugin reports it.
pub fn attach_limit_reached(vm: &VirtualMachine, configured: Option<u32>) -> Option<(i64, i64)> {
    let (hotplugged, fixed) = vm.volume_counts();
    let hotplugged = i64::try_from(hotplugged).unwrap_or(i64::MAX);
    let limit = configured.map_or_else(|| hotplug_capacity(fixed), i64::from);
    (hotplugged >= limit).then_some((hotplugged, limit))
}

/// What an answer of virt-api's `addvolume`/`removevolume` means for the volume asked about.
#[derive(Debug, PartialEq, Eq)]
pub enum VirtApiAnswer {
    /// Accepted, or the change is already made or already requested: wait for the VMI.
    Done,
    /// Another request changed the VM's volumes meanwhile, or a remove of this volume is still
    /// being processed: ask again.
    Race,
    /// virt-api refuses this volume for good (the message says why).
    Refused(String),
    /// Not a hot-plug answer (API server, RBAC, network): the caller's error.
    Failed,
}

/// Reads virt-api's answer to `verb` (`addvolume` or `removevolume`). From KubeVirt v1.6.0 to
/// v1.8.3, `pkg/virt-api/rest/volumes.go`: every volume conflict is a 409 (`errors.NewConflict`)
/// with the texts matched here; the VM patch virt-api sends `test`s the lists it read (the spec's
/// volumes and disks, or with `HotplugVolumes` the VM's `status.volumeRequests`), and a lost race
/// comes back as the API server's 422 (Invalid), relayed as it is. Releases before v1.6 answered
/// 400 for the same conflicts; those texts are read the same way.
pub fn virt_api_answer(verb: &str, e: &HotplugError) -> VirtApiAnswer {
    let HotplugError::Request {
        source: kube::Error::Api(s),
        ..
    } = e
    else {
        return VirtApiAnswer::Failed;
    };
    let m = s.message.as_str();
    match (verb, s.code) {
        // A failed JSON patch `test` is the API server's bare 422; an admission webhook's refusal
        // (KubeVirt's VM admitter) is a 422 too, but says what it refused.
        (_, 422) if m.contains(PATCH_TEST_FAILED) => VirtApiAnswer::Race,
        (_, 422) => VirtApiAnswer::Refused(m.to_string()),
        ("addvolume", 400 | 409) if m.contains("because volume with that name already exists") => {
            VirtApiAnswer::Done
        }
        ("addvolume", 409) if m.contains("add volume request for volume") => {
            if m.contains("remove volume request") {
                // "unable to add volume since a remove volume request ... is still being processed"
                VirtApiAnswer::Race
            } else {
                // "add volume request for volume [X] already exists": ours, still being applied.
                VirtApiAnswer::Done
            }
        }
        ("addvolume", 409) if m.contains("remove volume request") => VirtApiAnswer::Race,
        ("addvolume", 409) if m.contains("because it already exists") => VirtApiAnswer::Refused(
            format!("the claim is already a volume of the VM under another name: {m}"),
        ),
        ("removevolume", 400 | 409) if m.contains("because it does not exist") => {
            VirtApiAnswer::Done
        }
        ("removevolume", 404) => VirtApiAnswer::Done,
        ("removevolume", 409) if m.contains("still being processed") => VirtApiAnswer::Done,
        ("removevolume", 409) if m.contains("not hotpluggable") => {
            VirtApiAnswer::Refused(m.to_string())
        }
        // Any other conflict is the VM changing under the request.
        (_, 409) => VirtApiAnswer::Race,
        (_, 400) if m.contains(HOTPLUG_GATES_OFF) => VirtApiAnswer::Refused(format!(
            "KubeVirt's hot-plug is switched off on Harvester: {m}"
        )),
        _ => VirtApiAnswer::Failed,
    }
}

/// Whether the API server refused a JSON patch of ours because a list it `test`s changed since it
/// was read (422 with the bare message below), or the object changed (409): plan again.
pub fn patch_lost_race(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s)
        if s.code == 409 || (s.code == 422 && s.message.contains(PATCH_TEST_FAILED)))
}

/// virt-api's answer (400) to `addvolume`/`removevolume` with neither hot-plug feature gate on
/// (kubevirt/kubevirt v1.6.1, v1.7.0, v1.8.0 `pkg/virt-api/rest/volumes.go`
/// `hotplugVolumeNotEnabledError`): the cluster's configuration, not a bad request of ours.
const HOTPLUG_GATES_OFF: &str =
    "Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API.";

/// kube-apiserver's whole message for a JSON patch whose `test` failed.
const PATCH_TEST_FAILED: &str = "the server rejected our request due to an error in our request";

/// How long to back off before attempt `attempt` (1-based) of a request that lost a race: grows
/// with the attempt, spread by `seed` so that concurrent requests for one VM stop colliding.
pub fn race_backoff(attempt: u32, seed: &str) -> Duration {
    use std::hash::BuildHasher;
    let spread = std::collections::hash_map::RandomState::new().hash_one((seed, attempt));
    let step = 25 * u64::from(attempt.min(8));
    Duration::from_millis(step + spread % (step * 2))
}

pub fn describe_volume(vmi: Option<&VirtualMachineInstance>, volume: &str) -> String {
    match vmi.and_then(|v| v.volume_status(volume)) {
        None => "no volumeStatus yet".into(),
        Some(s) => format!(
            "phase {:?}, reason {:?}, message {:?}",
            s.phase.as_deref().unwrap_or(""),
            s.reason.as_deref().unwrap_or(""),
            s.message.as_deref().unwrap_or("")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(name: &str, volumes: &[(&str, &str, Option<&str>)]) -> VirtualMachine {
        let vols: Vec<_> = volumes
            .iter()
            .map(|(n, c, _)| json!({"name": n, "persistentVolumeClaim": {"claimName": c, "hotpluggable": true}}))
            .collect();
        let disks: Vec<_> = volumes
            .iter()
            .map(|(n, _, s)| json!({"name": n, "serial": s, "disk": {"bus": "scsi"}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"volumes": vols, "domain": {"devices": {"disks": disks}}}}}
        }))
        .expect("vm literal")
    }

    fn vmi(name: &str, claims: &[&str]) -> VirtualMachineInstance {
        let vols: Vec<_> = claims
            .iter()
            .map(|c| json!({"name": c, "persistentVolumeClaim": {"claimName": c}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name}, "spec": {"volumes": vols}
        }))
        .expect("vmi literal")
    }

    #[test]
    fn a_single_node_volume_held_by_another_vm_is_found() {
        let vms = [vm("w1", &[("v1", "v1", Some("s1"))]), vm("w2", &[])];
        assert_eq!(
            attached_elsewhere("v1", "w2", &vms, &[], &[]),
            Some("w1".into())
        );
        assert_eq!(
            attached_elsewhere("v1", "w1", &vms, &[], &[]),
            None,
            "same node is fine"
        );
        assert_eq!(
            attached_elsewhere("v1", "", &vms, &[], &[]),
            Some("w1".into()),
            "no node: any VM (DeleteVolume)"
        );
        assert_eq!(attached_elsewhere("v2", "w2", &vms, &[], &[]), None);
        // A VMI still holding it (VM spec already cleaned up) counts too...
        assert_eq!(
            attached_elsewhere("v9", "w2", &vms, &[vmi("w3", &["v9"])], &[]),
            Some("w3".into())
        );
        // ...unless it is fenced (stopped, guest Node out of service).
        assert_eq!(
            attached_elsewhere("v9", "w2", &vms, &[vmi("w3", &["v9"])], &["w3".into()]),
            None
        );
        // A fenced VM whose spec still names it with a remove queued for KubeVirt is leaving it;
        // without the queued remove it still holds it.
        let mut leaving = vm("w1", &[("v1", "v1", Some("s1"))]);
        leaving.status = Some(
            serde_json::from_value(
                json!({"volumeRequests": [{"removeVolumeOptions": {"name": "v1"}}]}),
            )
            .expect("status literal"),
        );
        let fenced = ["w1".to_string()];
        assert_eq!(
            attached_elsewhere("v1", "w2", &[leaving.clone()], &[], &fenced),
            None
        );
        assert_eq!(
            attached_elsewhere("v1", "w2", &[leaving], &[], &[]),
            Some("w1".into())
        );
        assert_eq!(
            attached_elsewhere("v1", "w2", &vms, &[], &fenced),
            Some("w1".into())
        );
    }

    fn node(name: &str, provider_id: Option<&str>, taints: &[&str]) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"providerID": provider_id,
                     "taints": taints.iter().map(|k| json!({"key": k, "value": "nodeshutdown", "effect": "NoExecute"})).collect::<Vec<_>>()}
        }))
        .expect("node literal")
    }

    #[test]
    fn only_a_vmi_that_does_not_run_on_an_out_of_service_node_is_fenced() {
        let with_phase = |phase: &str| {
            let mut v = vmi("w1", &["v1"]);
            v.status = Some(serde_json::from_value(json!({"phase": phase})).unwrap());
            v
        };
        // (VMI phase, Node tainted out-of-service) -> fenced
        for (phase, tainted, want) in [
            ("Failed", true, true),
            ("Succeeded", true, true),
            ("Failed", false, false),
            ("Running", true, false),
            ("Scheduling", true, true),
            ("Scheduled", true, true),
            ("Pending", false, false),
        ] {
            assert_eq!(with_phase(phase).fenced(tainted), want, "{phase} {tainted}");
        }
        assert!(out_of_service(&node("w1", None, &[OUT_OF_SERVICE_TAINT])));
        assert!(!out_of_service(&node(
            "w1",
            None,
            &["node.kubernetes.io/unreachable"]
        )));
    }

    #[test]
    fn the_guest_node_is_found_by_name_then_provider_id() {
        let nodes = [
            node("host-a", Some("harvester://uid-a"), &[]),
            node("w2", Some("harvester://uid-2"), &[]),
        ];
        let name = |n: Option<&Node>| n.and_then(|n| n.metadata.name.clone());
        assert_eq!(
            name(guest_node_of("w2", Some("uid-x"), &nodes)),
            Some("w2".into())
        );
        assert_eq!(
            name(guest_node_of("vm-a", Some("uid-a"), &nodes)),
            Some("host-a".into())
        );
        assert_eq!(name(guest_node_of("vm-b", Some("uid-b"), &nodes)), None);
        assert_eq!(name(guest_node_of("vm-a", None, &nodes)), None);
    }

    #[test]
    fn the_attach_limit_counts_hot_plugged_volumes() {
        let w = vm("w1", &[("v1", "v1", Some("a")), ("v2", "v2", Some("b"))]);
        assert_eq!(attach_limit_reached(&w, Some(2)), Some((2, 2)));
        assert_eq!(attach_limit_reached(&w, Some(3)), None);
        assert_eq!(attach_limit_reached(&w, None), None, "KubeVirt's 256");
    }

    fn virt_api(code: u16, text: &str) -> HotplugError {
        HotplugError::Request {
            verb: "addvolume",
            namespace: "ns".into(),
            vm: "w1".into(),
            volume: "v1".into(),
            source: kube::Error::Api(
                kube::core::Status::failure(
                    &format!(
                        "Operation cannot be fulfilled on virtualmachine.kubevirt.io \"w1\": {text}"
                    ),
                    "Conflict",
                )
                .with_code(code)
                .boxed(),
            ),
        }
    }

    /// kubevirt/kubevirt v1.6.0-v1.8.3 pkg/virt-api/rest/volumes.go: (verb, code, text) -> meaning.
    fn virt_api_rows() -> [(&'static str, u16, &'static str, VirtApiAnswer); 16] {
        use VirtApiAnswer::*;
        [
            (
                "addvolume",
                409,
                "Unable to add volume [v1] because volume with that name already exists",
                Done,
            ),
            (
                "addvolume",
                409,
                "add volume request for volume [v1] already exists",
                Done,
            ),
            (
                "addvolume",
                409,
                "unable to add volume since a remove volume request for volume [v1] already exists and is still being processed",
                Race,
            ),
            (
                "addvolume",
                409,
                "Unable to add volume source [v1] because it already exists",
                Refused(String::new()),
            ),
            (
                "removevolume",
                409,
                "Unable to remove volume [v1] because it does not exist",
                Done,
            ),
            (
                "removevolume",
                409,
                "a remove volume request for volume [v1] already exists and is still being processed",
                Done,
            ),
            (
                "removevolume",
                409,
                "Unable to remove volume [v1] because it is not hotpluggable",
                Refused(String::new()),
            ),
            // A lost race on the VM's lists: the API server's 422, relayed.
            (
                "addvolume",
                422,
                "the server rejected our request due to an error in our request",
                Race,
            ),
            (
                "removevolume",
                422,
                "the server rejected our request due to an error in our request",
                Race,
            ),
            // KubeVirt's admission webhooks refusing the VM (declarative) or VM status
            // (HotplugVolumes) patch virt-api sent, as the bed plays them: their message
            // (pkg/storage/admitters/disks.go, storagehotplug.go, v1.7.0).
            (
                "addvolume",
                422,
                "admission webhook \"virtualmachine-validator.kubevirt.io\" denied the request: spec.template.spec.domain.devices.disks[1] must be made up of the following characters [A-Za-z0-9_.+-], if specified",
                Refused(String::new()),
            ),
            (
                "addvolume",
                422,
                "admission webhook \"kubevirt-crd-status-validator.kubevirt.io\" denied the request: AddVolume request for disk [v1] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted.",
                Refused(String::new()),
            ),
            // KubeVirt before v1.6 answered 400 for the same conflicts.
            (
                "addvolume",
                400,
                "Unable to add volume [v1] because volume with that name already exists",
                Done,
            ),
            (
                "removevolume",
                404,
                "virtualmachine.kubevirt.io \"w1\" not found",
                Done,
            ),
            // Neither hot-plug gate on: refused until an administrator enables one.
            (
                "addvolume",
                400,
                "Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API.",
                Refused(String::new()),
            ),
            (
                "addvolume",
                400,
                "AddVolumeOptions requires name to be set",
                Failed,
            ),
            ("addvolume", 500, "unable to patch vm status: boom", Failed),
        ]
    }

    #[test]
    fn virt_api_answers_are_read_by_what_they_mean() {
        use VirtApiAnswer::*;
        for (verb, code, text, want) in virt_api_rows() {
            let got = virt_api_answer(verb, &virt_api(code, text));
            match (&got, &want) {
                (Refused(why), Refused(_)) => assert!(why.contains(text), "{why}"),
                _ => assert_eq!(got, want, "{verb} {code} {text}"),
            }
        }
        assert_eq!(
            virt_api_answer("addvolume", &HotplugError::Build("x".into())),
            Failed
        );
    }

    #[test]
    fn race_backoff_grows_and_stays_bounded() {
        for attempt in 1..=30 {
            let d = race_backoff(attempt, "v1");
            let step = 25 * u64::from(attempt.min(8));
            assert!(d >= Duration::from_millis(step), "{attempt}: {d:?}");
            assert!(d < Duration::from_millis(step * 3), "{attempt}: {d:?}");
        }
    }

    #[test]
    fn vm_volume_reports_the_existing_serial() {
        let w = vm("w1", &[("v1", "v1", Some("abc")), ("v2", "v2", None)]);
        assert_eq!(w.volume("v1"), Some(Some("abc".into())));
        assert_eq!(w.volume("v2"), Some(None));
        assert_eq!(w.volume("v3"), None);
    }
}
