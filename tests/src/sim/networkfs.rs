//! harvester/networkfs-manager's part, with Longhorn's share manager behind it: a watch on
//! NetworkFilesystems. `desiredState: Enabled` -> the volume's backing device (the storage
//! stand-in's loop device of the host PVC whose `spec.volumeName` is the CR's name) is formatted
//! once (ext4, as the share manager formats a new RWX volume), mounted on the host and exported by
//! the real NFS server ([`crate::nfs::NfsServer`]) as `/<name>`; the status goes
//! `Enabling` -> `Enabled` with `status: Ready`, `endpoint` and `mountOpts` (field names and
//! values as upstream's `pkg/controller/networkfilesystem/controller.go`). A new CR first gets
//! upstream's initial status (`Disabled`, `Unknown`, `NFS`).
//!
//! Disabling is a state of its own, as upstream plays it (networkfs-manager v0.1.1,
//! 8d20f3e6679f0a0b484e16fbb8d05e086e183e09): `desiredState: Disabled` clears the Longhorn
//! VolumeAttachment tickets and writes only `state: Disabling` (status and endpoint stay as they
//! were, `disableNetworkFS`); the share manager stops (the export goes at once here) and, after
//! [`NetworkFs::set_disable_delay`], is Stopped; only then, and only if `desiredState` is still
//! Disabled, the CR becomes `Disabled`, `NotReady`, endpoint and `mountOpts` cleared, with the
//! `NotReady` condition "ShareManager is stopped" (`pkg/controller/sharemanager/controller.go`
//! `OnShareManagerChange`). `desiredState: Enabled` while Disabling fails as `enableNetworkFS`
//! does: "wait the share manager <name> to be running" while it stops, "wait the previous
//! operation (disable) to finish on <name>" once it has stopped; upstream's handler returns the
//! error (logged and requeued; nothing is written to the CR), which the stand-in keeps in
//! [`NetworkFs::errors`]. Nothing moves such a CR on any more: it stays `Disabling`.
//!
//! Not played: `Expanding` (networkfs-manager b9addbdce76c2317c828ec7ac84c472b6f7a96b4
//! `checkAndProcessExpand`, an Enabled CR whose PVC grows): the driver does not expand RWX
//! volumes (ControllerExpand is FAILED_PRECONDITION); the driver's reading of an `Expanding`
//! status is unit-tested (`harvester_common::harvester::networkfs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs::{
    ENDPOINT_READY, NAMESPACE, STATE_DISABLED, STATE_DISABLING, STATE_ENABLED, STATE_ENABLING,
};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use serde_json::json;

use super::storage::{Storage, backing};
use crate::BedError;
use crate::nfs::NfsServer;

/// Longhorn's share manager of one volume, as networkfs-manager sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareManager {
    Stopped,
    Running,
    /// Its tickets were cleared; it is Stopped after the disable delay.
    Stopping,
}

/// What the stand-in reports and where it keeps its mounts.
pub struct NetworkFs {
    pub nfs: Arc<NfsServer>,
    /// The address clients mount (`status.endpoint`): 10.0.2.2 for QEMU guests.
    pub endpoint: String,
    /// `<bed dir>/nfs/mnt/<name>`: the host mounts of exported volumes.
    mnt: PathBuf,
    disable_delay: Mutex<Duration>,
    mount_opts: Mutex<String>,
    share_managers: Mutex<HashMap<String, ShareManager>>,
    errors: Mutex<Vec<(String, String)>>,
}

/// How long a share manager takes to stop unless a test sets it: Longhorn deletes its Pod.
pub const DEFAULT_DISABLE_DELAY: Duration = Duration::from_secs(1);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NetworkFs {
    pub fn new(nfs: Arc<NfsServer>, endpoint: &str) -> NetworkFs {
        NetworkFs {
            mnt: nfs.dir.join("mnt"),
            nfs,
            endpoint: endpoint.to_string(),
            disable_delay: Mutex::new(DEFAULT_DISABLE_DELAY),
            mount_opts: Mutex::new(String::new()),
            share_managers: Mutex::default(),
            errors: Mutex::default(),
        }
    }

    /// How long CRs stay `Disabling` (the share manager stopping) from now on.
    pub fn set_disable_delay(&self, delay: Duration) {
        *lock(&self.disable_delay) = delay;
    }

    /// `status.mountOpts`: upstream copies the PV's `nfsOptions` volume attribute, which is
    /// usually not set, so it is empty unless a test sets it. Clients then mount with the CSI
    /// driver's `vers=4`, on the standard port, where [`NfsServer`] serves.
    pub fn set_mount_opts(&self, opts: &str) {
        *lock(&self.mount_opts) = opts.to_string();
    }

    pub fn mount_opts(&self) -> String {
        lock(&self.mount_opts).clone()
    }

    /// The share manager of volume `name` (Stopped when it never ran).
    pub fn share_manager(&self, name: &str) -> ShareManager {
        lock(&self.share_managers)
            .get(name)
            .copied()
            .unwrap_or(ShareManager::Stopped)
    }

    fn set_share_manager(&self, name: &str, sm: ShareManager) {
        lock(&self.share_managers).insert(name.to_string(), sm);
    }

    /// The errors upstream's handler returned for CR `name` (logged and requeued upstream; no
    /// trace on the CR), oldest first.
    pub fn errors(&self, name: &str) -> Vec<String> {
        lock(&self.errors)
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, e)| e.clone())
            .collect()
    }

    fn fail(&self, name: &str, error: String) {
        tracing::info!("sim networkfs: {name}: {error}");
        let mut errors = lock(&self.errors);
        if errors.last() != Some(&(name.to_string(), error.clone())) {
            errors.push((name.to_string(), error));
        }
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

/// `status.conditions` with `cond` replacing the one of its type, else appended (upstream's
/// `UpdateNetworkFSConds`).
fn with_condition(n: &NetworkFilesystem, cond: serde_json::Value) -> serde_json::Value {
    let mut conds: Vec<serde_json::Value> = n
        .status
        .as_ref()
        .and_then(|s| s.rest.get("conditions"))
        .and_then(|c| c.as_array())
        .cloned()
        .unwrap_or_default();
    match conds.iter_mut().find(|c| c["type"] == cond["type"]) {
        Some(c) => *c = cond,
        None => conds.push(cond),
    }
    serde_json::Value::Array(conds)
}

fn condition(type_: &str, reason: &str, message: &str) -> serde_json::Value {
    json!({"type": type_, "status": "True", "reason": reason, "message": message,
           "lastTransitionTime": jiff::Timestamp::now().to_string()})
}

async fn reconcile(
    client: &kube::Client,
    storage: &Storage,
    fs: &Arc<NetworkFs>,
    nfs_cr: &NetworkFilesystem,
) -> Result<(), BedError> {
    let name = nfs_cr.name_any();
    let ns = nfs_cr.namespace().unwrap_or_else(|| NAMESPACE.into());
    let api: Api<NetworkFilesystem> = Api::namespaced(client.clone(), &ns);
    let state = nfs_cr.state().to_string();
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
        // enableNetworkFS
        STATE_ENABLED => {
            let sm = fs.share_manager(&name);
            if state != STATE_ENABLING && sm == ShareManager::Stopped {
                if state != STATE_DISABLED {
                    fs.fail(
                        &name,
                        format!("wait the previous operation (disable) to finish on {name}"),
                    );
                    return Ok(());
                }
                return set_status(
                    &api,
                    &name,
                    json!({"state": STATE_ENABLING, "status": "NotReady", "type": "NFS"}),
                )
                .await;
            }
            match sm {
                ShareManager::Stopping => {
                    fs.fail(
                        &name,
                        format!("wait the share manager {name} to be running"),
                    );
                    return Ok(());
                }
                // The tickets set while Enabling start it: the volume mounted and exported.
                ShareManager::Stopped => start_share_manager(client, storage, fs, &name).await?,
                ShareManager::Running => {}
            }
            let opts = fs.mount_opts();
            set_status(
                &api,
                &name,
                json!({"state": STATE_ENABLED, "status": ENDPOINT_READY, "type": "NFS",
                       "endpoint": fs.endpoint,
                       "mountOpts": if opts.is_empty() { serde_json::Value::Null } else { json!(opts) },
                       "conditions": with_condition(nfs_cr, condition("Ready", "Endpoint is ready",
                           "Endpoint contains the corresponding address"))}),
            )
            .await
        }
        // disableNetworkFS: tickets cleared, only the state written.
        STATE_DISABLED => {
            if state == STATE_DISABLING {
                return Ok(());
            }
            // The share manager stops (a starting one too: its tickets are gone) and
            // Longhorn reports it Stopped after the delay.
            fs.set_share_manager(&name, ShareManager::Stopping);
            disable(fs, &name).await?;
            set_status(&api, &name, json!({"state": STATE_DISABLING})).await?;
            let delay = *lock(&fs.disable_delay);
            let (client, fs2, name2) = (client.clone(), fs.clone(), name.clone());
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                share_manager_stopped(&client, &fs2, &ns, &name2).await;
            });
            Ok(())
        }
        other => {
            tracing::warn!("sim networkfs: {ns}/{name}: unknown desiredState {other:?}");
            Ok(())
        }
    }
}

/// The tickets of an enabled CR: Longhorn attaches the volume and its share manager serves it.
async fn start_share_manager(
    client: &kube::Client,
    storage: &Storage,
    fs: &NetworkFs,
    name: &str,
) -> Result<(), BedError> {
    let pvc = claim_of(client, name).await?;
    let b = backing(
        storage,
        &pvc.namespace().unwrap_or_default(),
        &pvc.name_any(),
    )
    .await
    .map_err(BedError::Storage)?;
    let at = fs.host_mount(name);
    let device = b.device.clone();
    let at2 = at.clone();
    tokio::task::spawn_blocking(move || mount_volume(&device, &at2))
        .await
        .map_err(|e| BedError::Storage(e.to_string()))??;
    let nfs = fs.nfs.clone();
    let pseudo = name.to_string();
    tokio::task::spawn_blocking(move || nfs.export(&pseudo, &at))
        .await
        .map_err(|e| BedError::Storage(e.to_string()))??;
    fs.set_share_manager(name, ShareManager::Running);
    Ok(())
}

/// `OnShareManagerChange` for a share manager that has stopped: `Disabled` only if the CR is
/// `Disabling` with `desiredState: Disabled`; otherwise it is left as it is, for good.
async fn share_manager_stopped(client: &kube::Client, fs: &NetworkFs, ns: &str, name: &str) {
    if fs.share_manager(name) != ShareManager::Stopping {
        return;
    }
    fs.set_share_manager(name, ShareManager::Stopped);
    let api: Api<NetworkFilesystem> = Api::namespaced(client.clone(), ns);
    let Ok(Some(n)) = api.get_opt(name).await else {
        return;
    };
    if n.spec.desired_state != STATE_DISABLED || n.state() != STATE_DISABLING {
        tracing::info!(
            "sim networkfs: {name}: share manager stopped; left {:?} (desiredState {:?})",
            n.state(),
            n.spec.desired_state
        );
        return;
    }
    let status = json!({"state": STATE_DISABLED, "status": "NotReady", "type": "NFS",
        "endpoint": "", "mountOpts": null,
        "conditions": with_condition(&n, condition("NotReady", "ShareManager is stopped",
            "ShareManager is stopped, means the networkfs is disabled"))});
    if let Err(e) = set_status(&api, name, status).await {
        tracing::warn!("sim networkfs: {name}: {e}");
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
                lock(&fs.share_managers).remove(&n.name_any());
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
