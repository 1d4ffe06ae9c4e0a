//! The real guest node's Pod network (issue 15): a Linux bridge on a private /24 that the CNI
//! `bridge` plugin attaches Pods to, and, instead of kube-proxy, two TCP splices on host
//! addresses so Pods reach the bed's API servers, which listen on 127.0.0.1 only:
//! - the guest `kubernetes` Service VIP (`KUBERNETES_VIP:443`, what in-cluster clients dial from
//!   `KUBERNETES_SERVICE_HOST/PORT`), an address put on `lo`, spliced to the guest API server;
//! - the bridge's gateway address at the Harvester API server's port, spliced to it (the
//!   cloud-config the charts get names `https://GATEWAY:<port>`).
//!
//! No forwarding or NAT is turned on: Pods only talk to addresses of the host itself, and
//! nothing leaves the machine. Dropping it removes the bridge and the VIP and stops the splices.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::BedError;

/// The bridge the CNI plugin attaches Pods to (at most 15 characters, a Linux limit).
pub const BRIDGE: &str = "hvtb0";
/// The bridge's MAC, set explicitly: a Linux bridge with a kernel-chosen MAC takes the lowest
/// MAC of its ports, so it changes as Pods come and go, and every Pod's ARP entry for the
/// gateway goes stale: Pods then lose the host (API servers, probes' replies) for 30-60 s.
pub const BRIDGE_MAC: &str = "02:68:76:74:62:30";
/// The bridge's address: the Pods' gateway, and the host as Pods see it.
pub const GATEWAY: &str = "172.31.250.1";
pub const POD_SUBNET: &str = "172.31.250.0/24";
/// The guest cluster's `kubernetes` Service address: the first of its service CIDR.
pub const KUBERNETES_VIP: &str = "10.96.0.1";
/// The guest API server's service CIDR (the bed passes it to kube-apiserver).
pub const GUEST_SERVICE_CIDR: &str = "10.96.0.0/16";

/// The CNI network config (`.conflist`) of the node: the bridge plugin on [`BRIDGE`] as the Pods'
/// gateway, host-local addresses of [`POD_SUBNET`] (state under `ipam_dir`), no IP masquerade.
pub fn cni_conflist(ipam_dir: &Path) -> String {
    serde_json::json!({
        "cniVersion": "0.4.0",
        "name": "testbed",
        "plugins": [{
            "type": "bridge",
            "bridge": BRIDGE,
            "isGateway": true,
            "ipMasq": false,
            "hairpinMode": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": ipam_dir,
            },
        }],
    })
    .to_string()
}

/// `ip ARGS`, its stderr in the error.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Where containerd's CRI plugin and `ip netns` mount named network namespaces (`/var/run/netns`,
/// a link to `/run` on Debian).
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// Makes [`NETNS_RUN_DIR`] a shared mount point of its own, as the first `ip netns add` after a
/// boot does (iproute2 `ip/ipnetns.c` `netns_add`: `MS_SHARED|MS_REC` on the directory, and on
/// `EINVAL`, not a mount point yet, first a `MS_BIND|MS_REC` bind of it onto itself). Called
/// before containerd starts: when that first `ip netns add` comes from a DHCP suite in the other
/// lane while containerd has Pods, the new bind covers their namespace mounts; containerd's
/// `umount` of a Pod's namespace then takes the bind's copy and its `unlink` hits the covered
/// mount (`device or resource busy`), and the Pod stays Terminating for good (a fresh machine's
/// first `make test`, 4 Dec: `install_docs` waited 20 minutes on `kubectl delete pod`).
pub fn ensure_netns_run_dir() -> Result<(), BedError> {
    use crate::real::{mounts::mount_points, netns::run};
    let io = |e: std::io::Error| BedError::Setup(format!("{NETNS_RUN_DIR} as a mount point: {e}"));
    std::fs::create_dir_all(NETNS_RUN_DIR).map_err(io)?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(io)?;
    if !mount_points(&mountinfo).any(|p| p == Path::new(NETNS_RUN_DIR)) {
        run("mount", &["--rbind", NETNS_RUN_DIR, NETNS_RUN_DIR])?;
    }
    run("mount", &["--make-rshared", NETNS_RUN_DIR])
}

/// The bridge, the VIP and the splices. Only one can exist on a machine at a time (fixed
/// addresses): a second start fails naming what is taken.
pub struct PodNetwork {
    splices: JoinSet<()>,
    bridge_added: bool,
    vip_added: bool,
}

impl PodNetwork {
    /// Creates the bridge and the VIP and starts the splices `KUBERNETES_VIP:443 -> guest` and
    /// `GATEWAY:<harvester port> -> harvester` (both targets on 127.0.0.1).
    pub async fn start(guest: SocketAddr, harvester: SocketAddr) -> Result<PodNetwork, BedError> {
        let mut net = PodNetwork {
            splices: JoinSet::new(),
            bridge_added: false,
            vip_added: false,
        };
        let setup = |e: String| BedError::Setup(format!("the Pod network: {e}"));
        ip(&["link", "add", BRIDGE, "type", "bridge"]).map_err(|e| {
            setup(format!(
                "{e} (is another real guest cluster running on this machine?)"
            ))
        })?;
        net.bridge_added = true;
        ip(&["link", "set", "dev", BRIDGE, "address", BRIDGE_MAC]).map_err(setup)?;
        ip(&["addr", "add", &format!("{GATEWAY}/24"), "dev", BRIDGE]).map_err(setup)?;
        ip(&["link", "set", BRIDGE, "up"]).map_err(setup)?;
        // `replace`, not `add`: with the bridge free, a VIP already on `lo` is what a bed that
        // was killed (SIGKILL, no Drop) left behind, not another cluster.
        ip(&[
            "addr",
            "replace",
            &format!("{KUBERNETES_VIP}/32"),
            "dev",
            "lo",
        ])
        .map_err(setup)?;
        net.vip_added = true;
        for (listen, target) in [
            (
                SocketAddr::new(KUBERNETES_VIP.parse().expect("an IP"), 443),
                guest,
            ),
            (
                SocketAddr::new(GATEWAY.parse().expect("an IP"), harvester.port()),
                harvester,
            ),
        ] {
            let listener = TcpListener::bind(listen)
                .await
                .map_err(|e| setup(format!("listening on {listen}: {e}")))?;
            net.splices.spawn(splice(listener, target));
        }
        Ok(net)
    }
}

/// Accepts on `listener` and copies each connection both ways to `target` until either closes.
pub(crate) async fn splice(listener: TcpListener, target: SocketAddr) {
    let mut conns = JoinSet::new();
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            continue;
        };
        conns.spawn(async move {
            if let Ok(mut outbound) = TcpStream::connect(target).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
        while conns.try_join_next().is_some() {}
    }
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        self.splices.abort_all();
        if self.vip_added
            && let Err(e) = ip(&["addr", "del", &format!("{KUBERNETES_VIP}/32"), "dev", "lo"])
        {
            eprintln!("pod network: {e}");
        }
        if self.bridge_added
            && let Err(e) = ip(&["link", "del", BRIDGE])
        {
            eprintln!("pod network: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflist_makes_the_bridge_the_gateway_without_masquerade() {
        let c: serde_json::Value =
            serde_json::from_str(&cni_conflist(Path::new("/n/ipam"))).expect("JSON");
        let bridge = &c["plugins"][0];
        assert_eq!(bridge["type"], "bridge");
        assert_eq!(bridge["bridge"], BRIDGE);
        assert_eq!(bridge["isGateway"], true);
        assert_eq!(bridge["ipMasq"], false);
        assert_eq!(bridge["ipam"]["ranges"][0][0]["gateway"], GATEWAY);
        assert_eq!(bridge["ipam"]["dataDir"], "/n/ipam");
        let vip: std::net::Ipv4Addr = KUBERNETES_VIP.parse().unwrap();
        let cidr: ipnetwork::Ipv4Network = GUEST_SERVICE_CIDR.parse().unwrap();
        assert_eq!(
            cidr.nth(1),
            Some(vip),
            "the VIP is the CIDR's first address"
        );
        assert!(BRIDGE.len() <= 15);
    }
}
