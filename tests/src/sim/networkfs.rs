//! harvester/networkfs-manager's part, with Longhorn's share manager behind it: a watch on
//! NetworkFilesystems. `desiredState: Enabled` -> the volume's backing device (the storage
//! stand-in's loop device of the host PVC whose `spec.volumeName` is the CR's name) is formatted
//! once (ext4, as the share manager formats a new RWX volume), mounted on the host and exported by
//! the real NFS server ([`crate::real::nfs::NfsServer`]) as `/<name>`; the status goes
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
//! Expanding, as upstream plays it (networkfs-manager b9addbdce76c2317c828ec7ac84c472b6f7a96b4,
//! `pkg/controller/pvc/controller.go` `OnPVCChange` and `pkg/controller/networkfilesystem/
//! controller.go` `checkAndProcessExpand`): a watch on PVCs enqueues the CR named by a claim's
//! `spec.volumeName` when the claim's request differs from its capacity (`utils.PVCNeedExpand`)
//! or the CR is `Expanding`. An `Enabled` CR (desired state reached) whose claim needs expanding
//! gets `status: Expanding` and an expander Pod (a privileged Pod mounting the claim, so that
//! Longhorn grows the volume and the kubelet its filesystem); once the claim's capacity equals its
//! request, the Pod goes and the status is `Ready` again. The stand-in's expander, after
//! [`NetworkFs::set_expand_delay`], grows the backing volume and, online, the share manager's
//! filesystem, then writes the claim's capacity (the kubelet's part). Its failures are kept in
//! [`NetworkFs::errors`] and the CR stays `Expanding`. The share manager formats the volume with
//! the host StorageClass's `fsType` parameter (Longhorn's; ext4 when unset). Online ext4 growth
//! needs CAP_SYS_RESOURCE, which the test bed's host lacks (docs/testbed.md), so expansion
//! stories use `fsType: xfs`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs::{
    ENDPOINT_EXPANDING, ENDPOINT_READY, NAMESPACE, STATE_DISABLED, STATE_DISABLING, STATE_ENABLED,
    STATE_ENABLING,
};
use harvester_common::quantity;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::Event;
use serde_json::json;

use super::storage::{Storage, backing, capacity_bytes, requested_quantity};
use crate::BedError;
use crate::real::nfs::NfsServer;

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
    expand_delay: Mutex<Duration>,
    /// CRs whose expander Pod exists.
    expanders: Mutex<HashSet<String>>,
}

/// How long a share manager takes to stop unless a test sets it: Longhorn deletes its Pod.
pub const DEFAULT_DISABLE_DELAY: Duration = Duration::from_secs(1);

/// How long an expander takes to start unless a test sets it: a Pod is scheduled and started.
pub const DEFAULT_EXPAND_DELAY: Duration = Duration::from_secs(1);

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
            expand_delay: Mutex::new(DEFAULT_EXPAND_DELAY),
            expanders: Mutex::default(),
        }
    }

    /// How long expander Pods take before they grow anything, from now on.
    pub fn set_expand_delay(&self, delay: Duration) {
        *lock(&self.expand_delay) = delay;
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
fn mount_volume(device: &Path, at: &Path, fs_type: &str) -> Result<(), BedError> {
    if mounted(at) {
        return Ok(());
    }
    std::fs::create_dir_all(at)
        .map_err(|e| BedError::Storage(format!("creating {}: {e}", at.display())))?;
    // blkid -p exits 2 when the device holds no signature at all.
    let probe = exec(Command::new("blkid").arg("-p").arg(device))?;
    if probe.status.code() == Some(2) {
        let mkfs = format!("mkfs.{fs_type}");
        let force = if fs_type == "xfs" { "-f" } else { "-F" };
        let out = exec(Command::new(&mkfs).arg("-q").arg(force).arg(device))?;
        if !out.status.success() {
            return Err(BedError::Storage(format!(
                "{mkfs} {}: {}",
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
    storage: &Arc<Storage>,
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
        return check_and_process_expand(client, storage, fs, nfs_cr).await;
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
    let fs_type = fs_type_of(client, &pvc).await?;
    let at = fs.host_mount(name);
    let device = b.device.clone();
    let at2 = at.clone();
    tokio::task::spawn_blocking(move || mount_volume(&device, &at2, &fs_type))
        .await
        .map_err(|e| BedError::Storage(e.to_string()))??;
    let nfs = fs.nfs.clone();
    let pseudo = name.to_string();
    tokio::task::spawn_blocking(move || nfs.export(&pseudo, &at))
        .await
        .map_err(|e| BedError::Storage(e.to_string()))??;
    storage.mark_shared(&pvc.namespace().unwrap_or_default(), &pvc.name_any());
    fs.set_share_manager(name, ShareManager::Running);
    Ok(())
}

/// The filesystem Longhorn formats the volume with: its StorageClass's `fsType` parameter, ext4
/// when unset.
async fn fs_type_of(
    client: &kube::Client,
    pvc: &PersistentVolumeClaim,
) -> Result<String, BedError> {
    let class = pvc.spec.as_ref().and_then(|s| s.storage_class_name.clone());
    let Some(class) = class else {
        return Ok("ext4".into());
    };
    let sc = Api::<StorageClass>::all(client.clone())
        .get_opt(&class)
        .await?;
    let fs_type = sc
        .and_then(|sc| sc.parameters)
        .and_then(|p| p.get("fsType").cloned())
        .unwrap_or_else(|| "ext4".into());
    match fs_type.as_str() {
        "ext4" | "xfs" => Ok(fs_type),
        other => Err(BedError::Storage(format!(
            "StorageClass {class}: fsType {other:?} is not one Longhorn formats (ext4, xfs)"
        ))),
    }
}

/// `utils.PVCNeedExpand`: the request differs from the capacity (a claim without a capacity
/// needs expanding too, as upstream compares the quantities' values with 0 for a missing one).
fn need_expand(pvc: &PersistentVolumeClaim) -> bool {
    requested(pvc) != capacity_bytes(pvc).unwrap_or(0)
}

fn requested(pvc: &PersistentVolumeClaim) -> u64 {
    quantity::to_bytes(&requested_quantity(pvc)).unwrap_or(0)
}

/// `checkAndProcessExpand`: only an `Enabled` CR; `Expanding` with an expander while its claim
/// needs expanding, else the expander gone and `Ready`. Writes only a change.
async fn check_and_process_expand(
    client: &kube::Client,
    storage: &Arc<Storage>,
    fs: &Arc<NetworkFs>,
    nfs_cr: &NetworkFilesystem,
) -> Result<(), BedError> {
    let name = nfs_cr.name_any();
    if nfs_cr.state() != STATE_ENABLED {
        return Ok(());
    }
    // Upstream requeues while the claim is missing (it writes nothing either way); the stand-in's
    // one queue must not stall on a CR whose claim is gone.
    let Ok(pvc) = claim_of(client, &name).await else {
        return Ok(());
    };
    let api: Api<NetworkFilesystem> = Api::namespaced(
        client.clone(),
        &nfs_cr.namespace().unwrap_or_else(|| NAMESPACE.into()),
    );
    let status = nfs_cr
        .status
        .as_ref()
        .map(|s| s.status.as_str())
        .unwrap_or("");
    if need_expand(&pvc) {
        if status == ENDPOINT_EXPANDING {
            return Ok(());
        }
        start_expander(client, storage, fs, &name, &pvc);
        return set_status(&api, &name, json!({"status": ENDPOINT_EXPANDING})).await;
    }
    lock(&fs.expanders).remove(&name);
    if status == ENDPOINT_READY {
        return Ok(());
    }
    set_status(&api, &name, json!({"status": ENDPOINT_READY})).await
}

/// `createExpanderPodIfNeed`: one expander per CR. After the delay it grows the volume (Longhorn),
/// the share manager's filesystem online and then the claim's capacity (the kubelet, once
/// NodeExpandVolume is done).
fn start_expander(
    client: &kube::Client,
    storage: &Arc<Storage>,
    fs: &Arc<NetworkFs>,
    name: &str,
    pvc: &PersistentVolumeClaim,
) {
    if !lock(&fs.expanders).insert(name.to_string()) {
        return;
    }
    let (ns, claim, size) = (
        pvc.namespace().unwrap_or_default(),
        pvc.name_any(),
        requested(pvc),
    );
    let Some(backing) = storage.get(&ns, &claim) else {
        fs.fail(name, format!("expander: PVC {ns}/{claim} has no volume"));
        return;
    };
    let (client, storage, fs, name) = (
        client.clone(),
        storage.clone(),
        fs.clone(),
        name.to_string(),
    );
    tokio::spawn(async move {
        let delay = *lock(&fs.expand_delay);
        tokio::time::sleep(delay).await;
        let at = fs.host_mount(&name);
        let device = backing.device.clone();
        let (ns2, claim2) = (ns.clone(), claim.clone());
        let result = tokio::task::spawn_blocking(move || {
            storage.ensure(&ns2, &claim2, size)?;
            grow_filesystem(&device, &at, size)
        })
        .await
        .map_err(|e| BedError::Storage(e.to_string()))
        .and_then(|r| r);
        let result = match result {
            Ok(()) => Api::<PersistentVolumeClaim>::namespaced(client, &ns)
                .patch_status(
                    &claim,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"status": {"capacity": {"storage": quantity::from_bytes(size)}}}),
                    ),
                )
                .await
                .map(|_| ())
                .map_err(BedError::from),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            fs.fail(&name, format!("expander: {e}"));
            lock(&fs.expanders).remove(&name);
        }
    });
}

/// The size of the filesystem mounted at `at`, in bytes (`df`).
pub fn filesystem_size(at: &Path) -> Result<u64, BedError> {
    let df = exec(Command::new("df").args(["-B1", "--output=size"]).arg(at))?;
    String::from_utf8_lossy(&df.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| BedError::Storage(format!("df {}: {df:?}", at.display())))
}

/// Grows the filesystem mounted at `at` (on `device`) online to the device's size and checks it
/// got there: `xfs_growfs` for xfs, `resize2fs` for ext4 (which fails on a host without
/// CAP_SYS_RESOURCE, as the test bed's).
fn grow_filesystem(device: &Path, at: &Path, size: u64) -> Result<(), BedError> {
    let probe = exec(
        Command::new("blkid")
            .args(["-o", "value", "-s", "TYPE"])
            .arg(device),
    )?;
    let fs_type = String::from_utf8_lossy(&probe.stdout).trim().to_string();
    let out = match fs_type.as_str() {
        "xfs" => exec(Command::new("xfs_growfs").arg(at))?,
        _ => exec(Command::new("resize2fs").arg(device))?,
    };
    if !out.status.success() {
        return Err(BedError::Storage(format!(
            "growing {fs_type} on {}: {}",
            device.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let total = filesystem_size(at)?;
    // A filesystem's own metadata keeps its size under the device's (xfs: 576 of 640 MiB).
    if total < size / 10 * 8 {
        return Err(BedError::Storage(format!(
            "{fs_type} on {} is {total} bytes after growing it online, not about {size}",
            device.display()
        )));
    }
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

/// The watch loops (run until aborted): NetworkFilesystems, one CR at a time, as a controller's
/// work queue would (a failure is logged and retried with the CR as it is then, up to 30 times a
/// second apart); and PVCs, `OnPVCChange`, which enqueue their CR.
pub async fn run(client: kube::Client, storage: Arc<Storage>, fs: Arc<NetworkFs>) {
    let api: Api<NetworkFilesystem> = Api::all(client.clone());
    let mut events = super::watch(api);
    let claims: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let mut claim_events = super::watch(claims);
    loop {
        tokio::select! {
            Some(ev) = events.next() => match ev {
                Ok(Event::Apply(n) | Event::InitApply(n)) => {
                    handle(&client, &storage, &fs, n).await;
                }
                Ok(Event::Delete(n)) => {
                    lock(&fs.share_managers).remove(&n.name_any());
                    lock(&fs.expanders).remove(&n.name_any());
                    if let Err(e) = disable(&fs, &n.name_any()).await {
                        tracing::warn!("sim networkfs: {}: {e}", n.name_any());
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("sim networkfs watch: {e}"),
            },
            Some(ev) = claim_events.next() => {
                if let Ok(Event::Apply(pvc) | Event::InitApply(pvc)) = ev
                    && let Some(n) = on_pvc_change(&client, &pvc).await
                {
                    handle(&client, &storage, &fs, n).await;
                }
            },
            else => return,
        }
    }
}

/// `OnPVCChange`: the CR named by the claim's volume when the claim needs expanding or the CR
/// is `Expanding`.
async fn on_pvc_change(
    client: &kube::Client,
    pvc: &PersistentVolumeClaim,
) -> Option<NetworkFilesystem> {
    if pvc.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let pv = pvc
        .spec
        .as_ref()?
        .volume_name
        .as_deref()
        .filter(|v| !v.is_empty())?;
    let api: Api<NetworkFilesystem> = Api::namespaced(client.clone(), NAMESPACE);
    let n = api.get_opt(pv).await.ok().flatten()?;
    let expanding = n
        .status
        .as_ref()
        .is_some_and(|s| s.status == ENDPOINT_EXPANDING);
    (need_expand(pvc) || expanding).then_some(n)
}

/// One CR through [`reconcile`], retried as the work queue would.
async fn handle(
    client: &kube::Client,
    storage: &Arc<Storage>,
    fs: &Arc<NetworkFs>,
    n: NetworkFilesystem,
) {
    let name = n.name_any();
    let ns = n.namespace().unwrap_or_else(|| NAMESPACE.into());
    let api: Api<NetworkFilesystem> = Api::namespaced(client.clone(), &ns);
    let mut current = Some(n);
    for attempt in 0..30 {
        let Some(n) = current.take() else { break };
        match reconcile(client, storage, fs, &n).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!("sim networkfs: {ns}/{name} (attempt {attempt}): {e}");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                current = api.get_opt(&name).await.ok().flatten();
            }
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
