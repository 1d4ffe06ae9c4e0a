//! ControllerUnpublishVolume of a hot-plugged volume as a plan, pure (no client): from the VM
//! (its spec and its pending `status.volumeRequests`) and its VMI, the next step that brings the
//! volume out of both. The driver takes a step, waits for the VM or VMI to change, and plans again
//! until [`Step::Done`].
//!
//! What KubeVirt does (kubevirt/kubevirt v1.6.1, v1.7.0, v1.8.0, the same in all three):
//! - VM `removevolume` is checked against the VM spec only: a volume still in a pending add
//!   request, not yet in the spec, is refused as one that does not exist
//!   (`pkg/virt-api/rest/volumes.go` `verifyVolumeOption`). Under `HotplugVolumes` it queues a
//!   request (dropping the volume's pending adds, `addRemoveVolumeRequests`); under the declarative
//!   gate alone it edits the VM spec. It never looks at the VMI.
//! - virt-controller applies the queued requests to the VM spec and, through the VMI's
//!   `addvolume`/`removevolume`, to an existing VMI, which virt-api refuses for a VMI that is not
//!   running (`VMI is not running`, `pkg/virt-api/rest/volumes.go` `vmiVolumePatch`); one refusal
//!   fails the whole pass and nothing is stored (`pkg/virt-controller/watch/vm/vm.go`
//!   `handleVolumeRequests`). Its status update still drops the requests the stored spec already
//!   reflects (`updateStatus`, `trimDoneVolumeRequests`).
//!
//! So while a VM's VMI has stopped (and is not yet replaced by a new one) no queued request is
//! ever applied: the driver makes the VM spec edit virt-controller would have made, and a queued
//! add would otherwise be applied to the next VMI, attaching the disk with no VolumeAttachment.

use harvester_common::harvester::hotplug::VolumeRequest;
use harvester_common::harvester::{AddVolumeOptions, VirtualMachine, VirtualMachineInstance};

use super::rules::OUT_OF_SERVICE_TAINT;

/// What to do next about a volume leaving a VM.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Neither the VM (spec or a pending add) nor a VMI that may still run holds the volume.
    Done,
    /// VM `removevolume` through virt-api.
    RemoveVolume,
    /// The VM spec edit KubeVirt does not make while the VM's VMI has stopped.
    Edit(SpecEdit),
    /// KubeVirt has a step left: wait for the VM or VMI to change (the text says for what).
    Wait(String),
    /// The volume cannot leave (FAILED_PRECONDITION, the text says why).
    Refuse(String),
}

#[derive(Debug, PartialEq)]
pub enum SpecEdit {
    /// The volume and its disk out of the VM spec.
    Remove,
    /// A pending add applied to the spec as virt-controller would apply it: the request is then
    /// done, virt-controller drops it, and the volume is removed from the spec next.
    Apply(Box<AddVolumeOptions>),
}

/// The next step for volume `id` of VM `vm` (named `node`) and its VMI. `fenced`: the VMI does
/// not run and its guest Node is out of service ([`VirtualMachineInstance::fenced`]).
pub fn plan(
    ns: &str,
    node: &str,
    id: &str,
    vm: Option<&VirtualMachine>,
    vmi: Option<&VirtualMachineInstance>,
    fenced: bool,
) -> Step {
    let in_spec = vm.is_some_and(|v| v.volume(id).is_some());
    if in_spec && !vm.is_some_and(|v| v.hotplugged(id)) {
        return Step::Refuse(format!(
            "volume {id} is a static (not hot-plugged) disk of VM {ns}/{node}; refusing to remove it"
        ));
    }
    let pending = vm.and_then(|v| v.pending_request(id));
    let in_vmi = vmi.is_some_and(|v| v.has_volume(id));
    // A VMI that has not started yet is one KubeVirt applies nothing to either; once its guest
    // Node is out of service it is handled as a stopped one, except that a queued remove stays
    // for KubeVirt to apply should it start.
    let stopped = vmi.is_some_and(|v| v.stopped());
    if stopped || fenced {
        // A stopped VMI keeps its disks: only the administrator's out-of-service taint on its
        // guest Node says that no guest uses them any more.
        if in_vmi && !fenced {
            return Step::Refuse(format!(
                "VM {ns}/{node} is stopped, but its VMI still holds volume {id} and KubeVirt \
                 cannot unplug a disk from a stopped VMI; if the guest is shut down for good, \
                 taint its Node {OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute"
            ));
        }
        return match (in_spec, pending) {
            (false, Some(VolumeRequest::Add(opts))) => Step::Edit(SpecEdit::Apply(Box::new(opts))),
            (true, Some(VolumeRequest::Add(_))) => Step::Wait(format!(
                "KubeVirt to drop the add request of volume {id} that VM {ns}/{node}'s spec now holds"
            )),
            // Asked, but queued: virt-controller applies nothing while the VMI has stopped.
            (true, Some(VolumeRequest::Remove(_))) if stopped => Step::Edit(SpecEdit::Remove),
            // Queued for a VMI that has not started: applied once it runs, which a spec edit
            // now would prevent (the request would be dropped as done, the disk left in it).
            (true, Some(VolumeRequest::Remove(_))) => Step::Done,
            // Asked first: under the declarative gate alone virt-api edits the spec itself.
            (true, None) => Step::RemoveVolume,
            // A pending remove of a volume the spec no longer has is dropped by virt-controller
            // and changes nothing.
            (false, _) => Step::Done,
        };
    }
    // The VMI runs, is starting, or there is none: KubeVirt applies each request (to a VMI once
    // it runs).
    match (in_spec, pending) {
        (false, Some(VolumeRequest::Add(_))) => Step::Wait(format!(
            "KubeVirt to apply the pending addvolume request of volume {id} to VM {ns}/{node} \
             (virt-api removes only a volume the VM spec has)"
        )),
        (true, Some(VolumeRequest::Remove(_))) => Step::Wait(format!(
            "KubeVirt to apply the removevolume request of volume {id} to VM {ns}/{node}"
        )),
        (true, _) => Step::RemoveVolume,
        (false, _) if in_vmi => Step::Wait(format!("volume {id} to leave VMI {ns}/{node}")),
        (false, _) => Step::Done,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn add(name: &str) -> Value {
        json!({"addVolumeOptions": {"name": name, "disk": {"name": name, "serial": "s1", "disk": {"bus": "scsi"}},
               "volumeSource": {"persistentVolumeClaim": {"claimName": name, "hotpluggable": true}}}})
    }

    fn remove(name: &str) -> Value {
        json!({"removeVolumeOptions": {"name": name}})
    }

    /// VM `w1` with `pvc-1` in its spec (hot-plugged or not) or not, and `requests` pending.
    fn vm(spec: Option<bool>, requests: &[Value]) -> VirtualMachine {
        let volumes: Vec<_> = spec
            .map(|hp| json!({"name": "pvc-1", "persistentVolumeClaim": {"claimName": "pvc-1", "hotpluggable": hp}}))
            .into_iter()
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "w1", "namespace": "ns"},
            "spec": {"template": {"spec": {"volumes": volumes,
                "domain": {"devices": {"disks": [{"name": "pvc-1", "serial": "s1"}]}}}}},
            "status": {"volumeRequests": requests}
        }))
        .expect("vm literal")
    }

    fn vmi(phase: &str, has: bool) -> VirtualMachineInstance {
        let volumes: Vec<_> = has
            .then(|| json!({"name": "pvc-1", "persistentVolumeClaim": {"claimName": "pvc-1"}}))
            .into_iter()
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "w1"}, "spec": {"volumes": volumes},
            "status": {"phase": phase}
        }))
        .expect("vmi literal")
    }

    fn step(vm: &VirtualMachine, vmi: Option<&VirtualMachineInstance>, fenced: bool) -> Step {
        plan("ns", "w1", "pvc-1", Some(vm), vmi, fenced)
    }

    fn kind(s: &Step) -> &'static str {
        match s {
            Step::Done => "done",
            Step::RemoveVolume => "removevolume",
            Step::Edit(SpecEdit::Remove) => "edit: remove",
            Step::Edit(SpecEdit::Apply(_)) => "edit: apply add",
            Step::Wait(_) => "wait",
            Step::Refuse(_) => "refuse",
        }
    }

    #[test]
    fn a_running_vm_is_left_to_kubevirt_and_a_pending_add_is_waited_for() {
        let running = vmi("Running", true);
        let starting = vmi("Scheduled", false);
        // (VM spec has it, pending requests, VMI) -> step
        type Row<'a> = (
            Option<bool>,
            Vec<Value>,
            Option<&'a VirtualMachineInstance>,
            &'a str,
        );
        let rows: [Row; 9] = [
            (Some(true), vec![], Some(&running), "removevolume"),
            (
                Some(true),
                vec![add("pvc-1")],
                Some(&running),
                "removevolume",
            ),
            (Some(true), vec![remove("pvc-1")], Some(&running), "wait"),
            (None, vec![], Some(&running), "wait"),
            (None, vec![], Some(&vmi("Running", false)), "done"),
            // Published while the VMI was starting: the add is applied once it runs.
            (None, vec![add("pvc-1")], Some(&starting), "wait"),
            (None, vec![add("pvc-1")], None, "wait"),
            // Requests for other volumes do not matter.
            (None, vec![add("pvc-2"), remove("pvc-3")], None, "done"),
            // A remove after an add: the last one counts.
            (None, vec![add("pvc-1"), remove("pvc-1")], None, "done"),
        ];
        for (spec, requests, vmi, want) in rows {
            let got = step(&vm(spec, &requests), vmi, false);
            assert_eq!(kind(&got), want, "{spec:?} {requests:?} {vmi:?}: {got:?}");
        }
    }

    #[test]
    fn a_stopped_vmi_gets_the_spec_edit_kubevirt_does_not_make() {
        let holding = vmi("Failed", true);
        let without = vmi("Succeeded", false);
        type Row<'a> = (
            Option<bool>,
            Vec<Value>,
            &'a VirtualMachineInstance,
            bool,
            &'a str,
        );
        let rows: [Row; 9] = [
            (Some(true), vec![], &holding, false, "refuse"),
            (Some(true), vec![], &holding, true, "removevolume"),
            (
                Some(true),
                vec![remove("pvc-1")],
                &holding,
                true,
                "edit: remove",
            ),
            (None, vec![remove("pvc-1")], &holding, true, "done"),
            (None, vec![], &holding, true, "done"),
            // The stopped VMI never had it: no taint needed.
            (
                Some(true),
                vec![remove("pvc-1")],
                &without,
                false,
                "edit: remove",
            ),
            (None, vec![add("pvc-1")], &without, false, "edit: apply add"),
            (Some(true), vec![add("pvc-1")], &without, false, "wait"),
            (None, vec![], &without, false, "done"),
        ];
        for (spec, requests, vmi, fenced, want) in rows {
            let got = step(&vm(spec, &requests), Some(vmi), fenced);
            assert_eq!(
                kind(&got),
                want,
                "{spec:?} {requests:?} {vmi:?} {fenced}: {got:?}"
            );
        }
        let Step::Refuse(why) = step(&vm(Some(true), &[]), Some(&holding), false) else {
            unreachable!()
        };
        assert!(why.contains(OUT_OF_SERVICE_TAINT), "{why}");
        let Step::Edit(SpecEdit::Apply(opts)) =
            step(&vm(None, &[add("pvc-1")]), Some(&without), false)
        else {
            unreachable!()
        };
        assert_eq!(
            (opts.name.as_str(), opts.claim_name()),
            ("pvc-1", Some("pvc-1"))
        );
    }

    /// KubeVirt restarted the VM of a lost host: its new VMI lists the volume (from the VM
    /// spec) and waits for a host. KubeVirt applies nothing to it until it runs, so only the
    /// out-of-service taint lets the volume go.
    #[test]
    fn a_vmi_waiting_for_a_host_is_waited_for_until_its_node_is_out_of_service() {
        let waiting = vmi("Scheduling", true);
        // (VM spec has it, pending requests, fenced) -> step
        let rows: [(Option<bool>, Vec<Value>, bool, &str); 5] = [
            (Some(true), vec![], false, "removevolume"),
            (Some(true), vec![remove("pvc-1")], false, "wait"),
            (Some(true), vec![], true, "removevolume"),
            // The queued remove stays for KubeVirt, should the VMI start.
            (Some(true), vec![remove("pvc-1")], true, "done"),
            (None, vec![], true, "done"),
        ];
        for (spec, requests, fenced, want) in rows {
            let got = step(&vm(spec, &requests), Some(&waiting), fenced);
            assert_eq!(kind(&got), want, "{spec:?} {requests:?} {fenced}: {got:?}");
        }
        assert_eq!(
            kind(&step(&vm(None, &[]), Some(&waiting), false)),
            "wait",
            "without the taint the volume is waited for until it leaves the VMI"
        );
    }

    #[test]
    fn a_static_disk_is_never_removed() {
        let got = step(&vm(Some(false), &[]), Some(&vmi("Running", true)), false);
        assert!(
            matches!(&got, Step::Refuse(w) if w.contains("static")),
            "{got:?}"
        );
    }
}
