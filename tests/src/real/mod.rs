//! Real things on this machine that the bed drives: the guest node (containerd + kubelet), its
//! images and Pod network, the kubelet plugin registrar and livenessprobe, a QEMU guest, an NFS
//! server, network namespaces with dnsmasq, mounts and pod logs. Rule: a module here uses
//! `util` and the API-server parts of `bed` (`bed::{cluster, certs, apply, rbac, crds}`), never
//! the stand-in (`sim`) or the composed bed (`bed::TestBed`).

pub mod images;
pub mod livenessprobe;
pub mod mounts;
pub mod netns;
pub mod nfs;
pub mod node;
pub mod pod_logs;
pub mod podnet;
pub mod registrar;
pub mod vm;
