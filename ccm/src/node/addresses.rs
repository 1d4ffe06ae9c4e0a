//! Node addresses from a VMI, by upstream's rules (harvester-ccm-contract §2.3). Pure.
//!
//! 1. Pick the NIC: only Multus networks count; `--management-network` picks the first network of
//!    that name, otherwise the first Multus network.
//! 2. Read the NIC's IPs from `vmi.status.interfaces` (`ipAddresses`, else `ipAddress`). They are
//!    reported by qemu-guest-agent in the guest.
//! 3. Drop loopback, link-local, multicast, unspecified and broadcast addresses.
//! 4. Choose InternalIPs (at most one per family), in this order of precedence:
//!    the Node annotation `alpha.kubernetes.io/provided-node-ip` (kubelet `--node-ip`), else
//!    `--node-ip-cidr`, else the first address of each family. The others are ExternalIPs, minus
//!    those listed in `cloudprovider.harvesterhci.io/additional-internal-ips` and, with
//!    `--node-ip-cidr`, minus those inside `--node-exclude-ip-ranges`.
//! 5. Append `Hostname: <node name>`.
//!
//! Fixed against upstream: a dual-stack `provided-node-ip` (`"10.0.0.5,fd00::5"`) matches both
//! addresses (upstream compares the whole string and matches nothing); addresses are compared as
//! IPs, not strings; the additional-internal-ips annotation applies in every mode.

use std::collections::BTreeMap;
use std::net::IpAddr;

use harvester_common::harvester::VirtualMachineInstance;
use k8s_openapi::api::core::v1::NodeAddress;

use crate::config::addresses::{AddressError, AddressRules, PROVIDED_NODE_IP, unusable};
use crate::network::NetworkName;

/// Node annotation: JSON array of IPs that must not be reported as ExternalIPs.
pub const ADDITIONAL_INTERNAL_IPS: &str = "cloudprovider.harvesterhci.io/additional-internal-ips";

/// The addresses of the Node `node_name` (with `annotations`) run by `vmi`.
pub fn node_addresses(
    node_name: &str,
    annotations: &BTreeMap<String, String>,
    vmi: &VirtualMachineInstance,
    rules: &AddressRules,
) -> Result<Vec<NodeAddress>, AddressError> {
    let (interface, network) = pick_nic(vmi, rules.management_network.as_ref())?;
    let reported = reported_ips(vmi, &interface);
    if reported.is_empty() {
        return Err(AddressError::NoGuestAgentAddresses { interface, network });
    }
    let mut ips: Vec<IpAddr> = Vec::new();
    for raw in &reported {
        // Tolerate "ip/prefix"; drop what does not parse or cannot be a node address.
        let text = raw.split('/').next().unwrap_or_default().trim();
        if let Ok(ip) = text.parse::<IpAddr>()
            && unusable(ip).is_none()
            && !ips.contains(&ip)
        {
            ips.push(ip);
        }
    }
    if ips.is_empty() {
        return Err(AddressError::NoUsableAddress {
            interface,
            reported: reported.join(", "),
        });
    }

    let (provided, extra_internal) = if rules.use_node_annotations {
        (
            provided_ips(annotations)?,
            additional_internal_ips(annotations)?,
        )
    } else {
        (None, Vec::new())
    };

    let internal: Vec<IpAddr> = match provided {
        Some(provided) => {
            let mut chosen = Vec::new();
            for p in provided {
                if !ips.contains(&p) {
                    return Err(AddressError::ProvidedIpNotFound {
                        ip: p,
                        found: join(&ips),
                    });
                }
                chosen.push(p);
            }
            chosen
        }
        None if !rules.node_ip_cidr.is_empty() => {
            let chosen = first_per_family(
                ips.iter()
                    .copied()
                    .filter(|ip| rules.node_ip_cidr.iter().any(|n| n.contains(*ip))),
            );
            if chosen.is_empty() {
                return Err(AddressError::NothingInNodeIpCidr {
                    found: join(&ips),
                    cidrs: join(&rules.node_ip_cidr),
                });
            }
            chosen
        }
        None => first_per_family(ips.iter().copied()),
    };

    let cidr_mode = !rules.node_ip_cidr.is_empty() && !matches_provided(annotations, rules);
    let not_external = |ip: &IpAddr| {
        internal.contains(ip)
            || extra_internal.contains(ip)
            || (cidr_mode && rules.exclude_ranges.iter().any(|n| n.contains(*ip)))
    };
    let external = ips.iter().copied().filter(|ip| !not_external(ip));

    let mut out: Vec<NodeAddress> = internal
        .iter()
        .map(|ip| address("InternalIP", ip.to_string()))
        .collect();
    out.extend(external.map(|ip| address("ExternalIP", ip.to_string())));
    out.push(address("Hostname", node_name.to_string()));
    Ok(out)
}

/// The NIC (VMI network name) and its Multus network.
fn pick_nic(
    vmi: &VirtualMachineInstance,
    management: Option<&NetworkName>,
) -> Result<(String, String), AddressError> {
    let namespace = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let multus: Vec<(&str, &str)> = vmi
        .spec
        .networks
        .iter()
        .filter_map(|n| Some((n.name.as_str(), n.multus.as_ref()?.network_name.as_str())))
        .collect();
    let picked = match management {
        Some(wanted) => multus.iter().find(|(_, raw)| {
            // A bare networkName on a VMI means the VMI's namespace (KubeVirt semantics).
            *raw == wanted.to_string()
                || NetworkName::parse_in(raw, namespace).is_ok_and(|n| &n == wanted)
        }),
        None => multus.first(),
    };
    match (picked, management) {
        (Some((iface, net)), _) => Ok((iface.to_string(), net.to_string())),
        (None, Some(wanted)) => Err(AddressError::ManagementNetworkNotFound {
            network: wanted.to_string(),
            available: multus
                .iter()
                .map(|(_, n)| *n)
                .collect::<Vec<_>>()
                .join(", "),
        }),
        (None, None) => Err(AddressError::NoMultusNetwork),
    }
}

fn reported_ips(vmi: &VirtualMachineInstance, interface: &str) -> Vec<String> {
    let Some(status) = vmi.status.as_ref() else {
        return Vec::new();
    };
    let Some(i) = status.interfaces.iter().find(|i| i.name == interface) else {
        return Vec::new();
    };
    if !i.ip_addresses.is_empty() {
        i.ip_addresses.clone()
    } else {
        i.ip_address.iter().cloned().collect()
    }
}

fn matches_provided(annotations: &BTreeMap<String, String>, rules: &AddressRules) -> bool {
    rules.use_node_annotations
        && annotations
            .get(PROVIDED_NODE_IP)
            .is_some_and(|v| !v.trim().is_empty())
}

/// `provided-node-ip`: one address, or two of different families separated by a comma.
fn provided_ips(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<Vec<IpAddr>>, AddressError> {
    let Some(value) = annotations.get(PROVIDED_NODE_IP) else {
        return Ok(None);
    };
    if value.trim().is_empty() {
        return Ok(None);
    }
    let bad = |reason: String| AddressError::BadAnnotation {
        key: PROVIDED_NODE_IP,
        value: value.clone(),
        reason,
    };
    let mut ips: Vec<IpAddr> = Vec::new();
    for part in value.split(',').map(str::trim) {
        let ip: IpAddr = part
            .parse()
            .map_err(|_| bad(format!("{part:?} is not an IP address")))?;
        if ips.iter().any(|o| o.is_ipv4() == ip.is_ipv4()) {
            return Err(bad("at most one address per IP family".into()));
        }
        ips.push(ip);
    }
    Ok(Some(ips))
}

/// `additional-internal-ips`: a JSON array of IP strings.
fn additional_internal_ips(
    annotations: &BTreeMap<String, String>,
) -> Result<Vec<IpAddr>, AddressError> {
    let Some(value) = annotations.get(ADDITIONAL_INTERNAL_IPS) else {
        return Ok(Vec::new());
    };
    let bad = |reason: String| AddressError::BadAnnotation {
        key: ADDITIONAL_INTERNAL_IPS,
        value: value.clone(),
        reason,
    };
    let list: Vec<String> = serde_json::from_str(value)
        .map_err(|e| bad(format!("not a JSON array of IP strings: {e}")))?;
    list.iter()
        .map(|s| {
            s.trim()
                .parse::<IpAddr>()
                .map_err(|_| bad(format!("{s:?} is not an IP address")))
        })
        .collect()
}

fn first_per_family(ips: impl Iterator<Item = IpAddr>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in ips {
        if !out.iter().any(|o| o.is_ipv4() == ip.is_ipv4()) {
            out.push(ip);
        }
    }
    out
}

fn join<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn address(type_: &str, address: String) -> NodeAddress {
    NodeAddress {
        address,
        type_: type_.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::addresses::parse_prefix;
    use ipnetwork::IpNetwork;
    use serde_json::json;

    /// A VMI with one Multus NIC `nic-1` on `default/mgmt` reporting `ips`, plus extra networks.
    fn vmi(ips: &[&str]) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "w1", "namespace": "guest-vms"},
            "spec": {"networks": [
                {"name": "default", "pod": {}},
                {"name": "nic-1", "multus": {"networkName": "default/mgmt"}},
                {"name": "nic-2", "multus": {"networkName": "storage"}}
            ]},
            "status": {"interfaces": [
                {"name": "default", "ipAddress": "10.244.0.9", "ipAddresses": ["10.244.0.9"]},
                {"name": "nic-1", "ipAddresses": ips},
                {"name": "nic-2", "ipAddress": "172.16.0.9", "ipAddresses": ["172.16.0.9"]}
            ]}
        }))
        .expect("test VMI")
    }

    fn rules() -> AddressRules {
        AddressRules {
            use_node_annotations: true,
            ..Default::default()
        }
    }

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Addresses as "Type=addr" strings, Hostname last.
    fn run(
        ips: &[&str],
        annotations: &[(&str, &str)],
        rules: &AddressRules,
    ) -> Result<Vec<String>, AddressError> {
        node_addresses("w1", &ann(annotations), &vmi(ips), rules).map(|v| {
            v.into_iter()
                .map(|a| format!("{}={}", a.type_, a.address))
                .collect()
        })
    }

    fn cidr(list: &[&str]) -> Vec<IpNetwork> {
        list.iter()
            .map(|s| parse_prefix(s).expect("test prefix"))
            .collect()
    }

    /// (what, reported IPs, Node annotations, rules, expected addresses)
    type Row<'a> = (
        &'a str,
        &'a [&'a str],
        Vec<(&'a str, &'a str)>,
        &'a AddressRules,
        Vec<&'a str>,
    );

    #[test]
    fn address_rules() {
        let base = rules();
        let cidr_rules = AddressRules {
            node_ip_cidr: cidr(&["10.0.0.0/24", "fd00::/64"]),
            exclude_ranges: cidr(&["192.168.5.0/24"]),
            ..rules()
        };
        let no_annotations = AddressRules {
            use_node_annotations: false,
            ..rules()
        };
        let dual = ["192.168.5.5", "10.0.0.5", "fd00::5", "2001:db8::5"];
        #[rustfmt::skip]
        let table: Vec<Row> = vec![
            ("fallback: first of each family internal, rest external, hostname last",
             &dual, vec![], &base,
             vec!["InternalIP=192.168.5.5", "InternalIP=fd00::5", "ExternalIP=10.0.0.5", "ExternalIP=2001:db8::5", "Hostname=w1"]),
            ("single IPv4",
             &["10.52.0.11"], vec![], &base,
             vec!["InternalIP=10.52.0.11", "Hostname=w1"]),
            ("link-local, loopback, multicast, unspecified, broadcast and garbage are dropped",
             &["169.254.1.1", "127.0.0.1", "fe80::1", "::1", "224.0.0.1", "0.0.0.0", "255.255.255.255", "not-an-ip", "10.0.0.7"], vec![], &base,
             vec!["InternalIP=10.0.0.7", "Hostname=w1"]),
            ("ip/prefix forms are read as the address",
             &["10.0.0.7/24"], vec![], &base,
             vec!["InternalIP=10.0.0.7", "Hostname=w1"]),
            ("duplicates reported once",
             &["10.0.0.7", "10.0.0.7"], vec![], &base,
             vec!["InternalIP=10.0.0.7", "Hostname=w1"]),
            ("provided-node-ip picks the InternalIP",
             &dual, vec![(PROVIDED_NODE_IP, "10.0.0.5")], &base,
             vec!["InternalIP=10.0.0.5", "ExternalIP=192.168.5.5", "ExternalIP=fd00::5", "ExternalIP=2001:db8::5", "Hostname=w1"]),
            ("provided-node-ip dual stack matches both (upstream matched nothing)",
             &dual, vec![(PROVIDED_NODE_IP, "2001:db8::5, 10.0.0.5")], &base,
             vec!["InternalIP=2001:db8::5", "InternalIP=10.0.0.5", "ExternalIP=192.168.5.5", "ExternalIP=fd00::5", "Hostname=w1"]),
            ("provided-node-ip compared as an IP, not as a string",
             &["fd00:0:0:0::5"], vec![(PROVIDED_NODE_IP, "fd00::5")], &base,
             vec!["InternalIP=fd00::5", "Hostname=w1"]),
            ("provided-node-ip beats --node-ip-cidr",
             &dual, vec![(PROVIDED_NODE_IP, "192.168.5.5")], &cidr_rules,
             vec!["InternalIP=192.168.5.5", "ExternalIP=10.0.0.5", "ExternalIP=fd00::5", "ExternalIP=2001:db8::5", "Hostname=w1"]),
            ("additional-internal-ips hides those ExternalIPs",
             &dual, vec![(ADDITIONAL_INTERNAL_IPS, r#"["10.0.0.5","2001:db8::5"]"#)], &base,
             vec!["InternalIP=192.168.5.5", "InternalIP=fd00::5", "Hostname=w1"]),
            ("additional-internal-ips with provided-node-ip",
             &dual, vec![(PROVIDED_NODE_IP, "10.0.0.5"), (ADDITIONAL_INTERNAL_IPS, r#"["192.168.5.5"]"#)], &base,
             vec!["InternalIP=10.0.0.5", "ExternalIP=fd00::5", "ExternalIP=2001:db8::5", "Hostname=w1"]),
            ("--node-ip-cidr picks one per family inside, excludes drop ExternalIPs",
             &dual, vec![], &cidr_rules,
             vec!["InternalIP=10.0.0.5", "InternalIP=fd00::5", "ExternalIP=2001:db8::5", "Hostname=w1"]),
            ("--node-ip-cidr with only an IPv4 match",
             &["192.168.5.5", "10.0.0.5", "2001:db8::5"], vec![], &cidr_rules,
             vec!["InternalIP=10.0.0.5", "ExternalIP=2001:db8::5", "Hostname=w1"]),
            ("disabled annotations are ignored, even malformed ones",
             &dual, vec![(PROVIDED_NODE_IP, "10.0.0.5"), (ADDITIONAL_INTERNAL_IPS, "nope")], &no_annotations,
             vec!["InternalIP=192.168.5.5", "InternalIP=fd00::5", "ExternalIP=10.0.0.5", "ExternalIP=2001:db8::5", "Hostname=w1"]),
        ];
        for (what, ips, annotations, rules, want) in table {
            let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
            assert_eq!(run(ips, &annotations, rules), Ok(want), "{what}");
        }
    }

    #[test]
    fn address_failures() {
        let base = rules();
        let cidr_rules = AddressRules {
            node_ip_cidr: cidr(&["10.9.0.0/16"]),
            ..rules()
        };
        let check =
            |what: &str, got: Result<Vec<String>, AddressError>, reason: &str, says: &[&str]| {
                let err = got.expect_err(what);
                assert_eq!(err.reason(), reason, "{what}");
                let text = err.to_string();
                for s in says {
                    assert!(text.contains(s), "{what}: {text:?} should say {s:?}");
                }
            };
        check(
            "no IPs: explain qemu-guest-agent",
            run(&[], &[], &base),
            "NoGuestAgentAddresses",
            &["qemu-guest-agent", "v0.6.3", "cloud-init", "nic-1"],
        );
        check(
            "only link-local",
            run(&["169.254.3.3", "fe80::3"], &[], &base),
            "NoUsableAddress",
            &["169.254.3.3", "fe80::3"],
        );
        check(
            "provided IP missing",
            run(&["10.0.0.5"], &[(PROVIDED_NODE_IP, "10.0.0.6")], &base),
            "ProvidedNodeIPNotFound",
            &["10.0.0.6", "10.0.0.5"],
        );
        check(
            "provided IP malformed",
            run(&["10.0.0.5"], &[(PROVIDED_NODE_IP, "10.0.0.x")], &base),
            "BadAnnotation",
            &[PROVIDED_NODE_IP, "10.0.0.x"],
        );
        check(
            "provided IPs of one family",
            run(
                &["10.0.0.5"],
                &[(PROVIDED_NODE_IP, "10.0.0.5,10.0.0.6")],
                &base,
            ),
            "BadAnnotation",
            &[PROVIDED_NODE_IP],
        );
        check(
            "additional-internal-ips not JSON",
            run(
                &["10.0.0.5"],
                &[(ADDITIONAL_INTERNAL_IPS, "10.0.0.5")],
                &base,
            ),
            "BadAnnotation",
            &[ADDITIONAL_INTERNAL_IPS, "10.0.0.5"],
        );
        check(
            "additional-internal-ips bad entry",
            run(
                &["10.0.0.5"],
                &[(ADDITIONAL_INTERNAL_IPS, r#"["x"]"#)],
                &base,
            ),
            "BadAnnotation",
            &[ADDITIONAL_INTERNAL_IPS, "\"x\""],
        );
        check(
            "nothing inside --node-ip-cidr",
            run(&["10.0.0.5"], &[], &cidr_rules),
            "NoAddressInNodeIPCIDR",
            &["10.0.0.5", "10.9.0.0/16"],
        );
    }

    #[test]
    fn nic_selection() {
        let pick = |management: Option<&str>| {
            let rules = AddressRules {
                management_network: management.map(|m| NetworkName::parse(m).expect("name")),
                ..rules()
            };
            node_addresses("w1", &BTreeMap::new(), &vmi(&["10.0.0.5"]), &rules)
                .map(|a| a[0].address.clone())
        };
        // Without --management-network: the first Multus NIC, never the pod network.
        assert_eq!(pick(None).as_deref(), Ok("10.0.0.5"));
        assert_eq!(pick(Some("default/mgmt")).as_deref(), Ok("10.0.0.5"));
        assert_eq!(
            pick(Some("mgmt")).as_deref(),
            Ok("10.0.0.5"),
            "bare name means default/"
        );
        // A bare networkName on the VMI is in the VMI's namespace.
        assert_eq!(pick(Some("guest-vms/storage")).as_deref(), Ok("172.16.0.9"));
        let err = pick(Some("default/other")).expect_err("no such network");
        assert_eq!(err.reason(), "ManagementNetworkNotFound");
        assert!(err.to_string().contains("default/other"), "{err}");

        let mut pod_only = vmi(&["10.0.0.5"]);
        pod_only.spec.networks.retain(|n| n.multus.is_none());
        let err =
            node_addresses("w1", &BTreeMap::new(), &pod_only, &rules()).expect_err("pod only");
        assert_eq!(err, AddressError::NoMultusNetwork);
    }

    #[test]
    fn single_ip_address_field_is_a_fallback() {
        let mut v = vmi(&[]);
        if let Some(s) = v.status.as_mut() {
            s.interfaces[1].ip_address = Some("10.0.0.8".into());
        }
        let got = node_addresses("w1", &BTreeMap::new(), &v, &rules()).expect("addresses");
        assert_eq!(got[0].address, "10.0.0.8");
    }
}
