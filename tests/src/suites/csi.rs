//! Shared by the CSI suites (`csi_*.rs`, `chaos_csi.rs`, `guest_vm.rs`, ...): the driver started
//! in-process or as the `harvester-csi-driver` binary against the test bed, gRPC clients on its
//! socket, the volume steps the suites share, and mount cleanup that also runs when a test fails.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::sim::GuestVm;
use crate::util::process::Proc;
use crate::{BedOptions, TestBed};
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::identity_client::IdentityClient;
use csi_proto::csi::v1::node_client::NodeClient;
use csi_proto::csi::v1::*;
use harvester_csi_driver::{Config, Running};

use crate::csi_client;
use tonic::Code;
use tonic::transport::Channel;

/// The guest VM (and CSI node ID) the suites use.
pub const NODE: &str = "worker-1";

/// One attempt of at most this long to reach a node plugin in a QEMU guest.
pub const GUEST_PLUGIN_ATTEMPT: Duration = Duration::from_secs(10);

/// One attempt to reach the node plugin a QEMU guest serves behind the host's forwarded `port`:
/// connect, then Probe. QEMU's user network accepts on the host side before the guest does, so
/// an attempt it never completes is given up after [`GUEST_PLUGIN_ATTEMPT`] (the caller tries
/// again) instead of waiting forever.
pub async fn probe_guest_plugin(port: u16) -> Result<Channel, String> {
    let attempt = async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        IdentityClient::new(ch.clone())
            .probe(ProbeRequest {})
            .await
            .map_err(|e| e.to_string())?;
        Ok(ch)
    };
    tokio::time::timeout(GUEST_PLUGIN_ATTEMPT, attempt)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {GUEST_PLUGIN_ATTEMPT:?}")))
}

pub fn assert_root() {
    assert!(
        crate::sim::storage::is_root(),
        "this test needs root (loop devices, mkfs, mount); run it as root (`make test` does)"
    );
}

/// A bed to hot-plug on: KubeVirt's own virt-api and virt-controller ([`BedOptions::hotplugging`]).
pub async fn bed() -> TestBed {
    TestBed::started_with(BedOptions::hotplugging()).await
}

pub async fn bed_with(opts: BedOptions) -> TestBed {
    TestBed::started_with(opts).await
}

/// A bed to hot-plug on ([`bed`]) with Harvester's default StorageClass, a host and the running
/// guest VM [`NODE`].
pub async fn bed_with_vm() -> TestBed {
    bed_with_vm_and(BedOptions::hotplugging()).await
}

/// [`bed_with_vm`] on a bed started with `opts`.
pub async fn bed_with_vm_and(opts: BedOptions) -> TestBed {
    TestBed::started_with(opts)
        .await
        .with_default_storage_class()
        .await
        .with_vm(NODE)
        .await
}

/// The driver serving on a socket in the bed's directory, until [`Driver::stop`] or drop.
pub struct Driver {
    pub socket: PathBuf,
    pub channel: Channel,
    running: Running,
}

impl Driver {
    /// Starts the driver in `all` mode for node [`NODE`], with the bed's guest kubeconfig;
    /// `tweak` adjusts the config (a second driver sets another `endpoint`).
    pub async fn start(bed: &TestBed, tweak: impl FnOnce(&mut Config)) -> Driver {
        let socket = bed
            .dir
            .path()
            .join(format!("csi-{}.sock", std::process::id()));
        let mut config = Config::new(format!("unix://{}", socket.display()), &bed.cloud_config);
        config.node_id = Some(NODE.into());
        config.disk_by_id_dir = bed.sim.by_id_dir(NODE);
        config.guest_kubeconfig = Some(bed.guest.kubeconfig.clone());
        tweak(&mut config);
        let socket = harvester_csi_driver::socket_path(&config.endpoint)
            .unwrap_or_else(|e| panic!("test driver endpoint: {e}"));
        let running = harvester_csi_driver::spawn(config);
        // Until a connect succeeds: the socket file of a driver this process stopped before
        // may still be there while this one starts (a connect then is refused).
        let start = Instant::now();
        let channel = loop {
            if running.is_finished() {
                match running.join().await {
                    Err(e) => panic!("the driver failed to start: {e}"),
                    Ok(()) => panic!("the driver stopped while starting"),
                }
            }
            let refused = if socket.exists() {
                match harvester_csi_driver::connect(&socket).await {
                    Ok(channel) => break channel,
                    Err(e) => e.to_string(),
                }
            } else {
                "no socket file".to_string()
            };
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "driver socket {} did not serve within 30s: {refused}",
                socket.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Driver {
            socket,
            channel,
            running,
        }
    }

    pub fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.channel.clone())
    }
    pub fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel.clone())
    }
    pub fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone())
    }

    /// Stops the driver gracefully and checks it removed its socket.
    pub async fn stop(self) {
        match tokio::time::timeout(Duration::from_secs(20), self.running.stop()).await {
            Ok(Ok(())) => {}
            other => panic!("the driver did not stop cleanly: {other:?}"),
        }
        assert!(!self.socket.exists(), "the driver left its socket behind");
    }
}

impl AsRef<Channel> for Driver {
    fn as_ref(&self) -> &Channel {
        &self.channel
    }
}

/// The `harvester-csi-driver` binary as a child process against the bed's cloud-config, logging
/// to `<bed dir>/<name>.log`. [`DriverProc::kill`] or dropping the handle SIGKILLs it, which
/// leaves its socket file behind as a crash would.
pub struct DriverProc {
    pub proc: Proc,
    pub socket: PathBuf,
    pub channel: Channel,
}

impl DriverProc {
    /// The controller service (`--mode=controller`) on `socket`.
    pub async fn controller(bed: &TestBed, name: &str, socket: &Path) -> DriverProc {
        let args = ["--mode=controller".to_string()];
        DriverProc::start(bed, name, socket, &args, &[]).await
    }

    /// The node plugin of [`NODE`] (`--mode=node`) on `socket`, finding disks in the stand-in's
    /// by-id directory of that guest.
    pub async fn node(bed: &TestBed, name: &str, socket: &Path) -> DriverProc {
        DriverProc::node_with_env(bed, name, socket, &[]).await
    }

    /// [`DriverProc::node`] with extra environment variables (e.g. a `PATH` with tool wrappers).
    pub async fn node_with_env(
        bed: &TestBed,
        name: &str,
        socket: &Path,
        env: &[(&str, String)],
    ) -> DriverProc {
        // No Harvester credential, as the chart runs the node plugin (the last flag wins).
        let args = [
            "--mode=node".to_string(),
            "--kubeconfig=".to_string(),
            format!("--nodeid={NODE}"),
            format!("--disk-by-id-dir={}", bed.sim.by_id_dir(NODE).display()),
        ];
        DriverProc::start(bed, name, socket, &args, env).await
    }

    /// Starts the binary with `args` and `env` and waits (30 s) until it answers Probe on
    /// `socket`.
    pub async fn start(
        bed: &TestBed,
        name: &str,
        socket: &Path,
        args: &[String],
        env: &[(&str, String)],
    ) -> DriverProc {
        let mut cmd = Command::new(crate::util::process::built_binary("harvester-csi-driver"));
        cmd.arg(format!("--endpoint=unix://{}", socket.display()))
            .arg(format!("--kubeconfig={}", bed.cloud_config.display()))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)));
        let mut proc = Proc::spawn(name, cmd, bed.dir.path())
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let start = Instant::now();
        let mut last = String::new();
        loop {
            if let Err(e) = proc.check_alive() {
                panic!("{name} stopped while starting: {e}");
            }
            // A socket left by a killed predecessor refuses connections until the new process
            // has replaced it.
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                match harvester_csi_driver::connect(socket).await {
                    Ok(channel) => {
                        match IdentityClient::new(channel.clone())
                            .probe(ProbeRequest {})
                            .await
                        {
                            Ok(_) => {
                                return DriverProc {
                                    proc,
                                    socket: socket.to_path_buf(),
                                    channel,
                                };
                            }
                            Err(e) => last = format!("Probe: {e}"),
                        }
                    }
                    Err(e) => last = format!("connect: {e}"),
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{name} did not answer on {} within 30s (last: {last}); log {}:\n{}",
                socket.display(),
                proc.log.display(),
                crate::util::process::tail(&proc.log, 20)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL and reap: no graceful shutdown, the socket file stays.
    pub fn kill(mut self) {
        self.proc.stop();
    }

    pub fn controller_client(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel.clone())
    }
    pub fn node_client(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone())
    }
}

impl AsRef<Channel> for DriverProc {
    fn as_ref(&self) -> &Channel {
        &self.channel
    }
}

/// A created and controller-published volume, with its staging and target paths.
pub struct Vol {
    pub id: String,
    pub ctx: HashMap<String, String>,
    pub staging: PathBuf,
    pub target: PathBuf,
}

/// ControllerPublishVolume of `id` to [`NODE`].
pub fn publish_request(id: &str, cap: &VolumeCapability) -> ControllerPublishVolumeRequest {
    csi_client::publish_request(id, NODE, cap)
}

/// ControllerUnpublishVolume of `id` from [`NODE`].
pub fn unpublish_request(id: &str) -> ControllerUnpublishVolumeRequest {
    csi_client::unpublish_request(id, NODE)
}

/// The administrator's confirmation that guest node `node` is shut down for good: the
/// `node.kubernetes.io/out-of-service` taint, which lets the controller detach its volumes.
pub async fn taint_out_of_service(bed: &TestBed, node: &str) {
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> =
        kube::Api::all(bed.guest.client.clone());
    let patch = serde_json::json!({"spec": {"taints": [{
        "key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"
    }]}});
    nodes
        .patch(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .expect("tainting the guest Node out-of-service");
}

/// CreateVolume of a 64 MiB volume `name` with `cap` on controller `d`: its ID.
pub async fn create_volume(d: &impl AsRef<Channel>, name: &str, cap: &VolumeCapability) -> String {
    ControllerClient::new(d.as_ref().clone())
        .create_volume(create_request(name, 64 << 20, cap))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id
}

/// CreateVolume and ControllerPublishVolume to [`NODE`] on controller `d`; the staging and
/// target paths are `<dir>/<name>-staging` and `<dir>/<name>-target`.
pub async fn create_and_publish(
    d: &impl AsRef<Channel>,
    name: &str,
    size: u64,
    cap: &VolumeCapability,
    dir: &Path,
) -> Vol {
    let mut c = ControllerClient::new(d.as_ref().clone());
    let created = c
        .create_volume(create_request(name, size, cap))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume");
    let published = c
        .controller_publish_volume(publish_request(&created.volume_id, cap))
        .await
        .expect("ControllerPublishVolume")
        .into_inner();
    Vol {
        id: created.volume_id,
        ctx: published.publish_context,
        staging: dir.join(format!("{name}-staging")),
        target: dir.join(format!("{name}-target")),
    }
}

/// `<bed dir>/<name>`, created, and a sweeper that unmounts whatever a test leaves under it (also
/// when it fails).
pub fn node_dir(bed: &TestBed, name: &str) -> (PathBuf, MountSweeper) {
    let dir = bed.dir.path().join(name);
    std::fs::create_dir_all(&dir).expect("node dir");
    let sweeper = MountSweeper(dir.clone());
    (dir, sweeper)
}

/// [`create_and_publish`], then NodeStageVolume and NodePublishVolume with `cap`, both expected
/// to succeed: the volume mounted (or its device bound) at `v.target`.
pub async fn mounted(
    d: &impl AsRef<Channel>,
    name: &str,
    size: u64,
    cap: &VolumeCapability,
    dir: &Path,
) -> Vol {
    let v = create_and_publish(d, name, size, cap, dir).await;
    stage(d, &v, cap)
        .await
        .unwrap_or_else(|e| panic!("NodeStageVolume {name}: {e:?}"));
    publish(d, &v, cap)
        .await
        .unwrap_or_else(|e| panic!("NodePublishVolume {name}: {e:?}"));
    v
}

pub async fn stage(
    d: &impl AsRef<Channel>,
    v: &Vol,
    cap: &VolumeCapability,
) -> Result<(), tonic::Status> {
    NodeClient::new(d.as_ref().clone())
        .node_stage_volume(csi_client::stage_request(&v.id, &v.ctx, &v.staging, cap))
        .await
        .map(|_| ())
}

pub async fn publish(
    d: &impl AsRef<Channel>,
    v: &Vol,
    cap: &VolumeCapability,
) -> Result<(), tonic::Status> {
    NodeClient::new(d.as_ref().clone())
        .node_publish_volume(csi_client::node_publish_request(
            &v.id, &v.ctx, &v.staging, &v.target, cap,
        ))
        .await
        .map(|_| ())
}

/// NodeUnpublishVolume and NodeUnstageVolume, both expected to succeed.
pub async fn unpublish_and_unstage(d: &impl AsRef<Channel>, v: &Vol) {
    let mut n = NodeClient::new(d.as_ref().clone());
    n.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: v.id.clone(),
        target_path: v.target.display().to_string(),
    })
    .await
    .expect("NodeUnpublishVolume");
    n.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: v.id.clone(),
        staging_target_path: v.staging.display().to_string(),
    })
    .await
    .expect("NodeUnstageVolume");
}

/// ControllerUnpublishVolume from [`NODE`] and DeleteVolume, both expected to succeed.
pub async fn detach_and_delete(d: &impl AsRef<Channel>, v: &Vol) {
    let mut c = ControllerClient::new(d.as_ref().clone());
    c.controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume");
    c.delete_volume(DeleteVolumeRequest {
        volume_id: v.id.clone(),
        ..Default::default()
    })
    .await
    .expect("DeleteVolume");
}

/// The bed's VM [`NODE`] with `spec.updateVolumesStrategy: Migration` (as Harvester v1.8 sets it
/// on a VM it storage-migrates).
pub async fn migration_strategy(bed: &TestBed) {
    update_volumes_strategy(bed, Some("Migration")).await;
}

/// The bed's VM [`NODE`] with `spec.updateVolumesStrategy` set to `strategy`, or unset.
pub async fn update_volumes_strategy(bed: &TestBed, strategy: Option<&str>) {
    bed.sim
        .patch_vm(
            NODE,
            serde_json::json!({"spec": {"updateVolumesStrategy": strategy}}),
        )
        .await
        .unwrap_or_else(|e| panic!("VM updateVolumesStrategy: {strategy:?}: {e}"));
}

/// The filesystem UUID of the mount holding `path` (`findmnt`, independent of the driver).
pub fn blkid_uuid(path: &Path) -> String {
    let out = Command::new("findmnt")
        .args(["-n", "-o", "UUID", "--target"])
        .arg(path)
        .output()
        .expect("findmnt");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The `/proc/self/mountinfo` lines of mounts exactly at `path` (mount ID first, so a remount
/// or a second mount on top shows as a changed or extra line).
pub fn mount_entries(path: &Path) -> Vec<String> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let want = path.to_string_lossy().replace(' ', "\\040");
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some(want.as_str()))
        .map(str::to_string)
        .collect()
}

pub use crate::csi_client::{block_cap, create_request, from_snapshot, from_volume, mount_cap};
pub use crate::real::mounts::MountSweeper;

/// What a powered-off guest leaves of its mounts: none (its kernel is gone). Lazy unmounts by
/// the test, not by the node plugin, which never hears of it.
fn guest_kernel_gone(paths: &[&Path]) {
    for p in paths {
        let _ = Command::new("umount").arg("-l").arg(p).status();
    }
}

/// A guest powered off for good: its stopped VMI keeps the disk, and KubeVirt acts on no hot-plug
/// request for it (virt-controller applies `status.volumeRequests` to running VMIs only), so
/// the force-detach after the out-of-service taint must end under each KubeVirt gate set
/// Harvester runs, and the volume move to another node with its data.
/// On `bed` ([`bed_with_vm`] or kin, with guest node [`NODE`] running and no driver serving).
/// `pinned` (under KubeVirt's own controllers): `worker-1`'s VM is pinned to its host, as a
/// Harvester VM scheduling rule pins it, so the VMI KubeVirt starts again after the host's loss
/// waits for that host for good and KubeVirt applies no unplug to it.
pub async fn a_volume_of_a_powered_off_node_moves(bed: &TestBed, pinned: bool) {
    assert_root();
    const OTHER: &str = "worker-2";
    let what = match &bed.kubevirt {
        Some(k) => format!("KubeVirt v{} {:?}", k.line.version, k.line.gates),
        None => format!("the stand-in, {:?}", bed.sim.hotplug.gates()),
    };
    // On another host: under KubeVirt's own controllers worker-1's host is what loses power.
    bed.sim
        .create_host("harvester-2", Some("region-a"), Some("zone-2"))
        .await
        .expect("second host");
    bed.sim
        .create_vm(&GuestVm::new(OTHER).on_host("harvester-2").ip("10.52.0.12"))
        .await
        .expect("second guest VM");
    for n in [NODE, OTHER] {
        bed.sim.create_guest_node(n).await.expect("guest Node");
    }
    let d1 = Driver::start(bed, |_| {}).await;
    let d2 = Driver::start(bed, |c| {
        c.endpoint = format!(
            "unix://{}",
            bed.dir.path().join("csi-worker-2.sock").display()
        );
        c.mode = harvester_csi_driver::Mode::Node;
        c.node_id = Some(OTHER.into());
        c.disk_by_id_dir = bed.sim.by_id_dir(OTHER);
    })
    .await;
    let (dir, sweeper) = node_dir(bed, "shutdown");
    let cap = mount_cap("ext4");
    let v = mounted(&d1, "pvc-shutdown", 64 << 20, &cap, &dir).await;
    std::fs::write(v.target.join("state.db"), b"written on worker-1").expect("write");
    assert!(Command::new("sync").status().expect("sync").success());

    // worker-1 powers off for good. On the stand-in its VMI stays Failed, still holding the disk;
    // under KubeVirt's own controllers its host lost power: Harvester force-reset the VM and
    // KubeVirt started it again, its new VMI waiting for a host.
    if pinned {
        bed.sim
            .patch_vm(
                NODE,
                serde_json::json!({"spec": {"template": {"spec": {
                    "nodeSelector": {"kubernetes.io/hostname": "harvester-1"}}}}}),
            )
            .await
            .expect("pin worker-1's VM to its host");
    }
    bed.sim.power_off_vm(NODE).await.expect("power off");
    guest_kernel_gone(&[&v.target, &v.staging]);
    let mut c = d1.controller();
    let to_other = ControllerPublishVolumeRequest {
        node_id: OTHER.into(),
        ..publish_request(&v.id, &cap)
    };
    // Still attached to worker-1.
    let e = c
        .controller_publish_volume(to_other.clone())
        .await
        .expect_err("publish elsewhere while worker-1 holds it");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(NODE), "{}", e.message());
    if bed.kubevirt.is_none() {
        // Not released from its stopped VMI without the taint.
        let e = c
            .controller_unpublish_volume(unpublish_request(&v.id))
            .await
            .expect_err("unpublish from a stopped VMI without the taint");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(
            e.message().contains("node.kubernetes.io/out-of-service"),
            "says what to do: {}",
            e.message()
        );
        let e = c
            .controller_publish_volume(to_other.clone())
            .await
            .expect_err("still FAILED_PRECONDITION");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    }

    // The administrator confirms the shutdown.
    taint_out_of_service(bed, NODE).await;
    c.controller_unpublish_volume(unpublish_request(&v.id))
        .await
        .expect("ControllerUnpublishVolume from the stopped VM");
    let vm: harvester_common::harvester::VirtualMachine =
        kube::Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
            .get(NODE)
            .await
            .expect("VM worker-1");
    // No add request left for KubeVirt to apply to the VM's next VMI; the volume is out of the
    // VM spec, or (a VMI that has not started, under `HotplugVolumes`) a remove request waits
    // for KubeVirt to apply it should that VMI start.
    let requests = vm
        .status
        .as_ref()
        .and_then(|s| s.rest.get("volumeRequests"))
        .cloned()
        .unwrap_or_default();
    assert!(
        !requests.to_string().contains("addVolumeOptions"),
        "{requests}"
    );
    let in_spec = vm
        .spec
        .template
        .spec
        .volumes
        .iter()
        .any(|vol| vol.name == v.id);
    assert!(
        !in_spec
            || (bed.kubevirt.is_some() && requests.to_string().contains("removeVolumeOptions")),
        "the hot-plugged volume left the stopped VM ({what}): {requests}"
    );
    // Published as the external-attacher does, again on FAILED_PRECONDITION: a VMI KubeVirt
    // started again elsewhere may hold the disk until KubeVirt applies the remove.
    let published = crate::util::wait::until(
        "ControllerPublishVolume to worker-2",
        Duration::from_secs(30),
        || {
            let mut c = c.clone();
            let req = to_other.clone();
            async move {
                Ok(match c.controller_publish_volume(req).await {
                    Ok(r) => Ok(r.into_inner()),
                    Err(e) if e.code() == Code::FailedPrecondition => Err(e.message().to_string()),
                    Err(e) => return Err(format!("{e:?}")),
                })
            }
        },
    )
    .await
    .expect("ControllerPublishVolume to worker-2");
    let moved = Vol {
        id: v.id.clone(),
        ctx: published.publish_context,
        staging: dir.join("w2-staging"),
        target: dir.join("w2-target"),
    };
    stage(&d2, &moved, &cap).await.expect("stage on worker-2");
    publish(&d2, &moved, &cap)
        .await
        .expect("publish on worker-2");
    assert_eq!(
        std::fs::read(moved.target.join("state.db")).expect("data on worker-2"),
        b"written on worker-1"
    );
    unpublish_and_unstage(&d2, &moved).await;
    c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        node_id: OTHER.into(),
        ..unpublish_request(&v.id)
    })
    .await
    .expect("unpublish from worker-2");
    c.delete_volume(DeleteVolumeRequest {
        volume_id: v.id.clone(),
        ..Default::default()
    })
    .await
    .expect("DeleteVolume");
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    d2.stop().await;
    d1.stop().await;
}
