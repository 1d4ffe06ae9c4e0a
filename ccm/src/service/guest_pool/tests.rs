//! The ConfigMap format: one row per rule of kube-vip-cloud-provider's, and one per refusal.

use std::collections::BTreeMap;

use super::*;

fn config(pairs: &[(&str, &str)]) -> PoolConfig {
    let data: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    PoolConfig::parse(&data)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn bounds(pool: &Pool) -> Vec<(IpAddr, IpAddr)> {
    pool.spans
        .iter()
        .map(|s| (from_int(s.v6, s.first), from_int(s.v6, s.last)))
        .collect()
}

#[test]
fn a_namespace_pool_comes_before_the_global_one() {
    let c = config(&[
        ("range-global", "10.0.0.10-10.0.0.20"),
        ("cidr-apps", "10.0.1.0/29"),
    ]);
    assert_eq!(c.pool_for("apps").unwrap().key, "cidr-apps");
    assert_eq!(c.pool_for("other").unwrap().key, "range-global");
}

#[test]
fn cidr_is_taken_before_range_of_one_scope() {
    let c = config(&[
        ("range-apps", "10.0.2.1-10.0.2.5"),
        ("cidr-apps", "10.0.1.0/29"),
    ]);
    assert_eq!(c.pool_for("apps").unwrap().key, "cidr-apps");
}

#[test]
fn cidrs_and_ranges_become_merged_spans_of_both_families() {
    let c = config(&[
        ("cidr-global", "10.0.0.200/29, fd00::10/127,10.0.0.204/30"),
        ("range-apps", "10.0.1.10-10.0.1.12,10.0.1.13-10.0.1.14"),
    ]);
    let global = c.pool_for("x").unwrap();
    assert_eq!(
        bounds(global),
        vec![
            (ip("10.0.0.200"), ip("10.0.0.207")),
            (ip("fd00::10"), ip("fd00::11"))
        ]
    );
    assert!(global.contains(ip("10.0.0.207")) && !global.contains(ip("10.0.0.208")));
    assert_eq!(
        bounds(c.pool_for("apps").unwrap()),
        vec![(ip("10.0.1.10"), ip("10.0.1.14"))]
    );
}

#[test]
fn skip_end_ips_leaves_out_the_ends_of_ipv4_cidrs_only() {
    let c = config(&[
        ("cidr-global", "192.168.0.200/29,10.9.9.0/31,fd00::/126"),
        ("skip-end-ips-in-cidr", "true"),
    ]);
    assert_eq!(
        bounds(c.pool_for("x").unwrap()),
        vec![
            (ip("10.9.9.0"), ip("10.9.9.1")),
            (ip("192.168.0.201"), ip("192.168.0.206")),
            (ip("fd00::"), ip("fd00::3"))
        ]
    );
}

#[test]
fn interface_and_search_order_are_read() {
    let c = config(&[
        ("interface-global", "eth1"),
        ("interface-apps", "eth2"),
        ("search-order", "desc"),
    ]);
    assert!(c.descending);
    assert_eq!(c.interface_for("apps"), Some("eth2"));
    assert_eq!(c.interface_for("other"), Some("eth1"));
    assert!(!config(&[]).descending);
    assert_eq!(config(&[]).interface_for("apps"), None);
}

#[test]
fn no_pool_names_the_keys_looked_for() {
    let err = config(&[("cidr-other", "10.0.0.0/30")])
        .pool_for("apps")
        .unwrap_err();
    let text = err.to_string();
    for key in ["cidr-apps", "range-apps", "cidr-global", "range-global"] {
        assert!(text.contains(key), "{text}");
    }
    assert_eq!(err.reason(), "GuestPoolInvalid");
}

#[test]
fn bad_values_are_refused_naming_the_key_and_value() {
    for (key, value, why) in [
        ("cidr-apps", "10.0.0.0/33", "not a CIDR"),
        ("cidr-apps", "10.0.0.1", "not a CIDR"),
        ("cidr-apps", "0.0.0.0/32", "ipam: dhcp"),
        ("range-apps", "10.0.0.9", "not a range"),
        ("range-apps", "10.0.0.9-10.0.0.1", "ends before it starts"),
        ("range-apps", "10.0.0.1-fd00::1", "mixes IPv4 and IPv6"),
        ("range-apps", "10.0.0.1-ten", "not an IP address"),
        ("range-apps", " , ", "no address"),
    ] {
        let c = config(&[(key, value), ("range-global", "10.1.0.1-10.1.0.9")]);
        let err = c.pool_for("apps").unwrap_err();
        match &err {
            GuestProblem::InvalidPool {
                key: k,
                value: v,
                reason,
            } => {
                assert_eq!((k.as_str(), v.as_str()), (key, value));
                assert!(reason.contains(why), "{value}: {reason}");
            }
            other => panic!("{value}: {other:?}"),
        }
        assert!(err.to_string().contains(key) && err.to_string().contains(value));
        // Other namespaces keep their (global) pool.
        assert_eq!(c.pool_for("other").unwrap().key, "range-global");
    }
}

#[test]
fn a_namespace_pool_overlapping_another_is_refused_and_the_others_still_serve() {
    let c = config(&[
        ("cidr-global", "10.0.0.0/24"),
        ("range-apps", "10.0.0.100-10.0.0.110"),
        ("range-web", "10.0.1.1-10.0.1.9"),
        ("range-db", "10.0.1.5-10.0.1.20"),
    ]);
    let err = c.pool_for("apps").unwrap_err();
    assert_eq!(
        err,
        GuestProblem::Overlap {
            key: "range-apps".into(),
            value: "10.0.0.100-10.0.0.110".into(),
            other_key: "cidr-global".into(),
            other_value: "10.0.0.0/24".into(),
        }
    );
    assert!(err.to_string().contains("range-apps") && err.to_string().contains("cidr-global"));
    assert!(matches!(
        c.pool_for("web"),
        Err(GuestProblem::Overlap { .. })
    ));
    assert!(matches!(
        c.pool_for("db"),
        Err(GuestProblem::Overlap { .. })
    ));
    assert_eq!(c.pool_for("other").unwrap().key, "cidr-global");
    // Families never overlap each other.
    let c = config(&[("cidr-global", "10.0.0.0/24"), ("cidr-apps", "fd00::/120")]);
    assert_eq!(c.pool_for("apps").unwrap().key, "cidr-apps");
}
