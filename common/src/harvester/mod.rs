//! Typed Harvester and KubeVirt resources: only the fields this project reads or writes are typed;
//! everything else is kept in `rest` maps, so a read-modify-write never drops a field we do not know.
//! The rules both binaries apply to them live beside the types: the KubeVirt ones (a VM's
//! volumes and their claims, a fenced VMI, the hot-plug capacity, the `harvester://` provider ID,
//! the serial handed to the node plugin) in [`kubevirt`]. The CSI driver's snapshots and
//! backups are [`snapshot`] and [`backup`].

pub mod backup;
pub mod hotplug;
pub mod kubevirt;
pub mod lenient;
pub mod loadbalancer;
pub mod networkfs;
pub mod settings;
pub mod snapshot;

pub use backup::{VolumeRemoteBackup, VolumeRemoteRestore};
pub use hotplug::{AddVolumeOptions, HotplugError, RemoveVolumeOptions};
pub use kubevirt::{VirtualMachine, VirtualMachineInstance};
pub use loadbalancer::{IPPool, LoadBalancer};
pub use networkfs::NetworkFilesystem;
pub use settings::{HotplugMode, Setting};
pub use snapshot::VolumeSnapshot;

/// Unknown fields of an object part, preserved on write-back.
pub type Rest = serde_json::Map<String, serde_json::Value>;

/// Annotation keys Harvester copies from the host Node's labels onto a guest VMI.
pub const TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";
pub const TOPOLOGY_REGION: &str = "topology.kubernetes.io/region";
/// The deprecated (beta) twins of the topology labels. The cloud-provider framework upstream
/// builds on sets both on a guest Node; old manifests still select on these.
pub const FAILURE_DOMAIN_ZONE: &str = "failure-domain.beta.kubernetes.io/zone";
pub const FAILURE_DOMAIN_REGION: &str = "failure-domain.beta.kubernetes.io/region";
