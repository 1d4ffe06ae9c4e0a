//! harvester/networkfs-manager's part, with Longhorn's share manager behind it: a watch on
//! NetworkFilesystems. `desiredState: Enabled` -> the volume's backing device (the storage
//! stand-in's loop device of the host PVC whose `spec.volumeName` is the CR's name) is formatted
//! once (ext4, as the share manager formats a new RWX volume), mounted on the host and exported by
//! the real NFS server ([`crate::nfs::NfsServer`]) as `/<name>`; the status goes
//! `Enabling` -> `Enabled` with `status: Ready`, `endpoint` and `mountOpts` (field names and
//! values as upstream's `pkg/controller/networkfilesystem/controller.go`). `Disabled` -> the
//! export is removed and the volume unmounted; status `Disabled`, `NotReady`. A new CR first gets
//! upstream's initial status (`Disabled`, `Unknown`, `NFS`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use futures::StreamExt;
use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs::{
    ENDPOINT_READY, NAMESPACE, STATE_DISABLED, STATE_ENABLED, STATE_ENABLING,
};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use serde_json::json;

use super::storage::{Storage, backing};
use crate::BedError;
use crate::nfs::NfsServer;

/// What the stand-in reports and where it keeps its mounts.
pub struct NetworkFs {
    pub nfs: Arc<NfsServer>,
    /// The address clients mount (`status.endpoint`): 10.0.2.2 for QEMU guests.
    pub endpoint: String,
    /// `<bed dir>/nfs/mnt/<name>`: the host mounts of exported volumes.
    mnt: PathBuf,
}

impl NetworkFs {
    pub fn new(nfs: Arc<NfsServer>, endpoint: &str) -> NetworkFs {
        NetworkFs {
            mnt: nfs.dir.join("mnt"),
            nfs,
            endpoint: endpoint.to_string(),
        }
    }

    /// `status.mountOpts`: NFSv4 on the server's port (the share manager serves on 2049, which
    /// needs no option; upstream copies the PV's `nfsOptions` here, else leaves it empty).
    pub fn mount_opts(&self) -> String {
        format!("vers=4,port={}", self.nfs.port)
    }

    /// Where volume `name` is mounted on the host while exported.
    pub fn host_mount(&self, name: &str) -> PathBuf {
        self.mnt.join(name)
    }
}

fn exec(cmd: &mut Command) -> Result<std::process::Output, BedError> {
    cmd.output()
        .map_err(|e| BedError::Storage(format!("running {cmd:?}: {e}")))
}

fn mounted(path: &Path) -> bool {
    let p = path.display().to_string();
    std::fs::read_to_string("/proc/self/mounts")
        .map(|m| m.lines().any(|l| l.split(' ').nth(1) == Some(p.as_str())))
        .unwrap_or(false)
}

/// Formats `device` with ext4 unless it holds something, then mounts it at `at`.
fn mount_volume(device: &Path, at: &Path) -> Result<(), BedError> {
    if mounted(at) {
        return Ok(());
    }
    std::fs::create_dir_all(at)
        .map_err(|e| BedError::Storage(format!("creating {}: {e}", at.display())))?;
    // blkid -p exits 2 when the device holds no signature at all.
    let probe = exec(Command::new("blkid").arg("-p").arg(device))?;
    if probe.status.code() == Some(2) {
        let out = exec(Command::new("mkfs.ext4").arg("-q").arg("-F").arg(device))?;
        if !out.status.success() {
            return Err(BedError::Storage(format!(
                "mkfs.ext4 {}: {}",
                device.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    let out = exec(Command::new("mount").arg(device).arg(at))?;
    if !out.status.success() {
        return Err(BedError::Storage(format!(
            "mount {} {}: {}",
            device.display(),
            at.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    // Clients write as root (no_root_squash) and as users: the share manager's export root is
    // world-writable too.
    let _ = exec(Command::new("chmod").arg("0777").arg(at));
    Ok(())
}

fn unmount_volume(at: &Path) {
    if mounted(at) {
        match exec(Command::new("umount").arg(at)) {
            Ok(o) if o.status.success() => {}
            Ok(o) => tracing::warn!(
                "sim networkfs: umount {}: {}",
                at.display(),
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => tracing::warn!("sim networkfs: {e}"),
        }
    }
    let _ = std::fs::remove_dir(at);
}

/// The host PVC bound to PV `pv` (`spec.volumeName`), in any namespace.
async fn claim_of(client: &kube::Client, pv: &str) -> Result<PersistentVolumeClaim, BedError> {
    let pvcs: Api<PersistentVolumeClaim> = Api::all(client.clone());
    pvcs.list(&Default::default())
        .await?
        .items
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.volume_name.as_deref()) == Some(pv))
        .ok_or_else(|| BedError::Storage(format!("no PVC is bound to PV {pv}")))
}

async fn set_status(
    api: &Api<NetworkFilesystem>,
    name: &str,
    status: serde_json::Value,
) -> Result<(), BedError> {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await?;
    Ok(())
}

async fn reconcile(
    client: &kube::Client,
    storage: &Storage,
    fs: &NetworkFs,
    nfs_cr: &NetworkFilesystem,
) -> Result<(), BedError> {
    let name = nfs_cr.name_any();
    let ns = nfs_cr.namespace().unwrap_or_else(|| NAMESPACE.into());
    let api: Api<NetworkFilesystem> = Api::namespaced(client.clone(), &ns);
    let state = nfs_cr
        .status
        .as_ref()
        .map(|s| s.state.clone())
        .unwrap_or_default();
    if nfs_cr.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    if state.is_empty() {
        return set_status(
            &api,
            &name,
            json!({"state": STATE_DISABLED, "status": "Unknown", "type": "NFS", "endpoint": ""}),
        )
        .await;
    }
    let desired = nfs_cr.spec.desired_state.as_str();
    if desired == state {
        return Ok(());
    }
    match desired {
        STATE_ENABLED => {
            if state != STATE_ENABLING {
                return set_status(
                    &api,
                    &name,
                    json!({"state": STATE_ENABLING, "status": "NotReady", "type": "NFS"}),
                )
                .await;
            }
            let pvc = claim_of(client, &name).await?;
            let b = backing(
                storage,
                &pvc.namespace().unwrap_or_default(),
                &pvc.name_any(),
            )
            .await
            .map_err(BedError::Storage)?;
            let at = fs.host_mount(&name);
            let device = b.device.clone();
            let at2 = at.clone();
            tokio::task::spawn_blocking(move || mount_volume(&device, &at2))
                .await
                .map_err(|e| BedError::Storage(e.to_string()))??;
            let nfs = fs.nfs.clone();
            let pseudo = name.clone();
            tokio::task::spawn_blocking(move || nfs.export(&pseudo, &at))
                .await
                .map_err(|e| BedError::Storage(e.to_string()))??;
            set_status(
                &api,
                &name,
                json!({"state": STATE_ENABLED, "status": ENDPOINT_READY, "type": "NFS",
                       "endpoint": fs.endpoint, "mountOpts": fs.mount_opts()}),
            )
            .await
        }
        STATE_DISABLED => {
            disable(fs, &name).await?;
            set_status(
                &api,
                &name,
                json!({"state": STATE_DISABLED, "status": "NotReady", "endpoint": ""}),
            )
            .await
        }
        other => {
            tracing::warn!("sim networkfs: {ns}/{name}: unknown desiredState {other:?}");
            Ok(())
        }
    }
}

async fn disable(fs: &NetworkFs, name: &str) -> Result<(), BedError> {
    let nfs = fs.nfs.clone();
    let pseudo = name.to_string();
    let at = fs.host_mount(name);
    tokio::task::spawn_blocking(move || {
        nfs.unexport(&pseudo)?;
        unmount_volume(&at);
        Ok::<_, BedError>(())
    })
    .await
    .map_err(|e| BedError::Storage(e.to_string()))?
}

/// The watch loop (runs until aborted): one CR at a time, as a controller's work queue would; a
/// failure is logged and retried with the CR as it is then, up to 30 times a second apart.
pub async fn run(client: kube::Client, storage: Arc<Storage>, fs: Arc<NetworkFs>) {
    let api: Api<NetworkFilesystem> = Api::all(client.clone());
    let mut events = watcher::watcher(api, watcher::Config::default()).boxed();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(Event::Apply(n) | Event::InitApply(n)) => {
                let name = n.name_any();
                let ns = n.namespace().unwrap_or_else(|| NAMESPACE.into());
                let api: Api<NetworkFilesystem> = Api::namespaced(client.clone(), &ns);
                let mut current = Some(n);
                for attempt in 0..30 {
                    let Some(n) = current.take() else { break };
                    match reconcile(&client, &storage, &fs, &n).await {
                        Ok(()) => break,
                        Err(e) => {
                            tracing::warn!("sim networkfs: {ns}/{name} (attempt {attempt}): {e}");
                            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                            current = api.get_opt(&name).await.ok().flatten();
                        }
                    }
                }
            }
            Ok(Event::Delete(n)) => {
                if let Err(e) = disable(&fs, &n.name_any()).await {
                    tracing::warn!("sim networkfs: {}: {e}", n.name_any());
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!("sim networkfs watch: {e}"),
        }
    }
}

impl Drop for NetworkFs {
    fn drop(&mut self) {
        self.nfs.stop();
        for name in self.nfs.exports() {
            unmount_volume(&self.host_mount(&name));
        }
    }
}
