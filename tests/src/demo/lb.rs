//! Demo steps of LoadBalancer Services: an IPPool on Harvester, a guest Service of type
//! LoadBalancer gets an address from it through the cloud provider, then is deleted and the
//! address goes back to the pool.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_common::harvester::{IPPool, LoadBalancer};
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use testbed::{TestBed, util::wait};

const LIMIT: Duration = Duration::from_secs(30);

pub async fn run(bed: &TestBed) -> anyhow::Result<()> {
    let config = super::ccm_config(bed, &[])?;
    let pools: Api<IPPool> = Api::all(bed.harvester.client.clone());
    let pool: IPPool = serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "IPPool",
        "metadata": {"name": "demo-pool"},
        "spec": {"ranges": [{"subnet": "192.168.200.0/24", "rangeStart": "192.168.200.100", "rangeEnd": "192.168.200.120"}],
                 "selector": {"scope": [{"project": "*", "namespace": "*", "guestCluster": "*"}]}}
    }))?;
    pools.create(&PostParams::default(), &pool).await?;
    println!("--- Harvester IPPool demo-pool: 192.168.200.100-192.168.200.120");
    let ccm = harvester_cloud_provider::spawn(config);
    let services: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"type": "LoadBalancer", "selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    }))?;
    let t0 = Instant::now();
    services.create(&PostParams::default(), &svc).await?;
    let svc = wait_external_ip(&services, "web").await?;
    println!(
        "--- guest Service default/web got its address in {:.2}s",
        t0.elapsed().as_secs_f64()
    );
    println!("NAME   TYPE           CLUSTER-IP   EXTERNAL-IP        PORT(S)");
    println!(
        "web    LoadBalancer   {:<12} {:<18} 80:{}/TCP",
        svc.spec
            .as_ref()
            .and_then(|s| s.cluster_ip.clone())
            .unwrap_or_default(),
        ingress_ip(&svc).unwrap_or_default(),
        svc.spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .and_then(|p| p.first())
            .and_then(|p| p.node_port)
            .map_or("-".to_string(), |n| n.to_string()),
    );
    let lbs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    for lb in lbs.list(&Default::default()).await?.items {
        println!(
            "--- Harvester LoadBalancer {}/{}: ipam {}, allocated {} from {}",
            bed.vm_namespace,
            lb.name_any(),
            lb.spec.ipam.as_deref().unwrap_or("pool"),
            lb.allocated_ip().unwrap_or("-"),
            lb.status
                .as_ref()
                .and_then(|s| s.allocated_address.as_ref())
                .and_then(|a| a.ip_pool.clone())
                .unwrap_or_default()
        );
    }
    print_pool(&pools, "after allocation").await?;

    services.delete("web", &DeleteParams::default()).await?;
    wait::until("Service web and its LoadBalancer gone", LIMIT, || {
        let (services, lbs) = (services.clone(), lbs.clone());
        async move {
            let svc = services.get_opt("web").await.map_err(|e| e.to_string())?;
            let crs = lbs
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .len();
            Ok(if svc.is_none() && crs == 0 {
                Ok(())
            } else {
                Err((svc.is_some(), crs))
            })
        }
    })
    .await
    .map_err(anyhow::Error::msg)?;
    println!("--- Service web deleted: its Harvester LoadBalancer is gone");
    wait::until("address back in the pool", LIMIT, || {
        let pools = pools.clone();
        async move {
            let p = pools.get("demo-pool").await.map_err(|e| e.to_string())?;
            let st = p.status.unwrap_or_default();
            Ok(if st.allocated.is_empty() {
                Ok(())
            } else {
                Err(st.allocated)
            })
        }
    })
    .await
    .map_err(anyhow::Error::msg)?;
    print_pool(&pools, "after deletion").await?;
    ccm.stop().await.context("stopping the cloud provider")?;
    Ok(())
}

/// Waits until Service `name` shows an external address.
async fn wait_external_ip(services: &Api<Service>, name: &str) -> anyhow::Result<Service> {
    wait::until(&format!("Service {name} gets an address"), LIMIT, || {
        let services = services.clone();
        async move {
            let s = services.get(name).await.map_err(|e| e.to_string())?;
            Ok(if ingress_ip(&s).is_some() {
                Ok(s)
            } else {
                Err(s.status)
            })
        }
    })
    .await
    .map_err(anyhow::Error::msg)
}

async fn print_pool(pools: &Api<IPPool>, when: &str) -> anyhow::Result<()> {
    let st = pools.get("demo-pool").await?.status.unwrap_or_default();
    println!(
        "--- IPPool demo-pool {when}: total {}, available {}, allocated {:?}, history {:?}",
        st.total, st.available, st.allocated, st.allocated_history
    );
    Ok(())
}

/// With root: a DHCP server (dnsmasq) on a veth, and an `ipam: dhcp` Service whose address the
/// cloud provider leases itself.
pub async fn run_dhcp(bed: &TestBed) -> anyhow::Result<()> {
    if !testbed::sim::storage::is_root() {
        println!("--- DHCP demo skipped: dnsmasq in a network namespace needs root");
        return Ok(());
    }
    let net = testbed::real::netns::DhcpNet::start_host_client()?;
    println!(
        "--- dnsmasq serving {}-{} on a veth; the cloud provider leases on {}",
        testbed::real::netns::RANGE.0,
        testbed::real::netns::RANGE.1,
        net.client_if
    );
    let config = super::ccm_config(bed, &["--dhcp-interface", &net.client_if])?;
    let ccm = harvester_cloud_provider::spawn(config);
    let services: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "dns", "annotations": {"cloudprovider.harvesterhci.io/ipam": "dhcp"}},
        "spec": {"type": "LoadBalancer", "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}
    }))?;
    let t0 = Instant::now();
    services.create(&PostParams::default(), &svc).await?;
    let svc = wait_external_ip(&services, "dns").await?;
    let ann = svc.annotations();
    println!(
        "--- Service default/dns (ipam dhcp) got {} in {:.2}s for MAC {} (kube-vip.io/hwaddr), kept in kube-vip.io/requestedIP={}",
        ingress_ip(&svc).unwrap_or_default(),
        t0.elapsed().as_secs_f64(),
        ann.get("kube-vip.io/hwaddr").cloned().unwrap_or_default(),
        ann.get("kube-vip.io/requestedIP")
            .cloned()
            .unwrap_or_default()
    );
    for l in net.leases() {
        println!(
            "--- dnsmasq lease file: {} {} expires {}",
            l.mac, l.ip, l.expiry
        );
    }
    services.delete("dns", &DeleteParams::default()).await?;
    wait::until("lease released", LIMIT, || async {
        let n = net.leases().len();
        Ok(if n == 0 { Ok(()) } else { Err(n) })
    })
    .await
    .map_err(anyhow::Error::msg)?;
    println!(
        "--- Service dns deleted: the provider sent DHCPRELEASE, dnsmasq's lease file is empty"
    );
    ccm.stop().await.context("stopping the cloud provider")?;
    Ok(())
}
