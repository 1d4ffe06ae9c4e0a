//! DHCPv4 leases on behalf of a synthetic MAC address (LoadBalancer Services with `ipam: dhcp`):
//! the cloud provider's DHCP client, its own crate because only the provider uses it.
//!
//! The cloud provider leases an address from the VM network's DHCP server for a MAC that belongs
//! to no interface: one stable, locally administered MAC per Service ([`mac_for`] of the Service
//! UID, kept in the `kube-vip.io/hwaddr` annotation), so the server sees one client per Service.
//!
//! # Shape
//! - A sans-IO core, unit-tested without a network:
//!   - [`wire`]: builds DISCOVER / REQUEST / INIT-REBOOT REQUEST / RELEASE and parses OFFER / ACK /
//!     NAK (never panics on hostile bytes; a property test drives it);
//!   - [`timers`]: T1/T2 from options 58/59 (defaults lease/2 and 7/8 lease), retransmission
//!     backoff with bounded jitter, and the renew/rebind/expire schedule ([`timers::next_step`]);
//!   - [`machine`]: the exchange state machine (`start` / `on_reply` / `on_timeout` -> what to
//!     send next, a lease, or an error). NAK -> rediscover; silence -> retransmit with backoff, then
//!     a named error.
//! - A thin tokio driver ([`acquire`], [`renew`], [`release`]) and a lease keeper ([`maintain`],
//!   [`Maintainer`]) that renews at T1, rebinds at T2 and re-acquires after a loss, reporting
//!   [`LeaseEvent`]s so the caller can count acquired / renewed / failed.
//! - [`route`]: the interface of the default route, where kube-vip leases when its
//!   `vip_interface` is empty (the interface to lease on when nothing else names one).
//!
//! # Talking for a MAC that no interface has
//! Tested against dnsmasq (see `tests/tests/dhcp_netns.rs`):
//! - Every message is a broadcast from `0.0.0.0:68` to `255.255.255.255:67` with the BOOTP
//!   broadcast flag set, `chaddr` = the synthetic MAC and client-id (option 61) = `01` + MAC. The
//!   flag makes the server broadcast its reply; a unicast reply to an address no local interface
//!   holds would be dropped by the kernel.
//! - Renewal and rebinding are INIT-REBOOT-style REQUESTs (`ciaddr` = 0, option 50 = leased address,
//!   no option 54), broadcast. An RFC 2131 RENEW (`ciaddr` set) is answered by unicast to `ciaddr`,
//!   which needs ARP for the synthetic MAC that nobody answers.
//! - RELEASE is broadcast with `ciaddr` = leased address and option 54 = the server.
//!
//! # Sockets and concurrent leases
//! Each exchange opens its own UDP socket bound to `0.0.0.0:68` with `SO_REUSEADDR`,
//! `SO_BROADCAST` and `SO_BINDTODEVICE`, and drops it when done. Linux delivers a broadcast
//! datagram to *every* socket bound to the matching address and port (only a unicast one goes to a
//! single socket of several), and all server replies here are broadcasts, so each concurrent
//! exchange sees every reply and keeps those whose `xid` and `chaddr` are its own. The netns test
//! `concurrent_leases_each_get_their_reply_first_time_root` checks this: six acquisitions and six
//! renewals at once with a single transmission per step (a reply delivered to only one socket
//! would fail an exchange), while a bystander socket on the same port also sees all twelve ACKs.
//!
//! Requirements: the CCM must see the VM network's interface (host network), bind port 68
//! (`CAP_NET_BIND_SERVICE`) and, on kernels before 5.7, `SO_BINDTODEVICE` needs `CAP_NET_RAW`.
//! Another process holding port 68 on the same interface without `SO_REUSEADDR` makes the bind
//! fail with [`DhcpError::Socket`]. A socket lives in the network namespace of the thread that
//! creates it.
//!
//! # Crates: dhcproto + socket2, not mozim
//! - `dhcproto` (wire format only) encodes and decodes the messages and options; its lazy
//!   `borrowed::Message` lets a reply with one malformed option we do not use still be read.
//! - `socket2` sets the socket options tokio's `UdpSocket` lacks (`SO_BINDTODEVICE`,
//!   `SO_REUSEADDR` before bind).
//! - `mozim` (a whole client, with a "proxy" mode acting for another MAC) was considered: its proxy
//!   mode receives through an `AF_PACKET` socket with a BPF filter in promiscuous mode, one raw
//!   socket per client driven by its own event loop, and renews RFC-style (unicast from the leased
//!   address), which does not work for a MAC nobody answers ARP for. A plain UDP socket, INIT-REBOOT
//!   renewals and our own small state machine fit tokio and the CCM's many-leases-per-interface use
//!   better.
//!
//! # Keeping a lease
//! ```no_run
//! # async fn demo() -> Result<(), harvester_dhcp::DhcpError> {
//! use harvester_dhcp::{self as dhcp, DhcpOptions, Maintainer};
//! let opts = DhcpOptions::default();
//! let mac = dhcp::mac_for("0d3b5a3e-5c1f-4a7e-9a34-6a0c2b1f9e11"); // the Service UID
//! let lease = dhcp::acquire("eth1", mac, None, &opts).await?;
//! let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
//! let keeper = Maintainer::spawn(lease, opts, tx); // renews at T1, rebinds at T2
//! # let _ = events.recv().await;
//! keeper.release().await?; // on Service deletion
//! # Ok(()) }
//! ```

mod client;
#[doc(hidden)]
pub mod fuzz;
pub mod mac;
pub mod machine;
mod maintain;
pub mod route;
pub mod timers;
pub mod wire;

use std::net::Ipv4Addr;
use std::time::Duration;

use ipnetwork::Ipv4Network;

pub use client::{Lease, acquire, acquire_hinting, release, renew};
pub use mac::{format_mac, mac_for, parse_mac};
pub use maintain::{LeaseEvent, Maintainer, maintain};
pub use timers::Backoff;

/// Which step of an exchange failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// DISCOVER -> OFFER
    Discover,
    /// REQUEST for an offered address -> ACK
    Request,
    /// INIT-REBOOT REQUEST for a known address (restart, renewal, rebinding) -> ACK
    InitReboot,
    /// RELEASE
    Release,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Discover => "DISCOVER",
            Step::Request => "REQUEST",
            Step::InitReboot => "INIT-REBOOT REQUEST",
            Step::Release => "RELEASE",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DhcpError {
    #[error("DHCP on {iface}: {op}: {source}")]
    Socket {
        iface: String,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("DHCP on {iface} for {mac}: no OFFER after {attempts} DISCOVERs")]
    NoOffer {
        iface: String,
        mac: String,
        attempts: u32,
    },
    #[error(
        "DHCP on {iface} for {mac}: no ACK for {ip} after {attempts} transmissions of the {step}"
    )]
    NoAck {
        iface: String,
        mac: String,
        ip: Ipv4Addr,
        step: Step,
        attempts: u32,
    },
    #[error("DHCP on {iface} for {mac}: server {server} refused {ip} (NAK{})",
        message.as_deref().map(|m| format!(": {m}")).unwrap_or_default())]
    Nak {
        iface: String,
        mac: String,
        ip: Ipv4Addr,
        /// The NAK's server identifier, `0.0.0.0` if it had none.
        server: Ipv4Addr,
        message: Option<String>,
    },
    #[error("DHCP on {iface}: encoding the {step}: {reason}")]
    Encode {
        iface: String,
        step: Step,
        reason: String,
    },
    #[error("bad MAC address {value:?}: {reason}")]
    BadMac { value: String, reason: &'static str },
}

/// How an exchange retransmits and what it accepts. One per Service (the hostname is per lease).
#[derive(Debug, Clone, PartialEq)]
pub struct DhcpOptions {
    /// Timeouts between transmissions of one message (RFC 2131 §4.1 doubles from 4 s with ±1 s).
    pub retransmit: Backoff,
    /// Transmissions of DISCOVER, of the REQUEST, and of a renewal before giving up (≥ 1).
    pub attempts: u32,
    /// Transmissions of the INIT-REBOOT REQUEST for a requested address before falling back to
    /// DISCOVER (a non-authoritative server stays silent for addresses it does not know).
    pub init_reboot_attempts: u32,
    /// Rediscoveries after a NAK (or an unanswered REQUEST) before an acquisition gives up with
    /// that NAK (or `NoAck`): a NAK storm ends here.
    pub max_restarts: u32,
    /// Lease time assumed when an ACK has no option 51.
    pub default_lease: Duration,
    /// Shortest wait between renewal (or rebinding) attempts after a failed one (RFC: 60 s).
    pub min_renew_interval: Duration,
    /// Delay between re-acquisitions by [`maintain`] after the lease was lost (kube-vip: 10 s to
    /// 1 min).
    pub reacquire: Backoff,
    /// Option 12 hostname sent with DISCOVER and REQUEST (dnsmasq records it in its lease file).
    pub hostname: Option<String>,
    /// Only accept offers inside this network (offers elsewhere are ignored).
    pub allowed: Option<Ipv4Network>,
}

impl Default for DhcpOptions {
    fn default() -> Self {
        DhcpOptions {
            retransmit: Backoff::new(Duration::from_secs(2), Duration::from_secs(8), 10),
            attempts: 4,
            init_reboot_attempts: 2,
            max_restarts: 3,
            default_lease: Duration::from_secs(3600),
            min_renew_interval: Duration::from_secs(60),
            reacquire: Backoff::new(Duration::from_secs(10), Duration::from_secs(60), 10),
            hostname: None,
            allowed: None,
        }
    }
}

impl DhcpOptions {
    /// The longest [`acquire`] waits when no server answers at all: the INIT-REBOOT attempts (with
    /// a requested address) and the DISCOVER attempts, each timeout at its jittered maximum.
    pub fn silent_server_bound(&self, requested: bool) -> Duration {
        let discover = self.retransmit.upper_bound(self.attempts.max(1));
        if requested {
            discover + self.retransmit.upper_bound(self.init_reboot_attempts)
        } else {
            discover
        }
    }
}
