//! The Service annotations this controller reads, parsed into a typed [`ServiceLbSpec`] at the edge.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;

pub const ANN_IPAM: &str = "cloudprovider.harvesterhci.io/ipam";
pub const ANN_NETWORK: &str = "cloudprovider.harvesterhci.io/network";
pub const ANN_PROJECT: &str = "cloudprovider.harvesterhci.io/project";
pub const ANN_NAMESPACE: &str = "cloudprovider.harvesterhci.io/namespace";
pub const ANN_PRIMARY_SERVICE: &str = "cloudprovider.harvesterhci.io/primary-service";
/// Label written on secondaries: `<primary namespace>.<primary name>` (upstream format).
pub const LABEL_PRIMARY_SERVICE: &str = "cloudprovider.harvesterhci.io/primary-service";
pub const KUBE_VIP_IPS: &str = "kube-vip.io/loadbalancerIPs";
pub const KUBE_VIP_INTERFACE: &str = "kube-vip.io/serviceInterface";

/// How the address is obtained (`cloudprovider.harvesterhci.io/ipam`, else `--default-ipam`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ipam {
    /// Harvester's IP pools, through a LoadBalancer CR (upstream's default).
    #[default]
    Pool,
    /// DHCP on the VM network (leased by this provider or by kube-vip, `--dhcp-mode`).
    Dhcp,
    /// The guest cluster's own ranges (ConfigMap `kube-system/kubevip`), no CR in Harvester.
    Guest,
}

impl Ipam {
    pub fn as_str(self) -> &'static str {
        match self {
            Ipam::Pool => "pool",
            Ipam::Dhcp => "dhcp",
            Ipam::Guest => "guest",
        }
    }
}

impl std::str::FromStr for Ipam {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pool" => Ok(Ipam::Pool),
            "dhcp" => Ok(Ipam::Dhcp),
            "guest" => Ok(Ipam::Guest),
            _ => Err("must be pool, dhcp or guest".into()),
        }
    }
}

/// A Service by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ServiceKey {
    pub fn of(svc: &Service) -> ServiceKey {
        ServiceKey {
            namespace: svc.namespace().unwrap_or_default(),
            name: svc.name_any(),
        }
    }
    /// The value of the secondaries' primary-service label.
    pub fn label_value(&self) -> String {
        format!("{}.{}", self.namespace, self.name)
    }
}

/// One port of a Service, for the shared-IP overlap check.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PortKey {
    pub port: i32,
    pub protocol: String,
}

/// What a LoadBalancer Service asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceLbSpec {
    pub ipam: Ipam,
    pub network: Option<String>,
    pub project: Option<String>,
    pub namespace: Option<String>,
    /// Set on a secondary that shares its primary's address.
    pub primary: Option<ServiceKey>,
    /// `spec.loadBalancerIP`, which Harvester cannot honour (no field on the CR).
    pub requested_ip: Option<IpAddr>,
    /// `kube-vip.io/loadbalancerIPs` as the user wrote it: read only while the Service has no
    /// ingress (once it has one, the annotation is the address this provider wrote), and empty
    /// for kube-vip's DHCP sentinel `0.0.0.0`.
    pub kube_vip_ips: Vec<IpAddr>,
    pub ports: Vec<PortKey>,
}

/// Input from a Service that cannot be used, named by its key or field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}={value:?}: {reason}")]
pub struct BadAnnotation {
    pub key: String,
    pub value: String,
    pub reason: String,
}

fn bad(key: &str, value: &str, reason: impl Into<String>) -> BadAnnotation {
    BadAnnotation {
        key: key.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

/// A DNS-1123 subdomain-ish name segment (namespace or Service name).
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn non_empty(svc: &Service, key: &str) -> Option<String> {
    svc.annotations()
        .get(key)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Parses `ns/name` or a bare `name` (in the Service's namespace).
pub fn parse_primary(own_namespace: &str, value: &str) -> Result<ServiceKey, BadAnnotation> {
    let value = value.trim();
    let (namespace, name) = match value.split_once('/') {
        Some((ns, name)) => (ns, name),
        None => (own_namespace, value),
    };
    if !valid_name(namespace) || !valid_name(name) {
        return Err(bad(
            ANN_PRIMARY_SERVICE,
            value,
            "expected <namespace>/<name> or <name> of a Service",
        ));
    }
    Ok(ServiceKey {
        namespace: namespace.into(),
        name: name.into(),
    })
}

/// `kube-vip.io/loadbalancerIPs` as kube-vip reads it: a comma-separated list of IPv4 and IPv6
/// addresses, each trimmed, blanks skipped (kube-vip v1.2.3 `pkg/utils/ip.go` `FetchServiceIPs`).
/// Only kube-vip's DHCP sentinel `0.0.0.0` alone means no address (its cloud provider writes it for
/// a `0.0.0.0/32` pool, kube-vip-cloud-provider v0.0.12 `pkg/provider/loadBalancer.go`). Read
/// only while the Service has no ingress: afterwards the value is the address written for it.
fn user_kube_vip_ips(svc: &Service) -> Result<Vec<IpAddr>, BadAnnotation> {
    let has_ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .is_some_and(|i| i.iter().any(|i| i.ip.is_some()));
    let Some(value) = non_empty(svc, KUBE_VIP_IPS).filter(|_| !has_ingress) else {
        return Ok(Vec::new());
    };
    let ips = value
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| v.parse::<IpAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| {
            bad(
                KUBE_VIP_IPS,
                &value,
                "expected IP addresses separated by commas",
            )
        })?;
    Ok(if ips.iter().all(IpAddr::is_unspecified) {
        Vec::new()
    } else {
        ips
    })
}

impl ServiceLbSpec {
    /// The Service's input, with `pool` for a Service without `ipam` (upstream's default).
    pub fn from_service(svc: &Service) -> Result<ServiceLbSpec, BadAnnotation> {
        ServiceLbSpec::with_default_ipam(svc, Ipam::Pool)
    }

    /// The Service's input, with `default` (`--default-ipam`) for a Service without `ipam`.
    pub fn with_default_ipam(svc: &Service, default: Ipam) -> Result<ServiceLbSpec, BadAnnotation> {
        let ipam = match non_empty(svc, ANN_IPAM) {
            None => default,
            Some(v) => v
                .parse()
                .map_err(|reason: String| bad(ANN_IPAM, &v, reason))?,
        };
        let network = non_empty(svc, ANN_NETWORK);
        if let Some(n) = &network
            && n.split('/').count() > 2
        {
            return Err(bad(
                ANN_NETWORK,
                n,
                "expected <namespace>/<network> or <network>",
            ));
        }
        let own_ns = svc.namespace().unwrap_or_default();
        let primary = match non_empty(svc, ANN_PRIMARY_SERVICE) {
            Some(v) => {
                let key = parse_primary(&own_ns, &v)?;
                if key == ServiceKey::of(svc) {
                    return Err(bad(
                        ANN_PRIMARY_SERVICE,
                        &v,
                        "a Service cannot be its own primary",
                    ));
                }
                Some(key)
            }
            None => None,
        };
        let spec = svc.spec.as_ref();
        let requested_ip = match spec.and_then(|s| s.load_balancer_ip.as_deref()) {
            None | Some("") => None,
            Some(ip) => Some(
                ip.parse::<IpAddr>()
                    .map_err(|_| bad("spec.loadBalancerIP", ip, "not an IP address"))?,
            ),
        };
        let mut ports: Vec<PortKey> = spec
            .and_then(|s| s.ports.as_ref())
            .map(|ps| {
                ps.iter()
                    .map(|p| PortKey {
                        port: p.port,
                        protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                    })
                    .collect()
            })
            .unwrap_or_default();
        ports.sort();
        let kube_vip_ips = user_kube_vip_ips(svc)?;
        Ok(ServiceLbSpec {
            kube_vip_ips,
            ipam,
            network,
            project: non_empty(svc, ANN_PROJECT),
            namespace: non_empty(svc, ANN_NAMESPACE),
            primary,
            requested_ip,
            ports,
        })
    }

    /// The address the Service asks for: the first of a user's `kube-vip.io/loadbalancerIPs`,
    /// else `spec.loadBalancerIP` (kube-vip's order, `FetchServiceIPs`).
    pub fn requested(&self) -> Option<IpAddr> {
        self.kube_vip_ips.first().copied().or(self.requested_ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(annotations: serde_json::Value, spec: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "apps", "annotations": annotations},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn defaults_to_pool_without_annotations() {
        let s =
            ServiceLbSpec::from_service(&svc(json!({}), json!({"type": "LoadBalancer"}))).unwrap();
        assert_eq!(s.ipam, Ipam::Pool);
        assert_eq!((s.network, s.primary, s.requested_ip), (None, None, None));
    }

    #[test]
    fn reads_every_annotation() {
        let s = ServiceLbSpec::from_service(&svc(
            json!({ANN_IPAM: "dhcp", ANN_NETWORK: "default/vlan10", ANN_PROJECT: "c-1/p-1", ANN_NAMESPACE: "ns1"}),
            json!({"type": "LoadBalancer", "loadBalancerIP": "10.0.0.9",
                   "ports": [{"port": 80}, {"port": 53, "protocol": "UDP"}]}),
        ))
        .unwrap();
        assert_eq!(s.ipam, Ipam::Dhcp);
        assert_eq!(s.network.as_deref(), Some("default/vlan10"));
        assert_eq!(s.project.as_deref(), Some("c-1/p-1"));
        assert_eq!(s.namespace.as_deref(), Some("ns1"));
        assert_eq!(s.requested_ip, Some("10.0.0.9".parse().unwrap()));
        assert_eq!(
            s.ports,
            vec![
                PortKey {
                    port: 53,
                    protocol: "UDP".into()
                },
                PortKey {
                    port: 80,
                    protocol: "TCP".into()
                }
            ]
        );
    }

    #[test]
    fn rejects_bad_input_naming_the_key_and_value() {
        for (ann, spec, key, value) in [
            (json!({ANN_IPAM: "static"}), json!({}), ANN_IPAM, "static"),
            (
                json!({ANN_PRIMARY_SERVICE: "a/b/c"}),
                json!({}),
                ANN_PRIMARY_SERVICE,
                "a/b/c",
            ),
            (
                json!({ANN_PRIMARY_SERVICE: "Bad_Name"}),
                json!({}),
                ANN_PRIMARY_SERVICE,
                "Bad_Name",
            ),
            (
                json!({ANN_PRIMARY_SERVICE: "apps/web"}),
                json!({}),
                ANN_PRIMARY_SERVICE,
                "apps/web",
            ),
            (
                json!({ANN_NETWORK: "a/b/c"}),
                json!({}),
                ANN_NETWORK,
                "a/b/c",
            ),
            (
                json!({}),
                json!({"loadBalancerIP": "ten"}),
                "spec.loadBalancerIP",
                "ten",
            ),
        ] {
            let err = ServiceLbSpec::from_service(&svc(ann, spec)).unwrap_err();
            assert_eq!((err.key.as_str(), err.value.as_str()), (key, value));
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    #[test]
    fn the_requested_address_is_kube_vips_annotation_then_load_balancer_ip() {
        let spec = |ann, lb_ip: Option<&str>, status| {
            let mut s = svc(
                ann,
                json!({"type": "LoadBalancer", "loadBalancerIP": lb_ip}),
            );
            s.status = serde_json::from_value(status).unwrap();
            ServiceLbSpec::from_service(&s)
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let none = json!(null);
        let both = spec(
            json!({KUBE_VIP_IPS: " 10.0.0.8 , fd00::8"}),
            Some("10.0.0.9"),
            none.clone(),
        )
        .unwrap();
        assert_eq!(both.kube_vip_ips, vec![ip("10.0.0.8"), ip("fd00::8")]);
        assert_eq!(
            both.requested(),
            Some(ip("10.0.0.8")),
            "the annotation first"
        );
        let spec_only = spec(json!({}), Some("10.0.0.9"), none.clone()).unwrap();
        assert_eq!(spec_only.requested(), Some(ip("10.0.0.9")));
        let sentinel = spec(json!({KUBE_VIP_IPS: "0.0.0.0"}), None, none.clone()).unwrap();
        assert_eq!(
            sentinel.requested(),
            None,
            "kube-vip's DHCP sentinel asks for nothing"
        );
        let addressed = spec(
            json!({KUBE_VIP_IPS: "10.0.0.7"}),
            None,
            json!({"loadBalancer": {"ingress": [{"ip": "10.0.0.7"}]}}),
        )
        .unwrap();
        assert_eq!(addressed.requested(), None, "with an ingress it is ours");
        let err = spec(json!({KUBE_VIP_IPS: "10.0.0.1,lb.example"}), None, none).unwrap_err();
        assert_eq!(
            (err.key.as_str(), err.value.as_str()),
            (KUBE_VIP_IPS, "10.0.0.1,lb.example")
        );
    }

    #[test]
    fn ipam_comes_from_the_annotation_else_the_default() {
        let guest = svc(json!({ANN_IPAM: "guest"}), json!({}));
        assert_eq!(
            ServiceLbSpec::from_service(&guest).unwrap().ipam,
            Ipam::Guest
        );
        let plain = svc(json!({}), json!({}));
        for default in [Ipam::Pool, Ipam::Dhcp, Ipam::Guest] {
            let spec = ServiceLbSpec::with_default_ipam(&plain, default).unwrap();
            assert_eq!(spec.ipam, default);
            let spec = ServiceLbSpec::with_default_ipam(&guest, default).unwrap();
            assert_eq!(spec.ipam, Ipam::Guest, "the annotation wins");
        }
        let err =
            ServiceLbSpec::from_service(&svc(json!({ANN_IPAM: "static"}), json!({}))).unwrap_err();
        assert!(err.reason.contains("pool, dhcp or guest"), "{err}");
    }

    #[test]
    fn primary_accepts_namespaced_and_bare_names() {
        assert_eq!(
            parse_primary("apps", "infra/gw").unwrap(),
            ServiceKey {
                namespace: "infra".into(),
                name: "gw".into()
            }
        );
        assert_eq!(
            parse_primary("apps", "gw").unwrap(),
            ServiceKey {
                namespace: "apps".into(),
                name: "gw".into()
            }
        );
        assert_eq!(
            parse_primary("apps", "gw").unwrap().label_value(),
            "apps.gw"
        );
    }
}

#[cfg(test)]
mod proptests;
