//! Leader election against the real guest API server: one leader at a time, hand-over on
//! shutdown, and a leader that cannot renew stops before anyone else may start.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use harvester_cloud_provider::leader::{LeaderConfig, LeaderError, run_as_leader};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use testbed::{TestBed, util::wait};
use tokio::sync::oneshot;

/// The Lease the candidates compete for.
const LEASE: &str = "harvester-cloud-provider";

fn cfg(identity: &str) -> LeaderConfig {
    LeaderConfig {
        lease_duration: Duration::from_secs(3),
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(200),
        ..LeaderConfig::new("default", LEASE, identity)
    }
}

/// Work that counts how many replicas run at once and what the most ever was.
#[derive(Default)]
struct Active {
    now: AtomicUsize,
    max: AtomicUsize,
    runs: AtomicUsize,
}

fn candidate(
    bed: &TestBed,
    identity: &'static str,
    active: Arc<Active>,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), LeaderError>>,
) {
    let (tx, rx) = oneshot::channel::<()>();
    let client = bed.guest.client.clone();
    let task = tokio::spawn(async move {
        run_as_leader(
            client,
            cfg(identity),
            async {
                let _ = rx.await;
            },
            |mut stop| async move {
                let n = active.now.fetch_add(1, Ordering::SeqCst) + 1;
                active.max.fetch_max(n, Ordering::SeqCst);
                active.runs.fetch_add(1, Ordering::SeqCst);
                let _ = stop.wait_for(|s| *s).await;
                active.now.fetch_sub(1, Ordering::SeqCst);
            },
        )
        .await
    });
    (tx, task)
}

#[tokio::test]
async fn one_leader_at_a_time_and_hand_over_on_shutdown() {
    let bed = TestBed::started().await;
    let api: Api<Lease> = Api::namespaced(bed.guest.client.clone(), "default");
    let active = Arc::new(Active::default());
    let (stop_a, a) = candidate(&bed, "replica-a", active.clone());
    wait::lease_held_by(&api, LEASE, "replica-a", Duration::from_secs(10))
        .await
        .unwrap();
    let (stop_b, b) = candidate(&bed, "replica-b", active.clone());
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        wait::lease_holder(&api, LEASE).await.as_deref(),
        Some("replica-a"),
        "the leader keeps renewing"
    );
    assert_eq!(
        active.runs.load(Ordering::SeqCst),
        1,
        "only the leader works"
    );

    let t0 = tokio::time::Instant::now();
    drop(stop_a);
    a.await
        .unwrap()
        .expect("a clean shutdown releases the lease");
    wait::lease_held_by(&api, LEASE, "replica-b", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "released lease is taken at once, not after expiry: {:?}",
        t0.elapsed()
    );
    wait::until("replica-b works", Duration::from_secs(5), || {
        let active = active.clone();
        async move {
            let r = active.runs.load(Ordering::SeqCst);
            Ok(if r == 2 { Ok(()) } else { Err(r) })
        }
    })
    .await
    .unwrap();
    assert_eq!(
        active.max.load(Ordering::SeqCst),
        1,
        "never two leaders at once"
    );
    drop(stop_b);
    b.await.unwrap().expect("b stops cleanly");
}

#[tokio::test]
async fn a_leader_that_cannot_renew_stops_within_the_renew_deadline() {
    let bed = TestBed::started().await;
    let api: Api<Lease> = Api::namespaced(bed.guest.client.clone(), "default");
    let active = Arc::new(Active::default());
    let (_stop, a) = candidate(&bed, "replica-a", active.clone());
    wait::until("replica-a works", Duration::from_secs(10), || {
        let active = active.clone();
        async move {
            let n = active.now.load(Ordering::SeqCst);
            Ok(if n == 1 { Ok(()) } else { Err(n) })
        }
    })
    .await
    .unwrap();
    // Someone else holds the lease now (as after a partition): replica-a can no longer renew.
    let t0 = tokio::time::Instant::now();
    api.patch(
        LEASE,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"holderIdentity": "intruder"}})),
    )
    .await
    .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), a)
        .await
        .expect("stops")
        .unwrap();
    assert!(
        matches!(result, Err(LeaderError::Lost { .. })),
        "{result:?}"
    );
    assert_eq!(active.now.load(Ordering::SeqCst), 0, "work stopped");
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "stopped before the lease (3 s) could pass to another: {took:?}"
    );
}
