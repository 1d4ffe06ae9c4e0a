//! Demo steps of the cloud provider: start it in-process against the bed, watch it initialise the
//! guest Node `worker-1` from its VM, live-migrate the VM to a host in another zone and watch the
//! Node's labels follow, stop it.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use harvester_cloud_provider::node::patch::UNINITIALIZED_TAINT;
use harvester_common::harvester::{TOPOLOGY_REGION, TOPOLOGY_ZONE};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::Api;
use testbed::{TestBed, util::wait};

const NODE: &str = "worker-1";

pub async fn run(bed: &TestBed) -> anyhow::Result<()> {
    let config = super::ccm_config(bed, &[])?;
    println!(
        "--- cloud provider: starting (cloud-config {})",
        bed.cloud_config.display()
    );
    let t0 = Instant::now();
    let ccm = harvester_cloud_provider::spawn(config);
    let nodes: Api<Node> = Api::all(bed.guest.client.clone());

    let node = node_until(&nodes, "Node initialised", |n| {
        !n.spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
    })
    .await?;
    println!(
        "--- guest Node {NODE} initialised {:.1}s after the cloud provider started",
        t0.elapsed().as_secs_f64()
    );
    print_node(&node);

    bed.sim
        .create_host("harvester-2", Some("region-a"), Some("zone-2"))
        .await?;
    println!("--- live-migrating VM {NODE} to Harvester host harvester-2 (region-a/zone-2)");
    let t1 = Instant::now();
    bed.sim.migrate_vm(NODE, "harvester-2").await?;
    let node = node_until(&nodes, "zone label of harvester-2", |n| {
        n.labels().get(TOPOLOGY_ZONE).map(String::as_str) == Some("zone-2")
    })
    .await?;
    println!(
        "--- Node {NODE} follows its VM in {:.1}s: zone {}",
        t1.elapsed().as_secs_f64(),
        node.labels()
            .get(TOPOLOGY_ZONE)
            .map_or("(none)", String::as_str)
    );
    print_node(&node);

    ccm.stop().await.context("stopping the cloud provider")?;
    println!("--- cloud provider stopped");
    Ok(())
}

async fn node_until(
    nodes: &Api<Node>,
    what: &str,
    done: impl Fn(&Node) -> bool,
) -> anyhow::Result<Node> {
    let done = &done;
    wait::until(what, Duration::from_secs(30), || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get(NODE).await.map_err(|e| e.to_string())?;
            Ok(if done(&node) {
                Ok(node)
            } else {
                Err(node.spec.and_then(|s| s.taints))
            })
        }
    })
    .await
    .map_err(anyhow::Error::msg)
}

fn print_node(node: &Node) {
    let spec = node.spec.clone().unwrap_or_default();
    println!(
        "providerID: {}",
        spec.provider_id.as_deref().unwrap_or("(none)")
    );
    println!("addresses:");
    for a in node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
    {
        println!("  {}: {}", a.type_, a.address);
    }
    println!("labels:");
    for k in [TOPOLOGY_REGION, TOPOLOGY_ZONE] {
        println!(
            "  {k}: {}",
            node.labels().get(k).map_or("(none)", String::as_str)
        );
    }
    let taints: Vec<String> = spec
        .taints
        .unwrap_or_default()
        .iter()
        .map(|t| format!("{}:{}", t.key, t.effect))
        .collect();
    let note = if taints
        .iter()
        .any(|t| t.starts_with("node.kubernetes.io/not-ready"))
    {
        " (not-ready is the API server's: the bed runs no kubelet)"
    } else {
        ""
    };
    println!("taints: [{}]{note}", taints.join(", "));
}
