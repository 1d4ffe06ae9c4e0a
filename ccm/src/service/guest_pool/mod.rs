//! Guest-side address pools (`cloudprovider.harvesterhci.io/ipam: guest`): ranges and CIDRs the
//! guest cluster defines itself in ConfigMap `kube-system/kubevip`, in kube-vip-cloud-provider's
//! key format so an existing ConfigMap moves over as it is. Pure: the ConfigMap's data parsed into
//! a [`PoolConfig`] here, the choice of an address in [`alloc`]; the reconcile reads the caches and
//! writes the Service around them.
//!
//! The format, as kube-vip-cloud-provider v0.0.12 reads it (`pkg/provider/loadBalancer.go`
//! `discoverPool`, `pkg/ipam/addressbuilder.go`, `pkg/config/config.go`):
//! - `cidr-<namespace>` / `range-<namespace>` for one namespace, `cidr-global` / `range-global`
//!   for all; values are comma-separated lists (`10.0.0.0/29,fd00::/126`,
//!   `10.0.0.10-10.0.0.20,10.0.0.30-10.0.0.40`), IPv4 and IPv6 mixed;
//! - of one scope, `cidr-` is taken before `range-`;
//! - `skip-end-ips-in-cidr: "true"` leaves out the first and last address of IPv4 CIDRs shorter
//!   than /31; `search-order: "desc"` allocates from the top;
//! - `interface-<namespace>` / `interface-global` name kube-vip's `serviceInterface`.
//!
//! Where we differ, on purpose: a namespace's own keys come before both global keys (upstream
//! takes `cidr-global` before `range-<namespace>`); a malformed value, a range whose ends are
//! swapped or of two families, kube-vip's DHCP pool `0.0.0.0/32`, and a namespace's pool that
//! overlaps another pool are refused with a Warning naming the key and value (upstream allocates
//! from overlapping pools, and counts only the namespace's own Services as using a namespace
//! pool, so two namespaces can get one address). `allow-share-*` (automatic sharing) is not
//! read: addresses are shared with `cloudprovider.harvesterhci.io/primary-service`.

pub mod alloc;

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnetwork::IpNetwork;

/// Where the pools are: kube-vip-cloud-provider's default ConfigMap (`KUBEVIP_NAMESPACE`,
/// `KUBEVIP_CONFIG_MAP` unset; v0.0.12 `pkg/provider/provider.go`).
pub const POOL_CONFIGMAP_NAMESPACE: &str = "kube-system";
pub const POOL_CONFIGMAP_NAME: &str = "kubevip";
const GLOBAL: &str = "global";
const SKIP_END_IPS: &str = "skip-end-ips-in-cidr";
const SEARCH_ORDER: &str = "search-order";

/// Why a guest-pool Service gets no address (or not the one it asked for).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GuestProblem {
    #[error(
        "no guest pool for namespace {namespace}: ConfigMap {POOL_CONFIGMAP_NAMESPACE}/{POOL_CONFIGMAP_NAME} has none of cidr-{namespace}, range-{namespace}, cidr-global, range-global"
    )]
    NoPool { namespace: String },
    #[error(
        "ConfigMap {POOL_CONFIGMAP_NAMESPACE}/{POOL_CONFIGMAP_NAME} key {key}={value:?}: {reason}"
    )]
    InvalidPool {
        key: String,
        value: String,
        reason: String,
    },
    #[error(
        "ConfigMap {POOL_CONFIGMAP_NAMESPACE}/{POOL_CONFIGMAP_NAME} key {key}={value:?} overlaps {other_key}={other_value:?}; pools must not share addresses"
    )]
    Overlap {
        key: String,
        value: String,
        other_key: String,
        other_value: String,
    },
    #[error(
        "no free address in guest pool {key}={value:?}; the Service gets one when an address is freed or the pool grows"
    )]
    Exhausted { key: String, value: String },
    #[error("requested address {requested} is outside guest pool {key}={value:?}")]
    RequestedOutside {
        requested: IpAddr,
        key: String,
        value: String,
    },
    #[error(
        "requested address {requested} is already used by {holder}; the Service gets it when it is freed"
    )]
    RequestedTaken { requested: IpAddr, holder: String },
}

impl GuestProblem {
    /// Stable Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            GuestProblem::NoPool { .. }
            | GuestProblem::InvalidPool { .. }
            | GuestProblem::Overlap { .. } => "GuestPoolInvalid",
            GuestProblem::Exhausted { .. } => "GuestPoolExhausted",
            GuestProblem::RequestedOutside { .. } | GuestProblem::RequestedTaken { .. } => {
                "LoadBalancerIPNotHonoured"
            }
        }
    }
}

/// An inclusive run of addresses of one family, as integers (IPv4 in the low 32 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Span {
    pub v6: bool,
    pub first: u128,
    pub last: u128,
}

pub fn to_int(ip: IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(v4) => (false, u128::from(u32::from(v4))),
        IpAddr::V6(v6) => (true, u128::from(v6)),
    }
}

pub fn from_int(v6: bool, n: u128) -> IpAddr {
    if v6 {
        IpAddr::V6(n.into())
    } else {
        // IPv4 spans never leave the low 32 bits.
        IpAddr::V4(u32::try_from(n).unwrap_or(u32::MAX).into())
    }
}

/// One scope's addresses: the key and value they came from, as sorted, merged spans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    pub key: String,
    pub value: String,
    pub spans: Vec<Span>,
}

impl Pool {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let (v6, n) = to_int(ip);
        self.spans
            .iter()
            .any(|s| s.v6 == v6 && s.first <= n && n <= s.last)
    }

    fn overlaps(&self, other: &Pool) -> bool {
        self.spans.iter().any(|a| {
            other
                .spans
                .iter()
                .any(|b| a.v6 == b.v6 && a.first <= b.last && b.first <= a.last)
        })
    }
}

/// The pools of ConfigMap `kube-system/kubevip`, per scope (a namespace, or `global`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolConfig {
    pools: BTreeMap<String, Result<Pool, GuestProblem>>,
    /// `search-order: desc`.
    pub descending: bool,
    interfaces: BTreeMap<String, String>,
}

impl PoolConfig {
    /// Reads the ConfigMap's data; a bad value is kept as the error of its scope only.
    pub fn parse(data: &BTreeMap<String, String>) -> PoolConfig {
        let skip_ends = data.get(SKIP_END_IPS).map(|v| v.trim()) == Some("true");
        let mut pools = BTreeMap::new();
        // `cidr-` before `range-` of one scope, as upstream's discoverPool.
        for (prefix, cidr) in [("range-", false), ("cidr-", true)] {
            for (key, value) in data {
                let Some(scope) = key.strip_prefix(prefix).filter(|s| !s.is_empty()) else {
                    continue;
                };
                let parsed = parse_spans(value, cidr, skip_ends)
                    .map(|spans| Pool {
                        key: key.clone(),
                        value: value.clone(),
                        spans,
                    })
                    .map_err(|reason| GuestProblem::InvalidPool {
                        key: key.clone(),
                        value: value.clone(),
                        reason,
                    });
                pools.insert(scope.to_string(), parsed);
            }
        }
        let interfaces = data
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("interface-")?.to_string(), v.trim())))
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k, v.to_string()))
            .collect();
        PoolConfig {
            pools,
            descending: data.get(SEARCH_ORDER).map(|v| v.trim()) == Some("desc"),
            interfaces,
        }
    }

    /// The pool a Service of `namespace` takes its address from: the namespace's own, else the
    /// global one. A namespace's pool that shares addresses with another pool is refused (the
    /// global one is not: the namespace's key is the one to fix).
    pub fn pool_for(&self, namespace: &str) -> Result<&Pool, GuestProblem> {
        if let Some(own) = self.pools.get(namespace).filter(|_| namespace != GLOBAL) {
            let own = own.as_ref().map_err(Clone::clone)?;
            let other = self
                .pools
                .iter()
                .filter(|(scope, _)| scope.as_str() != namespace)
                .filter_map(|(_, p)| p.as_ref().ok())
                .find(|p| own.overlaps(p));
            return match other {
                Some(other) => Err(GuestProblem::Overlap {
                    key: own.key.clone(),
                    value: own.value.clone(),
                    other_key: other.key.clone(),
                    other_value: other.value.clone(),
                }),
                None => Ok(own),
            };
        }
        match self.pools.get(GLOBAL) {
            Some(global) => global.as_ref().map_err(Clone::clone),
            None => Err(GuestProblem::NoPool {
                namespace: namespace.to_string(),
            }),
        }
    }

    /// kube-vip's interface for Services of `namespace` (`interface-<namespace>`, else
    /// `interface-global`), if the ConfigMap names one.
    pub fn interface_for(&self, namespace: &str) -> Option<&str> {
        self.interfaces
            .get(namespace)
            .or_else(|| self.interfaces.get(GLOBAL))
            .map(String::as_str)
    }
}

/// A comma-separated list of CIDRs (`cidr`) or `first-last` ranges, as sorted, merged spans.
fn parse_spans(value: &str, cidr: bool, skip_ends: bool) -> Result<Vec<Span>, String> {
    let mut spans = Vec::new();
    for item in value.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        let span = if cidr {
            cidr_span(item, skip_ends)?
        } else {
            range_span(item)?
        };
        spans.push(span);
    }
    if spans.is_empty() {
        return Err("no address in the value".into());
    }
    spans.sort();
    let mut merged: Vec<Span> = Vec::with_capacity(spans.len());
    for s in spans {
        match merged.last_mut() {
            Some(m) if m.v6 == s.v6 && s.first <= m.last.saturating_add(1) => {
                m.last = m.last.max(s.last)
            }
            _ => merged.push(s),
        }
    }
    Ok(merged)
}

fn cidr_span(item: &str, skip_ends: bool) -> Result<Span, String> {
    if !item.contains('/') {
        return Err(format!("{item:?} is not a CIDR (address/prefix length)"));
    }
    let net: IpNetwork = item
        .parse()
        .map_err(|e| format!("{item:?} is not a CIDR: {e}"))?;
    if item == "0.0.0.0/32" {
        return Err(
            "0.0.0.0/32 is kube-vip's DHCP pool; use cloudprovider.harvesterhci.io/ipam: dhcp"
                .into(),
        );
    }
    let (v6, first) = to_int(net.network());
    let (_, last) = match net {
        IpNetwork::V4(n) => to_int(IpAddr::V4(n.broadcast())),
        IpNetwork::V6(n) => {
            let host_bits = 128 - u32::from(n.prefix());
            let mask = if host_bits == 128 {
                u128::MAX
            } else {
                (1u128 << host_bits) - 1
            };
            (true, first | mask)
        }
    };
    // Upstream skips the ends of IPv4 CIDRs only, and never of a /31 or /32.
    if skip_ends && !v6 && net.prefix() < 31 {
        return Ok(Span {
            v6,
            first: first + 1,
            last: last - 1,
        });
    }
    Ok(Span { v6, first, last })
}

fn range_span(item: &str) -> Result<Span, String> {
    let Some((a, b)) = item.split_once('-') else {
        return Err(format!("{item:?} is not a range (first-last)"));
    };
    let parse = |s: &str| {
        s.trim()
            .parse::<IpAddr>()
            .map_err(|_| format!("{:?} in {item:?} is not an IP address", s.trim()))
    };
    let ((v6a, first), (v6b, last)) = (to_int(parse(a)?), to_int(parse(b)?));
    if v6a != v6b {
        return Err(format!("{item:?} mixes IPv4 and IPv6"));
    }
    if first > last {
        return Err(format!("{item:?} ends before it starts"));
    }
    Ok(Span {
        v6: v6a,
        first,
        last,
    })
}

#[cfg(test)]
mod tests;
