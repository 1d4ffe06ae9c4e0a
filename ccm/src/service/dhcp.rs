//! `ipam: dhcp` with `--dhcp-mode=ccm`: the provider leases the address itself, for a synthetic
//! MAC kept on the Service (`kube-vip.io/hwaddr`), keeps the lease renewed for the Service's life
//! (`harvester_dhcp::Maintainer`), remembers the address (`kube-vip.io/requestedIP`) so a
//! restarted provider asks for the same one, and releases it when the Service goes. kube-vip then
//! only announces the address, as for pool addresses (upstream leaves the whole lease to kube-vip,
//! whose renewals are known to fail: Harvester issues #6563, #6637).
//!
//! The interface a lease is on comes from [`lease_interface`]: the Service's mapped network,
//! `--dhcp-interface`, else the default route's, where kube-vip leases under upstream's values.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use harvester_common::telemetry::Metrics;
use harvester_common::telemetry::metrics::LeaseLabels;
use harvester_dhcp::route::{DefaultRoute, Family, IPV4_ROUTES, IPV6_ROUTES, RouteError};
use harvester_dhcp::{self as dhcp, DhcpOptions, Lease, LeaseEvent, Maintainer};
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use super::annotations::{ANN_NETWORK, ServiceKey};
use super::{NAD_MAPPING_NAME, NAD_MAPPING_NAMESPACE};

pub const KUBE_VIP_HWADDR: &str = "kube-vip.io/hwaddr";
pub const KUBE_VIP_REQUESTED_IP: &str = "kube-vip.io/requestedIP";

/// Who leases DHCP addresses (`--dhcp-mode`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DhcpMode {
    /// The provider leases and renews (default).
    #[default]
    Ccm,
    /// Upstream behaviour: `kube-vip.io/loadbalancerIPs: 0.0.0.0`, kube-vip does DHCP.
    KubeVip,
}

impl std::str::FromStr for DhcpMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ccm" => Ok(DhcpMode::Ccm),
            "kube-vip" => Ok(DhcpMode::KubeVip),
            other => Err(format!("--dhcp-mode {other:?}: must be ccm or kube-vip")),
        }
    }
}

/// What named the interface a Service's address is leased on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChosenBy {
    /// The Service's network, through `kube-system/harvester-nad-mapping`.
    NetworkMapping,
    /// `--dhcp-interface`.
    Flag,
    /// Nothing named one: the interface of the default route, where kube-vip leases under
    /// upstream's values (empty `vip_interface`; see `harvester_dhcp::route`).
    DefaultRoute(Family),
}

impl std::fmt::Display for ChosenBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ChosenBy::NetworkMapping => "the network's interface in harvester-nad-mapping",
            ChosenBy::Flag => "--dhcp-interface",
            ChosenBy::DefaultRoute(_) => "the default route's interface",
        })
    }
}

/// The interface to lease on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseInterface {
    pub name: String,
    pub chosen_by: ChosenBy,
}

/// Where a Service's address is leased: the interface its network maps to (`mapped`), else
/// `--dhcp-interface` (`flag`, taken as given: a name that does not exist fails at the socket,
/// never falls through to another interface), else the default route's (`default_route`, only
/// asked when both are missing). Without any, the error says what was tried, for the Warning.
pub fn lease_interface(
    network: Option<&str>,
    mapped: Option<String>,
    flag: Option<&str>,
    default_route: impl FnOnce() -> Result<Option<DefaultRoute>, RouteError>,
) -> Result<LeaseInterface, String> {
    let chosen = |name: String, chosen_by| LeaseInterface { name, chosen_by };
    if let Some(name) = mapped {
        return Ok(chosen(name, ChosenBy::NetworkMapping));
    }
    if let Some(name) = flag {
        return Ok(chosen(name.to_string(), ChosenBy::Flag));
    }
    let route = match default_route() {
        Ok(Some(r)) => return Ok(chosen(r.iface, ChosenBy::DefaultRoute(r.family))),
        Ok(None) => format!("no default route (IPv4 or IPv6) in {IPV4_ROUTES} or {IPV6_ROUTES}"),
        Err(e) => format!("no default route known ({e})"),
    };
    let network = match network {
        None => format!("the Service has no {ANN_NETWORK}"),
        Some(n) => format!(
            "{ANN_NETWORK} {n} is not mapped (no ConfigMap {NAD_MAPPING_NAMESPACE}/{NAD_MAPPING_NAME})"
        ),
    };
    Err(format!(
        "no interface to lease a DHCP address on: {network}, no --dhcp-interface, {route}; set \
         --dhcp-interface, or {ANN_NETWORK} with a network that {NAD_MAPPING_NAMESPACE}/{NAD_MAPPING_NAME} maps"
    ))
}

/// The MAC a Service's lease is for: its `kube-vip.io/hwaddr`, else one derived from its UID.
pub fn mac_of(svc: &Service) -> Result<[u8; 6], String> {
    match svc.annotations().get(KUBE_VIP_HWADDR) {
        Some(v) => dhcp::parse_mac(v).map_err(|e| format!("{KUBE_VIP_HWADDR}={v:?}: {e}")),
        None => Ok(dhcp::mac_for(svc.uid().as_deref().unwrap_or_default())),
    }
}

/// The address a Service held before (asked for again after a restart).
pub fn requested_of(svc: &Service) -> Option<Ipv4Addr> {
    svc.annotations().get(KUBE_VIP_REQUESTED_IP)?.parse().ok()
}

/// The leases this provider keeps, one per Service.
pub struct Leases {
    pub opts: DhcpOptions,
    kept: Mutex<HashMap<ServiceKey, Maintainer>>,
    wake: mpsc::UnboundedSender<ObjectRef<Service>>,
    metrics: Option<Metrics>,
}

impl Leases {
    pub fn new(
        opts: DhcpOptions,
        wake: mpsc::UnboundedSender<ObjectRef<Service>>,
        metrics: Option<Metrics>,
    ) -> Leases {
        Leases {
            opts,
            kept: Mutex::new(HashMap::new()),
            wake,
            metrics,
        }
    }

    fn count(&self, event: &str) {
        if let Some(m) = &self.metrics {
            m.dhcp_leases
                .get_or_create(&LeaseLabels {
                    event: event.into(),
                })
                .inc();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ServiceKey, Maintainer>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lease kept for `key` with `mac`, if any.
    pub fn current(&self, key: &ServiceKey, mac: [u8; 6]) -> Option<Lease> {
        self.lock()
            .get(key)
            .and_then(Maintainer::lease)
            .filter(|l| l.mac == mac)
    }

    /// Leases an address for `mac` on `iface` and keeps it renewed: the one held before
    /// (`held`, asked for again with INIT-REBOOT) when there is one, else asking for the Service's
    /// requested address (`wanted`, option 50 in the DISCOVER).
    pub async fn acquire(
        &self,
        key: &ServiceKey,
        iface: &str,
        mac: [u8; 6],
        held: Option<Ipv4Addr>,
        wanted: Option<Ipv4Addr>,
    ) -> Result<Lease, dhcp::DhcpError> {
        let acquired = match (held, wanted) {
            (None, Some(wanted)) => dhcp::acquire_hinting(iface, mac, wanted, &self.opts).await,
            _ => dhcp::acquire(iface, mac, held, &self.opts).await,
        };
        let lease = match acquired {
            Ok(l) => l,
            Err(e) => {
                self.count("failed");
                return Err(e);
            }
        };
        self.count("acquired");
        tracing::info!(service = %key, ip = %lease.ip, mac = %dhcp::format_mac(&mac), iface, "DHCP lease acquired");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let keeper = Maintainer::spawn(lease.clone(), self.opts.clone(), tx);
        if let Some(old) = self.lock().insert(key.clone(), keeper) {
            drop(old);
        }
        let wake = self.wake.clone();
        let metrics = self.metrics.clone();
        let target = ObjectRef::new(&key.name).within(&key.namespace);
        let service = key.clone();
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                let (name, reconcile) = match &event {
                    LeaseEvent::Renewed { .. } => ("renewed", false),
                    LeaseEvent::RenewFailed { .. } => ("renew_failed", false),
                    LeaseEvent::Lost { .. } => ("lost", true),
                    LeaseEvent::Reacquired(_) => ("acquired", true),
                    LeaseEvent::AcquireFailed { .. } => ("failed", false),
                };
                tracing::info!(service = %service, "DHCP lease event: {event:?}");
                if let Some(m) = &metrics {
                    m.dhcp_leases
                        .get_or_create(&LeaseLabels { event: name.into() })
                        .inc();
                }
                if reconcile {
                    let _ = wake.send(target.clone());
                }
            }
        });
        Ok(lease)
    }

    /// Stops renewing and sends RELEASE (when a lease is kept for `key`).
    pub async fn release(&self, key: &ServiceKey) {
        let keeper = self.lock().remove(key);
        tracing::debug!(service = %key, kept = keeper.is_some(), "releasing the DHCP lease");
        if let Some(k) = keeper {
            match k.release().await {
                Ok(Some(ip)) => {
                    self.count("released");
                    tracing::info!(service = %key, %ip, "DHCP lease released");
                }
                Ok(None) => tracing::debug!(service = %key, "no lease held at release"),
                Err(e) => tracing::warn!(service = %key, "releasing the DHCP lease: {e}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(ann: serde_json::Value) -> Service {
        serde_json::from_value(json!({"metadata": {"name": "s", "namespace": "n", "uid": "uid-1", "annotations": ann}}))
            .unwrap()
    }

    #[test]
    fn mac_comes_from_the_annotation_or_the_uid() {
        assert_eq!(mac_of(&svc(json!({}))).unwrap(), dhcp::mac_for("uid-1"));
        assert_eq!(
            mac_of(&svc(json!({KUBE_VIP_HWADDR: "02:00:00:aa:bb:cc"}))).unwrap(),
            [2, 0, 0, 0xaa, 0xbb, 0xcc]
        );
        let err = mac_of(&svc(json!({KUBE_VIP_HWADDR: "zz"}))).unwrap_err();
        assert!(err.contains(KUBE_VIP_HWADDR) && err.contains("zz"), "{err}");
    }

    #[test]
    fn requested_ip_is_read_when_valid() {
        assert_eq!(
            requested_of(&svc(json!({KUBE_VIP_REQUESTED_IP: "10.0.0.7"}))),
            Some(Ipv4Addr::new(10, 0, 0, 7))
        );
        assert_eq!(
            requested_of(&svc(json!({KUBE_VIP_REQUESTED_IP: "x"}))),
            None
        );
    }

    /// A routing table whose default route goes out through `iface`.
    fn route(iface: &str) -> impl FnOnce() -> Result<Option<DefaultRoute>, RouteError> {
        let iface = iface.to_string();
        move || {
            Ok(Some(DefaultRoute {
                iface,
                family: Family::Ipv4,
            }))
        }
    }

    #[test]
    fn the_lease_interface_is_the_mapped_one_then_the_flag_then_the_default_route() {
        let pick = |network, mapped: Option<&str>, flag, default_route| {
            lease_interface(network, mapped.map(String::from), flag, default_route)
                .map(|i| (i.name, i.chosen_by))
        };
        let by = |name: &str, chosen_by| Ok((name.to_string(), chosen_by));
        // One row per rule.
        assert_eq!(
            pick(Some("vlan1"), Some("eth1"), Some("eth2"), route("eth0")),
            by("eth1", ChosenBy::NetworkMapping),
            "the network's mapping first"
        );
        assert_eq!(
            pick(None, None, Some("eth2"), route("eth0")),
            by("eth2", ChosenBy::Flag),
            "then --dhcp-interface"
        );
        assert_eq!(
            pick(None, None, Some("nosuch0"), route("eth0")),
            by("nosuch0", ChosenBy::Flag),
            "a named interface is taken as given, never replaced by the default route"
        );
        assert_eq!(
            pick(None, None, None, route("eth0")),
            by("eth0", ChosenBy::DefaultRoute(Family::Ipv4)),
            "upstream's values (neither): the default route's, as kube-vip's empty vip_interface"
        );
        assert_eq!(
            pick(Some("vlan1"), None, None, route("eth0")),
            by("eth0", ChosenBy::DefaultRoute(Family::Ipv4)),
            "a network without a mapping ConfigMap: the default route's"
        );
    }

    #[test]
    fn the_default_route_is_only_read_when_nothing_names_an_interface() {
        let unread =
            || -> Result<Option<DefaultRoute>, RouteError> { panic!("the routing table was read") };
        assert!(lease_interface(None, Some("eth1".into()), None, unread).is_ok());
        assert!(lease_interface(None, None, Some("eth2"), unread).is_ok());
    }

    #[test]
    fn without_any_interface_the_error_names_what_was_tried() {
        let none = || Ok(None);
        let err = lease_interface(None, None, None, none).unwrap_err();
        for tried in [
            "the Service has no cloudprovider.harvesterhci.io/network",
            "no --dhcp-interface",
            "no default route (IPv4 or IPv6) in /proc/thread-self/net/route",
            "kube-system/harvester-nad-mapping",
        ] {
            assert!(err.contains(tried), "{tried:?} in {err}");
        }
        let err = lease_interface(Some("vlan1"), None, None, none).unwrap_err();
        assert!(
            err.contains("cloudprovider.harvesterhci.io/network vlan1 is not mapped"),
            "{err}"
        );
        let unreadable = || {
            Err(RouteError {
                path: IPV4_ROUTES,
                source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
            })
        };
        let err = lease_interface(None, None, None, unreadable).unwrap_err();
        assert!(
            err.contains("reading /proc/thread-self/net/route: permission denied"),
            "{err}"
        );
    }

    #[test]
    fn modes_parse_with_clear_errors() {
        assert_eq!("ccm".parse::<DhcpMode>(), Ok(DhcpMode::Ccm));
        assert_eq!("kube-vip".parse::<DhcpMode>(), Ok(DhcpMode::KubeVip));
        assert!(
            "both"
                .parse::<DhcpMode>()
                .unwrap_err()
                .contains("--dhcp-mode")
        );
    }
}
