//! The cloud provider's service controller against the test bed: guest Services of type
//! LoadBalancer, Harvester LoadBalancer CRs allocated by the stand-in from IPPools.

use std::collections::BTreeSet;
use std::time::Duration;

use harvester_cloud_provider::service::annotations::{ANN_NETWORK, KUBE_VIP_INTERFACE};
use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_cloud_provider::service::{
    FINALIZER, NAD_MAPPING_KEY, NAD_MAPPING_NAME, NAD_MAPPING_NAMESPACE, name::lb_name,
};
use harvester_common::harvester::{IPPool, LoadBalancer};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testbed::suites::service_controller::{self, ServiceController};
use testbed::{TestBed, util::wait};

const CLUSTER: &str = "rke2-test";
const LIMIT: Duration = Duration::from_secs(30);

/// The service controller running in this process until stopped.
fn start_ccm(bed: &TestBed) -> ServiceController {
    ServiceController::start(bed, CLUSTER)
}

fn pool(name: &str, ranges: serde_json::Value) -> IPPool {
    serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "IPPool",
        "metadata": {"name": name},
        "spec": {"ranges": ranges, "selector": {"scope": [{"project": "*", "namespace": "*", "guestCluster": "*"}]}}
    }))
    .expect("pool literal")
}

async fn create_pool(bed: &TestBed, name: &str, ranges: serde_json::Value) {
    Api::<IPPool>::all(bed.harvester.client.clone())
        .create(&PostParams::default(), &pool(name, ranges))
        .await
        .expect("create pool");
}

fn lb_svc(name: &str, ports: &[(i32, &str)], annotations: serde_json::Value) -> Service {
    let ports: Vec<_> = ports
        .iter()
        .map(|(p, proto)| json!({"name": format!("p{p}-{}", proto.to_lowercase()), "port": p, "protocol": proto}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"type": "LoadBalancer", "ports": ports, "selector": {"app": name}}
    }))
    .expect("service literal")
}

fn services(bed: &TestBed) -> Api<Service> {
    Api::namespaced(bed.guest.client.clone(), "default")
}

fn crs(bed: &TestBed) -> Api<LoadBalancer> {
    Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
}

/// Waits until the Service has an ingress address and returns it with the Service.
async fn wait_address(bed: &TestBed, name: &str) -> (String, Service) {
    service_controller::wait_ingress(&services(bed), name, LIMIT).await
}

async fn wait_gone(bed: &TestBed, name: &str) {
    service_controller::wait_gone(&services(bed), name, LIMIT).await
}

async fn cr_names(bed: &TestBed) -> Vec<String> {
    crs(bed)
        .list(&ListParams::default())
        .await
        .expect("list CRs")
        .items
        .iter()
        .map(|c| c.name_any())
        .collect()
}

/// Waits until no CR is left: a deleted CR goes once Harvester (the stand-in) has released its
/// address and removed its own finalizer, which can be a moment after the Service is gone.
async fn wait_no_crs(bed: &TestBed, what: &str) {
    let lbs = crs(bed);
    wait::until(what, LIMIT, || {
        let lbs = lbs.clone();
        async move {
            let names: Vec<String> = lbs
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .map(|c| c.name_any())
                .collect();
            Ok(if names.is_empty() { Ok(()) } else { Err(names) })
        }
    })
    .await
    .unwrap();
}

/// Waits for an event with `reason` on Service `name` whose note contains `text`.
async fn wait_event(bed: &TestBed, name: &str, reason: &str, text: &str) -> String {
    service_controller::wait_event(bed, ("default", name), reason, text, LIMIT).await
}

#[tokio::test]
async fn lb_service_gets_a_pool_address_and_gives_it_back_on_delete() {
    let bed = TestBed::started().await;
    create_pool(&bed, "pool-1", json!([{"subnet": "192.168.50.0/24", "rangeStart": "192.168.50.10", "rangeEnd": "192.168.50.19"}])).await;
    let ccm = start_ccm(&bed);
    let created = services(&bed)
        .create(
            &PostParams::default(),
            &lb_svc(
                "web",
                &[(80, "TCP")],
                json!({"cloudprovider.harvesterhci.io/network": "default/vlan10"}),
            ),
        )
        .await
        .expect("create service");
    let (ip, svc) = wait_address(&bed, "web").await;
    assert_eq!(ip, "192.168.50.10");
    assert!(
        svc.finalizers().iter().any(|f| f == FINALIZER),
        "cleanup finalizer: {:?}",
        svc.finalizers()
    );
    assert_eq!(
        svc.annotations()
            .get("kube-vip.io/loadbalancerIPs")
            .map(String::as_str),
        Some("192.168.50.10")
    );
    assert_eq!(
        svc.labels()
            .get("cloudprovider.harvesterhci.io/primary-service"),
        None
    );

    let name = lb_name(CLUSTER, "default", "web", &created.uid().expect("uid"));
    let cr = crs(&bed)
        .get(&name)
        .await
        .expect("the CR has the upstream name");
    assert_eq!(cr.spec.workload_type.as_deref(), Some("cluster"));
    assert_eq!(cr.spec.ipam.as_deref(), Some("pool"));
    let l = cr.labels();
    assert_eq!(
        l.get("cloudprovider.harvesterhci.io/cluster")
            .map(String::as_str),
        Some(CLUSTER)
    );
    assert_eq!(
        l.get("cloudprovider.harvesterhci.io/serviceNamespace")
            .map(String::as_str),
        Some("default")
    );
    assert_eq!(
        l.get("cloudprovider.harvesterhci.io/serviceName")
            .map(String::as_str),
        Some("web")
    );
    let a = cr.annotations();
    // Harvester's webhook keeps the provider's network from v1.9; v1.7-v1.8 always re-derive it
    // from node-driver VMIs, of which this bed has none.
    let network = match testbed::sim::lb_webhook::Rules::from_env() {
        testbed::sim::lb_webhook::Rules::V1_9 => "default/vlan10",
        testbed::sim::lb_webhook::Rules::Legacy => "",
    };
    assert_eq!(
        a.get("loadbalancer.harvesterhci.io/network")
            .map(String::as_str),
        Some(network)
    );
    assert_eq!(
        a.get("cloudprovider.harvesterhci.io/lb-network")
            .map(String::as_str),
        Some("default/vlan10")
    );
    assert_eq!(
        a.get("loadbalancer.harvesterhci.io/cluster")
            .map(String::as_str),
        Some(CLUSTER)
    );
    let lbs = crs(&bed);
    let mirrored = wait::until("CR status.address mirrored", LIMIT, || {
        let lbs = lbs.clone();
        let name = name.clone();
        async move {
            let cr = lbs.get(&name).await.map_err(|e| e.to_string())?;
            let addr = cr.status.and_then(|s| s.address);
            Ok(if addr.is_some() { Ok(addr) } else { Err(addr) })
        }
    })
    .await
    .unwrap();
    assert_eq!(mirrored.as_deref(), Some("192.168.50.10"));
    wait_event(&bed, "web", "EnsuredLoadBalancer", "192.168.50.10").await;

    services(&bed)
        .delete("web", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&bed, "web").await;
    wait_no_crs(&bed, "no CR left").await;
    let pools = Api::<IPPool>::all(bed.harvester.client.clone());
    wait::until("address back in the pool", LIMIT, || {
        let pools = pools.clone();
        async move {
            let st = pools
                .get("pool-1")
                .await
                .map_err(|e| e.to_string())?
                .status
                .unwrap_or_default();
            Ok(if st.allocated.is_empty() {
                Ok(())
            } else {
                Err(st.allocated)
            })
        }
    })
    .await
    .unwrap();
    ccm.stop().await;
}

#[tokio::test]
async fn lb_service_waits_with_an_event_while_the_pool_is_exhausted_then_converges() {
    let bed = TestBed::started().await;
    create_pool(&bed, "small", json!([{"subnet": "10.20.0.5/32"}])).await;
    let ccm = start_ccm(&bed);
    let api = services(&bed);
    api.create(
        &PostParams::default(),
        &lb_svc("first", &[(80, "TCP")], json!({})),
    )
    .await
    .unwrap();
    let (first, _) = wait_address(&bed, "first").await;
    assert_eq!(first, "10.20.0.5");
    api.create(
        &PostParams::default(),
        &lb_svc("second", &[(80, "TCP")], json!({})),
    )
    .await
    .unwrap();
    wait_event(
        &bed,
        "second",
        "SyncLoadBalancerFailed",
        "no IP addresses available",
    )
    .await;
    assert!(
        ingress_ip(&api.get("second").await.unwrap()).is_none(),
        "pending while exhausted"
    );

    // Widen the pool: the second Service converges by itself, no delete-and-recreate.
    let pools = Api::<IPPool>::all(bed.harvester.client.clone());
    let cr_before = cr_names(&bed).await;
    pools
        .patch(
            "small",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ranges": [
            {"subnet": "10.20.0.5/32"}, {"subnet": "10.20.0.6/32"}]}})),
        )
        .await
        .expect("widen pool");
    let (second, _) = wait_address(&bed, "second").await;
    assert_eq!(second, "10.20.0.6");
    assert_eq!(
        cr_names(&bed).await,
        cr_before,
        "the same CRs, none recreated"
    );
    ccm.stop().await;
}

#[tokio::test]
async fn lb_secondaries_share_the_primary_address_and_conflicting_ports_are_refused() {
    let bed = TestBed::started().await;
    create_pool(&bed, "p", json!([{"subnet": "10.30.0.0/29"}])).await;
    let ccm = start_ccm(&bed);
    let api = services(&bed);
    api.create(
        &PostParams::default(),
        &lb_svc("gw", &[(80, "TCP")], json!({})),
    )
    .await
    .unwrap();
    let (ip, _) = wait_address(&bed, "gw").await;
    let shared = json!({"cloudprovider.harvesterhci.io/primary-service": "default/gw"});
    api.create(
        &PostParams::default(),
        &lb_svc("dns", &[(53, "UDP"), (80, "UDP")], shared.clone()),
    )
    .await
    .unwrap();
    let (dns_ip, dns) = wait_address(&bed, "dns").await;
    assert_eq!(dns_ip, ip, "secondary follows the primary");
    assert_eq!(
        dns.labels()
            .get("cloudprovider.harvesterhci.io/primary-service")
            .map(String::as_str),
        Some("default.gw")
    );
    // A bare name means the Service's own namespace.
    api.create(
        &PostParams::default(),
        &lb_svc(
            "clash",
            &[(80, "TCP")],
            json!({"cloudprovider.harvesterhci.io/primary-service": "gw"}),
        ),
    )
    .await
    .unwrap();
    wait_event(&bed, "clash", "PortConflict", "80/TCP").await;
    assert!(ingress_ip(&api.get("clash").await.unwrap()).is_none());
    assert_eq!(cr_names(&bed).await.len(), 1, "only the primary has a CR");

    // The primary cannot go while secondaries use its address.
    api.delete("clash", &DeleteParams::default()).await.unwrap();
    api.delete("gw", &DeleteParams::default()).await.unwrap();
    wait_event(&bed, "gw", "DeletingLoadBalancerFailed", "default/dns").await;
    assert!(
        api.get_opt("gw").await.unwrap().is_some(),
        "primary kept while shared"
    );
    api.delete("dns", &DeleteParams::default()).await.unwrap();
    wait_gone(&bed, "gw").await;
    wait_gone(&bed, "dns").await;
    wait_no_crs(&bed, "no CR left").await;
    ccm.stop().await;
}

#[tokio::test]
async fn lb_service_deleted_while_pending_leaves_no_cr() {
    let bed = TestBed::started().await;
    let ccm = start_ccm(&bed);
    let api = services(&bed);
    api.create(
        &PostParams::default(),
        &lb_svc("early", &[(80, "TCP")], json!({})),
    )
    .await
    .unwrap();
    wait_event(&bed, "early", "SyncLoadBalancerFailed", "no matched IPPool").await;
    assert_eq!(cr_names(&bed).await.len(), 1, "a CR exists while pending");
    api.delete("early", &DeleteParams::default()).await.unwrap();
    wait_gone(&bed, "early").await;
    wait_no_crs(&bed, "the pending CR was deleted").await;
    ccm.stop().await;
}

#[tokio::test]
async fn lb_service_recreated_with_a_new_uid_replaces_the_old_cr() {
    let bed = TestBed::started().await;
    create_pool(&bed, "p", json!([{"subnet": "10.40.0.0/29"}])).await;
    let ccm = start_ccm(&bed);
    let api = services(&bed);
    let old = api
        .create(
            &PostParams::default(),
            &lb_svc("app", &[(80, "TCP")], json!({})),
        )
        .await
        .unwrap();
    wait_address(&bed, "app").await;
    ccm.stop().await;
    // While the provider is down, someone force-removes the finalizer and recreates the Service.
    api.patch(
        "app",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    api.delete("app", &DeleteParams::default()).await.unwrap();
    wait_gone(&bed, "app").await;
    let new = api
        .create(
            &PostParams::default(),
            &lb_svc("app", &[(80, "TCP")], json!({})),
        )
        .await
        .unwrap();
    let ccm = start_ccm(&bed);
    wait_address(&bed, "app").await;
    let want = lb_name(CLUSTER, "default", "app", &new.uid().unwrap());
    let lbs = crs(&bed);
    wait::until("only the new Service's CR remains", LIMIT, || {
        let lbs = lbs.clone();
        let want = want.clone();
        async move {
            let names: Vec<String> = lbs
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .map(|c| c.name_any())
                .collect();
            Ok(if names == [want] { Ok(()) } else { Err(names) })
        }
    })
    .await
    .unwrap();
    assert_ne!(old.uid(), new.uid());
    ccm.stop().await;
}

#[tokio::test]
async fn lb_orphaned_crs_of_this_cluster_are_collected_at_start() {
    let bed = TestBed::started().await;
    let orphan: LoadBalancer = serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": "orphan", "labels": {
            "cloudprovider.harvesterhci.io/cluster": CLUSTER,
            "cloudprovider.harvesterhci.io/serviceNamespace": "default",
            "cloudprovider.harvesterhci.io/serviceName": "gone"}},
        "spec": {"workloadType": "cluster", "ipam": "pool"}
    }))
    .unwrap();
    let mut foreign = orphan.clone();
    foreign.metadata.name = Some("other-cluster".into());
    foreign.labels_mut().insert(
        "cloudprovider.harvesterhci.io/cluster".into(),
        "someone-else".into(),
    );
    crs(&bed)
        .create(&PostParams::default(), &orphan)
        .await
        .unwrap();
    crs(&bed)
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();
    let ccm = start_ccm(&bed);
    let lbs = crs(&bed);
    wait::until("orphan collected", LIMIT, || {
        let lbs = lbs.clone();
        async move {
            let names: Vec<String> = lbs
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .map(|c| c.name_any())
                .collect();
            Ok(if names == ["other-cluster"] {
                Ok(())
            } else {
                Err(names)
            })
        }
    })
    .await
    .unwrap();
    ccm.stop().await;
}

#[tokio::test]
async fn lb_bad_annotation_gets_a_warning_and_creates_nothing() {
    let bed = TestBed::started().await;
    let ccm = start_ccm(&bed);
    services(&bed)
        .create(
            &PostParams::default(),
            &lb_svc(
                "bad",
                &[(80, "TCP")],
                json!({"cloudprovider.harvesterhci.io/ipam": "static"}),
            ),
        )
        .await
        .unwrap();
    let note = wait_event(
        &bed,
        "bad",
        "SyncLoadBalancerFailed",
        "cloudprovider.harvesterhci.io/ipam",
    )
    .await;
    assert!(note.contains("static"), "{note}");
    assert!(
        cr_names(&bed).await.is_empty(),
        "nothing created from bad input"
    );
    let svc = services(&bed).get("bad").await.unwrap();
    assert!(
        svc.finalizers().is_empty(),
        "no finalizer for a Service we do not serve"
    );
    ccm.stop().await;
}

#[tokio::test]
async fn lb_fifty_services_at_once_with_a_restart_in_the_middle_get_distinct_matching_addresses() {
    let bed = TestBed::started().await;
    create_pool(&bed, "big", json!([{"subnet": "10.50.0.0/24"}])).await;
    let ccm = start_ccm(&bed);
    let api = services(&bed);
    for i in 0..50 {
        api.create(
            &PostParams::default(),
            &lb_svc(&format!("s{i:02}"), &[(80, "TCP")], json!({})),
        )
        .await
        .unwrap();
    }
    // Restart the provider while it works through them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    ccm.stop().await;
    let ccm = start_ccm(&bed);
    let mut seen = BTreeSet::new();
    for i in 0..50 {
        let name = format!("s{i:02}");
        let (ip, svc) = wait_address(&bed, &name).await;
        assert!(seen.insert(ip.clone()), "address {ip} given twice");
        let cr = crs(&bed)
            .get(&lb_name(CLUSTER, "default", &name, &svc.uid().unwrap()))
            .await
            .unwrap();
        assert_eq!(
            cr.allocated_ip(),
            Some(ip.as_str()),
            "{name}: Service and CR agree"
        );
    }
    assert_eq!(
        cr_names(&bed).await.len(),
        50,
        "one CR per Service, none leaked"
    );
    ccm.stop().await;
}

/// Harvester's LB controller lost the status write that recorded an address while the pool kept
/// it (the pool is written first): upstream's allocator then refuses the LoadBalancer as a
/// duplicate applicant, the controller releases the address and says so in the Ready condition;
/// that status write wakes it again, and the pool's history gives the same address back. The
/// Service keeps that address, and nothing is allocated twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_a_lost_allocation_is_released_as_a_duplicate_and_the_same_address_comes_back() {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    use testbed::sim::lb::DUPLICATE_ALLOCATION;

    let bed = TestBed::started().await;
    create_pool(&bed, "pool-dup", json!([{"subnet": "10.71.0.0/24"}])).await;
    let ccm = start_ccm(&bed);
    let created = services(&bed)
        .create(
            &PostParams::default(),
            &lb_svc("dup", &[(80, "TCP")], json!({})),
        )
        .await
        .expect("service");
    let (ip, _) = wait_address(&bed, "dup").await;
    let name = lb_name(CLUSTER, "default", "dup", &created.uid().expect("uid"));
    let cr = crs(&bed);
    wait::until("the CR records the address", LIMIT, || {
        let cr = cr.clone();
        let (name, ip) = (name.clone(), ip.clone());
        async move {
            let lb = cr.get(&name).await.map_err(|e| e.to_string())?;
            Ok(if lb.allocated_ip() == Some(ip.as_str()) {
                Ok(())
            } else {
                Err(lb.status)
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Every version of the CR from now on, as the watch delivers them. The first is the initial
    // list; taking it before the patch starts the watch at that version, so the stand-in's
    // refusal cannot fall between the patch and a list that already shows the address back.
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut versions = Box::pin(watcher(cr.clone(), config).applied_objects());
    let listed = tokio::time::timeout(LIMIT, versions.next())
        .await
        .expect("the CR's watch lists it")
        .expect("the watch is open")
        .expect("the list succeeds");
    assert_eq!(
        listed.allocated_ip(),
        Some(ip.as_str()),
        "listed before the patch"
    );
    let t0 = std::time::Instant::now();
    cr.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"allocatedAddress": null}})),
    )
    .await
    .expect("the CR forgets its address");
    let mut said_duplicate = None;
    let back = tokio::time::timeout(LIMIT, async {
        while let Some(Ok(lb)) = versions.next().await {
            if let Some(c) = lb.ready_condition()
                && c.status == "False"
                && c.message
                    .as_deref()
                    .is_some_and(|m| m.contains(DUPLICATE_ALLOCATION))
            {
                said_duplicate.get_or_insert((c.message.clone(), t0.elapsed()));
            }
            if said_duplicate.is_some() && lb.allocated_ip().is_some() {
                return lb;
            }
        }
        panic!("the LoadBalancer watch ended");
    })
    .await
    .unwrap_or_else(|_| {
        panic!("no duplicate refusal and re-allocation within {LIMIT:?}; seen {said_duplicate:?}")
    });
    let (message, at) = said_duplicate.expect("seen");
    eprintln!(
        "duplicate refused after {at:?} ({message:?}); address back after {:?}",
        t0.elapsed()
    );
    assert_eq!(
        back.allocated_ip(),
        Some(ip.as_str()),
        "the same address again"
    );
    let pool = Api::<IPPool>::all(bed.harvester.client.clone())
        .get("pool-dup")
        .await
        .expect("pool");
    let holders: Vec<_> = pool
        .status
        .as_ref()
        .map(|s| {
            s.allocated
                .iter()
                .filter(|(_, id)| id.ends_with(&format!("/{name}")))
                .count()
        })
        .into_iter()
        .collect();
    assert_eq!(
        holders,
        vec![1],
        "allocated once in the pool: {:?}",
        pool.status
    );
    let (again, _) = wait_address(&bed, "dup").await;
    assert_eq!(again, ip, "the Service keeps its address");
    ccm.stop().await;
}

/// The NAD mapping ConfigMap is watched: created after the Service got its address, and then
/// changed, it reaches the Service's kube-vip interface annotation well within the controller's
/// 60 s resync (the limit here is 30 s), so the watch, not the resync, carried it.
#[tokio::test]
async fn lb_nad_mapping_changes_reach_the_services_naming_a_network() {
    let bed = TestBed::started().await;
    create_pool(&bed, "pool-nad", json!([{"subnet": "192.168.52.0/24", "rangeStart": "192.168.52.10", "rangeEnd": "192.168.52.19"}])).await;
    let ccm = start_ccm(&bed);
    services(&bed)
        .create(
            &PostParams::default(),
            &lb_svc(
                "vlan",
                &[(80, "TCP")],
                json!({ANN_NETWORK: "default/vlan10"}),
            ),
        )
        .await
        .expect("create service");
    let (_, svc) = wait_address(&bed, "vlan").await;
    assert_eq!(
        svc.annotations().get(KUBE_VIP_INTERFACE),
        None,
        "no mapping yet"
    );

    let configmaps: Api<ConfigMap> =
        Api::namespaced(bed.guest.client.clone(), NAD_MAPPING_NAMESPACE);
    let mapping = |iface: &str| -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": NAD_MAPPING_NAME},
            "data": {NAD_MAPPING_KEY: format!(r#"{{"default/vlan10": "{iface}"}}"#)}
        }))
        .expect("ConfigMap literal")
    };
    let interface_becomes = |want: &'static str| {
        let api = services(&bed);
        async move {
            wait::until(
                &format!("Service vlan's {KUBE_VIP_INTERFACE} becomes {want}"),
                LIMIT,
                || {
                    let api = api.clone();
                    async move {
                        let svc = api.get("vlan").await.map_err(|e| e.to_string())?;
                        let got = svc.annotations().get(KUBE_VIP_INTERFACE).cloned();
                        Ok(if got.as_deref() == Some(want) {
                            Ok(())
                        } else {
                            Err(got)
                        })
                    }
                },
            )
            .await
            .unwrap()
        }
    };
    configmaps
        .create(&PostParams::default(), &mapping("enp2s0"))
        .await
        .expect("create NAD mapping");
    interface_becomes("enp2s0").await;
    configmaps
        .replace(NAD_MAPPING_NAME, &PostParams::default(), &mapping("enp3s0"))
        .await
        .expect("change NAD mapping");
    interface_becomes("enp3s0").await;
    ccm.stop().await;
}
