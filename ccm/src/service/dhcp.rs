//! `ipam: dhcp` with `--dhcp-mode=ccm`: the provider leases the address itself, for a synthetic
//! MAC kept on the Service (`kube-vip.io/hwaddr`), keeps the lease renewed for the Service's life
//! (`harvester_common::dhcp::Maintainer`), remembers the address (`kube-vip.io/requestedIP`) so a
//! restarted provider asks for the same one, and releases it when the Service goes. kube-vip then
//! only announces the address, as for pool addresses (upstream leaves the whole lease to kube-vip,
//! whose renewals are known to fail: Harvester issues #6563, #6637).

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use harvester_common::dhcp::{self, DhcpOptions, Lease, LeaseEvent, Maintainer};
use harvester_common::telemetry::Metrics;
use harvester_common::telemetry::metrics::LeaseLabels;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use super::annotations::ServiceKey;

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

    /// Leases an address for `mac` on `iface` and keeps it renewed.
    pub async fn acquire(
        &self,
        key: &ServiceKey,
        iface: &str,
        mac: [u8; 6],
        requested: Option<Ipv4Addr>,
    ) -> Result<Lease, dhcp::DhcpError> {
        let lease = match dhcp::acquire(iface, mac, requested, &self.opts).await {
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
