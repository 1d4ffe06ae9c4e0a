//! ListVolumes, ControllerGetVolume and GetSnapshot against the test bed (root: the stand-in
//! hot-plugs loop devices): pages and tokens, published nodes read from the VM and its VMI, the
//! volume condition when a disk leaves the VMI behind the driver's back (harvester/harvester
//! #10588: VM spec and VMI disagree), NOT_FOUND for what does not exist, ABORTED naming a bad
//! token.

use std::time::Duration;

use csi_proto::csi::v1::*;
use testbed::csi_client::{block_cap, create_request, snapshot_request};
use testbed::suites::csi::{Driver, NODE, assert_root, bed_with_vm, publish_request};
use tonic::Code;

/// ListVolumes from `token`, at most `max` entries.
fn list(token: &str, max: i32) -> ListVolumesRequest {
    ListVolumesRequest {
        max_entries: max,
        starting_token: token.into(),
    }
}

fn published(e: &list_volumes_response::Entry) -> Vec<String> {
    e.status
        .as_ref()
        .map(|s| s.published_node_ids.clone())
        .unwrap_or_default()
}

/// Volume `id`'s entry in one unpaged ListVolumes.
async fn listed_entry(
    c: &mut csi_proto::csi::v1::controller_client::ControllerClient<tonic::transport::Channel>,
    id: &str,
) -> list_volumes_response::Entry {
    let listed = c
        .list_volumes(list("", 0))
        .await
        .expect("list")
        .into_inner();
    listed
        .entries
        .into_iter()
        .find(|e| e.volume.as_ref().is_some_and(|v| v.volume_id == id))
        .unwrap_or_else(|| panic!("{id} is not listed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_list_in_pages_with_their_published_nodes_and_condition_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let mut c = d.controller();
    let mut ids = Vec::new();
    for name in ["pvc-list-a", "pvc-list-b", "pvc-list-c"] {
        let v = c
            .create_volume(create_request(name, 32 << 20, &block_cap()))
            .await
            .expect("CreateVolume")
            .into_inner()
            .volume
            .expect("volume");
        ids.push(v.volume_id);
    }
    let a = ids[0].clone();
    c.controller_publish_volume(publish_request(&a, &block_cap()))
        .await
        .expect("ControllerPublishVolume");

    // Two pages: 2 entries and a token, then the last one and no token.
    let first = c
        .list_volumes(list("", 2))
        .await
        .expect("page 1")
        .into_inner();
    assert_eq!(first.entries.len(), 2, "{first:?}");
    assert!(!first.next_token.is_empty(), "{first:?}");
    let second = c
        .list_volumes(list(&first.next_token, 2))
        .await
        .expect("page 2")
        .into_inner();
    assert!(second.next_token.is_empty(), "{second:?}");
    let all: Vec<_> = first.entries.iter().chain(&second.entries).collect();
    let listed: Vec<String> = all
        .iter()
        .filter_map(|e| e.volume.as_ref().map(|v| v.volume_id.clone()))
        .collect();
    assert_eq!(listed, ids, "every volume once, in order");
    for e in &all {
        let id = &e.volume.as_ref().expect("volume").volume_id;
        let want: Vec<String> = if *id == a { vec![NODE.into()] } else { vec![] };
        assert_eq!(published(e), want, "published nodes of {id}");
        let cond = e.status.as_ref().and_then(|s| s.volume_condition.clone());
        let cond = cond.unwrap_or_else(|| panic!("{id} has no condition: {e:?}"));
        // The published one is Bound and Ready; the others may still be binding.
        assert!(*id != a || !cond.abnormal, "{id}: {cond:?}");
    }

    // A bad token: ABORTED, naming it.
    let bad = c
        .list_volumes(list("page-two", 0))
        .await
        .expect_err("bad token");
    assert_eq!(bad.code(), Code::Aborted, "{bad:?}");
    assert!(bad.message().contains("page-two"), "{bad:?}");
    let past = c
        .list_volumes(list("99", 0))
        .await
        .expect_err("token past the end");
    assert_eq!(past.code(), Code::Aborted, "{past:?}");

    // ControllerGetVolume: published to NODE, normal; an unknown volume is NOT_FOUND.
    let got = c
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: a.clone(),
        })
        .await
        .expect("ControllerGetVolume")
        .into_inner();
    let status = got.status.expect("status");
    assert_eq!(status.published_node_ids, vec![NODE.to_string()]);
    assert!(!status.volume_condition.expect("condition").abnormal);
    let missing = c
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: "pvc-no-such-volume".into(),
        })
        .await
        .expect_err("unknown volume");
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");

    // #10588: the disk leaves the VMI (spec and status) while the VM spec keeps it. Under the
    // declarative gate alone KubeVirt's virt-controller would put it back at once, so this part
    // needs `HotplugVolumes` alone (the bed's default line).
    assert!(
        !bed.sim.hotplug.gates().declarative_controller(),
        "run this suite with the bed's default KubeVirt line (TESTBED_KUBEVIRT unset)"
    );
    bed.sim
        .drop_from_vmi(NODE, &[a.as_str()])
        .await
        .expect("dropping the disk from the VMI");
    let want = format!(
        "VM {}/{NODE} has the volume in its spec but its VMI does not report it Ready",
        bed.vm_namespace
    );
    // The driver's watch of VMIs sees it within its latency (bounded, not slept).
    let condition = testbed::util::wait::until(
        "the volume to be abnormal and published nowhere",
        Duration::from_secs(10),
        || {
            let mut c = c.clone();
            let a = a.clone();
            async move {
                let got = c
                    .controller_get_volume(ControllerGetVolumeRequest { volume_id: a })
                    .await
                    .map_err(|e| e.to_string())?
                    .into_inner();
                let status = got.status.unwrap_or_default();
                let cond = status.volume_condition.clone().unwrap_or_default();
                Ok(if cond.abnormal && status.published_node_ids.is_empty() {
                    Ok(cond.message)
                } else {
                    Err(status)
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(condition.contains(&want), "{condition}");
    let entry = listed_entry(&mut c, &a).await;
    assert!(published(&entry).is_empty(), "{entry:?}");

    // What the csi-attacher does at its resync for a VolumeAttachment whose node is not among
    // the published ones: ControllerPublishVolume again. The driver gives KubeVirt 15 s to take
    // the disk back, then removes it from the VM and hot-plugs it again.
    let t = std::time::Instant::now();
    let again = c
        .controller_publish_volume(publish_request(&a, &block_cap()))
        .await
        .expect("ControllerPublishVolume again")
        .into_inner();
    eprintln!(
        "re-published after the disk left the VMI in {:?}",
        t.elapsed()
    );
    assert!(again.publish_context.contains_key("serial"), "{again:?}");
    let entry = listed_entry(&mut c, &a).await;
    assert_eq!(published(&entry), vec![NODE.to_string()], "{entry:?}");

    // Unpublish; then every volume goes.
    c.controller_unpublish_volume(testbed::suites::csi::unpublish_request(&a))
        .await
        .expect("ControllerUnpublishVolume");
    for id in &ids {
        c.delete_volume(DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("DeleteVolume");
    }
    let after = c
        .list_volumes(list("", 0))
        .await
        .expect("list")
        .into_inner();
    assert!(after.entries.is_empty(), "{after:?}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_snapshot_finds_a_snapshot_and_not_what_does_not_exist_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let d = Driver::start(&bed, |_| {}).await;
    let mut c = d.controller();
    let v = c
        .create_volume(create_request("pvc-get-snap", 32 << 20, &block_cap()))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume");
    let snap = c
        .create_snapshot(snapshot_request("snap-get-1", &v.volume_id))
        .await
        .expect("CreateSnapshot")
        .into_inner()
        .snapshot
        .expect("snapshot");
    let got = c
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .expect("GetSnapshot")
        .into_inner()
        .snapshot
        .expect("snapshot");
    assert_eq!(got.snapshot_id, snap.snapshot_id);
    assert_eq!(got.source_volume_id, v.volume_id);
    for (id, code) in [
        ("snap-no-such", Code::NotFound),
        ("backup:default/no-such-backup", Code::NotFound),
        ("", Code::InvalidArgument),
    ] {
        let e = c
            .get_snapshot(GetSnapshotRequest {
                snapshot_id: id.into(),
                ..Default::default()
            })
            .await
            .expect_err(id);
        assert_eq!(e.code(), code, "{id:?}: {e:?}");
    }
    c.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        ..Default::default()
    })
    .await
    .expect("DeleteSnapshot");
    c.delete_volume(DeleteVolumeRequest {
        volume_id: v.volume_id,
        ..Default::default()
    })
    .await
    .expect("DeleteVolume");
    d.stop().await;
}
