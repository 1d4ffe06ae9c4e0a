//! The exchange state machine, sans I/O: it says what to send and how long to wait, and is fed
//! the replies and timeouts. One `Exchange` is one acquisition or one renewal.
//!
//! ```text
//! acquire(requested = Some(ip)):  INIT-REBOOT(ip) --ACK--> bound
//!                                   |  NAK, or silent for init_reboot_attempts
//!                                   v
//! acquire(None):                  SELECTING (DISCOVER) --OFFER--> REQUESTING --ACK--> bound
//!                                   ^                               |
//!                                   +------- NAK / no ACK ----------+  (at most max_restarts)
//! renew(ip):                      INIT-REBOOT(ip) --ACK--> bound; NAK or silence -> error
//! ```
//! Retransmissions reuse the step's `xid` (a late answer to an earlier copy still counts) and
//! wait per [`DhcpOptions::retransmit`]. Replies for another `xid`, `chaddr` or client-id, and
//! offers of unusable addresses, are ignored.
//!
//! Just over 700 lines: about 360 of code and the transition tests beside it, kept in one file so
//! a change to a transition and its test are read together.

use std::net::Ipv4Addr;
use std::time::Duration;

use super::mac::format_mac;
use super::timers::{Rng, Timers};
use super::wire::{self, Reply, ReplyKind};
use super::{DhcpError, DhcpOptions, Step};

/// A lease the server committed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    pub ip: Ipv4Addr,
    pub server_id: Ipv4Addr,
    pub timers: Timers,
    pub subnet_mask: Option<Ipv4Addr>,
    pub router: Option<Ipv4Addr>,
}

/// What the driver does next.
#[derive(Debug)]
pub enum Action {
    /// Broadcast `packet`, then wait up to `timeout` for replies. `first` is the first
    /// transmission of this step's message (the lease starts at the first REQUEST that was
    /// answered, so the driver notes the time).
    Send {
        packet: Vec<u8>,
        timeout: Duration,
        first: bool,
        step: Step,
    },
    /// The reply was not for this exchange or not useful now; keep waiting until the deadline.
    Ignored(&'static str),
    Bound(Bound),
    Failed(DhcpError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    InitReboot { ip: Ipv4Addr },
    Selecting,
    Requesting { ip: Ipv4Addr, server: Ipv4Addr },
    Done,
}

#[derive(Debug)]
pub struct Exchange {
    iface: String,
    mac: [u8; 6],
    opts: DhcpOptions,
    /// A renewal: NAK or silence ends it with an error instead of a rediscovery.
    renewing: bool,
    /// Address hinted in DISCOVER (option 50); dropped after a NAK.
    hint: Option<Ipv4Addr>,
    state: State,
    xid: u32,
    /// Transmissions of the current step's message so far, minus one.
    attempt: u32,
    restarts: u32,
    rng: Rng,
}

impl Exchange {
    /// An acquisition; with `requested` it first asks for that address (INIT-REBOOT).
    pub fn acquire(
        iface: &str,
        mac: [u8; 6],
        requested: Option<Ipv4Addr>,
        opts: &DhcpOptions,
        seed: u64,
    ) -> Exchange {
        let state = match requested {
            Some(ip) if opts.init_reboot_attempts > 0 => State::InitReboot { ip },
            _ => State::Selecting,
        };
        Exchange::new(iface, mac, opts, seed, false, requested, state)
    }

    /// A renewal (or rebinding) of `ip`: an INIT-REBOOT-style REQUEST, broadcast.
    pub fn renew(
        iface: &str,
        mac: [u8; 6],
        ip: Ipv4Addr,
        opts: &DhcpOptions,
        seed: u64,
    ) -> Exchange {
        Exchange::new(
            iface,
            mac,
            opts,
            seed,
            true,
            Some(ip),
            State::InitReboot { ip },
        )
    }

    fn new(
        iface: &str,
        mac: [u8; 6],
        opts: &DhcpOptions,
        seed: u64,
        renewing: bool,
        hint: Option<Ipv4Addr>,
        state: State,
    ) -> Exchange {
        Exchange {
            iface: iface.to_string(),
            mac,
            opts: opts.clone(),
            renewing,
            hint,
            state,
            xid: 0,
            attempt: 0,
            restarts: 0,
            rng: Rng::new(seed),
        }
    }

    /// The transaction id of the current step.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// The first transmission.
    pub fn start(&mut self) -> Action {
        self.enter(self.state, true)
    }

    /// The wait after the last transmission ended without a useful reply.
    pub fn on_timeout(&mut self) -> Action {
        if self.state == State::Done {
            return Action::Ignored("exchange finished");
        }
        self.attempt += 1;
        let limit = self.limit();
        if self.attempt < limit {
            return self.transmit(false);
        }
        match self.state {
            State::InitReboot { .. } if !self.renewing => self.enter(State::Selecting, true),
            State::InitReboot { ip } => self.fail(DhcpError::NoAck {
                iface: self.iface.clone(),
                mac: format_mac(&self.mac),
                ip,
                step: Step::InitReboot,
                attempts: limit,
            }),
            State::Selecting => self.fail(DhcpError::NoOffer {
                iface: self.iface.clone(),
                mac: format_mac(&self.mac),
                attempts: limit,
            }),
            State::Requesting { ip, .. } => {
                let err = DhcpError::NoAck {
                    iface: self.iface.clone(),
                    mac: format_mac(&self.mac),
                    ip,
                    step: Step::Request,
                    attempts: limit,
                };
                self.restart(err)
            }
            State::Done => Action::Ignored("exchange finished"),
        }
    }

    /// A parsed reply received while waiting.
    pub fn on_reply(&mut self, reply: &Reply) -> Action {
        if self.state == State::Done {
            return Action::Ignored("exchange finished");
        }
        if reply.xid != self.xid {
            return Action::Ignored("another transaction id");
        }
        if reply.chaddr != self.mac {
            return Action::Ignored("another client's chaddr");
        }
        if reply
            .client_id
            .as_ref()
            .is_some_and(|id| *id != wire::client_id(&self.mac))
        {
            return Action::Ignored("another client's client-id");
        }
        match (self.state, reply.kind) {
            (State::Selecting, ReplyKind::Offer) => {
                let Some(server) = reply.server_id else {
                    return Action::Ignored("OFFER without a server identifier");
                };
                if !usable(reply.yiaddr) {
                    return Action::Ignored(
                        "OFFER of an address that is not a usable unicast address",
                    );
                }
                if self
                    .opts
                    .allowed
                    .is_some_and(|net| !net.contains(reply.yiaddr))
                {
                    return Action::Ignored("OFFER outside the allowed network");
                }
                // The REQUEST in SELECTING state keeps the DISCOVER's xid.
                self.state = State::Requesting {
                    ip: reply.yiaddr,
                    server,
                };
                self.attempt = 0;
                self.transmit(true)
            }
            (State::Requesting { ip, server }, ReplyKind::Ack) => {
                if reply.yiaddr != ip {
                    return Action::Ignored("ACK for another address");
                }
                if reply.server_id.is_some_and(|s| s != server) {
                    return Action::Ignored("ACK from a server we did not select");
                }
                self.bound(reply, server)
            }
            (State::Requesting { ip, server }, ReplyKind::Nak) => {
                if reply.server_id.is_some_and(|s| s != server) {
                    return Action::Ignored("NAK from a server we did not select");
                }
                let err = self.nak(ip, reply);
                self.hint = None;
                self.restart(err)
            }
            (State::InitReboot { ip }, ReplyKind::Ack) => {
                if reply.yiaddr != ip {
                    return Action::Ignored("ACK for another address");
                }
                let Some(server) = reply.server_id else {
                    return Action::Ignored("ACK without a server identifier");
                };
                self.bound(reply, server)
            }
            (State::InitReboot { ip }, ReplyKind::Nak) => {
                let err = self.nak(ip, reply);
                if self.renewing {
                    return self.fail(err);
                }
                self.hint = None;
                self.restart(err)
            }
            _ => Action::Ignored("message type not expected at this step"),
        }
    }

    fn limit(&self) -> u32 {
        match self.state {
            State::InitReboot { .. } if !self.renewing => self.opts.init_reboot_attempts.max(1),
            _ => self.opts.attempts.max(1),
        }
    }

    fn enter(&mut self, state: State, first: bool) -> Action {
        self.state = state;
        self.xid = self.rng.next_u32();
        self.attempt = 0;
        self.transmit(first)
    }

    fn restart(&mut self, err: DhcpError) -> Action {
        self.restarts += 1;
        if self.restarts > self.opts.max_restarts {
            return self.fail(err);
        }
        tracing::debug!(iface = %self.iface, mac = %format_mac(&self.mac), error = %err, "DHCP: rediscovering");
        self.enter(State::Selecting, true)
    }

    fn transmit(&mut self, first: bool) -> Action {
        let hostname = self.opts.hostname.as_deref();
        let (msg, step) = match self.state {
            State::InitReboot { ip } => (
                wire::request_init_reboot(&self.mac, self.xid, ip, hostname),
                Step::InitReboot,
            ),
            State::Selecting => (
                wire::discover(&self.mac, self.xid, self.hint, hostname),
                Step::Discover,
            ),
            State::Requesting { ip, server } => (
                wire::request_selecting(&self.mac, self.xid, ip, server, hostname),
                Step::Request,
            ),
            State::Done => return Action::Ignored("exchange finished"),
        };
        match wire::encode(&msg) {
            Ok(packet) => Action::Send {
                packet,
                timeout: self
                    .opts
                    .retransmit
                    .delay(self.attempt, self.rng.next_u64()),
                first,
                step,
            },
            Err(reason) => self.fail(DhcpError::Encode {
                iface: self.iface.clone(),
                step,
                reason,
            }),
        }
    }

    fn nak(&self, ip: Ipv4Addr, reply: &Reply) -> DhcpError {
        DhcpError::Nak {
            iface: self.iface.clone(),
            mac: format_mac(&self.mac),
            ip,
            server: reply.server_id.unwrap_or(Ipv4Addr::UNSPECIFIED),
            message: reply.message.clone(),
        }
    }

    fn bound(&mut self, reply: &Reply, server_id: Ipv4Addr) -> Action {
        self.state = State::Done;
        Action::Bound(Bound {
            ip: reply.yiaddr,
            server_id,
            timers: Timers::from_options(
                reply.lease_time,
                reply.t1,
                reply.t2,
                self.opts.default_lease,
            ),
            subnet_mask: reply.subnet_mask,
            router: reply.router,
        })
    }

    fn fail(&mut self, err: DhcpError) -> Action {
        self.state = State::Done;
        Action::Failed(err)
    }
}

/// An address a server may lease to a client: not 0/8, loopback, link-local, multicast,
/// reserved or broadcast.
fn usable(ip: Ipv4Addr) -> bool {
    let first = ip.octets()[0];
    first != 0 && first != 127 && first < 224 && !ip.is_link_local()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backoff;
    use dhcproto::v4::{self, Decodable, DhcpOption, MessageType, OptionCode};

    const MAC: [u8; 6] = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0x01];
    const IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 120);
    const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);

    fn opts() -> DhcpOptions {
        DhcpOptions {
            retransmit: Backoff::new(Duration::from_secs(1), Duration::from_secs(4), 10),
            ..DhcpOptions::default()
        }
    }

    fn sent(a: &Action) -> (v4::Message, Duration, bool, Step) {
        match a {
            Action::Send {
                packet,
                timeout,
                first,
                step,
            } => (
                v4::Message::from_bytes(packet).expect("decodes"),
                *timeout,
                *first,
                *step,
            ),
            other => panic!("expected a Send, got {other:?}"),
        }
    }

    fn reply(kind: ReplyKind, xid: u32, yiaddr: Ipv4Addr) -> Reply {
        Reply {
            kind,
            xid,
            chaddr: MAC,
            yiaddr,
            server_id: Some(SERVER),
            lease_time: Some(120),
            t1: None,
            t2: None,
            subnet_mask: None,
            router: None,
            client_id: Some(wire::client_id(&MAC)),
            message: None,
        }
    }

    fn requested(m: &v4::Message) -> Option<Ipv4Addr> {
        match m.opts().get(OptionCode::RequestedIpAddress) {
            Some(DhcpOption::RequestedIpAddress(ip)) => Some(*ip),
            _ => None,
        }
    }

    #[test]
    fn discover_offer_request_ack() {
        let mut ex = Exchange::acquire("eth1", MAC, None, &opts(), 1);
        let (m, timeout, first, step) = sent(&ex.start());
        assert_eq!(m.opts().msg_type(), Some(MessageType::Discover));
        assert_eq!((first, step), (true, Step::Discover));
        assert!(timeout >= Duration::from_millis(900) && timeout <= Duration::from_millis(1100));
        let xid = m.xid();

        let (m, _, first, step) = sent(&ex.on_reply(&reply(ReplyKind::Offer, xid, IP)));
        assert_eq!(m.opts().msg_type(), Some(MessageType::Request));
        assert_eq!((m.xid(), first, step), (xid, true, Step::Request));
        assert_eq!(requested(&m), Some(IP));
        assert_eq!(
            m.opts().get(OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(SERVER))
        );

        match ex.on_reply(&reply(ReplyKind::Ack, xid, IP)) {
            Action::Bound(b) => {
                assert_eq!((b.ip, b.server_id), (IP, SERVER));
                assert_eq!(
                    b.timers,
                    Timers::from_options(Some(120), None, None, Duration::ZERO)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            ex.on_reply(&reply(ReplyKind::Ack, xid, IP)),
            Action::Ignored(_)
        ));
    }

    #[test]
    fn requested_address_is_asked_for_with_init_reboot() {
        let mut ex = Exchange::acquire("eth1", MAC, Some(IP), &opts(), 2);
        let (m, _, _, step) = sent(&ex.start());
        assert_eq!(step, Step::InitReboot);
        assert_eq!(m.ciaddr(), Ipv4Addr::UNSPECIFIED);
        assert_eq!(requested(&m), Some(IP));
        assert!(m.opts().get(OptionCode::ServerIdentifier).is_none());
        assert!(matches!(
            ex.on_reply(&reply(ReplyKind::Ack, m.xid(), IP)),
            Action::Bound(Bound { ip: IP, .. })
        ));
    }

    #[test]
    fn nak_on_init_reboot_rediscovers_without_the_hint() {
        let mut ex = Exchange::acquire("eth1", MAC, Some(IP), &opts(), 3);
        let (m, ..) = sent(&ex.start());
        let mut nak = reply(ReplyKind::Nak, m.xid(), Ipv4Addr::UNSPECIFIED);
        nak.message = Some("address not available".into());
        let (d, _, first, step) = sent(&ex.on_reply(&nak));
        assert_eq!((step, first), (Step::Discover, true));
        assert_ne!(d.xid(), m.xid(), "a new transaction");
        assert_eq!(
            requested(&d),
            None,
            "the refused address is not hinted again"
        );
        let other = Ipv4Addr::new(10, 77, 0, 101);
        sent(&ex.on_reply(&reply(ReplyKind::Offer, d.xid(), other)));
        assert!(matches!(
            ex.on_reply(&reply(ReplyKind::Ack, d.xid(), other)),
            Action::Bound(Bound { ip, .. }) if ip == other
        ));
    }

    #[test]
    fn silent_init_reboot_falls_back_to_discover_with_the_hint() {
        let o = opts();
        let mut ex = Exchange::acquire("eth1", MAC, Some(IP), &o, 4);
        sent(&ex.start());
        for _ in 1..o.init_reboot_attempts {
            assert_eq!(sent(&ex.on_timeout()).3, Step::InitReboot);
        }
        let (d, _, first, step) = sent(&ex.on_timeout());
        assert_eq!((step, first), (Step::Discover, true));
        assert_eq!(requested(&d), Some(IP));
    }

    #[test]
    fn silence_gives_no_offer_after_the_attempts_with_growing_timeouts() {
        let o = opts();
        let mut ex = Exchange::acquire("eth1", MAC, None, &o, 5);
        let (m, t0, ..) = sent(&ex.start());
        let mut timeouts = vec![t0];
        for _ in 1..o.attempts {
            let (r, t, first, _) = sent(&ex.on_timeout());
            assert_eq!(r.xid(), m.xid(), "retransmissions keep the xid");
            assert!(!first);
            timeouts.push(t);
        }
        for (i, t) in timeouts.iter().enumerate() {
            let base = o.retransmit.base(i as u32);
            assert!(*t >= base * 9 / 10 && *t <= base * 11 / 10, "{i}: {t:?}");
        }
        assert!(timeouts.iter().sum::<Duration>() <= o.silent_server_bound(false));
        match ex.on_timeout() {
            Action::Failed(DhcpError::NoOffer {
                iface,
                mac,
                attempts,
            }) => {
                assert_eq!(
                    (iface.as_str(), mac.as_str(), attempts),
                    ("eth1", "02:aa:bb:cc:dd:01", 4)
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn replies_for_others_are_ignored() {
        let mut ex = Exchange::acquire("eth1", MAC, None, &opts(), 6);
        let (m, ..) = sent(&ex.start());
        let xid = m.xid();
        let mut wrong_xid = reply(ReplyKind::Offer, xid.wrapping_add(1), IP);
        assert!(matches!(ex.on_reply(&wrong_xid), Action::Ignored(_)));
        wrong_xid.xid = xid;
        wrong_xid.chaddr = [2, 0, 0, 0, 0, 9];
        assert!(matches!(ex.on_reply(&wrong_xid), Action::Ignored(_)));
        let mut wrong_id = reply(ReplyKind::Offer, xid, IP);
        wrong_id.client_id = Some(vec![1, 2, 3]);
        assert!(matches!(ex.on_reply(&wrong_id), Action::Ignored(_)));
        // A NAK or ACK while selecting is not ours to act on.
        assert!(matches!(
            ex.on_reply(&reply(ReplyKind::Nak, xid, IP)),
            Action::Ignored(_)
        ));
        assert!(matches!(
            ex.on_reply(&reply(ReplyKind::Ack, xid, IP)),
            Action::Ignored(_)
        ));
        // Still selecting: a good offer is taken.
        assert_eq!(
            sent(&ex.on_reply(&reply(ReplyKind::Offer, xid, IP))).3,
            Step::Request
        );
    }

    #[test]
    fn bad_offers_are_ignored() {
        let o = DhcpOptions {
            allowed: Some("10.77.0.0/24".parse().unwrap()),
            ..opts()
        };
        let mut ex = Exchange::acquire("eth1", MAC, None, &o, 7);
        let xid = sent(&ex.start()).0.xid();
        for bad in [
            "0.0.0.0",
            "127.0.0.1",
            "255.255.255.255",
            "224.0.0.1",
            "169.254.1.1",
            "10.78.0.5",
        ] {
            let r = reply(ReplyKind::Offer, xid, bad.parse().unwrap());
            assert!(matches!(ex.on_reply(&r), Action::Ignored(_)), "{bad}");
        }
        let mut no_server = reply(ReplyKind::Offer, xid, IP);
        no_server.server_id = None;
        assert!(matches!(ex.on_reply(&no_server), Action::Ignored(_)));
        assert_eq!(
            sent(&ex.on_reply(&reply(ReplyKind::Offer, xid, IP))).3,
            Step::Request
        );
        // An ACK for another address or from another server is not ours either.
        assert!(matches!(
            ex.on_reply(&reply(ReplyKind::Ack, xid, Ipv4Addr::new(10, 77, 0, 121))),
            Action::Ignored(_)
        ));
        let mut other_server = reply(ReplyKind::Ack, xid, IP);
        other_server.server_id = Some(Ipv4Addr::new(10, 77, 0, 2));
        assert!(matches!(ex.on_reply(&other_server), Action::Ignored(_)));
        let mut other_nak = reply(ReplyKind::Nak, xid, Ipv4Addr::UNSPECIFIED);
        other_nak.server_id = Some(Ipv4Addr::new(10, 77, 0, 2));
        assert!(matches!(ex.on_reply(&other_nak), Action::Ignored(_)));
    }

    #[test]
    fn a_nak_storm_ends_with_the_nak() {
        let o = opts();
        let mut ex = Exchange::acquire("eth1", MAC, None, &o, 8);
        let mut xid = sent(&ex.start()).0.xid();
        for round in 0..=o.max_restarts {
            sent(&ex.on_reply(&reply(ReplyKind::Offer, xid, IP)));
            match ex.on_reply(&reply(ReplyKind::Nak, xid, Ipv4Addr::UNSPECIFIED)) {
                a @ Action::Send { .. } if round < o.max_restarts => xid = sent(&a).0.xid(),
                Action::Failed(DhcpError::Nak { ip, server, .. }) if round == o.max_restarts => {
                    assert_eq!((ip, server), (IP, SERVER));
                }
                other => panic!("round {round}: {other:?}"),
            }
        }
    }

    #[test]
    fn unanswered_request_rediscovers() {
        let o = opts();
        let mut ex = Exchange::acquire("eth1", MAC, None, &o, 9);
        let xid = sent(&ex.start()).0.xid();
        sent(&ex.on_reply(&reply(ReplyKind::Offer, xid, IP)));
        for _ in 1..o.attempts {
            assert_eq!(sent(&ex.on_timeout()).3, Step::Request);
        }
        assert_eq!(sent(&ex.on_timeout()).3, Step::Discover);
    }

    #[test]
    fn renewal_nak_and_silence_are_errors() {
        let o = opts();
        let mut ex = Exchange::renew("eth1", MAC, IP, &o, 10);
        let (m, _, _, step) = sent(&ex.start());
        assert_eq!(step, Step::InitReboot);
        assert_eq!(m.ciaddr(), Ipv4Addr::UNSPECIFIED);
        assert!(matches!(
            ex.on_reply(&reply(ReplyKind::Nak, m.xid(), Ipv4Addr::UNSPECIFIED)),
            Action::Failed(DhcpError::Nak { ip: IP, .. })
        ));

        let mut ex = Exchange::renew("eth1", MAC, IP, &o, 11);
        sent(&ex.start());
        for _ in 1..o.attempts {
            assert_eq!(sent(&ex.on_timeout()).3, Step::InitReboot);
        }
        assert!(matches!(
            ex.on_timeout(),
            Action::Failed(DhcpError::NoAck {
                ip: IP,
                step: Step::InitReboot,
                attempts: 4,
                ..
            })
        ));
    }

    #[test]
    fn renewal_ack_carries_the_servers_timers() {
        let mut ex = Exchange::renew("eth1", MAC, IP, &opts(), 12);
        let xid = sent(&ex.start()).0.xid();
        let mut ack = reply(ReplyKind::Ack, xid, IP);
        ack.lease_time = Some(600);
        ack.t1 = Some(100);
        ack.t2 = Some(200);
        match ex.on_reply(&ack) {
            Action::Bound(b) => assert_eq!(
                (b.timers.lease, b.timers.t1, b.timers.t2),
                (
                    Duration::from_secs(600),
                    Duration::from_secs(100),
                    Duration::from_secs(200)
                )
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn replies_through_the_wire_parser_drive_the_machine() {
        let mut ex = Exchange::acquire("eth1", MAC, None, &opts(), 13);
        let xid = sent(&ex.start()).0.xid();
        let offer = wire::encode(&wire::server_reply(
            MessageType::Offer,
            xid,
            &MAC,
            IP,
            SERVER,
        ))
        .unwrap();
        let parsed = wire::parse_reply(&offer).unwrap();
        assert_eq!(sent(&ex.on_reply(&parsed)).3, Step::Request);
        let mut ack = wire::server_reply(MessageType::Ack, xid, &MAC, IP, SERVER);
        ack.opts_mut().insert(DhcpOption::AddressLeaseTime(300));
        let parsed = wire::parse_reply(&wire::encode(&ack).unwrap()).unwrap();
        assert!(matches!(
            ex.on_reply(&parsed),
            Action::Bound(Bound { ip: IP, .. })
        ));
    }
}
