//! Body of the fuzz target in `ccm/dhcp/fuzz/` (see `docs/fuzzing.md`): a plain function that
//! panics when an invariant breaks, so `cargo fuzz` and the unit tests below run the same code.
//! It takes arbitrary bytes, as a datagram from outside would arrive.

use std::net::Ipv4Addr;
use std::time::Duration;

use crate::DhcpOptions;
use crate::machine::{Action, Exchange};
use crate::timers::next_step;
use crate::wire::{self, ReplyKind};

const MAC: [u8; 6] = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0x01];

/// A datagram on the DHCP client port: [`wire::parse_reply`] never panics, a reply it accepts
/// has the header fields the bytes say, and the exchange state machine, fed that reply as the
/// answer to each of its steps, never panics and binds only with `t1 <= t2 <= lease`. Returns how
/// many of the three exchanges bound (the tests check that the seeds reach the state machine).
pub fn dhcp_reply(data: &[u8]) -> usize {
    let Ok(reply) = wire::parse_reply(data) else {
        return 0;
    };
    assert!(data.len() >= 240, "a reply shorter than the BOOTP header");
    assert_eq!(data[0], 2, "op is BOOTREPLY");
    assert_eq!(
        reply.xid,
        u32::from_be_bytes([data[4], data[5], data[6], data[7]])
    );
    assert_eq!(
        reply.yiaddr,
        Ipv4Addr::new(data[16], data[17], data[18], data[19])
    );
    assert_eq!(reply.chaddr[..], data[28..34]);

    let opts = DhcpOptions::default();
    let ip = reply.yiaddr;
    let exchanges = [
        Exchange::acquire("eth1", MAC, None, &opts, 1),
        Exchange::acquire("eth1", MAC, Some(ip), &opts, 2),
        Exchange::renew("eth1", MAC, ip, &opts, 3),
    ];
    let mut bound = 0;
    for mut ex in exchanges {
        ex.start();
        let mut ours = reply.clone();
        ours.chaddr = MAC;
        // Twice: an OFFER moves SELECTING to REQUESTING, where the same reply as an ACK binds.
        for kind in [reply.kind, ReplyKind::Ack] {
            ours.xid = ex.xid();
            ours.kind = kind;
            match ex.on_reply(&ours) {
                Action::Bound(b) => {
                    let t = b.timers;
                    assert!(t.t1 <= t.t2 && t.t2 <= t.lease, "{t:?}");
                    assert_eq!(b.ip, ours.yiaddr);
                    for elapsed in [Duration::ZERO, t.t1, t.t2, t.lease, t.lease + t.t1] {
                        for failed in [None, Some(t.t1), Some(t.t2), Some(elapsed)] {
                            let _ = next_step(&t, elapsed, failed, opts.min_renew_interval);
                        }
                    }
                    bound += 1;
                    break;
                }
                Action::Send { packet, .. } => {
                    assert!(
                        wire::parse_reply(&packet).is_err(),
                        "our request parsed as a reply"
                    );
                }
                Action::Ignored(_) | Action::Failed(_) => {}
            }
        }
    }
    bound
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::v4::{DhcpOption, MessageType};

    const SERVER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
    const IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 120);

    fn reply(kind: MessageType, opts: Vec<DhcpOption>) -> Vec<u8> {
        let mut m = wire::server_reply(kind, 7, &MAC, IP, SERVER);
        for o in opts {
            m.opts_mut().insert(o);
        }
        wire::encode(&m).unwrap()
    }

    /// Seeds like those in `ccm/dhcp/fuzz/seeds/dhcp_reply`, run on every `cargo test`: valid replies
    /// with odd timers, truncations at every length, and garbage.
    #[test]
    fn dhcp_reply_seeds() {
        let ack = reply(
            MessageType::Ack,
            vec![
                DhcpOption::AddressLeaseTime(120),
                DhcpOption::Renewal(200),
                DhcpOption::Rebinding(0),
                DhcpOption::Router(vec![]),
                DhcpOption::ClientIdentifier(wire::client_id(&MAC)),
            ],
        );
        // (seed, exchanges that bind): an ACK binds the two INIT-REBOOT ones, an OFFER all three
        // (SELECTING -> REQUESTING -> ACK), a NAK or an INFORM none.
        let seeds = [
            (ack.clone(), 2),
            (
                reply(
                    MessageType::Offer,
                    vec![DhcpOption::AddressLeaseTime(u32::MAX)],
                ),
                3,
            ),
            (
                reply(MessageType::Nak, vec![DhcpOption::Message("no".into())]),
                0,
            ),
            (
                reply(MessageType::Ack, vec![DhcpOption::AddressLeaseTime(0)]),
                2,
            ),
            (reply(MessageType::Inform, vec![]), 0),
            (vec![], 0),
            (vec![0xff; 600], 0),
        ];
        for (seed, binds) in &seeds {
            assert_eq!(dhcp_reply(seed), *binds, "{seed:02x?}");
        }
        for len in 0..ack.len() {
            dhcp_reply(&ack[..len]);
        }
    }

    proptest::proptest! {
        /// The body over random bytes, so `cargo test` covers a little of what `make fuzz` does.
        #[test]
        fn body_holds_on_random_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            dhcp_reply(&bytes);
        }

        /// A reply header with a message type and random options reaches the state machine.
        #[test]
        fn dhcp_reply_holds_with_random_options(
            kind in 1u8..9,
            opts in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        ) {
            let mut bytes = reply(MessageType::Ack, vec![])[..240].to_vec();
            bytes.extend_from_slice(&[53, 1, kind, 54, 4, 10, 77, 0, 1]);
            bytes.extend_from_slice(&opts);
            dhcp_reply(&bytes);
        }
    }
}
