//! DHCPv4 messages for a synthetic MAC, built and parsed with `dhcproto`.
//!
//! Every message a client sends here carries the BOOTP broadcast flag, `chaddr` = the MAC and
//! client-id (option 61) = `01` + MAC. Replies are parsed lazily: options we do not use are never
//! decoded, so a server's odd vendor option cannot make us drop its ACK, while a malformed option
//! we rely on (53, 54, 51) rejects the reply. Nothing here panics on any input.

use std::net::Ipv4Addr;

use dhcproto::v4::{
    self, DhcpOption, Encodable, Flags, HType, MessageType, Opcode, OptionCode, borrowed,
};

/// Port a server listens on.
pub const SERVER_PORT: u16 = v4::SERVER_PORT;
/// Port a client listens on.
pub const CLIENT_PORT: u16 = v4::CLIENT_PORT;
/// BOOTP's minimum message size; shorter requests are padded (some servers drop them otherwise).
const MIN_SIZE: usize = v4::MIN_PACKET_SIZE;

/// Option 61 for a MAC: hardware type 1 (Ethernet) followed by the MAC.
pub fn client_id(mac: &[u8; 6]) -> Vec<u8> {
    let mut id = Vec::with_capacity(7);
    id.push(1);
    id.extend_from_slice(mac);
    id
}

fn base(mac: &[u8; 6], xid: u32, kind: MessageType, hostname: Option<&str>) -> v4::Message {
    let unspecified = Ipv4Addr::UNSPECIFIED;
    let mut msg =
        v4::Message::new_with_id(xid, unspecified, unspecified, unspecified, unspecified, mac);
    msg.set_flags(Flags::default().set_broadcast());
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::MessageType(kind));
    opts.insert(DhcpOption::ClientIdentifier(client_id(mac)));
    if kind != MessageType::Release {
        opts.insert(DhcpOption::ParameterRequestList(vec![
            OptionCode::SubnetMask,
            OptionCode::Router,
            OptionCode::AddressLeaseTime,
            OptionCode::ServerIdentifier,
            OptionCode::Renewal,
            OptionCode::Rebinding,
        ]));
        if let Some(name) = hostname.filter(|n| !n.is_empty()) {
            opts.insert(DhcpOption::Hostname(name.to_string()));
        }
    }
    msg
}

/// DISCOVER, optionally hinting an address (option 50) the server may offer again.
pub fn discover(
    mac: &[u8; 6],
    xid: u32,
    requested: Option<Ipv4Addr>,
    hostname: Option<&str>,
) -> v4::Message {
    let mut msg = base(mac, xid, MessageType::Discover, hostname);
    if let Some(ip) = requested {
        msg.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
    }
    msg
}

/// REQUEST in SELECTING state: takes `server`'s offer of `ip` (options 50 and 54).
pub fn request_selecting(
    mac: &[u8; 6],
    xid: u32,
    ip: Ipv4Addr,
    server: Ipv4Addr,
    hostname: Option<&str>,
) -> v4::Message {
    let mut msg = base(mac, xid, MessageType::Request, hostname);
    msg.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
    msg.opts_mut().insert(DhcpOption::ServerIdentifier(server));
    msg
}

/// INIT-REBOOT-style REQUEST for a known address: `ciaddr` = 0, option 50 = `ip`, no option 54.
/// Used after a restart and for renewing and rebinding (see the module doc of `dhcp`).
pub fn request_init_reboot(
    mac: &[u8; 6],
    xid: u32,
    ip: Ipv4Addr,
    hostname: Option<&str>,
) -> v4::Message {
    let mut msg = base(mac, xid, MessageType::Request, hostname);
    msg.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
    msg
}

/// RELEASE of `ip`: `ciaddr` = `ip`, option 54 = the server that leased it.
pub fn release(mac: &[u8; 6], xid: u32, ip: Ipv4Addr, server: Ipv4Addr) -> v4::Message {
    let mut msg = base(mac, xid, MessageType::Release, None);
    msg.set_ciaddr(ip);
    msg.opts_mut().insert(DhcpOption::ServerIdentifier(server));
    msg
}

/// The bytes to send, padded to the BOOTP minimum.
pub fn encode(msg: &v4::Message) -> Result<Vec<u8>, String> {
    let mut bytes = msg.to_vec().map_err(|e| e.to_string())?;
    if bytes.len() < MIN_SIZE {
        bytes.resize(MIN_SIZE, 0);
    }
    Ok(bytes)
}

/// The server's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    Offer,
    Ack,
    Nak,
}

/// A parsed OFFER, ACK or NAK: the fields a client acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub kind: ReplyKind,
    pub xid: u32,
    pub chaddr: [u8; 6],
    pub yiaddr: Ipv4Addr,
    /// Option 54.
    pub server_id: Option<Ipv4Addr>,
    /// Options 51, 58 and 59, in seconds.
    pub lease_time: Option<u32>,
    pub t1: Option<u32>,
    pub t2: Option<u32>,
    pub subnet_mask: Option<Ipv4Addr>,
    pub router: Option<Ipv4Addr>,
    /// Option 61 echoed by the server (RFC 6842), if it did.
    pub client_id: Option<Vec<u8>>,
    /// Option 56 (a NAK's reason).
    pub message: Option<String>,
}

/// Why bytes were not a reply for a client. The driver logs these at debug level and drops the
/// datagram.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("{0} bytes is shorter than a BOOTP header")]
    TooShort(usize),
    #[error("not a BOOTREPLY")]
    NotAReply,
    #[error("no DHCP magic cookie")]
    NoMagic,
    #[error("hardware type {htype}/length {hlen} is not Ethernet")]
    NotEthernet { htype: u8, hlen: u8 },
    #[error("no message type (option 53)")]
    NoMessageType,
    #[error("message type {0} is not an OFFER, ACK or NAK")]
    NotForClient(u8),
    #[error("option {code} is malformed: {reason}")]
    BadOption { code: u8, reason: String },
}

/// Parses a datagram received on the client port.
pub fn parse_reply(bytes: &[u8]) -> Result<Reply, ParseError> {
    // borrowed::Message::new checks the 240-byte header; every fixed offset below is inside it.
    let msg = borrowed::Message::new(bytes).map_err(|_| ParseError::TooShort(bytes.len()))?;
    if msg.opcode() != Opcode::BootReply {
        return Err(ParseError::NotAReply);
    }
    let (htype, hlen) = (bytes[1], msg.hlen());
    if msg.htype() != HType::Eth || hlen != 6 {
        return Err(ParseError::NotEthernet { htype, hlen });
    }
    if bytes[236..240] != v4::MAGIC {
        return Err(ParseError::NoMagic);
    }
    let mut chaddr = [0u8; 6];
    chaddr.copy_from_slice(&bytes[28..34]);

    let mut kind = None;
    let mut reply = Reply {
        kind: ReplyKind::Nak,
        xid: msg.xid(),
        chaddr,
        yiaddr: msg.yiaddr(),
        server_id: None,
        lease_time: None,
        t1: None,
        t2: None,
        subnet_mask: None,
        router: None,
        client_id: None,
        message: None,
    };
    for opt in msg.opts() {
        let code = u8::from(opt.code());
        let essential = matches!(code, 51 | 53 | 54);
        let wanted = essential || matches!(code, 1 | 3 | 56 | 58 | 59 | 61);
        if !wanted {
            continue;
        }
        let decoded = match opt.into_option() {
            Ok(d) => d,
            Err(e) if essential => {
                return Err(ParseError::BadOption {
                    code,
                    reason: e.to_string(),
                });
            }
            Err(_) => continue,
        };
        match decoded {
            DhcpOption::MessageType(t) => kind = Some(t),
            DhcpOption::ServerIdentifier(ip) => reply.server_id = Some(ip),
            DhcpOption::AddressLeaseTime(s) => reply.lease_time = Some(s),
            DhcpOption::Renewal(s) => reply.t1 = Some(s),
            DhcpOption::Rebinding(s) => reply.t2 = Some(s),
            DhcpOption::SubnetMask(m) => reply.subnet_mask = Some(m),
            DhcpOption::Router(r) => reply.router = r.first().copied(),
            DhcpOption::ClientIdentifier(id) => reply.client_id = Some(id),
            DhcpOption::Message(m) => reply.message = Some(m),
            _ => {}
        }
    }
    reply.kind = match kind {
        Some(MessageType::Offer) => ReplyKind::Offer,
        Some(MessageType::Ack) => ReplyKind::Ack,
        Some(MessageType::Nak) => ReplyKind::Nak,
        Some(other) => return Err(ParseError::NotForClient(u8::from(other))),
        None => return Err(ParseError::NoMessageType),
    };
    Ok(reply)
}

/// A server reply built with dhcproto, for the unit tests here and of the state machine.
#[cfg(test)]
pub(crate) fn server_reply(
    kind: MessageType,
    xid: u32,
    mac: &[u8; 6],
    yiaddr: Ipv4Addr,
    server: Ipv4Addr,
) -> v4::Message {
    let z = Ipv4Addr::UNSPECIFIED;
    let mut m = v4::Message::new_with_id(xid, z, yiaddr, z, z, mac);
    m.set_opcode(Opcode::BootReply);
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    m.opts_mut().insert(DhcpOption::ServerIdentifier(server));
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::v4::Decodable;

    const MAC: [u8; 6] = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0x01];
    const IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 120);
    const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);

    fn decode(bytes: &[u8]) -> v4::Message {
        v4::Message::from_bytes(bytes).expect("our own message decodes")
    }

    fn common_checks(m: &v4::Message, xid: u32, kind: MessageType) {
        assert_eq!(m.opcode(), Opcode::BootRequest);
        assert_eq!(m.xid(), xid);
        assert!(m.flags().broadcast(), "broadcast flag");
        assert_eq!(m.chaddr(), &MAC);
        assert_eq!(m.opts().msg_type(), Some(kind));
        assert_eq!(
            m.opts().get(OptionCode::ClientIdentifier),
            Some(&DhcpOption::ClientIdentifier(vec![
                1, 2, 0xaa, 0xbb, 0xcc, 0xdd, 1
            ]))
        );
    }

    #[test]
    fn discover_round_trips() {
        let bytes = encode(&discover(&MAC, 7, Some(IP), Some("svc-a"))).unwrap();
        assert!(bytes.len() >= 300);
        let m = decode(&bytes);
        common_checks(&m, 7, MessageType::Discover);
        assert_eq!(m.ciaddr(), Ipv4Addr::UNSPECIFIED);
        assert_eq!(
            m.opts().get(OptionCode::RequestedIpAddress),
            Some(&DhcpOption::RequestedIpAddress(IP))
        );
        assert_eq!(
            m.opts().get(OptionCode::Hostname),
            Some(&DhcpOption::Hostname("svc-a".into()))
        );
        assert!(m.opts().get(OptionCode::ServerIdentifier).is_none());
        let plain = decode(&encode(&discover(&MAC, 8, None, None)).unwrap());
        assert!(plain.opts().get(OptionCode::RequestedIpAddress).is_none());
        assert!(plain.opts().get(OptionCode::Hostname).is_none());
    }

    #[test]
    fn selecting_request_names_the_server() {
        let m = decode(&encode(&request_selecting(&MAC, 9, IP, SERVER, None)).unwrap());
        common_checks(&m, 9, MessageType::Request);
        assert_eq!(m.ciaddr(), Ipv4Addr::UNSPECIFIED);
        assert_eq!(
            m.opts().get(OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(SERVER))
        );
        assert_eq!(
            m.opts().get(OptionCode::RequestedIpAddress),
            Some(&DhcpOption::RequestedIpAddress(IP))
        );
    }

    #[test]
    fn init_reboot_request_has_no_ciaddr_and_no_server() {
        let m = decode(&encode(&request_init_reboot(&MAC, 10, IP, None)).unwrap());
        common_checks(&m, 10, MessageType::Request);
        assert_eq!(m.ciaddr(), Ipv4Addr::UNSPECIFIED);
        assert!(m.opts().get(OptionCode::ServerIdentifier).is_none());
        assert_eq!(
            m.opts().get(OptionCode::RequestedIpAddress),
            Some(&DhcpOption::RequestedIpAddress(IP))
        );
    }

    #[test]
    fn release_carries_ciaddr_and_server() {
        let m = decode(&encode(&release(&MAC, 11, IP, SERVER)).unwrap());
        common_checks(&m, 11, MessageType::Release);
        assert_eq!(m.ciaddr(), IP);
        assert_eq!(
            m.opts().get(OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(SERVER))
        );
        assert!(m.opts().get(OptionCode::RequestedIpAddress).is_none());
    }

    #[test]
    fn ack_parses_with_its_timers() {
        let mut m = server_reply(MessageType::Ack, 42, &MAC, IP, SERVER);
        m.opts_mut().insert(DhcpOption::AddressLeaseTime(120));
        m.opts_mut().insert(DhcpOption::Renewal(60));
        m.opts_mut().insert(DhcpOption::Rebinding(105));
        m.opts_mut()
            .insert(DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)));
        m.opts_mut().insert(DhcpOption::Router(vec![SERVER]));
        m.opts_mut()
            .insert(DhcpOption::ClientIdentifier(client_id(&MAC)));
        let r = parse_reply(&encode(&m).unwrap()).unwrap();
        assert_eq!(r.kind, ReplyKind::Ack);
        assert_eq!((r.xid, r.chaddr, r.yiaddr), (42, MAC, IP));
        assert_eq!(r.server_id, Some(SERVER));
        assert_eq!((r.lease_time, r.t1, r.t2), (Some(120), Some(60), Some(105)));
        assert_eq!(r.subnet_mask, Some(Ipv4Addr::new(255, 255, 255, 0)));
        assert_eq!(r.router, Some(SERVER));
        assert_eq!(r.client_id, Some(client_id(&MAC)));
    }

    #[test]
    fn offer_and_nak_parse() {
        let r =
            parse_reply(&encode(&server_reply(MessageType::Offer, 1, &MAC, IP, SERVER)).unwrap())
                .unwrap();
        assert_eq!(r.kind, ReplyKind::Offer);
        let mut nak = server_reply(MessageType::Nak, 2, &MAC, Ipv4Addr::UNSPECIFIED, SERVER);
        nak.opts_mut()
            .insert(DhcpOption::Message("address not available".into()));
        let r = parse_reply(&encode(&nak).unwrap()).unwrap();
        assert_eq!(r.kind, ReplyKind::Nak);
        assert_eq!(r.message.as_deref(), Some("address not available"));
    }

    #[test]
    fn requests_and_odd_types_are_not_replies() {
        let req = encode(&discover(&MAC, 1, None, None)).unwrap();
        assert_eq!(parse_reply(&req), Err(ParseError::NotAReply));
        let inform = encode(&server_reply(MessageType::Inform, 1, &MAC, IP, SERVER)).unwrap();
        assert_eq!(parse_reply(&inform), Err(ParseError::NotForClient(8)));
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        let good = encode(&server_reply(MessageType::Ack, 3, &MAC, IP, SERVER)).unwrap();
        assert_eq!(parse_reply(&good[..100]), Err(ParseError::TooShort(100)));
        assert_eq!(parse_reply(&[]), Err(ParseError::TooShort(0)));
        let mut bad_hlen = good.clone();
        bad_hlen[2] = 255;
        assert!(matches!(
            parse_reply(&bad_hlen),
            Err(ParseError::NotEthernet { .. })
        ));
        let mut no_magic = good.clone();
        no_magic[236] = 0;
        assert_eq!(parse_reply(&no_magic), Err(ParseError::NoMagic));
        // Options cut after the header: no message type.
        assert_eq!(parse_reply(&good[..240]), Err(ParseError::NoMessageType));
        // Server identifier with a 3-byte body.
        let mut short_sid = good[..240].to_vec();
        short_sid.extend_from_slice(&[53, 1, 5, 54, 3, 10, 77, 0, 255]);
        assert!(matches!(
            parse_reply(&short_sid),
            Err(ParseError::BadOption { code: 54, .. })
        ));
        // Option length running past the end of the datagram.
        let mut overrun = good[..240].to_vec();
        overrun.extend_from_slice(&[53, 1, 5, 51, 200, 0, 0]);
        // (the option iterator stops there; the reply keeps what came before it)
        assert_eq!(parse_reply(&overrun).map(|r| r.lease_time), Ok(None));
    }

    #[test]
    fn a_malformed_unused_option_does_not_drop_the_reply() {
        let good = encode(&server_reply(MessageType::Ack, 3, &MAC, IP, SERVER)).unwrap();
        let mut bytes = good[..240].to_vec();
        // option 53 = ACK, 54 = server, a malformed option 1 (subnet mask of 2 bytes), end.
        bytes.extend_from_slice(&[53, 1, 5, 54, 4, 10, 77, 0, 1, 1, 2, 255, 255, 255]);
        let r = parse_reply(&bytes).unwrap();
        assert_eq!(r.kind, ReplyKind::Ack);
        assert_eq!(r.subnet_mask, None);
    }

    proptest::proptest! {
        #[test]
        fn parser_never_panics_on_random_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..700)) {
            let _ = parse_reply(&bytes);
        }

        #[test]
        fn parser_never_panics_on_a_valid_header_with_random_options(
            opts in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
            hlen in proptest::prelude::any::<u8>(),
        ) {
            let mut bytes = encode(&server_reply(MessageType::Ack, 3, &MAC, IP, SERVER)).unwrap()[..240].to_vec();
            bytes[2] = hlen;
            bytes.extend_from_slice(&opts);
            let _ = parse_reply(&bytes);
        }
    }
}
