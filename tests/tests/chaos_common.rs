//! Shared by the fault tests (`chaos_*.rs`): the `harvester-cloud-provider` binary as a child
//! process of the test bed, LoadBalancer Services, and the Harvester side to check them against.
//! (Compiled on its own as well, where it holds no tests.)

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use harvester_cloud_provider::service::plan::LABEL_CLUSTER;
use harvester_common::harvester::{IPPool, LoadBalancer};
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use testbed::process::Proc;
use testbed::{BedOptions, TestBed};

pub const CLUSTER: &str = "chaos";
pub const POOL: &str = "chaos-pool";

pub async fn bed() -> TestBed {
    TestBed::start(BedOptions::default())
        .await
        .unwrap_or_else(|e| panic!("the test bed must start for this test: {e}"))
}

/// The binary cargo built next to this test (`cargo test --workspace` builds every binary).
pub fn binary() -> PathBuf {
    testbed::process::built_binary("harvester-cloud-provider")
}

/// The provider binary against the bed, logging to `<bed dir>/<name>.log`; dropping or
/// `stop()`ping the handle kills it with SIGKILL.
pub fn start_provider(bed: &TestBed, name: &str) -> Proc {
    let mut cmd = Command::new(binary());
    cmd.args(["--cloud-config", &bed.cloud_config.to_string_lossy()])
        .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
        .args(["--cluster-name", CLUSTER])
        .args(["--leader-elect=false", "--metrics-address="]);
    Proc::spawn(name, cmd, bed.dir.path()).expect("start the cloud provider binary")
}

/// One pool of `subnet` for every guest cluster.
pub async fn create_pool(bed: &TestBed, subnet: &str) {
    let pool: IPPool = serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "IPPool",
        "metadata": {"name": POOL},
        "spec": {"ranges": [{"subnet": subnet}],
                 "selector": {"scope": [{"project": "*", "namespace": "*", "guestCluster": "*"}]}}
    }))
    .expect("pool literal");
    Api::<IPPool>::all(bed.harvester.client.clone())
        .create(&PostParams::default(), &pool)
        .await
        .expect("create pool");
}

pub fn lb_svc(name: &str) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"type": "LoadBalancer", "selector": {"app": name},
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
    }))
    .expect("service literal")
}

pub fn services(bed: &TestBed) -> Api<Service> {
    Api::namespaced(bed.guest.client.clone(), "default")
}

pub fn crs(bed: &TestBed) -> Api<LoadBalancer> {
    Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
}

pub fn ingress(svc: &Service) -> Option<String> {
    svc.status
        .as_ref()?
        .load_balancer
        .as_ref()?
        .ingress
        .as_ref()?
        .first()?
        .ip
        .clone()
}

pub async fn create_service(bed: &TestBed, name: &str) -> Service {
    services(bed)
        .create(&PostParams::default(), &lb_svc(name))
        .await
        .unwrap_or_else(|e| panic!("create Service {name}: {e}"))
}

/// CR name -> allocated IP (empty while pending), of this cluster's CRs.
pub async fn cluster_crs(bed: &TestBed) -> BTreeMap<String, String> {
    crs(bed)
        .list(&ListParams::default().labels(&format!("{LABEL_CLUSTER}={CLUSTER}")))
        .await
        .expect("list CRs")
        .items
        .iter()
        .map(|c| {
            (
                c.name_any(),
                c.allocated_ip().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// The pool's `status.allocated` (IP -> `<namespace>/<LB name>`).
pub async fn pool_allocated(bed: &TestBed) -> BTreeMap<String, String> {
    Api::<IPPool>::all(bed.harvester.client.clone())
        .get(POOL)
        .await
        .expect("get pool")
        .status
        .unwrap_or_default()
        .allocated
}

/// How long a converging state may take after the last fault.
pub const LIMIT: Duration = Duration::from_secs(30);
