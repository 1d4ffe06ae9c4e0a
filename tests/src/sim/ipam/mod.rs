//! A pure IP pool allocator with Harvester's IPPool semantics (`load-balancer-harvester`
//! `pkg/ipam`), for the stand-in of Harvester's LB controller ([`super::lb`]). The `IPPool` CRD
//! type itself stays in `harvester_common::harvester` (the cloud provider reads it too).
//!
//! - [`Range`]: one `spec.ranges[*]` entry with CNI host-local defaults, parsed at the edge.
//! - [`select_pool`]: which pool serves a LoadBalancer (strict pass, global fallback, loose pass).
//! - [`allocate`] / [`release`] on a [`PoolState`] (the CR status' `allocated`,
//!   `allocatedHistory`, `lastAllocated`): history reuse, then round robin after the last
//!   allocated IP.
//!
//! No I/O and no Kubernetes types: the caller maps CR fields in and out.

mod addr;
mod alloc;
mod range;
mod select;

#[cfg(test)]
mod alloc_tests;
#[cfg(test)]
mod proptests;

pub use alloc::{
    AllocError, Allocation, PoolState, allocate, available, prune_history, release, release_ip,
    total,
};
pub use range::{Range, RangeError};
pub use select::{NoMatchedPool, PoolView, Requirement, Scope, Selector, WILDCARD, select_pool};
