//! Bad input under load (issue 18): among 200 LoadBalancer Services created 16 at a time, one
//! carries a malformed annotation. It gets its Warning Event naming the annotation and the value,
//! and nothing is created for it; every other Service gets its own address, and the provider's
//! own step (Harvester's allocation seen → the Service's address seen) stays short for all of
//! them: the bad one holds up no queue. Real kube-apiservers (the test bed), the service
//! controller in-process, the stand-in's LB controller allocating from an IPPool.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt, TryStreamExt};
use harvester_cloud_provider::service::plan::{LABEL_SERVICE_NAME, ingress_ip};
use harvester_cloud_provider::service::{self, FINALIZER};
use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use testbed::suites::service_controller::service_context;
use testbed::util::observe::{observe, seen_now};
use testbed::{TestBed, util::wait};

const CLUSTER: &str = "rke2-load";
const N: usize = 200;
const BAD: &str = "bad-annotation";
/// The provider's own step for any one Service, allocation seen → address seen. Tens of
/// milliseconds when the machine is quiet; the bound leaves room for a loaded 2-core machine.
const OWN_STEP_LIMIT: Duration = Duration::from_secs(10);

fn lb_svc(name: &str, annotations: serde_json::Value) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"type": "LoadBalancer", "selector": {"app": name},
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
    }))
    .expect("service literal")
}

fn allocated(lb: &LoadBalancer) -> Option<String> {
    lb.allocated_ip()?;
    lb.labels().get(LABEL_SERVICE_NAME).cloned()
}

fn addressed(svc: &Service) -> Option<String> {
    ingress_ip(svc).map(|_| svc.name_any())
}

#[tokio::test]
async fn lb_malformed_annotation_among_200_services_gets_its_warning_and_delays_no_other() {
    let bed = TestBed::started().await;
    bed.sim
        .create_pool("load", "10.60.0.0/23")
        .await
        .expect("create pool");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let provider = tokio::spawn(service::run(
        service_context(&bed, CLUSTER, "300s"),
        async move {
            let _ = stopped.await;
        }
        .boxed()
        .shared(),
    ));
    let services: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let (alloc_seen, alloc_watch) =
        observe(crs.clone(), |o| allocated(o).map(|k| (k, String::new())));
    let (addr_seen, addr_watch) = observe(services.clone(), |o| {
        addressed(o).map(|k| (k, String::new()))
    });

    // 200 good ones, 16 creates in flight, the bad one in the middle of them.
    let names: Vec<String> = (0..N).map(|i| format!("load-{i:03}")).collect();
    let started = Instant::now();
    futures::stream::iter((0..=N).map(|i| {
        let services = services.clone();
        let (name, annotations) = match i {
            i if i == N / 2 => (
                BAD.to_string(),
                json!({"cloudprovider.harvesterhci.io/ipam": "static"}),
            ),
            i if i > N / 2 => (names[i - 1].clone(), json!({})),
            i => (names[i].clone(), json!({})),
        };
        async move {
            services
                .create(&PostParams::default(), &lb_svc(&name, annotations))
                .await
                .map_err(|e| format!("creating {name}: {e}"))
        }
    }))
    .buffer_unordered(16)
    .try_collect::<Vec<_>>()
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // The bad one: a Warning naming the annotation and its value, no finalizer, no CR.
    let events: Api<Event> = Api::namespaced(bed.guest.client.clone(), "default");
    let note = wait::until(
        "Warning SyncLoadBalancerFailed on the malformed Service",
        Duration::from_secs(60),
        || {
            let events = events.clone();
            async move {
                let list = events
                    .list(&ListParams::default().fields(&format!("regarding.name={BAD}")))
                    .await
                    .map_err(|e| e.to_string())?;
                let seen: Vec<_> = list
                    .items
                    .iter()
                    .map(|e| (e.type_.clone(), e.reason.clone(), e.note.clone()))
                    .collect();
                Ok(
                    match list.items.iter().find(|e| {
                        e.type_.as_deref() == Some("Warning")
                            && e.reason.as_deref() == Some("SyncLoadBalancerFailed")
                    }) {
                        Some(e) => Ok(e.note.clone().unwrap_or_default()),
                        None => Err(seen),
                    },
                )
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        note.contains("cloudprovider.harvesterhci.io/ipam") && note.contains("static"),
        "the Warning names the annotation and the value: {note}"
    );

    // Every other Service gets an address: the stand-in allocates one at a time, so the bound
    // grows with N.
    let limit = Duration::from_secs(60) + Duration::from_millis(500) * N as u32;
    wait::until("every good Service has an address", limit, || {
        let seen = addr_seen.clone();
        let names = names.clone();
        async move {
            let seen = seen.lock().unwrap_or_else(|p| p.into_inner());
            let missing: Vec<&String> = names.iter().filter(|n| !seen.contains_key(*n)).collect();
            Ok(if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} of {N} without an address, e.g. {:?}",
                    missing.len(),
                    missing.iter().take(5).collect::<Vec<_>>()
                ))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let took = started.elapsed();
    alloc_watch.abort();
    addr_watch.abort();

    // The provider's own step, per Service, from the two watches.
    let alloc = seen_now(&alloc_seen);
    let addr = seen_now(&addr_seen);
    let mut slowest = (String::new(), Duration::ZERO);
    for name in &names {
        let (Some((a, _)), Some((s, _))) = (alloc.get(name), addr.get(name)) else {
            panic!("{name}: allocation or address not seen by the watches");
        };
        let own = s.saturating_duration_since(*a);
        if own > slowest.1 {
            slowest = (name.clone(), own);
        }
    }
    assert!(
        slowest.1 < OWN_STEP_LIMIT,
        "the provider took {:?} from allocation to address for {} (all {N} in {took:?})",
        slowest.1,
        slowest.0
    );

    // Distinct addresses, one CR per good Service, none for the bad one.
    let mut ips = BTreeSet::new();
    for svc in services.list(&ListParams::default()).await.unwrap().items {
        if svc.name_any() == BAD {
            assert!(
                ingress_ip(&svc).is_none() && !svc.finalizers().iter().any(|f| f == FINALIZER),
                "nothing written to the malformed Service: {:?}",
                svc.status
            );
        } else if let Some(ip) = ingress_ip(&svc) {
            assert!(ips.insert(ip.clone()), "{ip} given twice");
        }
    }
    assert_eq!(ips.len(), N, "one address per good Service");
    let owners: Vec<String> = crs
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .filter_map(|cr| cr.labels().get(LABEL_SERVICE_NAME).cloned())
        .collect();
    assert_eq!(owners.len(), N, "one CR per good Service");
    assert!(
        !owners.iter().any(|o| o == BAD),
        "no CR for the malformed Service"
    );
    drop(stop);
    tokio::time::timeout(Duration::from_secs(20), provider)
        .await
        .expect("the provider stops within 20 s")
        .expect("provider task");
}
