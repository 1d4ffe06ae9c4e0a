//! Properties of the allocator over random pools and random allocate/release sequences.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use proptest::prelude::*;

use super::addr::{from_bits, to_bits};
use super::*;

/// One range inside its own /24 (IPv4) or /120 (IPv6) so ranges never overlap, as the webhook
/// guarantees. Offsets are host parts; the gateway is default, absent (/32) or explicit.
#[derive(Debug, Clone)]
struct RangeSpec {
    v6: bool,
    start: u8,
    end: u8,
    gateway: Option<u8>,
    single: bool,
}

impl RangeSpec {
    fn build(&self, slot: usize) -> Range {
        let (subnet, host) = match (self.v6, self.single) {
            (false, false) => (format!("10.0.{slot}.0/24"), format!("10.0.{slot}.")),
            (false, true) => (format!("10.0.{slot}.{}/32", self.start), String::new()),
            (true, false) => (format!("fd00:{slot}::/120"), format!("fd00:{slot}::")),
            (true, true) => (format!("fd00:{slot}::{:x}/128", self.start), String::new()),
        };
        if self.single {
            return Range::parse(&subnet, None, None, None).unwrap();
        }
        let addr = |n: u8| {
            if self.v6 {
                format!("{host}{n:x}")
            } else {
                format!("{host}{n}")
            }
        };
        let gw = self.gateway.map(addr);
        Range::parse(
            &subnet,
            Some(&addr(self.start)),
            Some(&addr(self.end)),
            gw.as_deref(),
        )
        .unwrap()
    }
}

fn range_spec() -> impl Strategy<Value = RangeSpec> {
    (
        any::<bool>(),
        1u8..=254,
        1u8..=254,
        proptest::option::of(1u8..=254),
        proptest::bool::weighted(0.15),
    )
        .prop_map(|(v6, a, b, gateway, single)| RangeSpec {
            v6,
            // keep ranges small so exhaustion happens often
            start: a,
            end: a.saturating_add(b % 12).min(254),
            gateway,
            single,
        })
}

fn ranges() -> impl Strategy<Value = Vec<Range>> {
    proptest::collection::vec(range_spec(), 1..4)
        .prop_map(|specs| specs.iter().enumerate().map(|(i, s)| s.build(i)).collect())
}

#[derive(Debug, Clone)]
enum Op {
    Allocate(u8),
    Release(u8),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(
        prop_oneof![
            3 => (0u8..24).prop_map(Op::Allocate),
            1 => (0u8..24).prop_map(Op::Release),
        ],
        1..120,
    )
}

fn id(n: u8) -> String {
    format!("default/lb-{n}")
}

/// The straightforward host-local order: every address of every range in order, rotated to start
/// just after `last`, gateways and allocated addresses skipped.
fn naive_next(ranges: &[Range], state: &PoolState) -> Option<IpAddr> {
    let all: Vec<(IpAddr, Option<IpAddr>)> = ranges
        .iter()
        .flat_map(|r| {
            (to_bits(r.start())..=to_bits(r.end()))
                .filter_map(move |b| from_bits(r.start(), b).map(|ip| (ip, r.gateway())))
        })
        .collect();
    let pivot = state
        .last_allocated
        .and_then(|last| all.iter().position(|(ip, _)| *ip == last))
        .map_or(0, |p| p + 1);
    all.iter()
        .cycle()
        .skip(pivot)
        .take(all.len())
        .find(|(ip, gw)| Some(*ip) != *gw && !state.allocated.contains_key(ip))
        .map(|(ip, _)| *ip)
}

fn check_invariants(ranges: &[Range], state: &PoolState) -> Result<(), TestCaseError> {
    let holders: BTreeSet<&String> = state.allocated.values().collect();
    prop_assert_eq!(
        holders.len(),
        state.allocated.len(),
        "an applicant holds two IPs"
    );
    for ip in state.allocated.keys() {
        prop_assert!(
            ranges
                .iter()
                .any(|r| r.contains(*ip) && r.gateway() != Some(*ip)),
            "{} is outside the ranges or a gateway",
            ip
        );
    }
    let in_range = state
        .allocated
        .keys()
        .filter(|ip| ranges.iter().any(|r| r.is_allocatable(**ip)))
        .count() as u128;
    prop_assert_eq!(available(ranges, state) + in_range, total(ranges));
    Ok(())
}

proptest! {
    // Regressions are kept beside this file (`proptests.proptest-regressions`), inside the module.
    #![proptest_config(ProptestConfig::with_failure_persistence(
        proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
    ))]

    #[test]
    fn allocate_release_sequences_keep_the_invariants(ranges in ranges(), ops in ops()) {
        let mut state = PoolState::default();
        let mut released: BTreeMap<String, IpAddr> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Allocate(n) => {
                    let applicant = id(n);
                    let held = state.allocated.iter().find(|(_, h)| **h == applicant).map(|(ip, _)| *ip);
                    // history only survives while nobody else took the IP in between
                    let reusable = released
                        .get(&applicant)
                        .copied()
                        .filter(|ip| state.history.get(ip) == Some(&applicant))
                        .filter(|ip| !state.allocated.contains_key(ip));
                    let expected = held.or(reusable).or_else(|| naive_next(&ranges, &state));
                    let before = state.clone();
                    match allocate(&ranges, &mut state, &applicant) {
                        Ok(a) => {
                            prop_assert_eq!(Some(a.ip), expected);
                            if held.is_none() {
                                prop_assert!(!before.allocated.contains_key(&a.ip), "handed out a taken IP");
                            }
                            released.remove(&applicant);
                        }
                        Err(e) => {
                            prop_assert_eq!(expected, None, "{}", e);
                            prop_assert_eq!(&state, &before);
                        }
                    }
                }
                Op::Release(n) => {
                    let applicant = id(n);
                    if let Some(ip) = release(&mut state, &applicant) {
                        released.insert(applicant, ip);
                    }
                }
            }
            check_invariants(&ranges, &state)?;
        }
    }

    #[test]
    fn release_then_allocate_returns_the_same_ip(ranges in ranges(), others in 0usize..6) {
        let mut state = PoolState::default();
        let Ok(first) = allocate(&ranges, &mut state, "mine") else { return Ok(()) };
        for i in 0..others {
            let _ = allocate(&ranges, &mut state, &format!("other-{i}"));
        }
        prop_assert_eq!(release(&mut state, "mine"), Some(first.ip));
        let again = allocate(&ranges, &mut state, "mine").map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(again, first);
    }

    #[test]
    fn range_parse_never_panics(
        subnet in "\\PC{0,24}",
        start in proptest::option::of("\\PC{0,24}"),
        end in proptest::option::of("[0-9a-f:.]{0,24}"),
        gw in proptest::option::of("[0-9a-f:.]{0,24}"),
    ) {
        let _ = Range::parse(&subnet, start.as_deref(), end.as_deref(), gw.as_deref());
    }

    #[test]
    fn parsed_ranges_respect_their_subnet(
        prefix in 0u8..=32,
        base in any::<u32>(),
        a in any::<u32>(),
        b in any::<u32>(),
    ) {
        let subnet = format!("{}/{}", std::net::Ipv4Addr::from(base), prefix);
        let host = |x: u32| std::net::Ipv4Addr::from(base ^ (x >> prefix.min(31))).to_string();
        if let Ok(r) = Range::parse(&subnet, Some(&host(a)), Some(&host(b)), None) {
            prop_assert!(r.start() <= r.end());
            prop_assert!(r.subnet().contains(r.start()) && r.subnet().contains(r.end()));
            prop_assert!(r.size() >= 1 || r.gateway().is_some());
        }
    }
}
