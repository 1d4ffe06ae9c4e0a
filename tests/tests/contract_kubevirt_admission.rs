//! KubeVirt's admission rules on hot-plugged disks: KubeVirt's own validating webhooks
//! (configuration `virt-api-validator`, served by virt-api; KubeVirt v1.6.1 with `HotplugVolumes`
//! and v1.7.0 with `DeclarativeHotplugVolumes`; kubevirt/kubevirt `pkg/storage/admitters/disks.go`,
//! `storagehotplug.go`, `pkg/virt-api/webhooks/validating-webhook/admitters/vms-admitter.go`):
//! - under `HotplugVolumes`, virt-api's status patch is judged by the VM status webhook
//!   (`validateVolumeRequests`): a bad serial or a `sata` bus is refused at once, the API
//!   server's 422 relayed by virt-api with KubeVirt's message;
//! - under the declarative gate alone, virt-api's VM spec patch is judged by the VM webhook
//!   (`ValidateDisks`): a bad serial is refused at once; a `sata` disk is a valid disk there, so
//!   the spec takes it and the refusal comes when virt-controller puts it into the VMI (VMI update
//!   webhook, `AdmitHotplugStorage`): the VMI never gets the volume;
//! - the CSI driver's own publish passes the webhooks under both gate sets.

use testbed::suites::csi as csi_common;

use std::time::Duration;

use csi_common::*;
use harvester_common::harvester::hotplug::{self, AddVolumeOptions, HotplugError};
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use kube::api::Api;
use serde_json::json;
use testbed::bed::kubevirt::KubevirtLine;
use testbed::{BedOptions, TestBed, util::wait};

/// The webhooks of `virt-api-validator` that judge a hot-plug's disk, as virt-operator names them
/// (`pkg/virt-operator/resource/generate/components/webhooks.go`).
const VM_WEBHOOK: &str = "virtualmachine-validator.kubevirt.io";
const STATUS_WEBHOOK: &str = "kubevirt-crd-status-validator.kubevirt.io";

fn options(line: KubevirtLine) -> BedOptions {
    BedOptions {
        kubevirt: Some(line),
        ..Default::default()
    }
}

fn body(name: &str, serial: &str, bus: &str) -> AddVolumeOptions {
    let mut opts = AddVolumeOptions::scsi_pvc(name, &format!("{name}-claim"), serial);
    opts.disk.disk = json!({"bus": bus});
    opts
}

/// virt-api's answer to an `addvolume` of `body` on the guest VM: `Ok` or (code, reason,
/// message); the refusal's `details.causes` as `reason field` go to [`causes`].
async fn add(bed: &TestBed, body: &AddVolumeOptions) -> Result<(), (u16, String, String)> {
    add_with_causes(bed, body)
        .await
        .map_err(|(c, r, m, _)| (c, r, m))
}

async fn causes(bed: &TestBed, body: &AddVolumeOptions) -> Vec<String> {
    add_with_causes(bed, body).await.expect_err("refused").3
}

type Answer = (u16, String, String, Vec<String>);

async fn add_with_causes(bed: &TestBed, body: &AddVolumeOptions) -> Result<(), Answer> {
    match hotplug::add_volume(&bed.sim.harvester, &bed.vm_namespace, NODE, body).await {
        Ok(()) => Ok(()),
        Err(HotplugError::Request {
            source: kube::Error::Api(s),
            ..
        }) => Err((
            s.code,
            s.reason.clone(),
            s.message.clone(),
            s.details
                .as_ref()
                .map(|d| {
                    d.causes
                        .iter()
                        .map(|c| format!("{} {}", c.reason, c.field))
                        .collect()
                })
                .unwrap_or_default(),
        )),
        Err(e) => panic!("addvolume: {e}"),
    }
}

fn serial_text(index: usize) -> String {
    format!(
        "spec.template.spec.domain.devices.disks[{index}] must be made up of the following characters [A-Za-z0-9_.+-], if specified"
    )
}

fn denied(webhook: &str, text: &str) -> String {
    format!("admission webhook \"{webhook}\" denied the request: {text}")
}

async fn vm_has(bed: &TestBed, volume: &str) -> bool {
    Api::<VirtualMachine>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .get(NODE)
        .await
        .expect("VM")
        .spec
        .template
        .spec
        .volumes
        .iter()
        .any(|v| v.name == volume)
}

async fn vmi_has(bed: &TestBed, volume: &str) -> bool {
    let vmi =
        Api::<VirtualMachineInstance>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
            .get(NODE)
            .await
            .expect("VMI");
    vmi.spec.volumes.iter().any(|v| v.name == volume) || vmi.volume_status(volume).is_some()
}

/// The CSI driver publishes and unpublishes a volume to the guest VM through the webhooks.
async fn the_driver_s_publish_passes(bed: &TestBed) {
    let d = Driver::start(bed, |_| {}).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cap = mount_cap("ext4");
    let v = create_and_publish(&d, "admitted", 64 << 20, &cap, dir.path()).await;
    assert!(
        vm_has(bed, &v.id).await,
        "the VM spec has the published volume"
    );
    assert!(
        vmi_has(bed, &v.id).await,
        "the VMI has the published volume"
    );
    detach_and_delete(&d, &v).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_kubevirt_admission_refuses_a_bad_disk_at_addvolume_under_hotplug_volumes() {
    assert_root();
    let bed = bed_with_vm_and(options(KubevirtLine::V1_6_HOTPLUG)).await;

    let (code, reason, message) = add(&bed, &body("bad-serial", "a/b", "scsi"))
        .await
        .expect_err("a serial with '/' is refused");
    assert_eq!((code, reason.as_str()), (422, "Invalid"), "{message}");
    // The request applied to the template: after the VM's root disk, so it is disks[1].
    assert_eq!(message, denied(STATUS_WEBHOOK, &serial_text(1)));

    let (code, _, message) = add(&bed, &body("bad-bus", "okserial", "sata"))
        .await
        .expect_err("a sata hot-plug is refused");
    assert_eq!(code, 422, "{message}");
    assert_eq!(
        message,
        denied(
            STATUS_WEBHOOK,
            "AddVolume request for disk [bad-bus] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted."
        )
    );
    assert!(!vm_has(&bed, "bad-serial").await && !vm_has(&bed, "bad-bus").await);
    // The causes with their field paths come through the API server and virt-api.
    assert_eq!(
        causes(&bed, &body("bad-serial", "a/b", "scsi")).await,
        ["FieldValueInvalid spec.template.spec.domain.devices.disks[1].serial"]
    );
    assert_eq!(
        causes(&bed, &body("bad-bus", "okserial", "sata")).await,
        ["FieldValueInvalid Status.volumeRequests"]
    );

    the_driver_s_publish_passes(&bed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_kubevirt_admission_refuses_a_bad_disk_under_the_declarative_gate() {
    assert_root();
    let bed = bed_with_vm_and(options(KubevirtLine::V1_7_DECLARATIVE)).await;

    let (code, reason, message) = add(&bed, &body("bad-serial", "a/b", "scsi"))
        .await
        .expect_err("a serial with '/' is refused");
    assert_eq!((code, reason.as_str()), (422, "Invalid"), "{message}");
    assert_eq!(message, denied(VM_WEBHOOK, &serial_text(1)));
    assert!(!vm_has(&bed, "bad-serial").await);
    assert_eq!(
        causes(&bed, &body("bad-serial", "a/b", "scsi")).await,
        ["FieldValueInvalid spec.template.spec.domain.devices.disks[1].serial"]
    );

    // `sata` is a disk bus ValidateDisks knows: the VM spec takes it...
    add(&bed, &body("bad-bus", "okserial", "sata"))
        .await
        .expect("virt-api's spec patch passes the VM webhook");
    assert!(vm_has(&bed, "bad-bus").await);
    // ...and virt-controller's VMI update is refused by the VMI update webhook (its log says so).
    let want = "Hotplug configuration for disk [bad-bus] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted.";
    let log = bed
        .kubevirt
        .as_ref()
        .expect("KubeVirt's own binaries")
        .virt_controller
        .log
        .clone();
    wait::until(
        "the VMI update webhook refuses the sata hot-plug",
        Duration::from_secs(20),
        || {
            let log = log.clone();
            async move {
                let text = std::fs::read_to_string(&log).map_err(|e| e.to_string())?;
                Ok(if text.contains(want) {
                    Ok(())
                } else {
                    Err(log.display().to_string())
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(!vmi_has(&bed, "bad-bus").await, "the VMI never takes it");

    // The refused disk stays in the VM spec (as in KubeVirt); take it out before our publish.
    hotplug::remove_volume(
        &bed.sim.harvester,
        &bed.vm_namespace,
        NODE,
        &hotplug::RemoveVolumeOptions {
            name: "bad-bus".into(),
            rest: Default::default(),
        },
    )
    .await
    .expect("removevolume of the refused disk");
    wait::until(
        "the refused disk leaves the VM spec",
        Duration::from_secs(20),
        || async {
            Ok(if vm_has(&bed, "bad-bus").await {
                Err("still there")
            } else {
                Ok(())
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    the_driver_s_publish_passes(&bed).await;
}
