//! Harvester's remote-backup controllers (harvester/harvester `pkg/volumeremotebackup/`) and the
//! Longhorn backup target behind them, against the real Harvester API server, watch-driven:
//!
//! - a `VolumeRemoteBackup` copies its source PVC's volume (the loop device's backing file) into
//!   the backup target, a directory `backup-target/` under the bed dir, then gets the status
//!   Harvester writes: `handle`, `csiProvider`, `sourceSpec` (the source PVC's spec), `success`
//!   and a `Ready` condition. Deleting the VRB deletes its copy.
//! - a `VolumeRemoteRestore` goes as upstream's Longhorn restore operation
//!   (`pkg/volumeremotebackup/longhorn/restore.go`, v1.8.2): a cluster-scoped
//!   VolumeSnapshotContent of the backup's handle, a VolumeSnapshot bound to it and a PVC with
//!   `dataSource: VolumeSnapshot`, each named after the VRR (the content and snapshot annotated
//!   `harvesterhci.io/pvcrestore-ref`), the PVC built from the backup's `sourceSpec` and owned by
//!   the VRR (controller owner reference). The content is made ready to use here (Longhorn's CSI
//!   driver and the snapshotter sidecar), the backup copy is put where the snapshot stand-in
//!   ([`super::snapshot`]) restores the PVC from, and the VRR is marked `success` once the PVC is
//!   Bound and filled. The VolumeSnapshotClass is the one `csi-driver-config` names for the
//!   backup's `csiProvider` (upstream's default value when the setting is absent); a bed without
//!   that class uses the provider as the content's driver.
//! - the Harvester API server of the bed runs no garbage collector (no kube-controller-manager
//!   there), so when a VRR is deleted the stand-in deletes the PVCs it owns, as the collector
//!   would, and its VolumeSnapshot and VolumeSnapshotContent, as upstream's `Delete` and the
//!   snapshot controller do.
//!
//! Differences from Harvester, on purpose: a source PVC annotated [`BACKUP_DELAY_ANNOTATION`] (a
//! VRB annotated [`RESTORE_DELAY_ANNOTATION`]) makes its backups (restores from it) take that
//! long, so tests can see a backup or a restore that is still running. What Harvester's webhook
//! refuses is played by [`super::backup_validator`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::watcher::Event;
use serde_json::{Value, json};

use super::snapshot::{self, Jobs};
use super::storage::{Storage, backing, flush};

/// `driver.AnnotationPVCRestoreRef` (`pkg/volumeremotebackup/driver/driver.go`): `<ns>/<restore>`
/// on the VolumeSnapshotContent and VolumeSnapshot of a restore.
pub const ANN_PVC_RESTORE_REF: &str = "harvesterhci.io/pvcrestore-ref";
/// harvester/harvester `pkg/settings/settings.go` v1.8.2: the setting and its default.
const CSI_DRIVER_CONFIG: &str = "csi-driver-config";
const CSI_DRIVER_CONFIG_DEFAULT: &str = r#"{"driver.longhorn.io":{"volumeSnapshotClassName":"longhorn-snapshot","backupVolumeSnapshotClassName":"longhorn"}}"#;

/// On a source PVC: its backups take this many milliseconds before they succeed.
pub const BACKUP_DELAY_ANNOTATION: &str = "sim.harvesterhci.io/backup-delay-ms";
/// On a VolumeRemoteBackup: restores from it take this many milliseconds before they succeed.
pub const RESTORE_DELAY_ANNOTATION: &str = "sim.harvesterhci.io/restore-delay-ms";

fn delay(o: &impl kube::Resource, annotation: &str) -> Option<Duration> {
    o.annotations()
        .get(annotation)
        .and_then(|ms| ms.parse().ok())
        .map(Duration::from_millis)
}

pub fn backup_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("harvesterhci.io", "v1beta1", "VolumeRemoteBackup"),
        "volumeremotebackups",
    )
}

pub fn restore_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("harvesterhci.io", "v1beta1", "VolumeRemoteRestore"),
        "volumeremoterestores",
    )
}

/// The backup target's copy of VRB `ns/name`.
pub fn target_file(bed_dir: &std::path::Path, ns: &str, name: &str) -> PathBuf {
    bed_dir
        .join("backup-target")
        .join(format!("{ns}_{name}.img"))
}

struct Ctx {
    client: kube::Client,
    storage: Arc<Storage>,
    dir: PathBuf,
}

fn succeeded(o: &DynamicObject) -> bool {
    o.data.pointer("/status/success").and_then(Value::as_bool) == Some(true)
}

fn key(kind: &str, o: &DynamicObject) -> String {
    format!(
        "{kind}/{}/{}",
        o.namespace().unwrap_or_default(),
        o.name_any()
    )
}

/// Watches VolumeRemoteBackups and VolumeRemoteRestores until the bed stops.
pub async fn run(client: kube::Client, storage: Arc<Storage>, dir: PathBuf) {
    if let Err(e) = std::fs::create_dir_all(dir.join("backup-target")) {
        tracing::warn!("sim backup: creating the backup target: {e}");
        return;
    }
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        storage,
        dir,
    });
    let jobs = Arc::new(Jobs::default());
    let vrbs: Api<DynamicObject> = Api::all_with(client.clone(), &backup_resource());
    let vrrs: Api<DynamicObject> = Api::all_with(client, &restore_resource());
    let mut vrb_events = super::watch(vrbs);
    let mut vrr_events = super::watch(vrrs);
    loop {
        tokio::select! {
            Some(ev) = vrb_events.next() => match ev {
                Ok(Event::Apply(b) | Event::InitApply(b)) => {
                    if !succeeded(&b) && b.metadata.deletion_timestamp.is_none() {
                        jobs.once("sim backup", key("vrb", &b), back_up(ctx.clone(), b));
                    }
                }
                Ok(Event::Delete(b)) => {
                    let _ = std::fs::remove_file(target_file(&ctx.dir, &b.namespace().unwrap_or_default(), &b.name_any()));
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("sim backup watch: {e}"),
            },
            Some(ev) = vrr_events.next() => match ev {
                Ok(Event::Apply(r) | Event::InitApply(r)) => {
                    if !succeeded(&r) && r.metadata.deletion_timestamp.is_none() {
                        jobs.once("sim restore", key("vrr", &r), restore(ctx.clone(), r));
                    }
                }
                Ok(Event::Delete(r)) => {
                    jobs.once("sim restore", key("gc", &r), collect_garbage(ctx.clone(), r));
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("sim restore watch: {e}"),
            },
            else => return,
        }
    }
}

/// The status Harvester's operator writes (`SetReady` / `SetError`): `Ready` condition plus the
/// given fields, written with a plain patch (the CRDs have no status subresource); not written
/// again when `obj` already has that condition (no watch event, so no loop on a lasting error).
async fn set_status(
    api: &Api<DynamicObject>,
    obj: &DynamicObject,
    mut status: Value,
    ready: Result<(), &str>,
) -> Result<(), String> {
    let name = obj.name_any();
    let (cond, message) = match ready {
        Ok(()) => ("True", "Operation complete"),
        Err(m) => ("False", m),
    };
    let current = obj.data.pointer("/status/conditions/0");
    if current.and_then(|c| c["status"].as_str()) == Some(cond)
        && current.and_then(|c| c["message"].as_str()) == Some(message)
    {
        return Ok(());
    }
    status["conditions"] = json!([{
        "type": "Ready", "status": cond, "message": message,
        "lastTransitionTime": jiff::Timestamp::now().to_string(),
    }]);
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await
    .map(|_| ())
    .map_err(|e| format!("writing the status of {name}: {e}"))
}

async fn back_up(ctx: Arc<Ctx>, vrb: DynamicObject) -> Result<(), String> {
    let ns = vrb.namespace().unwrap_or_default();
    let name = vrb.name_any();
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, &backup_resource());
    let source = vrb
        .data
        .pointer("/spec/source")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(pvc) = pvcs
        .get_opt(&source)
        .await
        .map_err(|e| format!("getting PVC {ns}/{source}: {e}"))?
    else {
        let why = format!("source PVC {ns}/{source} not found");
        set_status(&api, &vrb, json!({"success": false}), Err(&why)).await?;
        return Err(why);
    };
    if let Some(d) = delay(&pvc, BACKUP_DELAY_ANNOTATION) {
        set_status(&api, &vrb, json!({}), Err("Operation in progress")).await?;
        tokio::time::sleep(d).await;
    }
    let b = backing(&ctx.storage, &ns, &source).await?;
    let dest = target_file(&ctx.dir, &ns, &name);
    tokio::task::spawn_blocking(move || {
        flush(&b);
        std::fs::copy(&b.file, &dest)
            .map(|_| ())
            .map_err(|e| format!("copying {} to {}: {e}", b.file.display(), dest.display()))
    })
    .await
    .map_err(|e| e.to_string())??;
    // Harvester's csiProvider is the PVC's provisioner (its StorageClass's).
    let class = pvc.spec.as_ref().and_then(|s| s.storage_class_name.clone());
    let provisioner = match class {
        Some(c) => Api::<StorageClass>::all(ctx.client.clone())
            .get_opt(&c)
            .await
            .ok()
            .flatten()
            .map(|sc| sc.provisioner),
        None => None,
    };
    let status = json!({
        "handle": format!("bak://{source}/{}", vrb.uid().unwrap_or_default()),
        "csiProvider": provisioner,
        "sourceSpec": pvc.spec,
        "success": true,
    });
    set_status(&api, &vrb, status, Ok(())).await
}

async fn restore(ctx: Arc<Ctx>, vrr: DynamicObject) -> Result<(), String> {
    let ns = vrr.namespace().unwrap_or_default();
    let name = vrr.name_any();
    let api: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &ns, &restore_resource());
    let from = vrr
        .data
        .pointer("/spec/from")
        .and_then(Value::as_str)
        .unwrap_or_default();
    // As upstream's util.SplitNamespacedName: no namespace means the VRR's own.
    let (from_ns, from_name) = from.split_once('/').unwrap_or((&ns, from));
    let vrbs: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), from_ns, &backup_resource());
    let vrb = vrbs
        .get_opt(from_name)
        .await
        .map_err(|e| format!("getting VolumeRemoteBackup {from}: {e}"))?;
    let Some(vrb) = vrb.filter(succeeded) else {
        let why = format!("source VolumeRemoteBackup {from_ns}/{from_name} not found or not done");
        set_status(&api, &vrr, json!({"success": false}), Err(&why)).await?;
        return Err(why);
    };
    let handle = vrb
        .data
        .pointer("/status/handle")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if handle.is_empty() {
        return Err(format!(
            "source RemoteBackup {from_ns}/{from_name} has no handle"
        ));
    }
    let data = target_file(&ctx.dir, from_ns, from_name);
    if !data.exists() {
        return Err(format!(
            "VolumeRemoteBackup {from_ns}/{from_name} has no copy in the backup target"
        ));
    }
    let (class, driver) = match snapshot_class(&ctx.client, &vrb).await {
        Ok(c) => c,
        Err(why) => {
            set_status(&api, &vrr, json!({"success": false}), Err(&why)).await?;
            return Err(why);
        }
    };
    let restore_ref = format!("{ns}/{name}");
    // 1. The VolumeSnapshotContent of the backup handle, named after the restore; Longhorn's CSI
    // driver and the snapshotter sidecar find the backup and make it ready to use.
    let vscs: Api<DynamicObject> =
        Api::all_with(ctx.client.clone(), &snapshot::snapshot_content_resource());
    let vsc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotContent",
        "metadata": {"name": name, "annotations": {ANN_PVC_RESTORE_REF: restore_ref}},
        "spec": {
            "deletionPolicy": "Delete", "driver": driver,
            "source": {"snapshotHandle": handle},
            "volumeSnapshotRef": {"name": name, "namespace": ns},
            "volumeSnapshotClassName": class,
        },
    }))
    .map_err(|e| format!("VolumeSnapshotContent {name}: {e}"))?;
    create_or_get(&vscs, &vsc).await?;
    let size = std::fs::metadata(&data)
        .map_err(|e| format!("{}: {e}", data.display()))?
        .len();
    vscs.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(
            json!({"status": {"readyToUse": true, "snapshotHandle": handle,
                                        "restoreSize": size, "creationTime": 0}}),
        ),
    )
    .await
    .map_err(|e| format!("marking VolumeSnapshotContent {name} ready: {e}"))?;
    // The data the snapshot stand-in restores from.
    let snap_data = snapshot::data_file(&ctx.dir, &ns, &name);
    tokio::task::spawn_blocking(move || std::fs::copy(&data, &snap_data).map(|_| ()))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("copying the backup for VolumeSnapshot {ns}/{name}: {e}"))?;
    // 2. The VolumeSnapshot bound to it.
    let vss: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &ns, &snapshot::snapshot_resource());
    let vs: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": name, "namespace": ns, "annotations": {ANN_PVC_RESTORE_REF: restore_ref}},
        "spec": {"source": {"volumeSnapshotContentName": name}, "volumeSnapshotClassName": class},
    }))
    .map_err(|e| format!("VolumeSnapshot {ns}/{name}: {e}"))?;
    create_or_get(&vss, &vs).await?;
    // 3. The PVC from the VolumeSnapshot, owned by the restore (`createPVCFromSnapshot`).
    let spec = vrb
        .data
        .pointer("/status/sourceSpec")
        .cloned()
        .unwrap_or_default();
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {
            "name": name, "namespace": ns, "annotations": {},
            "ownerReferences": [{
                "apiVersion": "harvesterhci.io/v1beta1", "kind": "VolumeRemoteRestore",
                "name": name, "uid": vrr.uid().unwrap_or_default(), "controller": true,
            }],
        },
        "spec": {
            "accessModes": spec["accessModes"], "resources": spec["resources"],
            "storageClassName": spec["storageClassName"], "volumeMode": spec["volumeMode"],
            "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": name},
        },
    }))
    .map_err(|e| format!("the restored PVC {ns}/{name}: {e}"))?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    match pvcs.create(&PostParams::default(), &pvc).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(format!("creating the restored PVC {ns}/{name}: {e}")),
    }
    if let Some(d) = delay(&vrb, RESTORE_DELAY_ANNOTATION) {
        set_status(&api, &vrr, json!({}), Err("Operation in progress")).await?;
        tokio::time::sleep(d).await;
    }
    // Upstream's readiness: the PVC is Bound (Immediate binding); here also its data is in
    // place (the snapshot stand-in writes it after binding, see `snapshot`).
    let restored =
        kube::runtime::wait::await_condition(pvcs, &name, |p: Option<&PersistentVolumeClaim>| {
            p.is_some_and(|p| {
                p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                    && p.annotations().contains_key(snapshot::RESTORED_ANNOTATION)
            })
        });
    tokio::time::timeout(Duration::from_secs(60), restored)
        .await
        .map_err(|_| format!("the restored PVC {ns}/{name} was not Bound and filled within 60s"))?
        .map_err(|e| format!("watching the restored PVC {ns}/{name}: {e}"))?;
    set_status(&api, &vrr, json!({"success": true}), Ok(())).await
}

/// `createOrGet`: made, or already there.
async fn create_or_get(api: &Api<DynamicObject>, obj: &DynamicObject) -> Result<(), String> {
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(format!("creating {}: {e}", obj.name_any())),
    }
}

/// `GetSnapshotClassInfo` + `vsClassCache.Get`: the `csi-driver-config` setting (else its
/// default) names, for the backup's `csiProvider`, the VolumeSnapshotClass whose driver the
/// content gets. A bed without that class uses the provider as the driver.
async fn snapshot_class(
    client: &kube::Client,
    vrb: &DynamicObject,
) -> Result<(String, String), String> {
    let provider = vrb
        .data
        .pointer("/status/csiProvider")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let settings: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("harvesterhci.io", "v1beta1", "Setting"),
            "settings",
        ),
    );
    let configured = settings
        .get_opt(CSI_DRIVER_CONFIG)
        .await
        .map_err(|e| format!("getting setting {CSI_DRIVER_CONFIG}: {e}"))?
        .and_then(|s| {
            s.data
                .get("value")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .filter(|v| !v.is_empty());
    let config: Value =
        serde_json::from_str(configured.as_deref().unwrap_or(CSI_DRIVER_CONFIG_DEFAULT))
            .map_err(|e| format!("setting {CSI_DRIVER_CONFIG}: {e}"))?;
    let Some(class) = config
        .get(&provider)
        .and_then(|d| d.get("volumeSnapshotClassName"))
        .and_then(Value::as_str)
    else {
        return Err(format!(
            "CSI driver {provider:?} not found in CSIDriverInfo settings for resource {}/{}",
            vrb.namespace().unwrap_or_default(),
            vrb.name_any()
        ));
    };
    let classes: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", "VolumeSnapshotClass"),
            "volumesnapshotclasses",
        ),
    );
    let driver = classes
        .get_opt(class)
        .await
        .map_err(|e| format!("getting VolumeSnapshotClass {class}: {e}"))?
        .and_then(|c| {
            c.data
                .get("driver")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or(provider);
    Ok((class.to_string(), driver))
}

/// The garbage collector's part: the PVCs a deleted VRR owns are deleted.
async fn collect_garbage(ctx: Arc<Ctx>, vrr: DynamicObject) -> Result<(), String> {
    let ns = vrr.namespace().unwrap_or_default();
    let uid = vrr.uid().unwrap_or_default();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let owned = pvcs
        .list(&Default::default())
        .await
        .map_err(|e| format!("listing PVCs in {ns}: {e}"))?
        .items
        .into_iter()
        .filter(|p| p.owner_references().iter().any(|o| o.uid == uid));
    for p in owned {
        match pvcs.delete(&p.name_any(), &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(format!("deleting PVC {ns}/{}: {e}", p.name_any())),
        }
    }
    // Upstream's `Delete`: the VolumeSnapshot named after the restore goes (its handle cleared
    // first, so Longhorn keeps the backup), and with `deletionPolicy: Delete` the
    // snapshot controller deletes its content.
    let name = vrr.name_any();
    let restore_ref = format!("{ns}/{name}");
    let vss: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &ns, &snapshot::snapshot_resource());
    let vscs: Api<DynamicObject> =
        Api::all_with(ctx.client.clone(), &snapshot::snapshot_content_resource());
    for api in [vss, vscs] {
        let ours = api
            .get_opt(&name)
            .await
            .map_err(|e| format!("getting {name}: {e}"))?
            .is_some_and(|o| o.annotations().get(ANN_PVC_RESTORE_REF) == Some(&restore_ref));
        if !ours {
            continue;
        }
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(format!("deleting {name}: {e}")),
        }
    }
    Ok(())
}
