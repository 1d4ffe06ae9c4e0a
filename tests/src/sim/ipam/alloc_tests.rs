//! One test per allocation rule of the contract (§4.4), plus the status JSON shape.

use std::net::IpAddr;
use std::time::Instant;

use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn r(subnet: &str, start: &str, end: &str) -> Range {
    Range::parse(subnet, Some(start), Some(end), None).unwrap()
}

fn r_gw(subnet: &str, start: &str, end: &str, gw: &str) -> Range {
    Range::parse(subnet, Some(start), Some(end), Some(gw)).unwrap()
}

fn alloc_ip(ranges: &[Range], state: &mut PoolState, id: &str) -> IpAddr {
    allocate(ranges, state, id).unwrap().ip
}

#[test]
fn first_allocation_skips_the_default_gateway() {
    let ranges = [r("10.0.0.0/24", "", "")];
    let mut state = PoolState::default();
    let got = allocate(&ranges, &mut state, "default/lb-a").unwrap();
    assert_eq!(
        got,
        Allocation {
            ip: ip("10.0.0.2"),
            mask: "255.255.255.0".into(),
            gateway: Some(ip("10.0.0.1")),
        }
    );
    assert_eq!(
        state.allocated.get(&ip("10.0.0.2")).map(String::as_str),
        Some("default/lb-a")
    );
    assert_eq!(state.last_allocated, Some(ip("10.0.0.2")));
}

#[test]
fn explicit_gateway_inside_the_range_is_skipped() {
    let ranges = [r_gw("10.0.0.0/24", "10.0.0.10", "10.0.0.12", "10.0.0.11")];
    let mut state = PoolState::default();
    let got: Vec<IpAddr> = ["a", "b"]
        .iter()
        .map(|id| alloc_ip(&ranges, &mut state, id))
        .collect();
    assert_eq!(got, vec![ip("10.0.0.10"), ip("10.0.0.12")]);
    assert!(allocate(&ranges, &mut state, "c").is_err());
}

#[test]
fn gateway_outside_the_range_is_still_reported() {
    let ranges = [r("10.0.0.0/24", "10.0.0.10", "10.0.0.20")];
    let got = allocate(&ranges, &mut PoolState::default(), "a").unwrap();
    assert_eq!(
        (got.ip, got.gateway),
        (ip("10.0.0.10"), Some(ip("10.0.0.1")))
    );
}

#[test]
fn single_address_range_has_no_gateway() {
    let ranges = [r("192.168.5.9/32", "", "")];
    let got = allocate(&ranges, &mut PoolState::default(), "a").unwrap();
    assert_eq!(got.ip, ip("192.168.5.9"));
    assert_eq!(got.mask, "255.255.255.255");
    assert_eq!(got.gateway, None);
}

#[test]
fn allocate_is_idempotent_for_the_same_applicant() {
    let ranges = [r("10.0.0.0/24", "", "")];
    let mut state = PoolState::default();
    let first = allocate(&ranges, &mut state, "a").unwrap();
    let before = state.clone();
    let again = allocate(&ranges, &mut state, "a").unwrap();
    assert_eq!(first, again);
    assert_eq!(state, before, "a repeated allocate changes nothing");
}

#[test]
fn history_is_reused_before_round_robin() {
    let ranges = [r("10.0.0.0/24", "", "")];
    let mut state = PoolState::default();
    state.history.insert(ip("10.0.0.77"), "default/lb-a".into());
    state.last_allocated = Some(ip("10.0.0.5"));
    assert_eq!(
        alloc_ip(&ranges, &mut state, "default/lb-a"),
        ip("10.0.0.77")
    );
    assert!(state.history.is_empty(), "the history entry is consumed");
    assert_eq!(state.last_allocated, Some(ip("10.0.0.77")));
}

#[test]
fn history_is_skipped_when_taken_or_out_of_range() {
    let ranges = [r_gw("10.0.0.0/24", "10.0.0.10", "10.0.0.20", "10.0.0.12")];
    let rows = [
        ("taken by someone else", "10.0.0.15", Some("other")),
        ("outside the ranges now", "10.0.0.99", None),
        ("now the gateway", "10.0.0.12", None),
    ];
    for (name, old, holder) in rows {
        let mut state = PoolState::default();
        state.history.insert(ip(old), "a".into());
        if let Some(h) = holder {
            state.allocated.insert(ip(old), h.into());
        }
        assert_eq!(
            alloc_ip(&ranges, &mut state, "a"),
            ip("10.0.0.10"),
            "{name}"
        );
    }
}

#[test]
fn release_then_allocate_gives_the_same_ip_back() {
    let ranges = [r("10.0.0.0/24", "", "")];
    let mut state = PoolState::default();
    let a = alloc_ip(&ranges, &mut state, "a");
    alloc_ip(&ranges, &mut state, "b");
    assert_eq!(release(&mut state, "a"), Some(a));
    assert_eq!(state.history.get(&a).map(String::as_str), Some("a"));
    alloc_ip(&ranges, &mut state, "c");
    assert_eq!(alloc_ip(&ranges, &mut state, "a"), a);
}

#[test]
fn release_is_a_no_op_the_second_time() {
    let ranges = [r("10.0.0.0/24", "", "")];
    let mut state = PoolState::default();
    let a = alloc_ip(&ranges, &mut state, "a");
    assert_eq!(release(&mut state, "a"), Some(a));
    let after_first = state.clone();
    assert_eq!(release(&mut state, "a"), None);
    assert_eq!(state, after_first);
    assert_eq!(release(&mut state, "never-allocated"), None);
}

#[test]
fn release_ip_checks_the_holder() {
    let ranges = [r("10.0.0.0/24", "", "")];
    let mut state = PoolState::default();
    let a = alloc_ip(&ranges, &mut state, "a");
    assert!(!release_ip(&mut state, a, "b"));
    assert!(state.allocated.contains_key(&a));
    assert!(release_ip(&mut state, a, "a"));
    assert!(!state.allocated.contains_key(&a));
}

#[test]
fn round_robin_continues_after_last_allocated() {
    let ranges = [r("10.0.0.0/24", "10.0.0.10", "10.0.0.20")];
    let mut state = PoolState::default();
    for id in ["a", "b", "c"] {
        alloc_ip(&ranges, &mut state, id);
    }
    release(&mut state, "b");
    state.history.clear();
    assert_eq!(
        alloc_ip(&ranges, &mut state, "d"),
        ip("10.0.0.13"),
        "not the freed .11"
    );
}

#[test]
fn round_robin_wraps_around() {
    // (name, ranges, already allocated, last allocated, expected)
    type Row = (
        &'static str,
        Vec<Range>,
        &'static [&'static str],
        &'static str,
        &'static str,
    );
    let rows: Vec<Row> = vec![
        (
            "last at the end of the only range",
            vec![r("10.0.0.0/24", "10.0.0.10", "10.0.0.20")],
            &["10.0.0.15"],
            "10.0.0.20",
            "10.0.0.10",
        ),
        (
            "wrap finds the gap before last",
            vec![r("10.0.0.0/24", "10.0.0.10", "10.0.0.12")],
            &["10.0.0.11", "10.0.0.12"],
            "10.0.0.11",
            "10.0.0.10",
        ),
        (
            "next range after the end of the current one",
            vec![
                r("10.0.0.0/24", "10.0.0.10", "10.0.0.11"),
                r("10.0.1.0/24", "10.0.1.5", "10.0.1.6"),
            ],
            &[],
            "10.0.0.11",
            "10.0.1.5",
        ),
        (
            "wraps from the last range to the first",
            vec![
                r("10.0.0.0/24", "10.0.0.10", "10.0.0.11"),
                r("10.0.1.0/24", "10.0.1.5", "10.0.1.6"),
            ],
            &[],
            "10.0.1.6",
            "10.0.0.10",
        ),
        (
            "last outside every range: start from the beginning",
            vec![r("10.0.0.0/24", "10.0.0.10", "10.0.0.20")],
            &[],
            "10.9.9.9",
            "10.0.0.10",
        ),
        (
            "skips an allocated run",
            vec![r("10.0.0.0/24", "10.0.0.10", "10.0.0.20")],
            &["10.0.0.13", "10.0.0.14", "10.0.0.15"],
            "10.0.0.12",
            "10.0.0.16",
        ),
    ];
    for (name, ranges, taken, last, want) in rows {
        let mut state = PoolState::default();
        for t in taken {
            state.allocated.insert(ip(t), format!("holder-{t}"));
        }
        state.last_allocated = Some(ip(last));
        assert_eq!(alloc_ip(&ranges, &mut state, "new"), ip(want), "{name}");
    }
}

#[test]
fn exhaustion_reads_like_host_local() {
    let ranges = [
        r("10.0.0.0/24", "10.0.0.10", "10.0.0.11"),
        r("10.0.1.7/32", "", ""),
    ];
    let mut state = PoolState::default();
    for id in ["a", "b", "c"] {
        alloc_ip(&ranges, &mut state, id);
    }
    let before = state.clone();
    let err = allocate(&ranges, &mut state, "d").unwrap_err();
    assert_eq!(
        err.to_string(),
        "no IP addresses available in range set: 10.0.0.10-10.0.0.11,10.0.1.7-10.0.1.7"
    );
    assert_eq!(state, before, "a failed allocate changes nothing");
}

#[test]
fn no_ranges_is_an_error() {
    let err = allocate(&[], &mut PoolState::default(), "a").unwrap_err();
    assert_eq!(err, AllocError::NoRanges);
}

#[test]
fn ipv6_small_range() {
    let ranges = [Range::parse("fd00:10::/126", None, None, None).unwrap()];
    assert_eq!(
        total(&ranges),
        2,
        "::1 is the gateway; ::2 and ::3 are usable"
    );
    let mut state = PoolState::default();
    let a = allocate(&ranges, &mut state, "a").unwrap();
    assert_eq!(a.ip, ip("fd00:10::2"));
    assert_eq!(a.mask, "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffc");
    assert_eq!(a.gateway, Some(ip("fd00:10::1")));
    assert_eq!(alloc_ip(&ranges, &mut state, "b"), ip("fd00:10::3"));
    assert!(allocate(&ranges, &mut state, "c").is_err());
}

#[test]
fn ipv6_huge_range_is_not_enumerated() {
    let ranges = [Range::parse("fd00::/64", None, None, None).unwrap()];
    let mut state = PoolState {
        last_allocated: Some(ip("fd00::ffff:ffff:ffff:ffff")),
        ..PoolState::default()
    };
    assert_eq!(alloc_ip(&ranges, &mut state, "a"), ip("fd00::2"), "wrapped");
    assert_eq!(available(&ranges, &state), (1u128 << 64) - 3);
}

#[test]
fn total_and_available() {
    let ranges = [
        r("10.0.0.0/24", "", ""),                     // 254 - gateway = 253
        r("10.0.1.0/24", "10.0.1.100", "10.0.1.109"), // 10, gateway .1 outside
    ];
    assert_eq!(total(&ranges), 263);
    let mut state = PoolState::default();
    alloc_ip(&ranges, &mut state, "a");
    state
        .allocated
        .insert(ip("192.168.0.1"), "left over from old ranges".into());
    state
        .allocated
        .insert(ip("10.0.0.1"), "on the gateway".into());
    assert_eq!(available(&ranges, &state), 262);
}

#[test]
fn prune_history_drops_entries_outside_the_ranges() {
    let ranges = [r("10.0.0.0/24", "10.0.0.10", "10.0.0.20")];
    let mut state = PoolState::default();
    state.history.insert(ip("10.0.0.15"), "kept".into());
    state.history.insert(ip("10.0.0.21"), "dropped".into());
    state.history.insert(ip("fd00::15"), "dropped".into());
    prune_history(&ranges, &mut state);
    assert_eq!(
        state.history.keys().copied().collect::<Vec<_>>(),
        vec![ip("10.0.0.15")]
    );
}

#[test]
fn a_99_percent_full_slash_16_still_allocates_fast() {
    let ranges = [r("10.1.0.0/16", "", "")];
    let mut state = PoolState::default();
    // Everything from .0.2 up to ~99% allocated; the free tail is at the very end, and
    // round robin starts at the beginning, so the walk crosses the whole allocated run.
    let usable = u32::try_from(total(&ranges)).unwrap();
    let free_tail = usable / 100;
    for n in 2..(usable - free_tail + 2) {
        let addr = IpAddr::V4(std::net::Ipv4Addr::from(
            u32::from_be_bytes([10, 1, 0, 0]) + n,
        ));
        state.allocated.insert(addr, format!("lb-{n}"));
    }
    state.last_allocated = Some(ip("10.1.0.1"));
    let started = Instant::now();
    for i in 0..10 {
        allocate(&ranges, &mut state, &format!("new-{i}")).unwrap();
    }
    let per_allocation = started.elapsed() / 10;
    // Generous bound for unoptimised builds on a busy machine; the point is "no quadratic walk".
    assert!(
        per_allocation.as_millis() < 50,
        "took {per_allocation:?} per allocation"
    );
}

#[test]
fn status_json_round_trips_in_the_cr_shape() {
    let ranges = [r("10.0.0.0/24", "", "")];
    let mut state = PoolState::default();
    alloc_ip(&ranges, &mut state, "default/lb-a");
    alloc_ip(&ranges, &mut state, "default/lb-b");
    release(&mut state, "default/lb-a");
    let json = serde_json::to_value(&state).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "allocated": {"10.0.0.3": "default/lb-b"},
            "allocatedHistory": {"10.0.0.2": "default/lb-a"},
            "lastAllocated": "10.0.0.3",
        })
    );
    let back: PoolState = serde_json::from_value(json).unwrap();
    assert_eq!(back, state);
}

#[test]
fn status_written_by_go_is_read_leniently() {
    let go_status = serde_json::json!({
        "total": 253,
        "available": 252,
        "lastAllocated": "",
        "allocated": {"10.0.0.2": "default/lb-a", "not-an-ip": "default/lb-x"},
        "allocatedHistory": null,
        "conditions": [{"type": "Ready", "status": "True"}],
    });
    let state: PoolState = serde_json::from_value(go_status).unwrap();
    assert_eq!(state.last_allocated, None);
    assert_eq!(state.allocated.len(), 1);
    assert!(state.history.is_empty());
    let empty: PoolState = serde_json::from_str("{}").unwrap();
    assert_eq!(empty, PoolState::default());
    assert_eq!(
        serde_json::to_value(&empty).unwrap(),
        serde_json::json!({"lastAllocated": ""}),
        "lastAllocated has no omitempty upstream"
    );
}
