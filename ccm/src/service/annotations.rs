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

/// How the address is obtained (`cloudprovider.harvesterhci.io/ipam`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ipam {
    Pool,
    Dhcp,
}

impl Ipam {
    pub fn as_str(self) -> &'static str {
        match self {
            Ipam::Pool => "pool",
            Ipam::Dhcp => "dhcp",
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

impl ServiceLbSpec {
    pub fn from_service(svc: &Service) -> Result<ServiceLbSpec, BadAnnotation> {
        let ipam = match non_empty(svc, ANN_IPAM).as_deref() {
            None | Some("pool") => Ipam::Pool,
            Some("dhcp") => Ipam::Dhcp,
            Some(other) => return Err(bad(ANN_IPAM, other, "must be pool or dhcp")),
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
        Ok(ServiceLbSpec {
            ipam,
            network,
            project: non_empty(svc, ANN_PROJECT),
            namespace: non_empty(svc, ANN_NAMESPACE),
            primary,
            requested_ip,
            ports,
        })
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
