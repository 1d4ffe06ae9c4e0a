//! Harvester's LoadBalancer validating webhook on the bed (`testbed::sim::lb_validator`, played
//! from load-balancer-harvester v1.8.2 `pkg/webhook/loadbalancer/validator.go`) and the cloud
//! provider living with it: a refused LoadBalancer is a Warning Event on the Service carrying the
//! webhook's message, and nothing else is made.

use std::time::Duration;

use harvester_cloud_provider::service::plan::{LABEL_SERVICE_NAME, ingress_ip};
use harvester_common::harvester::{IPPool, LoadBalancer};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use testbed::sim::lb_validator::{ANN_ON_REMOVE, LABEL_CLUSTER_ON_VM, LABEL_CREATOR, WEBHOOK_NAME};
use testbed::suites::service_controller::ServiceController;
use testbed::{TestBed, util::wait};

const CLUSTER: &str = "rke2-going";
const LIMIT: Duration = Duration::from_secs(30);

fn start_ccm(bed: &TestBed) -> ServiceController {
    ServiceController::start(bed, CLUSTER)
}

/// A node-driver VM of guest cluster `CLUSTER`, marked as Rancher marks the VMs of a guest
/// cluster it is deleting when `removing`.
async fn guest_cluster_vm(bed: &TestBed, name: &str, removing: bool) {
    let mut annotations = serde_json::Map::new();
    if removing {
        annotations.insert(ANN_ON_REMOVE.into(), "true".into());
    }
    let yaml = json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": bed.vm_namespace,
                     "labels": {LABEL_CREATOR.0: LABEL_CREATOR.1, LABEL_CLUSTER_ON_VM: CLUSTER},
                     "annotations": annotations},
        "spec": {"running": false, "template": {"spec": {"domain": {"devices": {}}}}}
    })
    .to_string();
    testbed::bed::apply::apply_yaml(&bed.harvester.client, &yaml, &bed.vm_namespace)
        .await
        .expect("guest cluster VM");
}

/// Warning events on Service `name`: (reason, note).
async fn warnings(bed: &TestBed, name: &str) -> Result<Vec<(String, String)>, String> {
    let api: Api<Event> = Api::namespaced(bed.guest.client.clone(), "default");
    Ok(api
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .map(|e| {
            (
                e.reason.clone().unwrap_or_default(),
                e.note.clone().unwrap_or_default(),
            )
        })
        .collect())
}

/// Issue 23: v1.8's validator refuses a new cluster LoadBalancer while a VM of its guest cluster
/// is marked for removal. The provider tells the user why on the Service (the webhook's own
/// message), creates no CR, takes no address and sets no ingress; once the guest cluster is no
/// longer being removed, the same Service converges.
#[tokio::test]
async fn contract_lb_refused_by_harvester_validator_is_a_warning_event() {
    let bed = TestBed::started().await;
    bed.sim
        .create_pool("pool-v", "10.71.0.0/29")
        .await
        .expect("pool");
    guest_cluster_vm(&bed, "rke2-going-pool1-a", false).await;
    guest_cluster_vm(&bed, "rke2-going-pool1-b", true).await;
    let ccm = start_ccm(&bed);
    let svcs: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "late"},
        "spec": {"type": "LoadBalancer", "ports": [{"name": "http", "port": 80}], "selector": {"app": "late"}}
    }))
    .unwrap();
    svcs.create(&PostParams::default(), &svc)
        .await
        .expect("create Service");

    let expected = format!(
        "the vm {ns}/rke2-going-pool1-b shows guest cluster {CLUSTER} is being removed",
        ns = bed.vm_namespace
    );
    let note = wait::until(
        "a Warning Event on Service late carrying the validator's message",
        LIMIT,
        || {
            let bed = &bed;
            let expected = expected.clone();
            async move {
                let seen = warnings(bed, "late").await?;
                Ok(match seen.iter().find(|(_, n)| n.contains(&expected)) {
                    Some((_, n)) => Ok(n.clone()),
                    None => Err(seen),
                })
            }
        },
    )
    .await
    .unwrap();
    assert!(
        note.contains(WEBHOOK_NAME),
        "the note names the webhook that refused: {note}"
    );

    // Nothing else was made: no CR, no address taken from the pool, no ingress.
    let lbs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let crs: Vec<String> = lbs
        .list(&ListParams::default())
        .await
        .expect("list CRs")
        .items
        .iter()
        .map(|l| l.name_any())
        .collect();
    assert_eq!(crs, Vec::<String>::new(), "no LoadBalancer CR");
    let pool = Api::<IPPool>::all(bed.harvester.client.clone())
        .get("pool-v")
        .await
        .expect("pool");
    let allocated = serde_json::to_value(&pool.status).unwrap()["allocated"].clone();
    assert!(
        allocated.is_null() || allocated == json!({}),
        "no address allocated: {allocated}"
    );
    let svc = svcs.get("late").await.expect("Service");
    assert_eq!(ingress_ip(&svc), None, "no ingress");

    // The guest cluster is not being removed after all: the same Service converges.
    Api::<kube::api::DynamicObject>::namespaced_with(
        bed.harvester.client.clone(),
        &bed.vm_namespace,
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    )
    .patch(
        "rke2-going-pool1-b",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {ANN_ON_REMOVE: null}}})),
    )
    .await
    .expect("unmark the VM");
    wait::until(
        "Service late addressed from pool-v once the guest cluster stays",
        Duration::from_secs(60),
        || {
            let (svcs, lbs) = (svcs.clone(), lbs.clone());
            async move {
                let svc = svcs.get("late").await.map_err(|e| e.to_string())?;
                let crs: Vec<String> = lbs
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .iter()
                    .filter(|l| {
                        l.labels().get(LABEL_SERVICE_NAME).map(String::as_str) == Some("late")
                    })
                    .map(|l| l.name_any())
                    .collect();
                Ok(match ingress_ip(&svc) {
                    Some(ip) if ip.starts_with("10.71.0.") && crs.len() == 1 => Ok(ip),
                    other => Err((other, crs)),
                })
            }
        },
    )
    .await
    .unwrap();
    ccm.stop().await;
}
