//! The CSI node side and the cloud provider's address path on a real guest kernel: QEMU boots
//! the bed's Debian guest (`tests/scripts/guest.sh`), the stand-in hot-plugs Harvester volumes
//! into it over QMP, and the node plugin (`harvester-csi-driver --mode node`, the binary through
//! 9p) runs inside it, reached over a forwarded TCP port; the controller runs on the host.
//!
//! One VM per test, each test a story over its VM (a boot is the expensive part); the two tests
//! take turns so that only one guest runs at a time on the 2-core machine.

use testbed::suites::csi as common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    Driver, NODE, Vol, assert_root, create_and_publish, detach_and_delete, mount_cap,
    publish_request, stage, unpublish_request,
};
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::node_client::NodeClient;
use csi_proto::csi::v1::*;
use harvester_csi_driver::Mode;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use testbed::real::vm::{GUEST_SHARE, HOST_FROM_GUEST, Vm, VmOptions};
use testbed::sim::GuestVm;
use testbed::{TestBed, util::wait};
use tonic::transport::Channel;

/// The most one test of this file may take (the longest about 3 minutes on a loaded 2-core
/// machine): past it the test fails and cleans up instead of holding its lane.
const TEST_LIMIT: Duration = Duration::from_secs(600);

/// The node plugin's port in the guest.
const CSI_PORT: u16 = 10000;
/// Where the guest's staging and target paths live.
const GUEST_WORK: &str = "/var/lib/guest-csi";
const MIB: u64 = 1 << 20;
/// The bare guest's device wait (`--device-timeout-seconds`; 30 s by default): its last step
/// waits it out, and a hot-plugged disk shows in its sysfs within 0.3-2 s.
const DEVICE_BOUND: Duration = Duration::from_secs(10);

/// Only one guest at a time: two TCG guests on 2 shared cores would slow each other's boot.
static ONE_VM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "[guest_vm] {line}");
}

/// A bed with Harvester's default StorageClass, a host and the guest VM [`NODE`] backed by a
/// freshly booted real VM.
async fn bed_with_real_vm(opts: VmOptions) -> (TestBed, Arc<Vm>) {
    assert_root();
    let bed = common::bed().await;
    let bed = bed.with_default_storage_class().await;
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    let vm = match Vm::start(bed.dir.path(), opts.forward(CSI_PORT)).await {
        Ok(vm) => Arc::new(vm),
        Err(e) => panic!("the guest VM must boot for this test: {e}"),
    };
    say(&format!(
        "guest {} booted in {:.1}s (udev={}, agent={})",
        vm.name,
        vm.booted_in.as_secs_f64(),
        vm.options.udev,
        vm.options.agent
    ));
    bed.sim
        .create_vm_backed(&GuestVm::new(NODE).on_host("harvester-1"), vm.clone())
        .await
        .expect("VM and VMI backed by the guest");
    (bed, vm)
}

/// The node plugin running in the guest.
struct GuestPlugin {
    pid: String,
    channel: Channel,
}

/// Starts `harvester-csi-driver --mode node` in the guest (binary and cloud-config through the 9p
/// share; the cloud-config points at the Harvester API server as the guest reaches it) and waits
/// until it answers Probe through the forwarded port.
async fn start_plugin(bed: &TestBed, vm: &Vm, run: usize, mode: &str, extra: &str) -> GuestPlugin {
    let bin = vm.share.join("harvester-csi-driver");
    if !bin.exists() {
        std::fs::copy(
            testbed::util::process::built_binary("harvester-csi-driver"),
            &bin,
        )
        .expect("copying the driver into the share");
    }
    let cloud_config = std::fs::read_to_string(&bed.cloud_config)
        .expect("cloud-config")
        .replace("https://127.0.0.1:", &format!("https://{HOST_FROM_GUEST}:"));
    assert!(cloud_config.contains(HOST_FROM_GUEST), "{cloud_config}");
    std::fs::write(vm.share.join("cloud-config"), cloud_config).expect("guest cloud-config");
    let log = format!("{GUEST_SHARE}/node-plugin-{run}.log");
    let pid = vm
        .run(&format!(
            "setsid {GUEST_SHARE}/harvester-csi-driver --mode={mode} --nodeid={NODE} \
             --endpoint=tcp://0.0.0.0:{CSI_PORT} --kubeconfig={GUEST_SHARE}/cloud-config {extra} \
             >{log} 2>&1 </dev/null & echo $!"
        ))
        .await
        .expect("starting the node plugin in the guest")
        .trim()
        .to_string();
    let port = vm.host_port(CSI_PORT).expect("forwarded CSI port");
    let t0 = Instant::now();
    loop {
        let alive = vm
            .shell(&format!("kill -0 {pid}"))
            .await
            .is_ok_and(|o| o.code == 0);
        assert!(
            alive,
            "the node plugin in the guest exited; its log:\n{}",
            std::fs::read_to_string(vm.share.join(format!("node-plugin-{run}.log")))
                .unwrap_or_default()
        );
        if let Ok(ch) = common::probe_guest_plugin(port).await {
            say(&format!(
                "node plugin (pid {pid}) serving in the guest after {:.1}s",
                t0.elapsed().as_secs_f64()
            ));
            return GuestPlugin { pid, channel: ch };
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "the node plugin did not answer on 127.0.0.1:{port} within 90s; log:\n{}",
            std::fs::read_to_string(vm.share.join(format!("node-plugin-{run}.log")))
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

impl GuestPlugin {
    async fn kill(&self, vm: &Vm) {
        // Gone once the guest's init has reaped it (a zombie still answers `kill -0`), which
        // takes longer than a moment on a busy host.
        vm.run(&format!(
            "kill -9 {pid}; i=0; while kill -0 {pid} 2>/dev/null; do \
             [ $i -lt 100 ] || exit 1; i=$((i+1)); sleep 0.1; done",
            pid = self.pid
        ))
        .await
        .expect("killing the node plugin");
    }
}

impl AsRef<Channel> for GuestPlugin {
    fn as_ref(&self) -> &Channel {
        &self.channel
    }
}

/// The node plugin's volume limit (NodeGetInfo), small so csi-sanity's attach-limit test needs
/// few hot-plugs; the controller enforces the same limit.
const ATTACH_LIMIT: u32 = 3;

/// The controller on the host, on a unix socket in the bed's directory.
async fn controller(bed: &TestBed) -> Driver {
    Driver::start(bed, |c| {
        c.mode = Mode::Controller;
        c.max_volumes_per_node = Some(ATTACH_LIMIT);
    })
    .await
}

fn guest_paths(name: &str) -> PathBuf {
    Path::new(GUEST_WORK).join(name)
}

/// `findmnt` in the guest: "<uuid> <fstype> <source>" of the mount at `path`.
async fn guest_mount(vm: &Vm, path: &Path) -> Vec<String> {
    vm.run(&format!(
        "findmnt -n -o UUID,FSTYPE,SOURCE --mountpoint {}",
        path.display()
    ))
    .await
    .unwrap_or_else(|e| panic!("nothing mounted at {} in the guest: {e}", path.display()))
    .split_whitespace()
    .map(str::to_string)
    .collect()
}

async fn guest_md5(vm: &Vm, file: &Path) -> String {
    vm.run(&format!("md5sum {}", file.display()))
        .await
        .expect("md5sum in the guest")
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Whether the guest kernel has a SCSI disk with `serial`.
async fn guest_has_serial(vm: &Vm, serial: &str) -> bool {
    vm.wait_for_disk(serial, Duration::from_millis(200))
        .await
        .is_ok()
}

async fn unstage(n: &impl AsRef<Channel>, v: &Vol) {
    NodeClient::new(n.as_ref().clone())
        .node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: v.id.clone(),
            staging_target_path: v.staging.display().to_string(),
        })
        .await
        .expect("NodeUnstageVolume");
}

async fn controller_unpublish(c: &impl AsRef<Channel>, v: &Vol) {
    ControllerClient::new(c.as_ref().clone())
        .controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume");
}

/// ControllerPublishVolume again; returns how long the hot-plug took end to end.
async fn controller_publish(c: &impl AsRef<Channel>, v: &Vol, cap: &VolumeCapability) -> Duration {
    let t0 = Instant::now();
    ControllerClient::new(c.as_ref().clone())
        .controller_publish_volume(publish_request(&v.id, cap))
        .await
        .expect("ControllerPublishVolume");
    t0.elapsed()
}

/// Hot-plug, stage, write, unstage, unplug, replug, restage: same filesystem, same data; then
/// online expansion while mounted.
async fn hotplug_cycle(vm: &Vm, ctrl: &Driver, node: &GuestPlugin, fs: &str) {
    let cap = mount_cap(fs);
    // mkfs.xfs wants at least 300 MiB.
    let size = 320 * MIB;
    let name = format!("cycle-{fs}");
    let t0 = Instant::now();
    let v = create_and_publish(ctrl, &name, size, &cap, &guest_paths("")).await;
    let serial = harvester_csi_driver::naming::disk_serial(&v.id);
    say(&format!(
        "[{fs}] CreateVolume + ControllerPublishVolume (hot-plug into the guest) in {:.2}s",
        t0.elapsed().as_secs_f64()
    ));
    assert!(
        guest_has_serial(vm, &serial).await,
        "published: the guest has {serial}"
    );
    if vm.options.udev {
        // udev names the disk a moment after the kernel has it.
        vm.run(&format!(
            "udevadm settle -t 20; test -L /dev/disk/by-id/scsi-0QEMU_QEMU_HARDDISK_{serial}"
        ))
        .await
        .expect("udev made the by-id link");
    }
    stage(node, &v, &cap).await.expect("NodeStageVolume");
    let first = guest_mount(vm, &v.staging).await;
    assert_eq!(first[1], fs, "staged as {fs}: {first:?}");
    let data = v.staging.join("data");
    vm.run(&format!(
        "dd if=/dev/urandom of={} bs=64k count=32 2>/dev/null && sync",
        data.display()
    ))
    .await
    .expect("writing in the guest");
    let sum = guest_md5(vm, &data).await;
    unstage(node, &v).await;
    controller_unpublish(ctrl, &v).await;
    assert!(
        !guest_has_serial(vm, &serial).await,
        "unpublished: the guest no longer has {serial}"
    );
    let replug = controller_publish(ctrl, &v, &cap).await;
    say(&format!(
        "[{fs}] replug (addvolume to VMI Ready, the guest has the disk) in {:.2}s",
        replug.as_secs_f64()
    ));
    stage(node, &v, &cap).await.expect("NodeStageVolume again");
    let again = guest_mount(vm, &v.staging).await;
    assert_eq!(
        again[0], first[0],
        "the same filesystem (never reformatted)"
    );
    assert_eq!(
        guest_md5(vm, &data).await,
        sum,
        "the data survived unplug and replug"
    );

    // Online expansion: publish, grow on Harvester (loop device + QMP block_resize), grow the
    // mounted filesystem in the guest.
    NodeClient::new(node.channel.clone())
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: v.id.clone(),
            publish_context: v.ctx.clone(),
            staging_target_path: v.staging.display().to_string(),
            target_path: v.target.display().to_string(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .expect("NodePublishVolume");
    let before = df_bytes(vm, &v.target).await;
    let bigger = 2 * size;
    let grown = ControllerClient::new(ctrl.channel.clone())
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: v.id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: bigger as i64,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .expect("ControllerExpandVolume")
        .into_inner();
    assert!(grown.capacity_bytes >= bigger as i64, "{grown:?}");
    let dev = guest_mount(vm, &v.staging).await[2].clone();
    let seen = wait::until(
        "the guest sees the bigger disk",
        Duration::from_secs(30),
        || {
            let dev = dev.clone();
            async move {
                let out = vm
                    .run(&format!("blockdev --getsize64 {dev}"))
                    .await
                    .map_err(|e| e.to_string())?;
                let n: u64 = out.trim().parse().map_err(|_| out.clone())?;
                Ok(if n >= bigger { Ok(n) } else { Err(n) })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(seen >= bigger);
    NodeClient::new(node.channel.clone())
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: v.id.clone(),
            volume_path: v.target.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: bigger as i64,
                limit_bytes: 0,
            }),
            staging_target_path: v.staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .expect("NodeExpandVolume while mounted");
    let after = df_bytes(vm, &v.target).await;
    say(&format!(
        "[{fs}] online expansion in the guest: {} MiB -> {} MiB",
        before / MIB,
        after / MIB
    ));
    assert!(
        after > before + size / 2,
        "{fs} grew while mounted: {before} -> {after} bytes"
    );
    assert_eq!(
        guest_mount(vm, &v.staging).await[0],
        first[0],
        "still one filesystem"
    );
    assert_eq!(guest_md5(vm, &data).await, sum, "data intact after growing");

    NodeClient::new(node.channel.clone())
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: v.id.clone(),
            target_path: v.target.display().to_string(),
        })
        .await
        .expect("NodeUnpublishVolume");
    unstage(node, &v).await;
    detach_and_delete(ctrl, &v).await;
}

/// Filesystem size at `path` in the guest (`df`), bytes.
async fn df_bytes(vm: &Vm, path: &Path) -> u64 {
    let out = vm
        .run(&format!("df -k {} | tail -n 1", path.display()))
        .await
        .expect("df in the guest");
    let kib: u64 = out
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("df output {out:?}"));
    kib * 1024
}

/// The node plugin SIGKILLed while NodeStageVolume formats: restarted and staged again, the
/// disk holds one filesystem and keeps what is written to it.
async fn kill_during_stage(
    bed: &TestBed,
    vm: &Vm,
    ctrl: &Driver,
    node: GuestPlugin,
) -> GuestPlugin {
    let cap = mount_cap("ext4");
    let v = create_and_publish(ctrl, "killed-stage", 256 * MIB, &cap, &guest_paths("")).await;
    let req_node = node.channel.clone();
    let staging = {
        let v = Vol {
            id: v.id.clone(),
            ctx: v.ctx.clone(),
            staging: v.staging.clone(),
            target: v.target.clone(),
        };
        let cap = cap.clone();
        tokio::spawn(async move {
            let n = ChannelRef(req_node);
            stage(&n, &v, &cap).await
        })
    };
    // Kill while mkfs runs (seen in the guest's process list), or as soon as stage is under way.
    let caught = wait::until(
        "mkfs running in the guest",
        Duration::from_secs(20),
        || async {
            let o = vm
                .shell("ps -o args | grep '[m]kfs'")
                .await
                .map_err(|e| e.to_string())?;
            Ok(if o.code == 0 { Ok(()) } else { Err(o.output) })
        },
    )
    .await;
    node.kill(vm).await;
    say(&format!(
        "node plugin killed during NodeStageVolume ({})",
        if caught.is_ok() {
            "mkfs was running"
        } else {
            "mkfs not seen"
        }
    ));
    let cut = staging.await.expect("stage task");
    assert!(cut.is_err(), "the stage call was cut by the kill: {cut:?}");
    let node = start_plugin(bed, vm, 2, "node", "").await;
    stage(&node, &v, &cap)
        .await
        .expect("NodeStageVolume after restart");
    let m = guest_mount(vm, &v.staging).await;
    assert_eq!(m[1], "ext4", "{m:?}");
    // One filesystem on the whole disk: no second signature, and a clean check.
    let probe = vm
        .run(&format!("blkid -p -o export {}", m[2]))
        .await
        .expect("blkid -p");
    assert_eq!(
        probe.lines().filter(|l| l.starts_with("TYPE=")).count(),
        1,
        "{probe}"
    );
    let data = v.staging.join("data");
    vm.run(&format!(
        "dd if=/dev/urandom of={} bs=64k count=16 2>/dev/null && sync",
        data.display()
    ))
    .await
    .expect("write");
    let sum = guest_md5(vm, &data).await;
    unstage(&node, &v).await;
    stage(&node, &v, &cap).await.expect("stage again");
    assert_eq!(
        guest_mount(vm, &v.staging).await[0],
        m[0],
        "not reformatted"
    );
    assert_eq!(guest_md5(vm, &data).await, sum, "data intact");
    unstage(&node, &v).await;
    detach_and_delete(ctrl, &v).await;
    node
}

/// A channel as the shared helpers take it.
struct ChannelRef(Channel);
impl AsRef<Channel> for ChannelRef {
    fn as_ref(&self) -> &Channel {
        &self.0
    }
}

/// csi-sanity's path commands (`--csi.createmountpathcmd` etc.): each runs its one-line script
/// with the path in the guest through the command channel (bash's /dev/tcp), so the directories
/// csi-sanity makes, removes and checks are the node plugin's, not the host's.
struct PathCommands {
    mkdir: PathBuf,
    rmdir: PathBuf,
    check: PathBuf,
}

fn path_commands(bed: &TestBed, vm: &Vm) -> PathCommands {
    use std::os::unix::fs::PermissionsExt;
    let port = vm.shell_port();
    let write = |name: &str, script: &str| {
        let path = bed.dir.path().join(name);
        let text = format!(
            "#!/bin/bash\n# {name} PATH: runs in guest {vm}\nset -e\nexec 3<>/dev/tcp/127.0.0.1/{port}\n\
             printf '%s\\n' \"p=$1\" '{script}' exit >&3\ncat <&3\n",
            vm = vm.name
        );
        std::fs::write(&path, text).expect("path command");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    };
    PathCommands {
        mkdir: write("guest-mkdir", r#"mkdir -p "$p" && echo "$p""#),
        rmdir: write("guest-rmdir", r#"rmdir "$p" 2>/dev/null || rm -f "$p""#),
        check: write(
            "guest-checkpath",
            r#"if [ -f "$p" ]; then echo file; elif [ -d "$p" ]; then echo directory; elif [ -e "$p" ]; then echo other; else echo not_found; fi"#,
        ),
    }
}

/// csi-sanity with the node plugin in the guest and the controller on the host; `focus`, when
/// given, is ginkgo's `--ginkgo.focus` (a regular expression over the specs' names).
async fn csi_sanity(bed: &TestBed, vm: &Vm, ctrl: &Driver, access_type: &str, focus: Option<&str>) {
    let bin = testbed::util::tools::tool("csi-sanity").unwrap_or_else(|e| panic!("{e}"));
    let port = vm.host_port(CSI_PORT).expect("port");
    // The staging and target paths are made in the guest (path commands); their parent exists
    // on the host too, where csi-sanity's own code looks.
    let work = bed.dir.path().join(format!("guest-sanity-{access_type}"));
    std::fs::create_dir_all(&work).expect("csi-sanity work dir");
    let work = work.display().to_string();
    let cmds = path_commands(bed, vm);
    let t0 = Instant::now();
    let out = tokio::process::Command::new(&bin)
        .arg(format!("--csi.endpoint=127.0.0.1:{port}"))
        .arg(format!(
            "--csi.controllerendpoint=unix://{}",
            ctrl.socket.display()
        ))
        .arg(format!("--csi.stagingdir={work}/staging"))
        .arg(format!("--csi.mountdir={work}/mount"))
        .arg(format!("--csi.testvolumeaccesstype={access_type}"))
        .arg(format!("--csi.testvolumesize={}", 64 * MIB))
        .arg(format!("--csi.testvolumeexpandsize={}", 128 * MIB))
        .arg("--csi.testnodevolumeattachlimit")
        .arg(format!("--csi.createmountpathcmd={}", cmds.mkdir.display()))
        .arg(format!(
            "--csi.createstagingpathcmd={}",
            cmds.mkdir.display()
        ))
        .arg(format!("--csi.removemountpathcmd={}", cmds.rmdir.display()))
        .arg(format!(
            "--csi.removestagingpathcmd={}",
            cmds.rmdir.display()
        ))
        .arg(format!("--csi.checkpathcmd={}", cmds.check.display()))
        .arg("--ginkgo.no-color")
        .args(focus.map(|f| format!("--ginkgo.focus={f}")))
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let log = std::env::temp_dir().join(format!("csi-sanity-guest-{access_type}.log"));
    let _ = std::fs::write(&log, &text);
    let summary: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("Ran ") || l.contains(" Passed | "))
        .collect();
    say(&format!(
        "csi-sanity {access_type} against the guest in {:.0}s: {summary:?} (log {})",
        t0.elapsed().as_secs_f64(),
        log.display()
    ));
    let _ = std::fs::remove_dir_all(&work);
    if !out.status.success() || !summary.iter().any(|l| l.contains(" 0 Failed ")) {
        let tail: Vec<&str> = text.lines().rev().take(120).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!(
            "csi-sanity ({access_type}) against the guest failed; {summary:?}\n{}",
            tail.join("\n")
        );
    }
}

/// Prints the VM's hot-plug measurements.
fn report_hotplugs(vm: &Vm) {
    let s = vm.hotplug_stats();
    let mut ms: Vec<u128> = s.plug_to_guest.iter().map(|d| d.as_millis()).collect();
    ms.sort_unstable();
    let deleted = s
        .unplug_seen_by
        .iter()
        .filter(|w| **w == "DEVICE_DELETED")
        .count();
    say(&format!(
        "{}: {} hot-plugs, QMP plug to disk in the guest (ms) min {:?} median {:?} max {:?}; \
         {} unplugs, {deleted} seen by DEVICE_DELETED, {} by the qom-list fallback",
        vm.name,
        ms.len(),
        ms.first(),
        ms.get(ms.len() / 2),
        ms.last(),
        s.unplug_seen_by.len(),
        s.unplug_seen_by.len() - deleted
    ));
}

fn start_ccm(bed: &TestBed) -> harvester_cloud_provider::Running {
    let cloud_config = bed.cloud_config.to_string_lossy().to_string();
    let kubeconfig = bed.guest.kubeconfig.to_string_lossy().to_string();
    let config = harvester_cloud_provider::Config::from_args([
        "harvester-cloud-provider",
        "--cloud-config",
        &cloud_config,
        "--kubeconfig",
        &kubeconfig,
        "--cluster-name",
        "guest-1",
    ])
    .expect("flags");
    harvester_cloud_provider::spawn(config)
}

fn node_addresses(n: &Node) -> Vec<String> {
    n.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|a| {
            a.iter()
                .map(|a| format!("{}={}", a.type_, a.address))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_vm_with_udev_and_agent_root() {
    wait::within(
        "guest_vm_with_udev_and_agent_root",
        TEST_LIMIT,
        guest_vm_with_udev_and_agent_root_steps(),
    )
    .await
}

async fn guest_vm_with_udev_and_agent_root_steps() {
    let _one = ONE_VM.lock().await;
    let t0 = Instant::now();
    let (bed, vm) = bed_with_real_vm(VmOptions::new("guest-udev")).await;

    // The stand-in filled the VMI's interfaces from the real agent; the provider uses them.
    bed.sim.create_guest_node(NODE).await.expect("guest Node");
    let ccm = start_ccm(&bed);
    let nodes: Api<Node> = Api::all(bed.guest.client.clone());
    let node = wait::until(
        "Node initialised with the agent's address",
        Duration::from_secs(60),
        || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get(NODE).await.map_err(|e| e.to_string())?;
                let addrs = node_addresses(&n);
                Ok(if addrs.iter().any(|a| a == "InternalIP=10.0.2.15") {
                    Ok(n)
                } else {
                    Err(addrs)
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    say(&format!(
        "Node addresses from the guest agent: {:?}",
        node_addresses(&node)
    ));
    ccm.stop().await.expect("the cloud provider stops");

    let ctrl = controller(&bed).await;
    let node = start_plugin(
        &bed,
        &vm,
        1,
        "node",
        &format!("--max-volumes-per-node={ATTACH_LIMIT}"),
    )
    .await;
    hotplug_cycle(&vm, &ctrl, &node, "ext4").await;
    hotplug_cycle(&vm, &ctrl, &node, "xfs").await;
    let node = kill_during_stage(&bed, &vm, &ctrl, node).await;
    node.kill(&vm).await;
    // csi-sanity learns whether to call ControllerPublishVolume from GetPluginCapabilities on
    // the node endpoint (CONTROLLER_SERVICE), and a `--mode node` plugin rightly does not claim
    // it; so for csi-sanity the plugin in the guest runs in `all` mode. Its controller service
    // is not called: csi-sanity sends controller RPCs to the host's controller.
    let _node = start_plugin(
        &bed,
        &vm,
        3,
        "all",
        &format!("--max-volumes-per-node={ATTACH_LIMIT}"),
    )
    .await;
    csi_sanity(&bed, &vm, &ctrl, "mount", None).await;
    // Block volumes: the node's specs. The controller's, with a block capability, are the host
    // suite's (`csi_sanity` runs them all with block volumes), and their hot-plugs into this
    // guest are the mount run's: the controller plugs a disk the same way for either.
    csi_sanity(&bed, &vm, &ctrl, "block", Some("Node Service")).await;
    ctrl.stop().await;
    report_hotplugs(&vm);
    vm.stop().await;
    say(&format!(
        "guest_vm_with_udev_and_agent_root took {:.0}s (boot {:.1}s)",
        t0.elapsed().as_secs_f64(),
        vm.booted_in.as_secs_f64()
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_vm_without_udev_or_agent_root() {
    wait::within(
        "guest_vm_without_udev_or_agent_root",
        TEST_LIMIT,
        guest_vm_without_udev_or_agent_root_steps(),
    )
    .await
}

async fn guest_vm_without_udev_or_agent_root_steps() {
    let _one = ONE_VM.lock().await;
    let t0 = Instant::now();
    let (bed, vm) =
        bed_with_real_vm(VmOptions::new("guest-bare").without_udev().without_agent()).await;

    // No agent: no addresses on the VMI, and the provider's Event names qemu-guest-agent.
    bed.sim.create_guest_node(NODE).await.expect("guest Node");
    let ccm = start_ccm(&bed);
    let events: Api<Event> = Api::namespaced(bed.guest.client.clone(), "default");
    let event = wait::until(
        "a Warning Event naming qemu-guest-agent",
        Duration::from_secs(60),
        || {
            let events = events.clone();
            async move {
                let list = events
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let seen: Vec<String> = list
                    .items
                    .iter()
                    .map(|e| format!("{:?}", e.reason))
                    .collect();
                Ok(list
                    .items
                    .into_iter()
                    .find(|e| {
                        e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(NODE)
                            && e.reason.as_deref() == Some("NoGuestAgentAddresses")
                    })
                    .ok_or(seen))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let note = event.note.unwrap_or_default();
    assert!(note.contains("qemu-guest-agent"), "{note}");
    say(&format!("Event without an agent: {note}"));
    ccm.stop().await.expect("the cloud provider stops");

    // No udev: no by-id links; stage finds the disk by its SCSI serial in sysfs.
    let ctrl = controller(&bed).await;
    // The device wait shortened (30 s by default): the last step waits it out.
    let node = start_plugin(
        &bed,
        &vm,
        1,
        "node",
        &format!("--device-timeout-seconds={}", DEVICE_BOUND.as_secs()),
    )
    .await;
    let cap = mount_cap("ext4");
    let v = create_and_publish(&ctrl, "no-udev", 64 * MIB, &cap, &guest_paths("")).await;
    let serial = harvester_csi_driver::naming::disk_serial(&v.id);
    let links = vm
        .shell("ls /dev/disk/by-id 2>&1")
        .await
        .expect("ls in the guest");
    assert_ne!(
        links.code, 0,
        "no udev, no by-id directory: {}",
        links.output
    );
    stage(&node, &v, &cap)
        .await
        .expect("NodeStageVolume by sysfs serial");
    let m = guest_mount(&vm, &v.staging).await;
    let disk = m[2].trim_start_matches("/dev/").to_string();
    let page = vm
        .run(&format!("tail -c +5 /sys/block/{disk}/device/vpd_pg80"))
        .await
        .expect("vpd_pg80");
    assert_eq!(
        page.trim_end_matches(['\0', ' ', '\n']),
        serial,
        "staged the disk with the serial"
    );
    unstage(&node, &v).await;
    controller_unpublish(&ctrl, &v).await;

    // A disk that is not in the guest: NOT_FOUND within the device wait, naming the serial.
    let t = Instant::now();
    let err = stage(&node, &v, &cap)
        .await
        .expect_err("no disk in the guest");
    let took = t.elapsed();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(err.message().contains(&serial), "{}", err.message());
    assert!(
        took >= DEVICE_BOUND && took < DEVICE_BOUND + Duration::from_secs(10),
        "NOT_FOUND once the device wait (--device-timeout-seconds) is over: {took:?}"
    );
    say(&format!(
        "NodeStageVolume without the disk: {:?} after {:.0}s: {}",
        err.code(),
        took.as_secs_f64(),
        err.message()
    ));
    ControllerClient::new(ctrl.channel.clone())
        .delete_volume(DeleteVolumeRequest {
            volume_id: v.id.clone(),
            ..Default::default()
        })
        .await
        .expect("DeleteVolume");
    node.kill(&vm).await;
    ctrl.stop().await;
    report_hotplugs(&vm);
    vm.stop().await;
    say(&format!(
        "guest_vm_without_udev_or_agent_root took {:.0}s (boot {:.1}s)",
        t0.elapsed().as_secs_f64(),
        vm.booted_in.as_secs_f64()
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_does_not_come_up_fails_with_its_console() {
    wait::within(
        "a_guest_that_does_not_come_up_fails_with_its_console",
        TEST_LIMIT,
        a_guest_that_does_not_come_up_fails_with_its_console_steps(),
    )
    .await
}

async fn a_guest_that_does_not_come_up_fails_with_its_console_steps() {
    let _one = ONE_VM.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut opts = VmOptions::new("too-slow");
    opts.boot_timeout = Duration::from_secs(2);
    let t0 = Instant::now();
    let err = match Vm::start(dir.path(), opts).await {
        Ok(_) => panic!("a guest cannot be up within 2s under TCG"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("did not come up within 2s") && err.contains("console's last lines"),
        "{err}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "bounded: {:?}",
        t0.elapsed()
    );
    // QEMU was killed and reaped: its pidfile names no live process.
    let pid = std::fs::read_to_string(dir.path().join("vm-too-slow/qemu.pid")).expect("pidfile");
    assert!(
        !Path::new(&format!("/proc/{}", pid.trim())).exists()
            || std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
                .is_ok_and(|s| s.contains(") Z ")),
        "QEMU {pid} still running"
    );
}
