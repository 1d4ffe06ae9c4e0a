//! Fault test: one Harvester LoadBalancer CR of this guest cluster that the provider cannot read
//! (`status.allocatedAddress` a string instead of an object, `spec.ipam` a number instead of a
//! string). kube-apiserver's schema refuses such
//! a write, so it is put straight into etcd, as an older or newer Harvester, a restore or a hand
//! edit of storage could leave it. The provider must ignore that one object and keep reconciling
//! every other Service: when the object arrives in its running watch (passes), and when it is
//! already there as the provider starts and lists.

use testbed::suites::chaos as common;

use std::time::{Duration, Instant};

use common::{
    LIMIT, bed, create_pool, create_service, crs, etcd_put, ingress_ip, services, start_provider,
};
use harvester_cloud_provider::service::name::lb_name;
use harvester_cloud_provider::service::plan::{
    LABEL_CLUSTER, LABEL_SERVICE_NAME, LABEL_SERVICE_NAMESPACE,
};
use harvester_common::harvester::LoadBalancer;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::json;
use testbed::{TestBed, util::wait};

const BAD: &str = "chaos-default-ghost-0badcafe";

/// A CR of this cluster for a Service that does not exist, made valid through the API, then
/// overwritten in etcd with `status.allocatedAddress` as a string.
async fn plant_malformed_cr(bed: &TestBed) {
    plant(bed).await;
    let api = dynamic(bed);
    wait::until("kube-apiserver serves the malformed CR", LIMIT, || {
        let api = api.clone();
        async move {
            let obj = api.get(BAD).await.map_err(|e| e.to_string())?;
            let addr = obj.data["status"]["allocatedAddress"].clone();
            let ipam = obj.data["spec"]["ipam"].clone();
            Ok(if addr.is_string() && ipam.is_number() {
                Ok(())
            } else {
                Err((addr, ipam))
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // Nothing writes it back.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_still_malformed(bed).await;
}

fn dynamic(bed: &TestBed) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
        "loadbalancer.harvesterhci.io",
        "v1beta1",
        "LoadBalancer",
    ));
    Api::namespaced_with(bed.harvester.client.clone(), &bed.vm_namespace, &ar)
}

/// kube-apiserver serves the CR as stored, with the string, unless the provider's garbage
/// collection deleted it (its Service `ghost` does not exist): nothing rewrote it.
async fn assert_still_malformed(bed: &TestBed) {
    let Some(obj) = dynamic(bed)
        .get_opt(BAD)
        .await
        .expect("reading the malformed CR")
    else {
        return;
    };
    let addr = &obj.data["status"]["allocatedAddress"];
    assert!(
        addr.is_string() && obj.data["spec"]["ipam"].is_number(),
        "still malformed: {addr}; {}",
        serde_json::to_string_pretty(&obj).unwrap()
    );
}

async fn plant(bed: &TestBed) {
    let cr: LoadBalancer = serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": BAD, "labels": {
            LABEL_CLUSTER: common::CLUSTER,
            LABEL_SERVICE_NAMESPACE: "default",
            LABEL_SERVICE_NAME: "ghost"}},
        "spec": {"workloadType": "cluster", "ipam": "pool"}
    }))
    .unwrap();
    crs(bed)
        .create(&PostParams::default(), &cr)
        .await
        .expect("create the CR");
    // Let the stand-in finish with it first (allocated, Ready, and no write for a second): a
    // late status patch of its own would repair the field.
    let api = crs(bed);
    let start = Instant::now();
    let mut last = (String::new(), Instant::now());
    let allocated = loop {
        let lb = api.get(BAD).await.expect("get the CR");
        let ready = lb.ready_condition().is_some_and(|c| c.status == "True");
        let rv = lb.resource_version().unwrap_or_default();
        if rv != last.0 {
            last = (rv, Instant::now());
        }
        if ready && lb.allocated_ip().is_some() && last.1.elapsed() >= Duration::from_secs(1) {
            break lb;
        }
        assert!(
            start.elapsed() < LIMIT,
            "the stand-in did not settle on the CR: {:?}",
            lb.status
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut raw = serde_json::to_value(&allocated).unwrap();
    raw["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    raw["status"] = json!({"allocatedAddress": "10.99.0.1"});
    raw["spec"]["ipam"] = json!(7);
    // From now on the stand-in leaves it alone (Harvester's controller could not decode it either).
    raw["metadata"]["annotations"] = json!({testbed::sim::lb::UNMANAGED: "true"});
    let key = format!(
        "/harvester/loadbalancer.harvesterhci.io/loadbalancers/{}/{BAD}",
        bed.vm_namespace
    );
    etcd_put(&bed.etcd.url, &key, raw.to_string().as_bytes());
}

async fn wait_address(bed: &TestBed, name: &str, why: &str) -> String {
    let api = services(bed);
    wait::until(
        &format!("Service {name} gets an address ({why})"),
        LIMIT,
        || {
            let api = api.clone();
            async move {
                let svc = api.get(name).await.map_err(|e| e.to_string())?;
                Ok(match ingress_ip(&svc) {
                    Some(ip) => Ok(ip),
                    None => Err(svc.metadata.finalizers),
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_cr_arriving_in_the_watch_does_not_stop_other_services() {
    let bed = bed().await;
    create_pool(&bed, "192.168.80.0/24").await;
    let _ccm = start_provider(&bed, "ccm-1");
    create_service(&bed, "before").await;
    wait_address(&bed, "before", "no malformed CR yet").await;

    plant_malformed_cr(&bed).await;
    create_service(&bed, "during").await;
    wait_address(&bed, "during", "malformed CR seen by the running watch").await;
    assert_still_malformed(&bed).await;
}

/// The provider's LoadBalancer watch lists the CRs of its cluster as typed objects: one CR it
/// could not decode used to fail every list (the watch never started, a new Service never got its
/// address until the 5-minute resync). LoadBalancer spec and status are now decoded leniently: a
/// bad field reads as unset, with a warning naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_cr_present_at_start_does_not_stop_other_services() {
    let bed = bed().await;
    create_pool(&bed, "192.168.81.0/24").await;
    plant_malformed_cr(&bed).await;

    let ccm = start_provider(&bed, "ccm-1");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let svc = create_service(&bed, "after").await;
    // Harvester (the stand-in) allocates its CR ...
    let cr = lb_name(common::CLUSTER, "default", "after", &svc.uid().unwrap());
    let api = crs(&bed);
    let allocated = wait::until(
        "the stand-in allocates the CR of Service after",
        LIMIT,
        || {
            let (api, cr) = (api.clone(), cr.clone());
            async move {
                let lb = api.get_opt(&cr).await.map_err(|e| e.to_string())?;
                Ok(match lb.as_ref().and_then(|l| l.allocated_ip()) {
                    Some(ip) => Ok(ip.to_string()),
                    None => Err(lb.map(|l| l.status)),
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // ... and the provider must put that address on the Service.
    let ip = wait_address(
        &bed,
        "after",
        "malformed CR present when the provider lists",
    )
    .await;
    assert_eq!(ip, allocated);
    assert_still_malformed(&bed).await;
    let log = std::fs::read_to_string(&ccm.log).unwrap_or_default();
    assert!(
        log.contains(BAD),
        "the provider names the CR it cannot read in its log:\n{log}"
    );
}
