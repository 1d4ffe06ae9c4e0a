//! Typed Harvester and KubeVirt resources: only the fields this project reads or writes are typed;
//! everything else is kept in `rest` maps, so a read-modify-write never drops a field we do not know.

pub mod hotplug;
pub mod kubevirt;
pub mod lenient;
pub mod loadbalancer;

pub use hotplug::{AddVolumeOptions, HotplugError, RemoveVolumeOptions};
pub use kubevirt::{VirtualMachine, VirtualMachineInstance};
pub use loadbalancer::{IPPool, LoadBalancer};

/// Unknown fields of an object part, preserved on write-back.
pub type Rest = serde_json::Map<String, serde_json::Value>;

/// Annotation keys Harvester copies from the host Node's labels onto a guest VMI.
pub const TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";
pub const TOPOLOGY_REGION: &str = "topology.kubernetes.io/region";
