//! Fault test: the Harvester kube-apiserver is killed and restarted (same port, flags and
//! certificates; SIGKILL, so requests and watches in flight are cut) twice while 100 LoadBalancer
//! Services converge: a quarter of them deleted while it is down the first time, 20 more created
//! while it is down the second time. The provider keeps running throughout. Afterwards every
//! remaining Service has its own address, equal to its CR's allocation and to the pool's record,
//! no address was ever seen on two Services, and nothing is left of the deleted ones (no CR, no
//! address held in the pool, except the one leak Harvester's own controller makes when a restart
//! cuts its status write: see `wait_crs_and_pool_match_across_harvester_restarts`).

use testbed::suites::chaos as common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{
    assert_distinct_addresses, bed, create_pool, create_service, ingress_ip, record_addresses,
    record_crs, services, start_provider, wait_converged,
    wait_crs_and_pool_match_across_harvester_restarts,
};
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams};
use testbed::TestBed;

const FIRST_WAVE: usize = 100;
const TOTAL: usize = 120;
/// 120 allocations one at a time by the stand-in after two restarts, on a loaded machine.
const CONVERGE: Duration = Duration::from_secs(90);

fn name(i: usize) -> String {
    format!("wave-{i:03}")
}

/// How many Services of the churn show an address now.
async fn with_address(bed: &TestBed) -> usize {
    services(bed)
        .list(&ListParams::default())
        .await
        .expect("list Services")
        .items
        .iter()
        .filter(|s| s.name_any().starts_with("wave-") && ingress_ip(s).is_some())
        .count()
}

/// Kills the Harvester API server, runs `while_down`, starts it again and waits until it serves
/// (CRDs, aggregated virt-api); returns how long it was away.
async fn harvester_outage(bed: &mut TestBed, while_down: impl AsyncFnOnce(&TestBed)) -> Duration {
    let t0 = Instant::now();
    bed.harvester.stop();
    while_down(&*bed).await;
    bed.harvester
        .start_again()
        .await
        .unwrap_or_else(|e| panic!("the Harvester API server must come back: {e}"));
    bed.wait_harvester_serving()
        .await
        .unwrap_or_else(|e| panic!("the Harvester API server must serve again: {e}"));
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_converge_without_double_addresses_or_leaks_across_harvester_restarts() {
    let mut bed = bed().await;
    // 253 addresses for 120 Services: the round robin never wraps during the test, so an address
    // seen on two Services can only be an address handed out twice.
    create_pool(&bed, "192.168.90.0/24").await;
    let (sightings, watch) = record_addresses(&bed);
    let (cr_sightings, cr_watch) = record_crs(&bed);
    let mut ccm = start_provider(&bed, "ccm");

    let created = futures::future::join_all((0..FIRST_WAVE).map(|i| {
        let bed = &bed;
        async move { create_service(bed, &name(i)).await }
    }))
    .await;
    assert_eq!(created.len(), FIRST_WAVE);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Outage 1, while the first allocations are in flight: a quarter of the Services deleted.
    let before = with_address(&bed).await;
    assert!(
        before < FIRST_WAVE,
        "the outage must hit while allocations are in flight ({before} done already)"
    );
    let deleted: Vec<String> = (0..FIRST_WAVE).step_by(4).map(name).collect();
    let away = harvester_outage(&mut bed, async |bed| {
        for n in &deleted {
            services(bed)
                .delete(n, &DeleteParams::default())
                .await
                .unwrap_or_else(|e| panic!("delete {n}: {e}"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    })
    .await;
    eprintln!("outage 1: {before} Services had an address; Harvester away {away:?}");

    // Outage 2, a moment later: 20 more Services while it is down.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = with_address(&bed).await;
    let away = harvester_outage(&mut bed, async |bed| {
        for i in FIRST_WAVE..TOTAL {
            create_service(bed, &name(i)).await;
        }
    })
    .await;
    eprintln!("outage 2: {before} Services had an address; Harvester away {away:?}");

    let remaining: BTreeSet<String> = (0..TOTAL)
        .map(name)
        .filter(|n| !deleted.contains(n))
        .collect();
    let t0 = Instant::now();
    let converged = wait_converged(&bed, "wave-", &remaining, CONVERGE).await;
    eprintln!(
        "{} Services converged {:?} after the second outage",
        converged.len(),
        t0.elapsed()
    );
    assert_distinct_addresses(&converged, &sightings);
    wait_crs_and_pool_match_across_harvester_restarts(&bed, &converged, CONVERGE, &cr_sightings)
        .await;

    // The provider saw the outages and rode them out without a restart.
    ccm.check_alive()
        .unwrap_or_else(|e| panic!("the provider must survive the outages: {e}"));
    let log = std::fs::read_to_string(&ccm.log).unwrap_or_default();
    assert!(
        log.contains("Harvester API"),
        "the provider's log shows its Harvester calls failing during the outages:\n{}",
        testbed::util::process::tail(&ccm.log, 40)
    );
    drop(ccm);
    watch.abort();
    cr_watch.abort();
}
