//! Fault test: the `harvester-cloud-provider` binary is killed with SIGKILL three times while 30
//! LoadBalancer Services come and go (created at once, a third deleted mid-flight, more created
//! while it is down). Afterwards every remaining Service has its own address, equal to its CR's
//! allocation and to the pool's record; the deleted ones are gone with their CRs and addresses.

#[path = "chaos_common.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    LIMIT, bed, cluster_crs, create_pool, create_service, ingress, pool_allocated, services,
    start_provider,
};
use futures::StreamExt;
use harvester_cloud_provider::service::name::lb_name;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use testbed::wait;

const FIRST_WAVE: usize = 25;
const TOTAL: usize = 30;

fn name(i: usize) -> String {
    format!("churn-{i:02}")
}

/// Every (Service, address) pair a watch has ever seen.
type Sightings = Arc<Mutex<BTreeSet<(String, String)>>>;

fn record_addresses(bed: &testbed::TestBed) -> (Sightings, tokio::task::JoinHandle<()>) {
    let seen: Sightings = Arc::default();
    let out = seen.clone();
    let api = services(bed);
    let task = tokio::spawn(async move {
        let mut events = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = events.next().await {
            if let Ok(Event::Apply(svc) | Event::InitApply(svc)) = ev
                && let Some(ip) = ingress(&svc)
            {
                out.lock().unwrap().insert((svc.name_any(), ip));
            }
        }
    });
    (seen, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_converge_without_double_addresses_or_leaks_across_three_sigkills() {
    let bed = bed().await;
    // 253 addresses for 30 Services: the round robin never wraps during the test, so an address
    // seen on two Services can only be an address handed out twice.
    create_pool(&bed, "192.168.70.0/24").await;
    let (sightings, watch) = record_addresses(&bed);
    let mut ccm = start_provider(&bed, "ccm-1");

    // 25 Services at once; SIGKILL while they converge.
    let created = futures::future::join_all((0..FIRST_WAVE).map(|i| {
        let bed = &bed;
        async move { create_service(bed, &name(i)).await }
    }))
    .await;
    assert_eq!(created.len(), FIRST_WAVE);
    tokio::time::sleep(Duration::from_millis(700)).await;
    ccm.stop();
    ccm = start_provider(&bed, "ccm-2");

    // Delete every third one; SIGKILL while the cleanups run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let deleted: Vec<String> = (0..FIRST_WAVE).step_by(3).map(name).collect();
    for n in &deleted {
        services(&bed)
            .delete(n, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete {n}: {e}"));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    ccm.stop();

    // While it is down: five more Services.
    for i in FIRST_WAVE..TOTAL {
        create_service(&bed, &name(i)).await;
    }
    ccm = start_provider(&bed, "ccm-3");
    tokio::time::sleep(Duration::from_millis(800)).await;
    ccm.stop();
    let ccm = start_provider(&bed, "ccm-4");

    let remaining: BTreeSet<String> = (0..TOTAL)
        .map(name)
        .filter(|n| !deleted.contains(n))
        .collect();
    let api = services(&bed);
    let converged: Vec<Service> = wait::until(
        "every remaining Service has an address and the deleted ones are gone",
        LIMIT,
        || {
            let api = api.clone();
            let remaining = remaining.clone();
            async move {
                let list = api
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let ours: Vec<Service> = list
                    .items
                    .into_iter()
                    .filter(|s| s.name_any().starts_with("churn-"))
                    .collect();
                let names: BTreeSet<String> = ours.iter().map(|s| s.name_any()).collect();
                let pending: Vec<String> = ours
                    .iter()
                    .filter(|s| ingress(s).is_none())
                    .map(|s| s.name_any())
                    .collect();
                Ok(if names == remaining && pending.is_empty() {
                    Ok(ours)
                } else {
                    Err(format!(
                        "extra: {:?}, missing: {:?}, without address: {pending:?}",
                        names.difference(&remaining).collect::<Vec<_>>(),
                        remaining.difference(&names).collect::<Vec<_>>()
                    ))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // One address per Service, never two Services on one address at any time.
    let addresses: BTreeMap<String, String> = converged
        .iter()
        .map(|s| (s.name_any(), ingress(s).unwrap()))
        .collect();
    let distinct: BTreeSet<&String> = addresses.values().collect();
    assert_eq!(distinct.len(), remaining.len(), "addresses: {addresses:?}");
    let mut holders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (svc, ip) in sightings.lock().unwrap().iter() {
        holders.entry(ip.clone()).or_default().insert(svc.clone());
    }
    let shared: Vec<_> = holders.iter().filter(|(_, s)| s.len() > 1).collect();
    assert!(
        shared.is_empty(),
        "addresses seen on two Services: {shared:?}"
    );

    // Exactly one CR per remaining Service, with its address; nothing left of the deleted ones
    // (the stand-in releases a CR's address when it goes, so the pool must agree).
    let want: BTreeMap<String, String> = converged
        .iter()
        .map(|s| {
            (
                lb_name(common::CLUSTER, "default", &s.name_any(), &s.uid().unwrap()),
                ingress(s).unwrap(),
            )
        })
        .collect();
    wait::until("CRs and pool match the Services", LIMIT, || {
        let bed = &bed;
        let want = want.clone();
        async move {
            let crs = cluster_crs(bed).await;
            let pool = pool_allocated(bed).await;
            let pool_view: BTreeMap<String, String> = pool
                .iter()
                .map(|(ip, holder)| {
                    let lb = holder.rsplit('/').next().unwrap_or_default().to_string();
                    (lb, ip.clone())
                })
                .collect();
            Ok(if crs == want && pool_view == want {
                Ok(())
            } else {
                Err(format!("CRs: {crs:?}\npool: {pool:?}\nwanted: {want:?}"))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    drop(ccm);
    watch.abort();
}
