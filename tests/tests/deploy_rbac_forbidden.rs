//! The other half of the least-privilege proof (deploy_rbac.rs): take one needed verb away from
//! the documented RBAC and the flow fails, visibly, with a Forbidden that names the resource
//! and the verb, where an operator looks (an Event on the object, or the CSI error).

use std::time::Duration;

use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::volume_capability::access_mode::Mode;
use csi_proto::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
use csi_proto::csi::v1::*;
use harvester_cloud_provider::Config;
use harvester_cloud_provider::node::patch::UNINITIALIZED_TAINT;
use harvester_common::harvester::{HotplugMode, LoadBalancer};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use testbed::suites::deploy::*;
use testbed::{TestBed, util::wait};

const LIMIT: Duration = Duration::from_secs(30);

/// Waits for a Warning Event with `reason` about `name` (in `namespace`) whose note mentions
/// `text`, and returns the note.
async fn warning(bed: &TestBed, namespace: &str, name: &str, reason: &str, text: &str) -> String {
    let events: Api<Event> = Api::namespaced(bed.guest.client.clone(), namespace);
    wait::until(
        &format!("Warning {reason} on {name} mentioning {text:?}"),
        LIMIT,
        || {
            let events = events.clone();
            async move {
                let list = events
                    .list(&ListParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                let seen: Vec<(Option<String>, Option<String>)> = list
                    .items
                    .iter()
                    .map(|e| (e.reason.clone(), e.note.clone()))
                    .collect();
                Ok(list
                    .items
                    .into_iter()
                    .find(|e| {
                        e.type_.as_deref() == Some("Warning")
                            && e.reason.as_deref() == Some(reason)
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                            && e.note.as_deref().is_some_and(|n| n.contains(text))
                    })
                    .and_then(|e| e.note)
                    .ok_or(seen))
            }
        },
    )
    .await
    .map(|note| {
        eprintln!("Warning {reason} on {name}: {note}");
        note
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

/// An IPPool of 192.168.50.0/24 for every guest cluster.
async fn create_pool(bed: &TestBed) {
    bed.sim
        .create_pool("pool-1", "192.168.50.0/24")
        .await
        .expect("pool");
}

/// LoadBalancer Service `default/web` on port 80; returns the Services of `default`.
async fn create_web_service(bed: &TestBed) -> Api<Service> {
    let services = Api::<Service>::namespaced(bed.guest.client.clone(), "default");
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "web"},
                "spec": {"type": "LoadBalancer", "selector": {"app": "web"},
                         "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}
            }))
            .expect("service literal"),
        )
        .await
        .expect("service");
    services
}

/// The cloud provider on the chart's flags, under service accounts bound to `chart`'s guest RBAC
/// and `harvester_docs` in Harvester.
async fn spawn_ccm(
    bed: &TestBed,
    chart: &[serde_json::Value],
    harvester_docs: &[serde_json::Value],
) -> harvester_cloud_provider::Running {
    let accounts = accounts(bed, chart, Some(CCM_SA), harvester_docs).await;
    harvester_cloud_provider::spawn(
        Config::from_args(ccm_args(chart, &accounts)).expect("chart flags"),
    )
}

/// The cloud provider under the chart's RBAC minus `verb` on core `resource` in its ClusterRole.
async fn spawn_ccm_without(
    bed: &TestBed,
    resource: &str,
    verb: &str,
) -> harvester_cloud_provider::Running {
    let mut chart = ccm_chart();
    revoke(
        &mut chart,
        "ClusterRole",
        "harvester-cloud-provider",
        "",
        resource,
        verb,
    );
    let harvester_docs = harvester_rbac_of(&bed.vm_namespace, HARVESTER_CCM_ROLES);
    spawn_ccm(bed, &chart, &harvester_docs).await
}

/// Creates Service `default/web` and returns the note of its Forbidden `SyncLoadBalancerFailed`.
async fn web_service_forbidden(bed: &TestBed) -> String {
    create_web_service(bed).await;
    warning(bed, "default", "web", "SyncLoadBalancerFailed", "forbidden").await
}

#[tokio::test]
async fn without_patch_on_nodes_the_node_stays_tainted_with_a_forbidden_event() {
    let bed = TestBed::started().await.with_vm("worker-1").await;
    let ccm = spawn_ccm_without(&bed, "nodes", "patch").await;
    bed.sim.create_guest_node("worker-1").await.expect("node");

    let note = warning(&bed, "default", "worker-1", "NodeUpdateFailed", "forbidden").await;
    for part in [
        "forbidden",
        "system:serviceaccount:kube-system:harvester-cloud-provider",
        "cannot patch resource \"nodes\"",
    ] {
        assert!(note.contains(part), "the Event says {part:?}: {note}");
    }
    let node = Api::<Node>::all(bed.guest.client.clone())
        .get("worker-1")
        .await
        .expect("node");
    assert!(
        node.spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .iter()
            .any(|t| t.key == UNINITIALIZED_TAINT),
        "the Node must stay uninitialised"
    );
    ccm.stop().await.expect("the cloud provider stops cleanly");
}

#[tokio::test]
async fn without_update_on_loadbalancers_the_service_gets_a_forbidden_event() {
    let bed = TestBed::started().await.with_vm("worker-1").await;
    create_pool(&bed).await;
    let chart = ccm_chart();
    // The provider writes LoadBalancers with `update` (as upstream Harvester's role grants).
    let mut harvester_docs = harvester_rbac_of(&bed.vm_namespace, HARVESTER_CCM_ROLES);
    revoke(
        &mut harvester_docs,
        "ClusterRole",
        HARVESTER_CCM_ROLES,
        "loadbalancer.harvesterhci.io",
        "loadbalancers",
        "update",
    );
    let ccm = spawn_ccm(&bed, &chart, &harvester_docs).await;
    let note = web_service_forbidden(&bed).await;
    let user = format!("system:serviceaccount:{}:{CLUSTER}", bed.vm_namespace);
    for part in [
        "forbidden",
        user.as_str(),
        "cannot update resource \"loadbalancers\"",
    ] {
        assert!(note.contains(part), "the Event says {part:?}: {note}");
    }
    ccm.stop().await.expect("the cloud provider stops cleanly");
}

/// The finalizer and the CR of a new Service are written at once: when the finalizer is refused,
/// the Service gets the Forbidden and no CR made beside it is left once the provider stops (it
/// deletes each one again before reporting; a CR kept without the finalizer would leak when the
/// Service goes).
#[tokio::test]
async fn without_patch_on_services_the_service_gets_a_forbidden_event_and_no_cr_is_left() {
    let bed = TestBed::started().await.with_vm("worker-1").await;
    create_pool(&bed).await;
    let ccm = spawn_ccm_without(&bed, "services", "patch").await;
    let note = web_service_forbidden(&bed).await;
    for part in [
        "system:serviceaccount:kube-system:harvester-cloud-provider",
        "cannot patch resource \"services\"",
    ] {
        assert!(note.contains(part), "the Event says {part:?}: {note}");
    }
    ccm.stop().await.expect("the cloud provider stops cleanly");
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    wait::until("no LoadBalancer CR left", LIMIT, || {
        let crs = crs.clone();
        async move {
            let left: Vec<String> = crs
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .map(|lb| lb.metadata.name.clone().unwrap_or_default())
                .collect();
            Ok(if left.is_empty() { Ok(()) } else { Err(left) })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The chart's Role minus ConfigMap `kube-system/kubevip` (the guest pools, new with `ipam:
/// guest`): only guest-pool Services need it, so a pool Service still gets its address.
#[tokio::test]
async fn without_the_guest_pool_configmap_pool_services_still_get_their_address() {
    let bed = TestBed::started().await.with_vm("worker-1").await;
    create_pool(&bed).await;
    let mut chart = ccm_chart();
    let role = chart
        .iter_mut()
        .find(|d| {
            d["kind"] == "Role" && d["metadata"]["name"] == "harvester-cloud-provider-nad-mapping"
        })
        .expect("the ConfigMap Role");
    role["rules"][0]["resourceNames"] = json!(["harvester-nad-mapping"]);
    let harvester_docs = harvester_rbac_of(&bed.vm_namespace, HARVESTER_CCM_ROLES);
    let ccm = spawn_ccm(&bed, &chart, &harvester_docs).await;
    let services = create_web_service(&bed).await;
    testbed::suites::service_controller::wait_ingress(&services, "web", LIMIT).await;
    ccm.stop().await.expect("the cloud provider stops cleanly");
}

#[tokio::test]
async fn without_update_on_addvolume_publish_fails_naming_the_subresource() {
    publish_fails_without(
        HotplugMode::Subresource,
        (
            "subresources.kubevirt.io",
            "virtualmachines/addvolume",
            "update",
        ),
        "cannot update resource \"virtualmachines/addvolume\"",
    )
    .await;
}

#[tokio::test]
async fn without_update_on_addvolume_publish_on_harvester_1_8_fails_naming_the_subresource() {
    publish_fails_without(
        HotplugMode::Declarative,
        (
            "subresources.kubevirt.io",
            "virtualmachines/addvolume",
            "update",
        ),
        "cannot update resource \"virtualmachines/addvolume\"",
    )
    .await;
}

/// On a Harvester whose hot-plug is `mode`, the controller with the documented RBAC minus
/// `(group, resource, verb)` fails ControllerPublishVolume with PERMISSION_DENIED saying `says`.
async fn publish_fails_without(mode: HotplugMode, revoked: (&str, &str, &str), says: &str) {
    let bed = TestBed::started().await.with_vm("worker-1").await;
    bed.sim
        .set_hotplug_mode(mode)
        .await
        .expect("setting the bed's Harvester version");
    let mut harvester_docs = harvester_rbac_of(&bed.vm_namespace, HARVESTER_CSI_ROLES);
    let (group, resource, verb) = revoked;
    revoke(
        &mut harvester_docs,
        "ClusterRole",
        HARVESTER_CSI_ROLES,
        group,
        resource,
        verb,
    );
    let accounts = accounts(&bed, &[], None, &harvester_docs).await;
    let socket = bed.dir.path().join("csi-controller.sock");
    let mut config = harvester_csi_driver::Config::new(
        format!("unix://{}", socket.display()),
        &accounts.cloud_config,
    );
    config.mode = harvester_csi_driver::Mode::Controller;
    let driver = harvester_csi_driver::spawn(config);
    wait::until("the driver's socket", LIMIT, || {
        let exists = socket.exists();
        async move { Ok(if exists { Ok(()) } else { Err(()) }) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut c = ControllerClient::new(
        harvester_csi_driver::connect(&socket)
            .await
            .expect("connecting"),
    );
    let cap = VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    };
    let vol = c
        .create_volume(testbed::csi_client::create_request(
            "pvc-forbidden",
            64 << 20,
            &cap,
        ))
        .await
        .expect("CreateVolume is still allowed")
        .into_inner()
        .volume
        .expect("volume");
    let err = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "worker-1".into(),
            volume_capability: Some(cap),
            ..Default::default()
        })
        .await
        .expect_err("publishing without the revoked verb must fail");
    let msg = err.message();
    eprintln!("ControllerPublishVolume: {:?}: {msg}", err.code());
    assert_eq!(
        err.code(),
        tonic::Code::PermissionDenied,
        "RBAC's refusal is PERMISSION_DENIED, not INTERNAL: {msg}"
    );
    for part in ["forbidden", says] {
        assert!(
            msg.contains(part),
            "the error says {part:?}: {:?} {msg}",
            err.code()
        );
    }
    let _ = tokio::time::timeout(Duration::from_secs(20), driver.stop()).await;
}
