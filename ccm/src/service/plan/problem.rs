//! What can be wrong with a LoadBalancer Service, typed, with the Event reason of each (as
//! `crate::error::Error::reason` does for Nodes), and the pure checks that find them: the
//! secondary's primary, CR drift the webhook or the user cannot have, an address that is not the
//! one asked for. The orchestration (`service::reconcile`) only reports what these return.

use std::net::IpAddr;

use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::Service;
use kube::{Resource, ResourceExt};

use super::{CrDrift, LbSettings, overlapping_ports, wants_load_balancer};
use crate::service::annotations::{
    ANN_IPAM, ANN_NETWORK, ANN_PRIMARY_SERVICE, BadAnnotation, Ipam, KUBE_VIP_IPS, PortKey,
    ServiceKey, ServiceLbSpec,
};

/// Reason of a Warning Event for a Service whose load balancer could not be synced.
pub const SYNC_FAILED: &str = "SyncLoadBalancerFailed";
/// Reasons of the Normal Events of a Service's load balancer.
pub const ENSURED: &str = "EnsuredLoadBalancer";
pub const DELETING: &str = "DeletingLoadBalancer";
pub const DELETED: &str = "DeletedLoadBalancer";

/// Why a Service gets a Warning Event (and, for most, waits for a change of its input).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceProblem {
    #[error("invalid {0}")]
    BadAnnotation(BadAnnotation),
    /// The Service's `kube-vip.io/hwaddr` (or its UID) gives no MAC to lease for.
    #[error("invalid {0}")]
    BadMac(String),
    /// No interface to lease a DHCP address on; the text lists what was tried.
    #[error("{0}")]
    NoLeaseInterface(String),
    /// Harvester said why it allocated no address (no matching pool, pool exhausted).
    #[error("ip is not allocated, mode: {mode}, message: {message}")]
    NotAllocated { mode: &'static str, message: String },
    #[error("{ANN_PRIMARY_SERVICE}={primary}: no such LoadBalancer Service")]
    NoSuchPrimary { primary: ServiceKey },
    #[error("{ANN_PRIMARY_SERVICE}={primary}: that Service shares another one's address itself")]
    PrimaryIsSecondary { primary: ServiceKey },
    #[error("{ANN_PRIMARY_SERVICE}={primary}: the primary has invalid {bad}")]
    PrimaryInvalid {
        primary: ServiceKey,
        bad: BadAnnotation,
    },
    #[error(
        "{ANN_PRIMARY_SERVICE}={primary}: ports {} are already used on the shared address",
        ports_text(.ports)
    )]
    PortConflict {
        primary: ServiceKey,
        ports: Vec<PortKey>,
    },
    #[error("{ANN_PRIMARY_SERVICE}={primary}: network {mine} differs from the primary's {theirs}")]
    NetworkMismatch {
        primary: ServiceKey,
        mine: String,
        theirs: String,
    },
    #[error("{ANN_PRIMARY_SERVICE}={primary}: the primary has no address yet")]
    PrimaryWithoutAddress { primary: ServiceKey },
    #[error(
        "{ANN_NETWORK} is immutable: the load balancer keeps network {old:?}, not {new:?}; recreate the Service to change it"
    )]
    NetworkChangeRejected { old: String, new: String },
    #[error(
        "{ANN_IPAM} cannot change from {old:?} to {new:?} on an existing load balancer; recreate the Service"
    )]
    IpamChangeRejected { old: String, new: String },
    #[error(
        "spec.loadBalancerIP {requested} cannot be requested from Harvester IP pools; the allocated address is {ip}"
    )]
    RequestedIpNotHonoured { requested: IpAddr, ip: String },
    #[error("{KUBE_VIP_IPS} was {user}, replaced by the address Harvester allocated: {ip}")]
    KubeVipIpsReplaced { user: String, ip: String },
    /// The DHCP server leased another address than the one the Service asked for.
    #[error(
        "requested address {requested} was not leased by the DHCP server, which gave {ip} (the address is taken, outside its range, or not IPv4)"
    )]
    DhcpRequestNotHonoured { requested: IpAddr, ip: String },
    /// A guest-pool Service's pool, or its request, cannot be served.
    #[error("{0}")]
    GuestPool(super::super::guest_pool::GuestProblem),
    /// A primary being deleted whose address secondaries still use.
    #[error(
        "the address is still shared by {}; remove their {ANN_PRIMARY_SERVICE} annotation first",
        .users.join(", ")
    )]
    StillShared { users: Vec<String> },
}

fn ports_text(ports: &[PortKey]) -> String {
    let ports: Vec<String> = ports
        .iter()
        .map(|p| format!("{}/{}", p.port, p.protocol))
        .collect();
    ports.join(", ")
}

impl ServiceProblem {
    /// Stable Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            ServiceProblem::PortConflict { .. } => "PortConflict",
            ServiceProblem::NetworkChangeRejected { .. } => "NetworkChangeRejected",
            ServiceProblem::IpamChangeRejected { .. } => "IpamChangeRejected",
            ServiceProblem::RequestedIpNotHonoured { .. }
            | ServiceProblem::DhcpRequestNotHonoured { .. }
            | ServiceProblem::KubeVipIpsReplaced { .. } => "LoadBalancerIPNotHonoured",
            ServiceProblem::GuestPool(problem) => problem.reason(),
            ServiceProblem::StillShared { .. } => "DeletingLoadBalancerFailed",
            ServiceProblem::BadAnnotation(_)
            | ServiceProblem::BadMac(_)
            | ServiceProblem::NoLeaseInterface(_)
            | ServiceProblem::NotAllocated { .. }
            | ServiceProblem::NoSuchPrimary { .. }
            | ServiceProblem::PrimaryIsSecondary { .. }
            | ServiceProblem::PrimaryInvalid { .. }
            | ServiceProblem::NetworkMismatch { .. }
            | ServiceProblem::PrimaryWithoutAddress { .. } => SYNC_FAILED,
        }
    }
}

/// The primary a secondary (`spec`, sharing `primary_key`'s address) follows, and its spec; or
/// why it cannot. `primary` is the primary as cached, `others` the specs of the primary's other
/// secondaries.
pub fn check_secondary<'p>(
    spec: &ServiceLbSpec,
    primary_key: &ServiceKey,
    primary: Option<&'p Service>,
    others: &[ServiceLbSpec],
    settings: &LbSettings,
) -> Result<(&'p Service, ServiceLbSpec), ServiceProblem> {
    let primary_of = || primary_key.clone();
    let primary = primary
        .filter(|p| wants_load_balancer(p, settings) && p.meta().deletion_timestamp.is_none())
        .ok_or_else(|| ServiceProblem::NoSuchPrimary {
            primary: primary_of(),
        })?;
    let primary_spec = match ServiceLbSpec::from_service(primary) {
        Ok(s) if s.primary.is_none() => s,
        Ok(_) => {
            return Err(ServiceProblem::PrimaryIsSecondary {
                primary: primary_of(),
            });
        }
        Err(bad) => {
            return Err(ServiceProblem::PrimaryInvalid {
                primary: primary_of(),
                bad,
            });
        }
    };
    let mut conflicts = overlapping_ports(&spec.ports, &primary_spec.ports);
    for other in others {
        conflicts.extend(overlapping_ports(&spec.ports, &other.ports));
    }
    if !conflicts.is_empty() {
        return Err(ServiceProblem::PortConflict {
            primary: primary_of(),
            ports: conflicts,
        });
    }
    if let (Some(mine), Some(theirs)) = (&spec.network, &primary_spec.network)
        && mine != theirs
    {
        return Err(ServiceProblem::NetworkMismatch {
            primary: primary_of(),
            mine: mine.clone(),
            theirs: theirs.clone(),
        });
    }
    Ok((primary, primary_spec))
}

/// The changes of an existing CR that are refused (the network and the IPAM mode are fixed at
/// creation), in the order they are reported.
pub fn drift_problems(drift: &CrDrift) -> Vec<ServiceProblem> {
    let text = |v: &Option<String>| v.clone().unwrap_or_default();
    let mut problems = Vec::new();
    if let Some((old, new)) = &drift.network_changed {
        problems.push(ServiceProblem::NetworkChangeRejected {
            old: text(old),
            new: text(new),
        });
    }
    if let Some((old, new)) = &drift.ipam_changed {
        problems.push(ServiceProblem::IpamChangeRejected {
            old: text(old),
            new: text(new),
        });
    }
    problems
}

/// Why a CR has no address yet, when Harvester said so (no condition yet just means Harvester
/// has not got to it: no problem).
pub fn not_allocated(lb: &LoadBalancer, ipam: &Ipam) -> Option<ServiceProblem> {
    let message = lb
        .ready_condition()
        .filter(|c| c.status != "True")
        .and_then(|c| c.message.clone())?;
    Some(ServiceProblem::NotAllocated {
        mode: ipam.as_str(),
        message,
    })
}

/// What a primary asked for that address `ip` from Harvester does not honour (reported when the
/// address is written). `dhcp_sentinel`: kube-vip leases the address, nothing was asked of
/// Harvester.
pub fn unhonoured_requests(
    svc: &Service,
    spec: &ServiceLbSpec,
    ip: &str,
    dhcp_sentinel: bool,
) -> Vec<ServiceProblem> {
    let mut problems = Vec::new();
    if let Some(requested) = spec.requested_ip
        && requested.to_string() != ip
        && !dhcp_sentinel
    {
        problems.push(ServiceProblem::RequestedIpNotHonoured {
            requested,
            ip: ip.to_string(),
        });
    }
    // kube-vip's DHCP client is handed a requested IPv4 address (`kube_vip_dhcp_request`).
    let handed_to_kube_vip = dhcp_sentinel && spec.requested().is_some_and(|r| r.is_ipv4());
    if let Some(user) = svc.annotations().get(KUBE_VIP_IPS)
        && super::ingress_ips(svc).is_empty()
        && user != ip
        && !handed_to_kube_vip
    {
        problems.push(ServiceProblem::KubeVipIpsReplaced {
            user: user.clone(),
            ip: ip.to_string(),
        });
    }
    problems
}

/// The address a secondary shares: its primary's first ingress address.
pub fn shared_address(
    primary_key: &ServiceKey,
    primary: &Service,
) -> Result<String, ServiceProblem> {
    super::ingress_ip(primary).ok_or_else(|| ServiceProblem::PrimaryWithoutAddress {
        primary: primary_key.clone(),
    })
}
