//! Allocation state and the host-local style allocator Harvester wraps
//! (`pkg/ipam/allocator.go`, `pkg/ipam/store/store.go`, host-local `IPAllocator`).
//!
//! Everything here is a pure function of `&[Range]` and a [`PoolState`]; the caller reads the
//! state from the IPPool status, calls these, and writes the status back.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::addr::{from_bits, next, to_bits};
use super::range::Range;

/// The allocation part of an IPPool's status. Same JSON keys as the CR: `allocated`,
/// `allocatedHistory`, `lastAllocated`; other status keys are ignored when reading.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolState {
    /// IP -> applicant (`<lbNamespace>/<lbName>`) currently holding it.
    #[serde(
        default,
        deserialize_with = "de_ip_map",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub allocated: BTreeMap<IpAddr, String>,
    /// IP -> applicant that held it last, so the same LB name gets the same IP back.
    #[serde(
        rename = "allocatedHistory",
        default,
        deserialize_with = "de_ip_map",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub history: BTreeMap<IpAddr, String>,
    /// Where the next round-robin walk starts (just after this IP).
    #[serde(default, deserialize_with = "de_opt_ip", serialize_with = "ser_opt_ip")]
    pub last_allocated: Option<IpAddr>,
}

/// One handed-out address, in the parts `status.allocatedAddress` needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub ip: IpAddr,
    /// Netmask as Harvester writes it: `255.255.255.0`, or `ffff:ffff:ffff:ffff::` for IPv6.
    pub mask: String,
    /// The gateway of the range the IP came from; `None` for a /32 or /128 range.
    pub gateway: Option<IpAddr>,
}

/// Why no address could be handed out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Upstream's message for a pool without ranges (`NewAllocator`).
    #[error("range could not be empty")]
    NoRanges,
    /// Every address is taken. The message is host-local's, which users and the CCM already
    /// recognise in the LB's Ready condition.
    #[error("no IP addresses available in range set: {}", join_ranges(.ranges))]
    Exhausted { ranges: Vec<Range> },
}

fn join_ranges(ranges: &[Range]) -> String {
    ranges
        .iter()
        .map(Range::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Hands `applicant_id` an address, recording it in `state`:
/// 1. the address it already holds, if that is still allocatable (idempotent, unlike host-local
///    which refuses a duplicate: a retried reconcile must not fail);
/// 2. else the address it held before (`history[ip] == id`), if free and still allocatable;
/// 3. else the first free address after `last_allocated`, walking the ranges in order with
///    wrap-around and skipping gateways.
pub fn allocate(
    ranges: &[Range],
    state: &mut PoolState,
    applicant_id: &str,
) -> Result<Allocation, AllocError> {
    if ranges.is_empty() {
        return Err(AllocError::NoRanges);
    }
    if let Some(held) = held_by(ranges, state, applicant_id) {
        return Ok(held);
    }
    let (ip, range) = from_history(ranges, state, applicant_id)
        .or_else(|| round_robin(ranges, state))
        .ok_or_else(|| AllocError::Exhausted {
            ranges: ranges.to_vec(),
        })?;
    reserve(state, ip, applicant_id);
    Ok(allocation(ip, range))
}

/// Moves every address `applicant_id` holds into the history and returns the (lowest) one.
/// Releasing again returns `None` and changes nothing.
pub fn release(state: &mut PoolState, applicant_id: &str) -> Option<IpAddr> {
    let held: Vec<IpAddr> = state
        .allocated
        .iter()
        .filter(|(_, id)| id.as_str() == applicant_id)
        .map(|(ip, _)| *ip)
        .collect();
    for ip in &held {
        state.allocated.remove(ip);
        state.history.insert(*ip, applicant_id.to_owned());
    }
    held.first().copied()
}

/// Releases `ip` only if it is recorded for `applicant_id`; the manual-release annotation
/// (`"<ip>: <ns>/<lbname>"`) needs this check so a stale note cannot free someone else's IP.
pub fn release_ip(state: &mut PoolState, ip: IpAddr, applicant_id: &str) -> bool {
    if state.allocated.get(&ip).map(String::as_str) != Some(applicant_id) {
        return false;
    }
    state.allocated.remove(&ip);
    state.history.insert(ip, applicant_id.to_owned());
    true
}

/// `status.total`: Σ(end − start + 1), minus one per range whose gateway lies inside it.
pub fn total(ranges: &[Range]) -> u128 {
    ranges.iter().fold(0, |sum, r| sum.saturating_add(r.size()))
}

/// `status.available`: the total minus allocated addresses that the ranges can actually hand out
/// (entries left over from older ranges do not count).
pub fn available(ranges: &[Range], state: &PoolState) -> u128 {
    let used = state
        .allocated
        .keys()
        .filter(|ip| allocatable(ranges, **ip))
        .count();
    total(ranges).saturating_sub(used as u128)
}

/// Drops history entries outside the ranges, as the IPPool controller does when ranges change.
pub fn prune_history(ranges: &[Range], state: &mut PoolState) {
    state
        .history
        .retain(|ip, _| ranges.iter().any(|r| r.contains(*ip)));
}

/// Whether some range may hand out `ip`.
fn allocatable(ranges: &[Range], ip: IpAddr) -> bool {
    ranges.iter().any(|r| r.is_allocatable(ip))
}

/// The first range that may hand out `ip` (host-local's `RangeFor`, plus the gateway check).
fn range_for(ranges: &[Range], ip: IpAddr) -> Option<&Range> {
    ranges.iter().find(|r| r.is_allocatable(ip))
}

fn allocation(ip: IpAddr, range: &Range) -> Allocation {
    Allocation {
        ip,
        mask: range.mask(),
        gateway: range.gateway(),
    }
}

/// The address the applicant already holds, if the ranges still allow it.
fn held_by(ranges: &[Range], state: &PoolState, id: &str) -> Option<Allocation> {
    state
        .allocated
        .iter()
        .filter(|(_, holder)| holder.as_str() == id)
        .find_map(|(ip, _)| range_for(ranges, *ip).map(|r| allocation(*ip, r)))
}

/// The address the applicant held before, if nobody else took it since.
fn from_history<'a>(
    ranges: &'a [Range],
    state: &PoolState,
    id: &str,
) -> Option<(IpAddr, &'a Range)> {
    state
        .history
        .iter()
        .filter(|(ip, holder)| holder.as_str() == id && !state.allocated.contains_key(ip))
        .find_map(|(ip, _)| range_for(ranges, *ip).map(|r| (*ip, r)))
}

/// Records the reservation the way upstream's `Store.Reserve` does.
fn reserve(state: &mut PoolState, ip: IpAddr, id: &str) {
    state.allocated.insert(ip, id.to_owned());
    state.last_allocated = Some(ip);
    state.history.remove(&ip);
}

/// One contiguous stretch of a range to search, both ends inclusive.
struct Segment<'a> {
    range: &'a Range,
    from: IpAddr,
    to: IpAddr,
}

/// The first free address in host-local's round-robin order.
fn round_robin<'a>(ranges: &'a [Range], state: &PoolState) -> Option<(IpAddr, &'a Range)> {
    walk_order(ranges, state.last_allocated)
        .into_iter()
        .find_map(|s| first_free(&s, &state.allocated).map(|ip| (ip, s.range)))
}

/// host-local's iteration order as at most `ranges.len() + 1` segments: from just after
/// `last` to the end of its range, the following ranges, wrapping around to the earlier ones, and
/// finally the start of `last`'s range up to `last` itself. Without a usable `last` (none, or no
/// longer inside any range), simply every range in order.
fn walk_order(ranges: &[Range], last: Option<IpAddr>) -> Vec<Segment<'_>> {
    let pivot = last.and_then(|ip| ranges.iter().position(|r| r.contains(ip)).map(|i| (i, ip)));
    let Some((i, last)) = pivot else {
        return ranges.iter().map(whole).collect();
    };
    let Some(current) = ranges.get(i) else {
        return ranges.iter().map(whole).collect();
    };
    let mut order = Vec::with_capacity(ranges.len() + 1);
    if let Some(after) = next(last)
        && last < current.end()
    {
        order.push(Segment {
            range: current,
            from: after,
            to: current.end(),
        });
    }
    let others = ranges.iter().skip(i + 1).chain(ranges.iter().take(i));
    order.extend(others.map(whole));
    order.push(Segment {
        range: current,
        from: current.start(),
        to: last,
    });
    order
}

/// A whole range as one segment.
fn whole(range: &Range) -> Segment<'_> {
    Segment {
        range,
        from: range.start(),
        to: range.end(),
    }
}

/// The lowest address in the segment that is neither the gateway nor allocated.
///
/// One pass over the allocated keys inside the segment, in order, alongside the candidate: the
/// cost is the length of the allocated run in front of the first gap, never the size of the
/// segment. A mostly free /8 (or IPv6 /64) answers at once; a 99% full /16 whose only gaps are
/// far away walks its allocated entries (~0.5 ms in release), and keys below the candidate (a
/// stale entry on the gateway) are simply passed over.
fn first_free(seg: &Segment<'_>, allocated: &BTreeMap<IpAddr, String>) -> Option<IpAddr> {
    let gateway = seg.range.gateway().map(to_bits);
    let skip_gateway = |c: u128| {
        if Some(c) == gateway {
            c.checked_add(1)
        } else {
            Some(c)
        }
    };
    let end = to_bits(seg.to);
    let mut candidate = skip_gateway(to_bits(seg.from))?;
    for taken in allocated
        .range(seg.from..=seg.to)
        .map(|(ip, _)| to_bits(*ip))
    {
        if taken > candidate {
            break;
        }
        if taken == candidate {
            candidate = skip_gateway(candidate.checked_add(1)?)?;
        }
    }
    if candidate > end {
        return None;
    }
    from_bits(seg.from, candidate)
}

/// Reads an IP-keyed map written by Go (`map[string]string`). A key that is not an IP cannot be
/// handed out or matched by this allocator, so it is dropped with a warning instead of making the
/// whole pool unreadable.
fn de_ip_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<IpAddr, String>, D::Error> {
    let raw: Option<BTreeMap<String, String>> = Option::deserialize(d)?;
    Ok(raw
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(key, id)| match key.parse::<IpAddr>() {
            Ok(ip) => Some((ip.to_canonical(), id)),
            Err(_) => {
                tracing::warn!(
                    key,
                    applicant = id,
                    "ignoring IPPool status entry whose key is not an IP"
                );
                None
            }
        })
        .collect())
}

/// Go writes `lastAllocated: ""` before the first allocation; that and any unparsable value
/// mean "start from the beginning", exactly what host-local does with an unparsable IP.
fn de_opt_ip<'de, D: Deserializer<'de>>(d: D) -> Result<Option<IpAddr>, D::Error> {
    let raw: Option<String> = Option::deserialize(d)?;
    Ok(raw
        .and_then(|s| s.parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical()))
}

/// `lastAllocated` has no `omitempty` in the CR's Go type, so it is always written, as `""`
/// when unset.
fn ser_opt_ip<S: Serializer>(ip: &Option<IpAddr>, s: S) -> Result<S::Ok, S::Error> {
    match ip {
        Some(ip) => s.collect_str(ip),
        None => s.serialize_str(""),
    }
}
