//! Remote backups (VolumeSnapshotClass parameter `type: backup`) against the test bed: the
//! driver in-process makes Harvester `VolumeRemoteBackup`s and `VolumeRemoteRestore`s on the
//! real Harvester API server, the stand-in (`testbed::sim::backup`) plays Harvester's
//! controllers and copies the loop-device data to and from a backup-target directory, and the
//! node plugin stages the restored volume with real mkfs/mount. Tests named `_root` need root.

use testbed::suites::csi as common;

use std::time::{Duration, Instant};

use common::{
    Driver, Vol, assert_root, bed_with_vm, create_request, detach_and_delete, mount_cap, mounted,
    node_dir, publish, stage, unpublish_and_unstage,
};
use csi_proto::csi::v1::*;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use testbed::TestBed;
use testbed::csi_client::backup_request;
use testbed::sim::backup::{
    BACKUP_DELAY_ANNOTATION, RESTORE_DELAY_ANNOTATION, backup_resource, restore_resource,
    target_file,
};
use tonic::Code;

// Upstream's wire facts, as data. Sources:
// - harvester/harvester `pkg/apis/harvesterhci.io/v1beta1/volumeremotebackup.go` (commit
//   de5320b3b9389787e89b1313f41e65df8c9ee7c6): group/version `harvesterhci.io/v1beta1`, kinds
//   VolumeRemoteBackup / VolumeRemoteRestore, `spec.type` enum `lh`, `spec.source`, `spec.from`,
//   `status.success`, `status.sourceSpec` (a PersistentVolumeClaimSpec).
// - harvester/harvester-csi-driver `pkg/csi/controller_server.go` as recorded in
//   https://github.com/harvester/harvester-csi-driver/blob/97b6c358/pkg/csi/controller_server.go
//   (CreateVolume from a snapshot source, CreateSnapshot with `type: backup`):
//   label `harvesterhci.io/backupSourceVolume=<volume>`, snapshot ID `backup:<ns>/<name>`,
//   parameter `type: backup`, VRR named like the volume with `from: "<ns>/<name>"`.
// - harvester/harvester `pkg/volumeremotebackup/longhorn/restore.go` (createPVCFromSnapshot): the
//   restored PVC has the VRR's name and a controller owner reference to it.
const GROUP_VERSION: &str = "harvesterhci.io/v1beta1";
const LABEL_SOURCE: &str = "harvesterhci.io/backupSourceVolume";
const TYPE_LH: &str = "lh";
/// CreateSnapshot with `type: backup`: the snapshot, or the error.
async fn take(d: &Driver, name: &str, source: &str) -> Result<Snapshot, tonic::Status> {
    d.controller()
        .create_snapshot(backup_request(name, source))
        .await?
        .into_inner()
        .snapshot
        .ok_or_else(|| tonic::Status::internal("CreateSnapshot answered no snapshot"))
}

async fn delete_snapshot(d: &Driver, id: &str) -> Result<(), tonic::Status> {
    d.controller()
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        })
        .await
        .map(|_| ())
}

fn from_snapshot(name: &str, size: u64, snapshot_id: &str) -> CreateVolumeRequest {
    common::from_snapshot(create_request(name, size, &mount_cap("ext4")), snapshot_id)
}

fn vrbs(bed: &TestBed) -> Api<DynamicObject> {
    Api::namespaced_with(
        bed.harvester.client.clone(),
        &bed.vm_namespace,
        &backup_resource(),
    )
}

fn vrrs(bed: &TestBed) -> Api<DynamicObject> {
    Api::namespaced_with(
        bed.harvester.client.clone(),
        &bed.vm_namespace,
        &restore_resource(),
    )
}

fn vss(bed: &TestBed) -> Api<DynamicObject> {
    Api::namespaced_with(
        bed.harvester.client.clone(),
        &bed.vm_namespace,
        &testbed::sim::snapshot::snapshot_resource(),
    )
}

fn vscs(bed: &TestBed) -> Api<DynamicObject> {
    Api::all_with(
        bed.harvester.client.clone(),
        &testbed::sim::snapshot::snapshot_content_resource(),
    )
}

fn pvcs(bed: &TestBed) -> Api<PersistentVolumeClaim> {
    Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
}

/// Waits (60 s) until `name` is gone from `api`.
async fn gone<K>(what: &str, api: &Api<K>, name: &str)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    testbed::util::wait::until(what, Duration::from_secs(60), || async {
        let o = api.get_opt(name).await.map_err(|e| e.to_string())?;
        Ok(o.map_or(Ok(()), |o| Err(o.meta().deletion_timestamp.clone())))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_restores_its_data_into_a_new_volume_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let (dir, sweeper) = node_dir(&bed, "backup-data");
    let src = mounted(&d, "pvc-backup-src", 64 << 20, &mount_cap("ext4"), &dir).await;
    std::fs::write(src.target.join("before.txt"), b"in the backup").expect("write");
    // What an application-consistent snapshot does first (fsfreeze): flush to the disk.
    assert!(
        std::process::Command::new("sync")
            .status()
            .expect("sync")
            .success()
    );

    // A CSI name that is no DNS label is mapped like our local snapshots' names.
    let snap = take(&d, "Backup-Of-Src", &src.id)
        .await
        .expect("CreateSnapshot type=backup");
    let vrb_name = snap
        .snapshot_id
        .strip_prefix(&format!("backup:{}/", bed.vm_namespace))
        .unwrap_or_else(|| panic!("a backup ID is backup:<ns>/<name>: {snap:?}"))
        .to_string();
    assert!(
        vrb_name.starts_with("backup-of-src"),
        "mapped name: {vrb_name}"
    );
    assert!(
        snap.ready_to_use,
        "the stand-in backs up within the wait: {snap:?}"
    );
    assert_eq!(snap.size_bytes, 64 << 20);
    assert_eq!(snap.source_volume_id, src.id);

    // The VolumeRemoteBackup on Harvester, as upstream makes it.
    let vrb = vrbs(&bed).get(&vrb_name).await.expect("the VRB");
    let v = serde_json::to_value(&vrb).expect("json");
    assert_eq!(
        v["metadata"]["labels"][LABEL_SOURCE],
        json!(src.id),
        "{v:#}"
    );
    assert_eq!(v["spec"], json!({"type": TYPE_LH, "source": src.id}));
    assert_eq!(v["status"]["success"], json!(true));
    let copy = target_file(bed.dir.path(), &bed.vm_namespace, &vrb_name);
    assert!(copy.exists(), "the backup target holds {}", copy.display());

    // Retrying CreateSnapshot is the same backup.
    let again = take(&d, "Backup-Of-Src", &src.id)
        .await
        .expect("CreateSnapshot again");
    assert_eq!(again.snapshot_id, snap.snapshot_id);

    std::fs::write(src.target.join("after.txt"), b"not in the backup").expect("write");

    let restored = d
        .controller()
        .create_volume(from_snapshot(
            "pvc-from-backup",
            64 << 20,
            &snap.snapshot_id,
        ))
        .await
        .expect("CreateVolume from the backup")
        .into_inner()
        .volume
        .expect("volume");
    assert_eq!(restored.volume_id, "pvc-from-backup");
    assert_eq!(restored.capacity_bytes, 64 << 20);
    assert!(restored.content_source.is_some(), "content source echoed");
    let vrr = vrrs(&bed).get("pvc-from-backup").await.expect("the VRR");
    let v = serde_json::to_value(&vrr).expect("json");
    assert_eq!(v["apiVersion"], GROUP_VERSION);
    assert_eq!(
        v["spec"],
        json!({"type": TYPE_LH, "from": format!("{}/{vrb_name}", bed.vm_namespace)})
    );
    assert_eq!(v["status"]["success"], json!(true));
    let pvc = pvcs(&bed)
        .get("pvc-from-backup")
        .await
        .expect("restored PVC");
    let owners = pvc.metadata.owner_references.clone().unwrap_or_default();
    assert!(
        owners.iter().any(|o| o.kind == "VolumeRemoteRestore"
            && o.name == "pvc-from-backup"
            && o.controller == Some(true)),
        "owned by its VRR: {owners:?}"
    );
    // Through a VolumeSnapshotContent and a VolumeSnapshot named after the VRR, as upstream's
    // `restore.go` goes: the PVC's dataSource is the VolumeSnapshot.
    let source = pvc.spec.as_ref().and_then(|s| s.data_source.clone());
    assert_eq!(
        source.map(|d| (d.api_group, d.kind, d.name)),
        Some((
            Some("snapshot.storage.k8s.io".to_string()),
            "VolumeSnapshot".to_string(),
            "pvc-from-backup".to_string()
        ))
    );
    let vs = vss(&bed)
        .get("pvc-from-backup")
        .await
        .expect("the VolumeSnapshot");
    assert_eq!(
        vs.data["spec"]["source"],
        json!({"volumeSnapshotContentName": "pvc-from-backup"})
    );
    let vsc = vscs(&bed)
        .get("pvc-from-backup")
        .await
        .expect("the VolumeSnapshotContent");
    assert_eq!(
        vsc.data["spec"]["source"]["snapshotHandle"],
        vrbs(&bed).get(&vrb_name).await.expect("the VRB").data["status"]["handle"],
        "the content is the backup's handle"
    );
    assert_eq!(
        vsc.data["spec"]["volumeSnapshotRef"],
        json!({"name": "pvc-from-backup", "namespace": bed.vm_namespace})
    );
    // Asking again is the same volume.
    let again = d
        .controller()
        .create_volume(from_snapshot(
            "pvc-from-backup",
            64 << 20,
            &snap.snapshot_id,
        ))
        .await
        .expect("CreateVolume from the backup again")
        .into_inner()
        .volume
        .expect("volume");
    assert_eq!(again.volume_id, restored.volume_id);

    let published = d
        .controller()
        .controller_publish_volume(common::publish_request(
            &restored.volume_id,
            &mount_cap("ext4"),
        ))
        .await
        .expect("ControllerPublishVolume restored")
        .into_inner();
    let copy_vol = Vol {
        id: restored.volume_id.clone(),
        ctx: published.publish_context,
        staging: dir.join("restored-staging"),
        target: dir.join("restored-target"),
    };
    stage(&d, &copy_vol, &mount_cap("ext4"))
        .await
        .expect("NodeStageVolume restored (holds ext4: no reformat)");
    publish(&d, &copy_vol, &mount_cap("ext4"))
        .await
        .expect("NodePublishVolume restored");
    assert_eq!(
        std::fs::read(copy_vol.target.join("before.txt")).expect("restored file"),
        b"in the backup"
    );
    assert!(
        !copy_vol.target.join("after.txt").exists(),
        "written after the backup"
    );

    for filter in [
        ListSnapshotsRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        },
        ListSnapshotsRequest {
            source_volume_id: src.id.clone(),
            ..Default::default()
        },
    ] {
        let listed = d
            .controller()
            .list_snapshots(filter.clone())
            .await
            .expect("ListSnapshots")
            .into_inner();
        let ids: Vec<(String, bool)> = listed
            .entries
            .iter()
            .filter_map(|e| e.snapshot.as_ref())
            .map(|s| (s.snapshot_id.clone(), s.ready_to_use))
            .collect();
        assert_eq!(ids, vec![(snap.snapshot_id.clone(), true)], "{filter:?}");
    }
    let by_other_source = d
        .controller()
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: restored.volume_id.clone(),
            ..Default::default()
        })
        .await
        .expect("ListSnapshots of the restored volume")
        .into_inner();
    assert!(by_other_source.entries.is_empty(), "{by_other_source:?}");

    unpublish_and_unstage(&d, &copy_vol).await;
    detach_and_delete(&d, &copy_vol).await;
    gone("the VRR deleted", &vrrs(&bed), "pvc-from-backup").await;
    gone("the restored PVC deleted", &pvcs(&bed), "pvc-from-backup").await;
    gone("its VolumeSnapshot deleted", &vss(&bed), "pvc-from-backup").await;
    gone(
        "its VolumeSnapshotContent deleted",
        &vscs(&bed),
        "pvc-from-backup",
    )
    .await;

    delete_snapshot(&d, &snap.snapshot_id)
        .await
        .expect("DeleteSnapshot");
    gone("the VRB deleted", &vrbs(&bed), &vrb_name).await;
    testbed::util::wait::until("the backup copy removed", Duration::from_secs(30), || {
        let copy = copy.clone();
        async move { Ok(if copy.exists() { Err(copy) } else { Ok(()) }) }
    })
    .await
    .expect("backup target emptied");
    delete_snapshot(&d, &snap.snapshot_id)
        .await
        .expect("DeleteSnapshot of a deleted backup succeeds");

    unpublish_and_unstage(&d, &src).await;
    detach_and_delete(&d, &src).await;
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_backups_and_restores_are_not_ready_then_ready() {
    let bed = bed_with_vm().await;
    let wait = Duration::from_secs(1);
    let d = Driver::start(&bed, |c| c.timeouts.snapshot_ready = wait).await;
    let vol = d
        .controller()
        .create_volume(create_request("pvc-slow-src", 16 << 20, &mount_cap("ext4")))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume");
    // The stand-in's knob: backups of this PVC take 8 s.
    pvcs(&bed)
        .patch(
            &vol.volume_id,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {BACKUP_DELAY_ANNOTATION: "8000"}}})),
        )
        .await
        .expect("annotating the source PVC");

    let t0 = Instant::now();
    let pending = take(&d, "snap-slow", &vol.volume_id)
        .await
        .expect("CreateSnapshot of a running backup is no error");
    assert!(!pending.ready_to_use, "{pending:?}");
    assert!(
        t0.elapsed() >= wait,
        "the driver watched for {wait:?} first"
    );
    assert_eq!(
        pending.snapshot_id,
        format!("backup:{}/snap-slow", bed.vm_namespace)
    );
    assert_eq!(
        pending.size_bytes,
        16 << 20,
        "the source's size until known"
    );
    let status = vrbs(&bed).get("snap-slow").await.expect("VRB").data["status"].clone();
    assert_ne!(status["success"], json!(true), "{status}");

    let early = d
        .controller()
        .create_volume(from_snapshot(
            "pvc-too-early",
            16 << 20,
            &pending.snapshot_id,
        ))
        .await
        .expect_err("restoring a running backup");
    assert_eq!(early.code(), Code::Unavailable, "{early:?}");
    assert!(
        early.message().contains(&pending.snapshot_id),
        "{}",
        early.message()
    );
    assert!(
        vrrs(&bed)
            .get_opt("pvc-too-early")
            .await
            .expect("get")
            .is_none(),
        "no VRR for a backup that is not done"
    );

    // The external-snapshotter asks again until it is ready.
    let ready = testbed::util::wait::until("the backup ready", Duration::from_secs(60), || {
        let mut c = d.controller();
        let id = vol.volume_id.clone();
        async move {
            let s = c
                .create_snapshot(backup_request("snap-slow", &id))
                .await
                .map_err(|e| e.to_string())?
                .into_inner()
                .snapshot
                .ok_or("no snapshot")?;
            Ok(if s.ready_to_use { Ok(s) } else { Err(s) })
        }
    })
    .await
    .expect("ready");
    assert_eq!(ready.snapshot_id, pending.snapshot_id);

    // A restore still running is UNAVAILABLE (the provisioner asks again), then the volume.
    vrbs(&bed)
        .patch(
            "snap-slow",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {RESTORE_DELAY_ANNOTATION: "8000"}}})),
        )
        .await
        .expect("annotating the VRB");
    let running = d
        .controller()
        .create_volume(from_snapshot(
            "pvc-slow-restore",
            16 << 20,
            &ready.snapshot_id,
        ))
        .await
        .expect_err("a restore still running");
    assert_eq!(running.code(), Code::Unavailable, "{running:?}");
    assert!(
        running.message().contains("still being restored"),
        "{}",
        running.message()
    );
    let restored = testbed::util::wait::until("the restore done", Duration::from_secs(60), || {
        let mut c = d.controller();
        let id = ready.snapshot_id.clone();
        async move {
            Ok(
                match c
                    .create_volume(from_snapshot("pvc-slow-restore", 16 << 20, &id))
                    .await
                {
                    Ok(v) => Ok(v.into_inner().volume.ok_or("no volume")?),
                    Err(e) if e.code() == Code::Unavailable => Err(e.message().to_string()),
                    Err(e) => return Err(format!("{e:?}")),
                },
            )
        }
    })
    .await
    .expect("restored");
    assert_eq!(
        (restored.volume_id.as_str(), restored.capacity_bytes),
        ("pvc-slow-restore", 16 << 20)
    );
    d.controller()
        .delete_volume(DeleteVolumeRequest {
            volume_id: restored.volume_id.clone(),
            ..Default::default()
        })
        .await
        .expect("DeleteVolume restored");
    gone("the VRR deleted", &vrrs(&bed), "pvc-slow-restore").await;
    delete_snapshot(&d, &ready.snapshot_id)
        .await
        .expect("DeleteSnapshot");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_backup_input_is_refused_naming_it() {
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let mut c = d.controller();
    let mut vols = Vec::new();
    for name in ["pvc-bad-a", "pvc-bad-b"] {
        vols.push(
            c.create_volume(create_request(name, 16 << 20, &mount_cap("ext4")))
                .await
                .expect("CreateVolume")
                .into_inner()
                .volume
                .expect("volume")
                .volume_id,
        );
    }

    let mut unknown_type = backup_request("snap-bad", &vols[0]);
    unknown_type
        .parameters
        .insert("type".into(), "offsite".into());
    let e = c
        .create_snapshot(unknown_type)
        .await
        .expect_err("unknown type");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("parameters") && e.message().contains("type \"offsite\""),
        "{}",
        e.message()
    );
    assert!(
        vrbs(&bed).get_opt("snap-bad").await.expect("get").is_none(),
        "nothing made for a refused request"
    );

    let e = c
        .create_volume(from_snapshot("pvc-bad-restore", 16 << 20, "backup:foo"))
        .await
        .expect_err("backup ID without a namespace");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains("volume_content_source.snapshot.snapshot_id")
            && e.message().contains("\"backup:foo\"")
            && e.message().contains("namespace"),
        "{}",
        e.message()
    );
    let e = delete_snapshot(&d, "backup:foo")
        .await
        .expect_err("DeleteSnapshot of a backup ID without a namespace");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    let missing = format!("backup:{}/nope", bed.vm_namespace);
    let e = c
        .create_volume(from_snapshot("pvc-bad-restore", 16 << 20, &missing))
        .await
        .expect_err("restore of a backup that does not exist");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains(&missing), "{}", e.message());
    assert!(
        vrrs(&bed)
            .get_opt("pvc-bad-restore")
            .await
            .expect("get")
            .is_none(),
        "no VRR for a missing backup"
    );
    delete_snapshot(&d, &missing)
        .await
        .expect("DeleteSnapshot of a missing backup succeeds");
    let listed = c
        .list_snapshots(ListSnapshotsRequest {
            snapshot_id: missing.clone(),
            ..Default::default()
        })
        .await
        .expect("ListSnapshots of a missing backup")
        .into_inner();
    assert!(listed.entries.is_empty(), "{listed:?}");

    let first = take(&d, "snap-of-a", &vols[0])
        .await
        .expect("CreateSnapshot");
    assert!(first.ready_to_use, "{first:?}");
    let e = take(&d, "snap-of-a", &vols[1])
        .await
        .expect_err("the same name for another volume");
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    assert!(
        e.message().contains(&vols[0]) && e.message().contains(&vols[1]),
        "{}",
        e.message()
    );
    let vrb = vrbs(&bed).get("snap-of-a").await.expect("VRB");
    assert_eq!(
        vrb.data["spec"]["source"],
        Value::from(vols[0].clone()),
        "left as it was"
    );

    // A restore into a volume larger than the backup cannot be made by Harvester: OUT_OF_RANGE.
    let e = c
        .create_volume(from_snapshot("pvc-too-big", 64 << 20, &first.snapshot_id))
        .await
        .expect_err("restore larger than the backup");
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    assert!(
        e.message().contains("capacity_range") && e.message().contains(&first.snapshot_id),
        "{}",
        e.message()
    );
    d.stop().await;
}

/// Issue 23: Harvester's remote-backup webhook (v1.8.2 `pkg/webhook/resources/volumeremotebackup/
/// validator.go`) refuses a VolumeRemoteRestore named like a VolumeRemoteBackup of its namespace.
/// The driver reaches it when the CO names a volume like a backup it took (CSI keeps volume and
/// snapshot names apart): CreateVolume from that backup fails with a gRPC error carrying the
/// webhook's message, a code that says retrying will not help, and nothing is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_restore_refused_by_harvesters_webhook_is_a_grpc_error_with_its_message() {
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let mut c = d.controller();
    let vol = c
        .create_volume(create_request(
            "pvc-named-src",
            16 << 20,
            &mount_cap("ext4"),
        ))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    let snap = take(&d, "same-name", &vol).await.expect("CreateSnapshot");
    assert!(snap.ready_to_use, "{snap:?}");
    let e = c
        .create_volume(from_snapshot("same-name", 16 << 20, &snap.snapshot_id))
        .await
        .expect_err("a restore named like a backup is refused by Harvester");
    let expected = format!(
        "a RemoteBackup with name same-name already exists in namespace {}",
        bed.vm_namespace
    );
    assert!(
        e.message().contains(&expected) && e.message().contains("validator.harvesterhci.io"),
        "the webhook's message and name: {e:?}"
    );
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        vrrs(&bed)
            .get_opt("same-name")
            .await
            .expect("get")
            .is_none(),
        "no VRR"
    );
    let pvc = pvcs(&bed).get_opt("same-name").await.expect("get");
    assert!(pvc.is_none(), "no PVC: {pvc:?}");
}
