//! The tokio driver: one UDP socket per exchange, fed to the state machine.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;
use tokio::time::Instant;

use super::mac::format_mac;
use super::machine::{Action, Bound, Exchange};
use super::timers::{Timers, random_seed};
use super::wire::{self, CLIENT_PORT, SERVER_PORT};
use super::{DhcpError, DhcpOptions, Step};

/// An address leased for a synthetic MAC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The interface the lease was obtained on (renewals and the release go out there).
    pub iface: String,
    pub mac: [u8; 6],
    pub ip: Ipv4Addr,
    /// Option 54 of the ACK: the server that holds the lease.
    pub server_id: Ipv4Addr,
    pub lease_time: Duration,
    /// Renew from `obtained_at + t1`, rebind from `obtained_at + t2`.
    pub t1: Duration,
    pub t2: Duration,
    /// When the REQUEST that the server acknowledged was first sent (RFC 2131 §4.4.1: the lease
    /// runs from then, so the client's view never outlasts the server's).
    pub obtained_at: Instant,
    pub subnet_mask: Option<Ipv4Addr>,
    pub router: Option<Ipv4Addr>,
}

impl Lease {
    fn from_bound(iface: &str, mac: [u8; 6], b: Bound, obtained_at: Instant) -> Lease {
        Lease {
            iface: iface.to_string(),
            mac,
            ip: b.ip,
            server_id: b.server_id,
            lease_time: b.timers.lease,
            t1: b.timers.t1,
            t2: b.timers.t2,
            obtained_at,
            subnet_mask: b.subnet_mask,
            router: b.router,
        }
    }

    pub fn timers(&self) -> Timers {
        Timers {
            lease: self.lease_time,
            t1: self.t1,
            t2: self.t2,
        }
    }

    pub fn renew_at(&self) -> Instant {
        self.obtained_at + self.t1
    }

    pub fn rebind_at(&self) -> Instant {
        self.obtained_at + self.t2
    }

    pub fn expires_at(&self) -> Instant {
        self.obtained_at + self.lease_time
    }

    /// The MAC as `aa:bb:cc:dd:ee:ff`, for the `kube-vip.io/hwaddr` annotation.
    pub fn mac_string(&self) -> String {
        format_mac(&self.mac)
    }
}

/// Leases an address for `mac` on `iface`. With `requested` (the address held before a restart,
/// from `kube-vip.io/requestedIP`) it first asks for that address (INIT-REBOOT), then falls back to
/// DISCOVER hinting it. Needs `CAP_NET_BIND_SERVICE` (port 68; see the module doc) and runs in the
/// caller's network namespace. Without any answer it returns `NoOffer` within
/// [`DhcpOptions::silent_server_bound`].
pub async fn acquire(
    iface: &str,
    mac: [u8; 6],
    requested: Option<Ipv4Addr>,
    opts: &DhcpOptions,
) -> Result<Lease, DhcpError> {
    let ex = Exchange::acquire(iface, mac, requested, opts, random_seed());
    let started = Instant::now();
    let lease = run(iface, mac, ex).await?;
    tracing::info!(
        iface, mac = %format_mac(&mac), ip = %lease.ip, server = %lease.server_id,
        lease_secs = lease.lease_time.as_secs(), took_ms = started.elapsed().as_millis() as u64,
        "DHCP lease acquired"
    );
    Ok(lease)
}

/// Leases an address for `mac` on `iface`, asking for `wanted` (a Service's requested address)
/// straight away: DISCOVER carries it as option 50 (RFC 2131 §4.4.1), and a server offers it when
/// it is free and in its range, another address otherwise (the caller compares). No INIT-REBOOT
/// first: the address was never leased to this MAC, and a server that is not authoritative stays
/// silent to an INIT-REBOOT for an address it does not know, which would only add its timeouts.
pub async fn acquire_hinting(
    iface: &str,
    mac: [u8; 6],
    wanted: Ipv4Addr,
    opts: &DhcpOptions,
) -> Result<Lease, DhcpError> {
    let opts = DhcpOptions {
        init_reboot_attempts: 0,
        ..opts.clone()
    };
    acquire(iface, mac, Some(wanted), &opts).await
}

/// Renews (or rebinds) `lease` with an INIT-REBOOT-style broadcast REQUEST for its address. Returns
/// the extended lease; `Nak` means the address is lost, `NoAck` that no server answered (keep the
/// old lease until it expires and try again).
pub async fn renew(lease: &Lease, opts: &DhcpOptions) -> Result<Lease, DhcpError> {
    let ex = Exchange::renew(&lease.iface, lease.mac, lease.ip, opts, random_seed());
    let renewed = run(&lease.iface, lease.mac, ex).await?;
    tracing::debug!(iface = %lease.iface, mac = %format_mac(&lease.mac), ip = %renewed.ip, "DHCP lease renewed");
    Ok(renewed)
}

/// Gives `lease` back to its server (one broadcast RELEASE; there is no answer to wait for).
pub async fn release(lease: &Lease) -> Result<(), DhcpError> {
    let msg = wire::release(&lease.mac, random_seed() as u32, lease.ip, lease.server_id);
    let packet = wire::encode(&msg).map_err(|reason| DhcpError::Encode {
        iface: lease.iface.clone(),
        step: Step::Release,
        reason,
    })?;
    let sock = open_socket(&lease.iface)?;
    send(&sock, &lease.iface, &packet).await?;
    tracing::info!(iface = %lease.iface, mac = %format_mac(&lease.mac), ip = %lease.ip, "DHCP lease released");
    Ok(())
}

async fn run(iface: &str, mac: [u8; 6], mut ex: Exchange) -> Result<Lease, DhcpError> {
    let sock = open_socket(iface)?;
    let mut buf = vec![0u8; 4096];
    let mut action = ex.start();
    let mut deadline = Instant::now();
    let mut step_started = Instant::now();
    loop {
        match action {
            Action::Send {
                packet,
                timeout,
                first,
                step,
            } => {
                let now = Instant::now();
                if first {
                    step_started = now;
                }
                tracing::trace!(iface, mac = %format_mac(&mac), %step, xid = ex.xid(), "DHCP send");
                send(&sock, iface, &packet).await?;
                deadline = now + timeout;
            }
            Action::Ignored(why) => {
                tracing::debug!(iface, mac = %format_mac(&mac), why, "DHCP reply ignored");
            }
            Action::Bound(b) => return Ok(Lease::from_bound(iface, mac, b, step_started)),
            Action::Failed(e) => return Err(e),
        }
        action = match tokio::time::timeout_at(deadline, sock.recv_from(&mut buf)).await {
            Err(_elapsed) => ex.on_timeout(),
            Ok(Err(source)) => {
                return Err(DhcpError::Socket {
                    iface: iface.to_string(),
                    op: "receiving",
                    source,
                });
            }
            Ok(Ok((n, from))) => match wire::parse_reply(&buf[..n]) {
                Ok(reply) => ex.on_reply(&reply),
                Err(e) => {
                    tracing::debug!(iface, %from, error = %e, "DHCP: dropped a malformed datagram");
                    Action::Ignored("malformed datagram")
                }
            },
        };
    }
}

async fn send(sock: &UdpSocket, iface: &str, packet: &[u8]) -> Result<(), DhcpError> {
    let to = SocketAddrV4::new(Ipv4Addr::BROADCAST, SERVER_PORT);
    sock.send_to(packet, to)
        .await
        .map(|_| ())
        .map_err(|source| DhcpError::Socket {
            iface: iface.to_string(),
            op: "sending to 255.255.255.255:67",
            source,
        })
}

/// `0.0.0.0:68` with `SO_REUSEADDR` (several exchanges at once), `SO_BROADCAST` and
/// `SO_BINDTODEVICE` (only this interface's traffic, and broadcasts leave through it).
fn open_socket(iface: &str) -> Result<UdpSocket, DhcpError> {
    let err = |op: &'static str| {
        move |source| DhcpError::Socket {
            iface: iface.to_string(),
            op,
            source,
        }
    };
    let sock = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))
        .map_err(err("opening a UDP socket"))?;
    sock.set_reuse_address(true)
        .map_err(err("setting SO_REUSEADDR"))?;
    sock.set_broadcast(true)
        .map_err(err("setting SO_BROADCAST"))?;
    sock.bind_device(Some(iface.as_bytes()))
        .map_err(err("binding to the interface (SO_BINDTODEVICE)"))?;
    sock.set_nonblocking(true)
        .map_err(err("setting O_NONBLOCK"))?;
    let addr = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, CLIENT_PORT);
    sock.bind(&addr.into())
        .map_err(err("binding 0.0.0.0:68 (needs CAP_NET_BIND_SERVICE)"))?;
    UdpSocket::from_std(sock.into()).map_err(err("registering with tokio"))
}

#[cfg(test)]
mod tests {
    use dhcproto::v4::{self, DhcpOption, MessageType, OptionCode};
    use dhcproto::{Decodable, Decoder};

    use super::*;

    /// What `acquire_hinting` runs: without INIT-REBOOT attempts, a requested address goes out in
    /// the first DISCOVER as option 50.
    #[test]
    fn a_wanted_address_is_hinted_in_the_first_discover() {
        let wanted = Ipv4Addr::new(10, 77, 0, 150);
        let opts = DhcpOptions {
            init_reboot_attempts: 0,
            ..DhcpOptions::default()
        };
        let mut ex = Exchange::acquire("eth1", [2, 0, 0, 0, 0, 1], Some(wanted), &opts, 7);
        let Action::Send { packet, step, .. } = ex.start() else {
            panic!("the exchange starts by sending");
        };
        assert_eq!(step, Step::Discover);
        let m = v4::Message::decode(&mut Decoder::new(&packet)).expect("a DHCP message");
        assert_eq!(m.opts().msg_type(), Some(MessageType::Discover));
        assert_eq!(
            m.opts().get(OptionCode::RequestedIpAddress),
            Some(&DhcpOption::RequestedIpAddress(wanted))
        );
    }
}
