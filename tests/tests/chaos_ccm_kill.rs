//! Fault test: the `harvester-cloud-provider` binary is killed with SIGKILL five times while 30
//! LoadBalancer Services come and go (created at once, a third deleted mid-flight, more created
//! while it is down). Afterwards every remaining Service has its own address, equal to its CR's
//! allocation and to the pool's record; the deleted ones are gone with their CRs and addresses.

use testbed::suites::chaos as common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{
    LIMIT, assert_distinct_addresses, bed, create_pool, create_service, record_addresses, services,
    start_provider, wait_converged, wait_crs_and_pool_match,
};
use kube::api::DeleteParams;

const FIRST_WAVE: usize = 25;
const TOTAL: usize = 30;

fn name(i: usize) -> String {
    format!("churn-{i:02}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_converge_without_double_addresses_or_leaks_across_five_sigkills() {
    let bed = bed().await;
    // 253 addresses for 30 Services: the round robin never wraps during the test, so an address
    // seen on two Services can only be an address handed out twice.
    create_pool(&bed, "192.168.70.0/24").await;
    let (sightings, watch) = record_addresses(&bed);
    let mut ccm = start_provider(&bed, "ccm-1");

    // 25 Services at once; SIGKILL 1 while they converge.
    let created = futures::future::join_all((0..FIRST_WAVE).map(|i| {
        let bed = &bed;
        async move { create_service(bed, &name(i)).await }
    }))
    .await;
    assert_eq!(created.len(), FIRST_WAVE);
    tokio::time::sleep(Duration::from_millis(700)).await;
    ccm.stop();
    ccm = start_provider(&bed, "ccm-2");

    // SIGKILL 2 soon after a start, while it lists and catches up.
    tokio::time::sleep(Duration::from_millis(400)).await;
    ccm.stop();
    ccm = start_provider(&bed, "ccm-3");

    // Delete every third one; SIGKILL 3 while the cleanups run.
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

    // While it is down: five more Services; SIGKILL 4 while it picks them up.
    for i in FIRST_WAVE..TOTAL {
        create_service(&bed, &name(i)).await;
    }
    ccm = start_provider(&bed, "ccm-4");
    tokio::time::sleep(Duration::from_millis(800)).await;
    ccm.stop();

    // SIGKILL 5 a little later, mid-way through whatever is still in flight.
    ccm = start_provider(&bed, "ccm-5");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    ccm.stop();
    let ccm = start_provider(&bed, "ccm-6");

    let remaining: BTreeSet<String> = (0..TOTAL)
        .map(name)
        .filter(|n| !deleted.contains(n))
        .collect();
    let converged = wait_converged(&bed, "churn-", &remaining, LIMIT).await;
    assert_distinct_addresses(&converged, &sightings);
    // The stand-in releases a CR's address when it goes, so the pool must agree.
    wait_crs_and_pool_match(&bed, &converged, LIMIT).await;

    drop(ccm);
    watch.abort();
}
