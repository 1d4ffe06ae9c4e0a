//! The flag-level address rules of the node-side controllers: what `--management-network`,
//! `--node-ip-cidr`, `--node-exclude-ip-ranges` and the annotation switch parse into, the
//! addresses that can never be node addresses, and why a VMI gives none. Here rather than in
//! `node::addresses` so that the flag parser and the error type do not import a controller.

use std::net::IpAddr;

use ipnetwork::IpNetwork;

use crate::network::NetworkName;

/// Node annotation kubelet sets from `--node-ip` when a cloud provider is external.
pub const PROVIDED_NODE_IP: &str = "alpha.kubernetes.io/provided-node-ip";

/// The address rules from the flags.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AddressRules {
    pub management_network: Option<NetworkName>,
    pub node_ip_cidr: Vec<IpNetwork>,
    pub exclude_ranges: Vec<IpNetwork>,
    /// false with `--disable-annotation-alpha-provided-ip-addr`.
    pub use_node_annotations: bool,
}

/// Why a VMI gives no usable node addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error(
        "the VMI has no Multus network named {network} (--management-network); its Multus networks: [{available}]"
    )]
    ManagementNetworkNotFound { network: String, available: String },
    #[error(
        "the VMI has no Multus network, so no NIC to take node addresses from (the pod network is not used)"
    )]
    NoMultusNetwork,
    #[error(
        "the VMI reports no IP address on interface {interface} (network {network}): node addresses come from qemu-guest-agent running in the guest, which the Rancher node driver no longer installs (since node driver v0.6.3); install qemu-guest-agent in the VM image or through cloud-init user data (packages: [qemu-guest-agent], runcmd: [systemctl enable --now qemu-guest-agent])"
    )]
    NoGuestAgentAddresses { interface: String, network: String },
    #[error(
        "interface {interface} reports only addresses that cannot be node addresses: [{reported}] (loopback, link-local, multicast, unspecified, broadcast or unparseable)"
    )]
    NoUsableAddress { interface: String, reported: String },
    #[error("Node annotation {key}={value:?} is invalid: {reason}")]
    BadAnnotation {
        key: &'static str,
        value: String,
        reason: String,
    },
    #[error(
        "the provided node IP {ip} (annotation {PROVIDED_NODE_IP}, from kubelet --node-ip) is not among the VM's addresses [{found}]"
    )]
    ProvidedIpNotFound { ip: IpAddr, found: String },
    #[error("no address of the VM [{found}] is inside --node-ip-cidr [{cidrs}]")]
    NothingInNodeIpCidr { found: String, cidrs: String },
}

impl AddressError {
    /// Stable Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            AddressError::ManagementNetworkNotFound { .. } => "ManagementNetworkNotFound",
            AddressError::NoMultusNetwork => "NoMultusNetwork",
            AddressError::NoGuestAgentAddresses { .. } => "NoGuestAgentAddresses",
            AddressError::NoUsableAddress { .. } => "NoUsableAddress",
            AddressError::BadAnnotation { .. } => "BadAnnotation",
            AddressError::ProvidedIpNotFound { .. } => "ProvidedNodeIPNotFound",
            AddressError::NothingInNodeIpCidr { .. } => "NoAddressInNodeIPCIDR",
        }
    }
}

/// Why an address can never be a node address, if it cannot.
pub fn unusable(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) if v4.is_loopback() => Some("loopback"),
        IpAddr::V4(v4) if v4.is_link_local() => Some("link-local"),
        IpAddr::V4(v4) if v4.is_multicast() => Some("multicast"),
        IpAddr::V4(v4) if v4.is_unspecified() => Some("unspecified"),
        IpAddr::V4(v4) if v4.is_broadcast() => Some("broadcast"),
        IpAddr::V6(v6) if v6.is_loopback() => Some("loopback"),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("link-local"),
        IpAddr::V6(v6) if v6.is_multicast() => Some("multicast"),
        IpAddr::V6(v6) if v6.is_unspecified() => Some("unspecified"),
        _ => None,
    }
}

/// An address or a prefix (`10.0.0.0/24`, `10.0.0.5`, `fd00::/64`).
pub fn parse_prefix(s: &str) -> Result<IpNetwork, String> {
    let s = s.trim();
    if s.contains('/') {
        s.parse::<IpNetwork>()
            .map_err(|e| format!("not an IP prefix: {e}"))
    } else {
        s.parse::<std::net::IpAddr>()
            .map(IpNetwork::from)
            .map_err(|_| "not an IP address or prefix".to_string())
    }
}
