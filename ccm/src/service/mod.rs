//! The service controller: guest Services of `type: LoadBalancer` get an address from Harvester
//! (a `loadbalancer.harvesterhci.io` LoadBalancer CR per primary Service, allocated by Harvester's
//! LB controller from its IPPools), shared addresses for secondaries, and cleanup that never leaks
//! a CR. Driven by watches on guest Services and Harvester LoadBalancers.

pub mod annotations;
pub mod dhcp;
pub mod name;
pub mod plan;
mod reconcile;
mod written;

pub use reconcile::{ServiceCtx, run};

/// The cloud-provider framework's finalizer on LoadBalancer Services (upstream compatible).
pub const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";
/// Field manager and event reporter of this controller.
pub const MANAGER: &str = "harvester-cloud-provider";
/// kube-vip's NAD -> interface mapping, maintained by the provider in the guest cluster.
pub const NAD_MAPPING_NAMESPACE: &str = "kube-system";
pub const NAD_MAPPING_NAME: &str = "harvester-nad-mapping";
pub const NAD_MAPPING_KEY: &str = "interface-nad-mapping";
