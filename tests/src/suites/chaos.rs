//! Shared by the fault tests (`chaos_*.rs`): the `harvester-cloud-provider` binary as a child
//! process of the test bed, LoadBalancer Services, and the Harvester side to check them against.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::util::process::Proc;
use crate::{TestBed, util::wait};
use base64::Engine;
use futures::StreamExt;
use harvester_cloud_provider::service::name::lb_name;
use harvester_cloud_provider::service::plan::LABEL_CLUSTER;
pub use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_common::harvester::{IPPool, LoadBalancer};
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::json;

pub const CLUSTER: &str = "chaos";
pub const POOL: &str = "chaos-pool";

pub async fn bed() -> TestBed {
    TestBed::started().await
}

/// The binary cargo built next to this test (`cargo test --workspace` builds every binary).
pub fn binary() -> PathBuf {
    crate::util::process::built_binary("harvester-cloud-provider")
}

/// The provider binary against the bed, logging to `<bed dir>/<name>.log`; dropping or
/// `stop()`ping the handle kills it with SIGKILL.
pub fn start_provider(bed: &TestBed, name: &str) -> Proc {
    let mut cmd = Command::new(binary());
    cmd.args(["--cloud-config", &bed.cloud_config.to_string_lossy()])
        .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
        .args(["--cluster-name", CLUSTER])
        .args([
            "--leader-elect=false",
            "--metrics-address=",
            "--secure-port=0",
        ]);
    Proc::spawn(name, cmd, bed.dir.path()).expect("start the cloud provider binary")
}

/// One pool of `subnet` for every guest cluster.
pub async fn create_pool(bed: &TestBed, subnet: &str) {
    bed.sim
        .create_pool(POOL, subnet)
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

/// Every (Service, address) pair a watch of the guest's Services has ever seen.
pub type Sightings = Arc<Mutex<BTreeSet<(String, String)>>>;

/// Records every address any Service of `default` shows, for as long as the task runs.
pub fn record_addresses(bed: &TestBed) -> (Sightings, tokio::task::JoinHandle<()>) {
    let seen: Sightings = Arc::default();
    let out = seen.clone();
    let api = services(bed);
    let task = tokio::spawn(async move {
        let mut events = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = events.next().await {
            if let Ok(Event::Apply(svc) | Event::InitApply(svc)) = ev
                && let Some(ip) = ingress_ip(&svc)
            {
                out.lock().unwrap().insert((svc.name_any(), ip));
            }
        }
    });
    (seen, task)
}

/// Waits until the Services named `<prefix>...` are exactly `remaining`, each with an address
/// (the deleted ones gone: their finalizer released), within `limit`; returns them.
pub async fn wait_converged(
    bed: &TestBed,
    prefix: &str,
    remaining: &BTreeSet<String>,
    limit: Duration,
) -> Vec<Service> {
    let api = services(bed);
    wait::until(
        "every remaining Service has an address and the deleted ones are gone",
        limit,
        || {
            let api = api.clone();
            async move {
                let list = api
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let ours: Vec<Service> = list
                    .items
                    .into_iter()
                    .filter(|s| s.name_any().starts_with(prefix))
                    .collect();
                let names: BTreeSet<String> = ours.iter().map(|s| s.name_any()).collect();
                let pending: Vec<String> = ours
                    .iter()
                    .filter(|s| ingress_ip(s).is_none())
                    .map(|s| s.name_any())
                    .collect();
                Ok(if &names == remaining && pending.is_empty() {
                    Ok(ours)
                } else {
                    Err(format!(
                        "extra: {:?}, missing: {:?}, without address: {pending:?}",
                        names.difference(remaining).collect::<Vec<_>>(),
                        remaining.difference(&names).collect::<Vec<_>>()
                    ))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// One address per Service now, and never one address on two Services at any time.
pub fn assert_distinct_addresses(converged: &[Service], sightings: &Sightings) {
    let addresses: BTreeMap<String, String> = converged
        .iter()
        .map(|s| (s.name_any(), ingress_ip(s).unwrap()))
        .collect();
    let distinct: BTreeSet<&String> = addresses.values().collect();
    assert_eq!(distinct.len(), converged.len(), "addresses: {addresses:?}");
    let mut holders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (svc, ip) in sightings.lock().unwrap().iter() {
        holders.entry(ip.clone()).or_default().insert(svc.clone());
    }
    let shared: Vec<_> = holders.iter().filter(|(_, s)| s.len() > 1).collect();
    assert!(
        shared.is_empty(),
        "addresses seen on two Services: {shared:?}"
    );
}

/// Every LoadBalancer CR of this cluster a watch has seen, and whether it was ever seen with an
/// allocated address.
pub type CrSightings = Arc<Mutex<BTreeMap<String, bool>>>;

/// Records this cluster's LoadBalancer CRs for as long as the task runs.
pub fn record_crs(bed: &TestBed) -> (CrSightings, tokio::task::JoinHandle<()>) {
    let seen: CrSightings = Arc::default();
    let out = seen.clone();
    let config = watcher::Config::default().labels(&format!("{LABEL_CLUSTER}={CLUSTER}"));
    let api = crs(bed);
    let task = tokio::spawn(async move {
        let mut events = watcher::watcher(api, config).default_backoff().boxed();
        while let Some(ev) = events.next().await {
            if let Ok(Event::Apply(lb) | Event::InitApply(lb)) = ev {
                let allocated = lb.allocated_ip().is_some_and(|ip| !ip.is_empty());
                *out.lock().unwrap().entry(lb.name_any()).or_default() |= allocated;
            }
        }
    });
    (seen, task)
}

/// Exactly one CR per converged Service, allocated the Service's address, and the pool records
/// exactly those: nothing is left of deleted Services (no CR leaked, their addresses released).
pub async fn wait_crs_and_pool_match(bed: &TestBed, converged: &[Service], limit: Duration) {
    wait_crs_and_pool_agree(bed, converged, limit, None).await
}

/// [`wait_crs_and_pool_match`] across restarts of the Harvester API server, where Harvester
/// itself can leak a pool address: its controller writes the pool before the LoadBalancer's
/// status, and on delete releases only what that status records (load-balancer-harvester v1.8.2
/// `pkg/controller/loadbalancer/controller.go` `OnRemove`: `Status.AllocatedAddress.IPPool != ""`;
/// the IPPool controller's `manuallyReleaseIP` annotation exists for exactly these records). A
/// status write cut by the restart, then the CR deleted, leaves the pool entry behind. Such an
/// entry is accepted only for a CR of this cluster that `seen` watched, that is gone, and that was
/// never seen with an address; anything else the pool holds beyond the Services is a failure.
pub async fn wait_crs_and_pool_match_across_harvester_restarts(
    bed: &TestBed,
    converged: &[Service],
    limit: Duration,
    seen: &CrSightings,
) {
    wait_crs_and_pool_agree(bed, converged, limit, Some(seen)).await
}

async fn wait_crs_and_pool_agree(
    bed: &TestBed,
    converged: &[Service],
    limit: Duration,
    harvester_leaks: Option<&CrSightings>,
) {
    let want: BTreeMap<String, String> = converged
        .iter()
        .map(|s| {
            (
                lb_name(CLUSTER, "default", &s.name_any(), &s.uid().unwrap()),
                ingress_ip(s).unwrap(),
            )
        })
        .collect();
    wait::until("CRs and pool match the Services", limit, || {
        let want = want.clone();
        async move {
            let crs = cluster_crs(bed).await;
            let pool = pool_allocated(bed).await;
            let mut pool_view: BTreeMap<String, String> = pool
                .iter()
                .map(|(ip, holder)| {
                    let lb = holder.rsplit('/').next().unwrap_or_default().to_string();
                    (lb, ip.clone())
                })
                .collect();
            if let Some(seen) = harvester_leaks {
                let seen = seen.lock().unwrap().clone();
                pool_view.retain(|lb, ip| {
                    let harvesters = !want.contains_key(lb)
                        && !crs.contains_key(lb)
                        && seen.get(lb) == Some(&false);
                    if harvesters {
                        eprintln!("pool keeps {ip} of the deleted {lb}, whose status never recorded it (Harvester's own leak)");
                    }
                    !harvesters
                });
            }
            Ok(if crs == want && pool_view == want {
                Ok(())
            } else {
                Err(format!(
                    "CRs against the Services: {}\npool against the Services: {}",
                    map_diff(&crs, &want),
                    map_diff(&pool_view, &want)
                ))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// What `got` has that `want` has not, what it lacks and which values differ: short enough to
/// survive a truncated CI log, where printing both maps of 100 entries was not.
fn map_diff(got: &BTreeMap<String, String>, want: &BTreeMap<String, String>) -> String {
    let extra: Vec<_> = got.iter().filter(|(k, _)| !want.contains_key(*k)).collect();
    let missing: Vec<_> = want.iter().filter(|(k, _)| !got.contains_key(*k)).collect();
    let differ: Vec<_> = got
        .iter()
        .filter_map(|(k, v)| want.get(k).filter(|w| *w != v).map(|w| (k, v, w)))
        .collect();
    if extra.is_empty() && missing.is_empty() && differ.is_empty() {
        return "equal".into();
    }
    format!("extra {extra:?}, missing {missing:?}, (name, got, wanted) {differ:?}")
}

/// `PUT key=value` through etcd's JSON gateway (`/v3/kv/put`), bypassing kube-apiserver and its
/// schema checks (how a malformed object gets into storage).
pub fn etcd_put(url: &str, key: &str, value: &[u8]) {
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let body = json!({"key": b64(key.as_bytes()), "value": b64(value)}).to_string();
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("connect to etcd");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v3/kv/put HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write to etcd");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read etcd's answer");
    assert!(out.starts_with("HTTP/1.1 200"), "etcd put failed: {out}");
}
