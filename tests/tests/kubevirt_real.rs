//! The CSI driver's hot-plug through KubeVirt's own virt-api and virt-controller
//! (`BedOptions { kubevirt: Some(line) }`, built by `tests/scripts/kubevirt.sh`), for each
//! KubeVirt line and gate set Harvester runs; only the node side (kubelet, virt-handler) is
//! played (`testbed::sim::virt_handler`). One bed per line: its cases run in one test. Tests
//! named `_root` need root (loop devices, mkfs, mount).

use std::path::Path;
use std::time::{Duration, Instant};

use csi_proto::csi::v1::*;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, ListParams};
use testbed::bed::kubevirt::KubevirtLine;
use testbed::suites::csi::{
    Driver, NODE, a_volume_of_a_powered_off_node_moves, assert_root, bed_with_vm_and,
    create_and_publish, create_volume, migration_strategy, mount_cap, node_dir, publish,
    publish_request, stage, unpublish_and_unstage, unpublish_request, update_volumes_strategy,
};
use testbed::util::wait;
use testbed::{BedOptions, TestBed};

async fn bed(line: KubevirtLine) -> TestBed {
    // The node play's warnings (a step it could not make) in the output of a failed test.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "testbed=info".into()),
        )
        .with_test_writer()
        .try_init();
    let bed = bed_with_vm_and(BedOptions {
        kubevirt: Some(line),
        ..Default::default()
    })
    .await;
    let t = bed.started_in.as_secs_f64();
    eprintln!(
        "KubeVirt v{} {:?}: bed with a running VM in {t:.1}s",
        line.version, line.gates
    );
    bed
}

fn vmis(bed: &TestBed) -> Api<VirtualMachineInstance> {
    Api::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
}

fn vms(bed: &TestBed) -> Api<VirtualMachine> {
    Api::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
}

fn pods(bed: &TestBed) -> Api<Pod> {
    Api::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
}

/// The KubeVirt Pods labelled `kubevirt.io=<role>`: `(name, node)`.
async fn kubevirt_pods(bed: &TestBed, role: &str) -> Vec<(String, Option<String>)> {
    pods(bed)
        .list(&ListParams::default().labels(&format!("kubevirt.io={role}")))
        .await
        .expect("listing Pods")
        .items
        .into_iter()
        .map(|p| {
            (
                p.metadata.name.unwrap_or_default(),
                p.spec.and_then(|s| s.node_name),
            )
        })
        .collect()
}

/// The VMI is virt-controller's (owned by the VM), and its launcher Pod runs on the VM's host.
async fn assert_made_by_virt_controller(bed: &TestBed) {
    let vmi = vmis(bed).get(NODE).await.expect("VMI");
    let owner = vmi.metadata.owner_references.unwrap_or_default();
    assert!(
        owner
            .iter()
            .any(|o| o.kind == "VirtualMachine" && o.name == NODE && o.controller == Some(true)),
        "the VMI is virt-controller's, owned by its VM: {owner:?}"
    );
    let launchers = kubevirt_pods(bed, "virt-launcher").await;
    assert_eq!(
        launchers.iter().map(|p| p.1.as_deref()).collect::<Vec<_>>(),
        [Some("harvester-1")],
        "virt-controller's one launcher Pod, on the VM's host: {launchers:?}"
    );
}

/// Create, publish (through real virt-api and virt-controller), stage and publish on the node,
/// write and read data on the hot-plugged disk, then take it all down: the disk gone from VM,
/// VMI, the guest and its attachment Pod, and the volume deleted.
async fn plug_use_unplug(bed: &TestBed, d: &Driver, name: &str) {
    let (dir, sweeper) = node_dir(bed, name);
    let cap = mount_cap("ext4");
    let t0 = Instant::now();
    let v = create_and_publish(d, name, 64 << 20, &cap, &dir).await;
    let published_in = t0.elapsed();

    let vmi = vmis(bed).get(NODE).await.expect("VMI");
    let status = vmi
        .volume_status(&v.id)
        .expect("the volume in the VMI's volumeStatus");
    assert_eq!(status.phase.as_deref(), Some("Ready"), "{status:?}");
    assert!(!status.target.is_empty(), "Ready with a target: {status:?}");
    assert!(
        vmi.spec.volumes.iter().any(|vol| vol.name == v.id),
        "virt-controller put the volume into the VMI spec"
    );
    assert!(
        vms(bed)
            .get(NODE)
            .await
            .expect("VM")
            .volume(&v.id)
            .is_some(),
        "the volume in the VM spec (virt-controller's request applied, or virt-api's patch)"
    );
    let attachment = kubevirt_pods(bed, "hotplug-disk").await;
    assert_eq!(
        attachment
            .iter()
            .map(|p| p.1.as_deref())
            .collect::<Vec<_>>(),
        [Some("harvester-1")],
        "virt-controller's attachment Pod, on the launcher's node: {attachment:?}"
    );

    stage(d, &v, &cap).await.expect("NodeStageVolume");
    publish(d, &v, &cap).await.expect("NodePublishVolume");
    let backing = bed
        .sim
        .storage
        .get(&bed.vm_namespace, &v.id)
        .expect("the claim's loop device");
    assert_eq!(
        mount_source(&v.staging),
        std::fs::canonicalize(&backing.device).expect("device"),
        "staged on the hot-plugged claim's device"
    );
    let file = v.target.join("data.txt");
    std::fs::write(&file, b"through real virt-api").expect("write");
    assert_eq!(
        std::fs::read(&file).expect("read"),
        b"through real virt-api"
    );
    unpublish_and_unstage(d, &v).await;

    let t1 = Instant::now();
    let mut c = d.controller();
    c.controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume");
    let unpublished_in = t1.elapsed();
    let vm = vms(bed).get(NODE).await.expect("VM");
    assert!(vm.volume(&v.id).is_none(), "the volume left the VM spec");
    let vmi = vmis(bed).get(NODE).await.expect("VMI");
    assert!(
        !vmi.has_volume(&v.id),
        "the volume left the VMI spec and status"
    );
    let link = bed.sim.by_id_dir(NODE).join(format!(
        "{}{}",
        testbed::sim::virt_api::BY_ID_PREFIX,
        v.ctx["serial"]
    ));
    assert!(
        !link.exists(),
        "the disk left the guest: {}",
        link.display()
    );
    wait::until(
        "virt-controller to delete the attachment Pod",
        Duration::from_secs(30),
        || async {
            let left = kubevirt_pods(bed, "hotplug-disk").await;
            Ok::<_, String>(if left.is_empty() { Ok(()) } else { Err(left) })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    c.delete_volume(DeleteVolumeRequest {
        volume_id: v.id.clone(),
        ..Default::default()
    })
    .await
    .expect("DeleteVolume");
    let claims: Api<PersistentVolumeClaim> =
        Api::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace);
    assert!(
        claims
            .get_opt(&v.id)
            .await
            .expect("PVC")
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some()),
        "the Harvester PVC is deleted"
    );
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    eprintln!("{name}: published in {published_in:.1?}, unpublished in {unpublished_in:.1?}");
}

/// The device (resolved) mounted at `path`.
fn mount_source(path: &Path) -> std::path::PathBuf {
    let out = std::process::Command::new("findmnt")
        .args(["-n", "-o", "SOURCE", "--mountpoint"])
        .arg(path)
        .output()
        .expect("findmnt");
    let source = String::from_utf8_lossy(&out.stdout).trim().to_string();
    std::fs::canonicalize(&source)
        .unwrap_or_else(|e| panic!("{source:?} at {}: {e}", path.display()))
}

/// Changes the VM's template spec (read and written whole, as an administrator's edit).
async fn edit_vm(bed: &TestBed, change: impl Fn(&mut serde_json::Value)) {
    let gvk = kube::core::GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine");
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
        bed.sim.harvester.clone(),
        &bed.vm_namespace,
        &kube::core::ApiResource::from_gvk(&gvk),
    );
    // virt-controller writes the VM's status meanwhile: again on a conflict.
    for _ in 0..20 {
        let mut vm = api.get(NODE).await.expect("VM");
        change(&mut vm.data["spec"]["template"]["spec"]);
        match api.replace(NODE, &Default::default(), &vm).await {
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            done => {
                done.expect("the VM edit, through virt-api's webhooks");
                return;
            }
        }
    }
    panic!("the VM edit lost 20 races in a row");
}

/// A claim the VM already has as a disk under another name (an administrator attached it by
/// hand) is one virt-api will not hot-plug again: `addvolume` answers 409 `Unable to add volume
/// source [<claim>] because it already exists` (`pkg/virt-api/rest/volumes.go`
/// `verifyVolumeOption`), and the CSI caller gets virt-api's words.
async fn addvolume_refusal_reaches_the_caller(bed: &TestBed, d: &Driver) {
    let mut c = d.controller();
    let cap = mount_cap("ext4");
    let id = create_volume(d, "twice-1", &cap).await;
    edit_vm(bed, |spec| {
        spec["volumes"].as_array_mut().expect("volumes").push(
            serde_json::json!({"name": "by-hand", "persistentVolumeClaim": {"claimName": id}}),
        );
        spec["domain"]["devices"]["disks"]
            .as_array_mut()
            .expect("disks")
            .push(serde_json::json!({"name": "by-hand", "disk": {"bus": "scsi"}}));
    })
    .await;
    let err = c
        .controller_publish_volume(publish_request(&id, &cap))
        .await
        .expect_err("virt-api refuses a claim the VM already has");
    let said = format!("Unable to add volume source [{id}] because it already exists");
    assert!(
        err.message().contains(&said),
        "the caller gets virt-api's message {said:?}: {err:?}"
    );
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let vm = vms(bed).get(NODE).await.expect("VM");
    assert!(
        vm.volume(&id).is_none(),
        "nothing hot-plugged under the volume's name"
    );
}

/// Under the declarative gate alone, virt-controller hot-plugs nothing into a VM whose volume
/// updates go by migration (`pkg/storage/hotplug/hotplug.go` `HandleDeclarativeVolumes`):
/// publish fails FAILED_PRECONDITION naming the strategy and the gate within KubeVirt's grace,
/// and unpublish takes the volume out of the VM spec again.
async fn migration_vm_fails_clearly(bed: &TestBed, d: &Driver) {
    // Through virt-api's webhooks, which accept it.
    migration_strategy(bed).await;
    let mut c = d.controller();
    let cap = mount_cap("ext4");
    let id = create_volume(d, "migr-1", &cap).await;
    let t0 = Instant::now();
    let err = c
        .controller_publish_volume(publish_request(&id, &cap))
        .await
        .expect_err("KubeVirt never hot-plugs into this VM: publish must fail");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    for word in [
        "updateVolumesStrategy",
        "Migration",
        "DeclarativeHotplugVolumes",
    ] {
        assert!(
            err.message().contains(word),
            "names {word}: {}",
            err.message()
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    assert!(
        !vmis(bed).get(NODE).await.expect("VMI").has_volume(&id),
        "the real virt-controller left the VMI alone"
    );
    c.controller_unpublish_volume(unpublish_request(&id))
        .await
        .expect("ControllerUnpublishVolume");
    assert!(vms(bed).get(NODE).await.expect("VM").volume(&id).is_none());
    c.delete_volume(DeleteVolumeRequest {
        volume_id: id,
        ..Default::default()
    })
    .await
    .expect("DeleteVolume");
}

/// The bed of `line`, then the cases every line runs (`name` names the first volume); the bed and
/// the driver are returned for a line's own cases. Last, on the same bed, the out-of-service
/// story: a volume leaves a powered-off guest node and moves to another.
async fn every_case(line: KubevirtLine, name: &str) -> (TestBed, Driver) {
    assert_root();
    let bed = bed(line).await;
    assert_made_by_virt_controller(&bed).await;
    let d = Driver::start(&bed, |_| {}).await;
    plug_use_unplug(&bed, &d, name).await;
    addvolume_refusal_reaches_the_caller(&bed, &d).await;
    (bed, d)
}

/// The out-of-service story (`testbed::suites::csi::a_volume_of_a_powered_off_node_moves`) after
/// the line's cases, `pinned` or not; it starts its own drivers, so `d` stops first.
async fn out_of_service(bed: &TestBed, d: Driver, pinned: bool) {
    d.stop().await;
    a_volume_of_a_powered_off_node_moves(bed, pinned).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_v1_6_hotplug_volumes_plugs_refuses_and_frees_a_powered_off_node_root() {
    let (bed, d) = every_case(KubevirtLine::V1_6_HOTPLUG, "v16-hp").await;
    out_of_service(&bed, d, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_v1_7_declarative_plugs_refuses_and_frees_a_powered_off_node_root() {
    let (bed, d) = every_case(KubevirtLine::V1_7_DECLARATIVE, "v17-decl").await;
    out_of_service(&bed, d, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_v1_7_both_gates_plugs_refuses_and_frees_a_powered_off_node_root() {
    let (bed, d) = every_case(KubevirtLine::V1_7_BOTH, "v17-both").await;
    out_of_service(&bed, d, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_v1_8_declarative_plugs_refuses_fails_a_migration_vm_and_frees_a_powered_off_node_root()
 {
    let (bed, d) = every_case(KubevirtLine::V1_8_DECLARATIVE, "v18-decl").await;
    migration_vm_fails_clearly(&bed, &d).await;
    update_volumes_strategy(&bed, None).await;
    out_of_service(&bed, d, false).await;
}

#[tokio::test]
async fn a_kubevirt_line_not_built_fails_the_bed_naming_its_build_and_log() {
    let line = KubevirtLine {
        version: "0.0.1",
        ..KubevirtLine::V1_7_DECLARATIVE
    };
    let Err(e) = TestBed::start(BedOptions {
        kubevirt: Some(line),
        ..Default::default()
    })
    .await
    else {
        panic!("a bed with a KubeVirt line that is not built must not start");
    };
    let e = e.to_string();
    for part in [
        "KubeVirt v0.0.1 is not built",
        "KUBEVIRT_VERSIONS=0.0.1 tests/scripts/kubevirt.sh",
        "build-kubevirt-v0.0.1.log",
    ] {
        assert!(e.contains(part), "names {part:?}: {e}");
    }
}
