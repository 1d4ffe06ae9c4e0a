//! Longhorn's part: every Harvester PVC gets a backing volume and is marked Bound. As root the
//! volume is a sparse file on a loop device (a real block device); otherwise only the sparse file,
//! so tests that need a device must run as root and check for `/dev/loop*`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use harvester_common::harvester::VirtualMachineInstance;
use harvester_common::quantity;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::Event;
use serde_json::json;

use crate::BedError;
use crate::real::vm::Vm;

#[derive(Clone, Debug)]
pub struct Backing {
    pub file: PathBuf,
    /// `/dev/loopN` as root, otherwise the file itself.
    pub device: PathBuf,
    pub size: u64,
}

pub struct Storage {
    dir: PathBuf,
    use_loop: bool,
    volumes: Mutex<HashMap<String, Backing>>,
    /// Claims hot-plugged into a real VM: claim key -> (the VM, QMP node name), so a size
    /// increase also grows the disk the guest sees (QMP `block_resize`).
    plugged: Mutex<HashMap<String, (Arc<Vm>, String)>>,
    /// Claims a share manager has served (RWX): Longhorn grows them only through
    /// networkfs-manager's expander ([`super::networkfs`]), never here.
    shared: Mutex<HashSet<String>>,
}

fn key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

fn run(cmd: &mut Command) -> Result<String, BedError> {
    let out = cmd
        .output()
        .map_err(|e| BedError::Storage(format!("running {cmd:?}: {e}")))?;
    if !out.status.success() {
        return Err(BedError::Storage(format!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn is_root() -> bool {
    // The effective uid of /proc/self is ours.
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

impl Storage {
    pub fn new(dir: &Path) -> Result<Storage, BedError> {
        let dir = dir.join("volumes");
        std::fs::create_dir_all(&dir)
            .map_err(|e| BedError::Storage(format!("creating {}: {e}", dir.display())))?;
        Ok(Storage {
            dir,
            use_loop: is_root(),
            volumes: Mutex::new(HashMap::new()),
            plugged: Mutex::new(HashMap::new()),
            shared: Mutex::new(HashSet::new()),
        })
    }

    /// Claim `name` is plugged into VM `vm` as QMP node `node`.
    pub fn mark_plugged(&self, namespace: &str, name: &str, vm: Arc<Vm>, node: &str) {
        self.plugged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key(namespace, name), (vm, node.to_string()));
    }

    pub fn mark_unplugged(&self, namespace: &str, name: &str) {
        self.plugged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key(namespace, name));
    }

    /// Claim `name` is served by a share manager (an RWX volume): from now on a larger request
    /// is networkfs-manager's expander's to carry out, as upstream's `checkAndProcessExpand`.
    pub fn mark_shared(&self, namespace: &str, name: &str) {
        self.shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key(namespace, name));
    }

    fn is_shared(&self, namespace: &str, name: &str) -> bool {
        self.shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&key(namespace, name))
    }

    /// The VM and QMP node a claim is plugged into.
    fn plugged_into(&self, namespace: &str, name: &str) -> Option<(Arc<Vm>, String)> {
        self.plugged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key(namespace, name))
            .cloned()
    }

    pub fn uses_loop_devices(&self) -> bool {
        self.use_loop
    }

    /// The devices (loop devices when root) of every volume that exists now.
    pub fn devices(&self) -> Vec<PathBuf> {
        self.lock().values().map(|b| b.device.clone()).collect()
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Backing> {
        self.lock().get(&key(namespace, name)).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Backing>> {
        self.volumes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates the volume of `size` bytes, or grows it to `size` (never shrinks).
    pub fn ensure(&self, namespace: &str, name: &str, size: u64) -> Result<Backing, BedError> {
        let k = key(namespace, name);
        // Bind the lookup first: a guard in the `if let` scrutinee would live through the block
        // and deadlock the `insert` below (Rust 2024 keeps it until the end of the then-branch).
        let existing = self.lock().get(&k).cloned();
        if let Some(b) = existing {
            if size <= b.size {
                return Ok(b);
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&b.file)
                .map_err(|e| BedError::Storage(format!("opening {}: {e}", b.file.display())))?;
            f.set_len(size)
                .map_err(|e| BedError::Storage(format!("growing {}: {e}", b.file.display())))?;
            if self.use_loop {
                run(Command::new("losetup").arg("-c").arg(&b.device))?;
            }
            let grown = Backing { size, ..b };
            self.lock().insert(k, grown.clone());
            return Ok(grown);
        }
        let file = self.dir.join(format!("{namespace}_{name}.img"));
        let f = std::fs::File::create(&file)
            .map_err(|e| BedError::Storage(format!("creating {}: {e}", file.display())))?;
        f.set_len(size)
            .map_err(|e| BedError::Storage(format!("sizing {}: {e}", file.display())))?;
        let device = if self.use_loop {
            PathBuf::from(run(Command::new("losetup")
                .args(["-f", "--show"])
                .arg(&file))?)
        } else {
            file.clone()
        };
        let b = Backing { file, device, size };
        self.lock().insert(k, b.clone());
        Ok(b)
    }

    /// Detaches and deletes the volume (idempotent).
    pub fn release(&self, namespace: &str, name: &str) {
        if let Some(b) = self.lock().remove(&key(namespace, name)) {
            detach(&b, self.use_loop);
        }
    }
}

fn detach(b: &Backing, use_loop: bool) {
    if use_loop && let Err(e) = run(Command::new("losetup").arg("-d").arg(&b.device)) {
        tracing::warn!("sim storage: {e}");
    }
    let _ = std::fs::remove_file(&b.file);
}

impl Drop for Storage {
    fn drop(&mut self) {
        for (_, b) in self.lock().drain() {
            detach(&b, self.use_loop);
        }
    }
}

/// Finalizer kube-apiserver's admission puts on every PVC; kube-controller-manager's
/// pvc-protection controller removes it once no pod uses the claim. The bed has no
/// controller-manager, so the stand-in plays that controller: a claim hot-plugged into a VMI
/// (whose hot-plug pod would use it) stays until it is unplugged.
pub const PVC_PROTECTION: &str = "kubernetes.io/pvc-protection";

/// Watches Harvester PVCs and VMIs: binds new claims, honours size increases, and frees deleted
/// claims once no VMI uses them.
pub async fn run_pvc_binder(client: kube::Client, storage: Arc<Storage>) {
    let pvcs: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let vmis: Api<VirtualMachineInstance> = Api::all(client.clone());
    let mut pvc_events = super::watch(pvcs);
    let mut vmi_events = super::watch(vmis);
    loop {
        tokio::select! {
            Some(ev) = pvc_events.next() => match ev {
                Ok(Event::Apply(pvc) | Event::InitApply(pvc)) => {
                    if let Err(e) = reconcile_pvc(&client, &pvc, &storage).await {
                        tracing::warn!("sim storage: {e}");
                    }
                }
                Ok(Event::Delete(pvc)) => {
                    storage.release(&pvc.namespace().unwrap_or_default(), &pvc.name_any());
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("sim storage watch: {e}"),
            },
            Some(ev) = vmi_events.next() => {
                // A VMI changed or went: a terminating claim it held may be free now.
                let ns = match &ev {
                    Ok(Event::Apply(v) | Event::Delete(v)) => v.namespace(),
                    _ => None,
                };
                if let Some(ns) = ns && let Err(e) = release_terminating(&client, &ns, &storage).await {
                    tracing::warn!("sim storage: {e}");
                }
            },
            else => return,
        }
    }
}

async fn release_terminating(
    client: &kube::Client,
    ns: &str,
    storage: &Storage,
) -> Result<(), BedError> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    for pvc in pvcs.list(&Default::default()).await?.items {
        if pvc.metadata.deletion_timestamp.is_some() {
            reconcile_pvc(client, &pvc, storage).await?;
        }
    }
    Ok(())
}

/// Whether a VMI in the claim's namespace mounts it (its hot-plug pod would hold it).
async fn in_use(client: &kube::Client, ns: &str, claim: &str) -> Result<bool, BedError> {
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), ns);
    Ok(vmis
        .list(&Default::default())
        .await?
        .items
        .iter()
        .any(|vmi| {
            vmi.spec.volumes.iter().any(|v| {
                v.persistent_volume_claim
                    .as_ref()
                    .is_some_and(|p| p.claim_name == claim)
            })
        }))
}

async fn reconcile_pvc(
    client: &kube::Client,
    pvc: &PersistentVolumeClaim,
    storage: &Storage,
) -> Result<(), BedError> {
    let ns = pvc.namespace().unwrap_or_default();
    let name = pvc.name_any();
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    if pvc.metadata.deletion_timestamp.is_none() {
        return bind(&api, pvc, storage).await;
    }
    if !pvc.finalizers().iter().any(|f| f == PVC_PROTECTION) || in_use(client, &ns, &name).await? {
        return Ok(());
    }
    let rest: Vec<&String> = pvc
        .finalizers()
        .iter()
        .filter(|f| *f != PVC_PROTECTION)
        .collect();
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(
            json!({"metadata": {"finalizers": rest, "resourceVersion": pvc.resource_version()}}),
        ),
    )
    .await?;
    Ok(())
}

async fn bind(
    api: &Api<PersistentVolumeClaim>,
    pvc: &PersistentVolumeClaim,
    storage: &Storage,
) -> Result<(), BedError> {
    let ns = pvc.metadata.namespace.clone().unwrap_or_default();
    let name = pvc.metadata.name.clone().unwrap_or_default();
    let requested = requested_quantity(pvc);
    let Some(size) = quantity::to_bytes(&requested) else {
        return Err(BedError::Storage(format!(
            "PVC {ns}/{name}: spec.resources.requests.storage {requested:?} is not a quantity"
        )));
    };
    let status = pvc.status.clone().unwrap_or_default();
    let current = capacity_bytes(pvc);
    let bound = status.phase.as_deref() == Some("Bound");
    if bound && current.is_some_and(|c| c >= size) && storage.get(&ns, &name).is_some() {
        return Ok(());
    }
    if bound && storage.is_shared(&ns, &name) {
        // An RWX volume grows while its share manager serves it: the expander does it.
        return Ok(());
    }
    let before = storage.get(&ns, &name).map(|b| b.size);
    let backing = storage.ensure(&ns, &name, size)?;
    if before.is_some_and(|b| b < backing.size)
        && let Some((vm, node)) = storage.plugged_into(&ns, &name)
    {
        // The loop device has grown (losetup -c); QEMU and the guest learn it from block_resize.
        vm.resize(&node, backing.size).await?;
    }
    let access_modes = pvc.spec.as_ref().and_then(|s| s.access_modes.clone());
    if pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_none_or(str::is_empty)
    {
        // kube-controller-manager's PV binder names the claim's volume (`pvc-<claim UID>` for a
        // provisioned one); networkfs-manager and the CSI driver find the NetworkFilesystem by it.
        let uid = pvc.metadata.uid.clone().unwrap_or_default();
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"volumeName": format!("pvc-{uid}")}})),
        )
        .await?;
    }
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Bound",
            "accessModes": access_modes,
            "capacity": {"storage": quantity::from_bytes(backing.size)},
        }})),
    )
    .await?;
    Ok(())
}

/// A claim's `spec.resources.requests.storage` as written (empty when unset).
pub(crate) fn requested_quantity(pvc: &PersistentVolumeClaim) -> String {
    pvc.spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .map(|q| q.0.clone())
        .unwrap_or_default()
}

/// A claim's `status.capacity.storage` in bytes.
pub(crate) fn capacity_bytes(pvc: &PersistentVolumeClaim) -> Option<u64> {
    pvc.status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .and_then(|c| c.get("storage"))
        .and_then(|q| quantity::to_bytes(&q.0))
}

/// The backing of PVC `ns/name` once the storage stand-in has created it.
pub(crate) async fn backing(storage: &Storage, ns: &str, name: &str) -> Result<Backing, String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(b) = storage.get(ns, name) {
            return Ok(b);
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("PVC {ns}/{name} never got a volume"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Writes what the device's buffers hold to its backing file (loop devices only).
pub(crate) fn flush(b: &Backing) {
    if b.device != b.file {
        let _ = Command::new("blockdev")
            .arg("--flushbufs")
            .arg(&b.device)
            .status();
    }
}

/// Copies `data` (a snapshot's or a source volume's) onto the start of the volume's backing file (never truncating it),
/// then drops the device's stale buffers.
pub(crate) fn write_over(data: &Path, b: &Backing) -> Result<(), String> {
    let mut src =
        std::fs::File::open(data).map_err(|e| format!("opening {}: {e}", data.display()))?;
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .open(&b.file)
        .map_err(|e| format!("opening {}: {e}", b.file.display()))?;
    std::io::copy(&mut src, &mut dst)
        .map_err(|e| format!("restoring into {}: {e}", b.file.display()))?;
    dst.sync_all().map_err(|e| e.to_string())?;
    flush(b);
    Ok(())
}

/// Set on a PVC cloned from another (its `dataSource` a PersistentVolumeClaim) once the
/// source's data is in place (value: the source PVC).
pub const CLONED_ANNOTATION: &str = "sim.harvesterhci.io/cloned-from";
const WAIT: Duration = Duration::from_secs(60);

/// Longhorn's clone: the source volume's data, as it is now, copied onto the new volume once
/// both exist; then the PVC is annotated [`CLONED_ANNOTATION`]. Like the snapshot restore, the
/// storage stand-in binds the clone at once and the copy follows within milliseconds.
pub async fn clone_volume(
    client: kube::Client,
    storage: Arc<Storage>,
    pvc: PersistentVolumeClaim,
    source: String,
) -> Result<(), String> {
    let ns = pvc.namespace().unwrap_or_default();
    let name = pvc.name_any();
    let from = backing(&storage, &ns, &source).await?;
    let to = backing(&storage, &ns, &name).await?;
    tokio::task::spawn_blocking(move || {
        // Whatever the source's device buffers hold belongs to the copy.
        flush(&from);
        write_over(&from.file, &to)
    })
    .await
    .map_err(|e| e.to_string())??;
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client, &ns);
    let patch = json!({"metadata": {"annotations": {CLONED_ANNOTATION: source}}});
    api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| format!("annotating cloned PVC {ns}/{name}: {e}"))?;
    Ok(())
}
