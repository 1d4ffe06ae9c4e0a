//! The network namespace NFS mounts of RWX volumes are made in.
//!
//! The kernel's NFS client keeps its sockets in the network namespace of the process that called
//! mount(2). A node plugin Pod without host network that mounts from its own namespace leaves every
//! RWX mount depending on that namespace: when the Pod is replaced (upgrade, eviction, crash) the
//! CNI deletes its interfaces and the mounts lose their server. Upstream runs its mounts in the
//! host's namespaces through nsenter (harvester/harvester-csi-driver v0.2.x
//! `pkg/csi/node_server.go` `nodeStageRWXVolume`: `cmd.NewExecutorWithNS(
//! common.GetHostNamespacePath("/proc"))`), which is why upstream's chart gives the node DaemonSet
//! `hostPID: true` and no host network (harvester/charts `harvester-csi-driver`
//! `templates/daemonset.yaml`). Ours runs it with `hostNetwork: true`.
//!
//! So: when PID 1's network namespace (the host's, visible through hostPID) is not ours, the
//! mount helper runs in it (`nsenter --net=/proc/1/ns/net mount.nfs ...`), keeping our mount
//! namespace so that the Bidirectional propagation still carries the mount to the kubelet. When it
//! is ours, we are on the host's network, or we cannot see the host at all (neither hostPID nor
//! host network): then one warning at start says what to set.
//!
//! Telling "host network without hostPID" (our chart) from "neither" uses the UTS namespace: the
//! container runtime gives a hostNetwork Pod the host's UTS namespace too (containerd v1.7.28
//! `pkg/cri/sbserver/podsandbox/sandbox_run_linux.go`: `NamespaceMode_NODE` drops both the
//! network and the UTS namespace), and the initial PID
//! and UTS namespaces have inode numbers fixed by the kernel since Linux 3.8
//! (`include/linux/proc_ns.h`: `PROC_UTS_INIT_INO`, `PROC_PID_INIT_INO`). On a node that is
//! itself a container (kind), neither is initial: the warning may then be printed needlessly, the
//! choice of namespace is unaffected.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// `PROC_PID_INIT_INO` (include/linux/proc_ns.h, since Linux 3.8).
pub const INIT_PID_NS: u64 = 0xEFFF_FFFC;
/// `PROC_UTS_INIT_INO` (include/linux/proc_ns.h, since Linux 3.8).
pub const INIT_UTS_NS: u64 = 0xEFFF_FFFE;

/// The namespace inodes the choice depends on; `None` where `/proc` would not tell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Namespaces {
    /// `/proc/self/ns/net`.
    pub own_net: Option<u64>,
    /// `/proc/1/ns/net`: the host's with hostPID, else this Pod's first process's.
    pub init_net: Option<u64>,
    /// `/proc/self/ns/pid`.
    pub own_pid: Option<u64>,
    /// `/proc/self/ns/uts`.
    pub own_uts: Option<u64>,
}

/// Where the NFS mount helper runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NfsNetns {
    /// In the plugin's own network namespace.
    Own,
    /// In the network namespace at this path (`<proc>/1/ns/net`), through `nsenter --net=`.
    Enter(PathBuf),
}

/// What to do, and why (for the start-up log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub netns: NfsNetns,
    pub reason: &'static str,
    /// Set when RWX mounts will not outlive this Pod.
    pub warning: Option<&'static str>,
}

const WARNING: &str = "the node plugin shares neither the host's PID namespace (hostPID) nor its \
    network (hostNetwork): NFS mounts of RWX volumes are made in this Pod's network namespace and \
    lose their server when the Pod is replaced; set hostPID: true (as upstream's chart does) or \
    hostNetwork: true (as ours does) on the node plugin's DaemonSet";

/// The choice for the namespaces `ns` (pure); `proc` is where `/proc` is mounted.
pub fn choose(ns: &Namespaces, proc: &Path) -> Choice {
    let own = |reason, warning| Choice {
        netns: NfsNetns::Own,
        reason,
        warning,
    };
    let host_uts = ns.own_uts == Some(INIT_UTS_NS);
    match (ns.own_net, ns.init_net) {
        (Some(own_net), Some(init_net)) if own_net != init_net => Choice {
            netns: NfsNetns::Enter(proc.join("1/ns/net")),
            reason: "PID 1 (the host's, through hostPID) is in another network namespace: \
                     NFS mounts are made in it",
            warning: None,
        },
        (Some(_), Some(_)) if ns.own_pid == Some(INIT_PID_NS) => own(
            "the host's PID 1 shares this network namespace: it is the host's",
            None,
        ),
        _ if host_uts => own(
            "the host's UTS namespace, which a Pod has with host network: mounting from it",
            None,
        ),
        (Some(_), Some(_)) => own(
            "PID 1 is this Pod's own and shares its network namespace",
            Some(WARNING),
        ),
        _ => own(
            "the network namespaces in /proc cannot be read",
            Some(WARNING),
        ),
    }
}

/// Reads the namespace inodes from `proc` (a link that cannot be read is `None`).
pub fn read(proc: &Path) -> Namespaces {
    let ino = |p: &str| std::fs::metadata(proc.join(p)).ok().map(|m| m.ino());
    Namespaces {
        own_net: ino("self/ns/net"),
        init_net: ino("1/ns/net"),
        own_pid: ino("self/ns/pid"),
        own_uts: ino("self/ns/uts"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD_NET: u64 = 4026532300;
    const HOST_NET: u64 = 4026531840;
    const POD_PID: u64 = 4026532301;
    const POD_UTS: u64 = 4026532302;

    fn ns(own_net: u64, init_net: Option<u64>, pid: u64, uts: u64) -> Namespaces {
        Namespaces {
            own_net: Some(own_net),
            init_net,
            own_pid: Some(pid),
            own_uts: Some(uts),
        }
    }

    #[test]
    fn the_netns_follows_the_pods_namespaces() {
        let host = NfsNetns::Enter(PathBuf::from("/proc/1/ns/net"));
        // (case, namespaces, where the mount helper runs, warned)
        let rows = [
            (
                "upstream's chart: hostPID, no host network",
                ns(POD_NET, Some(HOST_NET), INIT_PID_NS, POD_UTS),
                host.clone(),
                false,
            ),
            (
                "hostPID on a nested node (PID 1 the node container's init)",
                ns(POD_NET, Some(HOST_NET), POD_PID, POD_UTS),
                host.clone(),
                false,
            ),
            (
                "our chart: host network, no hostPID (PID 1 is the Pod's)",
                ns(HOST_NET, Some(HOST_NET), POD_PID, INIT_UTS_NS),
                NfsNetns::Own,
                false,
            ),
            (
                "host network and hostPID",
                ns(HOST_NET, Some(HOST_NET), INIT_PID_NS, INIT_UTS_NS),
                NfsNetns::Own,
                false,
            ),
            (
                "run on the host itself (not in a Pod)",
                ns(HOST_NET, Some(HOST_NET), INIT_PID_NS, INIT_UTS_NS),
                NfsNetns::Own,
                false,
            ),
            (
                "neither hostPID nor host network",
                ns(POD_NET, Some(POD_NET), POD_PID, POD_UTS),
                NfsNetns::Own,
                true,
            ),
            (
                "PID 1 unreadable, host network",
                ns(HOST_NET, None, POD_PID, INIT_UTS_NS),
                NfsNetns::Own,
                false,
            ),
            (
                "PID 1 unreadable, Pod network",
                ns(POD_NET, None, POD_PID, POD_UTS),
                NfsNetns::Own,
                true,
            ),
            (
                "nothing readable",
                Namespaces::default(),
                NfsNetns::Own,
                true,
            ),
        ];
        for (case, namespaces, netns, warned) in rows {
            let c = choose(&namespaces, Path::new("/proc"));
            assert_eq!(c.netns, netns, "{case}: {}", c.reason);
            assert_eq!(c.warning.is_some(), warned, "{case}: {}", c.reason);
        }
    }

    #[test]
    fn the_warning_says_what_to_set() {
        let c = choose(&ns(1, Some(1), 2, 3), Path::new("/proc"));
        let w = c.warning.unwrap_or_default();
        assert!(
            w.contains("hostPID: true") && w.contains("hostNetwork: true"),
            "{w}"
        );
        assert!(w.contains("RWX"), "{w}");
    }

    #[test]
    fn this_process_reads_its_namespaces() {
        let ns = read(Path::new("/proc"));
        assert!(ns.own_net.is_some() && ns.own_pid.is_some() && ns.own_uts.is_some());
        assert!(read(Path::new("/nonexistent")).own_net.is_none());
    }
}
