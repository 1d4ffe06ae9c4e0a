//! Hot-plug on Harvester v1.7 (KubeVirt `HotplugVolumes`) and v1.8+ (`DeclarativeHotplugVolumes`
//! alone), through KubeVirt v1.7.0's own virt-api and virt-controller with the matching feature
//! gates. The driver sends virt-api's `addvolume`/`removevolume` on every release (virt-api
//! v1.6+ serves them under either gate: a VM status request, or under the declarative gate a VM
//! spec patch); the driver still requires `server-version` to be readable, as upstream does. The
//! rest of the CSI suite runs under each gate set from `make test` (`TESTBED_KUBEVIRT`).

use testbed::suites::csi as csi_common;

use std::time::{Duration, Instant};

use csi_common::*;
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::*;
use harvester_common::harvester::hotplug::{self, AddVolumeOptions};
use harvester_common::harvester::{HotplugMode, Setting, VirtualMachine, VirtualMachineInstance};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use testbed::bed::kubevirt::KubevirtLine;
use testbed::sim::virt_api::{GATE_REFUSAL, Gates};
use testbed::{BedOptions, TestBed};

fn opts(line: KubevirtLine) -> BedOptions {
    BedOptions {
        kubevirt: Some(line),
        ..Default::default()
    }
}

async fn vm(bed: &TestBed) -> VirtualMachine {
    Api::<VirtualMachine>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .get(NODE)
        .await
        .expect("VM")
}

async fn vmi(bed: &TestBed) -> VirtualMachineInstance {
    Api::<VirtualMachineInstance>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .get(NODE)
        .await
        .expect("VMI")
}

/// `(volume entries, disk entries)` named `id` in the VM spec.
fn entries(vm: &VirtualMachine, id: &str) -> (usize, usize) {
    let spec = &vm.spec.template.spec;
    (
        spec.volumes.iter().filter(|v| v.name == id).count(),
        spec.domain
            .devices
            .disks
            .iter()
            .filter(|d| d.name == id)
            .count(),
    )
}

fn mount() -> VolumeCapability {
    mount_cap("ext4")
}

/// With neither hot-plug gate on, virt-api refuses its subresources with upstream's text, and
/// publish carries that text to the CSI caller at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_neither_gate_virt_api_refuses_and_publish_says_so() {
    let bed = bed_with_vm_and(opts(KubevirtLine {
        gates: &[],
        ..KubevirtLine::V1_7_DECLARATIVE
    }))
    .await;
    let refused = hotplug::add_volume(
        &bed.sim.harvester,
        &bed.vm_namespace,
        NODE,
        &AddVolumeOptions::scsi_pvc("probe", "probe", "probe"),
    )
    .await
    .expect_err("addvolume must be refused with both hot-plug gates off");
    let text = refused.to_string();
    assert!(text.contains(GATE_REFUSAL), "refusal: {text}");

    let d = Driver::start(&bed, |_| {}).await;
    let mut c = ControllerClient::new(d.channel.clone());
    let id = create_volume(&d, "no-gate", &mount()).await;
    let t0 = Instant::now();
    let err = c
        .controller_publish_volume(publish_request(&id, &mount()))
        .await
        .expect_err("publish with both hot-plug gates off");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(GATE_REFUSAL), "{}", err.message());
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert_eq!(entries(&vm(&bed).await, &id), (0, 0), "nothing hot-plugged");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declarative_hot_plug_goes_through_virt_api_s_vm_spec_patch() {
    let bed = bed_with_vm_and(opts(KubevirtLine::V1_7_DECLARATIVE)).await;
    let d = Driver::start(&bed, |_| {}).await;
    let dir = bed.dir.path().to_path_buf();
    let v = create_and_publish(&d, "decl-1", 64 << 20, &mount(), &dir).await;
    let serial = v
        .ctx
        .get("serial")
        .cloned()
        .expect("serial in the publish context");

    let spec_vm = vm(&bed).await;
    assert_eq!(
        entries(&spec_vm, &v.id),
        (1, 1),
        "one volume and one disk entry"
    );
    let volume = spec_vm
        .spec
        .template
        .spec
        .volumes
        .iter()
        .find(|x| x.name == v.id)
        .expect("volume entry");
    let pvc = volume
        .persistent_volume_claim
        .as_ref()
        .expect("a PVC volume");
    assert_eq!(pvc.claim_name, v.id);
    assert_eq!(pvc.hotpluggable, Some(true));
    let disk = spec_vm
        .spec
        .template
        .spec
        .domain
        .devices
        .disks
        .iter()
        .find(|x| x.name == v.id)
        .expect("disk entry");
    assert_eq!(
        disk.serial.as_deref(),
        Some(serial.as_str()),
        "our serial in the disk entry"
    );
    assert_eq!(
        disk.rest.get("disk"),
        Some(&serde_json::json!({"bus": "scsi"}))
    );
    let status = vmi(&bed).await;
    let vs = status.volume_status(&v.id).expect("VMI volumeStatus");
    assert_eq!(vs.phase.as_deref(), Some("Ready"));
    assert_eq!(vs.reason.as_deref(), Some("VolumeReady"));
    assert_eq!(
        vs.message.as_deref(),
        Some(format!("Successfully attach hotplugged volume {} to VM", v.id).as_str())
    );
    // Under the declarative gate virt-api patches the spec; it writes no status request.
    assert!(
        vm(&bed)
            .await
            .status
            .and_then(|s| s.rest.get("volumeRequests").cloned())
            .is_none(),
        "no status.volumeRequests on v1.8"
    );

    // The node plugin finds the disk the declarative hot-plug gave the guest.
    stage(&d, &v, &mount()).await.expect("NodeStage");
    publish(&d, &v, &mount()).await.expect("NodePublish");
    unpublish_and_unstage(&d, &v).await;

    ControllerClient::new(d.channel.clone())
        .controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume");
    assert_eq!(
        entries(&vm(&bed).await, &v.id),
        (0, 0),
        "removed from the VM spec"
    );
    assert!(
        vmi(&bed).await.volume_status(&v.id).is_none(),
        "gone from the VMI"
    );
    // KubeVirt took it into the VMI once and out once.
    assert_eq!(bed.sim.hotplug.plugs(NODE, &v.id), 1);
    assert_eq!(bed.sim.hotplug.unplugs(NODE, &v.id), 1);
    // Idempotent: unpublishing again finds nothing to remove.
    ControllerClient::new(d.channel.clone())
        .controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume again");
    detach_and_delete(&d, &v).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declarative_patch_on_a_changed_vm_is_refused_whole_and_retried_never_applied_twice() {
    let bed = bed_with_vm_and(opts(KubevirtLine::V1_7_DECLARATIVE)).await;
    let vms: Api<VirtualMachine> = Api::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace);
    let d = Driver::start(&bed, |_| {}).await;
    // The other writer's claims exist: KubeVirt hot-plugs only claims it finds.
    let other_vol = create_volume(&d, "other-vol", &mount()).await;
    let churn = create_volume(&d, "churn", &mount()).await;

    // The API server refuses, whole, a patch whose lists changed since they were read.
    let raw = |bed: &TestBed| {
        let (client, ns) = (bed.sim.harvester.clone(), bed.vm_namespace.clone());
        async move {
            hotplug::vm_template_spec(&client, &ns, NODE)
                .await
                .expect("GET VM")
                .expect("the VM")
        }
    };
    let stale = raw(&bed).await;
    let other =
        hotplug::declarative_add_patch(&stale, &other_vol, &other_vol, "o").expect("a patch");
    hotplug::patch_vm(&bed.sim.harvester, &bed.vm_namespace, NODE, &other)
        .await
        .expect("another writer's hot-plug");
    let patch =
        hotplug::declarative_add_patch(&stale, "stale-vol", "stale-vol", "s").expect("a patch");
    let err = hotplug::patch_vm(&bed.sim.harvester, &bed.vm_namespace, NODE, &patch)
        .await
        .expect_err("a patch of changed lists must be refused");
    // kube-apiserver answers a failed JSON patch test with a bare 422 (the failed operation is
    // not named): the driver tells a lost race by the lists having changed.
    assert!(
        hotplug::patch_refused(&err),
        "refused as invalid, got {err}"
    );
    let now = vm(&bed).await;
    assert_eq!(entries(&now, "stale-vol"), (0, 0), "nothing applied");
    assert_eq!(
        entries(&now, &other_vol),
        (1, 1),
        "the other writer's entries kept"
    );
    assert_ne!(
        hotplug::hotplug_lists(&raw(&bed).await),
        hotplug::hotplug_lists(&stale)
    );
    let undo = hotplug::declarative_remove_patch(&raw(&bed).await, &other_vol).expect("a patch");
    hotplug::patch_vm(&bed.sim.harvester, &bed.vm_namespace, NODE, &undo)
        .await
        .expect("removing the other writer's entries");

    // Publishes while another writer keeps hot-plugging and unplugging its own volume into the
    // same VM (lists change under the driver), and KubeVirt-like writers keep touching the VM
    // elsewhere (an annotation, which does not conflict): every attempt that loses the race is
    // made anew from the VM as it is, so each entry lands exactly once and none is lost.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = tokio::spawn({
        let (vms, stop, ns) = (vms.clone(), stop.clone(), bed.vm_namespace.clone());
        let churn = churn.clone();
        let client = bed.sim.harvester.clone();
        async move {
            let mut changes = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let Ok(Some(now)) = hotplug::vm_template_spec(&client, &ns, NODE).await else {
                    continue;
                };
                let patch = hotplug::declarative_add_patch(&now, &churn, &churn, "c")
                    .or_else(|| hotplug::declarative_remove_patch(&now, &churn));
                if let Some(p) = patch
                    && hotplug::patch_vm(&client, &ns, NODE, &p).await.is_ok()
                {
                    changes += 1;
                }
                let note = serde_json::json!({"metadata": {"annotations": {"test/bump": changes.to_string()}}});
                let _ = vms
                    .patch(NODE, &PatchParams::default(), &Patch::Merge(note))
                    .await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            changes
        }
    });
    let dir = bed.dir.path().to_path_buf();
    let mut vols = Vec::new();
    for i in 0..3 {
        vols.push(create_and_publish(&d, &format!("race-{i}"), 64 << 20, &mount(), &dir).await);
    }
    let mut c = ControllerClient::new(d.channel.clone());
    for v in &vols[..2] {
        c.controller_unpublish_volume(unpublish_request(&v.id))
            .await
            .expect("ControllerUnpublishVolume while the VM changes");
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let changes = writer.await.expect("the other writer");
    assert!(
        changes > 3,
        "the other writer changed the lists {changes} times"
    );
    let now = vm(&bed).await;
    assert_eq!(entries(&now, &vols[2].id), (1, 1), "still published, once");
    for v in &vols[..2] {
        assert_eq!(entries(&now, &v.id), (0, 0), "{} unpublished", v.id);
    }
    for v in &vols {
        detach_and_delete(&d, v).await;
    }
    d.stop().await;
}

/// `/readyz` of the driver on `port`: (status, body).
async fn readyz(port: u16) -> (u16, String) {
    testbed::util::scrape::get(port, "/readyz")
        .await
        .unwrap_or_else(|e| panic!("GET /readyz: {e}"))
}

async fn wait_readyz(port: u16, want_ok: bool, what: &str) -> String {
    let start = Instant::now();
    loop {
        let (code, body) = readyz(port).await;
        if (code == 200) == want_ok {
            return body;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what}: /readyz still {code}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mode_follows_server_version_and_an_unreadable_setting_fails_loudly() {
    // Both gates on, so that virt-api serves either mode; Harvester says v1.7 first.
    let bed = bed_with_vm_and(opts(KubevirtLine::V1_7_BOTH)).await;
    bed.sim
        .set_harvester(HotplugMode::Subresource, Gates::BOTH)
        .await
        .expect("server-version v1.7");
    let port = testbed::util::process::free_port().expect("a free port");
    let d = Driver::start(&bed, |c| {
        c.metrics_address = Some(([127, 0, 0, 1], port).into());
    })
    .await;
    wait_readyz(port, true, "ready on Harvester v1.7").await;
    let dir = bed.dir.path().to_path_buf();
    let v1 = create_and_publish(&d, "before-upgrade", 64 << 20, &mount(), &dir).await;
    assert_eq!(
        bed.sim.hotplug.plugs(NODE, &v1.id),
        1,
        "v1.7: hot-plugged once"
    );

    // The setting disappears (or RBAC takes it away): not ready, and publish says why.
    let settings: Api<Setting> = Api::all(bed.sim.harvester.clone());
    settings
        .delete("server-version", &DeleteParams::default())
        .await
        .expect("deleting server-version");
    let body = wait_readyz(port, false, "not ready without server-version").await;
    assert!(
        body.contains("hotplug") && body.contains("server-version"),
        "/readyz: {body}"
    );
    let mut c = ControllerClient::new(d.channel.clone());
    let created = c
        .create_volume(create_request("after-upgrade", 64 << 20, &mount()))
        .await
        .expect("CreateVolume needs no hot-plug mode")
        .into_inner()
        .volume
        .expect("volume");
    let err = c
        .controller_publish_volume(publish_request(&created.volume_id, &mount()))
        .await
        .expect_err("publish without a known hot-plug mode");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("server-version"),
        "{}",
        err.message()
    );

    // Harvester is upgraded to v1.8: the driver follows without a restart.
    bed.sim
        .set_harvester(HotplugMode::Declarative, Gates::BOTH)
        .await
        .expect("upgrading the bed's Harvester");
    wait_readyz(port, true, "ready again on Harvester v1.8").await;
    let published = c
        .controller_publish_volume(publish_request(&created.volume_id, &mount()))
        .await
        .expect("ControllerPublishVolume on v1.8")
        .into_inner();
    assert!(published.publish_context.contains_key("serial"));
    assert_eq!(entries(&vm(&bed).await, &created.volume_id), (1, 1));
    assert_eq!(
        bed.sim.hotplug.plugs(NODE, &created.volume_id),
        1,
        "v1.8: hot-plugged once"
    );
    // A volume hot-plugged the old way comes off the new way.
    c.controller_unpublish_volume(unpublish_request(&v1.id))
        .await
        .expect("unpublishing the v1.7 volume on v1.8");
    assert_eq!(entries(&vm(&bed).await, &v1.id), (0, 0));
    assert_eq!(bed.sim.hotplug.unplugs(NODE, &v1.id), 1);
    for id in [&v1.id, &created.volume_id] {
        c.controller_unpublish_volume(unpublish_request(id))
            .await
            .expect("ControllerUnpublishVolume");
        c.delete_volume(DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("DeleteVolume");
    }
    d.stop().await;
}
