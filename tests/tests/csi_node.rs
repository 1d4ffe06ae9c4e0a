//! The node plugin against real devices: loop-device volumes hot-plugged by the test bed's
//! virt-api stand-in, real mkfs/mount, the driver in-process. Tests named `_root` need root.

use testbed::suites::csi as common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{
    Driver, NODE, Vol, assert_root, bed_with_vm, blkid_uuid, create_and_publish, detach_and_delete,
    mount_cap, mounted, node_dir, publish, stage, unpublish_and_unstage,
};
use csi_proto::csi::v1::*;
use testbed::csi_client::snapshot_request;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_survives_unstage_and_restage_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let (dir, sweeper) = node_dir(&bed, "node-data");
    let v = create_and_publish(&d, "pvc-data-1", 64 << 20, &mount_cap("ext4"), &dir).await;
    assert_eq!(
        v.ctx.get("serial").map(String::len),
        Some(20),
        "publish context carries the 20-character serial: {:?}",
        v.ctx
    );

    stage(&d, &v, &mount_cap("ext4"))
        .await
        .expect("first NodeStageVolume");
    publish(&d, &v, &mount_cap("ext4"))
        .await
        .expect("NodePublishVolume");
    let uuid = blkid_uuid(&v.target);
    let file = v.target.join("hello.txt");
    std::fs::write(&file, b"written before unstage").expect("write");
    unpublish_and_unstage(&d, &v).await;
    assert!(!v.target.exists(), "NodeUnpublishVolume removes the target");
    assert!(
        testbed::real::mounts::mounts_under(&dir).is_empty(),
        "nothing mounted after unstage"
    );

    // The device now holds ext4: staging it as xfs must be refused, not reformatted.
    let refused = stage(&d, &v, &mount_cap("xfs"))
        .await
        .expect_err("ext4 staged as xfs");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains("refusing to format") && refused.message().contains("ext4"),
        "{}",
        refused.message()
    );

    stage(&d, &v, &mount_cap("ext4"))
        .await
        .expect("second NodeStageVolume");
    stage(&d, &v, &mount_cap("ext4"))
        .await
        .expect("NodeStageVolume again is idempotent");
    publish(&d, &v, &mount_cap("ext4"))
        .await
        .expect("NodePublishVolume");
    assert_eq!(
        std::fs::read(&file).expect("read back after restage"),
        b"written before unstage"
    );
    assert_eq!(
        blkid_uuid(&v.target),
        uuid,
        "same filesystem, not a new one"
    );

    unpublish_and_unstage(&d, &v).await;
    detach_and_delete(&d, &v).await;
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_volume_grows_while_mounted_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let (dir, sweeper) = node_dir(&bed, "node-xfs");
    // mkfs.xfs wants at least 300 MiB.
    let v = mounted(&d, "pvc-xfs-1", 320 << 20, &mount_cap("xfs"), &dir).await;
    std::fs::write(v.target.join("keep.txt"), b"xfs data").expect("write");
    let before = rustix_like_total(&v.target);

    let expanded = d
        .controller()
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: v.id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 512 << 20,
                limit_bytes: 0,
            }),
            volume_capability: Some(mount_cap("xfs")),
            ..Default::default()
        })
        .await
        .expect("ControllerExpandVolume")
        .into_inner();
    assert_eq!(expanded.capacity_bytes, 512 << 20);
    assert!(expanded.node_expansion_required);
    let grown = d
        .node()
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: v.id.clone(),
            volume_path: v.target.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: 512 << 20,
                limit_bytes: 0,
            }),
            staging_target_path: v.staging.display().to_string(),
            volume_capability: Some(mount_cap("xfs")),
            ..Default::default()
        })
        .await
        .expect("NodeExpandVolume")
        .into_inner();
    assert_eq!(grown.capacity_bytes, 512 << 20);
    let after = rustix_like_total(&v.target);
    assert!(
        after > before + (150 << 20),
        "the mounted xfs grew: {before} -> {after} bytes"
    );
    let stats = d
        .node()
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: v.id.clone(),
            volume_path: v.target.display().to_string(),
            ..Default::default()
        })
        .await
        .expect("NodeGetVolumeStats")
        .into_inner();
    assert_eq!(stats.usage.len(), 2, "bytes and inodes: {stats:?}");
    assert_eq!(stats.usage[0].total as u64, after);
    assert_eq!(
        stats.volume_condition.map(|c| c.abnormal),
        Some(false),
        "mounted volume is normal"
    );
    assert_eq!(
        std::fs::read(v.target.join("keep.txt")).expect("data after growth"),
        b"xfs data"
    );

    unpublish_and_unstage(&d, &v).await;
    // With the mount gone, the stats of the (re-created) path report an abnormal volume.
    std::fs::create_dir_all(&v.target).expect("empty target");
    let gone = d
        .node()
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: v.id.clone(),
            volume_path: v.target.display().to_string(),
            ..Default::default()
        })
        .await
        .expect("NodeGetVolumeStats on an unmounted path")
        .into_inner();
    assert_eq!(gone.volume_condition.map(|c| c.abnormal), Some(true));
    std::fs::remove_dir(&v.target).expect("cleanup");
    detach_and_delete(&d, &v).await;
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    d.stop().await;
}

/// Total bytes of the filesystem at `path`, via `df` (independent of the driver's statvfs).
fn rustix_like_total(path: &Path) -> u64 {
    let out = std::process::Command::new("df")
        .args(["-B1", "--output=size"])
        .arg(path)
        .output()
        .expect("df");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df size")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restores_the_data_and_mounts_beside_its_xfs_source_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let (dir, sweeper) = node_dir(&bed, "node-snap");
    let src = mounted(&d, "pvc-snap-src", 320 << 20, &mount_cap("xfs"), &dir).await;
    std::fs::write(src.target.join("before.txt"), b"in the snapshot").expect("write");
    // What an application-consistent snapshot does first (fsfreeze): flush to the disk.
    assert!(
        std::process::Command::new("sync")
            .status()
            .expect("sync")
            .success()
    );

    let snap = d
        .controller()
        .create_snapshot(snapshot_request("Snap-Of-Src", &src.id))
        .await
        .expect("CreateSnapshot")
        .into_inner()
        .snapshot
        .expect("snapshot");
    assert!(
        snap.ready_to_use,
        "the stand-in takes it within the wait: {snap:?}"
    );
    assert_eq!(snap.size_bytes, 320 << 20);
    std::fs::write(src.target.join("after.txt"), b"not in the snapshot").expect("write");

    let restored = d
        .controller()
        .create_volume(common::from_snapshot(
            common::create_request("pvc-snap-restored", 320 << 20, &mount_cap("xfs")),
            &snap.snapshot_id,
        ))
        .await
        .expect("CreateVolume from the snapshot")
        .into_inner()
        .volume
        .expect("volume");
    assert!(restored.content_source.is_some(), "content source echoed");
    // Longhorn binds a restored PVC after the restore; the stand-in says when its copy is done.
    let pvcs = kube::Api::<k8s_openapi::api::core::v1::PersistentVolumeClaim>::namespaced(
        bed.harvester.client.clone(),
        &bed.vm_namespace,
    );
    testbed::util::wait::until("the restore copy", Duration::from_secs(60), || {
        let pvcs = pvcs.clone();
        let id = restored.volume_id.clone();
        async move {
            let p = pvcs.get(&id).await.map_err(|e| e.to_string())?;
            let a = p.metadata.annotations.unwrap_or_default();
            Ok(
                if a.contains_key(testbed::sim::snapshot::RESTORED_ANNOTATION) {
                    Ok(())
                } else {
                    Err(a)
                },
            )
        }
    })
    .await
    .expect("restored");
    let published = d
        .controller()
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: restored.volume_id.clone(),
            node_id: NODE.into(),
            volume_capability: Some(mount_cap("xfs")),
            ..Default::default()
        })
        .await
        .expect("ControllerPublishVolume restored")
        .into_inner();
    let copy = Vol {
        id: restored.volume_id.clone(),
        ctx: published.publish_context,
        staging: dir.join("restored-staging"),
        target: dir.join("restored-target"),
    };
    // Same XFS UUID as the still-mounted source: mounts only thanks to `nouuid`.
    stage(&d, &copy, &mount_cap("xfs"))
        .await
        .expect("NodeStageVolume restored (no reformat, nouuid)");
    publish(&d, &copy, &mount_cap("xfs"))
        .await
        .expect("NodePublishVolume");
    assert_eq!(
        std::fs::read(copy.target.join("before.txt")).expect("restored file"),
        b"in the snapshot"
    );
    assert!(
        !copy.target.join("after.txt").exists(),
        "written after the snapshot"
    );

    let listed = d
        .controller()
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: src.id.clone(),
            ..Default::default()
        })
        .await
        .expect("ListSnapshots")
        .into_inner();
    assert_eq!(listed.entries.len(), 1);

    unpublish_and_unstage(&d, &copy).await;
    detach_and_delete(&d, &copy).await;
    d.controller()
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .expect("DeleteSnapshot");
    unpublish_and_unstage(&d, &src).await;
    detach_and_delete(&d, &src).await;
    assert!(sweeper.sweep().is_empty(), "mounts left behind");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_never_appears_fails_clearly_within_the_bound() {
    let bed = bed_with_vm().await;
    let bound = Duration::from_secs(2);
    let d = Driver::start(&bed, |c| c.timeouts.device = bound).await;
    let staging = bed.dir.path().join("never-staging");
    let t0 = Instant::now();
    let err = d
        .node()
        .node_stage_volume(NodeStageVolumeRequest {
            volume_id: "pvc-never-attached".into(),
            publish_context: HashMap::from([(
                "serial".to_string(),
                "0000deadbeef00000000".to_string(),
            )]),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        })
        .await
        .expect_err("a disk that never appears");
    let took = t0.elapsed();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    for needle in [
        "pvc-never-attached",
        "0000deadbeef00000000",
        "2s",
        "ControllerPublishVolume",
    ] {
        assert!(
            err.message().contains(needle),
            "message lacks {needle:?}: {}",
            err.message()
        );
    }
    assert!(
        took >= bound && took < bound + Duration::from_secs(5),
        "waited {took:?} for a bound of {bound:?}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_missing_a_field_get_invalid_argument_naming_it() {
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let check = |what: &str, r: Result<(), tonic::Status>, field: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert!(
            e.message().contains(field),
            "{what}: {:?} lacks {field:?}",
            e.message()
        );
    };
    let (mut c, mut n) = (d.controller(), d.node());
    check(
        "CreateVolume without name",
        c.create_volume(CreateVolumeRequest {
            volume_capabilities: vec![mount_cap("ext4")],
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "name",
    );
    check(
        "CreateVolume without capabilities",
        c.create_volume(CreateVolumeRequest {
            name: "pvc-x".into(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "volume_capabilities",
    );
    check(
        "ControllerPublishVolume without node",
        c.controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: "pvc-x".into(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "node_id",
    );
    check(
        "ControllerExpandVolume without range",
        c.controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: "pvc-x".into(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "capacity_range",
    );
    check(
        "NodeStageVolume without staging path",
        n.node_stage_volume(NodeStageVolumeRequest {
            volume_id: "pvc-x".into(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "staging_target_path",
    );
    check(
        "NodePublishVolume without capability",
        n.node_publish_volume(NodePublishVolumeRequest {
            volume_id: "pvc-x".into(),
            target_path: "/tmp/x".into(),
            staging_target_path: "/tmp/y".into(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "volume_capability",
    );
    check(
        "NodeStageVolume with an unsupported filesystem",
        n.node_stage_volume(NodeStageVolumeRequest {
            volume_id: "pvc-x".into(),
            staging_target_path: "/tmp/y".into(),
            volume_capability: Some(mount_cap("btrfs")),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "volume_capability: fs_type \"btrfs\"",
    );
    check(
        "NodeGetVolumeStats without path",
        n.node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: "pvc-x".into(),
            ..Default::default()
        })
        .await
        .map(|_| ()),
        "volume_path",
    );
    d.stop().await;
}

/// With `--kubelet-dir` (the chart sets it) the node plugin mounts and unmounts nowhere else:
/// a staging or target path outside is refused naming the field, before anything is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_paths_outside_the_kubelet_dir_are_refused() {
    let bed = bed_with_vm().await;
    let kubelet = bed.dir.path().join("kubelet");
    let d = Driver::start(&bed, |c| c.kubelet_dir = Some(kubelet.clone())).await;
    let mut n = d.node();
    let outside = bed.dir.path().join("elsewhere");
    let inside = kubelet.join("plugins/staging");
    let e = n
        .node_stage_volume(NodeStageVolumeRequest {
            volume_id: "pvc-x".into(),
            staging_target_path: outside.display().to_string(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        })
        .await
        .expect_err("staging outside the kubelet's directory");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("staging_target_path") && e.message().contains("--kubelet-dir"));
    assert!(!outside.exists(), "nothing made at {}", outside.display());
    let e = n
        .node_publish_volume(NodePublishVolumeRequest {
            volume_id: "pvc-x".into(),
            staging_target_path: inside.display().to_string(),
            target_path: "/etc/harvester-csi-test".into(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        })
        .await
        .expect_err("publishing outside the kubelet's directory");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("target_path"), "{e:?}");
    let e = n
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: "pvc-x".into(),
            target_path: "/etc".into(),
        })
        .await
        .expect_err("unpublishing /etc");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = n
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: "pvc-x".into(),
            volume_path: "/etc".into(),
            ..Default::default()
        })
        .await
        .expect_err("stats of /etc");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    d.stop().await;
}
