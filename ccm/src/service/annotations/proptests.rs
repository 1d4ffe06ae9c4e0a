//! Properties of the Service annotation parsers over random annotation values.
//!
//! The rules as the code implements them: annotation values are trimmed (Unicode whitespace) and
//! a blank value counts as absent; `ipam` is case-sensitive (`pool`, `dhcp` or `guest`); `network` has at
//! most one `/`; `primary-service` is `<namespace>/<name>` or `<name>` of lower-case DNS names;
//! `spec.loadBalancerIP` is not trimmed. Every error carries the key and the (trimmed) value.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use proptest::prelude::*;

use super::*;

const KEYS: [&str; 5] = [
    ANN_IPAM,
    ANN_NETWORK,
    ANN_PROJECT,
    ANN_NAMESPACE,
    ANN_PRIMARY_SERVICE,
];

fn service(
    namespace: &str,
    name: &str,
    annotations: BTreeMap<String, String>,
    load_balancer_ip: Option<String>,
    ports: Vec<(i32, Option<String>)>,
) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            load_balancer_ip,
            ports: Some(
                ports
                    .into_iter()
                    .map(|(port, protocol)| ServicePort {
                        port,
                        protocol,
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn with(key: &str, value: &str) -> Service {
    service(
        "apps",
        "web",
        BTreeMap::from([(key.to_string(), value.to_string())]),
        None,
        vec![],
    )
}

/// A DNS-1123 label (namespaces, Service names).
fn label() -> impl Strategy<Value = String> {
    "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
}

/// Whitespace that `str::trim` removes, including non-ASCII.
fn ws() -> impl Strategy<Value = String> {
    "[ \t\n\r\u{a0}\u{2003}]{0,3}"
}

/// Values near the accepted ones as well as arbitrary text.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        Just("pool".to_string()),
        Just("dhcp".to_string()),
        "[ a-zA-Z0-9_./-]{0,20}",
        (ws(), "[a-z/]{0,12}", ws()).prop_map(|(a, v, b)| format!("{a}{v}{b}")),
    ]
}

fn ipam() -> impl Strategy<Value = Ipam> {
    prop_oneof![Just(Ipam::Pool), Just(Ipam::Dhcp), Just(Ipam::Guest)]
}

proptest! {
    /// Arbitrary annotation values and loadBalancerIP never panic; an error names one of the keys
    /// we read and the offending value, trimmed as parsed (loadBalancerIP as given), and its
    /// message shows both.
    #[test]
    fn any_values_parse_or_fail_naming_key_and_value(
        values in proptest::collection::vec(proptest::option::of(value()), KEYS.len()),
        lb_ip in proptest::option::of(value()),
        namespace in label(),
        name in label(),
    ) {
        let annotations: BTreeMap<String, String> = KEYS
            .iter()
            .zip(&values)
            .filter_map(|(k, v)| v.clone().map(|v| (k.to_string(), v)))
            .collect();
        let svc = service(&namespace, &name, annotations.clone(), lb_ip.clone(), vec![]);
        match ServiceLbSpec::from_service(&svc) {
            Ok(spec) => {
                let trimmed = |k: &str| {
                    annotations.get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
                };
                prop_assert_eq!(spec.network, trimmed(ANN_NETWORK));
                prop_assert_eq!(spec.project, trimmed(ANN_PROJECT));
                prop_assert_eq!(spec.namespace, trimmed(ANN_NAMESPACE));
                prop_assert_eq!(spec.primary.is_some(), trimmed(ANN_PRIMARY_SERVICE).is_some());
                prop_assert_eq!(spec.requested_ip.is_some(), lb_ip.is_some_and(|ip| !ip.is_empty()));
            }
            Err(e) => {
                let given = if e.key == "spec.loadBalancerIP" {
                    lb_ip.clone()
                } else {
                    prop_assert!(KEYS.contains(&e.key.as_str()), "unknown key in {e:?}");
                    annotations.get(&e.key).map(|v| v.trim().to_string())
                };
                prop_assert_eq!(Some(e.value.clone()), given, "{:?}", e);
                let msg = e.to_string();
                prop_assert!(msg.contains(&e.key), "{msg}");
                prop_assert!(msg.contains(&format!("{:?}", e.value)), "{msg}");
                prop_assert!(!e.reason.is_empty());
            }
        }
    }

    /// `ipam` round-trips through its annotation string, whatever whitespace surrounds it.
    #[test]
    fn ipam_round_trips(ipam in ipam(), before in ws(), after in ws()) {
        let svc = with(ANN_IPAM, &format!("{before}{}{after}", ipam.as_str()));
        prop_assert_eq!(ServiceLbSpec::from_service(&svc).unwrap().ipam, ipam);
    }

    /// A blank `ipam` is the default, `pool`.
    #[test]
    fn blank_ipam_is_pool(blank in ws()) {
        prop_assert_eq!(ServiceLbSpec::from_service(&with(ANN_IPAM, &blank)).unwrap().ipam, Ipam::Pool);
    }

    /// `ipam` is case-sensitive: `Pool`, `DHCP`, ... are errors naming the key and value.
    #[test]
    fn ipam_is_case_sensitive(ipam in ipam(), upper in proptest::collection::vec(any::<bool>(), 4)) {
        prop_assume!(upper.iter().any(|u| *u));
        let value: String = ipam
            .as_str()
            .chars()
            .zip(&upper)
            .map(|(c, u)| if *u { c.to_ascii_uppercase() } else { c })
            .collect();
        let e = ServiceLbSpec::from_service(&with(ANN_IPAM, &value)).unwrap_err();
        prop_assert_eq!((e.key.as_str(), e.value.as_str()), (ANN_IPAM, value.as_str()));
    }

    /// Any other non-blank `ipam` is an error naming the key and the trimmed value.
    #[test]
    fn unknown_ipam_is_an_error(value in any::<String>()) {
        let trimmed = value.trim();
        prop_assume!(!["", "pool", "dhcp", "guest"].contains(&trimmed));
        let e = ServiceLbSpec::from_service(&with(ANN_IPAM, &value)).unwrap_err();
        prop_assert_eq!((e.key.as_str(), e.value.as_str()), (ANN_IPAM, trimmed));
    }

    /// `network` is kept (trimmed) with at most one `/`, an error with more.
    #[test]
    fn network_has_at_most_one_slash(parts in proptest::collection::vec("[a-z0-9-]{0,8}", 1..5), before in ws(), after in ws()) {
        let network = parts.join("/");
        let r = ServiceLbSpec::from_service(&with(ANN_NETWORK, &format!("{before}{network}{after}")));
        if network.is_empty() {
            prop_assert_eq!(r.unwrap().network, None);
        } else if parts.len() <= 2 {
            prop_assert_eq!(r.unwrap().network, Some(network));
        } else {
            let e = r.unwrap_err();
            prop_assert_eq!((e.key.as_str(), e.value.as_str()), (ANN_NETWORK, network.as_str()));
        }
    }

    /// `project` and `namespace` are free text: any value is kept trimmed, a blank one is absent.
    #[test]
    fn free_text_annotations_are_trimmed(value in any::<String>(), ns_too in any::<bool>()) {
        let key = if ns_too { ANN_NAMESPACE } else { ANN_PROJECT };
        let spec = ServiceLbSpec::from_service(&with(key, &value)).unwrap();
        let got = if ns_too { spec.namespace } else { spec.project };
        let want = Some(value.trim().to_string()).filter(|v| !v.is_empty());
        prop_assert_eq!(got, want);
    }

    /// A primary round-trips: `<ns>/<name>` or, in the Service's own namespace, a bare `<name>`,
    /// with any surrounding whitespace; its label value is `<ns>.<name>`.
    #[test]
    fn primary_round_trips(
        own in label(),
        namespace in label(),
        name in label(),
        bare in any::<bool>(),
        before in ws(),
        after in ws(),
    ) {
        let want = ServiceKey { namespace: namespace.clone(), name: name.clone() };
        let rendered = if bare && namespace == own {
            name.clone()
        } else {
            format!("{namespace}/{name}")
        };
        let value = format!("{before}{rendered}{after}");
        prop_assert_eq!(parse_primary(&own, &value).unwrap(), want.clone());
        prop_assert_eq!(want.label_value(), format!("{namespace}.{name}"));
        let svc = service(&own, "self", BTreeMap::from([(ANN_PRIMARY_SERVICE.to_string(), value)]), None, vec![]);
        match ServiceLbSpec::from_service(&svc) {
            Ok(spec) => prop_assert_eq!(spec.primary, Some(want)),
            Err(e) => {
                prop_assert_eq!(&want, &ServiceKey { namespace: own, name: "self".into() });
                prop_assert_eq!((e.key.as_str(), e.value.as_str()), (ANN_PRIMARY_SERVICE, rendered.as_str()));
            }
        }
    }

    /// A primary value with upper case, `_`, an empty part or more than one `/` is an error
    /// naming the key and the trimmed value.
    #[test]
    fn malformed_primary_is_an_error(
        value in prop_oneof![
            "[a-z]{1,5}/[a-z]{1,5}/[a-z]{0,5}",
            "[a-z]{0,3}[A-Z_][a-z]{0,3}",
            "/[a-z]{1,5}",
            "[a-z]{1,5}/",
            "-[a-z]{1,5}",
            "[a-z]{1,5}-",
        ],
        before in ws(),
    ) {
        let e = parse_primary("apps", &format!("{before}{value}")).unwrap_err();
        prop_assert_eq!((e.key.as_str(), e.value.as_str()), (ANN_PRIMARY_SERVICE, value.as_str()));
        let e = ServiceLbSpec::from_service(&with(ANN_PRIMARY_SERVICE, &value)).unwrap_err();
        prop_assert_eq!(e.key.as_str(), ANN_PRIMARY_SERVICE);
    }

    /// `spec.loadBalancerIP` round-trips for every IPv4 and IPv6 address; empty is unset.
    #[test]
    fn requested_ip_round_trips(ip in any::<IpAddr>()) {
        let svc = service("apps", "web", BTreeMap::new(), Some(ip.to_string()), vec![]);
        prop_assert_eq!(ServiceLbSpec::from_service(&svc).unwrap().requested_ip, Some(ip));
        let svc = service("apps", "web", BTreeMap::new(), Some(String::new()), vec![]);
        prop_assert_eq!(ServiceLbSpec::from_service(&svc).unwrap().requested_ip, None);
    }

    /// `kube-vip.io/loadbalancerIPs` round-trips for any list of addresses with any blanks
    /// around them, while the Service has no ingress; `0.0.0.0` alone is no request.
    #[test]
    fn kube_vip_ips_round_trip(ips in proptest::collection::vec(any::<IpAddr>(), 1..4), before in ws(), after in ws()) {
        let text: Vec<String> = ips.iter().map(|ip| format!("{before}{ip}{after}")).collect();
        let annotations = BTreeMap::from([(KUBE_VIP_IPS.to_string(), text.join(","))]);
        let svc = service("apps", "web", annotations, None, vec![]);
        let spec = ServiceLbSpec::from_service(&svc).unwrap();
        if ips.iter().all(IpAddr::is_unspecified) {
            prop_assert_eq!(spec.requested(), None);
        } else {
            prop_assert_eq!(spec.kube_vip_ips, ips.clone());
            prop_assert_eq!(ServiceLbSpec::from_service(&svc).unwrap().requested(), Some(ips[0]));
        }
    }

    /// Ports come out sorted, each once per Service port, TCP when no protocol is given.
    #[test]
    fn ports_are_sorted_with_tcp_default(
        ports in proptest::collection::vec(
            (any::<i32>(), proptest::option::of(prop_oneof![Just("TCP"), Just("UDP"), Just("SCTP")])),
            0..8,
        ),
    ) {
        let ports: Vec<(i32, Option<String>)> =
            ports.into_iter().map(|(p, proto)| (p, proto.map(String::from))).collect();
        let svc = service("apps", "web", BTreeMap::new(), None, ports.clone());
        let mut want: Vec<PortKey> = ports
            .into_iter()
            .map(|(port, protocol)| PortKey { port, protocol: protocol.unwrap_or_else(|| "TCP".into()) })
            .collect();
        want.sort();
        prop_assert_eq!(ServiceLbSpec::from_service(&svc).unwrap().ports, want);
    }
}
