//! Two guest clusters on one Harvester: each has its own Harvester ServiceAccount bound by
//! exactly deploy/harvester-rbac's documented bindings, its own CSI controller (in-process) and
//! its own cluster name, and neither can reach the other's volumes, snapshots, backups or VMs
//! through a volume, snapshot or node ID. Every attempt is refused with PERMISSION_DENIED naming
//! the object and the label it lacks, and the other cluster's objects are unchanged afterwards.
//! Tests named `_root` need root (the stand-in hot-plugs loop devices).

use std::time::Duration;

use csi_proto::csi::v1::*;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use harvester_csi_driver::Mode;
use harvester_csi_driver::controller::owner::LABEL_GUEST_CLUSTER;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;
use testbed::TestBed;
use testbed::csi_client::{backup_request, create_request, from_snapshot, from_volume, mount_cap};
use testbed::sim::GuestVm;
use testbed::sim::backup::backup_resource;
use testbed::suites::csi::{Driver, NODE, assert_root, bed_with_vm, publish_request};
use testbed::suites::deploy::{apply_all, harvester_rbac, wait_bindings};
use tonic::Code;

/// Cluster A's node is the bed's VM [`NODE`]; cluster B's is this one.
const B_NODE: &str = "b-worker-1";

/// A guest cluster's CSI controller with its own Harvester ServiceAccount `name` (in namespace
/// `ns`, bound by deploy/harvester-rbac's bindings there) and cluster name `name`.
async fn tenant(bed: &TestBed, ns: &str, name: &str) -> Driver {
    tenant_with(bed, ns, name, false).await.0
}

/// [`tenant`], with deploy/harvester-rbac/ownership-binding.yaml applied for it too when
/// `policed`; also the account's own Harvester client (what its token reaches directly).
async fn tenant_with(bed: &TestBed, ns: &str, name: &str, policed: bool) -> (Driver, kube::Client) {
    let mut docs = harvester_rbac(ns, name);
    if policed {
        docs.extend(ownership(ns, name));
    }
    apply_all(&bed.harvester.client, &docs, ns).await;
    let cloud_config = bed.dir.path().join(format!("cloud-config-{name}"));
    let access = testbed::bed::rbac::account_kubeconfig(
        &bed.harvester.client,
        &bed.harvester.url,
        &bed.pki,
        (ns, name),
        ns,
        &cloud_config,
    )
    .await
    .unwrap_or_else(|e| panic!("Harvester ServiceAccount {ns}/{name}: {e}"));
    wait_bindings(&access.client, &docs, ns, name).await;
    let socket = bed.dir.path().join(format!("csi-{name}.sock"));
    let driver = Driver::start(bed, |c| {
        c.endpoint = format!("unix://{}", socket.display());
        c.mode = Mode::Controller;
        c.cloud_config = Some(cloud_config);
        c.cluster_name = name.to_string();
        c.node_id = None;
    })
    .await;
    (driver, access.client)
}

/// deploy/harvester-rbac/ownership-policy.yaml and its binding for account `ns/sa`, cluster `sa`.
fn ownership(ns: &str, sa: &str) -> Vec<serde_json::Value> {
    let dir = testbed::suites::deploy::repo().join("deploy/harvester-rbac");
    let mut docs = Vec::new();
    for file in ["ownership-policy.yaml", "ownership-binding.yaml"] {
        let text = std::fs::read_to_string(dir.join(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"))
            .replace("${NAMESPACE}", ns)
            .replace("${SERVICE_ACCOUNT}", sa)
            .replace("${CLUSTER_NAME}", sa);
        docs.extend(testbed::suites::deploy::parse(&text));
    }
    docs
}

async fn label_vm(bed: &TestBed, vm: &str, cluster: &str) {
    let patch = json!({"metadata": {"labels": {LABEL_GUEST_CLUSTER: cluster}}});
    Api::<VirtualMachine>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
        .patch(vm, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("labelling VM {vm}: {e}"));
}

/// The refusal every cross-tenant request must get: PERMISSION_DENIED naming `name` and the
/// cluster label.
fn assert_refused<T: std::fmt::Debug>(what: &str, got: Result<T, tonic::Status>, name: &str) {
    let e = match got {
        Ok(v) => panic!("{what} must be refused, got {v:?}"),
        Err(e) => e,
    };
    assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
    assert!(
        e.message().contains(name) && e.message().contains(LABEL_GUEST_CLUSTER),
        "{what}: the refusal names {name} and the label: {e:?}"
    );
}

/// What cluster A has on Harvester that B must not change: each object's resourceVersion and
/// the hot-plugged volumes of A's VM and VMI.
async fn a_state(bed: &TestBed, volume: &str, snapshot: &str, backup: &str) -> Vec<String> {
    let h = &bed.harvester.client;
    let ns = &bed.vm_namespace;
    let pvc = Api::<PersistentVolumeClaim>::namespaced(h.clone(), ns)
        .get(volume)
        .await
        .expect("A's PVC");
    let vm = Api::<VirtualMachine>::namespaced(h.clone(), ns)
        .get(NODE)
        .await
        .expect("A's VM");
    let vmi = Api::<VirtualMachineInstance>::namespaced(h.clone(), ns)
        .get(NODE)
        .await
        .expect("A's VMI");
    let snaps = Api::<DynamicObject>::namespaced_with(
        h.clone(),
        ns,
        &kube::discovery::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "snapshot.storage.k8s.io",
            "v1",
            "VolumeSnapshot",
        )),
    );
    let snap = snaps.get(snapshot).await.expect("A's VolumeSnapshot");
    let vrb = Api::<DynamicObject>::namespaced_with(h.clone(), ns, &backup_resource())
        .get(backup)
        .await
        .expect("A's VolumeRemoteBackup");
    vec![
        format!("pvc {:?}", pvc.metadata.resource_version),
        format!("pvc spec {:?}", serde_json::to_string(&pvc.spec)),
        format!("vm volumes {:?}", vm.volume(volume).is_some()),
        format!("vm {:?}", vm.metadata.resource_version),
        format!("vmi has volume {}", vmi.has_volume(volume)),
        format!("snapshot {:?}", snap.metadata.resource_version),
        format!("backup {:?}", vrb.metadata.resource_version),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_clusters_sharing_a_namespace_cannot_reach_each_others_objects_root() {
    assert_root();
    let bed = bed_with_vm().await;
    bed.sim
        .create_vm(&GuestVm::new(B_NODE).on_host("harvester-1").ip("10.52.0.12"))
        .await
        .expect("cluster B's VM");
    label_vm(&bed, NODE, "tenant-a").await;
    label_vm(&bed, B_NODE, "tenant-b").await;
    let ns = bed.vm_namespace.clone();
    let a = tenant(&bed, &ns, "tenant-a").await;
    let b = tenant(&bed, &ns, "tenant-b").await;
    let cap = mount_cap("ext4");

    // Cluster A: a volume published to its node, a snapshot and a backup of it.
    let vol = a
        .controller()
        .create_volume(create_request("pvc-a-data", 16 << 20, &cap))
        .await
        .expect("A creates its volume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    a.controller()
        .controller_publish_volume(publish_request(&vol, &cap))
        .await
        .expect("A publishes to its own node");
    let snap = a
        .controller()
        .create_snapshot(CreateSnapshotRequest {
            name: "snap-a".into(),
            source_volume_id: vol.clone(),
            ..Default::default()
        })
        .await
        .expect("A snapshots its volume")
        .into_inner()
        .snapshot
        .expect("snapshot")
        .snapshot_id;
    let backup = a
        .controller()
        .create_snapshot(backup_request("backup-a", &vol))
        .await
        .expect("A backs its volume up")
        .into_inner()
        .snapshot
        .expect("backup")
        .snapshot_id;
    let backup_name = backup
        .rsplit('/')
        .next()
        .expect("backup:<ns>/<name>")
        .to_string();
    // The backup becomes ready (the stand-in copies the loop device): what B tries next must
    // fail on ownership, not on readiness.
    let vrbs = Api::<DynamicObject>::namespaced_with(
        bed.harvester.client.clone(),
        &ns,
        &backup_resource(),
    );
    testbed::util::wait::until("A's backup to succeed", Duration::from_secs(60), || {
        let vrbs = vrbs.clone();
        let name = backup_name.clone();
        async move {
            let vrb = vrbs.get(&name).await.map_err(|e| e.to_string())?;
            Ok(if vrb.data["status"]["success"] == json!(true) {
                Ok(())
            } else {
                Err(vrb.data["status"].clone())
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let before = a_state(&bed, &vol, &snap, &backup_name).await;

    // Cluster B, through its own controller, against each of A's objects.
    let mut c = b.controller();
    assert_refused(
        "B unpublishes A's volume from A's node",
        c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: vol.clone(),
            node_id: NODE.into(),
            ..Default::default()
        })
        .await,
        &vol,
    );
    let mut to_b = publish_request(&vol, &cap);
    to_b.node_id = B_NODE.into();
    assert_refused(
        "B publishes A's volume to its own node",
        c.controller_publish_volume(to_b).await,
        &vol,
    );
    assert_refused(
        "B deletes A's volume",
        c.delete_volume(DeleteVolumeRequest {
            volume_id: vol.clone(),
            ..Default::default()
        })
        .await,
        &vol,
    );
    assert_refused(
        "B expands A's volume",
        c.controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: vol.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 32 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await,
        &vol,
    );
    assert_refused(
        "B snapshots A's volume",
        c.create_snapshot(CreateSnapshotRequest {
            name: "snap-by-b".into(),
            source_volume_id: vol.clone(),
            ..Default::default()
        })
        .await,
        &vol,
    );
    assert_refused(
        "B backs A's volume up",
        c.create_snapshot(backup_request("backup-by-b", &vol)).await,
        &vol,
    );
    assert_refused(
        "B clones A's volume",
        c.create_volume(from_volume(
            create_request("pvc-b-clone", 16 << 20, &cap),
            &vol,
        ))
        .await,
        &vol,
    );
    assert_refused(
        "B restores A's snapshot",
        c.create_volume(from_snapshot(
            create_request("pvc-b-restore", 16 << 20, &cap),
            &snap,
        ))
        .await,
        &snap,
    );
    assert_refused(
        "B restores A's backup",
        c.create_volume(from_snapshot(
            create_request("pvc-b-from-backup", 16 << 20, &cap),
            &backup,
        ))
        .await,
        &backup_name,
    );
    assert_refused(
        "B deletes A's snapshot",
        c.delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: snap.clone(),
            ..Default::default()
        })
        .await,
        &snap,
    );
    assert_refused(
        "B deletes A's backup",
        c.delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: backup.clone(),
            ..Default::default()
        })
        .await,
        &backup_name,
    );
    assert_refused(
        "B reads A's volume",
        c.controller_get_volume(ControllerGetVolumeRequest {
            volume_id: vol.clone(),
        })
        .await,
        &vol,
    );
    assert_refused(
        "B reads A's snapshot",
        c.get_snapshot(GetSnapshotRequest {
            snapshot_id: snap.clone(),
            ..Default::default()
        })
        .await,
        &snap,
    );
    let listed = c
        .list_volumes(ListVolumesRequest::default())
        .await
        .expect("B lists its volumes")
        .into_inner();
    assert!(
        listed
            .entries
            .iter()
            .all(|e| e.volume.as_ref().is_some_and(|v| v.volume_id != vol)),
        "B's ListVolumes shows A's volume: {listed:?}"
    );
    let snaps = c
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .expect("B lists its snapshots")
        .into_inner();
    assert!(
        snaps.entries.is_empty(),
        "B's ListSnapshots shows A's snapshots or backups: {snaps:?}"
    );

    // B's own volume cannot be put into A's VM (a node of cluster A).
    let own = c
        .create_volume(create_request("pvc-b-data", 16 << 20, &cap))
        .await
        .expect("B creates its own volume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    assert_refused(
        "B publishes its volume to A's node",
        c.controller_publish_volume(publish_request(&own, &cap))
            .await,
        NODE,
    );
    // A node ID that is no VM name never reaches a Harvester URL.
    let mut crafted = publish_request(&own, &cap);
    crafted.node_id = "../../secrets/x".into();
    let e = c
        .controller_publish_volume(crafted)
        .await
        .expect_err("a crafted node ID");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("node_id"), "{e:?}");

    // Nothing of A's changed, and B made nothing from A's data.
    assert_eq!(a_state(&bed, &vol, &snap, &backup_name).await, before);
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(bed.harvester.client.clone(), &ns);
    for made in ["pvc-b-clone", "pvc-b-restore", "pvc-b-from-backup"] {
        assert!(
            pvcs.get_opt(made).await.expect("PVC read").is_none(),
            "B made {made} from A's data"
        );
    }
    // A still owns and serves all of it.
    let got = a
        .controller()
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: vol.clone(),
        })
        .await
        .expect("A reads its volume")
        .into_inner();
    assert_eq!(
        got.status.map(|s| s.published_node_ids),
        Some(vec![NODE.to_string()])
    );
    b.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_namespaces_backups_are_neither_listed_nor_restored_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let ns = bed.vm_namespace.clone();
    let a = tenant(&bed, &ns, "tenant-a").await;
    let cap = mount_cap("ext4");
    let vol = a
        .controller()
        .create_volume(create_request("pvc-a-data", 16 << 20, &cap))
        .await
        .expect("A creates its volume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    let backup = a
        .controller()
        .create_snapshot(backup_request("backup-a", &vol))
        .await
        .expect("A backs its volume up")
        .into_inner()
        .snapshot
        .expect("backup")
        .snapshot_id;

    // Cluster C lives in another Harvester namespace, bound by the default bindings there.
    let other_ns = "tenant-c-vms";
    let namespaces =
        Api::<k8s_openapi::api::core::v1::Namespace>::all(bed.harvester.client.clone());
    namespaces
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": other_ns}})).unwrap(),
        )
        .await
        .expect("namespace of cluster C");
    let c = tenant(&bed, other_ns, "tenant-c").await;
    let e = c
        .controller()
        .create_volume(from_snapshot(
            create_request("pvc-c-from-a", 16 << 20, &cap),
            &backup,
        ))
        .await
        .expect_err("restoring another namespace's backup");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("allowCrossNamespaceBackups") && e.message().contains(&backup),
        "the refusal names the backup and the value to set: {e:?}"
    );
    let listed = c
        .controller()
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .expect("C lists its snapshots")
        .into_inner();
    assert!(listed.entries.is_empty(), "C sees A's backup: {listed:?}");
    let by_id = c
        .controller()
        .list_snapshots(ListSnapshotsRequest {
            snapshot_id: backup.clone(),
            ..Default::default()
        })
        .await
        .expect("C lists by ID")
        .into_inner();
    assert!(
        by_id.entries.is_empty(),
        "C sees A's backup by ID: {by_id:?}"
    );
    let restores = Api::<PersistentVolumeClaim>::namespaced(bed.harvester.client.clone(), other_ns);
    assert!(
        restores
            .get_opt("pvc-c-from-a")
            .await
            .expect("read")
            .is_none(),
        "nothing restored in C's namespace"
    );
    c.stop().await;
    a.stop().await;
}

/// A host PVC of `size` in `ns`, labelled for `cluster` when given.
fn host_pvc(name: &str, cluster: Option<&str>) -> PersistentVolumeClaim {
    let labels = cluster.map(|c| json!({LABEL_GUEST_CLUSTER: c}));
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"accessModes": ["ReadWriteMany"], "volumeMode": "Block",
                 "resources": {"requests": {"storage": "16Mi"}}}
    }))
    .expect("PVC literal")
}

/// Harvester's admission refusing the account's own write: 403 from the ownership policy.
fn assert_policed<T: std::fmt::Debug>(what: &str, got: Result<T, kube::Error>) {
    match got {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{what}: {s:?}");
            assert!(
                s.message.contains("does not belong to guest cluster"),
                "{what}: {s:?}"
            );
        }
        other => panic!("{what} must be refused by the ownership policy, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ownership_policy_stops_a_token_used_directly_and_lets_the_driver_work_root() {
    assert_root();
    let bed = bed_with_vm().await;
    let ns = bed.vm_namespace.clone();
    let (a, a_token) = tenant_with(&bed, &ns, "tenant-a", true).await;
    let (b, b_token) = tenant_with(&bed, &ns, "tenant-b", true).await;
    let cap = mount_cap("ext4");
    let b_vms_client = b_token.clone();
    let b_pvcs = Api::<PersistentVolumeClaim>::namespaced(b_token, &ns);
    // The API server compiles a new policy asynchronously: wait until it refuses B's
    // unlabelled PVC (a dry run), before anything is tried under it.
    testbed::util::wait::until(
        "the ownership policy in force",
        Duration::from_secs(60),
        || {
            let b_pvcs = b_pvcs.clone();
            async move {
                let dry = kube::api::PostParams {
                    dry_run: true,
                    ..Default::default()
                };
                Ok(
                    match b_pvcs.create(&dry, &host_pvc("pvc-b-probe", None)).await {
                        Err(kube::Error::Api(s)) if s.code == 403 => Ok(()),
                        other => Err(format!("{:?}", other.map(|_| "admitted"))),
                    },
                )
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Under the policy, cluster A's driver does everything it does: create, publish, snapshot,
    // back up, restore (labelling the PVC Harvester made), unpublish, delete.
    let mut c = a.controller();
    let vol = c
        .create_volume(create_request("pvc-a-data", 16 << 20, &cap))
        .await
        .expect("A creates its volume under the policy")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    c.controller_publish_volume(publish_request(&vol, &cap))
        .await
        .expect("A publishes");
    let snap = c
        .create_snapshot(CreateSnapshotRequest {
            name: "snap-a".into(),
            source_volume_id: vol.clone(),
            ..Default::default()
        })
        .await
        .expect("A snapshots")
        .into_inner()
        .snapshot
        .expect("snapshot")
        .snapshot_id;
    let backup = c
        .create_snapshot(backup_request("backup-a", &vol))
        .await
        .expect("A backs up")
        .into_inner()
        .snapshot
        .expect("backup")
        .snapshot_id;
    let restored = testbed::util::wait::until("A's restore", Duration::from_secs(90), || {
        let mut c = c.clone();
        let backup = backup.clone();
        let cap = cap.clone();
        async move {
            match c
                .create_volume(from_snapshot(
                    create_request("pvc-a-restored", 16 << 20, &cap),
                    &backup,
                ))
                .await
            {
                Ok(r) => Ok(Ok(r.into_inner().volume.expect("volume").volume_id)),
                Err(e) if matches!(e.code(), Code::Unavailable) => Ok(Err(e.message().to_string())),
                Err(e) => Err(format!("restore: {e:?}")),
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(bed.harvester.client.clone(), &ns);
    let labels = pvcs
        .get(&restored)
        .await
        .expect("restored PVC")
        .metadata
        .labels;
    assert_eq!(
        labels
            .and_then(|l| l.get(LABEL_GUEST_CLUSTER).cloned())
            .as_deref(),
        Some("tenant-a"),
        "the restored PVC is labelled for A"
    );

    // Cluster B's token, used directly: no write to A's objects, no unlabelled object.
    assert_policed(
        "B deletes A's PVC with its token",
        b_pvcs.delete(&vol, &Default::default()).await,
    );
    let steal = json!({"metadata": {"labels": {LABEL_GUEST_CLUSTER: "tenant-b"}}});
    assert_policed(
        "B relabels A's PVC as its own",
        b_pvcs
            .patch(&vol, &PatchParams::default(), &Patch::Merge(&steal))
            .await,
    );
    assert_policed(
        "B creates an unlabelled PVC",
        b_pvcs
            .create(&Default::default(), &host_pvc("pvc-b-bare", None))
            .await,
    );
    assert_policed(
        "B creates a PVC labelled for A",
        b_pvcs
            .create(
                &Default::default(),
                &host_pvc("pvc-b-as-a", Some("tenant-a")),
            )
            .await,
    );
    b_pvcs
        .create(
            &Default::default(),
            &host_pvc("pvc-b-own", Some("tenant-b")),
        )
        .await
        .expect("B may create its own labelled PVC");
    // The driver's role may patch VMs (a stopped VM's hot-plugged volumes): under the policy only
    // its own cluster's.
    label_vm(&bed, NODE, "tenant-a").await;
    let b_vms = Api::<VirtualMachine>::namespaced(b_vms_client.clone(), &ns);
    let touch = json!({"metadata": {"annotations": {"testbed/touched": "yes"}}});
    assert_policed(
        "B patches A's VM",
        b_vms
            .patch(NODE, &PatchParams::default(), &Patch::Merge(&touch))
            .await,
    );
    let dry = PatchParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<VirtualMachine>::namespaced(a_token, &ns)
        .patch(NODE, &dry, &Patch::Merge(&touch))
        .await
        .expect("A may patch its own VM");

    // A cleans up through its driver.
    c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: vol.clone(),
        node_id: NODE.into(),
        ..Default::default()
    })
    .await
    .expect("A unpublishes");
    for id in [&snap, &backup] {
        c.delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: id.to_string(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("A deletes {id}: {e:?}"));
    }
    for id in [&restored, &vol] {
        c.delete_volume(DeleteVolumeRequest {
            volume_id: id.to_string(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("A deletes {id}: {e:?}"));
    }
    b.stop().await;
    a.stop().await;
}
