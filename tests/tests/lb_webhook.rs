//! Harvester's LoadBalancer mutating webhook on the bed (a real admission webhook of the Harvester
//! kube-apiserver, `testbed::sim::lb_webhook`), and the cloud provider living with it: the keys
//! the webhook owns are never fought over, and a write it reverted leaves nothing "behind".

use std::collections::BTreeMap;
use std::time::Duration;

use harvester_cloud_provider::service;
use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use testbed::sim::lb::UNMANAGED;
use testbed::sim::lb_webhook::{
    ANN_CLUSTER, ANN_MANAGEMENT_NETWORK, ANN_NAMESPACE, ANN_NETWORK, ANN_PROJECT, ANN_PROJECT_ID,
    Rules,
};
use testbed::suites::service_controller::ServiceController;
use testbed::{BedOptions, TestBed, util::wait};

const CLUSTER: &str = "rke2-hook";
const LIMIT: Duration = Duration::from_secs(30);
const KUBE_VIP_IPS: &str = "kube-vip.io/loadbalancerIPs";

async fn bed(rules: Rules) -> TestBed {
    TestBed::start(BedOptions {
        lb_webhook: rules,
        ..BedOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("the test bed must start for this test: {e}"))
}

/// Gives the bed's VM namespace a Rancher project, as a Harvester imported into Rancher has, and
/// waits until the webhook reads it: like upstream's, it reads Namespaces from a watch cache, so
/// a LoadBalancer written right after the patch may still get the old project. A dry-run create
/// goes through the admission chain and stores nothing.
async fn set_project(bed: &TestBed, project_id: &str) {
    Api::<Namespace>::all(bed.harvester.client.clone())
        .patch(
            &bed.vm_namespace,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {ANN_PROJECT_ID: project_id}}})),
        )
        .await
        .expect("annotate the VM namespace");
    let want = project_id.replacen(':', "/", 1);
    let probe = lb(
        "project-probe",
        json!({ANN_CLUSTER: "probe", ANN_MANAGEMENT_NETWORK: "default/mgmt", UNMANAGED: "x"}),
    );
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let lbs = crs(bed);
    wait::until("the webhook to read the project", LIMIT, || async {
        let made = lbs
            .create(&dry_run, &probe)
            .await
            .map_err(|e| e.to_string())?;
        let got = made.annotations().get(ANN_PROJECT).cloned();
        Ok(if got.as_deref() == Some(want.as_str()) {
            Ok(())
        } else {
            Err(got)
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// A `cluster` LoadBalancer with IPAM `pool` and annotations `ann`, as the provider writes one.
fn lb(name: &str, ann: serde_json::Value) -> LoadBalancer {
    serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "annotations": ann},
        "spec": {"workloadType": "cluster", "ipam": "pool"}
    }))
    .unwrap()
}

fn crs(bed: &TestBed) -> Api<LoadBalancer> {
    Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
}

fn start_ccm(bed: &TestBed) -> ServiceController {
    ServiceController::start(bed, CLUSTER)
}

/// Waits until Service `name` shows `want` (Some: that address; None: any address) with
/// kube-vip's annotation equal to it, and the CR's `status.address` mirrors it.
async fn wait_converged(bed: &TestBed, name: &str, port: i32, want: Option<&str>) -> String {
    let svcs: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let lbs = crs(bed);
    wait::until(
        &format!("Service {name} (port {port}) addressed, kube-vip annotation set, address mirrored to its CR"),
        LIMIT,
        || {
            let (svcs, lbs) = (svcs.clone(), lbs.clone());
            async move {
                let svc = svcs.get(name).await.map_err(|e| e.to_string())?;
                let ip = ingress_ip(&svc);
                let ann = svc.annotations().get(KUBE_VIP_IPS).cloned();
                let ports: Vec<i32> = svc
                    .spec
                    .as_ref()
                    .and_then(|s| s.ports.as_ref())
                    .map(|p| p.iter().map(|p| p.port).collect())
                    .unwrap_or_default();
                let cr = lbs
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?
                    .items
                    .into_iter()
                    .find(|lb| lb.labels().get(service::plan::LABEL_SERVICE_NAME).map(String::as_str) == Some(name));
                let mirrored = cr.as_ref().and_then(|c| c.status.as_ref()).and_then(|s| s.address.clone());
                let seen = (ip.clone(), ann.clone(), mirrored.clone(), ports.clone(), cr.as_ref().map(|c| c.resource_version()));
                Ok(match ip {
                    Some(ip)
                        if want.is_none_or(|w| w == ip)
                            && ann.as_deref() == Some(&ip)
                            && mirrored.as_deref() == Some(&ip)
                            && ports == [port] =>
                    {
                        Ok(ip)
                    }
                    _ => Err(seen),
                })
            }
        },
    )
    .await
    .unwrap()
}

async fn the_cr(bed: &TestBed, name: &str) -> LoadBalancer {
    crs(bed)
        .list(&Default::default())
        .await
        .expect("list CRs")
        .items
        .into_iter()
        .find(|lb| {
            lb.labels()
                .get(service::plan::LABEL_SERVICE_NAME)
                .map(String::as_str)
                == Some(name)
        })
        .unwrap_or_else(|| panic!("a CR for Service {name}"))
}

/// Issue 23, defect 1: a Service carrying `cloudprovider.harvesterhci.io/project` and
/// `/namespace` converges (address, status mirrored), is edited and converges again, with the
/// webhook of each upstream release rewriting the CR's annotations on every write.
#[tokio::test]
async fn contract_lb_annotations_owned_by_harvester_webhook() {
    if testbed::bed::lb_upstream::skip(
        "contract_lb_annotations_owned_by_harvester_webhook",
        "it switches the stand-in webhook between releases and reads the writes it recorded",
    ) {
        return;
    }
    for rules in [Rules::V1_9, Rules::Legacy] {
        let bed = bed(rules).await;
        set_project(&bed, "c-abc:p-xyz").await;
        bed.sim
            .create_pool("pool-a", "10.70.0.0/29")
            .await
            .expect("pool");
        let ccm = start_ccm(&bed);
        let svcs: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "web", "annotations": {
                "cloudprovider.harvesterhci.io/project": "svc-cluster/svc-project",
                "cloudprovider.harvesterhci.io/namespace": "svc-namespace"}},
            "spec": {"type": "LoadBalancer", "ports": [{"name": "http", "port": 80}], "selector": {"app": "web"}}
        }))
        .unwrap();
        svcs.create(&PostParams::default(), &svc)
            .await
            .expect("create Service");
        let ip = wait_converged(&bed, "web", 80, None).await;

        // The CR carries what Harvester's webhook wrote, not what the Service asked for.
        let cr = the_cr(&bed, "web").await;
        let ann = cr.annotations();
        assert_eq!(
            ann.get(ANN_NAMESPACE).map(String::as_str),
            Some(bed.vm_namespace.as_str()),
            "{rules:?}"
        );
        assert_eq!(
            ann.get(ANN_PROJECT).map(String::as_str),
            Some("c-abc/p-xyz"),
            "{rules:?}"
        );

        // A user edit: another port and a stray kube-vip address; the provider puts its address
        // back and the CR keeps mirroring it.
        svcs.patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {KUBE_VIP_IPS: "192.0.2.99", "example.com/note": "edited"}},
                "spec": {"ports": [{"name": "http", "port": 8080}]}
            })),
        )
        .await
        .expect("edit Service");
        let again = wait_converged(&bed, "web", 8080, Some(&ip)).await;
        assert_eq!(again, ip, "{rules:?}: the same address after the edit");
        let cr = the_cr(&bed, "web").await;
        assert_eq!(
            cr.annotations().get(ANN_PROJECT).map(String::as_str),
            Some("c-abc/p-xyz"),
            "{rules:?}"
        );
        assert!(
            bed.lb_webhook
                .calls
                .load(std::sync::atomic::Ordering::SeqCst)
                > 0,
            "the API server called the webhook"
        );
        // Never fought: no update of ours tried to change a key the webhook owns.
        assert_eq!(
            bed.lb_webhook.owned_key_writes_by(service::MANAGER),
            Vec::<String>::new(),
            "{rules:?}: updates of the provider that tried to change webhook-owned keys"
        );
        ccm.stop().await;
    }
}

/// The stand-in through the real API server: a cluster LoadBalancer's namespace and project are
/// the webhook's on create and on update (an update that changes only them stores nothing and
/// keeps the resourceVersion), the network follows v1.9's order, and a cluster LoadBalancer
/// without annotations gets them.
#[tokio::test]
async fn lb_webhook_mutates_creates_and_updates_through_the_api_server() {
    if testbed::bed::lb_upstream::skip(
        "lb_webhook_mutates_creates_and_updates_through_the_api_server",
        "it keeps the stand-in controller off its CRs (UNMANAGED) and reads the stand-in \
         webhook's record of writes",
    ) {
        return;
    }
    let bed = bed(Rules::V1_9).await;
    set_project(&bed, "c-1:p-2").await;
    // The stand-in's LB controller leaves these alone (UNMANAGED), so only the webhook writes.
    let lbs = crs(&bed);
    let made = lbs
        .create(
            &PostParams::default(),
            &lb(
                "a",
                json!({ANN_CLUSTER: "gc1", ANN_PROJECT: "mine", ANN_NAMESPACE: "elsewhere",
                       ANN_MANAGEMENT_NETWORK: "default/mgmt", UNMANAGED: "x"}),
            ),
        )
        .await
        .expect("create");
    let want = BTreeMap::from([
        (ANN_CLUSTER.to_string(), "gc1".to_string()),
        (ANN_PROJECT.to_string(), "c-1/p-2".to_string()),
        (ANN_NAMESPACE.to_string(), bed.vm_namespace.clone()),
        (ANN_NETWORK.to_string(), "default/mgmt".to_string()),
        (
            ANN_MANAGEMENT_NETWORK.to_string(),
            "default/mgmt".to_string(),
        ),
        (UNMANAGED.to_string(), "x".to_string()),
    ]);
    assert_eq!(made.annotations(), &want);

    // An update that changes only keys the webhook owns stores nothing.
    let mut edit = made.clone();
    edit.annotations_mut()
        .insert(ANN_PROJECT.into(), "mine-again".into());
    edit.annotations_mut()
        .insert(ANN_NETWORK.into(), "default/other".into());
    let stored = lbs
        .replace("a", &PostParams::default(), &edit)
        .await
        .expect("update");
    assert_eq!(stored.annotations()[ANN_PROJECT], "c-1/p-2");
    assert_eq!(
        stored.annotations()[ANN_NETWORK],
        "default/other",
        "v1.9 keeps a network already on the LB"
    );
    assert_ne!(stored.resource_version(), made.resource_version());
    let mut only_owned = stored.clone();
    only_owned
        .annotations_mut()
        .insert(ANN_PROJECT.into(), "x".into());
    only_owned
        .annotations_mut()
        .insert(ANN_NAMESPACE.into(), "y".into());
    let same = lbs
        .replace("a", &PostParams::default(), &only_owned)
        .await
        .expect("update");
    assert_eq!(
        same.resource_version(),
        stored.resource_version(),
        "reverted by the webhook: nothing stored, same resourceVersion"
    );
    assert_eq!(
        bed.lb_webhook.owned_key_writes_by(""),
        ["a", "a"],
        "both updates tried to change webhook-owned keys, and the webhook saw it"
    );

    // No annotations: upstream answers `replace /metadata/annotations` all the same, and the
    // API server's JSONPatch (json-patch v4) applies a replace of a missing key like an add.
    let mut bare = lb("b", json!({}));
    bare.metadata.annotations = None;
    let made = lbs
        .create(&PostParams::default(), &bare)
        .await
        .expect("created");
    assert_eq!(
        made.annotations(),
        &BTreeMap::from([
            (ANN_NAMESPACE.to_string(), bed.vm_namespace.clone()),
            (ANN_PROJECT.to_string(), "c-1/p-2".to_string()),
            (ANN_NETWORK.to_string(), String::new()),
        ])
    );
}
