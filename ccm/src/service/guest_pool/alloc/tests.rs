//! Allocation rules, one row each, and properties over random pools and used sets.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::service::guest_pool::PoolConfig;

fn pool(key: &str, value: &str) -> Pool {
    let data = BTreeMap::from([(key.to_string(), value.to_string())]);
    PoolConfig::parse(&data).pool_for("ns").unwrap().clone()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn svc(name: &str) -> ServiceKey {
    ServiceKey {
        namespace: "ns".into(),
        name: name.into(),
    }
}

fn used(pairs: &[(&str, &str)]) -> BTreeMap<IpAddr, ServiceKey> {
    pairs.iter().map(|(a, s)| (ip(a), svc(s))).collect()
}

fn req() -> Request {
    Request::default()
}

#[test]
fn the_first_free_address_in_order_skipping_ipv4_ends() {
    let p = pool("range-ns", "10.0.0.254-10.0.1.3");
    let d = allocate(&p, false, &req(), &used(&[]));
    assert_eq!(
        d,
        Decision {
            ip: Some(ip("10.0.0.254")),
            problem: None
        }
    );
    let d = allocate(&p, false, &req(), &used(&[("10.0.0.254", "a")]));
    assert_eq!(d.ip, Some(ip("10.0.1.1")), ".255 and .0 are skipped");
    let d = allocate(&p, true, &req(), &used(&[]));
    assert_eq!(d.ip, Some(ip("10.0.1.3")), "search-order desc");
}

#[test]
fn exhausted_is_a_problem_and_no_address() {
    let p = pool("range-ns", "10.0.0.1-10.0.0.2");
    let d = allocate(
        &p,
        false,
        &req(),
        &used(&[("10.0.0.1", "a"), ("10.0.0.2", "b")]),
    );
    assert_eq!(d.ip, None);
    assert_eq!(
        d.problem.as_ref().map(GuestProblem::reason),
        Some("GuestPoolExhausted")
    );
}

#[test]
fn a_service_keeps_its_address() {
    let p = pool("range-ns", "10.0.0.1-10.0.0.9");
    let r = Request {
        current: Some(ip("10.0.0.5")),
        ..req()
    };
    assert_eq!(allocate(&p, false, &r, &used(&[])).ip, Some(ip("10.0.0.5")));
}

#[test]
fn an_address_outside_the_pool_is_replaced() {
    let p = pool("range-ns", "10.0.0.1-10.0.0.9");
    let from_harvester = Request {
        current: Some(ip("192.168.50.10")),
        ..req()
    };
    assert_eq!(
        allocate(&p, false, &from_harvester, &used(&[])).ip,
        Some(ip("10.0.0.1"))
    );
    let refused = Request {
        requested: Some(ip("10.9.9.9")),
        ..from_harvester
    };
    assert_eq!(
        allocate(&p, false, &refused, &used(&[])).ip,
        None,
        "a refused request does not keep an address outside the pool"
    );
}

#[test]
fn a_requested_address_is_given_when_free_and_inside() {
    let p = pool("range-ns", "10.0.0.1-10.0.0.9");
    let r = Request {
        requested: Some(ip("10.0.0.7")),
        ..req()
    };
    assert_eq!(
        allocate(&p, false, &r, &used(&[])),
        Decision {
            ip: Some(ip("10.0.0.7")),
            problem: None
        }
    );
}

#[test]
fn a_requested_address_outside_or_taken_is_a_problem_and_no_other_address() {
    let p = pool("range-ns", "10.0.0.1-10.0.0.9");
    let outside = Request {
        requested: Some(ip("10.0.9.9")),
        ..req()
    };
    let d = allocate(&p, false, &outside, &used(&[]));
    assert_eq!(d.ip, None);
    assert!(matches!(
        d.problem,
        Some(GuestProblem::RequestedOutside { .. })
    ));
    let taken = Request {
        requested: Some(ip("10.0.0.3")),
        ..req()
    };
    let d = allocate(&p, false, &taken, &used(&[("10.0.0.3", "other")]));
    assert_eq!(d.ip, None);
    assert_eq!(
        d.problem,
        Some(GuestProblem::RequestedTaken {
            requested: ip("10.0.0.3"),
            holder: "ns/other".into()
        })
    );
    // With an address already, a refused request keeps it.
    let moving = Request {
        current: Some(ip("10.0.0.1")),
        ..taken
    };
    let d = allocate(&p, false, &moving, &used(&[("10.0.0.3", "other")]));
    assert_eq!(d.ip, Some(ip("10.0.0.1")));
    assert!(d.problem.is_some());
}

#[test]
fn a_new_request_moves_an_addressed_service_when_free() {
    let p = pool("range-ns", "10.0.0.1-10.0.0.9");
    let r = Request {
        current: Some(ip("10.0.0.1")),
        requested: Some(ip("10.0.0.4")),
        ..req()
    };
    assert_eq!(allocate(&p, false, &r, &used(&[])).ip, Some(ip("10.0.0.4")));
}

#[test]
fn the_family_follows_ip_families_else_ipv4_first() {
    let p = pool("cidr-ns", "10.0.0.8/30,fd00::8/126");
    assert_eq!(
        allocate(&p, false, &req(), &used(&[])).ip,
        Some(ip("10.0.0.8"))
    );
    let v6 = Request {
        family: Some(Family::V6),
        ..req()
    };
    assert_eq!(allocate(&p, false, &v6, &used(&[])).ip, Some(ip("fd00::8")));
    let only6 = pool("cidr-ns", "fd00::8/126");
    assert_eq!(
        allocate(&only6, false, &req(), &used(&[])).ip,
        Some(ip("fd00::8"))
    );
    let v4_of_v6_pool = Request {
        family: Some(Family::V4),
        ..req()
    };
    assert_eq!(allocate(&only6, false, &v4_of_v6_pool, &used(&[])).ip, None);
}

#[test]
fn the_ledger_never_gives_one_address_twice_and_wakes_waiters_on_release() {
    let ledger = Ledger::default();
    let p = pool("range-ns", "10.0.0.1-10.0.0.2");
    // Two Services decided before the cache shows either write.
    let a = ledger.decide(&svc("a"), &p, false, req(), BTreeMap::new());
    let b = ledger.decide(&svc("b"), &p, false, req(), BTreeMap::new());
    assert_eq!((a.ip, b.ip), (Some(ip("10.0.0.1")), Some(ip("10.0.0.2"))));
    // a again (its write failed): the same address.
    let again = ledger.decide(&svc("a"), &p, false, req(), BTreeMap::new());
    assert_eq!(again.ip, Some(ip("10.0.0.1")));
    let c = ledger.decide(&svc("c"), &p, false, req(), BTreeMap::new());
    assert_eq!(c.ip, None);
    assert_eq!(
        ledger.release(&svc("a")),
        vec![svc("c")],
        "c waits and is woken"
    );
    // The cache still shows a's address for a moment: released, it counts as free.
    let c = ledger.decide(
        &svc("c"),
        &p,
        false,
        req(),
        used(&[("10.0.0.1", "a"), ("10.0.0.2", "b")]),
    );
    assert_eq!(c.ip, Some(ip("10.0.0.1")));
    assert!(
        ledger.forget(&svc("x")).is_empty(),
        "x held nothing: nobody woken"
    );
    assert!(
        ledger.release(&svc("b")).is_empty(),
        "nobody waits any more"
    );
    ledger.retain(|k| k.name != "c");
    let d = ledger.decide(&svc("d"), &p, false, req(), BTreeMap::new());
    assert_eq!(d.ip, Some(ip("10.0.0.1")), "c's reservation went with c");
}

proptest! {
    /// Whatever the pool, the used set and the order: an address given is inside the pool, not
    /// used by another, not an IPv4 .0/.255 unless asked for; none is given only when the pool
    /// has no other free address (or the request was refused).
    #[test]
    fn allocation_is_inside_free_and_only_empty_when_exhausted(
        start in 0u32..600, len in 0u32..40, taken in proptest::collection::btree_set(0u32..700, 0..60),
        descending: bool,
    ) {
        let first = std::net::Ipv4Addr::from(0x0a00_0000 + start);
        let last = std::net::Ipv4Addr::from(0x0a00_0000 + start + len);
        let p = pool("range-ns", &format!("{first}-{last}"));
        let used: BTreeMap<IpAddr, ServiceKey> = taken
            .iter()
            .map(|n| (IpAddr::V4((0x0a00_0000 + n).into()), svc(&n.to_string())))
            .collect();
        let d = allocate(&p, descending, &req(), &used);
        let candidates: BTreeSet<IpAddr> = (start..=start + len)
            .map(|n| IpAddr::V4((0x0a00_0000 + n).into()))
            .filter(|ip| !used.contains_key(ip))
            .filter(|ip| !matches!(ip, IpAddr::V4(v4) if matches!(v4.octets()[3], 0 | 255)))
            .collect();
        match d.ip {
            Some(got) => {
                prop_assert!(candidates.contains(&got), "{got} not a free candidate");
                let want = if descending { candidates.last() } else { candidates.first() };
                prop_assert_eq!(Some(&got), want);
            }
            None => prop_assert!(candidates.is_empty()),
        }
    }

    /// Many Services deciding through one ledger with an empty cache never share an address.
    #[test]
    fn a_ledger_gives_distinct_addresses(n in 1usize..30, size in 1u32..20) {
        let ledger = Ledger::default();
        let p = pool("range-ns", &format!("10.0.0.1-10.0.0.{size}"));
        let mut given = BTreeSet::new();
        for i in 0..n {
            if let Some(ip) = ledger.decide(&svc(&i.to_string()), &p, false, req(), BTreeMap::new()).ip {
                prop_assert!(given.insert(ip), "{ip} twice");
            }
        }
        prop_assert_eq!(given.len(), n.min(size as usize));
    }
}
