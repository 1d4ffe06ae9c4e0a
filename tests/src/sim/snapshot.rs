//! The snapshot part of Harvester (external-snapshotter's controller plus Longhorn): a
//! `VolumeSnapshot` of a PVC gets a copy of the PVC's backing file and is marked `readyToUse`
//! with its `restoreSize`; a PVC whose `dataSource` is a VolumeSnapshot gets that copy written
//! onto its volume once the storage stand-in has created it, and is then annotated
//! [`RESTORED_ANNOTATION`]. A PVC whose `dataSource` is another PVC (a clone) gets the source
//! volume's data the same way ([`super::storage::clone_volume`]).
//!
//! Difference from Harvester, on purpose small: Longhorn binds a restored PVC only after the
//! restore, while here the storage stand-in binds it at once and the copy follows within
//! milliseconds. A test that stages a restored volume waits for [`RESTORED_ANNOTATION`] first.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use harvester_common::quantity;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::watcher::Event;
use serde_json::json;

use super::storage::{CLONED_ANNOTATION, Storage, backing, clone_volume, flush, write_over};

/// Set on a PVC restored from a snapshot once its data is in place (value: the snapshot).
pub const RESTORED_ANNOTATION: &str = "sim.harvesterhci.io/restored-from";

pub fn snapshot_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", "VolumeSnapshot"),
        "volumesnapshots",
    )
}

struct Ctx {
    client: kube::Client,
    storage: Arc<Storage>,
    dir: PathBuf,
    jobs: Arc<Jobs>,
}

impl Ctx {
    fn data_file(&self, ns: &str, snapshot: &str) -> PathBuf {
        self.dir.join(format!("{ns}_{snapshot}.img"))
    }
}

/// Where the stand-in keeps the data of VolumeSnapshot `ns/snapshot` (`bed_dir` = the bed's
/// directory): a snapshot it took, or a backup copy put there for a pre-provisioned content.
pub fn data_file(bed_dir: &std::path::Path, ns: &str, snapshot: &str) -> PathBuf {
    bed_dir
        .join("snapshots")
        .join(format!("{ns}_{snapshot}.img"))
}

pub fn snapshot_content_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", "VolumeSnapshotContent"),
        "volumesnapshotcontents",
    )
}

/// The stand-in's controller jobs in flight, one per key (also used by [`super::backup`]).
#[derive(Default)]
pub(crate) struct Jobs {
    busy: Mutex<HashSet<String>>,
}

impl Jobs {
    /// Runs `job` for `key` unless one is already running; its error is logged under `what`.
    pub(crate) fn once(
        self: &Arc<Self>,
        what: &'static str,
        key: String,
        job: impl Future<Output = Result<(), String>> + Send + 'static,
    ) {
        let fresh = self
            .busy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone());
        if !fresh {
            return;
        }
        let jobs = self.clone();
        tokio::spawn(async move {
            if let Err(e) = job.await {
                tracing::warn!("{what} {key}: {e}");
            }
            jobs.busy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
        });
    }
}

/// Watches VolumeSnapshots and PVCs on the Harvester API server until the bed stops.
pub async fn run(client: kube::Client, storage: Arc<Storage>, dir: PathBuf) {
    let dir = dir.join("snapshots");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!("sim snapshot: creating {}: {e}", dir.display());
        return;
    }
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        storage,
        dir,
        jobs: Arc::default(),
    });
    let snaps: Api<DynamicObject> = Api::all_with(client.clone(), &snapshot_resource());
    let pvcs: Api<PersistentVolumeClaim> = Api::all(client);
    let mut snap_events = super::watch(snaps);
    let mut pvc_events = super::watch(pvcs);
    loop {
        tokio::select! {
            Some(ev) = snap_events.next() => match ev {
                Ok(Event::Apply(s) | Event::InitApply(s)) => {
                    let ready = s.data.pointer("/status/readyToUse").and_then(|v| v.as_bool()) == Some(true);
                    if !ready && s.metadata.deletion_timestamp.is_none() {
                        let key = format!("snap/{}/{}", s.namespace().unwrap_or_default(), s.name_any());
                        ctx.jobs.once("sim snapshot", key, take(ctx.clone(), s));
                    }
                }
                Ok(Event::Delete(s)) => {
                    let _ = std::fs::remove_file(ctx.data_file(&s.namespace().unwrap_or_default(), &s.name_any()));
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("sim snapshot watch: {e}"),
            },
            Some(ev) = pvc_events.next() => match ev {
                Ok(Event::Apply(p) | Event::InitApply(p)) => {
                    let source = p.spec.as_ref().and_then(|s| s.data_source.as_ref())
                        .filter(|d| d.kind == "VolumeSnapshot").map(|d| d.name.clone());
                    let done = p.annotations().contains_key(RESTORED_ANNOTATION);
                    if let (Some(snapshot), false, None) = (source, done, &p.metadata.deletion_timestamp) {
                        let key = format!("restore/{}/{}", p.namespace().unwrap_or_default(), p.name_any());
                        ctx.jobs.once("sim snapshot", key, restore(ctx.clone(), p.clone(), snapshot));
                    }
                    let clone_of = p.spec.as_ref().and_then(|s| s.data_source.as_ref())
                        .filter(|d| d.kind == "PersistentVolumeClaim").map(|d| d.name.clone());
                    let cloned = p.annotations().contains_key(CLONED_ANNOTATION);
                    if let (Some(source), false, None) = (clone_of, cloned, &p.metadata.deletion_timestamp) {
                        let key = format!("clone/{}/{}", p.namespace().unwrap_or_default(), p.name_any());
                        let (client, storage) = (ctx.client.clone(), ctx.storage.clone());
                        ctx.jobs.once("sim snapshot", key, clone_volume(client, storage, p.clone(), source));
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("sim snapshot PVC watch: {e}"),
            },
            else => return,
        }
    }
}

async fn take(ctx: Arc<Ctx>, snap: DynamicObject) -> Result<(), String> {
    let ns = snap.namespace().unwrap_or_default();
    let name = snap.name_any();
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &ns, &snapshot_resource());
    if let Some(content) = snap
        .data
        .pointer("/spec/source/volumeSnapshotContentName")
        .and_then(|v| v.as_str())
    {
        return bind_content(&ctx, &api, &snap, content).await;
    }
    let Some(source) = snap
        .data
        .pointer("/spec/source/persistentVolumeClaimName")
        .and_then(|v| v.as_str())
        .map(str::to_string)
    else {
        let status = json!({"status": {"readyToUse": false, "error": {"message": "only PVC sources are simulated"}}});
        let _ = api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await;
        return Err(format!("VolumeSnapshot {ns}/{name} has no PVC source"));
    };
    let b = backing(&ctx.storage, &ns, &source).await?;
    let dest = ctx.data_file(&ns, &name);
    let copy = {
        let b = b.clone();
        let dest = dest.clone();
        tokio::task::spawn_blocking(move || {
            flush(&b);
            std::fs::copy(&b.file, &dest)
                .map_err(|e| format!("copying {} to {}: {e}", b.file.display(), dest.display()))
        })
    };
    copy.await.map_err(|e| e.to_string())??;
    let status = json!({"status": {
        "readyToUse": true,
        "restoreSize": quantity::from_bytes(b.size),
        "creationTime": jiff::Timestamp::now().to_string(),
        "boundVolumeSnapshotContentName": format!("snapcontent-{}", snap.uid().unwrap_or_default()),
    }});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|e| format!("marking VolumeSnapshot {ns}/{name} ready: {e}"))?;
    Ok(())
}

/// A VolumeSnapshot of a pre-provisioned VolumeSnapshotContent (a restore from a backup):
/// external-snapshotter's controller binds it once the content is ready to use, and it is ready
/// with the content's size. Its data must already be in [`data_file`].
async fn bind_content(
    ctx: &Ctx,
    api: &Api<DynamicObject>,
    snap: &DynamicObject,
    content: &str,
) -> Result<(), String> {
    let ns = snap.namespace().unwrap_or_default();
    let name = snap.name_any();
    let vscs: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &snapshot_content_resource());
    let vsc = vscs
        .get(content)
        .await
        .map_err(|e| format!("VolumeSnapshot {ns}/{name}: content {content}: {e}"))?;
    if vsc
        .data
        .pointer("/status/readyToUse")
        .and_then(|v| v.as_bool())
        != Some(true)
    {
        return Err(format!(
            "VolumeSnapshot {ns}/{name}: content {content} not ready yet"
        ));
    }
    let data = ctx.data_file(&ns, &name);
    let size = std::fs::metadata(&data)
        .map_err(|e| {
            format!(
                "VolumeSnapshot {ns}/{name}: no data at {}: {e}",
                data.display()
            )
        })?
        .len();
    let status = json!({"status": {
        "readyToUse": true,
        "restoreSize": quantity::from_bytes(size),
        "creationTime": jiff::Timestamp::now().to_string(),
        "boundVolumeSnapshotContentName": content,
    }});
    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(|e| format!("marking VolumeSnapshot {ns}/{name} ready: {e}"))?;
    Ok(())
}

async fn restore(
    ctx: Arc<Ctx>,
    pvc: PersistentVolumeClaim,
    snapshot: String,
) -> Result<(), String> {
    let ns = pvc.namespace().unwrap_or_default();
    let name = pvc.name_any();
    let data = ctx.data_file(&ns, &snapshot);
    if !data.exists() {
        return Err(format!(
            "PVC {ns}/{name}: snapshot {snapshot} has no data (not taken by the stand-in)"
        ));
    }
    let b = backing(&ctx.storage, &ns, &name).await?;
    tokio::task::spawn_blocking(move || write_over(&data, &b))
        .await
        .map_err(|e| e.to_string())??;
    let api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = json!({"metadata": {"annotations": {RESTORED_ANNOTATION: snapshot}}});
    api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| format!("annotating restored PVC {ns}/{name}: {e}"))?;
    Ok(())
}
