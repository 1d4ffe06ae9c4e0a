//! Fault tests of the `harvester-csi-driver` binary: SIGKILLed mid-hot-plug (controller) and with
//! staged volumes (node plugin). After a restart the CO's retries must converge on what is
//! already there: no second `addvolume`, no reformat, no stacked mounts, the data intact.

use testbed::suites::csi as common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

use common::{
    Driver, DriverProc, NODE, Vol, assert_root, bed_with_vm, bed_with_vm_and, blkid_uuid,
    block_cap, create_and_publish, create_request, detach_and_delete, mount_cap, mount_entries,
    node_dir, publish, publish_request, stage, unpublish_and_unstage, unpublish_request,
};
use csi_proto::csi::v1::*;
use harvester_common::harvester::kubevirt::VOLUME_READY;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use harvester_csi_driver::naming::disk_serial;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::Api;
use testbed::{BedOptions, TestBed, util::wait};

/// How often KubeVirt lists volume `id` in each place a hot-plugged disk shows up.
#[derive(Debug, Default, PartialEq, Eq)]
struct Listed {
    vm_volumes: usize,
    vm_disks: usize,
    vm_claim_refs: usize,
    vmi_volumes: usize,
    vmi_disks: usize,
    vmi_statuses: usize,
}

impl Listed {
    const ONCE: Listed = Listed {
        vm_volumes: 1,
        vm_disks: 1,
        vm_claim_refs: 1,
        vmi_volumes: 1,
        vmi_disks: 1,
        vmi_statuses: 1,
    };
    const NOWHERE: Listed = Listed {
        vm_volumes: 0,
        vm_disks: 0,
        vm_claim_refs: 0,
        vmi_volumes: 0,
        vmi_disks: 0,
        vmi_statuses: 0,
    };
}

fn vms(bed: &TestBed) -> Api<VirtualMachine> {
    Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
}
fn vmis(bed: &TestBed) -> Api<VirtualMachineInstance> {
    Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
}

async fn listed(bed: &TestBed, id: &str) -> Listed {
    let vm = vms(bed).get(NODE).await.expect("get VM");
    let vmi = vmis(bed).get(NODE).await.expect("get VMI");
    let vm_spec = &vm.spec.template.spec;
    let claim_of = |p: &Option<harvester_common::harvester::kubevirt::PvcVolumeSource>| {
        p.as_ref().is_some_and(|p| p.claim_name == id)
    };
    Listed {
        vm_volumes: vm_spec.volumes.iter().filter(|v| v.name == id).count(),
        vm_disks: vm_spec
            .domain
            .devices
            .disks
            .iter()
            .filter(|d| d.name == id)
            .count(),
        vm_claim_refs: vm_spec
            .volumes
            .iter()
            .filter(|v| claim_of(&v.persistent_volume_claim))
            .count(),
        vmi_volumes: vmi.spec.volumes.iter().filter(|v| v.name == id).count(),
        vmi_disks: vmi
            .spec
            .domain
            .devices
            .disks
            .iter()
            .filter(|d| d.name == id)
            .count(),
        vmi_statuses: vmi.status.as_ref().map_or(0, |s| {
            s.volume_status.iter().filter(|v| v.name == id).count()
        }),
    }
}

/// The VMI's volumeStatus phase of `id` (`None` while it has none).
async fn phase(bed: &TestBed, id: &str) -> Option<String> {
    vmis(bed)
        .get(NODE)
        .await
        .ok()?
        .volume_status(id)
        .and_then(|s| s.phase.clone())
}

/// A bed whose stand-in takes six seconds from `addvolume` to Ready: the window in which the
/// controller dies.
async fn slow_hotplug_bed() -> TestBed {
    bed_with_vm_and(BedOptions {
        hotplug_delay: Duration::from_secs(6),
        ..BedOptions::hotplugging()
    })
    .await
}

/// Creates a volume with the controller binary on `socket`, publishes it to [`NODE`] and SIGKILLs
/// the controller once `addvolume` is done (VM and VMI have the disk) and the disk is not Ready.
/// Returns the volume ID and the publish request the CO would retry.
async fn kill_controller_mid_hotplug(
    bed: &TestBed,
    socket: &std::path::Path,
) -> (String, ControllerPublishVolumeRequest) {
    let ctrl = DriverProc::controller(bed, "csi-controller-1", socket).await;
    let cap = mount_cap("ext4");
    let id = ctrl
        .controller_client()
        .create_volume(create_request("pvc-chaos-attach", 64 << 20, &cap))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    let req = publish_request(&id, &cap);

    let mut client = ctrl.controller_client();
    let first = {
        let req = req.clone();
        tokio::spawn(async move { client.controller_publish_volume(req).await })
    };
    let at_kill = wait::until(
        "the hot-plugged volume in the VM spec and a VMI volumeStatus short of Ready",
        Duration::from_secs(60),
        || {
            let id = id.clone();
            async move {
                let l = listed(bed, &id).await;
                let p = phase(bed, &id).await;
                Ok(if l.vm_volumes > 0 && p.is_some() {
                    Ok(p)
                } else {
                    Err((l, p))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    ctrl.kill();
    assert_ne!(
        at_kill.as_deref(),
        Some(VOLUME_READY),
        "the kill must land before the disk is Ready (hotplug_delay is the window)"
    );
    let killed = tokio::time::timeout(Duration::from_secs(20), first)
        .await
        .expect("the interrupted publish returns once its driver is gone")
        .expect("publish task");
    assert!(
        killed.is_err(),
        "a publish cut short by SIGKILL cannot have answered OK: {killed:?}"
    );
    assert_eq!(settled(1, || bed.sim.hotplug.plugs(NODE, &id)).await, 1);
    (id, req)
}

/// `count` once it reads `want`, else its value after 5 s: under KubeVirt's own controllers the
/// node play records what its VMI watch shows, a moment after the driver saw the same change.
async fn settled(want: usize, count: impl Fn() -> usize) -> usize {
    let t0 = Instant::now();
    loop {
        let n = count();
        if n == want || t0.elapsed() > Duration::from_secs(5) {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn delete_and_wait_gone(ctrl: &DriverProc, bed: &TestBed, id: &str) {
    ctrl.controller_client()
        .delete_volume(DeleteVolumeRequest {
            volume_id: id.to_string(),
            ..Default::default()
        })
        .await
        .expect("DeleteVolume");
    let pvcs: Api<PersistentVolumeClaim> =
        Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    wait::until("the host PVC to be gone", Duration::from_secs(30), || {
        let pvcs = pvcs.clone();
        async move {
            Ok(match pvcs.get_opt(id).await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(p) => Err(p.metadata.finalizers),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_retried_after_the_controller_is_killed_mid_hotplug_attaches_once() {
    let bed = slow_hotplug_bed().await;
    let socket = bed.dir.path().join("csi-controller.sock");
    let (id, req) = kill_controller_mid_hotplug(&bed, &socket).await;

    // The CO retries the same request against a new driver process (same socket path).
    let ctrl = DriverProc::controller(&bed, "csi-controller-2", &socket).await;
    let phase_at_retry = phase(&bed, &id).await;
    let t0 = Instant::now();
    let ctx = tokio::time::timeout(
        Duration::from_secs(60),
        ctrl.controller_client()
            .controller_publish_volume(req.clone()),
    )
    .await
    .expect("the retried publish answers within 60s")
    .expect("the retried ControllerPublishVolume")
    .into_inner()
    .publish_context;
    eprintln!(
        "retry started at phase {phase_at_retry:?}, answered after {:?}: {ctx:?}",
        t0.elapsed()
    );

    // The context names the disk that is attached: its serial in the VM spec, its VMI target.
    let serial = disk_serial(&id);
    assert_eq!(ctx.get("serial"), Some(&serial), "publish context: {ctx:?}");
    let vm = vms(&bed).get(NODE).await.expect("VM");
    let vm_serial = vm
        .spec
        .template
        .spec
        .domain
        .devices
        .disks
        .iter()
        .find(|d| d.name == id)
        .and_then(|d| d.serial.clone());
    assert_eq!(vm_serial.as_ref(), Some(&serial), "serial in the VM spec");
    let vmi = vmis(&bed).get(NODE).await.expect("VMI");
    let status = vmi.volume_status(&id).expect("volumeStatus");
    assert_eq!(status.phase.as_deref(), Some(VOLUME_READY));
    assert_eq!(ctx.get("target"), Some(&status.target), "{ctx:?}");
    assert_eq!(listed(&bed, &id).await, Listed::ONCE);
    assert_eq!(
        settled(1, || bed.sim.hotplug.plugs(NODE, &id)).await,
        1,
        "the retry must not hot-plug again: {:?}",
        bed.sim.hotplug.calls.lock().unwrap()
    );

    // And once more: idempotent, same context, still one disk.
    let again = ctrl
        .controller_client()
        .controller_publish_volume(req.clone())
        .await
        .expect("ControllerPublishVolume once more")
        .into_inner()
        .publish_context;
    assert_eq!(again, ctx, "same publish context");
    assert_eq!(listed(&bed, &id).await, Listed::ONCE);
    assert_eq!(settled(1, || bed.sim.hotplug.plugs(NODE, &id)).await, 1);

    // Clean up: detached from VM and VMI with one removevolume, then the PVC goes.
    let unpublish = unpublish_request(&id);
    ctrl.controller_client()
        .controller_unpublish_volume(unpublish.clone())
        .await
        .expect("ControllerUnpublishVolume");
    assert_eq!(listed(&bed, &id).await, Listed::NOWHERE);
    ctrl.controller_client()
        .controller_unpublish_volume(unpublish)
        .await
        .expect("ControllerUnpublishVolume again is OK");
    assert_eq!(settled(1, || bed.sim.hotplug.unplugs(NODE, &id)).await, 1);
    delete_and_wait_gone(&ctrl, &bed, &id).await;
    ctrl.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_after_the_controller_is_killed_mid_hotplug_detaches_for_good() {
    // The CO gave up on the publish (the pod went away) and unpublishes instead of retrying.
    let bed = slow_hotplug_bed().await;
    let socket = bed.dir.path().join("csi-controller.sock");
    let (id, _) = kill_controller_mid_hotplug(&bed, &socket).await;
    // addvolume was answered before the kill: the stand-in's Ready would come within 6 s.
    let window_end = tokio::time::Instant::now() + Duration::from_secs(7);
    let ctrl = DriverProc::controller(&bed, "csi-controller-2", &socket).await;
    let unpublish = unpublish_request(&id);
    ctrl.controller_client()
        .controller_unpublish_volume(unpublish.clone())
        .await
        .expect("ControllerUnpublishVolume of a half-attached volume");
    assert_eq!(listed(&bed, &id).await, Listed::NOWHERE);
    assert_eq!(settled(1, || bed.sim.hotplug.unplugs(NODE, &id)).await, 1);

    // The rest of the hot-plug window passes: the disk must not come back, in Harvester or in
    // the guest.
    tokio::time::sleep_until(window_end).await;
    assert_eq!(listed(&bed, &id).await, Listed::NOWHERE);
    let link = bed.sim.by_id_dir(NODE).join(format!(
        "{}{}",
        testbed::sim::virt_api::BY_ID_PREFIX,
        disk_serial(&id)
    ));
    assert!(!link.exists(), "the guest sees no disk: {}", link.display());
    ctrl.controller_client()
        .controller_unpublish_volume(unpublish)
        .await
        .expect("ControllerUnpublishVolume again is OK");
    assert_eq!(settled(1, || bed.sim.hotplug.plugs(NODE, &id)).await, 1);
    assert_eq!(settled(1, || bed.sim.hotplug.unplugs(NODE, &id)).await, 1);
    delete_and_wait_gone(&ctrl, &bed, &id).await;
    ctrl.kill();
}

/// One volume of the node test: how it is staged and what was written to it.
struct Case {
    vol: Vol,
    cap: VolumeCapability,
    block: bool,
}

const BLOCK_OFFSET: u64 = 1 << 20;

fn content(c: &Case) -> Vec<u8> {
    format!("written through {} before the node plugin died\n", c.vol.id).into_bytes()
}

/// Writes the case's content: a file on a mount, raw bytes at 1 MiB on a block device.
fn write_data(c: &Case) {
    if c.block {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&c.vol.target)
            .expect("open the published block device");
        f.seek(SeekFrom::Start(BLOCK_OFFSET)).expect("seek");
        f.write_all(&content(c)).expect("write to the block device");
        f.sync_all().expect("sync the block device");
    } else {
        std::fs::write(c.vol.target.join("data.txt"), content(c)).expect("write the file");
    }
}

fn read_data(c: &Case) -> Vec<u8> {
    if c.block {
        let mut f = std::fs::File::open(&c.vol.target).expect("open the published block device");
        f.seek(SeekFrom::Start(BLOCK_OFFSET)).expect("seek");
        let mut buf = vec![0; content(c).len()];
        f.read_exact(&mut buf).expect("read the block device");
        buf
    } else {
        std::fs::read(c.vol.target.join("data.txt")).expect("read the file")
    }
}

/// What must not change across a node plugin restart: the mounts (by mountinfo line, mount ID
/// included) at the staging path and the target, and the filesystem UUID.
#[derive(Debug, PartialEq, Eq)]
struct NodeState {
    staging: Vec<String>,
    target: Vec<String>,
    uuid: String,
}

fn node_state(c: &Case) -> NodeState {
    NodeState {
        staging: mount_entries(&c.vol.staging),
        target: mount_entries(&c.vol.target),
        uuid: if c.block {
            String::new()
        } else {
            blkid_uuid(&c.vol.target)
        },
    }
}

async fn stage_and_publish(node: &DriverProc, c: &Case, what: &str) {
    stage(node, &c.vol, &c.cap)
        .await
        .unwrap_or_else(|e| panic!("{what}: NodeStageVolume {}: {e:?}", c.vol.id));
    publish(node, &c.vol, &c.cap)
        .await
        .unwrap_or_else(|e| panic!("{what}: NodePublishVolume {}: {e:?}", c.vol.id));
}

async fn check_stats(node: &DriverProc, c: &Case, size: u64) {
    let stats = node
        .node_client()
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: c.vol.id.clone(),
            volume_path: c.vol.target.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("NodeGetVolumeStats {}: {e:?}", c.vol.id))
        .into_inner();
    assert_eq!(
        stats.volume_condition.as_ref().map(|v| v.abnormal),
        Some(false),
        "{}: {stats:?}",
        c.vol.id
    );
    if c.block {
        assert_eq!(stats.usage.len(), 1, "{stats:?}");
        assert_eq!(stats.usage[0].total as u64, size, "{stats:?}");
    } else {
        assert_eq!(stats.usage.len(), 2, "bytes and inodes: {stats:?}");
        let total = stats.usage[0].total as u64;
        assert!(
            total > size / 2 && total <= size,
            "{}: filesystem of {total} bytes on a {size}-byte disk",
            c.vol.id
        );
        assert!(stats.usage[0].used > 0, "{stats:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_volumes_survive_a_node_plugin_sigkill_without_reformat_or_stacked_mounts_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let ctrl = Driver::start(&bed, |c| c.mode = harvester_csi_driver::Mode::Controller).await;
    let (dir, sweeper) = node_dir(&bed, "chaos-node");
    // mkfs.xfs wants at least 300 MiB.
    let sizes = [
        ("pvc-chaos-ext4", 64u64 << 20),
        ("pvc-chaos-xfs", 320 << 20),
        ("pvc-chaos-block", 32 << 20),
    ];
    let mut cases = Vec::new();
    for ((name, size), cap) in sizes
        .iter()
        .zip([mount_cap("ext4"), mount_cap("xfs"), block_cap()])
    {
        let vol = create_and_publish(&ctrl, name, *size, &cap, &dir).await;
        let block = name.ends_with("block");
        cases.push((Case { vol, cap, block }, *size));
    }

    let socket = bed.dir.path().join("csi-node.sock");
    let node = DriverProc::node(&bed, "csi-node-1", &socket).await;
    let mut before = Vec::new();
    for (c, _) in &cases {
        stage_and_publish(&node, c, "first").await;
        write_data(c);
        let state = node_state(c);
        assert_eq!(
            state.target.len(),
            1,
            "{}: one mount at the target: {state:?}",
            c.vol.id
        );
        assert_eq!(
            state.staging.len(),
            usize::from(!c.block),
            "{}: a mount volume is staged by one mount, a block volume by none: {state:?}",
            c.vol.id
        );
        assert_eq!(state.uuid.is_empty(), c.block, "{state:?}");
        before.push(state);
    }

    node.kill();
    let node = DriverProc::node(&bed, "csi-node-2", &socket).await;
    // kubelet repeats both calls for every volume it believes staged and published.
    for ((c, size), was) in cases.iter().zip(&before) {
        stage_and_publish(&node, c, "after the restart").await;
        stage_and_publish(&node, c, "once more").await;
        assert_eq!(
            &node_state(c),
            was,
            "{}: mounts and filesystem unchanged by the restart and the repeated calls",
            c.vol.id
        );
        assert_eq!(read_data(c), content(c), "{}: data intact", c.vol.id);
        check_stats(&node, c, *size).await;
    }

    // The data is on the disks, not only in the page cache: unmount everything, stage anew.
    for (c, _) in &cases {
        unpublish_and_unstage(&node, &c.vol).await;
    }
    assert!(
        testbed::real::mounts::mounts_under(&dir).is_empty(),
        "nothing mounted after unstage: {:?}",
        testbed::real::mounts::mounts_under(&dir)
    );
    for ((c, _), was) in cases.iter().zip(&before) {
        stage_and_publish(&node, c, "restage").await;
        assert_eq!(read_data(c), content(c), "{}: data after restage", c.vol.id);
        assert_eq!(
            node_state(c).uuid,
            was.uuid,
            "{}: not reformatted",
            c.vol.id
        );
        unpublish_and_unstage(&node, &c.vol).await;
        unpublish_and_unstage(&node, &c.vol).await;
        assert!(!c.vol.target.exists(), "the target is removed");
    }
    assert!(
        testbed::real::mounts::mounts_under(&dir).is_empty(),
        "nothing mounted at the end: {:?}",
        testbed::real::mounts::mounts_under(&dir)
    );

    for (c, _) in &cases {
        detach_and_delete(&ctrl, &c.vol).await;
    }
    node.kill();
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    ctrl.stop().await;
}

/// SIGKILLs the processes whose pids are listed in the file, if any, when dropped (a
/// container's kill takes the plugin's children with it; also cleans up after a failed test).
struct KillPidsIn(std::path::PathBuf);

impl KillPidsIn {
    fn pids(&self) -> Vec<String> {
        std::fs::read_to_string(&self.0)
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }

    fn kill(&self) {
        for pid in self.pids() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

impl Drop for KillPidsIn {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether a mountinfo line's per-mount options make it read-only.
fn read_only_mount(line: &str) -> bool {
    line.split_whitespace()
        .nth(5)
        .is_some_and(|o| o.split(',').any(|o| o == "ro"))
}

/// A directory to put first in the node plugin's PATH, with a wrapper for `program`: a call for
/// which the shell condition `stall_if` holds (`$PIDS` names the pid file, `$*` the arguments)
/// appends its pid to `<dir>/<program>.pids` and sleeps 60 s; every other call runs the real one.
fn stalling_wrapper(dir: &std::path::Path, program: &str, stall_if: &str) -> (String, KillPidsIn) {
    let real = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .expect("sh");
    let real = String::from_utf8_lossy(&real.stdout).trim().to_string();
    assert!(real.starts_with('/'), "{program}: {real:?}");
    std::fs::create_dir_all(dir).expect("wrapper dir");
    let pids = dir.join(format!("{program}.pids"));
    let script = format!(
        "#!/bin/sh\nPIDS='{}'\nif {stall_if}; then echo $$ >> \"$PIDS\"; exec sleep 60; fi\nexec {real} \"$@\"\n",
        pids.display()
    );
    let wrapper = dir.join(program);
    std::fs::write(&wrapper, script).expect("wrapper");
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod wrapper");
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (path, KillPidsIn(pids))
}

/// `mount` stalls every read-only remount (the second of the two mounts of a read-only publish).
fn stalled_remount_wrapper(dir: &std::path::Path) -> (String, KillPidsIn) {
    stalling_wrapper(
        dir,
        "mount",
        r#"case " $* " in *remount,*) true;; *) false;; esac"#,
    )
}

fn read_only_publish(c: &Case) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: c.vol.id.clone(),
        publish_context: c.vol.ctx.clone(),
        staging_target_path: c.vol.staging.display().to_string(),
        target_path: c.vol.target.display().to_string(),
        volume_capability: Some(c.cap.clone()),
        readonly: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_publish_killed_between_bind_and_remount_is_read_only_after_the_retry_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let ctrl = Driver::start(&bed, |c| c.mode = harvester_csi_driver::Mode::Controller).await;
    let (dir, sweeper) = node_dir(&bed, "chaos-ro");
    let mut cases = Vec::new();
    for (name, cap, block) in [
        ("pvc-chaos-ro-ext4", mount_cap("ext4"), false),
        ("pvc-chaos-ro-block", block_cap(), true),
    ] {
        let vol = create_and_publish(&ctrl, name, 32 << 20, &cap, &dir).await;
        cases.push(Case { vol, cap, block });
    }

    let (path, stalled) = stalled_remount_wrapper(&bed.dir.path().join("slow-remount"));
    let socket = bed.dir.path().join("csi-node.sock");
    let node = DriverProc::node_with_env(&bed, "csi-node-1", &socket, &[("PATH", path)]).await;
    let mut first = Vec::new();
    for c in &cases {
        stage(&node, &c.vol, &c.cap).await.expect("NodeStageVolume");
        let mut client = node.node_client();
        let req = read_only_publish(c);
        first.push(tokio::spawn(async move {
            client.node_publish_volume(req).await
        }));
    }
    wait::until(
        "both binds done and their read-only remounts under way",
        Duration::from_secs(30),
        || {
            let pids = stalled.pids();
            async move { Ok(if pids.len() == 2 { Ok(()) } else { Err(pids) }) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    for c in &cases {
        let cut = mount_entries(&c.vol.target);
        assert!(
            cut.len() == 1 && !read_only_mount(&cut[0]),
            "{}: a writable bind at the target when the plugin dies: {cut:?}",
            c.vol.id
        );
    }
    node.kill();
    stalled.kill();
    for task in first {
        let killed = tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("the interrupted publish returns once its plugin is gone")
            .expect("publish task");
        assert!(killed.is_err(), "cut short, so not OK: {killed:?}");
    }

    // kubelet retries the same read-only publishes on the restarted plugin.
    let node = DriverProc::node(&bed, "csi-node-2", &socket).await;
    for c in &cases {
        for attempt in ["the retry", "once more"] {
            node.node_client()
                .node_publish_volume(read_only_publish(c))
                .await
                .unwrap_or_else(|e| panic!("{}: {attempt}: NodePublishVolume: {e:?}", c.vol.id));
            let now = mount_entries(&c.vol.target);
            assert_eq!(now.len(), 1, "{attempt}: one mount at the target: {now:?}");
            assert!(
                read_only_mount(&now[0]),
                "{}: {attempt}: a read-only publish must not leave the pod a writable mount: {now:?}",
                c.vol.id
            );
            if !c.block {
                // (A read-only mount does not stop writes to a device node, so only here.)
                let write = std::fs::write(c.vol.target.join("must-fail.txt"), b"x");
                assert_eq!(
                    write.as_ref().map_err(|e| e.raw_os_error()),
                    Err(Some(libc::EROFS)),
                    "{attempt}: writing through the read-only target"
                );
            }
        }
    }

    for c in &cases {
        unpublish_and_unstage(&node, &c.vol).await;
        detach_and_delete(&ctrl, &c.vol).await;
    }
    node.kill();
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    ctrl.stop().await;
}

/// Whether process `pid` still runs (a zombie waiting for its reaper does not count).
fn running(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| Some(stat.rsplit_once(") ")?.1.starts_with('Z')))
        == Some(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mkfs_dies_with_a_killed_node_plugin_and_the_retry_formats_once_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let ctrl = Driver::start(&bed, |c| c.mode = harvester_csi_driver::Mode::Controller).await;
    let (dir, sweeper) = node_dir(&bed, "chaos-mkfs");
    let cap = mount_cap("ext4");
    let vol = create_and_publish(&ctrl, "pvc-chaos-mkfs", 32 << 20, &cap, &dir).await;

    // The first mkfs.ext4 stalls, as a long format of a large disk would.
    let (path, stalled) = stalling_wrapper(
        &bed.dir.path().join("slow-mkfs"),
        "mkfs.ext4",
        r#"[ ! -s "$PIDS" ]"#,
    );
    let socket = bed.dir.path().join("csi-node.sock");
    let env = [("PATH", path)];
    let node = DriverProc::node_with_env(&bed, "csi-node-1", &socket, &env).await;
    let mut client = node.node_client();
    let request = NodeStageVolumeRequest {
        volume_id: vol.id.clone(),
        publish_context: vol.ctx.clone(),
        staging_target_path: vol.staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    let first = tokio::spawn(async move { client.node_stage_volume(request).await });
    let pid = wait::until("mkfs under way", Duration::from_secs(30), || {
        let pids = stalled.pids();
        async move { Ok(pids.first().cloned().ok_or("no mkfs yet")) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(running(&pid), "the stalled mkfs runs");
    node.kill();
    assert!(first.await.unwrap().is_err(), "the cut-off stage failed");
    wait::until(
        "the orphaned mkfs killed with the plugin",
        Duration::from_secs(10),
        || {
            let alive = running(&pid);
            async move { Ok(if alive { Err("still running") } else { Ok(()) }) }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // The kubelet's retry on a new plugin formats the disk (once) and mounts it.
    let node = DriverProc::node_with_env(&bed, "csi-node-2", &socket, &env).await;
    stage(&node, &vol, &cap)
        .await
        .expect("NodeStageVolume retried");
    assert_eq!(stalled.pids().len(), 1, "only the first mkfs stalled");
    let uuid = blkid_uuid(&vol.staging);
    assert!(!uuid.is_empty(), "an ext4 filesystem with a UUID");
    stage(&node, &vol, &cap)
        .await
        .expect("NodeStageVolume again");
    assert_eq!(blkid_uuid(&vol.staging), uuid, "not formatted again");
    assert_eq!(mount_entries(&vol.staging).len(), 1, "one mount");
    publish(&node, &vol, &cap).await.expect("NodePublishVolume");
    unpublish_and_unstage(&node, &vol).await;
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    detach_and_delete(&ctrl, &vol).await;
    node.kill();
    ctrl.stop().await;
}
