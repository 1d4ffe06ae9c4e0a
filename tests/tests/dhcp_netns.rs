//! `harvester_dhcp` against a real dnsmasq in a network namespace (root).
//!
//! Each test makes its own pair of namespaces (see `testbed::real::netns`), leases addresses for
//! synthetic MACs that no interface has, and checks dnsmasq's lease file and log.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use harvester_dhcp::wire::ReplyKind;
use harvester_dhcp::{
    self as dhcp, Backoff, DhcpError, DhcpOptions, Lease, LeaseEvent, Maintainer, format_mac,
    mac_for,
};
use testbed::real::netns::{DhcpNet, LEASE_SECS, LeaseLine, RANGE, SERVER_IP};

fn assert_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root (network namespaces, veth, dnsmasq, SO_BINDTODEVICE); run it as root \
         (`make test` does)"
    );
}

fn net() -> DhcpNet {
    assert_root();
    DhcpNet::start().unwrap_or_else(|e| panic!("starting dnsmasq in a netns: {e}"))
}

fn in_range(ip: Ipv4Addr) -> bool {
    ip >= RANGE.0 && ip <= RANGE.1
}

fn line_for(leases: &[LeaseLine], mac: &[u8; 6]) -> Option<LeaseLine> {
    let mac = format_mac(mac);
    leases.iter().find(|l| l.mac == mac).cloned()
}

/// Short timeouts: dnsmasq answers within milliseconds.
fn quick() -> DhcpOptions {
    DhcpOptions {
        retransmit: Backoff::new(Duration::from_millis(500), Duration::from_secs(2), 10),
        ..DhcpOptions::default()
    }
}

#[test]
fn acquire_gets_a_lease_for_a_synthetic_mac_root() {
    let net = net();
    let mac = mac_for("5e7a1f0c-0000-4000-8000-000000000001");
    assert_ne!(
        format_mac(&mac),
        net.client_if_mac().unwrap(),
        "the MAC must not be the interface's"
    );
    let iface = net.client_if.clone();
    let (lease, took) = net
        .in_client(|| async move {
            let start = Instant::now();
            let lease = dhcp::acquire(&iface, mac, None, &quick()).await;
            (lease, start.elapsed())
        })
        .unwrap();
    let lease = lease.unwrap_or_else(|e| panic!("{e}\n{}", net.dhcp_log_text()));
    eprintln!(
        "acquire took {took:?} -> {} from {}",
        lease.ip, lease.server_id
    );
    assert!(in_range(lease.ip), "{lease:?}");
    assert_eq!(lease.server_id, SERVER_IP);
    assert_eq!(lease.mac, mac);
    assert_eq!(lease.iface, net.client_if);
    assert_eq!(lease.lease_time, Duration::from_secs(LEASE_SECS));
    assert_eq!(lease.t1, Duration::from_secs(LEASE_SECS / 2));
    assert_eq!(lease.t2, Duration::from_secs(LEASE_SECS) / 8 * 7);
    assert_eq!(lease.subnet_mask, Some(Ipv4Addr::new(255, 255, 255, 0)));
    assert!(
        took < Duration::from_secs(2),
        "one round trip, no retransmission: {took:?}"
    );

    let leases = net
        .wait_leases("the lease in the lease file", Duration::from_secs(5), |l| {
            line_for(l, &mac).is_some()
        })
        .unwrap();
    let line = line_for(&leases, &mac).unwrap();
    assert_eq!(line.ip, lease.ip);
    assert_eq!(
        line.client_id,
        format!("01:{}", format_mac(&mac)),
        "option 61 = 01 + MAC"
    );
}

#[test]
fn concurrent_leases_each_get_their_reply_first_time_root() {
    let net = net();
    // One transmission per step and no rediscovery: a reply that reached only one of the
    // concurrent sockets would fail its exchange. This is the check that every socket bound to
    // 0.0.0.0:68 with SO_REUSEADDR gets each broadcast reply.
    let strict = DhcpOptions {
        retransmit: Backoff::new(Duration::from_secs(3), Duration::from_secs(3), 0),
        attempts: 1,
        init_reboot_attempts: 1,
        max_restarts: 0,
        ..DhcpOptions::default()
    };
    let macs: Vec<[u8; 6]> = (0..6)
        .map(|i| mac_for(&format!("concurrent-svc-{i}")))
        .collect();
    let iface = net.client_if.clone();
    let ms = macs.clone();
    let (results, observed) = net
        .in_client(|| async move {
            // A bystander on the same port sees every reply too, while each exchange got its own.
            let observer = observer_socket(&iface);
            let tasks: Vec<_> = ms
                .iter()
                .map(|mac| {
                    let (iface, mac, opts) = (iface.clone(), *mac, strict.clone());
                    tokio::spawn(async move { dhcp::acquire(&iface, mac, None, &opts).await })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("task"));
            }
            // And renew them all at once too.
            let leases: Vec<Lease> = out
                .iter()
                .filter_map(|r| r.as_ref().ok().cloned())
                .collect();
            let renewals: Vec<_> = leases
                .into_iter()
                .map(|l| {
                    let opts = strict.clone();
                    tokio::spawn(async move { dhcp::renew(&l, &opts).await })
                })
                .collect();
            for r in renewals {
                r.await.expect("task").expect("concurrent renewal");
            }
            let mut observed = Vec::new();
            let mut buf = [0u8; 2048];
            while let Ok(n) = observer.recv(&mut buf) {
                if let Ok(reply) = dhcp::wire::parse_reply(&buf[..n]) {
                    observed.push((reply.kind, reply.chaddr));
                }
            }
            let out: Vec<Result<Lease, DhcpError>> = out;
            (out, observed)
        })
        .unwrap();
    for mac in &macs {
        let acks = observed
            .iter()
            .filter(|(k, m)| *k == ReplyKind::Ack && m == mac)
            .count();
        // one ACK for the acquisition, one for the renewal
        assert_eq!(acks, 2, "the bystander socket saw {observed:?}");
    }
    let leases: Vec<Lease> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}\n{}", net.dhcp_log_text())))
        .collect();
    let mut ips: Vec<Ipv4Addr> = leases.iter().map(|l| l.ip).collect();
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), macs.len(), "distinct addresses: {leases:?}");
    let file = net
        .wait_leases("all leases in the file", Duration::from_secs(5), |l| {
            macs.iter().all(|m| line_for(l, m).is_some())
        })
        .unwrap();
    for l in &leases {
        assert_eq!(line_for(&file, &l.mac).map(|f| f.ip), Some(l.ip));
    }
}

/// A non-blocking socket on 0.0.0.0:68 with the options the client uses, in the caller's netns.
fn observer_socket(iface: &str) -> std::net::UdpSocket {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).expect("socket");
    s.set_reuse_address(true).expect("SO_REUSEADDR");
    s.set_broadcast(true).expect("SO_BROADCAST");
    s.bind_device(Some(iface.as_bytes()))
        .expect("SO_BINDTODEVICE");
    let addr = std::net::SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 68);
    s.bind(&addr.into()).expect("bind 0.0.0.0:68");
    s.set_nonblocking(true).expect("O_NONBLOCK");
    s.into()
}

#[test]
fn renew_keeps_the_address_and_extends_the_lease_root() {
    let net = net();
    let mac = mac_for("renew-svc");
    let iface = net.client_if.clone();
    let first = net
        .in_client(|| async move { dhcp::acquire(&iface, mac, None, &quick()).await })
        .unwrap()
        .unwrap();
    let before = net
        .wait_leases("the lease", Duration::from_secs(5), |l| {
            line_for(l, &mac).is_some()
        })
        .map(|l| line_for(&l, &mac).unwrap())
        .unwrap();
    // Expiry is in whole seconds: let at least two pass.
    std::thread::sleep(Duration::from_millis(2100));
    let lease = first.clone();
    let (renewed, took) = net
        .in_client(|| async move {
            let start = Instant::now();
            (dhcp::renew(&lease, &quick()).await, start.elapsed())
        })
        .unwrap();
    let renewed = renewed.unwrap_or_else(|e| panic!("{e}\n{}", net.dhcp_log_text()));
    eprintln!("renew took {took:?}");
    assert_eq!(renewed.ip, first.ip);
    assert_eq!(renewed.server_id, SERVER_IP);
    assert!(renewed.obtained_at > first.obtained_at);
    assert!(renewed.expires_at() > first.expires_at());
    let after = net
        .wait_leases("a later expiry", Duration::from_secs(5), |l| {
            line_for(l, &mac).is_some_and(|x| x.expiry >= before.expiry + 2)
        })
        .map(|l| line_for(&l, &mac).unwrap())
        .unwrap();
    assert_eq!(after.ip, first.ip);
    assert!(
        !net.dhcp_log_text().contains("DHCPNAK"),
        "{}",
        net.dhcp_log_text()
    );
}

#[test]
fn restart_with_requested_ip_keeps_the_address_root() {
    let net = net();
    let mac = mac_for("restart-svc");
    let iface = net.client_if.clone();
    let old = net
        .in_client(|| async move { dhcp::acquire(&iface, mac, None, &quick()).await })
        .unwrap()
        .unwrap();
    // Another Service takes an address meanwhile, so "the next free one" would differ.
    let (iface, other) = (net.client_if.clone(), mac_for("restart-other-svc"));
    net.in_client(|| async move { dhcp::acquire(&iface, other, None, &quick()).await })
        .unwrap()
        .unwrap();
    // "Restarted CCM": a new runtime and socket, the same MAC and the address from the Service's
    // kube-vip.io/requestedIP annotation.
    let (iface, requested) = (net.client_if.clone(), old.ip);
    let again = net
        .in_client(|| async move { dhcp::acquire(&iface, mac, Some(requested), &quick()).await })
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", net.dhcp_log_text()));
    assert_eq!(again.ip, old.ip);
    // Asked for by INIT-REBOOT: one DISCOVER for this MAC in all (the first acquisition).
    let log = net.dhcp_log_text();
    let discovers = log
        .lines()
        .filter(|l| l.contains("DHCPDISCOVER") && l.contains(&format_mac(&mac)))
        .count();
    assert_eq!(discovers, 1, "{log}");
}

#[test]
fn release_removes_the_lease_root() {
    let net = net();
    let mac = mac_for("release-svc");
    let iface = net.client_if.clone();
    let lease = net
        .in_client(|| async move { dhcp::acquire(&iface, mac, None, &quick()).await })
        .unwrap()
        .unwrap();
    net.wait_leases("the lease", Duration::from_secs(5), |l| {
        line_for(l, &mac).is_some()
    })
    .unwrap();
    let l = lease.clone();
    net.in_client(|| async move { dhcp::release(&l).await })
        .unwrap()
        .unwrap();
    net.wait_leases("the lease to be gone", Duration::from_secs(5), |l| {
        line_for(l, &mac).is_none()
    })
    .unwrap();
    assert!(
        net.dhcp_log_text().contains("DHCPRELEASE"),
        "{}",
        net.dhcp_log_text()
    );
}

#[test]
fn silent_server_gives_no_offer_within_the_bound_then_recovers_root() {
    let mut net = net();
    net.stop_server();
    let opts = DhcpOptions {
        retransmit: Backoff::new(Duration::from_millis(200), Duration::from_millis(800), 10),
        attempts: 3,
        ..DhcpOptions::default()
    };
    let bound = opts.silent_server_bound(false);
    let mac = mac_for("silent-svc");
    let (iface, o) = (net.client_if.clone(), opts.clone());
    let (result, took) = net
        .in_client(|| async move {
            let start = Instant::now();
            (dhcp::acquire(&iface, mac, None, &o).await, start.elapsed())
        })
        .unwrap();
    eprintln!("NoOffer after {took:?} (bound {bound:?})");
    match result {
        Err(DhcpError::NoOffer {
            iface,
            mac: m,
            attempts,
        }) => {
            assert_eq!(
                (iface, m, attempts),
                (net.client_if.clone(), format_mac(&mac), 3)
            );
        }
        other => panic!("expected NoOffer, got {other:?}"),
    }
    // 0.2 + 0.4 + 0.8 s, each within ±10 %.
    assert!(took >= Duration::from_millis(1260), "{took:?}");
    assert!(
        took <= bound + Duration::from_millis(300),
        "{took:?} > {bound:?}"
    );

    net.start_server().unwrap();
    let iface = net.client_if.clone();
    let lease = net
        .in_client(|| async move { dhcp::acquire(&iface, mac, None, &opts).await })
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", net.dhcp_log_text()));
    assert!(in_range(lease.ip));
}

#[test]
fn nak_for_an_address_outside_the_range_leads_to_a_new_lease_root() {
    let net = net();
    let mac = mac_for("nak-svc");
    let outside = Ipv4Addr::new(10, 77, 0, 200);
    let iface = net.client_if.clone();
    let lease = net
        .in_client(|| async move { dhcp::acquire(&iface, mac, Some(outside), &quick()).await })
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", net.dhcp_log_text()));
    assert!(in_range(lease.ip), "{lease:?}");
    let log = net.dhcp_log_text();
    assert!(
        log.contains("DHCPNAK"),
        "the INIT-REBOOT was refused first:\n{log}"
    );
    net.wait_leases("the new lease", Duration::from_secs(5), |l| {
        line_for(l, &mac).is_some_and(|x| x.ip == lease.ip)
    })
    .unwrap();

    // A renewal that is refused is an error naming the address and the server.
    let mut bogus = lease.clone();
    bogus.ip = Ipv4Addr::new(10, 77, 0, 201);
    match net
        .in_client(|| async move { dhcp::renew(&bogus, &quick()).await })
        .unwrap()
    {
        Err(DhcpError::Nak { ip, server, .. }) => {
            assert_eq!((ip, server), (Ipv4Addr::new(10, 77, 0, 201), SERVER_IP));
        }
        other => panic!("expected a NAK, got {other:?}"),
    }
}

#[test]
fn maintainer_renews_at_t1_and_releases_on_delete_root() {
    let net = net();
    let mac = mac_for("maintained-svc");
    let iface = net.client_if.clone();
    let (renewed_ip, released) = net
        .in_client(|| async move {
            let mut lease = dhcp::acquire(&iface, mac, None, &quick())
                .await
                .expect("lease");
            // Pretend the server asked for renewal after one second (dnsmasq's minimum lease is
            // two minutes, T1 one).
            lease.t1 = Duration::from_secs(1);
            lease.t2 = Duration::from_secs(2);
            let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
            let keeper = Maintainer::spawn(lease.clone(), quick(), tx);
            let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
                .await
                .expect("an event within 10 s")
                .expect("channel open");
            let renewed_ip = match event {
                LeaseEvent::Renewed {
                    lease: l,
                    rebinding,
                } => {
                    assert!(!rebinding);
                    assert_eq!(
                        l.t1,
                        Duration::from_secs(LEASE_SECS / 2),
                        "the server's T1 now"
                    );
                    l.ip
                }
                other => panic!("expected Renewed, got {other:?}"),
            };
            assert_eq!(keeper.lease().map(|l| l.ip), Some(lease.ip));
            (renewed_ip, keeper.release().await.expect("release"))
        })
        .unwrap();
    assert_eq!(Some(renewed_ip), released);
    net.wait_leases("the lease to be gone", Duration::from_secs(5), |l| {
        line_for(l, &mac).is_none()
    })
    .unwrap();
}
