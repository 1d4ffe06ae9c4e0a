//! The choice of a guest-pool address ([`allocate`], pure) and the provider's [`Ledger`] of the
//! addresses it chose whose writes the Service cache may not show yet, and of the Services waiting
//! for one.
//!
//! The record of who holds which address is the Services themselves: the addresses in their
//! `status.loadBalancer.ingress`. A restarted provider rebuilds the used set from its Service
//! cache before it allocates (the reconciles wait for the caches to list), so it needs no store of
//! its own. The ledger only covers the moment between a write and the watch event that shows it,
//! so two reconciles running at once never pick one address.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Mutex;

use super::{GuestProblem, Pool, Span, from_int};
use crate::service::annotations::ServiceKey;

/// The address family a Service wants (`spec.ipFamilies[0]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// What one Service has and asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// Its ingress address now.
    pub current: Option<IpAddr>,
    /// The address the ledger holds for it (chosen before, write not seen yet).
    pub reserved: Option<IpAddr>,
    /// The address it asks for (`kube-vip.io/loadbalancerIPs`, `spec.loadBalancerIP`).
    pub requested: Option<IpAddr>,
    /// `spec.ipFamilies[0]`; without it IPv4, or IPv6 when the pool has no IPv4 address.
    pub family: Option<Family>,
}

/// The address a Service is to have, and what to warn about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub ip: Option<IpAddr>,
    pub problem: Option<GuestProblem>,
}

/// The address for `req` from `pool`, where `used` maps the addresses other Services hold to
/// their names. A Service keeps the address it has while that is inside the pool (one outside:
/// the ConfigMap changed, or it came from Harvester, whose CR is gone and whose pool may give it
/// to another, is replaced), unless it asks for another one that is free;
/// a requested address that is outside the pool or held by another Service is a problem, and the
/// Service keeps what it has (or gets nothing: it asked for that address, not for any). Otherwise
/// the reserved address, else the first free one in search order (IPv4 addresses ending in .0 or
/// .255 are skipped, as upstream's `FindFreeAddress` does).
pub fn allocate(
    pool: &Pool,
    descending: bool,
    req: &Request,
    used: &BTreeMap<IpAddr, ServiceKey>,
) -> Decision {
    let give = |ip| Decision {
        ip: Some(ip),
        problem: None,
    };
    let current = req.current.filter(|c| pool.contains(*c));
    let refuse = |problem| Decision {
        ip: current,
        problem: Some(problem),
    };
    if let Some(requested) = req.requested.filter(|r| Some(*r) != current) {
        if !pool.contains(requested) {
            return refuse(GuestProblem::RequestedOutside {
                requested,
                key: pool.key.clone(),
                value: pool.value.clone(),
            });
        }
        return match used.get(&requested) {
            Some(holder) => refuse(GuestProblem::RequestedTaken {
                requested,
                holder: holder.to_string(),
            }),
            None => give(requested),
        };
    }
    if let Some(current) = current {
        return give(current);
    }
    if let Some(reserved) = req
        .reserved
        .filter(|r| pool.contains(*r) && !used.contains_key(r))
    {
        return give(reserved);
    }
    match first_free(pool, descending, req.family, used) {
        Some(ip) => give(ip),
        None => refuse(GuestProblem::Exhausted {
            key: pool.key.clone(),
            value: pool.value.clone(),
        }),
    }
}

fn first_free(
    pool: &Pool,
    descending: bool,
    family: Option<Family>,
    used: &BTreeMap<IpAddr, ServiceKey>,
) -> Option<IpAddr> {
    let has_v4 = pool.spans.iter().any(|s| !s.v6);
    let v6 = match family {
        Some(Family::V6) => true,
        Some(Family::V4) => false,
        None => !has_v4,
    };
    let spans: Vec<&Span> = pool.spans.iter().filter(|s| s.v6 == v6).collect();
    let free = |n: u128| {
        let ip = from_int(v6, n);
        let end_octet = !v6 && matches!(n & 0xff, 0 | 0xff);
        (!end_octet && !used.contains_key(&ip)).then_some(ip)
    };
    // Each step skips a used address or an IPv4 .0/.255: bounded by the used set, not the pool.
    if descending {
        spans
            .iter()
            .rev()
            .find_map(|s| (s.first..=s.last).rev().find_map(free))
    } else {
        spans.iter().find_map(|s| (s.first..=s.last).find_map(free))
    }
}

/// Addresses chosen by this provider whose writes the cache may not show yet, and the Services
/// waiting for an address (woken when one is freed).
#[derive(Default)]
pub struct Ledger {
    inner: Mutex<LedgerState>,
}

#[derive(Default)]
struct LedgerState {
    reserved: BTreeMap<ServiceKey, IpAddr>,
    waiting: BTreeSet<ServiceKey>,
    /// Services whose address was released while the cache may still show it (their finalizer
    /// just removed, their ingress just cleared): what the cache shows for them is not held.
    freed: BTreeSet<ServiceKey>,
}

impl Ledger {
    fn lock(&self) -> std::sync::MutexGuard<'_, LedgerState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides for `me` under the ledger's lock, with the addresses the cache shows as held
    /// (`held`: address -> holder, `me` included or not) plus those reserved for other Services;
    /// records the address chosen (or that `me` waits when it got none).
    pub fn decide(
        &self,
        me: &ServiceKey,
        pool: &Pool,
        descending: bool,
        mut req: Request,
        mut held: BTreeMap<IpAddr, ServiceKey>,
    ) -> Decision {
        let mut state = self.lock();
        state.freed.remove(me);
        held.retain(|_, holder| holder != me && !state.freed.contains(holder));
        for (holder, ip) in &state.reserved {
            if holder != me {
                held.entry(*ip).or_insert_with(|| holder.clone());
            }
        }
        req.reserved = state.reserved.get(me).copied();
        let decision = allocate(pool, descending, &req, &held);
        match decision.ip {
            Some(ip) => {
                state.reserved.insert(me.clone(), ip);
                state.waiting.remove(me);
            }
            None => {
                state.waiting.insert(me.clone());
            }
        }
        if decision.problem.is_some() {
            state.waiting.insert(me.clone());
        }
        decision
    }

    /// `key` gave its address back (deleted, or no LoadBalancer any more): forgets it, counts
    /// what the cache still shows for it as free, and returns the Services waiting (to wake).
    pub fn release(&self, key: &ServiceKey) -> Vec<ServiceKey> {
        let mut state = self.lock();
        state.reserved.remove(key);
        state.waiting.remove(key);
        state.freed.insert(key.clone());
        state.waiting.iter().cloned().collect()
    }

    /// `key` takes its address elsewhere now: its reservation goes, and when it had one, the
    /// Services waiting are returned (to wake).
    pub fn forget(&self, key: &ServiceKey) -> Vec<ServiceKey> {
        let mut state = self.lock();
        state.waiting.remove(key);
        match state.reserved.remove(key) {
            Some(_) => state.waiting.iter().cloned().collect(),
            None => Vec::new(),
        }
    }

    /// Forgets the Services `exists` refuses (gone from the cache).
    pub fn retain(&self, exists: impl Fn(&ServiceKey) -> bool) {
        let mut state = self.lock();
        state.reserved.retain(|k, _| exists(k));
        state.waiting.retain(|k| exists(k));
        state.freed.retain(|k| exists(k));
    }
}

#[cfg(test)]
mod tests;
