//! A user's day on a real guest cluster (issue 15): kubelet 1.34.4 + containerd, the control
//! plane and both charts installed with helm (`BedOptions { real_node: true }`); every step is
//! driven by the real kubelet, scheduler, controllers and CSI sidecars, and each checks the end
//! state on both clusters. One bed for the whole day (the node's network uses fixed addresses,
//! so one real cluster per machine); each step is its own function and names what failed.
//! Needs root and `make node-tools`.

use std::collections::BTreeMap;
use std::time::Duration;

use harvester_common::harvester::{LoadBalancer, VirtualMachine};
use harvester_common::quantity;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::json;
use testbed::bed::guest_cluster::{
    self, CLUSTER_NAME, CSI_RELEASE, GuestCluster, HOST_BY_ID, NAMESPACE, NODE, REGION, WORKLOAD,
    ZONE, events_of, wait_daemonset, wait_pod_ready, workload_command,
};
use testbed::bed::users_cluster::{self, LB_POOL_SUBNET, TRY_LB_SERVICE, TRY_LB_SERVICE_NAME};
use testbed::real::node::{KUBELET_SYSCTLS, SysctlSnapshot, kubepods_cgroups};
use testbed::real::pod_logs::LogWatch;
use testbed::{TestBed, util::wait};

#[path = "real_cluster/heal.rs"]
mod heal;
#[path = "real_cluster/rotate.rs"]
mod rotate;

const DRIVER: &str = "driver.harvesterhci.io";
const POD_READY: Duration = Duration::from_secs(150);
const NS: &str = "default";

fn api<K>(bed: &TestBed) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    <K as Resource>::DynamicType: Default,
{
    Api::namespaced(bed.guest.client.clone(), NS)
}

/// Each step's time on stderr, past libtest's capture, so a passing run shows where this
/// suite's minutes go (docs/testbed.md, "Test time").
struct Steps(std::time::Instant);

impl Steps {
    fn new() -> Steps {
        Steps(std::time::Instant::now())
    }

    fn done(&mut self, step: &str) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "[real_cluster] {step}: {:.1}s",
            self.0.elapsed().as_secs_f64()
        );
        self.0 = std::time::Instant::now();
    }
}

#[tokio::test]
async fn a_users_day_on_a_real_guest_cluster_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root (containerd, kubelet, loop devices, mounts); run it as root"
    );
    let sysctls_before =
        SysctlSnapshot::save(std::path::Path::new("/proc/sys"), KUBELET_SYSCTLS).expect("sysctls");
    let mut steps = Steps::new();
    // The bed `make cluster` gives a user, started by the same code.
    let bed = users_cluster::start()
        .await
        .unwrap_or_else(|e| panic!("the real guest cluster must start for this test: {e}"));
    steps.done("the real guest cluster ready (charts installed, Pods Ready)");
    let real = bed.real();
    let logs = LogWatch::start(
        &real.node.dirs.pod_logs,
        NAMESPACE,
        "forbidden",
        Duration::from_secs(1),
    );

    node_is_initialised_by_the_cloud_provider_pod(&bed).await;
    steps.done("the Node initialised by the provider's Pod");
    the_printed_kubectl_and_helm_reach_the_cluster(&bed);
    steps.done("the printed kubectl and helm");
    load_balancer_service_gets_its_address(&bed).await;
    steps.done("a LoadBalancer Service's address");
    volume_moves_between_pods_snapshots_and_restores(&bed).await;
    steps.done("a volume moved, snapshotted, restored");
    volume_grows_online_in_a_running_pod(&bed).await;
    steps.done("online growth");
    block_volume_keeps_data_across_pods(&bed).await;
    steps.done("a block volume across Pods");
    node_plugin_restart_keeps_mounts_and_serves_again(&bed, real).await;
    steps.done("the node plugin's restart");
    unknown_storageclass_parameter_is_named_in_an_event(&bed).await;
    steps.done("an unknown StorageClass parameter");
    stuck_pod_fails_its_wait_with_its_events(&bed).await;
    steps.done("a stuck Pod's wait");
    rotate::cloud_config_rotates_without_a_restart(&bed, real).await;
    steps.done("the cloud-config rotated, the old token revoked");
    // With the old token revoked both programs act on Harvester: a Service gets its address
    // here, the volumes are detached and deleted in the steps after.
    load_balancer_service_gets_its_address(&bed).await;
    steps.done("a LoadBalancer Service's address with the new token");
    heal::attachments_heal_at_the_attachers_resync(&bed, real).await;
    steps.done("attachments healed at the resync");
    everything_deleted_leaves_nothing(&bed, real).await;
    steps.done("everything deleted");
    no_chart_container_logged_forbidden(&bed, logs).await;
    steps.done("the containers' logs read");

    let dir = bed.dir.path().to_path_buf();
    drop(bed);
    assert_eq!(
        SysctlSnapshot::save(std::path::Path::new("/proc/sys"), KUBELET_SYSCTLS).expect("sysctls"),
        sysctls_before,
        "the kernel tunables the kubelet changed were not restored"
    );
    assert!(
        testbed::real::mounts::mounts_under(&dir).is_empty(),
        "mounts left under the bed's directory"
    );
    assert!(
        kubepods_cgroups(std::path::Path::new("/sys/fs/cgroup")).is_empty(),
        "kubepods cgroups left behind"
    );
    assert!(
        !std::path::Path::new("/sys/class/net")
            .join(testbed::real::podnet::BRIDGE)
            .exists(),
        "the Pod bridge is left behind"
    );
    assert!(
        guest_cluster::loop_links(std::path::Path::new(HOST_BY_ID)).is_empty(),
        "by-id links of hot-plugged disks left in {HOST_BY_ID}"
    );
}

/// Registered by the kubelet, initialised by the cloud provider running as a Pod of its chart:
/// providerID of the VM, its address, the host's region and zone, the uninitialized taint gone.
async fn node_is_initialised_by_the_cloud_provider_pod(bed: &TestBed) {
    let node = wait::node_initialised(&bed.guest.client, NODE)
        .await
        .unwrap_or_else(|e| panic!("the cloud provider Pod did not initialise {NODE}: {e}"));
    let vm = Api::<VirtualMachine>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
        .get(NODE)
        .await
        .unwrap_or_else(|e| panic!("VM {NODE}: {e}"));
    assert_eq!(
        node.spec.as_ref().and_then(|s| s.provider_id.clone()),
        Some(format!("harvester://{}", vm.uid().expect("VM uid"))),
        "providerID of {NODE}"
    );
    let labels = node.labels();
    assert_eq!(
        labels.get("topology.kubernetes.io/region"),
        Some(&REGION.to_string())
    );
    assert_eq!(
        labels.get("topology.kubernetes.io/zone"),
        Some(&ZONE.to_string())
    );
    let addresses: Vec<(String, String)> = node
        .status
        .as_ref()
        .and_then(|s| s.addresses.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|a| (a.type_, a.address))
        .collect();
    assert!(
        addresses.contains(&("InternalIP".into(), testbed::real::podnet::GATEWAY.into())),
        "addresses of {NODE}: {addresses:?}"
    );
    let node = wait::until(
        &format!("the uninitialized taint gone from {NODE}"),
        Duration::from_secs(30),
        || async {
            let n = Api::<Node>::all(bed.guest.client.clone())
                .get(NODE)
                .await
                .map_err(|e| e.to_string())?;
            let taints = n.spec.clone().and_then(|s| s.taints).unwrap_or_default();
            Ok(
                if taints
                    .iter()
                    .any(|t| t.key == testbed::real::node::TAINT_UNINITIALIZED)
                {
                    Err(taints)
                } else {
                    Ok(n)
                },
            )
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // The provider that did it is the chart's Pod (the bed runs no other).
    let pods = Api::<Pod>::namespaced(bed.guest.client.clone(), NAMESPACE)
        .list(&ListParams::default().labels("app.kubernetes.io/name=harvester-cloud-provider"))
        .await
        .expect("list the cloud provider Pods");
    assert!(
        pods.items.iter().any(|p| guest_cluster::pod_ready(p)
            && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE)),
        "no Ready cloud provider Pod on {NODE}: {:?}",
        pods.items
            .iter()
            .map(guest_cluster::pod_state)
            .collect::<Vec<_>>()
    );
    drop(node);
}

/// `kubectl` and `helm` from the directory `make cluster` puts on PATH answer with the guest
/// cluster's kubeconfig.
fn the_printed_kubectl_and_helm_reach_the_cluster(bed: &TestBed) {
    let nodes = printed_tool(bed, "kubectl", &["get", "nodes", "-o", "name"]);
    assert_eq!(nodes.trim(), format!("node/{NODE}"), "kubectl get nodes");
    let releases = printed_tool(bed, "helm", &["list", "-n", NAMESPACE, "-q"]);
    for release in [guest_cluster::CCM_RELEASE, CSI_RELEASE] {
        assert!(
            releases.lines().any(|l| l == release),
            "helm list lacks {release}: {releases}"
        );
    }
}

/// Runs `<bed>/bin/<tool> args` as the banner of `make cluster` has the user run it; its stdout.
fn printed_tool(bed: &TestBed, tool: &str, args: &[&str]) -> String {
    let bin = users_cluster::tools_bin(bed).unwrap_or_else(|e| panic!("{e}"));
    let out = std::process::Command::new(bin.join(tool))
        .args(args)
        .env("KUBECONFIG", &bed.real().kubeconfig)
        // helm's own homes stay out of the user's (here: root's) home directory
        .env("HELM_CACHE_HOME", bed.dir.path().join("helm-user/cache"))
        .env("HELM_CONFIG_HOME", bed.dir.path().join("helm-user/config"))
        .env("HELM_DATA_HOME", bed.dir.path().join("helm-user/data"))
        .output()
        .unwrap_or_else(|e| panic!("running {tool} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The LoadBalancer Service the banner of `make cluster` creates, with its command as printed,
/// gets an address of the pool the bed made on Harvester through its LoadBalancer CR; deleted,
/// the CR goes too.
async fn load_balancer_service_gets_its_address(bed: &TestBed) {
    let args: Vec<&str> = TRY_LB_SERVICE.split(' ').collect();
    assert_eq!(args[0], "kubectl", "{TRY_LB_SERVICE}");
    printed_tool(bed, "kubectl", &args[1..]);
    let name = TRY_LB_SERVICE_NAME;
    let services: Api<Service> = api(bed);
    let ip = wait::until(
        &format!("Service {name} to get a load balancer address"),
        Duration::from_secs(60),
        || async {
            let s = services.get(name).await.map_err(|e| e.to_string())?;
            let ingress = s
                .status
                .and_then(|s| s.load_balancer)
                .and_then(|l| l.ingress)
                .unwrap_or_default();
            Ok(match ingress.first().and_then(|i| i.ip.clone()) {
                Some(ip) => Ok(ip),
                None => Err(events_of(&bed.guest.client, NS, "Service", name).await),
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let pool: ipnetwork::IpNetwork = LB_POOL_SUBNET.parse().expect("pool subnet");
    let addr: std::net::IpAddr = ip.parse().unwrap_or_else(|e| panic!("address {ip}: {e}"));
    assert!(
        pool.contains(addr),
        "address {ip} is not of the pool {LB_POOL_SUBNET}"
    );
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let mine = |list: Vec<LoadBalancer>| -> Vec<String> {
        list.iter()
            .filter(|c| c.name_any().starts_with(CLUSTER_NAME))
            .map(|c| c.name_any())
            .collect()
    };
    let cr = mine(
        crs.list(&ListParams::default())
            .await
            .expect("list CRs")
            .items,
    );
    assert_eq!(
        cr.len(),
        1,
        "one LoadBalancer CR of cluster {CLUSTER_NAME}: {cr:?}"
    );
    services
        .delete(name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("delete Service {name}: {e}"));
    wait::until(
        "the LoadBalancer CR to go",
        Duration::from_secs(60),
        || async {
            let left = mine(
                crs.list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items,
            );
            Ok(if left.is_empty() { Ok(()) } else { Err(left) })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

fn pvc(name: &str, class: &str, size: &str, extra: serde_json::Value) -> PersistentVolumeClaim {
    let mut spec = json!({
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": class,
        "resources": {"requests": {"storage": size}},
    });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).expect("PVC")
}

/// A Pod of the workload image running `script` with PVC `claim` at /data (or as block device
/// /dev/xvda); `restartPolicy: Never`.
fn pod(name: &str, claim: &str, block: bool, script: &str) -> Pod {
    let (mounts, devices) = if block {
        (json!([]), json!([{"name": "d", "devicePath": "/dev/xvda"}]))
    } else {
        (json!([{"name": "d", "mountPath": "/data"}]), json!([]))
    };
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "c", "image": WORKLOAD, "imagePullPolicy": "Never",
                "command": workload_command(script),
                "volumeMounts": mounts, "volumeDevices": devices,
            }],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": claim}}],
        }
    }))
    .expect("Pod")
}

async fn create<K>(api: &Api<K>, obj: &K)
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    // The namespace's `default` ServiceAccount comes from kube-controller-manager: retry a Pod
    // refused for want of it.
    wait::until(
        &format!("creating {}", obj.meta().name.clone().unwrap_or_default()),
        Duration::from_secs(30),
        || async {
            Ok(match api.create(&PostParams::default(), obj).await {
                Ok(_) => Ok(()),
                Err(e) if e.to_string().contains("serviceaccount") => Err(e.to_string()),
                Err(e) => return Err(e.to_string()),
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Waits until Pod `name` Succeeded and returns its log; a failed Pod or one stuck (e.g. in
/// ContainerCreating) fails with its state, log and Events.
async fn finished_log(bed: &TestBed, name: &str) -> String {
    let pods: Api<Pod> = api(bed);
    let res = wait::until(&format!("Pod {name} to finish"), POD_READY, || async {
        let p = pods.get(name).await.map_err(|e| e.to_string())?;
        let phase = p
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        Ok(match phase.as_str() {
            "Succeeded" => Ok(Ok(())),
            "Failed" => Ok(Err(guest_cluster::pod_state(&p))),
            _ => Err(guest_cluster::pod_state(&p)),
        })
    })
    .await;
    let log = pods
        .logs(name, &LogParams::default())
        .await
        .unwrap_or_default();
    match res {
        Ok(Ok(())) => log,
        Ok(Err(state)) | Err(state) => panic!(
            "Pod {name} did not succeed: {state}\nlog:\n{log}\nEvents:\n{}\n{}",
            events_of(&bed.guest.client, NS, "Pod", name).await,
            claims_report(bed, name).await
        ),
    }
}

/// For a Pod that did not run: each claim it uses (phase and Events) and the last lines of the
/// provisioner's and the CSI controller's logs, the two that bind a claim (a claim left unbound
/// once cost a run its cause: docs/testbed.md, run 11 of 4 Dec).
async fn claims_report(bed: &TestBed, pod: &str) -> String {
    let p = match api::<Pod>(bed).get(pod).await {
        Ok(p) => p,
        Err(e) => return format!("(reading Pod {pod}: {e})"),
    };
    let claims = p
        .spec
        .into_iter()
        .flat_map(|s| s.volumes.unwrap_or_default());
    let mut report = String::new();
    for claim in claims.filter_map(|v| v.persistent_volume_claim.map(|c| c.claim_name)) {
        let phase = match api::<PersistentVolumeClaim>(bed).get(&claim).await {
            Ok(c) => c.status.and_then(|s| s.phase).unwrap_or_default(),
            Err(e) => e.to_string(),
        };
        let events = events_of(&bed.guest.client, NS, "PersistentVolumeClaim", &claim).await;
        report += &format!("claim {claim}: {phase}\nEvents:\n{events}\n");
    }
    let pods = Api::<Pod>::namespaced(bed.guest.client.clone(), NAMESPACE);
    let controllers = match pods
        .list(&ListParams::default().labels("component=csi-controllers"))
        .await
    {
        Ok(l) => l.items,
        Err(e) => return report + &format!("(listing the CSI controller Pods: {e})"),
    };
    for c in controllers {
        // Each container's state and restarts: a sidecar that lost its leader lease exits and
        // restarts after a growing back-off; then the last lines of the instance before too.
        report += &format!("{}\n", guest_cluster::pod_state(&c));
        let restarts = |container: &str| {
            c.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
                .find(|s| s.name == container)
                .map_or(0, |s| s.restart_count)
        };
        for container in ["csi-provisioner", "harvester-csi-driver"] {
            let instances: &[bool] = if restarts(container) > 0 {
                &[true, false]
            } else {
                &[false]
            };
            for &previous in instances {
                let lp = LogParams {
                    container: Some(container.into()),
                    tail_lines: Some(30),
                    previous,
                    ..LogParams::default()
                };
                let log = pods
                    .logs(&c.name_any(), &lp)
                    .await
                    .unwrap_or_else(|e| e.to_string());
                let which = if previous {
                    "the instance before"
                } else {
                    "now"
                };
                report += &format!(
                    "{} {container}, last lines of {which}:\n{log}\n",
                    c.name_any()
                );
            }
        }
    }
    report
}

async fn delete_pod(bed: &TestBed, name: &str) {
    let pods: Api<Pod> = api(bed);
    match pods.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return,
        Err(e) => panic!("deleting Pod {name}: {e}"),
    }
    let gone = wait::until(&format!("Pod {name} gone"), POD_READY, || async {
        Ok(match pods.get_opt(name).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(p) => Err(guest_cluster::pod_state(&p)),
        })
    })
    .await;
    if let Err(e) = gone {
        panic!(
            "{e}\nEvents:\n{}\nthe kubelet's last lines naming it:\n{}",
            events_of(&bed.guest.client, NS, "Pod", name).await,
            bed.real().node.kubelet_log_lines(name, 40)
        );
    }
}

async fn bound(bed: &TestBed, claim: &str) -> PersistentVolumeClaim {
    let pvcs: Api<PersistentVolumeClaim> = api(bed);
    wait::until(&format!("PVC {claim} Bound"), POD_READY, || async {
        let p = pvcs.get(claim).await.map_err(|e| e.to_string())?;
        Ok(
            if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound") {
                Ok(p)
            } else {
                Err(events_of(&bed.guest.client, NS, "PersistentVolumeClaim", claim).await)
            },
        )
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// StorageClass `harvester` -> PVC -> Pod writes; a new Pod on the same PVC reads it (the whole
/// unpublish/unstage/detach/attach/stage/publish chain by the kubelet and the sidecars); a
/// VolumeSnapshot of it -> PVC from the snapshot -> a Pod reads the snapshot's data.
async fn volume_moves_between_pods_snapshots_and_restores(bed: &TestBed) {
    create(&api(bed), &pvc("data", "harvester", "64Mi", json!({}))).await;
    create(
        &api(bed),
        &pod(
            "writer",
            "data",
            false,
            "echo hello-from-writer > /data/file && sync && cat /data/file",
        ),
    )
    .await;
    assert_eq!(
        finished_log(bed, "writer").await.trim(),
        "hello-from-writer"
    );
    let claim = bound(bed, "data").await;
    let volume = claim.spec.and_then(|s| s.volume_name).expect("PV name");
    delete_pod(bed, "writer").await;

    create(&api(bed), &pod("reader", "data", false, "cat /data/file")).await;
    assert_eq!(
        finished_log(bed, "reader").await.trim(),
        "hello-from-writer",
        "a new Pod on PVC data must read what the first wrote"
    );
    delete_pod(bed, "reader").await;

    let snapshots = kube::Api::<kube::api::DynamicObject>::namespaced_with(
        bed.guest.client.clone(),
        NS,
        &kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "snapshot.storage.k8s.io",
            "v1",
            "VolumeSnapshot",
        )),
    );
    let snap: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": "data-snap"},
        "spec": {"volumeSnapshotClassName": "harvester-snapshot",
                 "source": {"persistentVolumeClaimName": "data"}}
    }))
    .expect("VolumeSnapshot");
    snapshots
        .create(&PostParams::default(), &snap)
        .await
        .expect("create VolumeSnapshot");
    wait::until("VolumeSnapshot data-snap readyToUse", POD_READY, || async {
        let s = snapshots
            .get("data-snap")
            .await
            .map_err(|e| e.to_string())?;
        Ok(if s.data["status"]["readyToUse"] == json!(true) {
            Ok(())
        } else {
            Err(s.data["status"].clone())
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    create(
        &api(bed),
        &pvc(
            "restored",
            "harvester",
            "64Mi",
            json!({"dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "data-snap"}}),
        ),
    )
    .await;
    create(
        &api(bed),
        &pod("restore-reader", "restored", false, "cat /data/file"),
    )
    .await;
    assert_eq!(
        finished_log(bed, "restore-reader").await.trim(),
        "hello-from-writer",
        "the PVC restored from the snapshot must hold the snapshot's data"
    );
    delete_pod(bed, "restore-reader").await;
    eprintln!("volume {volume}: moved between Pods, snapshotted, restored");
}

/// PVC on an XFS StorageClass resized while a Pod uses it: the filesystem the Pod sees grows
/// (ext4 cannot grow online here: CAP_SYS_RESOURCE is missing on this machine).
async fn volume_grows_online_in_a_running_pod(bed: &TestBed) {
    let sc: k8s_openapi::api::storage::v1::StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "harvester-xfs"},
        "provisioner": DRIVER,
        "allowVolumeExpansion": true,
        "parameters": {"csi.storage.k8s.io/fstype": "xfs"},
    }))
    .expect("StorageClass");
    Api::<k8s_openapi::api::storage::v1::StorageClass>::all(bed.guest.client.clone())
        .create(&PostParams::default(), &sc)
        .await
        .expect("create StorageClass harvester-xfs");
    create(
        &api(bed),
        &pvc("growing", "harvester-xfs", "320Mi", json!({})),
    )
    .await;
    let mut p = pod(
        "grower",
        "growing",
        false,
        "while true; do df -k /data | tail -n 1; sleep 1; done",
    );
    if let Some(s) = p.spec.as_mut() {
        s.restart_policy = Some("Always".into());
    }
    create(&api(bed), &p).await;
    wait_pod_ready(&bed.guest.client, NS, "grower", POD_READY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let pods: Api<Pod> = api(bed);
    let size_kib = || async {
        let log = pods
            .logs(
                "grower",
                &LogParams {
                    tail_lines: Some(1),
                    ..LogParams::default()
                },
            )
            .await
            .map_err(|e| e.to_string())?;
        log.split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| format!("no df line in {log:?}"))
    };
    let before = wait::until(
        "a df line from Pod grower",
        Duration::from_secs(30),
        || async { Ok(size_kib().await) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let pvcs: Api<PersistentVolumeClaim> = api(bed);
    pvcs.patch(
        "growing",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(
            json!({"spec": {"resources": {"requests": {"storage": "640Mi"}}}}),
        ),
    )
    .await
    .expect("resize PVC growing");
    let after = wait::until(
        "the filesystem in Pod grower to grow",
        POD_READY,
        || async {
            let now = size_kib().await?;
            Ok(if now > before + 200 * 1024 {
                Ok(now)
            } else {
                Err((
                    now,
                    events_of(&bed.guest.client, NS, "PersistentVolumeClaim", "growing").await,
                ))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("online growth seen in the Pod: {before} KiB -> {after} KiB");
    // The kubelet ends an online expansion by writing the new size into the claim's status; a
    // Pod deleted before then waits for the pod worker's volume check of its current sync.
    wait::until(
        "PVC growing to report at least 640Mi with no resize condition",
        POD_READY,
        || async {
            let p = pvcs.get("growing").await.map_err(|e| e.to_string())?;
            let status = p.status.unwrap_or_default();
            let capacity = status
                .capacity
                .and_then(|c| c.get("storage").map(|q| q.0.clone()));
            let conditions: Vec<String> = status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .map(|c| c.type_)
                .collect();
            let bytes = capacity.as_deref().and_then(quantity::to_bytes);
            Ok(if bytes >= Some(640 << 20) && conditions.is_empty() {
                Ok(())
            } else {
                Err(format!("capacity {capacity:?}, conditions {conditions:?}"))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    delete_pod(bed, "grower").await;
}

/// `volumeMode: Block`: the device is in the Pod and keeps its data across Pods.
async fn block_volume_keeps_data_across_pods(bed: &TestBed) {
    create(
        &api(bed),
        &pvc("raw", "harvester", "16Mi", json!({"volumeMode": "Block"})),
    )
    .await;
    create(
        &api(bed),
        &pod("raw-writer", "raw", true, "printf block-data-42 | dd of=/dev/xvda bs=512 conv=sync 2>/dev/null && sync && echo written"),
    )
    .await;
    assert_eq!(finished_log(bed, "raw-writer").await.trim(), "written");
    delete_pod(bed, "raw-writer").await;
    create(
        &api(bed),
        &pod(
            "raw-reader",
            "raw",
            true,
            "dd if=/dev/xvda bs=13 count=1 2>/dev/null",
        ),
    )
    .await;
    assert_eq!(finished_log(bed, "raw-reader").await, "block-data-42");
    delete_pod(bed, "raw-reader").await;
}

/// The node plugin Pod deleted while a volume is in use: the DaemonSet brings it back, it
/// registers again, the running Pod's mount still works and a second Pod can still mount.
async fn node_plugin_restart_keeps_mounts_and_serves_again(bed: &TestBed, real: &GuestCluster) {
    let _ = real;
    create(&api(bed), &pvc("busy", "harvester", "64Mi", json!({}))).await;
    let mut p = pod(
        "busy-user",
        "busy",
        false,
        "echo still-here > /data/f; while true; do cat /data/f; sleep 1; done",
    );
    if let Some(s) = p.spec.as_mut() {
        s.restart_policy = Some("Always".into());
    }
    create(&api(bed), &p).await;
    wait_pod_ready(&bed.guest.client, NS, "busy-user", POD_READY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let plugin_pods = Api::<Pod>::namespaced(bed.guest.client.clone(), NAMESPACE);
    let selector = "component=csi-driver";
    let old: Vec<String> = plugin_pods
        .list(&ListParams::default().labels(selector))
        .await
        .expect("list node plugin Pods")
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(old.len(), 1, "one node plugin Pod: {old:?}");
    plugin_pods
        .delete(&old[0], &DeleteParams::default())
        .await
        .expect("delete the node plugin Pod");
    wait::until("a new node plugin Pod", POD_READY, || async {
        let now = plugin_pods
            .list(&ListParams::default().labels(selector))
            .await
            .map_err(|e| e.to_string())?;
        Ok(
            if now
                .items
                .iter()
                .any(|p| !old.contains(&p.name_any()) && guest_cluster::pod_ready(p))
            {
                Ok(())
            } else {
                Err(now
                    .items
                    .iter()
                    .map(guest_cluster::pod_state)
                    .collect::<Vec<_>>())
            },
        )
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    wait_daemonset(&bed.guest.client, NAMESPACE, CSI_RELEASE, POD_READY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The old registrar removed its socket and the kubelet unregistered the driver; the new
    // one registers it again.
    let csinodes = Api::<CSINode>::all(bed.guest.client.clone());
    wait::until(
        &format!("{DRIVER} registered in CSINode {NODE} again"),
        Duration::from_secs(60),
        || async {
            let n = csinodes.get(NODE).await.map_err(|e| e.to_string())?;
            Ok(if n.spec.drivers.iter().any(|d| d.name == DRIVER) {
                Ok(())
            } else {
                Err(n.spec.drivers)
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let pods: Api<Pod> = api(bed);
    let log = pods
        .logs(
            "busy-user",
            &LogParams {
                tail_lines: Some(1),
                ..LogParams::default()
            },
        )
        .await
        .expect("log of busy-user");
    assert_eq!(
        log.trim(),
        "still-here",
        "the running Pod's mount after the plugin restart"
    );
    assert!(
        pods.get("busy-user").await.ok().and_then(|p| p
            .status?
            .container_statuses?
            .first()
            .map(|c| c.restart_count))
            == Some(0),
        "busy-user restarted"
    );

    create(
        &api(bed),
        &pvc("after-restart", "harvester", "64Mi", json!({})),
    )
    .await;
    create(
        &api(bed),
        &pod(
            "second",
            "after-restart",
            false,
            "echo ok > /data/x && cat /data/x",
        ),
    )
    .await;
    assert_eq!(finished_log(bed, "second").await.trim(), "ok");
    delete_pod(bed, "second").await;
    delete_pod(bed, "busy-user").await;
}

/// A PVC of a StorageClass with a parameter the driver does not know gets a ProvisioningFailed
/// Event naming the parameter, and nothing is created on Harvester.
async fn unknown_storageclass_parameter_is_named_in_an_event(bed: &TestBed) {
    let sc: k8s_openapi::api::storage::v1::StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "harvester-typo"},
        "provisioner": DRIVER,
        "parameters": {"hostStorageClas": "longhorn"},
    }))
    .expect("StorageClass");
    Api::<k8s_openapi::api::storage::v1::StorageClass>::all(bed.guest.client.clone())
        .create(&PostParams::default(), &sc)
        .await
        .expect("create StorageClass harvester-typo");
    create(&api(bed), &pvc("typo", "harvester-typo", "64Mi", json!({}))).await;
    wait::until(
        "a ProvisioningFailed Event of PVC typo",
        Duration::from_secs(60),
        || async {
            let events = events_of(&bed.guest.client, NS, "PersistentVolumeClaim", "typo").await;
            // The provisioner may not have seen the new StorageClass yet ("not found"); it
            // retries, and the Event that counts names the unknown parameter.
            let naming = events
                .lines()
                .any(|l| l.contains("ProvisioningFailed") && l.contains("hostStorageClas"));
            Ok(if naming { Ok(()) } else { Err(events) })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("the Event must name the unknown parameter: {e}"));
    let _ = api::<PersistentVolumeClaim>(bed)
        .delete("typo", &DeleteParams::default())
        .await;
}

/// A Pod that cannot start (an image the node does not have, `imagePullPolicy: Never`) fails
/// the bed's wait with its state and its Events, not a bare timeout.
async fn stuck_pod_fails_its_wait_with_its_events(bed: &TestBed) {
    let mut p = pod("stuck", "none", false, "true");
    if let Some(s) = p.spec.as_mut() {
        s.volumes = None;
        s.containers[0].volume_mounts = None;
        s.containers[0].volume_devices = None;
        s.containers[0].image = Some("localhost/testbed/not-imported:testbed".into());
    }
    create(&api(bed), &p).await;
    let e = wait_pod_ready(&bed.guest.client, NS, "stuck", Duration::from_secs(20))
        .await
        .expect_err("a Pod without its image must not get Ready")
        .to_string();
    for part in [
        "Pod default/stuck",
        "ErrImageNeverPull",
        "Events of Pod default/stuck",
    ] {
        assert!(e.contains(part), "the error lacks {part:?}: {e}");
    }
    delete_pod(bed, "stuck").await;
}

/// Every Pod and PVC deleted: the Harvester PVCs and the VolumeAttachments go, no CSI mount, no
/// loop device and no hot-plugged disk link stays.
async fn everything_deleted_leaves_nothing(bed: &TestBed, real: &GuestCluster) {
    let pvcs: Api<PersistentVolumeClaim> = api(bed);
    for p in pvcs.list(&ListParams::default()).await.expect("PVCs").items {
        let _ = pvcs.delete(&p.name_any(), &DeleteParams::default()).await;
    }
    let harvester_pvcs: Api<PersistentVolumeClaim> =
        Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let attachments: Api<VolumeAttachment> = Api::all(bed.guest.client.clone());
    wait::until(
        "Harvester PVCs, VolumeAttachments and links gone",
        POD_READY,
        || async {
            let left_pvcs: Vec<String> = harvester_pvcs
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .map(|p| p.name_any())
                .collect();
            let left_va: Vec<String> = attachments
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .map(|v| v.name_any())
                .collect();
            let guest_left = pvcs
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            let links = guest_cluster::loop_links(std::path::Path::new(HOST_BY_ID));
            let left: BTreeMap<&str, String> = [
                ("harvester PVCs", format!("{left_pvcs:?}")),
                ("VolumeAttachments", format!("{left_va:?}")),
                ("guest PVCs", guest_left.to_string()),
                ("by-id links", format!("{links:?}")),
            ]
            .into();
            Ok(
                if left_pvcs.is_empty() && left_va.is_empty() && guest_left == 0 && links.is_empty()
                {
                    Ok(())
                } else {
                    Err(left)
                },
            )
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let csi_mounts: Vec<_> = testbed::real::mounts::mounts_under(&real.node.dirs.kubelet_root)
        .into_iter()
        .filter(|m| {
            let m = m.to_string_lossy();
            m.contains("kubernetes.io~csi") || m.contains("/plugins/kubernetes.io/csi")
        })
        .collect();
    assert!(csi_mounts.is_empty(), "CSI mounts left: {csi_mounts:?}");
    assert!(
        bed.sim.storage.devices().is_empty(),
        "volumes left on the stand-in: {:?}",
        bed.sim.storage.devices()
    );
}

/// No container of either chart (the provider; the CSI controller with its sidecars; the CSI node
/// plugin with its sidecars, the replaced Pod's too) logged a `forbidden` error during the day:
/// each one's RBAC in the chart covers what it does.
async fn no_chart_container_logged_forbidden(bed: &TestBed, logs: LogWatch) {
    let pods = Api::<Pod>::namespaced(bed.guest.client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await
        .expect("list the charts' Pods");
    let seen = logs.finish();
    let expected: Vec<String> = pods
        .items
        .iter()
        .flat_map(|p| {
            let pod = p.name_any();
            p.spec
                .iter()
                .flat_map(|s| s.containers.iter())
                .map(move |c| format!("{pod}/{}", c.name))
        })
        .collect();
    assert!(
        expected.len() >= 10,
        "the provider, the CSI controller and node Pods with their sidecars: {expected:?}"
    );
    let unread: Vec<&String> = expected
        .iter()
        .filter(|c| !seen.containers.contains(*c))
        .collect();
    assert!(
        unread.is_empty(),
        "the logs of {unread:?} were not read (read: {:?})",
        seen.containers
    );
    assert!(
        seen.matching.is_empty(),
        "containers of the charts logged forbidden errors:\n{}",
        seen.matching
            .iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!(
        "no forbidden error in the logs of {} containers",
        seen.containers.len()
    );
}
