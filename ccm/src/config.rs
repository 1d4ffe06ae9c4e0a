//! Flags, parsed and validated at the edge into a typed [`Config`].
//!
//! Flag names and defaults follow upstream harvester-cloud-provider (its own flags and the
//! cloud-provider framework flags the chart and users pass). Flags are grouped by the controllers
//! that read them: [`CommonFlags`] for everything, [`NodeFlags`] for the node-side controllers.
//! A new controller adds its own `#[command(flatten)]` group to [`Flags`] and its own typed
//! section to [`Config`].

use std::collections::BTreeSet;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser};
use ipnetwork::IpNetwork;

use crate::addresses::AddressRules;

/// Names accepted by `--controllers`, as the upstream cloud-provider framework spells them.
pub const CLOUD_NODE_CONTROLLER: &str = "cloud-node-controller";
pub const CLOUD_NODE_LIFECYCLE_CONTROLLER: &str = "cloud-node-lifecycle-controller";
pub const SERVICE_LB_CONTROLLER: &str = "service-lb-controller";
/// Accepted for compatibility; Harvester has no routes, so it never runs.
pub const NODE_ROUTE_CONTROLLER: &str = "node-route-controller";
const KNOWN_CONTROLLERS: [&str; 4] = [
    CLOUD_NODE_CONTROLLER,
    CLOUD_NODE_LIFECYCLE_CONTROLLER,
    SERVICE_LB_CONTROLLER,
    NODE_ROUTE_CONTROLLER,
];

/// The command line.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "harvester-cloud-provider",
    version,
    about = "Cloud controller manager for Kubernetes guest clusters on Harvester HCI"
)]
pub struct Flags {
    #[command(flatten)]
    pub common: CommonFlags,
    #[command(flatten)]
    pub node: NodeFlags,
    #[command(flatten)]
    pub service: ServiceFlags,
    #[command(flatten)]
    pub ops: OpsFlags,
}

/// Operations: logs, health and metrics endpoints, leader election, credential expiry.
/// Read by `main` only; the controllers never see them.
#[derive(Args, Debug, Clone)]
pub struct OpsFlags {
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: harvester_common::telemetry::LogFormat,
    /// Address of the /healthz, /readyz and /metrics endpoints; empty disables them.
    #[arg(long, default_value = "0.0.0.0:10268")]
    pub metrics_address: String,
    /// Run the controllers only while holding a Lease (needed with more than one replica).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,
    #[arg(long, default_value = "kube-system")]
    pub leader_elect_resource_namespace: String,
    #[arg(long, default_value = "harvester-cloud-provider")]
    pub leader_elect_resource_name: String,
    /// How long a Lease holds without renewal (Go duration).
    #[arg(long, default_value = "15s")]
    pub leader_elect_lease_duration: String,
    /// The leader stops working when it could not renew for this long (< lease duration).
    #[arg(long, default_value = "10s")]
    pub leader_elect_renew_deadline: String,
    #[arg(long, default_value = "2s")]
    pub leader_elect_retry_period: String,
    /// Warn this many days before the cloud-config token expires.
    #[arg(long, default_value_t = 7)]
    pub token_expiry_warning_days: u32,
}

/// Flags of the LoadBalancer service controller.
#[derive(Args, Debug, Clone)]
pub struct ServiceFlags {
    /// Also serve Services with this `spec.loadBalancerClass` (Services without a class are
    /// always served, as upstream does).
    #[arg(long)]
    pub load_balancer_class: Option<String>,
    /// Who leases addresses of `cloudprovider.harvesterhci.io/ipam: dhcp` Services: `ccm` (this
    /// provider, renewing and releasing them) or `kube-vip` (upstream: `0.0.0.0`, kube-vip does it).
    #[arg(long, default_value = "ccm")]
    pub dhcp_mode: crate::service::dhcp::DhcpMode,
    /// Interface to lease DHCP addresses on when the Service's network maps to no interface.
    #[arg(long)]
    pub dhcp_interface: Option<String>,
}

/// Flags every controller reads.
#[derive(Args, Debug, Clone)]
pub struct CommonFlags {
    /// The Harvester kubeconfig ("cloud-config"); its current context's namespace holds the VMs.
    #[arg(long, env = "CLOUD_CONFIG", default_value = harvester_common::cloud_config::DEFAULT_PATH)]
    pub cloud_config: PathBuf,
    /// Kubeconfig of the guest cluster (in-cluster config when unset).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Name of the guest cluster (labels and names of Harvester LoadBalancers).
    #[arg(long, default_value = "kubernetes")]
    pub cluster_name: String,
    /// Harvester VM network (`namespace/name`; a bare `name` means `default/name`) whose NIC
    /// supplies the node addresses and which LoadBalancers announce on.
    #[arg(long)]
    pub management_network: Option<String>,
    /// Controllers to run: `*` for all, `name` to add one, `-name` to remove one.
    #[arg(long, value_delimiter = ',', default_value = "*")]
    pub controllers: Vec<String>,
    /// Log verbosity as klog counts it (2 = info, 4 = debug, 6 = trace); RUST_LOG overrides it.
    #[arg(long = "v", default_value_t = 2)]
    pub verbosity: u8,
}

/// Flags of the node-side controllers (node, lifecycle, topology).
#[derive(Args, Debug, Clone)]
pub struct NodeFlags {
    /// At most one IPv4 and one IPv6 prefix (or address): the node's InternalIPs are chosen inside them.
    #[arg(long, value_delimiter = ',')]
    pub node_ip_cidr: Vec<String>,
    /// With --node-ip-cidr: ExternalIPs inside these prefixes (or addresses) are not reported.
    #[arg(long, value_delimiter = ',')]
    pub node_exclude_ip_ranges: Vec<String>,
    /// Ignore the Node annotations `alpha.kubernetes.io/provided-node-ip` and
    /// `cloudprovider.harvesterhci.io/additional-internal-ips`.
    #[arg(long)]
    pub disable_annotation_alpha_provided_ip_addr: bool,
    /// Do not follow VMIs after initialisation: no topology resync after live migration.
    #[arg(long)]
    pub disable_vmi_controller: bool,
    /// How many Nodes each node-side controller reconciles at once.
    #[arg(long, default_value_t = 1)]
    pub concurrent_node_syncs: u16,
    /// Period of the full resync of every Node (Go duration, e.g. `5m`, `30s`); changes are
    /// picked up from watches at once, this only bounds how long a missed event can go unseen.
    #[arg(long, default_value = "5m")]
    pub node_status_update_frequency: String,
}

/// A bad flag value, named with the flag.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid value {value:?} for {flag}: {reason}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub value: String,
    pub reason: String,
}

impl ConfigError {
    fn new(flag: &'static str, value: &str, reason: impl Into<String>) -> Self {
        ConfigError {
            flag,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub cloud_config: PathBuf,
    pub kubeconfig: Option<PathBuf>,
    /// Normalised: quotes, backticks and whitespace trimmed.
    pub cluster_name: String,
    pub management_network: Option<NetworkName>,
    pub controllers: Controllers,
    pub node: NodeConfig,
    pub service: ServiceConfig,
    /// `--token-expiry-warning-days`.
    pub token_expiry_warning_days: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceConfig {
    pub load_balancer_class: Option<String>,
    pub dhcp_mode: crate::service::dhcp::DhcpMode,
    pub dhcp_interface: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NodeConfig {
    pub addresses: AddressRules,
    /// Run the topology controller (upstream's VMI controller).
    pub topology: bool,
    pub concurrency: u16,
    pub resync: Duration,
}

impl Config {
    /// Parses a command line (program name first), for tests and embedding.
    pub fn from_args<I, T>(args: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let flags = Flags::try_parse_from(args)
            .map_err(|e| ConfigError::new("command line", "", e.to_string().trim().to_string()))?;
        Config::from_flags(flags)
    }

    pub fn from_flags(flags: Flags) -> Result<Config, ConfigError> {
        let CommonFlags {
            cloud_config,
            kubeconfig,
            cluster_name,
            management_network,
            controllers,
            verbosity: _,
        } = flags.common;
        let management_network = match management_network.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(raw) => Some(
                NetworkName::parse(raw)
                    .map_err(|reason| ConfigError::new("--management-network", raw, reason))?,
            ),
        };
        let n = flags.node;
        let node_ip_cidr = parse_node_ip_cidr(&n.node_ip_cidr)?;
        let exclude_ranges = n
            .node_exclude_ip_ranges
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| {
                parse_prefix(s).map_err(|r| ConfigError::new("--node-exclude-ip-ranges", s, r))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if n.concurrent_node_syncs == 0 {
            return Err(ConfigError::new(
                "--concurrent-node-syncs",
                "0",
                "must be at least 1",
            ));
        }
        let resync = parse_go_duration(&n.node_status_update_frequency).map_err(|r| {
            ConfigError::new(
                "--node-status-update-frequency",
                &n.node_status_update_frequency,
                r,
            )
        })?;
        if resync.is_zero() {
            return Err(ConfigError::new(
                "--node-status-update-frequency",
                &n.node_status_update_frequency,
                "must be positive",
            ));
        }
        Ok(Config {
            cloud_config,
            kubeconfig,
            cluster_name: normalize_cluster_name(&cluster_name),
            controllers: Controllers::parse(&controllers)?,
            node: NodeConfig {
                addresses: AddressRules {
                    management_network: management_network.clone(),
                    node_ip_cidr,
                    exclude_ranges,
                    use_node_annotations: !n.disable_annotation_alpha_provided_ip_addr,
                },
                topology: !n.disable_vmi_controller,
                concurrency: n.concurrent_node_syncs,
                resync,
            },
            management_network,
            token_expiry_warning_days: flags.ops.token_expiry_warning_days,
            service: ServiceConfig {
                dhcp_mode: flags.service.dhcp_mode.clone(),
                dhcp_interface: flags
                    .service
                    .dhcp_interface
                    .clone()
                    .map(|i| i.trim().to_string())
                    .filter(|i| !i.is_empty()),
                load_balancer_class: flags
                    .service
                    .load_balancer_class
                    .map(|c| c.trim().to_string())
                    .filter(|c| !c.is_empty()),
            },
        })
    }

    /// The default log filter for a klog verbosity (`--v`).
    pub fn log_filter(verbosity: u8) -> &'static str {
        match verbosity {
            0..=3 => "info,kube_client::client::builder=warn",
            4 | 5 => "debug,hyper_util=info,rustls=info,tower=info",
            _ => "trace,hyper_util=info,rustls=info,tower=info",
        }
    }

    /// Why the cluster name may be a mistake (upstream warns and carries on), if it may.
    pub fn cluster_name_warning(&self) -> Option<String> {
        let name = &self.cluster_name;
        if name.is_empty() || name == "kubernetes" {
            Some(format!(
                "--cluster-name is {name:?}: Harvester IP pools scoped to a guest cluster will not match; pass the guest cluster's name"
            ))
        } else if !is_dns1123_label(name) {
            Some(format!("--cluster-name {name:?} is not a DNS-1123 label"))
        } else {
            None
        }
    }
}

/// `namespace/name` of a Harvester VM network (a NetworkAttachmentDefinition).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkName {
    pub namespace: String,
    pub name: String,
}

impl NetworkName {
    /// `ns/name`, or a bare `name` in namespace `default` (as upstream normalises the flag).
    pub fn parse(raw: &str) -> Result<NetworkName, String> {
        Self::parse_in(raw, "default")
    }

    /// `ns/name`, or a bare `name` in `namespace`.
    pub fn parse_in(raw: &str, namespace: &str) -> Result<NetworkName, String> {
        let raw = raw.trim();
        let (ns, name) = match raw.split_once('/') {
            Some((ns, name)) => (ns, name),
            None => (namespace, raw),
        };
        if !is_dns1123_label(ns) {
            return Err(format!(
                "namespace {ns:?} is not a DNS-1123 label (expected namespace/name)"
            ));
        }
        if !is_dns1123_subdomain(name) {
            return Err(format!(
                "network name {name:?} is not a DNS-1123 subdomain (expected namespace/name)"
            ));
        }
        Ok(NetworkName {
            namespace: ns.to_string(),
            name: name.to_string(),
        })
    }
}

impl fmt::Display for NetworkName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The set of controllers to run, from `--controllers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Controllers {
    enabled: BTreeSet<&'static str>,
}

impl Default for Controllers {
    fn default() -> Self {
        Controllers {
            enabled: KNOWN_CONTROLLERS.into_iter().collect(),
        }
    }
}

impl Controllers {
    pub fn parse(values: &[String]) -> Result<Controllers, ConfigError> {
        let mut enabled = BTreeSet::new();
        let mut all = false;
        let mut disabled = BTreeSet::new();
        for v in values.iter().map(|v| v.trim()).filter(|v| !v.is_empty()) {
            if v == "*" {
                all = true;
                continue;
            }
            let (off, name) = match v.strip_prefix('-') {
                Some(name) => (true, name),
                None => (false, v),
            };
            let Some(known) = KNOWN_CONTROLLERS.iter().find(|k| **k == name) else {
                return Err(ConfigError::new(
                    "--controllers",
                    v,
                    format!(
                        "unknown controller; known: *, {}",
                        KNOWN_CONTROLLERS.join(", ")
                    ),
                ));
            };
            if off {
                disabled.insert(*known);
            } else {
                enabled.insert(*known);
            }
        }
        if all {
            enabled.extend(KNOWN_CONTROLLERS);
        }
        enabled.retain(|c| !disabled.contains(c));
        Ok(Controllers { enabled })
    }

    pub fn enabled(&self, name: &str) -> bool {
        self.enabled.contains(name)
    }
}

/// `--node-ip-cidr`: at most one IPv4 and one IPv6 prefix; no loopback, link-local, multicast,
/// unspecified or broadcast.
fn parse_node_ip_cidr(values: &[String]) -> Result<Vec<IpNetwork>, ConfigError> {
    const FLAG: &str = "--node-ip-cidr";
    let mut out: Vec<IpNetwork> = Vec::new();
    for v in values.iter().map(|v| v.trim()).filter(|v| !v.is_empty()) {
        let net = parse_prefix(v).map_err(|r| ConfigError::new(FLAG, v, r))?;
        if let Some(why) = crate::addresses::unusable(net.ip()) {
            return Err(ConfigError::new(
                FLAG,
                v,
                format!("{why} addresses cannot be node addresses"),
            ));
        }
        if out.iter().any(|o| o.is_ipv4() == net.is_ipv4()) {
            let family = if net.is_ipv4() { "IPv4" } else { "IPv6" };
            return Err(ConfigError::new(
                FLAG,
                v,
                format!("at most one {family} prefix is allowed"),
            ));
        }
        out.push(net);
    }
    Ok(out)
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

/// A Go duration: `300ms`, `30s`, `5m`, `1h30m`, `1.5h`, `0`.
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err("empty duration".into());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_len);
        let value: f64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a duration like 30s, 5m or 1h30m"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let seconds = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "" => return Err(format!("{s:?} lacks a unit (ns, us, ms, s, m, h)")),
            other => return Err(format!("unknown unit {other:?} in {s:?}")),
        };
        total += value * seconds;
        rest = next;
    }
    Duration::try_from_secs_f64(total).map_err(|e| format!("{s:?}: {e}"))
}

fn normalize_cluster_name(raw: &str) -> String {
    raw.trim_matches(|c: char| c == '"' || c == '\'' || c == '`' || c.is_whitespace())
        .to_string()
}

fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &[&str]) -> Result<Config, ConfigError> {
        let mut args = vec!["harvester-cloud-provider", "--cloud-config", "/cc"];
        args.extend_from_slice(extra);
        Config::from_args(args)
    }

    #[test]
    fn defaults_match_upstream() {
        let c = Config::from_args(["harvester-cloud-provider"]).unwrap();
        assert_eq!(
            c.cloud_config,
            PathBuf::from(harvester_common::cloud_config::DEFAULT_PATH)
        );
        assert_eq!(c.cluster_name, "kubernetes");
        assert_eq!(c.management_network, None);
        assert!(c.node.addresses.node_ip_cidr.is_empty());
        assert!(c.node.addresses.use_node_annotations);
        assert!(c.node.topology);
        assert_eq!(c.node.concurrency, 1);
        assert_eq!(c.node.resync, Duration::from_secs(300));
        for name in KNOWN_CONTROLLERS {
            assert!(c.controllers.enabled(name), "{name}");
        }
        assert!(c.cluster_name_warning().is_some());
    }

    #[test]
    fn flags_are_typed() {
        let c = config(&[
            "--cluster-name",
            " \"rke2-a\" ",
            "--management-network",
            "mgmt",
            "--node-ip-cidr",
            "10.0.0.0/24,fd00::/64",
            "--node-exclude-ip-ranges",
            "10.1.0.0/16",
            "--node-exclude-ip-ranges",
            "192.168.1.7",
            "--disable-annotation-alpha-provided-ip-addr",
            "--disable-vmi-controller",
            "--concurrent-node-syncs",
            "4",
            "--node-status-update-frequency",
            "1m30s",
            "--controllers",
            "*,-service-lb-controller",
        ])
        .unwrap();
        assert_eq!(c.cluster_name, "rke2-a");
        assert_eq!(c.cluster_name_warning(), None);
        assert_eq!(
            c.management_network.as_ref().map(ToString::to_string),
            Some("default/mgmt".to_string())
        );
        let a = &c.node.addresses;
        assert_eq!(
            a.node_ip_cidr,
            vec![
                "10.0.0.0/24".parse::<IpNetwork>().unwrap(),
                "fd00::/64".parse().unwrap()
            ]
        );
        assert_eq!(
            a.exclude_ranges,
            vec![
                "10.1.0.0/16".parse::<IpNetwork>().unwrap(),
                "192.168.1.7/32".parse().unwrap()
            ]
        );
        assert!(!a.use_node_annotations);
        assert_eq!(a.management_network, c.management_network);
        assert!(!c.node.topology);
        assert_eq!(c.node.concurrency, 4);
        assert_eq!(c.node.resync, Duration::from_secs(90));
        assert!(c.controllers.enabled(CLOUD_NODE_CONTROLLER));
        assert!(!c.controllers.enabled(SERVICE_LB_CONTROLLER));
    }

    #[test]
    fn bad_values_name_the_flag_and_the_value() {
        let cases: &[(&[&str], &str, &str)] = &[
            (
                &["--node-ip-cidr", "10.0.0.0/33"],
                "--node-ip-cidr",
                "10.0.0.0/33",
            ),
            (&["--node-ip-cidr", "banana"], "--node-ip-cidr", "banana"),
            (
                &["--node-ip-cidr", "127.0.0.0/8"],
                "--node-ip-cidr",
                "127.0.0.0/8",
            ),
            (
                &["--node-ip-cidr", "169.254.0.0/16"],
                "--node-ip-cidr",
                "169.254.0.0/16",
            ),
            (
                &["--node-ip-cidr", "fe80::/10"],
                "--node-ip-cidr",
                "fe80::/10",
            ),
            (
                &["--node-ip-cidr", "224.0.0.0/4"],
                "--node-ip-cidr",
                "224.0.0.0/4",
            ),
            (
                &["--node-ip-cidr", "0.0.0.0/0"],
                "--node-ip-cidr",
                "0.0.0.0/0",
            ),
            (
                &["--node-ip-cidr", "255.255.255.255"],
                "--node-ip-cidr",
                "255.255.255.255",
            ),
            (
                &["--node-ip-cidr", "10.0.0.0/8,10.1.0.0/16"],
                "--node-ip-cidr",
                "10.1.0.0/16",
            ),
            (
                &["--node-exclude-ip-ranges", "10.0.0"],
                "--node-exclude-ip-ranges",
                "10.0.0",
            ),
            (
                &["--management-network", "a/b/c"],
                "--management-network",
                "a/b/c",
            ),
            (
                &["--management-network", "Default/mgmt"],
                "--management-network",
                "Default/mgmt",
            ),
            (
                &["--management-network", "/mgmt"],
                "--management-network",
                "/mgmt",
            ),
            (
                &["--controllers", "cloud-node"],
                "--controllers",
                "cloud-node",
            ),
            (
                &["--concurrent-node-syncs", "0"],
                "--concurrent-node-syncs",
                "0",
            ),
            (
                &["--node-status-update-frequency", "5"],
                "--node-status-update-frequency",
                "5",
            ),
            (
                &["--node-status-update-frequency", "5d"],
                "--node-status-update-frequency",
                "5d",
            ),
            (
                &["--node-status-update-frequency", "0"],
                "--node-status-update-frequency",
                "0",
            ),
        ];
        for (args, flag, value) in cases {
            let err = config(args).expect_err(&format!("{args:?} must be refused"));
            assert_eq!((err.flag, err.value.as_str()), (*flag, *value), "{args:?}");
            let text = err.to_string();
            assert!(text.contains(flag) && text.contains(value), "{text}");
        }
    }

    #[test]
    fn go_durations() {
        for (s, d) in [
            ("0", Duration::ZERO),
            ("300ms", Duration::from_millis(300)),
            ("30s", Duration::from_secs(30)),
            ("5m", Duration::from_secs(300)),
            ("5m0s", Duration::from_secs(300)),
            ("1h30m", Duration::from_secs(5400)),
            ("1.5h", Duration::from_secs(5400)),
        ] {
            assert_eq!(parse_go_duration(s), Ok(d), "{s}");
        }
        for s in ["", "5", "m", "5x", "-5s", "1..2s"] {
            assert!(parse_go_duration(s).is_err(), "{s}");
        }
    }

    #[test]
    fn controllers_selection() {
        let c = |v: &[&str]| {
            Controllers::parse(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
        };
        let only_node = c(&["cloud-node-controller"]);
        assert!(only_node.enabled(CLOUD_NODE_CONTROLLER));
        assert!(!only_node.enabled(CLOUD_NODE_LIFECYCLE_CONTROLLER));
        let no_lb = c(&["*", "-service-lb-controller"]);
        assert!(no_lb.enabled(CLOUD_NODE_LIFECYCLE_CONTROLLER));
        assert!(!no_lb.enabled(SERVICE_LB_CONTROLLER));
    }

    #[test]
    fn network_names() {
        let n = NetworkName::parse("mgmt-vlan").unwrap();
        assert_eq!(n.to_string(), "default/mgmt-vlan");
        let n = NetworkName::parse_in("vlan1", "guest-vms").unwrap();
        assert_eq!(n.to_string(), "guest-vms/vlan1");
        assert_eq!(
            NetworkName::parse("ns1/net.a").unwrap(),
            NetworkName {
                namespace: "ns1".into(),
                name: "net.a".into()
            }
        );
    }
}
