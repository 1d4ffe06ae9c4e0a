//! Least privilege, proven: the programs run in-process against the test bed (RBAC on) with
//! ServiceAccount tokens bound only to the charts' guest RBAC and to deploy/harvester-rbac, and
//! their flows pass without one Forbidden answer from either API server (counted from the API
//! servers' own authorization metrics, so a refusal the program swallowed still counts).
//! The converse, a missing verb failing with a clear Forbidden: deploy_rbac_forbidden.rs.

use std::collections::HashMap;
use std::time::Duration;

use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::node_client::NodeClient;
use csi_proto::csi::v1::volume_capability::access_mode::Mode;
use csi_proto::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
use csi_proto::csi::v1::*;
use harvester_cloud_provider::Config;
use harvester_cloud_provider::leader::{LeaderConfig, run_as_leader};
use harvester_cloud_provider::node::patch::SHUTDOWN_TAINT;
use harvester_cloud_provider::service::annotations::{
    ANN_NETWORK, ANN_PRIMARY_SERVICE, KUBE_VIP_INTERFACE,
};
use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_cloud_provider::service::{NAD_MAPPING_KEY, NAD_MAPPING_NAME, NAD_MAPPING_NAMESPACE};
use harvester_common::harvester::{IPPool, LoadBalancer};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Service};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use testbed::csi_client::{
    backup_request, create_request, from_snapshot, mount_cap, snapshot_request,
};
use testbed::sim::GuestVm;
use testbed::suites::deploy::*;
use testbed::{BedOptions, TestBed, util::wait};
use tokio::sync::oneshot;
use tonic::transport::Channel;

const LIMIT: Duration = Duration::from_secs(30);

async fn until<T, S: std::fmt::Debug, F, Fut>(what: &str, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Result<T, S>, String>>,
{
    wait::until(what, LIMIT, probe)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

fn cp_taints(node: &Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|t| {
            t.iter()
                .map(|t| t.key.clone())
                .filter(|k| k.starts_with("node.cloudprovider.kubernetes.io/"))
                .collect()
        })
        .unwrap_or_default()
}

async fn node_until(bed: &TestBed, what: &str, check: impl Fn(Option<&Node>) -> bool) {
    let api: Api<Node> = Api::all(bed.guest.client.clone());
    let check = &check;
    until(what, || {
        let api = api.clone();
        async move {
            let node = api.get_opt("worker-1").await.map_err(|e| e.to_string())?;
            Ok(if check(node.as_ref()) {
                Ok(())
            } else {
                Err(node.map(|n| n.spec.map(|s| (s.provider_id, s.taints))))
            })
        }
    })
    .await
}

#[tokio::test]
async fn cloud_provider_runs_node_and_load_balancer_flows_with_only_the_documented_rbac() {
    let bed = TestBed::started().await;
    worker_vm(&bed).await;
    Api::<IPPool>::all(bed.harvester.client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "IPPool",
                "metadata": {"name": "pool-1"},
                "spec": {"ranges": [{"subnet": "192.168.50.0/24", "rangeStart": "192.168.50.10",
                                     "rangeEnd": "192.168.50.19"}],
                         "selector": {"scope": [{"project": "*", "namespace": "*", "guestCluster": "*"}]}}
            }))
            .expect("pool literal"),
        )
        .await
        .expect("pool");

    let chart = ccm_chart();
    let harvester_docs = harvester_rbac_of(&bed.vm_namespace, HARVESTER_CCM_ROLES);
    let accounts = accounts(&bed, &chart, Some(CCM_SA), &harvester_docs).await;
    let before = refusals(&bed).await;
    let argv = ccm_args(&chart, &accounts);
    eprintln!("running {argv:?}");
    let ccm = harvester_cloud_provider::spawn(Config::from_args(&argv).expect("chart flags"));

    // Node: initialised (nodes/status and nodes patch, VM/VMI watches, Events).
    bed.sim.create_guest_node("worker-1").await.expect("node");
    node_until(&bed, "Node initialised", |n| {
        n.is_some_and(|n| {
            cp_taints(n).is_empty()
                && n.spec
                    .as_ref()
                    .and_then(|s| s.provider_id.as_deref())
                    .is_some_and(|p| p.starts_with("harvester://"))
        })
    })
    .await;

    // LoadBalancer: finalizer, CR created, address allocated, Service annotated (with the
    // interface of its network, from the NAD mapping ConfigMap) and given its ingress, the CR's
    // status.address mirrored; a second Service shares the address (it reads its primary);
    // then both deleted, with the CR.
    let configmaps: Api<ConfigMap> =
        Api::namespaced(bed.guest.client.clone(), NAD_MAPPING_NAMESPACE);
    configmaps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": NAD_MAPPING_NAME},
                "data": {NAD_MAPPING_KEY: r#"{"default/vlan10": "enp2s0"}"#}
            }))
            .expect("ConfigMap literal"),
        )
        .await
        .expect("NAD mapping");
    let services: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    for (name, port, annotations) in [
        ("web", 80, json!({ANN_NETWORK: "default/vlan10"})),
        ("web-2", 8080, json!({ANN_PRIMARY_SERVICE: "default/web"})),
    ] {
        services
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": name, "annotations": annotations},
                    "spec": {"type": "LoadBalancer", "selector": {"app": "web"},
                             "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}
                }))
                .expect("service literal"),
            )
            .await
            .expect("service");
    }
    let address = |name: &'static str| {
        let services = services.clone();
        async move {
            until(&format!("Service {name} gets an address"), || {
                let services = services.clone();
                async move {
                    let svc = services.get(name).await.map_err(|e| e.to_string())?;
                    Ok(match ingress_ip(&svc) {
                        Some(ip) => Ok((ip, svc)),
                        None => Err(svc.metadata.annotations),
                    })
                }
            })
            .await
        }
    };
    let (ip, web) = address("web").await;
    assert_eq!(
        web.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(KUBE_VIP_INTERFACE))
            .map(String::as_str),
        Some("enp2s0"),
        "the interface of the Service's network, from {NAD_MAPPING_NAMESPACE}/{NAD_MAPPING_NAME}"
    );
    let (shared, _) = address("web-2").await;
    assert_eq!(shared, ip, "web-2 shares the address of its primary");
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let selector = format!("cloudprovider.harvesterhci.io/cluster={CLUSTER}");
    until("the CR mirrors the address in status.address", || {
        let crs = crs.clone();
        let selector = selector.clone();
        let ip = ip.clone();
        async move {
            let list = crs
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?;
            let addresses: Vec<Option<String>> = list
                .items
                .iter()
                .map(|c| c.status.as_ref().and_then(|s| s.address.clone()))
                .collect();
            Ok(if addresses == [Some(ip)] {
                Ok(())
            } else {
                Err(addresses)
            })
        }
    })
    .await;
    for name in ["web-2", "web"] {
        services
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete service");
    }
    until("Services and their CR gone", || {
        let services = services.clone();
        let crs = crs.clone();
        let selector = selector.clone();
        async move {
            let svc = services
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .filter(|s| s.metadata.name.as_deref() != Some("kubernetes"))
                .map(|s| (s.metadata.name, s.metadata.finalizers))
                .collect::<Vec<_>>();
            let left = crs
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            Ok(if svc.is_empty() && left == 0 {
                Ok(())
            } else {
                Err((svc, left))
            })
        }
    })
    .await;

    // Lifecycle: a stopped VM taints its Node; a deleted VM deletes it.
    bed.sim.stop_vm("worker-1").await.expect("stop");
    node_until(&bed, "shutdown taint", |n| {
        n.is_some_and(|n| cp_taints(n).iter().any(|k| k == SHUTDOWN_TAINT))
    })
    .await;
    bed.sim.delete_vm("worker-1").await.expect("delete vm");
    node_until(&bed, "Node deleted with its VM", |n| n.is_none()).await;

    assert!(!ccm.is_finished(), "the cloud provider ended early");
    ccm.stop().await.expect("the cloud provider stops cleanly");
    let after = refusals(&bed).await;
    assert_eq!(
        after, before,
        "(guest, Harvester) Forbidden answers before and after the run: the documented RBAC is not enough"
    );
}

#[tokio::test]
async fn cloud_provider_leader_election_fits_the_chart_role() {
    let bed = TestBed::started().await;
    let chart = ccm_chart();
    let harvester_docs = harvester_rbac_of(&bed.vm_namespace, HARVESTER_CCM_ROLES);
    let accounts = accounts(&bed, &chart, Some(CCM_SA), &harvester_docs).await;
    let guest = accounts.guest.clone().expect("guest client");
    let before = refusals(&bed).await;

    let (stop, stopped) = oneshot::channel::<()>();
    let (led, leading) = oneshot::channel::<()>();
    // The Lease the chart's command line names.
    let c = container(
        find(&chart, "Deployment", "harvester-cloud-provider"),
        "harvester-cloud-provider",
    );
    let flag = |name: &str| {
        args(c)
            .iter()
            .find_map(|a| a.strip_prefix(&format!("--{name}=")).map(String::from))
            .unwrap_or_else(|| panic!("the chart passes --{name}"))
    };
    let (namespace, lease_name) = (
        flag("leader-elect-resource-namespace"),
        flag("leader-elect-resource-name"),
    );
    let config = LeaderConfig {
        lease_duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(200),
        ..LeaderConfig::new(&namespace, &lease_name, "replica-a")
    };
    let task = tokio::spawn(run_as_leader(
        guest,
        config,
        async {
            let _ = stopped.await;
        },
        move |mut stop| async move {
            let _ = led.send(());
            let _ = stop.wait_for(|s| *s).await;
        },
    ));
    tokio::time::timeout(LIMIT, leading)
        .await
        .expect("replica-a leads within 30 s with the chart's Role (get, create)")
        .expect("leader work started");
    let leases: Api<Lease> = Api::namespaced(bed.guest.client.clone(), &namespace);
    let renewed = |l: &Lease| l.spec.as_ref().and_then(|s| s.renew_time.clone());
    let first = leases.get(&lease_name).await.expect("the Lease exists");
    assert_eq!(
        first
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref()),
        Some("replica-a")
    );
    until("the leader renews its Lease (update)", || {
        let leases = leases.clone();
        let was = renewed(&first);
        let lease_name = lease_name.clone();
        async move {
            let now = leases.get(&lease_name).await.map_err(|e| e.to_string())?;
            Ok(if renewed(&now) != was {
                Ok(())
            } else {
                Err(was)
            })
        }
    })
    .await;
    let _ = stop.send(());
    tokio::time::timeout(LIMIT, task)
        .await
        .expect("leader election stops")
        .expect("task")
        .expect("leader election ends without error");
    assert_eq!(refusals(&bed).await, before, "no Forbidden answer");
}

/// The CSI driver in-process on a socket in the bed's directory, with `cloud_config`, in `mode`
/// (as the chart's pods run it: `controller` in the Deployment, `node` in the DaemonSet).
struct Driver {
    channel: Channel,
    running: harvester_csi_driver::Running,
}

impl Driver {
    async fn start(
        bed: &TestBed,
        cloud_config: &std::path::Path,
        mode: harvester_csi_driver::Mode,
        node_id: Option<&str>,
    ) -> Driver {
        let socket = bed.dir.path().join(format!("csi-{mode:?}.sock"));
        let mut config =
            harvester_csi_driver::Config::new(format!("unix://{}", socket.display()), cloud_config);
        config.mode = mode;
        config.node_id = node_id.map(String::from);
        config.disk_by_id_dir = bed.sim.by_id_dir("worker-1");
        // The guest side (Nodes, for the out-of-service taint) is not what this file proves.
        config.guest_kubeconfig = Some(bed.guest.kubeconfig.clone());
        let running = harvester_csi_driver::spawn(config);
        until("the driver's socket", || {
            let socket = socket.clone();
            let finished = running.is_finished();
            async move {
                if finished {
                    return Err("the driver ended while starting".to_string());
                }
                Ok(if socket.exists() { Ok(()) } else { Err(()) })
            }
        })
        .await;
        let channel = harvester_csi_driver::connect(&socket)
            .await
            .expect("connecting to the driver");
        Driver { channel, running }
    }

    async fn stop(self) {
        match tokio::time::timeout(Duration::from_secs(20), self.running.stop()).await {
            Ok(Ok(())) => {}
            other => panic!("the driver did not stop cleanly: {other:?}"),
        }
    }
}

impl AsRef<Channel> for Driver {
    fn as_ref(&self) -> &Channel {
        &self.channel
    }
}

/// Harvester's default StorageClass (PVCs without a class get it; it lets them grow).
async fn harvester_storage_class(bed: &TestBed) {
    let sc: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "harvester-longhorn",
                     "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
        "provisioner": "driver.longhorn.io",
        "allowVolumeExpansion": true,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate"
    }))
    .expect("StorageClass literal");
    Api::<StorageClass>::all(bed.harvester.client.clone())
        .create(&PostParams::default(), &sc)
        .await
        .expect("Harvester StorageClass");
}

/// CreateVolume `name` (128 MiB, mount) from snapshot `snapshot_id`.
fn restore_request(name: &str, snapshot_id: &str) -> CreateVolumeRequest {
    from_snapshot(
        create_request(name, 128 << 20, &mount_cap("ext4")),
        snapshot_id,
    )
}

#[tokio::test]
async fn csi_controller_runs_the_volume_flow_with_only_the_documented_harvester_role() {
    let bed = TestBed::started_with(BedOptions::hotplugging()).await;
    harvester_storage_class(&bed).await;
    worker_vm(&bed).await;
    let harvester_docs = harvester_rbac_of(&bed.vm_namespace, HARVESTER_CSI_ROLES);
    let accounts = accounts(&bed, &[], None, &harvester_docs).await;
    let before = refusals(&bed).await;
    let driver = Driver::start(
        &bed,
        &accounts.cloud_config,
        harvester_csi_driver::Mode::Controller,
        None,
    )
    .await;
    let mut c = ControllerClient::new(driver.channel.clone());

    // CreateVolume, naming a Harvester class (the optional StorageClass read).
    let params = HashMap::from([("hostStorageClass".to_string(), "harvester-longhorn".into())]);
    let vol = c
        .create_volume(CreateVolumeRequest {
            parameters: params,
            ..create_request("pvc-rbac-proof", 64 << 20, &mount_cap("ext4"))
        })
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume");
    let id = vol.volume_id.clone();

    // ControllerPublish: hot-plug through virt-api (the aggregator checks addvolume), wait Ready.
    let published = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: id.clone(),
            node_id: "worker-1".into(),
            volume_capability: Some(mount_cap("ext4")),
            ..Default::default()
        })
        .await
        .expect("ControllerPublishVolume")
        .into_inner();
    assert!(
        published.publish_context.values().any(|v| !v.is_empty()),
        "the publish context names the disk: {published:?}"
    );

    // Expand, snapshot, restore.
    c.controller_expand_volume(ControllerExpandVolumeRequest {
        volume_id: id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: 128 << 20,
            limit_bytes: 0,
        }),
        volume_capability: Some(mount_cap("ext4")),
        ..Default::default()
    })
    .await
    .expect("ControllerExpandVolume");
    let snap = c
        .create_snapshot(snapshot_request("snap-rbac-proof", &id))
        .await
        .expect("CreateSnapshot")
        .into_inner()
        .snapshot
        .expect("snapshot");
    let listed = c
        .list_snapshots(ListSnapshotsRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .expect("ListSnapshots")
        .into_inner();
    assert_eq!(listed.entries.len(), 1, "{listed:?}");
    let restored = c
        .create_volume(restore_request("pvc-rbac-restored", &snap.snapshot_id))
        .await
        .expect("CreateVolume from a snapshot")
        .into_inner()
        .volume
        .expect("restored volume");

    // A remote backup (`type: backup`): taken, listed by its source, restored, deleted.
    let backup = c
        .create_snapshot(backup_request("backup-rbac-proof", &id))
        .await
        .expect("CreateSnapshot type=backup")
        .into_inner()
        .snapshot
        .expect("backup");
    assert!(backup.ready_to_use, "{backup:?}");
    let listed = c
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .expect("ListSnapshots by source")
        .into_inner();
    assert!(
        listed
            .entries
            .iter()
            .any(|e| e.snapshot.as_ref().map(|s| &s.snapshot_id) == Some(&backup.snapshot_id)),
        "{listed:?}"
    );
    let from_backup = c
        .create_volume(restore_request("pvc-rbac-from-backup", &backup.snapshot_id))
        .await
        .expect("CreateVolume from a backup")
        .into_inner()
        .volume
        .expect("volume restored from a backup");

    // An RWX volume (Harvester 1.4+; the role harvester-guest-csi-driver-rwx bound in
    // harvester-system): Harvester's default class found by listing (a Longhorn one), the
    // NetworkFilesystem listed, created with the volume and deleted with it.
    let rwx = c
        .create_volume(CreateVolumeRequest {
            name: "pvc-rbac-rwx".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume::default())),
                access_mode: Some(AccessMode {
                    mode: Mode::MultiNodeMultiWriter as i32,
                }),
            }],
            ..Default::default()
        })
        .await
        .expect("CreateVolume RWX")
        .into_inner()
        .volume
        .expect("RWX volume");
    let nfs: Api<harvester_common::harvester::NetworkFilesystem> =
        Api::namespaced(bed.harvester.client.clone(), "harvester-system");
    assert_eq!(
        nfs.list(&ListParams::default())
            .await
            .expect("listing NetworkFilesystems")
            .items
            .len(),
        1,
        "CreateVolume RWX made its NetworkFilesystem"
    );
    c.delete_volume(DeleteVolumeRequest {
        volume_id: rwx.volume_id,
        ..Default::default()
    })
    .await
    .expect("DeleteVolume RWX");
    assert!(
        nfs.list(&ListParams::default())
            .await
            .expect("listing NetworkFilesystems")
            .items
            .is_empty(),
        "DeleteVolume RWX deleted its NetworkFilesystem"
    );

    // And back down: unpublish (removevolume, wait until gone), delete everything.
    c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: id.clone(),
        node_id: "worker-1".into(),
        ..Default::default()
    })
    .await
    .expect("ControllerUnpublishVolume");
    c.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .expect("DeleteSnapshot");
    c.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: backup.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .expect("DeleteSnapshot of the backup");
    for v in [id, restored.volume_id, from_backup.volume_id] {
        c.delete_volume(DeleteVolumeRequest {
            volume_id: v,
            ..Default::default()
        })
        .await
        .expect("DeleteVolume");
    }

    // A node powered off for good, confirmed by the out-of-service taint: its volume leaves the
    // stopped VM with the documented role too (the driver edits the VM where KubeVirt does not).
    let off =
        testbed::suites::csi::create_volume(&driver, "pvc-rbac-off", &mount_cap("ext4")).await;
    c.controller_publish_volume(testbed::suites::csi::publish_request(
        &off,
        &mount_cap("ext4"),
    ))
    .await
    .expect("ControllerPublishVolume");
    bed.sim.power_off_vm("worker-1").await.expect("power off");
    bed.sim
        .create_guest_node("worker-1")
        .await
        .expect("guest Node");
    testbed::suites::csi::taint_out_of_service(&bed, "worker-1").await;
    c.controller_unpublish_volume(testbed::suites::csi::unpublish_request(&off))
        .await
        .expect("ControllerUnpublishVolume from the stopped VM");
    c.delete_volume(DeleteVolumeRequest {
        volume_id: off,
        ..Default::default()
    })
    .await
    .expect("DeleteVolume");
    driver.stop().await;

    // The node plugin's reads at start: the VMI named like the node, else every VMI (a match by
    // MAC address); here neither matches, so the node ID stays the name it was given.
    let node = Driver::start(
        &bed,
        &accounts.cloud_config,
        harvester_csi_driver::Mode::Node,
        Some("guest-hostname"),
    )
    .await;
    let info = NodeClient::new(node.channel.clone())
        .node_get_info(NodeGetInfoRequest {})
        .await
        .expect("NodeGetInfo")
        .into_inner();
    assert_eq!(info.node_id, "guest-hostname");
    node.stop().await;
    assert_eq!(
        refusals(&bed).await,
        before,
        "(guest, Harvester) Forbidden answers before and after the run: the documented role is not enough"
    );
}

/// The guest node `worker-1`: a VM on host `harvester-1` (region-a, zone-1).
async fn worker_vm(bed: &TestBed) {
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    bed.sim
        .create_vm(
            &GuestVm::new("worker-1")
                .on_host("harvester-1")
                .ip("10.52.0.11"),
        )
        .await
        .expect("vm");
}

/// Verbs that change something.
const WRITES: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

/// The node plugin's own Harvester account (deploy/harvester-rbac/csi-node.yaml and
/// csi-node-binding.yaml): it may write nothing that any role of deploy/harvester-rbac grants,
/// may read what the node plugin reads, and the node plugin runs with it without one Forbidden.
#[tokio::test]
async fn csi_node_plugin_account_reads_only() {
    let bed = TestBed::started_with(BedOptions::hotplugging()).await;
    worker_vm(&bed).await;
    let node_docs = csi_node_rbac(&bed.vm_namespace, CLUSTER);
    for role in node_docs.iter().filter(|d| d["kind"] == "ClusterRole") {
        for rule in role["rules"].as_array().expect("rules") {
            for verb in rule["verbs"].as_array().expect("verbs") {
                assert!(
                    ["get", "list", "watch"].contains(&verb.as_str().expect("verb")),
                    "{} grants {verb}: {rule}",
                    role["metadata"]["name"]
                );
            }
        }
    }
    let accounts = accounts(&bed, &[], None, &node_docs).await;
    let ns = bed.vm_namespace.clone();
    // Every resource any Harvester role of this project grants, asked with every write verb, in
    // the VM namespace and in harvester-system: all refused.
    let mut asked = 0;
    let controller_roles = harvester_rbac(&ns, "controller");
    for role in controller_roles
        .iter()
        .filter(|d| d["kind"] == "ClusterRole")
    {
        for rule in role["rules"].as_array().expect("rules") {
            let groups = rule["apiGroups"].as_array().expect("apiGroups");
            let resources = rule["resources"].as_array().expect("resources");
            for (group, resource) in groups
                .iter()
                .flat_map(|g| resources.iter().map(move |r| (g, r)))
            {
                let resource = resource.as_str().expect("resource");
                let (resource, subresource) = match resource.split_once('/') {
                    Some((r, s)) => (r, Some(s)),
                    None => (resource, None),
                };
                for namespace in [ns.as_str(), "harvester-system"] {
                    for verb in WRITES {
                        let access = testbed::bed::rbac::Access {
                            verb,
                            group: group.as_str().expect("group"),
                            resource,
                            subresource,
                            namespace: Some(namespace),
                            name: None,
                        };
                        let allowed = testbed::bed::rbac::allowed(&accounts.harvester, &access)
                            .await
                            .expect("SelfSubjectAccessReview");
                        assert!(!allowed, "the node plugin's account may {access:?}");
                        asked += 1;
                    }
                }
            }
        }
    }
    assert!(
        asked > 50,
        "only {asked} writes asked: the roles were not read"
    );
    // What the node plugin reads.
    for (verb, group, resource, namespace) in [
        ("get", "kubevirt.io", "virtualmachineinstances", ns.as_str()),
        (
            "list",
            "kubevirt.io",
            "virtualmachineinstances",
            ns.as_str(),
        ),
        ("get", "", "persistentvolumeclaims", ns.as_str()),
        (
            "get",
            "harvesterhci.io",
            "networkfilesystems",
            "harvester-system",
        ),
    ] {
        let access = testbed::bed::rbac::Access {
            verb,
            group,
            resource,
            namespace: Some(namespace),
            ..Default::default()
        };
        assert!(
            testbed::bed::rbac::allowed(&accounts.harvester, &access)
                .await
                .expect("SelfSubjectAccessReview"),
            "the node plugin's account may not {access:?}"
        );
    }
    let before = refusals(&bed).await;
    for (given, want) in [
        ("worker-1", "worker-1"),
        ("guest-hostname", "guest-hostname"),
    ] {
        let node = Driver::start(
            &bed,
            &accounts.cloud_config,
            harvester_csi_driver::Mode::Node,
            Some(given),
        )
        .await;
        let info = NodeClient::new(node.channel.clone())
            .node_get_info(NodeGetInfoRequest {})
            .await
            .expect("NodeGetInfo")
            .into_inner();
        assert_eq!(info.node_id, want);
        node.stop().await;
    }
    assert_eq!(
        refusals(&bed).await,
        before,
        "(guest, Harvester) Forbidden answers before and after: the node role is not enough"
    );
}
