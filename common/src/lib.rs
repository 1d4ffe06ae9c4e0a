//! Code shared by `harvester-cloud-provider` and `harvester-csi-driver`.
//!
//! - [`harvester`]: typed Harvester and KubeVirt resources (only the fields we read; the rest is
//!   preserved) and the KubeVirt hot-plug subresource calls.
//! - [`cloud_config`]: the Harvester kubeconfig ("cloud-config") -> client + VM namespace.
//! - [`ipam`]: a pure IP pool allocator with Harvester IPPool semantics.
//! - [`dhcp`]: a DHCPv4 client leasing addresses for synthetic MACs (LoadBalancer `ipam: dhcp`).
//! - [`guest`]: the guest cluster's client (kubeconfig file or in-cluster).
//! - [`flags`]: command lines parsed the way upstream's Go programs parse them.
//! - [`names`]: Kubernetes name rules (DNS-1123 labels).
//! - [`quantity`]: Kubernetes quantities as bytes.
//! - [`telemetry`]: logs, metrics, health endpoints, API request counts, shutdown signal.

pub mod api_error;
pub mod cloud_config;
pub mod dhcp;
pub mod flags;
#[doc(hidden)]
pub mod fuzz;
pub mod guest;
pub mod harvester;
pub mod ipam;
pub mod names;
pub mod quantity;
pub mod telemetry;
