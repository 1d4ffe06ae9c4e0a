//! `cloudprovider.harvesterhci.io/ipam: dhcp` Services with the cloud provider leasing the
//! address itself (`--dhcp-mode=ccm`) from a real dnsmasq, and upstream's kube-vip mode (root:
//! network namespaces).

use std::time::Duration;

use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_cloud_provider::{Config, Telemetry};
use harvester_common::harvester::LoadBalancer;
use harvester_dhcp as dhcp;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use testbed::real::netns::{DhcpNet, Forward};
use testbed::{BedError, TestBed, util::wait};
use tokio::sync::oneshot;

const LIMIT: Duration = Duration::from_secs(40);

struct Ccm {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), harvester_cloud_provider::Error>>,
}

fn start_ccm(bed: &TestBed, extra: &[&str], telemetry: &Telemetry) -> Ccm {
    let mut args = vec![
        "harvester-cloud-provider".to_string(),
        "--cloud-config".into(),
        bed.cloud_config.to_string_lossy().into(),
        "--kubeconfig".into(),
        bed.guest.kubeconfig.to_string_lossy().into(),
        "--cluster-name".into(),
        "dhcp-test".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let config = Config::from_args(args).expect("flags");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(harvester_cloud_provider::run_with(
        config,
        telemetry.clone(),
        async {
            let _ = stopped.await;
        },
    ));
    Ccm { stop, task }
}

impl Ccm {
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("stops")
            .expect("task")
            .expect("clean run");
    }
}

fn dhcp_service(name: &str) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"cloudprovider.harvesterhci.io/ipam": "dhcp"}},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}
    }))
    .unwrap()
}

async fn wait_ingress(api: &Api<Service>, name: &str) -> (String, Service) {
    wait::until(&format!("{name} gets a DHCP address"), LIMIT, || {
        let api = api.clone();
        async move {
            let s = api.get(name).await.map_err(|e| e.to_string())?;
            let ip = ingress_ip(&s);
            Ok(match ip {
                Some(ip) => Ok((ip, s)),
                None => Err(s.metadata.annotations),
            })
        }
    })
    .await
    .unwrap()
}

/// Waits for an Event of `kind` on Service `name` whose note satisfies `pred`; returns the note.
async fn wait_note(
    bed: &TestBed,
    name: &str,
    kind: &str,
    limit: Duration,
    pred: impl Fn(&str) -> bool,
) -> String {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(bed.guest.client.clone(), "default");
    let pred = &pred;
    wait::until(&format!("a {kind} event on {name}"), limit, || {
        let events = events.clone();
        async move {
            let list = events
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let notes: Vec<String> = list
                .items
                .iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                .filter(|e| e.type_.as_deref() == Some(kind))
                .filter_map(|e| e.note.clone())
                .collect();
            Ok(match notes.iter().find(|n| pred(n)) {
                Some(n) => Ok(n.clone()),
                None => Err(notes),
            })
        }
    })
    .await
    .unwrap()
}

/// The provider as a program of `net`'s client namespace (as on a node, with host networking,
/// whose interfaces are the namespace's): its own runtime in a thread inside the namespace, the
/// bed's API servers reached through splices at their usual addresses.
struct NsCcm {
    stop: oneshot::Sender<()>,
    thread: std::thread::JoinHandle<Result<Result<(), harvester_cloud_provider::Error>, BedError>>,
    _forwards: Vec<Forward>,
}

fn start_ccm_in_client(bed: &TestBed, net: &DhcpNet, telemetry: &Telemetry) -> NsCcm {
    let forwards = [&bed.guest.url, &bed.harvester.url]
        .into_iter()
        .map(|url| {
            let port = url
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("no port in {url}"));
            net.forward_into_client(port)
                .expect("splice into the namespace")
        })
        .collect();
    // Upstream's values: no --dhcp-interface, no --dhcp-mode.
    let config = Config::from_args([
        "harvester-cloud-provider".to_string(),
        "--cloud-config".into(),
        bed.cloud_config.to_string_lossy().into(),
        "--kubeconfig".into(),
        bed.guest.kubeconfig.to_string_lossy().into(),
        "--cluster-name".into(),
        "dhcp-test".into(),
    ])
    .expect("flags");
    let (stop, stopped) = oneshot::channel::<()>();
    let telemetry = telemetry.clone();
    let thread = net.spawn_in_client(move || {
        harvester_cloud_provider::run_with(config, telemetry, async {
            let _ = stopped.await;
        })
    });
    NsCcm {
        stop,
        thread,
        _forwards: forwards,
    }
}

impl NsCcm {
    async fn stop(self) {
        let _ = self.stop.send(());
        let thread = self.thread;
        tokio::time::timeout(
            Duration::from_secs(20),
            tokio::task::spawn_blocking(move || thread.join()),
        )
        .await
        .expect("stops")
        .expect("joined")
        .expect("no panic")
        .expect("in the namespace")
        .expect("clean run");
    }
}

fn metric(t: &Telemetry, event: &str) -> u64 {
    let needle = format!("harvester_dhcp_leases_total{{event=\"{event}\"}} ");
    t.metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&needle).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// The bed, for a test that needs root (network namespaces).
async fn root_bed() -> TestBed {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root for network namespaces (make test runs as root)"
    );
    TestBed::started().await
}

/// [`root_bed`] and dnsmasq serving a link into a network namespace.
async fn bed_and_dhcp_net() -> (TestBed, DhcpNet) {
    let bed = root_bed().await;
    let net = DhcpNet::start().expect("dnsmasq in a network namespace");
    (bed, net)
}

#[tokio::test]
async fn dhcp_service_gets_a_lease_keeps_it_across_a_restart_and_releases_it_root() {
    let bed = root_bed().await;
    let net = DhcpNet::start_host_client().expect("dnsmasq in a network namespace");
    let telemetry = Telemetry::new();
    let iface = net.client_if.clone();
    let ccm = start_ccm(&bed, &["--dhcp-interface", &iface], &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let created = api
        .create(&PostParams::default(), &dhcp_service("dns"))
        .await
        .unwrap();
    let (ip, svc) = wait_ingress(&api, "dns").await;
    let mac = dhcp::format_mac(&dhcp::mac_for(&created.uid().unwrap()));
    let ann = svc.annotations();
    assert_eq!(
        ann.get("kube-vip.io/loadbalancerIPs"),
        Some(&ip),
        "kube-vip announces the leased address"
    );
    assert_eq!(ann.get("kube-vip.io/hwaddr"), Some(&mac));
    assert_eq!(ann.get("kube-vip.io/requestedIP"), Some(&ip));
    let leases = net.leases();
    assert!(
        leases
            .iter()
            .any(|l| l.mac == mac && l.ip.to_string() == ip),
        "dnsmasq leased {ip} to {mac}: {leases:?}"
    );
    let lbs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let cr = lbs
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .pop()
        .expect("one CR");
    assert_eq!(cr.spec.ipam.as_deref(), Some("dhcp"));
    let mirrored = wait::until("CR status.address", LIMIT, || {
        let lbs = lbs.clone();
        let name = cr.name_any();
        async move {
            let cr = lbs.get(&name).await.map_err(|e| e.to_string())?;
            let a = cr.status.and_then(|s| s.address);
            Ok(if a.is_some() { Ok(a) } else { Err(a) })
        }
    })
    .await
    .unwrap();
    assert_eq!(mirrored.as_deref(), Some(ip.as_str()));
    assert_eq!(metric(&telemetry, "acquired"), 1);

    // A restarted provider asks for the same address for the same MAC.
    ccm.stop().await;
    let telemetry = Telemetry::new();
    let ccm = start_ccm(&bed, &["--dhcp-interface", &iface], &telemetry);
    wait::until(
        "the restarted provider holds a lease again",
        LIMIT,
        || async {
            Ok(if metric(&telemetry, "acquired") == 1 {
                Ok(())
            } else {
                Err(())
            })
        },
    )
    .await
    .unwrap();
    let (again, _) = wait_ingress(&api, "dns").await;
    assert_eq!(again, ip, "same address after a restart");
    assert_eq!(net.leases().iter().filter(|l| l.mac == mac).count(), 1);

    // Deleting the Service releases the lease.
    api.delete("dns", &DeleteParams::default()).await.unwrap();
    wait::until("lease released in dnsmasq", LIMIT, || async {
        let held: Vec<_> = net.leases().into_iter().filter(|l| l.mac == mac).collect();
        Ok(if held.is_empty() { Ok(()) } else { Err(held) })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\ndnsmasq log:\n{}", net.dhcp_log_text()));
    assert_eq!(metric(&telemetry, "released"), 1);
    ccm.stop().await;
}

#[tokio::test]
async fn kube_vip_dhcp_mode_keeps_upstreams_sentinel_root() {
    let bed = root_bed().await;
    let net = DhcpNet::start_host_client().expect("dnsmasq in a network namespace");
    let telemetry = Telemetry::new();
    let ccm = start_ccm(
        &bed,
        &[
            "--dhcp-mode",
            "kube-vip",
            "--dhcp-interface",
            &net.client_if,
        ],
        &telemetry,
    );
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    api.create(&PostParams::default(), &dhcp_service("dns"))
        .await
        .unwrap();
    wait::until("0.0.0.0 for kube-vip", LIMIT, || {
        let api = api.clone();
        async move {
            let s = api.get("dns").await.map_err(|e| e.to_string())?;
            let v = s.annotations().get("kube-vip.io/loadbalancerIPs").cloned();
            Ok(if v.as_deref() == Some("0.0.0.0") {
                Ok(())
            } else {
                Err(v)
            })
        }
    })
    .await
    .unwrap();
    assert!(
        net.leases().is_empty(),
        "the provider leased nothing in kube-vip mode"
    );
    assert_eq!(metric(&telemetry, "acquired"), 0);
    ccm.stop().await;
}

#[tokio::test]
async fn dhcp_service_waits_with_an_event_while_the_server_is_down_then_recovers_root() {
    let bed = root_bed().await;
    let mut net = DhcpNet::start_host_client().expect("dnsmasq in a network namespace");
    net.stop_server();
    let telemetry = Telemetry::new();
    let ccm = start_ccm(&bed, &["--dhcp-interface", &net.client_if], &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    api.create(&PostParams::default(), &dhcp_service("dns"))
        .await
        .unwrap();
    // No server: the acquisition gives up (about 24 s with the default retransmissions).
    wait_note(&bed, "dns", "Warning", Duration::from_secs(60), |n| {
        n.contains("DHCP") && n.contains("no OFFER")
    })
    .await;
    assert!(metric(&telemetry, "failed") >= 1);
    let svc = api.get("dns").await.unwrap();
    assert!(
        svc.status
            .and_then(|s| s.load_balancer)
            .and_then(|l| l.ingress)
            .is_none_or(|i| i.is_empty()),
        "pending while no server answers"
    );
    // The server comes back: the retry (with backoff) gets a lease.
    net.start_server().expect("dnsmasq back");
    let (ip, _) = wait_ingress(&api, "dns").await;
    assert!(
        net.leases().iter().any(|l| l.ip.to_string() == ip),
        "{:?}",
        net.leases()
    );
    ccm.stop().await;
}

/// An upstream user switching with upstream's values (no `--dhcp-interface`, no
/// `harvester-nad-mapping`): the address is leased on the interface of the default route, where
/// kube-vip, with upstream's empty `vip_interface`, leased it; a Service kube-vip had leased for
/// keeps its address.
#[tokio::test]
async fn upstream_defaults_lease_on_the_default_route_interface_root() {
    let (bed, net) = bed_and_dhcp_net().await;
    net.add_client_default_route()
        .expect("default route via the DHCP server's link");
    // Before the switch: kube-vip leased an address for its MAC and wrote both annotations.
    let kube_vip_mac = dhcp::mac_for("leased by kube-vip");
    let iface = net.client_if.clone();
    let held = net
        .in_client(|| async move {
            dhcp::acquire(&iface, kube_vip_mac, None, &dhcp::DhcpOptions::default()).await
        })
        .expect("in the namespace")
        .unwrap_or_else(|e| panic!("kube-vip's lease: {e}\n{}", net.dhcp_log_text()));
    let telemetry = Telemetry::new();
    let ccm = start_ccm_in_client(&bed, &net, &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let created = api
        .create(&PostParams::default(), &dhcp_service("dns"))
        .await
        .unwrap();
    let (ip, _) = wait_ingress(&api, "dns").await;
    let mac = dhcp::format_mac(&dhcp::mac_for(&created.uid().unwrap()));
    let leases = net.leases();
    assert!(
        leases
            .iter()
            .any(|l| l.mac == mac && l.ip.to_string() == ip),
        "dnsmasq leased {ip} to {mac}: {leases:?}"
    );
    let note = wait_note(&bed, "dns", "Normal", LIMIT, |n| n.contains(&ip)).await;
    assert!(
        note.contains(&format!(
            "on {} (the default route's interface)",
            net.client_if
        )),
        "the lease is on the default route's interface: {note}"
    );

    let mut upstream = dhcp_service("switched");
    upstream
        .metadata
        .annotations
        .get_or_insert_default()
        .extend([
            ("kube-vip.io/loadbalancerIPs".into(), "0.0.0.0".into()),
            ("kube-vip.io/hwaddr".into(), dhcp::format_mac(&kube_vip_mac)),
            ("kube-vip.io/requestedIP".into(), held.ip.to_string()),
        ]);
    api.create(&PostParams::default(), &upstream).await.unwrap();
    let (kept, _) = wait_ingress(&api, "switched").await;
    assert_eq!(kept, held.ip.to_string(), "the address kube-vip had leased");
    assert_eq!(metric(&telemetry, "acquired"), 2);

    // Async waits only from here: the splices to the API servers run on this runtime.
    api.delete("dns", &DeleteParams::default()).await.unwrap();
    wait::until("the lease released", LIMIT, || async {
        let held: Vec<_> = net.leases().into_iter().filter(|l| l.mac == mac).collect();
        Ok(if held.is_empty() { Ok(()) } else { Err(held) })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\ndnsmasq log:\n{}", net.dhcp_log_text()));
    ccm.stop().await;
}

/// Upstream's values on a node without a default route: nothing to lease on, and the Warning
/// says each place that was looked at.
#[tokio::test]
async fn without_a_default_route_the_warning_names_what_was_tried_root() {
    let (bed, net) = bed_and_dhcp_net().await;
    let telemetry = Telemetry::new();
    let ccm = start_ccm_in_client(&bed, &net, &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    api.create(&PostParams::default(), &dhcp_service("dns"))
        .await
        .unwrap();
    let note = wait_note(&bed, "dns", "Warning", LIMIT, |n| {
        n.contains("no interface to lease")
    })
    .await;
    eprintln!("Warning: {note}");
    for tried in [
        "cloudprovider.harvesterhci.io/network",
        "kube-system/harvester-nad-mapping",
        "--dhcp-interface",
        "no default route",
    ] {
        assert!(note.contains(tried), "the Warning names {tried:?}: {note}");
    }
    assert!(net.leases().is_empty(), "{:?}", net.leases());
    assert_eq!(ingress_ip(&api.get("dns").await.unwrap()), None);
    ccm.stop().await;
}

/// `--dhcp-interface` naming an interface that does not exist: one Warning naming it, no address
/// (and no fallback to another interface).
#[tokio::test]
async fn a_dhcp_interface_that_does_not_exist_is_a_clear_warning_root() {
    let bed = root_bed().await;
    let telemetry = Telemetry::new();
    let ccm = start_ccm(&bed, &["--dhcp-interface", "nosuchif0"], &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    api.create(&PostParams::default(), &dhcp_service("dns"))
        .await
        .unwrap();
    let note = wait_note(&bed, "dns", "Warning", LIMIT, |n| n.contains("nosuchif0")).await;
    eprintln!("Warning: {note}");
    assert!(note.contains("No such device"), "{note}");
    assert_eq!(ingress_ip(&api.get("dns").await.unwrap()), None);
    assert!(metric(&telemetry, "failed") >= 1);
    ccm.stop().await;
}

/// An `ipam: dhcp` Service asking for `requested` (in `spec.loadBalancerIP`).
fn dhcp_service_asking(name: &str, requested: &str) -> Service {
    let mut svc = dhcp_service(name);
    svc.spec.get_or_insert_default().load_balancer_ip = Some(requested.into());
    svc
}

/// Events with `reason` on Service `name`: each note with the times it was reported (a repeated
/// Event is one object with a series count).
async fn events_with(bed: &TestBed, name: &str, reason: &str) -> Vec<(String, i32)> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(bed.guest.client.clone(), "default");
    events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| {
            let times = e.series.as_ref().map_or(1, |s| s.count);
            (e.note.unwrap_or_default(), times)
        })
        .collect()
}

/// A requested address the real dnsmasq has free: the DISCOVER carries it (option 50), the lease
/// is that address, and nothing is warned about.
#[tokio::test]
async fn dhcp_service_gets_its_requested_address_when_the_server_has_it_free_root() {
    let bed = root_bed().await;
    let net = DhcpNet::start_host_client().expect("dnsmasq in a network namespace");
    let telemetry = Telemetry::new();
    let ccm = start_ccm(&bed, &["--dhcp-interface", &net.client_if], &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let created = api
        .create(
            &PostParams::default(),
            &dhcp_service_asking("dns", "10.77.0.142"),
        )
        .await
        .unwrap();
    let (ip, svc) = wait_ingress(&api, "dns").await;
    assert_eq!(ip, "10.77.0.142", "the requested address");
    assert_eq!(
        svc.annotations().get("kube-vip.io/requestedIP"),
        Some(&ip),
        "remembered for a restart"
    );
    let mac = dhcp::format_mac(&dhcp::mac_for(&created.uid().unwrap()));
    assert!(
        net.leases()
            .iter()
            .any(|l| l.mac == mac && l.ip.to_string() == ip),
        "dnsmasq leased {ip} to {mac}: {:?}",
        net.leases()
    );
    wait_note(&bed, "dns", "Normal", LIMIT, |n| n.contains(&ip)).await;
    assert!(
        events_with(&bed, "dns", "LoadBalancerIPNotHonoured")
            .await
            .is_empty(),
        "no Warning for an honoured request"
    );
    ccm.stop().await;
}

/// A requested address another client holds: the server offers another, the Service gets that
/// one and exactly one Warning naming both.
#[tokio::test]
async fn dhcp_service_asking_for_a_taken_address_gets_another_and_one_warning_root() {
    let bed = root_bed().await;
    let net = DhcpNet::start_host_client().expect("dnsmasq in a network namespace");
    let other = dhcp::acquire(
        &net.client_if,
        dhcp::mac_for("another client"),
        None,
        &dhcp::DhcpOptions::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("the other client's lease: {e}\n{}", net.dhcp_log_text()));
    let taken = other.ip.to_string();
    let telemetry = Telemetry::new();
    let ccm = start_ccm(&bed, &["--dhcp-interface", &net.client_if], &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    api.create(&PostParams::default(), &dhcp_service_asking("dns", &taken))
        .await
        .unwrap();
    let (ip, _) = wait_ingress(&api, "dns").await;
    assert_ne!(ip, taken, "the server gave another address");
    let note = wait_note(&bed, "dns", "Warning", LIMIT, |n| n.contains(&taken)).await;
    assert!(
        note.contains(&format!("requested address {taken} was not leased")) && note.contains(&ip),
        "{note}"
    );
    // Settled (the Normal Event follows the write the Warning preceded): one Warning only.
    wait_note(&bed, "dns", "Normal", LIMIT, |n| n.contains(&ip)).await;
    let warnings = events_with(&bed, "dns", "LoadBalancerIPNotHonoured").await;
    assert_eq!(
        warnings.iter().map(|(_, times)| times).sum::<i32>(),
        1,
        "{warnings:?}"
    );
    ccm.stop().await;
}

/// `--dhcp-mode=kube-vip`: kube-vip leases, so a requested address is handed to its DHCP client
/// as `kube-vip.io/requestedIP` next to upstream's `0.0.0.0` (kube-vip v1.2.3 asks for it).
#[tokio::test]
async fn kube_vip_dhcp_mode_hands_the_requested_address_to_kube_vip() {
    let bed = TestBed::started().await;
    let telemetry = Telemetry::new();
    let ccm = start_ccm(&bed, &["--dhcp-mode", "kube-vip"], &telemetry);
    let api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    api.create(
        &PostParams::default(),
        &dhcp_service_asking("dns", "10.77.0.142"),
    )
    .await
    .unwrap();
    let annotations = wait::until("kube-vip's annotations", LIMIT, || {
        let api = api.clone();
        async move {
            let s = api.get("dns").await.map_err(|e| e.to_string())?;
            let a = s.annotations().clone();
            Ok(if a.contains_key("kube-vip.io/loadbalancerIPs") {
                Ok(a)
            } else {
                Err(a)
            })
        }
    })
    .await
    .unwrap();
    assert_eq!(
        annotations
            .get("kube-vip.io/loadbalancerIPs")
            .map(String::as_str),
        Some("0.0.0.0")
    );
    assert_eq!(
        annotations
            .get("kube-vip.io/requestedIP")
            .map(String::as_str),
        Some("10.77.0.142")
    );
    ccm.stop().await;
}
