//! IP allocation throughput of `testbed::sim::ipam` on a /16 pool (65 533 allocatable
//! addresses: network, gateway and broadcast excluded) at 0 %, 90 % and 99 % full.
//!
//! One iteration is one `allocate` for an applicant that holds nothing yet, then the removal of
//! that entry and the `lastAllocated` reset, which put the pool back exactly where it was: every
//! iteration sees the same fill level and takes the path a new LoadBalancer takes (look for an
//! address it already holds, then its history, then the round robin). Three layouts:
//!
//! - `in_order`: filled in round-robin order from the start, `lastAllocated` on the last one (the
//!   steady state of a pool that has never wrapped): the walk starts right at a free address;
//! - `scattered`: the free addresses spread evenly (1 in 10 at 90 %, 1 in 100 at 99 %),
//!   `lastAllocated` at the start: the walk skips one allocated run;
//! - `wrapped`: filled from the start, `lastAllocated` back at the start (the round robin wrapped
//!   around): the walk passes every allocated address before the free tail, the worst case.
//!
//! `make bench` runs this with `-- --quick` and copies the estimates into docs/benchmarks.md.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use testbed::sim::ipam::{self, PoolState, Range};

const SUBNET: &str = "10.20.0.0/16";

fn range() -> Vec<Range> {
    vec![Range::parse(SUBNET, None, None, None).expect("a /16 parses")]
}

fn ip(n: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 20, 0, 0)) + n))
}

/// Allocatable host numbers of the /16: .0.2 .. .255.254 (.0.1 is the gateway).
fn hosts() -> impl Iterator<Item = u32> {
    2..=65_534
}

fn fill_from_start(percent: u32) -> BTreeMap<IpAddr, String> {
    let n = hosts().count() * percent as usize / 100;
    hosts()
        .take(n)
        .map(|h| (ip(h), format!("guest-vms/lb-{h}")))
        .collect()
}

/// `percent` % allocated from the start, `lastAllocated` on the last one.
fn in_order(percent: u32) -> PoolState {
    let allocated = fill_from_start(percent);
    let last = allocated.keys().next_back().copied();
    PoolState {
        allocated,
        history: BTreeMap::new(),
        last_allocated: last,
    }
}

/// `percent` % allocated with the free addresses spread evenly, `lastAllocated` at the start.
fn scattered(percent: u32) -> PoolState {
    let free_every = 100 / (100 - percent).max(1);
    let allocated: BTreeMap<IpAddr, String> = hosts()
        .filter(|h| percent > 0 && h % free_every != 0)
        .map(|h| (ip(h), format!("guest-vms/lb-{h}")))
        .collect();
    PoolState {
        allocated,
        history: BTreeMap::new(),
        last_allocated: Some(ip(2)),
    }
}

/// `percent` % allocated from the start, `lastAllocated` wrapped around to the first address.
fn wrapped(percent: u32) -> PoolState {
    PoolState {
        allocated: fill_from_start(percent),
        history: BTreeMap::new(),
        last_allocated: Some(ip(2)),
    }
}

fn bench_fill(c: &mut Criterion, group_name: &str, fill: fn(u32) -> PoolState) {
    let ranges = range();
    let mut group = c.benchmark_group(group_name);
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(3));
    for percent in [0u32, 90, 99] {
        let mut state = fill(percent);
        let before = state.last_allocated;
        group.bench_with_input(BenchmarkId::from_parameter(percent), &percent, |b, _| {
            b.iter(|| {
                let got = ipam::allocate(black_box(&ranges), &mut state, "guest-vms/new")
                    .expect("the pool has room");
                // Undo it exactly (no history entry, the same walk start), so every
                // iteration sees the same pool.
                state.allocated.remove(&got.ip);
                state.last_allocated = before;
                black_box(got)
            });
        });
    }
    group.finish();
}

fn allocate(c: &mut Criterion) {
    bench_fill(c, "ipam_slash16_in_order", in_order);
    bench_fill(c, "ipam_slash16_scattered", scattered);
    bench_fill(c, "ipam_slash16_wrapped", wrapped);
}

criterion_group!(benches, allocate);
criterion_main!(benches);
