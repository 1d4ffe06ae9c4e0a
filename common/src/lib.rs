//! Code shared by `harvester-cloud-provider` and `harvester-csi-driver`.
//!
//! - [`harvester`]: typed Harvester and KubeVirt resources (only the fields we read; the rest is
//!   preserved) and the KubeVirt hot-plug subresource calls.
//! - [`cloud_config`]: the Harvester kubeconfig ("cloud-config") -> client + VM namespace.
//! - [`guest`]: the guest cluster's client (kubeconfig file or in-cluster).
//! - [`flags`]: command lines parsed the way upstream's Go programs parse them.
//! - [`names`]: Kubernetes name rules (DNS-1123 labels).
//! - [`quantity`]: Kubernetes quantities as bytes.
//! - [`running`]: a program's run loop as a task with a stop handle (both `spawn`s).
//! - [`telemetry`]: logs, metrics, health endpoints, API request counts, shutdown signal.
//! - [`api_client`]: the kube client both programs use (a few HTTP/2 connections, watches over
//!   HTTP/1.1, counted requests).
//! - [`api_error`]: reading the API server's error answers (status predicates, messages).
//!
//! What only one side uses lives with it: the DHCP client in `ccm/dhcp` (crate `harvester-dhcp`),
//! leader election and HTTPS serving in the provider (`harvester_cloud_provider::{leader,
//! secure}`), the IP pool allocator of the LB stand-in in the test bed (`testbed::sim::ipam`).
//! Two rooms keep types one binary reads, on purpose: [`harvester`] holds every Harvester,
//! KubeVirt and Longhorn type in one place (the LoadBalancer CR is the provider's, the hot-plug,
//! NetworkFilesystem and snapshot types the driver's), because the test bed's stand-ins read
//! the same types; [`quantity`] is the driver's, and the test bed's storage stand-in reads it.

pub mod api_client;
pub mod api_error;
pub mod cloud_config;
pub mod flags;
#[doc(hidden)]
pub mod fuzz;
pub mod guest;
pub mod harvester;
pub mod names;
pub mod quantity;
pub mod running;
pub mod telemetry;
