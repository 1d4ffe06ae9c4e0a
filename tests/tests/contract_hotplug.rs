//! The driver against KubeVirt's hot-plug as it really behaves: KubeVirt's own virt-api and
//! virt-controller (v1.6.1 for Harvester v1.7, v1.7.0 for v1.8; `BedOptions::kubevirt`) under
//! each feature-gate set Harvester can run:
//! - virt-api answers volume conflicts with 409 and a lost race on the VM with the API server's
//!   422; several volumes published to one VM at once must all land in one CSI call each;
//! - `addvolume` works under either gate (`HotplugVolumes`: a VM status request; the declarative
//!   gate alone: a VM spec patch) and under both;
//! - under the declarative gate alone, KubeVirt hot-plugs nothing into a VM whose
//!   `updateVolumesStrategy` is `Migration`: publish must say so, not wait out its bound;
//! - under `HotplugVolumes`, virt-controller applies `vm.status.volumeRequests` to running VMIs
//!   only: an add request pending there is a disk about to be attached.

use testbed::suites::csi as csi_common;

use std::time::{Duration, Instant};

use csi_common::*;
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::*;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use kube::api::{Api, Patch, PatchParams};
use testbed::BedOptions;
use testbed::bed::kubevirt::KubevirtLine;
use tonic::transport::Channel;

/// How many volumes a burst publishes to one VM at once (a Pod with several claims).
const BURST: usize = 6;

fn harvester(line: KubevirtLine) -> BedOptions {
    BedOptions {
        kubevirt: Some(line),
        ..Default::default()
    }
}

fn mount() -> VolumeCapability {
    mount_cap("ext4")
}

/// DeleteVolume of `id`.
async fn delete(c: &mut ControllerClient<Channel>, id: &str) {
    c.delete_volume(DeleteVolumeRequest {
        volume_id: id.to_string(),
        ..Default::default()
    })
    .await
    .expect("DeleteVolume");
}

/// The hot-plugged volumes of the VM spec and of the VMI (spec or status) named like a volume
/// of `ids`.
async fn attached(bed: &testbed::TestBed, ids: &[String]) -> (usize, usize) {
    let vm = Api::<VirtualMachine>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .get(NODE)
        .await
        .expect("VM");
    let vmi =
        Api::<VirtualMachineInstance>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
            .get(NODE)
            .await
            .expect("VMI");
    let in_vm = ids
        .iter()
        .filter(|id| vm.spec.template.spec.volumes.iter().any(|v| &v.name == *id))
        .count();
    let in_vmi = ids
        .iter()
        .filter(|id| {
            vmi.spec.volumes.iter().any(|v| &v.name == *id) || vmi.volume_status(id).is_some()
        })
        .count();
    (in_vm, in_vmi)
}

/// [`BURST`] volumes published to one VM at once, then unpublished at once: every call answers
/// OK the first time (no ABORTED left to the attacher's backoff), each disk is plugged and
/// unplugged exactly once.
async fn a_burst_lands_in_one_round(line: KubevirtLine) {
    let bed = bed_with_vm_and(harvester(line)).await;
    let d = Driver::start(&bed, |_| {}).await;
    let mut c = d.controller();
    let mut ids = Vec::new();
    for i in 0..BURST {
        ids.push(create_volume(&d, &format!("burst-{i}"), &mount()).await);
    }

    let t0 = Instant::now();
    let publishes = ids.iter().map(|id| {
        let mut c = d.controller();
        let req = publish_request(id, &mount());
        async move { c.controller_publish_volume(req).await }
    });
    let answers = futures::future::join_all(publishes).await;
    let took = t0.elapsed();
    for (id, a) in ids.iter().zip(&answers) {
        let a = a
            .as_ref()
            .unwrap_or_else(|e| panic!("publish of {id} in the burst ({line:?}): {e:?}"));
        assert!(a.get_ref().publish_context.contains_key("serial"), "{a:?}");
    }
    eprintln!("{line:?}: {BURST} concurrent publishes to one VM answered OK in {took:?}");
    assert_eq!(attached(&bed, &ids).await, (BURST, BURST));

    let t0 = Instant::now();
    let unpublishes = ids.iter().map(|id| {
        let mut c = d.controller();
        let req = unpublish_request(id);
        async move { c.controller_unpublish_volume(req).await }
    });
    for (id, a) in ids.iter().zip(futures::future::join_all(unpublishes).await) {
        a.unwrap_or_else(|e| panic!("unpublish of {id} in the burst ({line:?}): {e:?}"));
    }
    eprintln!(
        "{line:?}: {BURST} concurrent unpublishes answered OK in {:?}",
        t0.elapsed()
    );
    assert_eq!(attached(&bed, &ids).await, (0, 0));
    for id in &ids {
        assert_eq!(bed.sim.hotplug.plugs(NODE, id), 1, "{id} plugged once");
        assert_eq!(bed.sim.hotplug.unplugs(NODE, id), 1, "{id} unplugged once");
        delete(&mut c, id).await;
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_burst_of_publishes_lands_in_one_round_on_harvester_1_7() {
    a_burst_lands_in_one_round(KubevirtLine::V1_6_HOTPLUG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_burst_of_publishes_lands_in_one_round_on_harvester_1_8() {
    a_burst_lands_in_one_round(KubevirtLine::V1_7_DECLARATIVE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_burst_of_publishes_lands_in_one_round_with_both_gates() {
    a_burst_lands_in_one_round(KubevirtLine::V1_7_BOTH).await;
}

/// The kinds (`add`, `remove`) of the bed VM's pending `status.volumeRequests` for volume `id`.
async fn pending_requests(bed: &testbed::TestBed, id: &str) -> Vec<&'static str> {
    let vm = Api::<VirtualMachine>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .get(NODE)
        .await
        .expect("VM");
    let requests = vm
        .status
        .and_then(|s| s.rest.get("volumeRequests").cloned())
        .unwrap_or_default();
    let named = |r: &serde_json::Value, kind: &str| r[kind]["name"].as_str() == Some(id);
    requests
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            if named(r, "addVolumeOptions") {
                Some("add")
            } else if named(r, "removeVolumeOptions") {
                Some("remove")
            } else {
                None
            }
        })
        .collect()
}

/// A publish that timed out while its add request still waited in `vm.status.volumeRequests`
/// (the VMI was not running yet, and virt-controller applies requests to running VMIs only):
/// KubeVirt applies it once the VMI runs, so unpublish must not answer OK before, nor another
/// node get the volume; once it runs, unpublish takes the disk out again.
async fn a_pending_add_is_never_left_behind(line: KubevirtLine) {
    const OTHER: &str = "worker-2";
    let bed = bed_with_vm_and(harvester(line)).await;
    bed.sim
        .create_vm(
            &testbed::sim::GuestVm::new(OTHER)
                .on_host("harvester-1")
                .ip("10.52.0.12"),
        )
        .await
        .expect("second guest VM");
    let d = Driver::start(&bed, |c| {
        c.timeouts.attach = Duration::from_secs(4);
        c.timeouts.detach = Duration::from_secs(10);
    })
    .await;
    let mut c = d.controller();
    let id = create_volume(&d, "pending-add", &mount()).await;
    let ids = std::slice::from_ref(&id);

    // The VM is starting: its VMI exists but does not run yet.
    bed.sim
        .restart_vm_held(NODE)
        .await
        .expect("the VM restarted, its guest held before boot");
    let err = c
        .controller_publish_volume(publish_request(&id, &mount()))
        .await
        .expect_err("no hot-plug into a VMI that does not run");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert_eq!(pending_requests(&bed, &id).await, ["add"], "({line:?})");
    assert_eq!(attached(&bed, ids).await, (0, 0), "nothing applied yet");

    let err = c
        .controller_unpublish_volume(unpublish_request(&id))
        .await
        .expect_err("unpublish while KubeVirt still holds the add request");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("addvolume"), "{}", err.message());
    let err = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            node_id: OTHER.into(),
            ..publish_request(&id, &mount())
        })
        .await
        .expect_err("publish elsewhere while the add to NODE is pending");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(NODE), "{}", err.message());

    // The VMI runs: KubeVirt applies the add, and unpublish takes the disk out again.
    bed.sim.boot_vm(NODE).await.expect("the guest boots");
    c.controller_unpublish_volume(unpublish_request(&id))
        .await
        .expect("ControllerUnpublishVolume once the VMI runs");
    assert_eq!(attached(&bed, ids).await, (0, 0));
    assert!(
        !pending_requests(&bed, &id).await.contains(&"add"),
        "no add left to apply"
    );
    assert_eq!(
        bed.sim.hotplug.plugs(NODE, &id),
        1,
        "plugged once the VMI ran"
    );
    assert_eq!(bed.sim.hotplug.unplugs(NODE, &id), 1);
    assert_eq!(bed.sim.hotplug.plugs(OTHER, &id), 0);
    delete(&mut c, &id).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_pending_add_request_is_never_left_behind_on_harvester_1_7() {
    a_pending_add_is_never_left_behind(KubevirtLine::V1_6_HOTPLUG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_pending_add_request_is_never_left_behind_with_both_gates() {
    a_pending_add_is_never_left_behind(KubevirtLine::V1_7_BOTH).await;
}

/// A VM whose volume updates go by migration, where KubeVirt hot-plugs (`HotplugVolumes` on):
/// publish and unpublish work as for any VM.
async fn migration_vm_works(line: KubevirtLine) {
    let bed = bed_with_vm_and(harvester(line)).await;
    migration_strategy(&bed).await;
    let d = Driver::start(&bed, |_| {}).await;
    let dir = bed.dir.path().to_path_buf();
    let v = create_and_publish(&d, "migr-1", 64 << 20, &mount(), &dir).await;
    assert_eq!(attached(&bed, std::slice::from_ref(&v.id)).await, (1, 1));
    d.controller()
        .controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume");
    assert_eq!(attached(&bed, std::slice::from_ref(&v.id)).await, (0, 0));
    detach_and_delete(&d, &v).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_migration_strategy_vm_is_hot_plugged_on_harvester_1_7() {
    migration_vm_works(KubevirtLine::V1_6_HOTPLUG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_migration_strategy_vm_is_hot_plugged_with_both_gates() {
    migration_vm_works(KubevirtLine::V1_7_BOTH).await;
}

/// What a request KubeVirt will not act on for a `Migration` VM must get: FAILED_PRECONDITION
/// naming the strategy and the gate (and `more`), within KubeVirt's grace rather than the
/// request's attach or detach bound.
fn assert_migration_refusal(err: &tonic::Status, took: Duration, more: &[&str]) {
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    for word in [
        "updateVolumesStrategy",
        "Migration",
        "DeclarativeHotplugVolumes",
    ]
    .iter()
    .chain(more)
    {
        assert!(
            err.message().contains(word),
            "names {word}: {}",
            err.message()
        );
    }
    assert!(
        took < Duration::from_secs(30),
        "answered within KubeVirt's grace, not the request's bound: {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_migration_strategy_vm_on_harvester_1_8_fails_clearly_and_unpublishes() {
    let bed = bed_with_vm_and(harvester(KubevirtLine::V1_7_DECLARATIVE)).await;
    migration_strategy(&bed).await;
    let d = Driver::start(&bed, |_| {}).await;
    let mut c = d.controller();
    let id = create_volume(&d, "migr-18", &mount()).await;
    let t0 = Instant::now();
    let err = c
        .controller_publish_volume(publish_request(&id, &mount()))
        .await
        .expect_err("KubeVirt never hot-plugs into this VM: publish must fail");
    assert_migration_refusal(&err, t0.elapsed(), &[]);
    // The request left the volume in the VM spec; unpublish takes it out again.
    c.controller_unpublish_volume(unpublish_request(&id))
        .await
        .expect("ControllerUnpublishVolume");
    assert_eq!(attached(&bed, std::slice::from_ref(&id)).await, (0, 0));
    assert_eq!(bed.sim.hotplug.plugs(NODE, &id), 0);
    delete(&mut c, &id).await;
    d.stop().await;
}

/// A volume hot-plugged before Harvester set `updateVolumesStrategy: Migration` on the VM (as
/// v1.8 does for every VM it storage-migrates): under the declarative gate alone KubeVirt never
/// unplugs it, so unpublish fails clearly within KubeVirt's grace instead of waiting out the
/// detach bound; once the strategy is back to Replacement, unpublish ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_unpublish_from_a_vm_turned_migration_on_harvester_1_8_fails_clearly() {
    let bed = bed_with_vm_and(harvester(KubevirtLine::V1_7_DECLARATIVE)).await;
    let d = Driver::start(&bed, |_| {}).await;
    let dir = bed.dir.path().to_path_buf();
    let v = create_and_publish(&d, "migr-late", 64 << 20, &mount(), &dir).await;
    assert_eq!(attached(&bed, std::slice::from_ref(&v.id)).await, (1, 1));
    migration_strategy(&bed).await;
    let mut c = d.controller();
    let t0 = Instant::now();
    let err = c
        .controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect_err("KubeVirt never unplugs from this VM: unpublish must fail");
    assert_migration_refusal(&err, t0.elapsed(), &["stays attached"]);
    // The storage migration cancelled: the strategy goes back, and unpublish ends.
    Api::<VirtualMachine>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .patch(
            NODE,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"updateVolumesStrategy": "Replacement"}})),
        )
        .await
        .expect("VM updateVolumesStrategy: Replacement");
    c.controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume once the strategy is Replacement");
    assert_eq!(attached(&bed, std::slice::from_ref(&v.id)).await, (0, 0));
    detach_and_delete(&d, &v).await;
    d.stop().await;
}
