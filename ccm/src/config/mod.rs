//! Flags, parsed and validated at the edge into a typed [`Config`].
//!
//! Flag names and defaults follow upstream harvester-cloud-provider (its own flags and the
//! cloud-provider framework flags the chart and users pass). Flags are grouped by the controllers
//! that read them: [`CommonFlags`] for everything, [`NodeFlags`] for the node-side controllers.
//! A new controller adds its own `#[command(flatten)]` group to [`Flags`] and its own typed
//! section to [`Config`].
//!
//! The command line is read as upstream's pflag/cobra reads it ([`parse_args`]): a repeated flag
//! keeps its last value, bools may be bare, `_` in a name is `-`, and every flag of upstream's
//! binary is accepted; those that mean nothing here are listed in [`upstream`].

pub mod addresses;
pub mod secure;
pub mod upstream;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser};
use harvester_common::flags::{self, Outcome, Syntax};
use ipnetwork::IpNetwork;

pub use crate::network::NetworkName;
use addresses::AddressRules;
pub use addresses::parse_prefix;
use harvester_common::names::is_dns1123_label;

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
/// Short names `--controllers` also takes (k8s.io/cloud-provider `names.CCMControllerAliases`).
const CONTROLLER_ALIASES: [(&str, &str); 4] = [
    ("cloud-node", CLOUD_NODE_CONTROLLER),
    ("cloud-node-lifecycle", CLOUD_NODE_LIFECYCLE_CONTROLLER),
    ("service", SERVICE_LB_CONTROLLER),
    ("route", NODE_ROUTE_CONTROLLER),
];
/// The Lease upstream's framework elects with (k8s.io/cloud-provider options); the same one, so
/// that old and new pods never lead at once during a rolling switch.
pub const DEFAULT_LEASE_NAME: &str = "cloud-controller-manager";

/// The command line.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "harvester-cloud-provider",
    version,
    about = "Cloud controller manager for Kubernetes guest clusters on Harvester HCI",
    // pflag: a repeated flag keeps its last value (a slice flag appends).
    args_override_self = true,
    // `--version[=true|false|raw]` is upstream's (component-base verflag), not clap's.
    disable_version_flag = true
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
    #[command(flatten)]
    pub secure: secure::SecureFlags,
}

/// Operations: logs, health and metrics endpoints, leader election, credential expiry.
/// Read by `main` only; the controllers never see them.
#[derive(Args, Debug, Clone)]
pub struct OpsFlags {
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    pub log_format: harvester_common::telemetry::LogFormat,
    /// Upstream's name for --log-format (component-base): text or json; wins when given.
    #[arg(long)]
    pub logging_format: Option<harvester_common::telemetry::LogFormat>,
    /// Print the version and exit (`raw` as well; upstream's verflag).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true",
          value_parser = parse_version_flag)]
    pub version: Option<bool>,
    /// Address of plain-HTTP /healthz, /readyz, /livez and /metrics without authentication
    /// (`host:port`); off when empty, the default. The HTTPS endpoints (--secure-port) are
    /// upstream's; this one is for a local scraper, e.g. `127.0.0.1:10268`.
    #[arg(long, default_value = "")]
    pub metrics_address: String,
    /// Run the controllers only while holding a Lease (needed with more than one replica).
    #[arg(long, default_value = "true", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = go_bool)]
    pub leader_elect: bool,
    #[arg(long, default_value = "kube-system")]
    pub leader_elect_resource_namespace: String,
    /// The Lease's name: upstream's default, so old and new pods share one election.
    #[arg(long, default_value = DEFAULT_LEASE_NAME)]
    pub leader_elect_resource_name: String,
    /// Only `leases` (what upstream defaults to; client-go has no other lock any more).
    #[arg(long, default_value = "leases", value_parser = ["leases"])]
    pub leader_elect_resource_lock: String,
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
    /// Interface to lease DHCP addresses on when the Service's network maps to no interface;
    /// without it, the default route's interface (kube-vip's choice when `vip_interface` is empty).
    #[arg(long)]
    pub dhcp_interface: Option<String>,
    /// Where a LoadBalancer Service without `cloudprovider.harvesterhci.io/ipam` gets its address:
    /// `pool` (Harvester's IP pools, upstream's default), `dhcp`, or `guest` (the guest cluster's
    /// ranges in ConfigMap `kube-system/kubevip`, kube-vip-cloud-provider's format).
    #[arg(long, default_value = "pool")]
    pub default_ipam: crate::service::annotations::Ipam,
    /// How many Services are reconciled at once; 64 when not given (upstream's flag: given, it
    /// bounds the service controller as upstream's does).
    #[arg(long)]
    pub concurrent_service_syncs: Option<u16>,
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
    /// Address of the guest API server; overrides the kubeconfig's (upstream's `--master`).
    #[arg(long)]
    pub master: Option<String>,
    /// Name of the guest cluster (labels and names of Harvester LoadBalancers).
    #[arg(long, default_value = "kubernetes")]
    pub cluster_name: String,
    /// Harvester VM network (`namespace/name`; a bare `name` means `default/name`) whose NIC
    /// supplies the node addresses and which LoadBalancers announce on.
    #[arg(long)]
    pub management_network: Option<String>,
    /// Controllers to run: `*` for all, `name` to add one, `-name` to remove one; upstream's
    /// short names (`cloud-node`, `cloud-node-lifecycle`, `service`, `route`) too.
    #[arg(long, value_delimiter = ',', default_value = "*")]
    pub controllers: Vec<String>,
    /// Log verbosity as klog counts it (2 = info, 4 = debug, 6 = trace); RUST_LOG overrides it.
    #[arg(long = "v", short = 'v', default_value_t = 2)]
    pub verbosity: u8,
}

/// Nodes each node-side controller reconciles at once when `--concurrent-node-syncs` is not
/// given. Upstream's default is one worker, which makes Nodes that register together (a cluster
/// scaling up, 16 at a time) wait in line behind each other's API round trips; a Node's
/// reconcile is independent of every other Node's, so they run side by side. 64, as for
/// Services: at 1 000 Nodes arriving 16 requests at a time, 16 left the Nodes waiting for a turn
/// and 128 only made each round trip slower (docs/ccm.md, "Under a burst").
pub const DEFAULT_NODE_SYNCS: u16 = 64;

/// Flags of the node-side controllers (node, lifecycle, topology).
#[derive(Args, Debug, Clone)]
pub struct NodeFlags {
    /// At most one IPv4 and one IPv6 prefix (or address), comma-separated: the node's
    /// InternalIPs are chosen inside them. One string upstream: given twice, the last counts.
    #[arg(long, default_value = "")]
    pub node_ip_cidr: String,
    /// With --node-ip-cidr: ExternalIPs inside these prefixes (or addresses) are not reported.
    #[arg(long, value_delimiter = ',')]
    pub node_exclude_ip_ranges: Vec<String>,
    /// Ignore the Node annotations `alpha.kubernetes.io/provided-node-ip` and
    /// `cloudprovider.harvesterhci.io/additional-internal-ips`.
    #[arg(long, default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = go_bool)]
    pub disable_annotation_alpha_provided_ip_addr: bool,
    /// Do not follow VMIs after initialisation: no topology resync after live migration.
    #[arg(long, default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = go_bool)]
    pub disable_vmi_controller: bool,
    /// How many Nodes each node-side controller reconciles at once; 64 when not given (upstream's
    /// flag: given, it bounds the node-side controllers as upstream's workers do).
    #[arg(long)]
    pub concurrent_node_syncs: Option<u16>,
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
    /// `--master`: the guest API server's address, overriding the kubeconfig's.
    pub master: Option<http::Uri>,
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
    /// `--concurrent-service-syncs`; `None`: unbounded.
    pub concurrency: Option<u16>,
    pub dhcp_mode: crate::service::dhcp::DhcpMode,
    pub dhcp_interface: Option<String>,
    /// `--default-ipam`.
    pub default_ipam: crate::service::annotations::Ipam,
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
        match parse_args(args) {
            Ok(parsed) => Config::from_flags(parsed.flags),
            Err(Outcome::Refused(line) | Outcome::Print(line)) => {
                Err(ConfigError::new("command line", "", line))
            }
        }
    }

    pub fn from_flags(flags: Flags) -> Result<Config, ConfigError> {
        let CommonFlags {
            cloud_config,
            kubeconfig,
            master: _,
            cluster_name,
            management_network,
            controllers,
            verbosity: _,
        } = flags.common.clone();
        let management_network = match management_network.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(raw) => Some(
                NetworkName::parse(raw)
                    .map_err(|reason| ConfigError::new("--management-network", raw, reason))?,
            ),
        };
        let n = flags.node;
        let node_ip_cidr = parse_node_ip_cidr(&n.node_ip_cidr)?;
        if flags.service.concurrent_service_syncs == Some(0) {
            return Err(ConfigError::new(
                "--concurrent-service-syncs",
                "0",
                "must be at least 1",
            ));
        }
        let master = parse_master(flags.common.master.as_deref())?;
        let exclude_ranges = n
            .node_exclude_ip_ranges
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| {
                parse_prefix(s).map_err(|r| ConfigError::new("--node-exclude-ip-ranges", s, r))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if n.concurrent_node_syncs == Some(0) {
            return Err(ConfigError::new(
                "--concurrent-node-syncs",
                "0",
                "must be at least 1",
            ));
        }
        let resync = parse_resync(&n.node_status_update_frequency)?;
        Ok(Config {
            cloud_config,
            kubeconfig,
            master,
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
                concurrency: n.concurrent_node_syncs.unwrap_or(DEFAULT_NODE_SYNCS),
                resync,
            },
            management_network,
            token_expiry_warning_days: flags.ops.token_expiry_warning_days,
            service: ServiceConfig {
                concurrency: flags.service.concurrent_service_syncs,
                dhcp_mode: flags.service.dhcp_mode.clone(),
                default_ipam: flags.service.default_ipam,
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
            let canonical = CONTROLLER_ALIASES
                .iter()
                .find(|(alias, _)| *alias == name)
                .map_or(name, |(_, full)| *full);
            let Some(known) = KNOWN_CONTROLLERS.iter().find(|k| **k == canonical) else {
                return Err(ConfigError::new(
                    "--controllers",
                    v,
                    format!(
                        "unknown controller; known: *, {}, or their short names {}",
                        KNOWN_CONTROLLERS.join(", "),
                        CONTROLLER_ALIASES.map(|(a, _)| a).join(", ")
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
fn parse_node_ip_cidr(value: &str) -> Result<Vec<IpNetwork>, ConfigError> {
    const FLAG: &str = "--node-ip-cidr";
    let mut out: Vec<IpNetwork> = Vec::new();
    for v in value.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        let net = parse_prefix(v).map_err(|r| ConfigError::new(FLAG, v, r))?;
        if let Some(why) = addresses::unusable(net.ip()) {
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

pub use harvester_common::flags::parse_go_duration;

/// A command line read as upstream reads it.
#[derive(Debug, Clone)]
pub struct Parsed {
    pub flags: Flags,
    /// Upstream flags that were given but mean nothing here, as given (`--name=value`), for
    /// the one info line at start.
    pub without_effect: Vec<String>,
}

/// Parses a command line (program name first) with upstream's pflag semantics: every flag of
/// upstream's binary is accepted, a repeated flag keeps its last value, a bool may be bare,
/// `_` in a flag name reads as `-`. `Err(Print)` for `--help`, `Err(Refused)` with one line
/// naming the flag and the value otherwise.
pub fn parse_args<I, T>(args: I) -> Result<Parsed, Outcome>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString>,
{
    let args = flags::normalize_args(args, Syntax::Pflag);
    let command = flags::take_hyphen_values(Flags::command().args(upstream::args()));
    let matches = command
        .try_get_matches_from(args)
        .map_err(|e| flags::clap_outcome(&e))?;
    let flags = Flags::from_arg_matches(&matches).map_err(|e| flags::clap_outcome(&e))?;
    Ok(Parsed {
        without_effect: upstream::given(&matches),
        flags,
    })
}

/// A bool flag's value as pflag reads it (`strconv.ParseBool`).
fn go_bool(s: &str) -> Result<bool, String> {
    flags::parse_go_bool(s)
}

/// `--version[=true|false|raw]`: whether to print the version.
fn parse_version_flag(s: &str) -> Result<bool, String> {
    match s {
        "raw" => Ok(true),
        other => flags::parse_go_bool(other),
    }
}

/// `--master`: a URL with a host, or nothing.
fn parse_master(raw: Option<&str>) -> Result<Option<http::Uri>, ConfigError> {
    match raw.map(str::trim) {
        None | Some("") => Ok(None),
        Some(raw) => raw
            .parse::<http::Uri>()
            .ok()
            .filter(|u| u.host().is_some())
            .map(Some)
            .ok_or_else(|| {
                ConfigError::new("--master", raw, "not a URL like https://10.0.0.1:6443")
            }),
    }
}

/// `--node-status-update-frequency`: a positive Go duration.
fn parse_resync(raw: &str) -> Result<Duration, ConfigError> {
    let flag = "--node-status-update-frequency";
    let resync = parse_go_duration(raw).map_err(|r| ConfigError::new(flag, raw, r))?;
    if resync.is_zero() {
        return Err(ConfigError::new(flag, raw, "must be positive"));
    }
    Ok(resync)
}

fn normalize_cluster_name(raw: &str) -> String {
    raw.trim_matches(|c: char| c == '"' || c == '\'' || c == '`' || c.is_whitespace())
        .to_string()
}

#[cfg(test)]
mod tests;
