//! Node service, run inside the guest VM: finds the hot-plugged disk by serial (`device`),
//! formats it only when blank and mounts it at the staging path (`filesystem`, `mount`),
//! bind-mounts it for pods, grows it, reports its usage; an RWX volume is an NFS mount instead
//! (`nfs`, made in the host's network namespace by `netns`). Which VM this node is and how many
//! volumes it takes: `discovery`; the rules for staging and target paths: `paths`.
//!
//! Staging rules, written once in [`NodeService::stage_filesystem`]: already staged from the same
//! device is success; another device on the path is ALREADY_EXISTS; a device is formatted only
//! when `blkid -p` finds neither a filesystem nor a partition table.

pub mod device;
pub mod discovery;
pub mod filesystem;
pub mod mount;
pub mod netns;
pub mod nfs;
pub mod paths;
mod stats;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_proto::csi::v1::node_server::Node;
use csi_proto::csi::v1::node_service_capability::{self, rpc};
use csi_proto::csi::v1::*;
use harvester_common::api_error::Describe;
use harvester_common::cloud_config::Harvester;
use harvester_common::harvester::VirtualMachineInstance;
use kube::api::Api;
use tonic::{Request, Response, Status};

pub use self::device::disk_id;
use self::discovery::refused;
pub use self::discovery::{local_macs, max_volumes, vmi_by_mac};
use self::filesystem::{Filesystem, Prepare};
use self::mount::{canonical, mount_at, mounts, run, run_any};
pub use self::paths::{Removable, needs_read_only_remount, removable};
use self::paths::{
    directory_or_nothing, not_a_symlink, other_mount, published_path, remount_read_only, republish,
};
use self::stats::{abnormal, filesystem_usage, normal, usage};
use crate::Config;
use crate::error::{ArgError, NodeError};
use crate::inflight::InFlight;
use crate::request::{self, Access, required};
use crate::rpc::rpc;

pub struct NodeService {
    node_id: String,
    /// Harvester, when the plugin has a cloud-config: an RWX volume whose publish context
    /// carries no export is looked up there (`nfs`).
    harvester: Option<Harvester>,
    nfs_mount_timeout: Duration,
    /// Where NFS mounts are made (`netns`): the host's network namespace when we can reach it.
    nfs_netns: netns::NfsNetns,
    /// How long statvfs and unmounts of an NFS mount may wait for the server (`nfs`).
    nfs_server_timeout: Duration,
    /// NFS mounts whose statvfs is waiting on a blocking thread: one thread per path at most.
    statvfs_waiting: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<PathBuf>>>,
    /// The kubelet's directory (`--kubelet-dir`): node paths outside it are refused; `None`:
    /// any path, as upstream.
    kubelet_dir: Option<PathBuf>,
    by_id: PathBuf,
    sysfs: PathBuf,
    device_wait: Duration,
    max_volumes: i64,
    inflight: InFlight,
    /// Staging and target paths in use: two volumes never work on one path at once.
    paths: InFlight,
    /// Why the node ID could not be looked up when Harvester refused it (RBAC): a misconfiguration
    /// for `/readyz`; other lookup errors only log (the hostname usually is the VM name).
    discovery: Result<(), String>,
}

/// The node ID, its VMI and the readiness of the lookup: the VMI named `given`, else the one
/// with this machine's MAC addresses, else `given` as it is.
async fn discover(
    harvester: &Harvester,
    given: &str,
    sysfs: &Path,
) -> (String, Option<VirtualMachineInstance>, Result<(), String>) {
    let vmis: Api<VirtualMachineInstance> =
        Api::namespaced(harvester.client.clone(), &harvester.namespace);
    match vmis.get_opt(given).await {
        Ok(Some(vmi)) => (given.to_string(), Some(vmi), Ok(())),
        Ok(None) => {
            let macs = local_macs(sysfs);
            match vmis.list(&Default::default()).await {
                Ok(list) => match vmi_by_mac(&list.items, &macs) {
                    Some(vmi) => (
                        vmi.metadata.name.clone().unwrap_or_default(),
                        Some(vmi.clone()),
                        Ok(()),
                    ),
                    None => {
                        tracing::warn!(
                            node = given,
                            ?macs,
                            "no VMI named {given} or with this machine's MAC addresses; using {given} as the node ID"
                        );
                        (given.to_string(), None, Ok(()))
                    }
                },
                Err(e) => {
                    tracing::warn!(
                        "listing VMIs for node discovery: {}; using {given}",
                        Describe(&e)
                    );
                    (given.to_string(), None, refused(&e, harvester, "list"))
                }
            }
        }
        Err(e) => {
            tracing::warn!(
                "getting VMI {given} for node discovery: {}; using {given}",
                Describe(&e)
            );
            (given.to_string(), None, refused(&e, harvester, "get"))
        }
    }
}

/// Node RPCs this driver implements.
pub const CAPABILITIES: [rpc::Type; 4] = [
    rpc::Type::StageUnstageVolume,
    rpc::Type::GetVolumeStats,
    rpc::Type::ExpandVolume,
    rpc::Type::VolumeCondition,
];

impl NodeService {
    /// Resolves the node ID as upstream does: the VMI named `given` (the hostname), else the VMI
    /// with one of this machine's MAC addresses, else `given` as it is; without a cloud-config,
    /// `given`.
    pub async fn start(harvester: Option<&Harvester>, given: &str, config: &Config) -> NodeService {
        let nfs = netns::choose(&netns::read(Path::new("/proc")), Path::new("/proc"));
        match nfs.warning {
            Some(w) => tracing::warn!(reason = nfs.reason, "{w}"),
            None => tracing::info!(netns = ?nfs.netns, reason = nfs.reason, "RWX (NFS) mounts"),
        }
        if config.kubelet_dir.is_none() {
            tracing::warn!(
                "--kubelet-dir is not set: staging and target paths anywhere on the node are accepted (upstream's behaviour); the chart sets it"
            );
        }
        let (node_id, vmi, discovery) = match harvester {
            Some(harvester) => discover(harvester, given, &config.sysfs_dir).await,
            None => {
                tracing::info!(
                    node = given,
                    "no Harvester credential: the node ID is the node's name, RWX volumes are mounted from the export ControllerPublishVolume passes"
                );
                (given.to_string(), None, Ok(()))
            }
        };
        let max_volumes = config
            .max_volumes_per_node
            .map(i64::from)
            .unwrap_or_else(|| max_volumes(vmi.as_ref()));
        NodeService {
            node_id,
            harvester: harvester.cloned(),
            nfs_mount_timeout: config.timeouts.nfs_mount,
            nfs_netns: nfs.netns,
            nfs_server_timeout: config.timeouts.nfs_server,
            statvfs_waiting: Default::default(),
            kubelet_dir: config.kubelet_dir.clone(),
            by_id: config.disk_by_id_dir.clone(),
            sysfs: config.sysfs_dir.clone(),
            device_wait: config.timeouts.device,
            max_volumes,
            inflight: InFlight::default(),
            paths: InFlight::default(),
            discovery,
        }
    }

    /// `Err` naming the cloud-config and the missing permission when Harvester refused the node
    /// ID lookup at start.
    pub fn discovery(&self) -> Result<(), String> {
        self.discovery.clone()
    }

    /// The node ID this plugin reports (the VM name).
    pub fn node_id(&self) -> String {
        self.node_id.clone()
    }

    fn begin(&self, volume: &str) -> Result<crate::inflight::Guard<'_>, NodeError> {
        self.inflight
            .begin(volume)
            .ok_or_else(|| NodeError::Busy(volume.to_string()))
    }

    /// Claims `path` for `volume`'s operation until the guard drops: a second volume's call on the
    /// same path meanwhile is ABORTED instead of stacking a second mount there.
    /// A staging or target path of a request: absolute and clean, and inside the kubelet's
    /// directory when `--kubelet-dir` names it.
    fn node_path(&self, field: &'static str, value: &str) -> Result<PathBuf, ArgError> {
        let path = request::node_path(field, value)?;
        paths::inside(field, &path, self.kubelet_dir.as_deref())?;
        Ok(path)
    }

    fn begin_path(
        &self,
        volume: &str,
        path: &Path,
    ) -> Result<crate::inflight::Guard<'_>, NodeError> {
        // The parent resolved, the last name as given: the same key before and after the
        // call creates the directory.
        let key = match (path.parent(), path.file_name()) {
            (Some(parent), Some(name)) => canonical(parent).join(name),
            _ => path.to_path_buf(),
        };
        self.paths
            .begin(&key.to_string_lossy())
            .ok_or_else(|| NodeError::PathBusy {
                path: key,
                volume: volume.to_string(),
            })
    }

    async fn find_disk(
        &self,
        volume: &str,
        ctx: &HashMap<String, String>,
    ) -> Result<PathBuf, NodeError> {
        let id = disk_id(volume, ctx);
        device::wait_for(volume, &self.by_id, &self.sysfs, &id, self.device_wait).await
    }

    async fn stage(
        &self,
        req: NodeStageVolumeRequest,
    ) -> Result<NodeStageVolumeResponse, NodeError> {
        let id = required("volume_id", &req.volume_id)?;
        let staging = self.node_path("staging_target_path", &req.staging_target_path)?;
        let cap = request::capability("volume_capability", req.volume_capability.as_ref())?;
        let _guard = self.begin(id)?;
        let _path = self.begin_path(id, &staging)?;
        // An RWX volume staged already (a kubelet restart re-sends NodeStage): its NFS mount is
        // recognised from mountinfo, before anything stats the path, which waits in the kernel
        // while the server is down. The kubelet's staging path is the volume's own.
        if cap.is_rwx() && nfs::nfs_mount_at(&mounts()?, &nfs::mount_key(&staging)).is_some() {
            return Ok(NodeStageVolumeResponse {});
        }
        not_a_symlink("staging_target_path", &staging)?;
        if !cap.is_block() {
            directory_or_nothing("staging_target_path", &staging)?;
        }
        if let (true, Access::Mount { flags, .. }) = (cap.is_rwx(), &cap.access) {
            self.stage_nfs(id, &staging, &req.publish_context, flags)
                .await?;
            return Ok(NodeStageVolumeResponse {});
        }
        let device = self.find_disk(id, &req.publish_context).await?;
        match &cap.access {
            // A block volume has nothing to stage: NodePublish binds the device itself.
            Access::Block => Ok(NodeStageVolumeResponse {}),
            Access::Mount { fs_type, flags } => {
                let fs = filesystem::by_name(fs_type).ok_or_else(|| ArgError::Invalid {
                    field: "volume_capability",
                    reason: format!("fs_type {fs_type} is not supported"),
                })?;
                self.stage_filesystem(&device, &staging, fs, flags, cap.read_only())
                    .await?;
                Ok(NodeStageVolumeResponse {})
            }
        }
    }

    /// Mounts `device` at `staging` with filesystem `fs`, formatting it only if it is blank.
    pub async fn stage_filesystem(
        &self,
        device: &Path,
        staging: &Path,
        fs: &dyn Filesystem,
        flags: &[String],
        read_only: bool,
    ) -> Result<(), NodeError> {
        std::fs::create_dir_all(staging).map_err(NodeError::io("creating", staging))?;
        let staging = canonical(staging);
        let want = device::rdev_of(device)?;
        if let Some(m) = mount_at(&mounts()?, &staging) {
            return if (m.major, m.minor) == want {
                Ok(())
            } else {
                Err(other_mount(&staging, m, device))
            };
        }
        let probe = run_any(&filesystem::probe_cmd(device)).await?;
        let probe = filesystem::classify(probe.code, &probe.stdout, &probe.stderr);
        match filesystem::prepare(&probe, fs.name()) {
            Prepare::Format => {
                let size = device::size_of(device)?;
                if size < fs.min_bytes() {
                    return Err(NodeError::TooSmall {
                        device: device.to_path_buf(),
                        size,
                        fs: fs.name(),
                        min: fs.min_bytes(),
                        min_mib: fs.min_bytes() >> 20,
                    });
                }
                tracing::info!(device = %device.display(), fs = fs.name(), "formatting blank device");
                run(&fs.format(device)).await?;
            }
            Prepare::Mount => {}
            Prepare::Refuse(reason) => {
                return Err(NodeError::WillNotFormat {
                    device: device.to_path_buf(),
                    reason,
                });
            }
        }
        let options = |flags: &[String]| {
            let mut options: Vec<String> =
                fs.mount_options().iter().map(|s| s.to_string()).collect();
            options.extend(flags.iter().cloned());
            if read_only {
                options.push("ro".into());
            }
            options
        };
        let refused = match run(&mount::mount_cmd(
            device,
            &staging,
            fs.name(),
            &options(flags),
        ))
        .await
        {
            Ok(_) => return Ok(()),
            Err(e) if flags.is_empty() => return Err(e),
            Err(e) => e,
        };
        // Whose fault? The same mount without the CO's flags tells: if it works, mount refused
        // the flags (a bad request), and the trial mount is undone.
        if run(&mount::mount_cmd(
            device,
            &staging,
            fs.name(),
            &options(&[]),
        ))
        .await
        .is_err()
        {
            return Err(refused);
        }
        mount::unmount_all(&staging).await?;
        let why = match &refused {
            NodeError::Command { stderr, .. } => stderr.clone(),
            other => other.to_string(),
        };
        Err(ArgError::Invalid {
            field: "volume_capability",
            reason: format!("mount refused mount_flags {flags:?}: {why}"),
        }
        .into())
    }

    async fn unstage(
        &self,
        req: NodeUnstageVolumeRequest,
    ) -> Result<NodeUnstageVolumeResponse, NodeError> {
        let id = required("volume_id", &req.volume_id)?;
        let staging = self.node_path("staging_target_path", &req.staging_target_path)?;
        let _guard = self.begin(id)?;
        let _path = self.begin_path(id, &staging)?;
        // An RWX volume's NFS mount: recognised from mountinfo before anything stats the path.
        let key = nfs::mount_key(&staging);
        if let Some(m) = nfs::nfs_mount_at(&mounts()?, &key).cloned() {
            self.unmount_nfs(id, &key, &m).await?;
            return Ok(NodeUnstageVolumeResponse {});
        }
        not_a_symlink("staging_target_path", &staging)?;
        if staging.exists() {
            mount::unmount_all(&staging).await?;
        }
        Ok(NodeUnstageVolumeResponse {})
    }

    async fn publish(
        &self,
        req: NodePublishVolumeRequest,
    ) -> Result<NodePublishVolumeResponse, NodeError> {
        let id = required("volume_id", &req.volume_id)?;
        let target = self.node_path("target_path", &req.target_path)?;
        let cap = request::capability("volume_capability", req.volume_capability.as_ref())?;
        let staging = self.node_path("staging_target_path", &req.staging_target_path)?;
        let read_only = req.readonly || cap.read_only();
        let _guard = self.begin(id)?;
        let _path = self.begin_path(id, &target)?;
        if let Some(staged) = nfs::nfs_mount_at(&mounts()?, &nfs::mount_key(&staging)).cloned() {
            // An RWX volume: the staging path and its bind are NFS mounts, never touched.
            return self
                .publish_nfs(id, &staging, &target, &staged, read_only)
                .await;
        }
        not_a_symlink("target_path", &target)?;
        let target = target.as_path();
        let source = match cap.access {
            Access::Mount { .. } => {
                directory_or_nothing("target_path", target)?;
                let staging = canonical(&staging);
                let all = mounts()?;
                let staged =
                    mount_at(&all, &staging)
                        .cloned()
                        .ok_or_else(|| NodeError::NotStaged {
                            volume: id.to_string(),
                            path: staging.clone(),
                        })?;
                std::fs::create_dir_all(target).map_err(NodeError::io("creating", target))?;
                if let Some(m) = mount_at(&all, &canonical(target)) {
                    return if (m.major, m.minor, &m.root)
                        == (staged.major, staged.minor, &staged.root)
                    {
                        republish(target, m, read_only).await
                    } else {
                        Err(other_mount(target, m, &staging))
                    };
                }
                staging
            }
            Access::Block => {
                let device = self.find_disk(id, &req.publish_context).await?;
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(NodeError::io("creating", parent))?;
                }
                match std::fs::symlink_metadata(target) {
                    Ok(m) if m.is_dir() => {
                        return Err(NodeError::Unsupported {
                            path: target.to_path_buf(),
                            reason:
                                "a block volume is published on a file, and this is a directory"
                                    .into(),
                        });
                    }
                    Ok(m) if m.is_file() && m.len() > 0 => {
                        return Err(ArgError::Invalid {
                            field: "target_path",
                            reason: format!(
                                "{} is a file holding {} bytes; a block volume is published on \
                                 an empty file, and this driver does not cover data",
                                target.display(),
                                m.len()
                            ),
                        }
                        .into());
                    }
                    Ok(_) => {}
                    Err(_) => {
                        std::fs::OpenOptions::new()
                            .create(true)
                            .truncate(false)
                            .write(true)
                            .open(target)
                            .map_err(NodeError::io("creating", target))?;
                    }
                }
                let all = mounts()?;
                if let Some(m) = mount_at(&all, &canonical(target)) {
                    return if device::rdev_of(target)? == device::rdev_of(&device)? {
                        republish(target, m, read_only).await
                    } else {
                        Err(other_mount(target, m, &device))
                    };
                }
                device
            }
        };
        run(&mount::bind_cmd(&source, target)).await?;
        if read_only {
            remount_read_only(target).await?;
        }
        Ok(NodePublishVolumeResponse {})
    }

    async fn unpublish(
        &self,
        req: NodeUnpublishVolumeRequest,
    ) -> Result<NodeUnpublishVolumeResponse, NodeError> {
        let id = required("volume_id", &req.volume_id)?;
        let target = self.node_path("target_path", &req.target_path)?;
        let _guard = self.begin(id)?;
        let _path = self.begin_path(id, &target)?;
        let key = nfs::mount_key(&target);
        if let Some(m) = nfs::nfs_mount_at(&mounts()?, &key).cloned() {
            self.unmount_nfs(id, &key, &m).await?;
        }
        not_a_symlink("target_path", &target)?;
        let target = target.as_path();
        match std::fs::symlink_metadata(target) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(NodeUnpublishVolumeResponse {});
            }
            Err(e) => return Err(NodeError::io("inspecting", target)(e)),
        }
        mount::unmount_all(target).await?;
        // What is left once unmounted: only an empty directory or an empty file (what publish
        // creates) is removed. Anything else is someone's data and stays where it is.
        let meta = match std::fs::symlink_metadata(target) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(NodeUnpublishVolumeResponse {});
            }
            Err(e) => return Err(NodeError::io("inspecting", target)(e)),
        };
        let removed = match removable(&meta) {
            Some(Removable::Dir) => std::fs::remove_dir(target),
            Some(Removable::EmptyFile) => std::fs::remove_file(target),
            None => {
                tracing::warn!(volume = id, target = %target.display(), "unpublished; left the target in place: it is not an empty directory or file");
                return Ok(NodeUnpublishVolumeResponse {});
            }
        };
        match removed {
            Ok(()) => Ok(NodeUnpublishVolumeResponse {}),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok(NodeUnpublishVolumeResponse {})
            }
            Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
                tracing::warn!(volume = id, target = %target.display(), "unpublished; left the target directory in place: it is not empty");
                Ok(NodeUnpublishVolumeResponse {})
            }
            Err(e) => Err(NodeError::io("removing", target)(e)),
        }
    }

    async fn stats(
        &self,
        req: NodeGetVolumeStatsRequest,
    ) -> Result<NodeGetVolumeStatsResponse, NodeError> {
        let id = required("volume_id", &req.volume_id)?;
        let path = published_path(&req.volume_path, self.kubelet_dir.as_deref())?;
        let key = nfs::mount_key(path);
        if let Some(m) = nfs::nfs_mount_at(&mounts()?, &key).cloned() {
            return self.stats_nfs(id, &key, &m).await;
        }
        let meta = std::fs::metadata(path).map_err(|_| NodeError::PathNotFound {
            path: path.to_path_buf(),
        })?;
        let all = mounts()?;
        let Some(m) = mount_at(&all, &canonical(path)) else {
            return Ok(NodeGetVolumeStatsResponse {
                usage: Vec::new(),
                volume_condition: Some(abnormal(format!(
                    "nothing is mounted at {}: the volume's mount is gone",
                    path.display()
                ))),
            });
        };
        if !meta.is_dir() {
            let total = device::size_of(path)?;
            return Ok(NodeGetVolumeStatsResponse {
                usage: vec![usage(volume_usage::Unit::Bytes, total, 0, 0)],
                volume_condition: Some(normal()),
            });
        }
        let st = rustix::fs::statvfs(path).map_err(|e| NodeError::io("statvfs", path)(e.into()))?;
        let condition = match device::device_of_mount(&self.sysfs, m) {
            // An NFS mount below the path (stats_nfs takes the mount points themselves).
            _ if m.fs_type.starts_with("nfs") => normal(),
            Some(dev) if dev.exists() => normal(),
            _ => abnormal(format!(
                "the device behind {} ({}:{}, {}) is gone",
                path.display(),
                m.major,
                m.minor,
                m.source
            )),
        };
        Ok(NodeGetVolumeStatsResponse {
            usage: filesystem_usage(&st),
            volume_condition: Some(condition),
        })
    }

    async fn expand(
        &self,
        req: NodeExpandVolumeRequest,
    ) -> Result<NodeExpandVolumeResponse, NodeError> {
        let id = required("volume_id", &req.volume_id)?;
        let path = published_path(&req.volume_path, self.kubelet_dir.as_deref())?;
        let cap = req
            .volume_capability
            .as_ref()
            .map(|c| request::Capability::parse("volume_capability", c))
            .transpose()?;
        let (required_bytes, _) =
            request::range_bytes("capacity_range", req.capacity_range.as_ref())?;
        let meta = std::fs::metadata(path).map_err(|_| NodeError::PathNotFound {
            path: path.to_path_buf(),
        })?;
        let _guard = self.begin(id)?;
        let capacity = if !meta.is_dir() || cap.is_some_and(|c| c.is_block()) {
            // A block volume: the device already has its new size; nothing to grow.
            device::size_of(path)?
        } else {
            let mount_point = Some(req.staging_target_path.as_str())
                .filter(|s| request::path_problem(s).is_none() && Path::new(s).exists())
                .map(|s| canonical(Path::new(s)))
                .filter(|s| mount_at(&mounts().unwrap_or_default(), s).is_some())
                .unwrap_or_else(|| canonical(path));
            let all = mounts()?;
            let m = mount_at(&all, &mount_point).ok_or_else(|| NodeError::PathNotFound {
                path: mount_point.clone(),
            })?;
            let dev =
                device::device_of_mount(&self.sysfs, m).ok_or_else(|| NodeError::Unsupported {
                    path: mount_point.clone(),
                    reason: format!("no block device for {}:{} ({})", m.major, m.minor, m.source),
                })?;
            let fs = filesystem::by_name(&m.fs_type).ok_or_else(|| NodeError::Unsupported {
                path: mount_point.clone(),
                reason: format!("cannot grow a {} filesystem", m.fs_type),
            })?;
            let size = device::size_of(&dev)?;
            if size < required_bytes {
                return Err(NodeError::Unsupported {
                    path: dev,
                    reason: format!(
                        "the disk is {size} bytes, less than the {required_bytes} asked for; \
                         the Harvester volume has not grown yet"
                    ),
                });
            }
            run(&fs.grow(&dev, &mount_point)).await?;
            tracing::info!(volume = id, device = %dev.display(), size, "grew {} filesystem", fs.name());
            size
        };
        Ok(NodeExpandVolumeResponse {
            capacity_bytes: i64::try_from(capacity).unwrap_or(i64::MAX),
        })
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("NodeStageVolume", &id, self.stage(req)).await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("NodeUnstageVolume", &id, self.unstage(req)).await
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("NodePublishVolume", &id, self.publish(req)).await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("NodeUnpublishVolume", &id, self.unpublish(req)).await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("NodeGetVolumeStats", &id, self.stats(req)).await
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = req.volume_id.clone();
        rpc("NodeExpandVolume", &id, self.expand(req)).await
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: CAPABILITIES
                .iter()
                .map(|t| NodeServiceCapability {
                    r#type: Some(node_service_capability::Type::Rpc(
                        node_service_capability::Rpc { r#type: *t as i32 },
                    )),
                })
                .collect(),
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: self.max_volumes,
            accessible_topology: None,
        }))
    }
}
