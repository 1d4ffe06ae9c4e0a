//! The binaries started with exactly the args upstream's charts render, against the test bed:
//! each becomes ready and each flag has its meaning. Upstream's templates (harvester/charts
//! `charts/harvester-cloud-provider/templates/deployment.yaml` and
//! `charts/harvester-csi-driver/templates/daemonset.yaml`) render
//!
//! ```text
//! harvester-cloud-provider --cloud-config=/etc/kubernetes/cloud-config \
//!     [--cluster-name=<global.cattle.clusterName>] <extraArgs...>
//! harvester-csi-driver --nodeid=$(NODE_ID) --endpoint=$(CSI_ENDPOINT) \
//!     --kubeconfig=/var/lib/harvester/cloud-provider-config [--host-storage-class=<class>]
//! ```
//!
//! with no Lease flags, no metrics flags and the in-cluster guest config (here `KUBECONFIG` in the
//! environment, which is not a flag) — only the files' paths differ (the bed's cloud-config).

use testbed::suites::chaos as chaos_common;
use testbed::suites::csi as csi_common;

use std::process::{Command, Stdio};
use std::time::Duration;

use chaos_common::{CLUSTER, create_pool, crs, lb_svc, services};
use harvester_cloud_provider::service::name::lb_name;
use harvester_cloud_provider::service::plan::LABEL_CLUSTER;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testbed::sim::GuestVm;
use testbed::{TestBed, util::scrape, util::wait};

/// Upstream's HTTPS port (k8s.io/cloud-provider `--secure-port` default; no flag in upstream's
/// chart), where `/readyz` is open without a token: one provider at a time in this file, and on
/// the machine: the real guest cluster's provider (hostNetwork) binds it too, so this suite is in
/// `make test`'s lane `machine` (tests/scripts/suites.sh), never beside real_cluster or
/// install_docs.
const DEFAULT_PORT: u16 = 10258;

/// The documented extraArgs (harvester/charts values.yaml and questions.yml, the provider's README).
const DOCUMENTED: &[&str] = &[
    "--disable-annotation-alpha-provided-ip-addr=true",
    "--show-full-help-on-error=true",
    "--leader-elect",
    "--controllers=cloud-node,service",
    "--cluster-name=from-extra-args",
];

struct Provider {
    child: std::process::Child,
    logs: std::thread::JoinHandle<Vec<String>>,
}

impl Provider {
    /// Starts the binary with `args` once [`DEFAULT_PORT`] is free: another process's `/readyz`
    /// there would pass for this one's.
    fn start(bed: &TestBed, args: &[String]) -> Provider {
        if let Err(e) = std::net::TcpListener::bind(("0.0.0.0", DEFAULT_PORT)) {
            panic!(
                "port {DEFAULT_PORT} is taken by another process ({e}): ss -ltnp sport = :{DEFAULT_PORT}"
            );
        }
        let mut child = Command::new(testbed::util::process::built_binary(
            "harvester-cloud-provider",
        ))
        .args(args)
        .env("KUBECONFIG", &bed.guest.kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the binary");
        let logs = testbed::util::process::collect_lines(child.stderr.take().unwrap());
        Provider { child, logs }
    }

    /// Waits for `/readyz` on [`DEFAULT_PORT`], then checks that this process is the one
    /// answering (it still runs: had it lost the port, it would have exited). `args` names the
    /// run in a failure.
    async fn ready(&mut self, args: &str) {
        scrape::wait_for_https_200(DEFAULT_PORT, "/readyz", Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{args}: /readyz on {DEFAULT_PORT}: {e}"));
        if let Some(exit) = self.child.try_wait().unwrap() {
            panic!(
                "{args}: the provider exited ({exit}) while something answered /readyz on {DEFAULT_PORT}"
            );
        }
    }

    /// SIGTERM (the Lease is released for the next one), then the log lines.
    async fn stop(mut self) -> Vec<String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let exit = tokio::task::spawn_blocking(move || self.child.wait())
            .await
            .unwrap()
            .unwrap();
        let logs = self.logs.join().unwrap();
        assert!(exit.success(), "exit {exit}: {}", logs.join("\n"));
        logs
    }
}

/// The chart's args: `--cloud-config`, `--cluster-name` when the node driver set one, extraArgs.
fn chart_args(bed: &TestBed, cluster: Option<&str>, extra: &[&str]) -> Vec<String> {
    let mut args = vec![format!("--cloud-config={}", bed.cloud_config.display())];
    args.extend(cluster.map(|c| format!("--cluster-name={c}")));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A LoadBalancer Service `name`; waits for the Harvester CR that upstream's name algorithm gives
/// it under `cluster` and checks the CR's cluster label.
async fn lb_served_as(bed: &TestBed, name: &str, cluster: &str) {
    let svc = services(bed)
        .create(&PostParams::default(), &lb_svc(name))
        .await
        .unwrap();
    let cr = lb_name(cluster, "default", name, &svc.uid().unwrap());
    let crs = crs(bed);
    let lb = wait::until(
        &format!("LoadBalancer CR {cr} for Service {name} (cluster {cluster})"),
        Duration::from_secs(30),
        || {
            let crs = crs.clone();
            let cr = cr.clone();
            async move {
                let got = crs.get_opt(&cr).await.map_err(|e| e.to_string())?;
                let names = crs
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .iter()
                    .map(|c| c.name_any())
                    .collect::<Vec<_>>();
                Ok(got.ok_or(names))
            }
        },
    )
    .await
    .unwrap();
    assert_eq!(
        lb.labels().get(LABEL_CLUSTER).map(String::as_str),
        Some(cluster)
    );
}

/// A tainted Node `name` with kubelet's `--node-ip` annotation pointing at an address its VM does
/// not have, then its VM: upstream refuses such a Node unless
/// `--disable-annotation-alpha-provided-ip-addr` is set.
async fn node_with_a_stale_node_ip(bed: &TestBed, name: &str, ip: &str) {
    bed.sim.create_guest_node(name).await.unwrap();
    Api::<Node>::all(bed.guest.client.clone())
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations":
                {"alpha.kubernetes.io/provided-node-ip": "10.99.0.99"}}})),
        )
        .await
        .unwrap();
    bed.sim
        .create_vm(&GuestVm::new(name).on_host("h1").ip(ip))
        .await
        .unwrap();
}

async fn initialised(bed: &TestBed, name: &str) -> Node {
    wait::node_initialised(&bed.guest.client, name)
        .await
        .unwrap()
}

fn internal_ips(node: &Node) -> Vec<String> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a.type_ == "InternalIP")
        .map(|a| a.address)
        .collect()
}

#[tokio::test]
async fn the_cloud_provider_runs_with_the_args_upstreams_chart_renders() {
    let bed = chaos_common::bed().await;
    bed.sim
        .create_host("h1", Some("r1"), Some("z1"))
        .await
        .unwrap();
    create_pool(&bed, "192.168.100.0/24").await;
    let leases: Api<Lease> = Api::namespaced(bed.guest.client.clone(), "kube-system");

    // Default values: no cluster name (the framework's "kubernetes").
    let mut p = Provider::start(&bed, &chart_args(&bed, None, &[]));
    p.ready("default values").await;
    lb_served_as(&bed, "svc-default", "kubernetes").await;
    held_by_this_host(&leases).await;
    p.stop().await;

    // Node-driver values: global.cattle.clusterName -> --cluster-name.
    let mut p = Provider::start(&bed, &chart_args(&bed, Some(CLUSTER), &[]));
    p.ready("--cluster-name").await;
    lb_served_as(&bed, "svc-rancher", CLUSTER).await;
    p.stop().await;

    // Each documented extraArg alone, with the node driver's --cluster-name before it.
    for (i, extra) in DOCUMENTED.iter().enumerate() {
        let mut p = Provider::start(&bed, &chart_args(&bed, Some(CLUSTER), &[extra]));
        p.ready(extra).await;
        let svc = format!("svc-extra-{i}");
        // pflag: of two --cluster-name, the last counts (and names the CRs).
        let cluster = extra.strip_prefix("--cluster-name=").unwrap_or(CLUSTER);
        lb_served_as(&bed, &svc, cluster).await;
        match *extra {
            "--cluster-name=from-extra-args" | "--show-full-help-on-error=true" => {}
            "--disable-annotation-alpha-provided-ip-addr=true" => {
                node_with_a_stale_node_ip(&bed, "w-stale", "10.0.0.21").await;
                let n = initialised(&bed, "w-stale").await;
                assert_eq!(internal_ips(&n), ["10.0.0.21"], "the annotation is ignored");
            }
            "--controllers=cloud-node,service" => {
                bed.sim
                    .create_vm(&GuestVm::new("w-ctl").on_host("h1").ip("10.0.0.22"))
                    .await
                    .unwrap();
                bed.sim.create_guest_node("w-ctl").await.unwrap();
                initialised(&bed, "w-ctl").await;
            }
            "--leader-elect" => held_by_this_host(&leases).await,
            other => panic!("no check for {other}"),
        }
        let logs = p.stop().await;
        if *extra == "--show-full-help-on-error=true" {
            assert!(
                logs.iter().any(|l| l.contains("without effect")
                    && l.contains("--show-full-help-on-error=true")),
                "named once at start as without effect: {logs:#?}"
            );
        }
    }

    // All of them together.
    let mut p = Provider::start(&bed, &chart_args(&bed, Some(CLUSTER), DOCUMENTED));
    p.ready("all documented extraArgs").await;
    lb_served_as(&bed, "svc-all", "from-extra-args").await;
    node_with_a_stale_node_ip(&bed, "w-all", "10.0.0.23").await;
    initialised(&bed, "w-all").await;
    p.stop().await;
}

/// Upstream's Lease `kube-system/cloud-controller-manager`, held under the identity client-go
/// gives a pod without POD_NAME: `<hostname>_<unique suffix>`.
async fn held_by_this_host(leases: &Api<Lease>) {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap();
    wait::until(
        "Lease kube-system/cloud-controller-manager held by this host",
        Duration::from_secs(10),
        || async {
            let holder = wait::lease_holder(leases, "cloud-controller-manager").await;
            Ok(match holder {
                Some(h) if h.starts_with(&format!("{host}_")) => Ok(()),
                other => Err(other),
            })
        },
    )
    .await
    .unwrap();
}

/// The CSI driver with the args of upstream's node DaemonSet (one process serving Identity,
/// Controller and Node on one socket, as upstream): the node ID is the VM's, and
/// `--host-storage-class` picks the Harvester PVC's class.
#[tokio::test]
async fn the_csi_driver_runs_with_the_args_upstreams_chart_renders() {
    use csi_common::{DriverProc, NODE, create_request, mount_cap};
    use csi_proto::csi::v1::NodeGetInfoRequest;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;

    csi_common::assert_root();
    let bed = csi_common::bed_with_vm_and(testbed::BedOptions::default()).await;
    let socket = bed.dir.path().join("upstream-args.sock");
    // `--endpoint=unix://...` and `--kubeconfig=...` are added by DriverProc, as the chart renders
    // them; the rest is the chart's `--nodeid=$(NODE_ID)` (spec.nodeName) and the optional class.
    let args = [
        format!("--nodeid={NODE}"),
        "--host-storage-class=harvester-longhorn".to_string(),
    ];
    let d = DriverProc::start(&bed, "csi-upstream-args", &socket, &args, &[]).await;
    let info = d
        .node_client()
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, NODE);
    let vol = d
        .controller_client()
        .create_volume(create_request(
            "pvc-upstream-args",
            64 << 20,
            &mount_cap("ext4"),
        ))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let pvc =
        Api::<PersistentVolumeClaim>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
            .get(&vol.volume_id)
            .await
            .unwrap();
    assert_eq!(
        pvc.spec.and_then(|s| s.storage_class_name).as_deref(),
        Some("harvester-longhorn"),
        "--host-storage-class names the Harvester StorageClass"
    );
    d.kill();
}
