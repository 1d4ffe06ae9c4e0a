//! KubeVirt's VMI `guestosinfo` subresource as the bed's virt-api plays it (kubevirt/kubevirt
//! v1.6.0, v1.7.0, v1.8.3 `pkg/virt-api/rest/subresource.go` `GuestOSInfo`), behind the real
//! aggregation layer, and the cloud provider's guest-agent fallback against it: a guest Node
//! named neither like its VM nor like the VMI's `spec.hostname` is found only through the
//! hostname the guest's qemu-guest-agent reports.

use std::time::Duration;

use harvester_cloud_provider::node::patch::UNINITIALIZED_TAINT;
use harvester_cloud_provider::{Config, Running};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::events::v1::Event;
use kube::api::Api;
use testbed::sim::GuestVm;
use testbed::sim::virt_api::{GUEST_OS_INFO, VMI_NO_AGENT, VMI_NOT_RUNNING};
use testbed::{TestBed, util::wait};

const LIMIT: Duration = Duration::from_secs(20);

fn start_ccm(bed: &TestBed) -> Running {
    let cloud_config = bed.cloud_config.to_string_lossy().to_string();
    let kubeconfig = bed.guest.kubeconfig.to_string_lossy().to_string();
    let config = Config::from_args([
        "harvester-cloud-provider",
        "--cloud-config",
        &cloud_config,
        "--kubeconfig",
        &kubeconfig,
        "--cluster-name",
        "guest-1",
        "--node-status-update-frequency",
        "1s",
    ])
    .expect("test flags are valid");
    harvester_cloud_provider::spawn(config)
}

/// What the aggregator relays of a `guestosinfo` GET: status code and body.
async fn guest_os_info(bed: &TestBed, vmi: &str) -> (u16, String) {
    let url = format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{}/virtualmachineinstances/{vmi}/guestosinfo",
        bed.vm_namespace
    );
    let req = http::Request::get(url).body(Vec::new()).expect("request");
    match bed.harvester.client.request_text(req).await {
        Ok(body) => (200, body),
        Err(kube::Error::Api(s)) => (s.code, format!("{} {}", s.reason, s.message)),
        Err(e) => panic!("guestosinfo of {vmi}: {e}"),
    }
}

/// The Node once the provider took its uninitialised taint away.
async fn initialised(bed: &TestBed, name: &str) -> Node {
    let api: Api<Node> = Api::all(bed.guest.client.clone());
    wait::until(&format!("Node {name} initialised"), LIMIT, || {
        let api = api.clone();
        async move {
            let node = api.get(name).await.map_err(|e| e.to_string())?;
            Ok(if tainted(&node) {
                Err(format!("{:?}", node.spec))
            } else {
                Ok(node)
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

fn tainted(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
}

fn provider_id(node: &Node) -> Option<String> {
    node.spec.as_ref().and_then(|s| s.provider_id.clone())
}

/// Waits for a Warning Event `reason` about Node `node`.
async fn warning(bed: &TestBed, node: &str, reason: &str) -> Event {
    let events: Api<Event> = Api::namespaced(bed.guest.client.clone(), "default");
    wait::until(&format!("Warning {reason} on Node {node}"), LIMIT, || {
        let events = events.clone();
        async move {
            let list = events
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?;
            let seen: Vec<String> = list
                .items
                .iter()
                .map(|e| format!("{:?}/{:?}", e.type_, e.reason))
                .collect();
            Ok(list
                .items
                .into_iter()
                .find(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node)
                        && e.type_.as_deref() == Some("Warning")
                        && e.reason.as_deref() == Some(reason)
                })
                .ok_or(seen))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn contract_guestosinfo_names_the_node_the_guest_agent_reports() {
    let bed = TestBed::started().await;
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    // The guest calls itself `pool-a-7f3k` (an FQDN, as an agent reports it); the VM is named
    // otherwise and its VMI has no spec.hostname.
    let spec = GuestVm::new("rke2-pool-a-0")
        .on_host("harvester-1")
        .ip("10.52.0.21")
        .guest_agent("pool-a-7f3k.cluster.internal");
    let (vm, vmi) = bed.sim.create_vm(&spec).await.expect("vm");
    assert_eq!(
        vmi.spec.rest.get("hostname"),
        None,
        "no VMI spec.hostname to match"
    );

    let (code, body) = guest_os_info(&bed, "rke2-pool-a-0").await;
    assert_eq!(code, 200, "{body}");
    let info: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(info["hostname"], "pool-a-7f3k.cluster.internal", "{info}");
    assert!(info["os"]["id"].is_string(), "{info}");

    bed.sim
        .create_guest_node("pool-a-7f3k")
        .await
        .expect("guest node");
    let ccm = start_ccm(&bed);
    let node = initialised(&bed, "pool-a-7f3k").await;
    assert_eq!(
        provider_id(&node),
        Some(format!("harvester://{}", vm.metadata.uid.expect("uid"))),
        "the Node is the VM the agent named"
    );
    assert!(
        bed.sim.hotplug.count(GUEST_OS_INFO, "rke2-pool-a-0", "") >= 1,
        "found through guestosinfo"
    );
    assert!(!ccm.is_finished(), "the cloud provider ended early");
    ccm.stop().await.expect("the cloud provider stops cleanly");
}

#[tokio::test]
async fn contract_guestosinfo_refusals_are_virt_api_s_and_the_provider_stays_correct() {
    let bed = TestBed::started().await;
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    // No agent: virt-api refuses before it asks virt-handler.
    let plain = GuestVm::new("no-agent")
        .on_host("harvester-1")
        .ip("10.52.0.31");
    bed.sim.create_vm(&plain).await.expect("vm without agent");
    // An agent that was connected, on a VMI that has stopped running (its condition lingers).
    let gone = GuestVm::new("stopped-guest")
        .on_host("harvester-1")
        .ip("10.52.0.32")
        .guest_agent("ghost-1");
    bed.sim.create_vm(&gone).await.expect("vm");
    bed.sim
        .power_off_vm("stopped-guest")
        .await
        .expect("power off");
    // And one that answers, to show the provider goes on with the rest.
    let good = GuestVm::new("rke2-pool-b-0")
        .on_host("harvester-1")
        .ip("10.52.0.33")
        .guest_agent("pool-b-x2");
    let (good_vm, _) = bed.sim.create_vm(&good).await.expect("vm");

    // virt-api's GET handlers write every StatusError with status 500 and its text.
    let (code, body) = guest_os_info(&bed, "no-agent").await;
    assert_eq!(code, 500, "{body}");
    assert!(
        body.contains(&format!(
            "Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io \"no-agent\": {VMI_NO_AGENT}"
        )),
        "{body}"
    );
    let (code, body) = guest_os_info(&bed, "stopped-guest").await;
    assert_eq!(code, 500, "{body}");
    assert!(
        body.contains(&format!(
            "Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io \"stopped-guest\": {VMI_NOT_RUNNING}"
        )),
        "{body}"
    );

    bed.sim.create_guest_node("ghost-1").await.expect("node");
    bed.sim.create_guest_node("pool-b-x2").await.expect("node");
    let ccm = start_ccm(&bed);
    let node = initialised(&bed, "pool-b-x2").await;
    assert_eq!(
        provider_id(&node),
        Some(format!(
            "harvester://{}",
            good_vm.metadata.uid.expect("uid")
        ))
    );
    // ghost-1 was named by an agent virt-api no longer answers for: not found, said so, kept.
    let event = warning(&bed, "ghost-1", "VirtualMachineNotFound").await;
    assert!(
        event
            .note
            .as_deref()
            .unwrap_or_default()
            .contains("ghost-1"),
        "{event:?}"
    );
    assert!(
        bed.sim.hotplug.count(GUEST_OS_INFO, "stopped-guest", "") >= 1,
        "the provider asked the stopped guest and was refused"
    );
    assert_eq!(
        bed.sim.hotplug.count(GUEST_OS_INFO, "no-agent", ""),
        1,
        "a VMI without the AgentConnected condition is not asked (only the test asked it)"
    );
    let ghost: Node = Api::all(bed.guest.client.clone())
        .get("ghost-1")
        .await
        .expect("ghost-1 stays");
    assert!(tainted(&ghost), "ghost-1 stays uninitialised");
    assert_eq!(provider_id(&ghost), None);
    assert!(!ccm.is_finished(), "the cloud provider ended early");
    ccm.stop().await.expect("the cloud provider stops cleanly");
}

/// A VMI backed by a real guest: virt-api's answer carries what the guest's qemu-guest-agent
/// says (`guest-get-host-name`), and the provider finds the Node by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_guestosinfo_asks_the_real_guest_agent() {
    use std::sync::Arc;
    use testbed::real::vm::{Vm, VmOptions};
    let bed = TestBed::started().await;
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    let vm = match Vm::start(bed.dir.path(), VmOptions::new("guest-qga")).await {
        Ok(vm) => Arc::new(vm),
        Err(e) => panic!("the guest VM must boot for this test: {e}"),
    };
    // The guest names itself before anything asks its agent for the name.
    vm.run("hostname pool-c-real")
        .await
        .expect("set the guest's hostname");
    let (created, _) = bed
        .sim
        .create_vm_backed(
            &GuestVm::new("rke2-pool-c-0").on_host("harvester-1"),
            vm.clone(),
        )
        .await
        .expect("VM and VMI backed by the guest");

    let (code, body) = guest_os_info(&bed, "rke2-pool-c-0").await;
    assert_eq!(code, 200, "{body}");
    let info: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(info["hostname"], "pool-c-real", "{info}");

    bed.sim
        .create_guest_node("pool-c-real")
        .await
        .expect("guest node");
    let ccm = start_ccm(&bed);
    let node = initialised(&bed, "pool-c-real").await;
    assert_eq!(
        provider_id(&node),
        Some(format!(
            "harvester://{}",
            created.metadata.uid.expect("uid")
        ))
    );
    ccm.stop().await.expect("the cloud provider stops cleanly");
    vm.stop().await;
}
