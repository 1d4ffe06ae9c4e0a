//! `cloudprovider.harvesterhci.io/ipam: guest`: addresses from the guest cluster's own pools
//! (ConfigMap `kube-system/kubevip`, kube-vip-cloud-provider's keys), allocated by the provider
//! with no LoadBalancer CR in Harvester, against the bed's real API servers.

use std::collections::BTreeSet;
use std::time::Duration;

use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testbed::suites::service_controller::{ServiceController, wait_event, wait_gone, wait_ingress};
use testbed::{TestBed, util::wait};

const CLUSTER: &str = "guest-pools";
const LIMIT: Duration = Duration::from_secs(30);

fn services(bed: &TestBed, ns: &str) -> Api<Service> {
    Api::namespaced(bed.guest.client.clone(), ns)
}

/// A LoadBalancer Service on port `port` with `annotations` and `spec` fields merged in.
fn lb_svc(
    name: &str,
    port: i32,
    annotations: serde_json::Value,
    spec: serde_json::Value,
) -> Service {
    let mut body = json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"type": "LoadBalancer", "ports": [{"port": port}]}
    });
    if let (Some(s), Some(extra)) = (body["spec"].as_object_mut(), spec.as_object()) {
        s.extend(extra.clone());
    }
    serde_json::from_value(body).expect("service literal")
}

fn guest() -> serde_json::Value {
    json!({"cloudprovider.harvesterhci.io/ipam": "guest"})
}

async fn create(bed: &TestBed, ns: &str, svc: Service) {
    services(bed, ns)
        .create(&PostParams::default(), &svc)
        .await
        .expect("create service");
}

async fn create_namespace(bed: &TestBed, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(bed.guest.client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
}

/// Writes ConfigMap `kube-system/kubevip` with `data` (server-side apply: creates or replaces).
async fn set_pools(bed: &TestBed, data: serde_json::Value) {
    let cm: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "kubevip", "namespace": "kube-system"},
        "data": data,
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(bed.guest.client.clone(), "kube-system")
        .patch(
            "kubevip",
            &PatchParams::apply("lb-guest-pool-test").force(),
            &Patch::Apply(&cm),
        )
        .await
        .expect("apply the pools");
}

async fn address(bed: &TestBed, ns: &str, name: &str) -> String {
    wait_ingress(&services(bed, ns), name, LIMIT).await.0
}

async fn no_address(bed: &TestBed, ns: &str, name: &str) -> Option<String> {
    ingress_ip(&services(bed, ns).get(name).await.expect("get service"))
}

async fn delete(bed: &TestBed, ns: &str, name: &str) {
    let api = services(bed, ns);
    api.delete(name, &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone(&api, name, LIMIT).await;
}

async fn crs(bed: &TestBed) -> Vec<String> {
    Api::<LoadBalancer>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
        .list(&ListParams::default())
        .await
        .expect("list CRs")
        .items
        .iter()
        .map(|c| c.name_any())
        .collect()
}

#[tokio::test]
async fn guest_pool_serves_a_namespace_from_its_own_range_before_the_global_one_with_no_cr() {
    let bed = TestBed::started().await;
    create_namespace(&bed, "apps").await;
    set_pools(
        &bed,
        json!({"range-global": "10.90.0.10-10.90.0.19", "cidr-apps": "10.91.0.8/30", "interface-apps": "eth7"}),
    )
    .await;
    let ccm = ServiceController::start(&bed, CLUSTER);
    create(&bed, "default", lb_svc("web", 80, guest(), json!({}))).await;
    create(&bed, "apps", lb_svc("api", 80, guest(), json!({}))).await;
    let (web, svc) = wait_ingress(&services(&bed, "default"), "web", LIMIT).await;
    assert_eq!(web, "10.90.0.10", "the first of range-global");
    assert_eq!(
        svc.annotations().get("kube-vip.io/loadbalancerIPs"),
        Some(&web),
        "kube-vip announces it"
    );
    let (api, svc) = wait_ingress(&services(&bed, "apps"), "api", LIMIT).await;
    assert_eq!(api, "10.91.0.8", "cidr-apps before range-global");
    assert_eq!(
        svc.annotations()
            .get("kube-vip.io/serviceInterface")
            .map(String::as_str),
        Some("eth7"),
        "interface-apps"
    );
    let note = wait_event(&bed, ("apps", "api"), "EnsuredLoadBalancer", &api, LIMIT).await;
    assert!(note.contains("guest pool cidr-apps"), "{note}");
    assert!(
        crs(&bed).await.is_empty(),
        "no LoadBalancer CR in Harvester"
    );
    ccm.stop().await;
}

#[tokio::test]
async fn guest_pool_exhausted_warns_then_a_freed_address_serves_the_waiting_service() {
    let bed = TestBed::started().await;
    set_pools(&bed, json!({"range-global": "10.92.0.1-10.92.0.2"})).await;
    let ccm = ServiceController::start(&bed, CLUSTER);
    for name in ["a", "b"] {
        create(&bed, "default", lb_svc(name, 80, guest(), json!({}))).await;
    }
    let held: BTreeSet<String> = [
        address(&bed, "default", "a").await,
        address(&bed, "default", "b").await,
    ]
    .into();
    assert_eq!(
        held,
        BTreeSet::from(["10.92.0.1".to_string(), "10.92.0.2".to_string()])
    );
    create(&bed, "default", lb_svc("c", 80, guest(), json!({}))).await;
    let note = wait_event(
        &bed,
        ("default", "c"),
        "GuestPoolExhausted",
        "range-global",
        LIMIT,
    )
    .await;
    assert!(note.contains("10.92.0.1-10.92.0.2"), "{note}");
    assert_eq!(
        no_address(&bed, "default", "c").await,
        None,
        "nothing while exhausted"
    );
    // a goes: its address is released and the waiting c is woken by it (no polling: the resync
    // of the bed's controller is 60 s, far beyond the wait).
    let a = address(&bed, "default", "a").await;
    delete(&bed, "default", "a").await;
    let started = std::time::Instant::now();
    let c = address(&bed, "default", "c").await;
    eprintln!("c got {c} {:?} after a was gone", started.elapsed());
    assert_eq!(c, a, "c takes the address a gave back");
    ccm.stop().await;
}

#[tokio::test]
async fn guest_pool_honours_a_requested_address_and_refuses_one_outside_or_taken() {
    let bed = TestBed::started().await;
    set_pools(&bed, json!({"cidr-global": "10.93.0.0/28"})).await;
    let ccm = ServiceController::start(&bed, CLUSTER);
    create(
        &bed,
        "default",
        lb_svc(
            "by-spec",
            80,
            guest(),
            json!({"loadBalancerIP": "10.93.0.9"}),
        ),
    )
    .await;
    let mut by_annotation = guest();
    by_annotation["kube-vip.io/loadbalancerIPs"] = json!("10.93.0.12");
    create(
        &bed,
        "default",
        lb_svc("by-annotation", 80, by_annotation, json!({})),
    )
    .await;
    assert_eq!(address(&bed, "default", "by-spec").await, "10.93.0.9");
    assert_eq!(
        address(&bed, "default", "by-annotation").await,
        "10.93.0.12"
    );

    create(
        &bed,
        "default",
        lb_svc(
            "outside",
            80,
            guest(),
            json!({"loadBalancerIP": "10.99.0.1"}),
        ),
    )
    .await;
    let note = wait_event(
        &bed,
        ("default", "outside"),
        "LoadBalancerIPNotHonoured",
        "10.99.0.1",
        LIMIT,
    )
    .await;
    assert!(note.contains("outside guest pool cidr-global"), "{note}");
    create(
        &bed,
        "default",
        lb_svc("taken", 80, guest(), json!({"loadBalancerIP": "10.93.0.9"})),
    )
    .await;
    let note = wait_event(
        &bed,
        ("default", "taken"),
        "LoadBalancerIPNotHonoured",
        "10.93.0.9",
        LIMIT,
    )
    .await;
    assert!(note.contains("already used by default/by-spec"), "{note}");
    assert_eq!(no_address(&bed, "default", "outside").await, None);
    assert_eq!(no_address(&bed, "default", "taken").await, None);
    // Unaffected: a Service asking for nothing gets the first free address (.0 is skipped, as
    // kube-vip-cloud-provider's search does).
    create(&bed, "default", lb_svc("plain", 80, guest(), json!({}))).await;
    assert_eq!(address(&bed, "default", "plain").await, "10.93.0.1");
    // The holder goes: the Service that asked for its address gets it.
    delete(&bed, "default", "by-spec").await;
    assert_eq!(address(&bed, "default", "taken").await, "10.93.0.9");
    ccm.stop().await;
}

#[tokio::test]
async fn guest_pool_address_is_shared_with_primary_service_and_released_on_delete() {
    let bed = TestBed::started().await;
    set_pools(&bed, json!({"range-global": "10.94.0.5-10.94.0.6"})).await;
    let ccm = ServiceController::start(&bed, CLUSTER);
    create(&bed, "default", lb_svc("gw", 80, guest(), json!({}))).await;
    let gw = address(&bed, "default", "gw").await;
    let mut shared = guest();
    shared["cloudprovider.harvesterhci.io/primary-service"] = json!("default/gw");
    create(&bed, "default", lb_svc("gw-dns", 53, shared, json!({}))).await;
    assert_eq!(
        address(&bed, "default", "gw-dns").await,
        gw,
        "the primary's address"
    );
    create(&bed, "default", lb_svc("other", 80, guest(), json!({}))).await;
    let other = address(&bed, "default", "other").await;
    assert_ne!(
        other, gw,
        "a shared address is not given to a third Service"
    );
    assert!(crs(&bed).await.is_empty());
    // Released on delete: secondary first (the primary is held while shared), then the primary.
    delete(&bed, "default", "gw-dns").await;
    delete(&bed, "default", "gw").await;
    create(&bed, "default", lb_svc("next", 80, guest(), json!({}))).await;
    assert_eq!(
        address(&bed, "default", "next").await,
        gw,
        "gw's address is free again"
    );
    ccm.stop().await;
}

#[tokio::test]
async fn guest_pool_addresses_survive_a_provider_restart_without_any_given_twice() {
    let bed = TestBed::started().await;
    set_pools(&bed, json!({"range-global": "10.95.0.1-10.95.0.8"})).await;
    let ccm = ServiceController::start(&bed, CLUSTER);
    let mut before = Vec::new();
    for i in 0..4 {
        create(
            &bed,
            "default",
            lb_svc(&format!("s{i}"), 80, guest(), json!({})),
        )
        .await;
    }
    for i in 0..4 {
        before.push(address(&bed, "default", &format!("s{i}")).await);
    }
    ccm.stop().await;
    // While the provider is down, more Services come; the restarted one rebuilds what is held
    // from the Services before it allocates.
    for i in 4..8 {
        create(
            &bed,
            "default",
            lb_svc(&format!("s{i}"), 80, guest(), json!({})),
        )
        .await;
    }
    let ccm = ServiceController::start(&bed, CLUSTER);
    let mut after = Vec::new();
    for i in 0..8 {
        after.push(address(&bed, "default", &format!("s{i}")).await);
    }
    assert_eq!(
        after[..4],
        before[..],
        "every address kept across the restart"
    );
    let distinct: BTreeSet<&String> = after.iter().collect();
    assert_eq!(distinct.len(), 8, "no address given twice: {after:?}");
    ccm.stop().await;
}

#[tokio::test]
async fn guest_pool_bad_input_warns_naming_key_and_value_and_leaves_others_served() {
    let bed = TestBed::started().await;
    for ns in ["broken", "overlap"] {
        create_namespace(&bed, ns).await;
    }
    set_pools(
        &bed,
        json!({
            "range-global": "10.96.0.1-10.96.0.9",
            "range-broken": "10.97.0.9-10.97.0.1",
            "cidr-overlap": "10.96.0.8/30",
        }),
    )
    .await;
    let ccm = ServiceController::start(&bed, CLUSTER);
    create(&bed, "broken", lb_svc("x", 80, guest(), json!({}))).await;
    create(&bed, "overlap", lb_svc("y", 80, guest(), json!({}))).await;
    create(&bed, "default", lb_svc("z", 80, guest(), json!({}))).await;
    let note = wait_event(
        &bed,
        ("broken", "x"),
        "GuestPoolInvalid",
        "range-broken",
        LIMIT,
    )
    .await;
    assert!(
        note.contains("10.97.0.9-10.97.0.1") && note.contains("ends before it starts"),
        "{note}"
    );
    let note = wait_event(
        &bed,
        ("overlap", "y"),
        "GuestPoolInvalid",
        "cidr-overlap",
        LIMIT,
    )
    .await;
    assert!(
        note.contains("overlaps range-global") && note.contains("10.96.0.8/30"),
        "{note}"
    );
    assert_eq!(
        address(&bed, "default", "z").await,
        "10.96.0.1",
        "other Services unaffected"
    );
    assert_eq!(no_address(&bed, "broken", "x").await, None);
    assert_eq!(no_address(&bed, "overlap", "y").await, None);
    // Fixing the ConfigMap serves them (its watch wakes the guest-pool Services).
    set_pools(
        &bed,
        json!({
            "range-global": "10.96.0.1-10.96.0.9",
            "range-broken": "10.97.0.1-10.97.0.9",
            "cidr-overlap": "10.98.0.8/30",
        }),
    )
    .await;
    assert_eq!(address(&bed, "broken", "x").await, "10.97.0.1");
    assert_eq!(address(&bed, "overlap", "y").await, "10.98.0.8");
    ccm.stop().await;
}

#[tokio::test]
async fn default_ipam_guest_serves_services_without_an_ipam_annotation() {
    let bed = TestBed::started().await;
    set_pools(&bed, json!({"range-global": "10.99.1.1-10.99.1.4"})).await;
    let ccm = ServiceController::start_with(&bed, CLUSTER, &["--default-ipam", "guest"]);
    create(&bed, "default", lb_svc("plain", 80, json!({}), json!({}))).await;
    assert_eq!(address(&bed, "default", "plain").await, "10.99.1.1");
    assert!(
        crs(&bed).await.is_empty(),
        "no LoadBalancer CR in Harvester"
    );
    ccm.stop().await;
}

/// A Service switched from Harvester's pools to `ipam: guest`: its CR goes (Harvester takes the
/// address back into its pool) and it gets a guest-pool address instead of keeping that one.
#[tokio::test]
async fn a_service_switched_from_harvesters_pool_to_guest_gets_a_guest_address_and_no_cr() {
    let bed = TestBed::started().await;
    let pool: harvester_common::harvester::IPPool = serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "IPPool",
        "metadata": {"name": "harvester-pool"},
        "spec": {"ranges": [{"subnet": "192.168.60.0/24"}],
                 "selector": {"scope": [{"project": "*", "namespace": "*", "guestCluster": "*"}]}}
    }))
    .expect("pool literal");
    Api::<harvester_common::harvester::IPPool>::all(bed.harvester.client.clone())
        .create(&PostParams::default(), &pool)
        .await
        .expect("pool");
    set_pools(&bed, json!({"range-global": "10.99.2.1-10.99.2.4"})).await;
    let ccm = ServiceController::start(&bed, CLUSTER);
    create(&bed, "default", lb_svc("moving", 80, json!({}), json!({}))).await;
    let from_harvester = address(&bed, "default", "moving").await;
    assert!(
        from_harvester.starts_with("192.168.60."),
        "{from_harvester}"
    );
    assert_eq!(crs(&bed).await.len(), 1);
    services(&bed, "default")
        .patch(
            "moving",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": guest()}})),
        )
        .await
        .expect("switch to ipam: guest");
    let note = wait_event(
        &bed,
        ("default", "moving"),
        "EnsuredLoadBalancer",
        "10.99.2.1",
        LIMIT,
    )
    .await;
    assert!(note.contains("guest pool range-global"), "{note}");
    assert_eq!(address(&bed, "default", "moving").await, "10.99.2.1");
    let lbs = crs(&bed).await;
    wait::until("the CR deleted", LIMIT, || async {
        let left = crs(&bed).await;
        Ok(if left.is_empty() { Ok(()) } else { Err(left) })
    })
    .await
    .unwrap_or_else(|e| panic!("{e} (was {lbs:?})"));
    ccm.stop().await;
}
