//! Flags of upstream's binary that mean nothing here. Upstream is a k8s.io/cloud-provider
//! program: its command line carries the framework's whole option set (serving, authn/authz,
//! webhooks, routes, CIDR allocation, client rate limits, klog) and Harvester's own flags. Users
//! and charts pass them in `extraArgs`, so each is accepted here with a value of its upstream
//! type, has no effect, and is named in one info line at start ([`given`]). docs/ccm.md lists
//! them with the reason for each group.

use clap::builder::ValueParser;
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches};
use harvester_common::flags::GoType;

/// (flag, upstream type), exactly the flags of k8s.io/cloud-provider v0.33.7's command (what
/// upstream vendors) and Harvester's own that have no meaning here: a flag upstream does not
/// have stays an error. Bools take a bare form (`--flag` = `--flag=true`), as pflag's do.
pub const WITHOUT_EFFECT: &[(&str, GoType)] = &[
    // Harvester's own (upstream main.go registerHarvesterFlags)
    ("show-full-help-on-error", GoType::Bool),
    ("loadbalancer-network", GoType::String),
    // the framework's cloud settings: upstream forces these itself
    ("cloud-provider", GoType::String),
    ("allow-untagged-cloud", GoType::Bool),
    ("external-cloud-volume-plugin", GoType::String),
    ("use-service-account-credentials", GoType::Bool),
    // routes and CIDR allocation: Harvester has no routes (the route controller never runs)
    ("allocate-node-cidrs", GoType::Bool),
    ("cidr-allocator-type", GoType::String),
    ("cluster-cidr", GoType::String),
    ("configure-cloud-routes", GoType::Bool),
    ("route-reconciliation-period", GoType::Duration),
    // the framework's controller loop settings: watches replace its periodic scans
    ("min-resync-period", GoType::Duration),
    ("node-monitor-period", GoType::Duration),
    ("controller-start-interval", GoType::Duration),
    ("node-sync-period", GoType::Duration),
    // client-side rate limits: requests are counted (/metrics), not throttled
    ("kube-api-content-type", GoType::String),
    ("kube-api-qps", GoType::Float32),
    ("kube-api-burst", GoType::Int32),
    // leader migration between kube-controller-manager and a CCM (not a Harvester setup)
    ("enable-leader-migration", GoType::Bool),
    ("leader-migration-config", GoType::String),
    // upstream's HTTPS serving: TLS tuning (rustls' safe defaults: TLS 1.2 and 1.3, its own cipher
    // suites; one certificate, no SNI), HTTP/2 tuning and port sharing
    ("tls-cipher-suites", GoType::StringSlice),
    ("tls-min-version", GoType::String),
    ("tls-sni-cert-key", GoType::NamedCertKey),
    ("http2-max-streams-per-connection", GoType::Int),
    ("disable-http2-serving", GoType::Bool),
    ("permit-port-sharing", GoType::Bool),
    ("permit-address-sharing", GoType::Bool),
    // delegated authn/authz (config::secure): bearer tokens only; client certificates and
    // front-proxy headers are not authenticated (never looked up: as with
    // --authentication-skip-lookup)
    ("authentication-skip-lookup", GoType::Bool),
    ("authentication-tolerate-lookup-failure", GoType::Bool),
    ("client-ca-file", GoType::String),
    ("requestheader-allowed-names", GoType::StringSlice),
    ("requestheader-client-ca-file", GoType::String),
    ("requestheader-extra-headers-prefix", GoType::StringSlice),
    ("requestheader-group-headers", GoType::StringSlice),
    ("requestheader-uid-headers", GoType::StringSlice),
    ("requestheader-username-headers", GoType::StringSlice),
    // profiling: no /debug/pprof here
    ("contention-profiling", GoType::Bool),
    ("profiling", GoType::Bool),
    // the framework's webhook server (no webhooks here)
    ("webhooks", GoType::StringSlice),
    ("webhook-bind-address", GoType::Ip),
    ("webhook-secure-port", GoType::Int),
    ("webhook-cert-dir", GoType::String),
    ("webhook-tls-cert-file", GoType::String),
    ("webhook-tls-private-key-file", GoType::String),
    // Kubernetes feature gates of the framework
    ("feature-gates", GoType::MapStringBool),
    // klog/component-base log tuning (logs here: --v, --log-format/--logging-format, RUST_LOG)
    ("log-flush-frequency", GoType::Duration),
    ("log-text-info-buffer-size", GoType::Quantity),
    ("log-text-split-stream", GoType::Bool),
    ("vmodule", GoType::ModuleSpec),
];

/// The clap arguments for [`WITHOUT_EFFECT`], hidden from `--help` (docs/ccm.md lists them).
pub fn args() -> Vec<Arg> {
    WITHOUT_EFFECT
        .iter()
        .map(|&(name, ty)| {
            let arg = Arg::new(name)
                .long(name)
                .hide(true)
                .value_parser(ValueParser::new(move |v: &str| {
                    ty.check(v).map(|()| v.to_string())
                }));
            match ty {
                GoType::Bool => arg
                    .num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true")
                    .action(ArgAction::Set),
                GoType::StringSlice | GoType::MapStringBool | GoType::MapStringString => {
                    arg.action(ArgAction::Append)
                }
                _ => arg.action(ArgAction::Set),
            }
        })
        .collect()
}

/// The flags of [`WITHOUT_EFFECT`] given on the command line, as `--name=value`.
pub fn given(matches: &ArgMatches) -> Vec<String> {
    WITHOUT_EFFECT
        .iter()
        .filter(|(name, _)| matches.value_source(name) == Some(ValueSource::CommandLine))
        .map(|(name, _)| {
            let values: Vec<&String> = matches
                .get_many::<String>(name)
                .map(Iterator::collect)
                .unwrap_or_default();
            let joined = values
                .iter()
                .map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(",");
            format!("--{name}={joined}")
        })
        .collect()
}
