//! Attachments that heal (issue 27, harvester/harvester #10588 and #9761) with the real
//! csi-attacher of the chart: a Pod's disk removed behind the driver's back is seen at the
//! attacher's next VolumeAttachment resync and attached again, and so is a disk attached
//! nowhere.
//!
//! What the real attacher does (kubernetes-csi/external-attacher v4.13.0, the version
//! `make node-tools` builds): when the driver offers `LIST_VOLUMES` and
//! `LIST_VOLUMES_PUBLISHED_NODES` (`cmd/csi-attacher/main.go` `supportsControllerCapabilities`),
//! `pkg/controller/controller.go` runs `ReconcileVA` every `--reconcile-sync` (default 1m; the
//! chart keeps it) and at start. `pkg/controller/csi_handler.go` `ReconcileVA` compares each
//! VolumeAttachment's `status.attached` with whether ListVolumes names its node; on a mismatch it
//! logs "VolumeAttachment attached status and actual state do not match" and queues the VA with
//! `forceSync`, so `syncAttach` calls ControllerPublishVolume again although `attached` is true
//! ("we avoid UPDATE on the VA or forcing a direct attach/detach"): at this version the VA is
//! NOT written `attached: false` on the way; it stays attached and the disk is published again.
//! The test asserts exactly that, with a watch of the VAs over the whole repair.
//!
//! Why it cannot pass without the attacher: with the bed's default hot-plug gates nothing else
//! puts a disk back into a VMI (the stand-in's virt-controller does that under the declarative
//! gate alone, checked below), the kubelet does not touch an attached VA, so the disk comes back
//! Ready only through a ControllerPublishVolume, and the attacher's mismatch line for each VA
//! must appear in its log; a driver whose ListVolumes still named the node (the #10588 bug)
//! would give no mismatch, no log line and no repair, and both waits would time out.

use std::path::{Path, PathBuf};
use std::time::Instant;

use futures::StreamExt;
use harvester_common::harvester::VirtualMachineInstance;
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::runtime::{WatchStreamExt, watcher};
use testbed::sim::virt_api::BY_ID_PREFIX;

use super::*;

/// The attacher's line for a VA whose state and ListVolumes disagree (csi_handler.go v4.13.0).
const MISMATCH: &str = "VolumeAttachment attached status and actual state do not match";
/// One resync period (the attacher's default `--reconcile-sync`) and the margin of a loaded
/// machine.
const RESYNC: Duration = Duration::from_secs(60 + 40);
/// The driver gives KubeVirt 15 s to bring back a disk in the VM spec but not in its VMI
/// (docs/csi.md), then hot-plugs it again (90 s at most for a disk to become Ready).
const REPAIR: Duration = Duration::from_secs(15 + 90);

/// One volume of the step: its PVC, Pod, volume handle, VolumeAttachment and disk serial.
struct Disk {
    claim: &'static str,
    pod: &'static str,
    handle: String,
    va: String,
    serial: String,
}

/// Two Pods use a volume each; then disk A leaves the VMI while the VM spec keeps it (#10588),
/// disk B leaves both the VM spec and the VMI (attached nowhere), and for both the guest's
/// by-id link goes. The attacher's next resync notices both, the driver publishes both again,
/// each VA stays attached throughout, and each Pod still writes and reads its volume.
pub async fn attachments_heal_at_the_attachers_resync(bed: &TestBed, real: &GuestCluster) {
    assert!(
        !bed.sim.hotplug.gates().declarative_controller(),
        "run this suite with the bed's default KubeVirt line (TESTBED_KUBEVIRT unset)"
    );
    let mut disks = Vec::new();
    for (claim, pod_name) in [("heal-a", "heal-a-user"), ("heal-b", "heal-b-user")] {
        create(&api(bed), &pvc(claim, "harvester", "64Mi", json!({}))).await;
        // Writes and reads its volume every second, so its log shows the volume usable.
        let mut p = pod(
            pod_name,
            claim,
            false,
            "while true; do date +%s > /data/t && cat /data/t; sleep 1; done",
        );
        if let Some(s) = p.spec.as_mut() {
            s.restart_policy = Some("Always".into());
        }
        create(&api(bed), &p).await;
        wait_pod_ready(&bed.guest.client, NS, pod_name, POD_READY)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        disks.push(disk_of(bed, claim, pod_name).await);
    }
    let vas: Api<VolumeAttachment> = Api::all(bed.guest.client.clone());
    let names: Vec<String> = disks.iter().map(|d| d.va.clone()).collect();
    let sightings = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let watch = tokio::spawn(watch_attached(vas.clone(), names, sightings.clone()));

    // Behind the driver's back: A out of the VMI only, B out of the VM spec and the VMI.
    let vmis: Api<VirtualMachineInstance> =
        Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let vms: Api<VirtualMachine> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let (a, b) = (disks[0].handle.clone(), disks[1].handle.clone());
    replace_vm(&vms, |vm| {
        let spec = &mut vm.spec.template.spec;
        spec.volumes.retain(|v| v.name != b);
        spec.domain.devices.disks.retain(|d| d.name != b);
    })
    .await;
    bed.sim
        .drop_from_vmi(NODE, &[a.as_str(), b.as_str()])
        .await
        .expect("dropping the disks from the VMI");
    for d in &disks {
        // The guest lost the device: its udev link goes with it (KubeVirt's node side may have
        // taken it already).
        let link = by_id(&d.serial);
        match std::fs::remove_file(&link) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("removing {}: {e}", link.display()),
        }
    }
    let removed = Instant::now();
    eprintln!("disks {a} (VMI only) and {b} (VM spec and VMI) removed behind the driver's back");

    // Both at once, so each is measured on its own.
    futures::future::join_all(disks.iter().map(|d| heals(&vmis, &vms, real, d, removed))).await;
    let healed = std::time::SystemTime::now();
    for d in &disks {
        pod_still_uses_its_volume(bed, d, healed).await;
        let va = vas.get(&d.va).await.expect("VA");
        let status = va.status.unwrap_or_default();
        assert!(
            status.attached && status.attach_error.is_none(),
            "VA {} after the repair: {status:?}",
            d.va
        );
    }
    eprintln!(
        "both Pods wrote and read their volume {:.1}s after the removal",
        removed.elapsed().as_secs_f64()
    );
    watch.abort();
    let seen = sightings.lock().map(|s| s.clone()).unwrap_or_default();
    eprintln!("status.attached of the VAs as watched: {seen:?}");
    for d in &disks {
        let of_va: Vec<bool> = seen
            .iter()
            .filter(|(n, _)| *n == d.va)
            .map(|(_, a)| *a)
            .collect();
        // external-attacher v4.13.0 re-publishes without writing attached=false (module doc).
        assert!(
            !of_va.is_empty() && of_va.iter().all(|a| *a),
            "VA {} stays attached through the repair: {of_va:?}",
            d.va
        );
    }
    for d in &disks {
        delete_pod(bed, d.pod).await;
    }
}

/// Waits until the attacher's resync noticed disk `d` (its mismatch line for the VA), then
/// until the disk is Ready in the VMI again, linked, and back in the VM spec; prints when.
async fn heals(
    vmis: &Api<VirtualMachineInstance>,
    vms: &Api<VirtualMachine>,
    real: &GuestCluster,
    d: &Disk,
    removed: Instant,
) {
    wait::until(
        &format!("the csi-attacher's resync to notice VA {}", d.va),
        RESYNC,
        || async {
            let lines = attacher_lines(&real.node.dirs.pod_logs, &d.va);
            Ok(if lines.is_empty() {
                Err("no line")
            } else {
                Ok(())
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "VA {} ({}) seen as not published by the attacher {:.1}s after the removal",
        d.va,
        d.claim,
        removed.elapsed().as_secs_f64()
    );
    // KubeVirt stores the VM spec and the VMI apart (virt-controller's VM sync), so the three
    // are waited for together.
    wait::until(
        &format!(
            "disk {} Ready in the VMI again with its by-id link, and in the VM spec",
            d.handle
        ),
        REPAIR,
        || async {
            let vmi = vmis.get(NODE).await.map_err(|e| e.to_string())?;
            let phase = vmi.status.as_ref().and_then(|s| {
                s.volume_status
                    .iter()
                    .find(|v| v.name == d.handle)
                    .and_then(|v| v.phase.clone())
            });
            let linked = by_id(&d.serial).exists();
            let vm = vms.get(NODE).await.map_err(|e| e.to_string())?;
            let in_vm = vm
                .spec
                .template
                .spec
                .volumes
                .iter()
                .any(|v| v.name == d.handle);
            Ok(if phase.as_deref() == Some("Ready") && linked && in_vm {
                Ok(())
            } else {
                Err((phase, linked, in_vm))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "disk of {} attached again {:.1}s after the removal",
        d.claim,
        removed.elapsed().as_secs_f64()
    );
}

/// The PV's volume handle, the VolumeAttachment and the disk serial of `claim`, used by `pod`.
async fn disk_of(bed: &TestBed, claim: &'static str, pod: &'static str) -> Disk {
    let pv_name = bound(bed, claim)
        .await
        .spec
        .and_then(|s| s.volume_name)
        .expect("volumeName");
    let pv = Api::<PersistentVolume>::all(bed.guest.client.clone())
        .get(&pv_name)
        .await
        .expect("PV");
    let handle = pv
        .spec
        .and_then(|s| s.csi)
        .map(|c| c.volume_handle)
        .expect("CSI volume handle");
    let vas: Api<VolumeAttachment> = Api::all(bed.guest.client.clone());
    let va = vas
        .list(&ListParams::default())
        .await
        .expect("VAs")
        .items
        .into_iter()
        .find(|v| v.spec.source.persistent_volume_name.as_deref() == Some(&pv_name))
        .unwrap_or_else(|| panic!("no VolumeAttachment for {pv_name}"));
    let vmi =
        Api::<VirtualMachineInstance>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
            .get(NODE)
            .await
            .expect("VMI");
    let serial = vmi
        .spec
        .domain
        .devices
        .disks
        .iter()
        .find(|d| d.name == handle)
        .and_then(|d| d.serial.clone())
        .unwrap_or_else(|| panic!("disk {handle} has no serial in the VMI"));
    assert!(by_id(&serial).exists(), "{} is linked", serial);
    Disk {
        claim,
        pod,
        handle,
        va: va.name_any(),
        serial,
    }
}

/// The guest's udev link of a hot-plugged disk.
fn by_id(serial: &str) -> PathBuf {
    Path::new(HOST_BY_ID).join(format!("{BY_ID_PREFIX}{serial}"))
}

/// Replaces the VM after `change`, again on a conflict.
async fn replace_vm(vms: &Api<VirtualMachine>, change: impl Fn(&mut VirtualMachine)) {
    wait::until("replacing the VM", Duration::from_secs(10), || async {
        let mut vm = vms.get(NODE).await.map_err(|e| e.to_string())?;
        change(&mut vm);
        Ok(match vms.replace(NODE, &PostParams::default(), &vm).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(s.message),
            Err(e) => return Err(e.to_string()),
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The csi-attacher's mismatch lines naming VA `va`, from every csi-attacher container log of
/// the chart's namespace (`<ns>_<pod>_<uid>/csi-attacher/<n>.log`).
fn attacher_lines(pod_logs: &Path, va: &str) -> Vec<String> {
    let Ok(pods) = std::fs::read_dir(pod_logs) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for pod in pods.flatten() {
        if !pod
            .file_name()
            .to_string_lossy()
            .starts_with(&format!("{NAMESPACE}_"))
        {
            continue;
        }
        let Ok(files) = std::fs::read_dir(pod.path().join("csi-attacher")) else {
            continue;
        };
        for f in files.flatten() {
            let text = std::fs::read_to_string(f.path()).unwrap_or_default();
            found.extend(
                text.lines()
                    .filter(|l| l.contains(MISMATCH) && l.contains(va))
                    .map(str::to_string),
            );
        }
    }
    found
}

/// Records every `status.attached` of VAs `names` the watch sees, in order, until aborted.
async fn watch_attached(
    vas: Api<VolumeAttachment>,
    names: Vec<String>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<(String, bool)>>>,
) {
    let mut stream = std::pin::pin!(watcher(vas, watcher::Config::default()).applied_objects());
    while let Some(e) = stream.next().await {
        if let Ok(va) = e
            && names.contains(&va.name_any())
        {
            let attached = va.status.as_ref().is_some_and(|s| s.attached);
            if let Ok(mut s) = seen.lock() {
                s.push((va.name_any(), attached));
            }
        }
    }
}

/// The Pod has not restarted and, after `healed`, still wrote and read its volume: the last
/// line of its log is a time written after the repair.
async fn pod_still_uses_its_volume(bed: &TestBed, d: &Disk, healed: std::time::SystemTime) {
    let after = healed
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let pods: Api<Pod> = api(bed);
    wait::until(
        &format!(
            "Pod {} to write and read its volume after the repair",
            d.pod
        ),
        Duration::from_secs(30),
        || async {
            let log = pods
                .logs(
                    d.pod,
                    &LogParams {
                        tail_lines: Some(1),
                        ..LogParams::default()
                    },
                )
                .await
                .map_err(|e| e.to_string())?;
            let t: u64 = log.trim().parse().map_err(|_| format!("log {log:?}"))?;
            Ok(if t > after { Ok(()) } else { Err(t) })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let restarts = pods.get(d.pod).await.ok().and_then(|p| {
        p.status?
            .container_statuses?
            .first()
            .map(|c| c.restart_count)
    });
    assert_eq!(restarts, Some(0), "{} restarted", d.pod);
}
