//! The service controller: guest Services of `type: LoadBalancer` get an address from Harvester
//! (a `loadbalancer.harvesterhci.io` LoadBalancer CR per primary Service, allocated by Harvester's
//! LB controller from its IPPools), shared addresses for secondaries, and cleanup that never leaks
//! a CR. Driven by watches on guest Services and Harvester LoadBalancers.
//!
//! - `reconcile`: the wiring and, per Service, fetch -> plan -> apply -> report;
//! - [`plan`]: the pure rules, and the typed problems with their Event reasons;
//! - [`annotations`], [`name`]: the Service's input and the CR's name, parsed at the edge;
//! - `crs`: LoadBalancer CR I/O and garbage collection; `service_io`: the Service's finalizer and
//!   status patches; `context`: the reconcile's context and error (our writes the caches have not
//!   shown yet are [`crate::written`]'s); [`dhcp`]: leases in `--dhcp-mode=ccm`; [`guest_pool`]: the guest
//!   cluster's own pools (`ipam: guest`, no CR), with `guest` their thin I/O.

pub mod annotations;
mod context;
mod crs;
pub mod dhcp;
mod guest;
pub mod guest_pool;
pub mod name;
pub mod plan;
mod reconcile;
mod service_io;
mod wake;

pub use context::{Error, ServiceCtx};
pub use reconcile::run;

/// The cloud-provider framework's finalizer on LoadBalancer Services (upstream compatible).
pub const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";
/// Field manager and event reporter of this controller.
pub const MANAGER: &str = crate::context::FIELD_MANAGER;
/// kube-vip's NAD -> interface mapping, maintained by the provider in the guest cluster.
pub const NAD_MAPPING_NAMESPACE: &str = "kube-system";
pub const NAD_MAPPING_NAME: &str = "harvester-nad-mapping";
pub const NAD_MAPPING_KEY: &str = "interface-nad-mapping";
