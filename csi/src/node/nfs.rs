//! NodeStage of RWX volumes, as upstream's `nodeStageRWXVolume`: the host PVC (volume ID) names
//! its PV (`spec.volumeName`); the NetworkFilesystem `harvester-system/<pv>` must be Ready; then
//! `mount.nfs <status.endpoint>:/<pv> <staging> -o <status.mountOpts | vers=4>`. NodePublish binds
//! the staging mount like any other (`super::NodeService::publish`), NodeUnstage unmounts it.
//!
//! The kernel's NFS client lives in the network namespace of the process that mounts: the mount
//! helper runs in the host's (`super::netns`: directly on host network as under our chart,
//! through `nsenter --net=/proc/1/ns/net` under upstream's chart, whose Pod has hostPID and its
//! own network), so a mount outlives the node plugin Pod. Unlike upstream (which enters the host's
//! mount namespace too), the helper stays in the plugin's mount namespace: the chart's
//! Bidirectional mount propagation carries the mount to the kubelet's staging path. And unlike
//! upstream, the mount has a deadline: an
//! unreachable endpoint makes `mount.nfs` retry for minutes (a hard mount, `retry=2` minutes by
//! default) or block in the kernel. The helper is run directly (not through `mount -t nfs`, whose
//! child would survive a kill), dies with the plugin, and is SIGKILLed at the deadline and reaped before the answer
//! ([`crate::Timeouts::nfs_mount`]); a mount that got through anyway is lazily unmounted; the answer is
//! UNAVAILABLE, which the CO retries. The CR's mount options are used as they are: soft mounts
//! and short timeouts would change how the volume behaves for its users, the deadline does not.
//!
//! The same holds once mounted: on a hard mount whose server is dead, `stat`, `statvfs` and
//! `umount` wait in the kernel until the server is back, and the node plugin serves everything
//! from one thread. So every node RPC (NodeStage and NodePublish re-sent after a kubelet
//! restart too) recognises an NFS mount from mountinfo alone (never touching the path), and
//! bounds what touches it (the bind of NodePublish among them) by
//! [`crate::Timeouts::nfs_server`]: statvfs runs on a blocking thread (one per path at a time:
//! a call while an earlier one still waits answers at once), the unmount in a child that is
//! SIGKILLed at the deadline, after which the mount is detached forced and lazily
//! (`umount -f -l`: MNT_FORCE | MNT_DETACH, which aborts the RPCs in flight and does not look
//! the path up through the server; also a child killed after 3 s, as tearing the client down
//! talks to the server too). Either way the answer is UNAVAILABLE naming the server.

use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_proto::csi::v1::{NodeGetVolumeStatsResponse, NodePublishVolumeResponse};

use harvester_common::cloud_config::Harvester;
use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs::{NAMESPACE, NfsSource};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::Api;

use super::NodeService;
use super::mount::{Cmd, MountInfo, canonical, mount_at, mounts, run_bounded};
use super::netns::NfsNetns;
use crate::error::{ArgError, NodeError};

/// What to mount (pure): the export and the CR's options (or `vers=4`), then the CO's mount
/// flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NfsMount {
    pub export: String,
    pub options: String,
}

pub fn plan(source: &NfsSource, flags: &[String]) -> NfsMount {
    let mut options = vec![source.options.clone()];
    options.extend(flags.iter().cloned());
    NfsMount {
        export: source.export.clone(),
        options: options.join(","),
    }
}

/// `mount.nfs <export> <staging> -o <options>` in the network namespace `netns` (util-linux
/// `nsenter --net=<path>`, which execs the helper: the kill reaches it), killed with the plugin.
pub fn mount_cmd(m: &NfsMount, staging: &Path, netns: &NfsNetns) -> Cmd {
    let cmd = match netns {
        NfsNetns::Own => Cmd::new("mount.nfs"),
        NfsNetns::Enter(ns) => {
            let mut net = std::ffi::OsString::from("--net=");
            net.push(ns);
            Cmd::new("nsenter").arg(net).arg("mount.nfs")
        }
    };
    cmd.arg(&m.export)
        .arg(staging)
        .arg("-o")
        .arg(&m.options)
        .dies_with_plugin()
}

/// The path mountinfo would show for `path`, without touching `path` itself (its parent
/// resolved, its last name as given): on a dead NFS mount, a `stat` of the mount point waits.
pub fn mount_key(path: &Path) -> PathBuf {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => canonical(parent).join(name),
        _ => path.to_path_buf(),
    }
}

/// The topmost mount at `key` if it is an NFS mount (pure).
pub fn nfs_mount_at<'a>(all: &'a [MountInfo], key: &Path) -> Option<&'a MountInfo> {
    mount_at(all, key).filter(|m| m.fs_type.starts_with("nfs"))
}

/// The server of an NFS source: `host:/export`, `[v6]:/export` (pure; the source as it is when
/// it has no `:/`).
pub fn server_of(source: &str) -> &str {
    let host = source.rsplit_once(":/").map_or(source, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Whether a mountinfo entry is an NFS mount of `export`.
fn is_nfs_of(m: &super::mount::MountInfo, export: &str) -> bool {
    m.fs_type.starts_with("nfs") && m.source == export
}

impl NodeService {
    /// NodePublish of an RWX volume staged at `staging` (NFS mount `staged`): the bind to
    /// `target`, judged from mountinfo alone and bounded by [`crate::Timeouts::nfs_server`] (a
    /// bind of a mount whose server is down waits in the kernel). Published already (a kubelet
    /// restart re-sends it): done, or finished read-only.
    pub(super) async fn publish_nfs(
        &self,
        id: &str,
        staging: &Path,
        target: &Path,
        staged: &MountInfo,
        read_only: bool,
    ) -> Result<NodePublishVolumeResponse, NodeError> {
        let key = mount_key(target);
        if let Some(m) = mount_at(&mounts()?, &key) {
            return if is_nfs_of(m, &staged.source) {
                super::paths::republish(target, m, read_only).await
            } else {
                Err(super::paths::other_mount(target, m, staging))
            };
        }
        super::paths::not_a_symlink("target_path", target)?;
        super::paths::directory_or_nothing("target_path", target)?;
        std::fs::create_dir_all(target).map_err(NodeError::io("creating", target))?;
        let source = mount_key(staging);
        let limit = self.nfs_server_timeout;
        if run_bounded(&super::mount::bind_cmd(&source, target), limit)
            .await?
            .is_none()
        {
            undo_mount(&target.to_path_buf()).await;
            return Err(self.server_down(id, staged, &source, "bind mount", ""));
        }
        if read_only {
            super::paths::remount_read_only(target).await?;
        }
        Ok(NodePublishVolumeResponse {})
    }

    /// NodeStage of an RWX volume `id` at `staging` (see the module doc): the export the
    /// publish context carries, else the one Harvester names (a volume attached by upstream's
    /// controller, with a node plugin that holds a cloud-config).
    pub(super) async fn stage_nfs(
        &self,
        id: &str,
        staging: &Path,
        context: &std::collections::HashMap<String, String>,
        flags: &[String],
    ) -> Result<(), NodeError> {
        let given = NfsSource::from_context(context).map_err(|reason| ArgError::Invalid {
            field: "publish_context",
            reason,
        })?;
        let source = match (given, &self.harvester) {
            (Some(source), _) => source,
            (None, Some(harvester)) => self.look_up_nfs(harvester, id).await?,
            // An NFS mount staged already was recognised before (`super::NodeService::stage`).
            (None, None) => {
                return Err(NodeError::NoNfsSource {
                    volume: id.to_string(),
                });
            }
        };
        let m = plan(&source, flags);
        std::fs::create_dir_all(staging).map_err(NodeError::io("creating", staging))?;
        let staging = canonical(staging);
        if let Some(existing) = mount_at(&mounts()?, &staging) {
            return if is_nfs_of(existing, &m.export) {
                Ok(())
            } else {
                Err(NodeError::OtherMount {
                    path: staging.clone(),
                    found: format!("{} ({})", existing.source, existing.fs_type),
                    wanted: m.export.clone(),
                })
            };
        }
        tracing::info!(volume = id, export = %m.export, options = %m.options, staging = %staging.display(), "mounting NFS");
        let failed = |reason: String| NodeError::NfsMount {
            volume: id.to_string(),
            export: m.export.clone(),
            path: staging.clone(),
            reason,
        };
        let limit = self.nfs_mount_timeout;
        let helper = mount_cmd(&m, &staging, &self.nfs_netns);
        match run_bounded(&helper, limit).await {
            Ok(Some(out)) if out.code == Some(0) => Ok(()),
            Ok(Some(out)) => {
                undo_mount(&staging).await;
                Err(failed(format!(
                    "mount.nfs exited {}: {}",
                    out.code.map_or("by a signal".into(), |c| c.to_string()),
                    out.stderr.trim()
                )))
            }
            Err(e) => Err(e),
            Ok(None) => {
                // run_bounded killed mount.nfs (SIGKILL) and reaped it.
                undo_mount(&staging).await;
                Err(failed(format!(
                    "no answer within {limit:?}; the mount helper was killed and nothing is left mounted"
                )))
            }
        }
    }
}

impl NodeService {
    /// The export of RWX volume `id` as Harvester names it: its host PVC's PV, whose
    /// NetworkFilesystem must serve.
    async fn look_up_nfs(&self, harvester: &Harvester, id: &str) -> Result<NfsSource, NodeError> {
        let namespace = &harvester.namespace;
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(harvester.client.clone(), namespace);
        let pvc = pvcs
            .get_opt(id)
            .await
            .map_err(NodeError::api(format!("getting PVC {namespace}/{id}")))?
            .ok_or_else(|| NodeError::VolumeNotFound {
                namespace: namespace.clone(),
                volume: id.to_string(),
            })?;
        let pv = pvc
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| NodeError::NotBound {
                volume: id.to_string(),
                reason: format!(
                    "PVC {namespace}/{id} has no spec.volumeName yet (not bound to a Longhorn volume)"
                ),
            })?;
        let nfs_api: Api<NetworkFilesystem> = Api::namespaced(harvester.client.clone(), NAMESPACE);
        let not_ready = |reason: String| NodeError::NfsNotReady {
            volume: id.to_string(),
            namespace: NAMESPACE.into(),
            name: pv.clone(),
            reason,
        };
        let nfs = nfs_api
            .get_opt(&pv)
            .await
            .map_err(NodeError::api(format!(
                "getting NetworkFilesystem {NAMESPACE}/{pv}"
            )))?
            .ok_or_else(|| {
                not_ready("it does not exist (ControllerPublishVolume enables it)".into())
            })?;
        nfs.source().map_err(not_ready)
    }

    fn server_down(
        &self,
        volume: &str,
        m: &MountInfo,
        path: &Path,
        what: &'static str,
        done: &'static str,
    ) -> NodeError {
        NodeError::NfsServerDown(Box::new(crate::error::NfsServerDown {
            volume: volume.to_string(),
            server: server_of(&m.source).to_string(),
            export: m.source.clone(),
            path: path.to_path_buf(),
            what,
            waited: self.nfs_server_timeout,
            done,
        }))
    }

    /// NodeGetVolumeStats of the NFS mount `m` at `key`: statvfs on a blocking thread, bounded.
    pub(super) async fn stats_nfs(
        &self,
        volume: &str,
        key: &Path,
        m: &MountInfo,
    ) -> Result<NodeGetVolumeStatsResponse, NodeError> {
        {
            let mut waiting = self
                .statvfs_waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if !waiting.insert(key.to_path_buf()) {
                return Err(self.server_down(
                    volume,
                    m,
                    key,
                    "statvfs",
                    "; an earlier statvfs of it is still waiting for the server",
                ));
            }
        }
        let waiting = self.statvfs_waiting.clone();
        let path = key.to_path_buf();
        let task = tokio::task::spawn_blocking(move || {
            let st = rustix::fs::statvfs(&path);
            waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&path);
            st
        });
        let st = match tokio::time::timeout(self.nfs_server_timeout, task).await {
            Ok(Ok(Ok(st))) => st,
            Ok(Ok(Err(e))) => return Err(NodeError::io("statvfs", key)(e.into())),
            Ok(Err(e)) => {
                self.statvfs_waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(key);
                return Err(NodeError::io("statvfs", key)(std::io::Error::other(
                    e.to_string(),
                )));
            }
            Err(_) => {
                tracing::warn!(volume, path = %key.display(), export = %m.source, "NFS server does not answer statvfs");
                return Err(self.server_down(volume, m, key, "statvfs", ""));
            }
        };
        Ok(NodeGetVolumeStatsResponse {
            usage: super::stats::filesystem_usage(&st),
            // The NFS server answered statvfs, so it serves.
            volume_condition: Some(super::normal()),
        })
    }

    /// Unmounts everything stacked at `key`, where the topmost mount is NFS mount `m`, each
    /// unmount a child bounded by `nfs_server`: past it the child is killed and the mount is
    /// detached forced and lazily, and the answer is UNAVAILABLE naming the server (the CO's
    /// retry finds nothing mounted).
    pub(super) async fn unmount_nfs(
        &self,
        volume: &str,
        key: &Path,
        m: &MountInfo,
    ) -> Result<(), NodeError> {
        let limit = self.nfs_server_timeout;
        for _ in 0..16 {
            if mount_at(&mounts()?, key).is_none() {
                return Ok(());
            }
            // `-i`: no umount.nfs helper, which would outlive a killed umount.
            let umount = Cmd::new("umount").arg("-i").arg(key).dies_with_plugin();
            match run_bounded(&umount, limit).await {
                Ok(Some(out)) if out.code == Some(0) => {}
                Ok(Some(out)) => {
                    return Err(NodeError::Command {
                        command: format!("umount -i {}", key.display()),
                        status: out
                            .code
                            .map_or("killed by a signal".into(), |c| format!("exit {c}")),
                        stderr: out.stderr.trim().to_string(),
                    });
                }
                Err(e) => return Err(e),
                Ok(None) => {
                    // run_bounded killed umount (SIGKILL) and reaped it.
                    tracing::warn!(volume, path = %key.display(), export = %m.source, "NFS server does not answer the unmount; detaching it forced and lazily");
                    let detached = detach(key, Duration::from_secs(3)).await;
                    return Err(self.server_down(
                        volume,
                        m,
                        key,
                        "the unmount",
                        if detached {
                            "; it was unmounted forced and lazily (umount -f -l): what the \
                             server had not written yet is lost"
                        } else {
                            "; the forced lazy unmount did not finish either"
                        },
                    ));
                }
            }
        }
        Err(NodeError::Unsupported {
            path: key.to_path_buf(),
            reason: "still mounted after 16 unmounts".into(),
        })
    }
}

/// `umount -i -c -f -l <key>` (MNT_FORCE | MNT_DETACH, the path not canonicalised, no helper)
/// in a child killed after `limit`: true once nothing is mounted at `key` any more. A child, not
/// a thread: detaching the last mount of the superblock tears the NFS client down in the
/// unmounting task (DESTROY_SESSION to the dead server), which waits too; a killed task aborts
/// those RPCs.
async fn detach(key: &Path, limit: Duration) -> bool {
    let umount = Cmd::new("umount")
        .arg("-i")
        .arg("-c")
        .arg("-f")
        .arg("-l")
        .arg(key)
        .dies_with_plugin();
    let out = run_bounded(&umount, limit).await;
    let gone = mounts().is_ok_and(|all| mount_at(&all, key).is_none());
    if !gone {
        tracing::warn!(path = %key.display(), "forced lazy unmount: {:?}", out.map(|r| r.map(|o| o.stderr)));
    }
    gone
}

/// Lazily unmounts whatever a killed or failed mount left at `path` (bounded: a lazy unmount
/// does not wait for the server).
async fn undo_mount(path: &PathBuf) {
    for _ in 0..4 {
        match mounts() {
            Ok(all) if mount_at(&all, path).is_some() => {}
            _ => return,
        }
        let umount = Cmd::new("umount").arg("-f").arg("-l").arg(path);
        match run_bounded(&umount, Duration::from_secs(10)).await {
            Ok(Some(out)) if out.code == Some(0) => {}
            other => {
                tracing::warn!(path = %path.display(), "lazy unmount after a failed NFS mount: {:?}", other.map(|r| r.map(|o| o.stderr)));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use harvester_common::harvester::networkfs::{NetworkFilesystemSpec, NetworkFilesystemStatus};

    fn nfs(status: &str, endpoint: &str, opts: Option<&str>) -> NetworkFilesystem {
        let mut n = NetworkFilesystem::new(
            "pvc-9",
            NetworkFilesystemSpec {
                network_fs_name: "pvc-9".into(),
                desired_state: "Enabled".into(),
                ..Default::default()
            },
        );
        n.status = Some(NetworkFilesystemStatus {
            endpoint: endpoint.into(),
            state: "Enabled".into(),
            status: status.into(),
            mount_opts: opts.map(str::to_string),
            ..Default::default()
        });
        n
    }

    #[test]
    fn the_export_is_the_endpoint_and_the_pv_with_upstreams_default_options() {
        // harvester-csi-driver pkg/csi/node_server.go nodeStageRWXVolume: `mountOpts := "vers=4"`
        // unless status.mountOpts is set; export `fmt.Sprintf("%s:/%s", endpoint, lhVolName)`.
        let m = plan(&nfs("Ready", "10.53.1.2", None).source().unwrap(), &[]);
        assert_eq!(m.export, "10.53.1.2:/pvc-9");
        assert_eq!(m.options, "vers=4");
        let m = plan(
            &nfs("Ready", "10.0.2.2", Some("vers=4,port=2050"))
                .source()
                .unwrap(),
            &["noatime".into()],
        );
        assert_eq!(m.options, "vers=4,port=2050,noatime");
        let cmd = mount_cmd(&m, Path::new("/s"), &NfsNetns::Own);
        assert_eq!(cmd.program, "mount.nfs");
        assert!(cmd.dies_with_plugin);
        assert_eq!(
            cmd.args,
            ["10.0.2.2:/pvc-9", "/s", "-o", "vers=4,port=2050,noatime"]
                .map(std::ffi::OsString::from)
                .to_vec()
        );
        // Under upstream's chart (hostPID, the Pod's own network): in the host's namespace.
        let host = NfsNetns::Enter(PathBuf::from("/proc/1/ns/net"));
        let cmd = mount_cmd(&m, Path::new("/s"), &host);
        assert_eq!(cmd.program, "nsenter");
        assert!(cmd.dies_with_plugin);
        assert_eq!(
            cmd.args,
            [
                "--net=/proc/1/ns/net",
                "mount.nfs",
                "10.0.2.2:/pvc-9",
                "/s",
                "-o",
                "vers=4,port=2050,noatime"
            ]
            .map(std::ffi::OsString::from)
            .to_vec()
        );
        let m = plan(&nfs("Ready", "fd00::5", None).source().unwrap(), &[]);
        assert_eq!(m.export, "[fd00::5]:/pvc-9");
    }

    #[test]
    fn an_endpoint_that_is_not_ready_is_unavailable_naming_the_cr() {
        let reason = nfs("NotReady", "", None).source().unwrap_err();
        let s = tonic::Status::from(NodeError::NfsNotReady {
            volume: "vol".into(),
            namespace: NAMESPACE.into(),
            name: "pvc-9".into(),
            reason,
        });
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert!(
            s.message().contains("harvester-system/pvc-9") && s.message().contains("NotReady"),
            "{}",
            s.message()
        );
    }

    #[test]
    fn without_an_export_or_a_credential_staging_fails_naming_the_way_out() {
        let s = tonic::Status::from(NodeError::NoNfsSource {
            volume: "vol".into(),
        });
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        assert!(
            s.message().contains("nfsExport") && s.message().contains("nodeCloudConfig"),
            "{}",
            s.message()
        );
    }

    #[test]
    fn the_server_is_named_from_the_mount_source() {
        assert_eq!(server_of("10.0.2.2:/pvc-1"), "10.0.2.2");
        assert_eq!(server_of("[fd00::5]:/pvc-1"), "fd00::5");
        assert_eq!(server_of("nfs.example:/a/b"), "nfs.example");
        assert_eq!(server_of("weird"), "weird");
        let all = super::super::mount::parse_mountinfo(
            "40 1 0:50 / /s rw - nfs4 10.0.2.2:/pvc-1 rw,vers=4.2\n\
             41 1 0:50 / /t rw - nfs4 10.0.2.2:/pvc-1 rw,vers=4.2\n\
             42 41 7:1 / /t rw - ext4 /dev/loop1 rw\n",
        );
        assert_eq!(
            nfs_mount_at(&all, Path::new("/s")).map(|m| m.source.as_str()),
            Some("10.0.2.2:/pvc-1")
        );
        assert!(
            nfs_mount_at(&all, Path::new("/t")).is_none(),
            "the topmost mount decides"
        );
        assert!(nfs_mount_at(&all, Path::new("/u")).is_none());
    }
}
