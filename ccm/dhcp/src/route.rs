//! The interface of the default route: where `ipam: dhcp` addresses are leased when neither the
//! Service's network nor `--dhcp-interface` names an interface.
//!
//! This is where kube-vip leases them under upstream's values: the Harvester cloud provider
//! chart leaves kube-vip's `vip_interface` empty, and kube-vip then takes the interface of the
//! default route for every Service (kube-vip/kube-vip v1.2.3, `cmd/kube-vip.go`: "auto-detecting
//! default Interface"; `pkg/vip/util.go` `GetDefaultGatewayInterface`: the first IPv4 default
//! route of the main table that has an interface, else the first IPv6 one; `pkg/instance/
//! instance.go` `startDHCP`: the DHCP client's macvlan sits on that interface).
//!
//! The tables are read from `/proc/thread-self/net/route` and `ipv6_route`: the same default
//! routes in the same order as kube-vip's netlink dump (the IPv4 file lists the main table
//! only, the kernel's `fib_route_seq_show`), and, unlike `/proc/self/net`, those of the calling
//! thread's network namespace, where the DHCP sockets are opened too. Parsing is pure
//! ([`default_route`]); [`read_default_route`] only reads the two files.

use std::io::ErrorKind;

/// The kernel's IPv4 routing table (main table), this thread's network namespace.
pub const IPV4_ROUTES: &str = "/proc/thread-self/net/route";
/// The kernel's IPv6 routing table, this thread's network namespace.
pub const IPV6_ROUTES: &str = "/proc/thread-self/net/ipv6_route";

/// `RTF_REJECT` (`linux/route.h`): an unreachable/prohibit route, no interface to send on (the
/// IPv6 table lists its null entry as such a default route on `lo`).
const RTF_REJECT: u32 = 0x0200;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Ipv4,
    Ipv6,
}

/// The interface a default route goes out through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefaultRoute {
    pub iface: String,
    pub family: Family,
}

/// A routing table that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading {path}: {source}")]
pub struct RouteError {
    pub path: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// The default route kube-vip would take, from the texts of `/proc/net/route` and
/// `/proc/net/ipv6_route`: the first IPv4 one with an interface, else the first IPv6 one.
/// Lines that do not parse are skipped (a table never makes this fail).
pub fn default_route(ipv4_table: &str, ipv6_table: &str) -> Option<DefaultRoute> {
    let route = |iface: &str, family| DefaultRoute {
        iface: iface.to_string(),
        family,
    };
    first_ipv4_default(ipv4_table)
        .map(|i| route(i, Family::Ipv4))
        .or_else(|| first_ipv6_default(ipv6_table).map(|i| route(i, Family::Ipv6)))
}

/// `Iface Destination Gateway Flags RefCnt Use Metric Mask ...` after a header line; a default
/// route has destination and mask 0; `*` is a route without a device (blackhole, unreachable).
fn first_ipv4_default(table: &str) -> Option<&str> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (iface, dst, mask) = (*f.first()?, *f.get(1)?, *f.get(7)?);
        let zero = |hex: &str| u32::from_str_radix(hex, 16).ok() == Some(0);
        (zero(dst) && zero(mask) && iface != "*").then_some(iface)
    })
}

/// `dest dest_len src src_len next_hop metric refcnt use flags device`, no header; a default
/// route is `::/0`.
fn first_ipv6_default(table: &str) -> Option<&str> {
    table.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (dst, len, flags, iface) = (*f.first()?, *f.get(1)?, *f.get(8)?, *f.get(9)?);
        let default = dst.len() == 32
            && u128::from_str_radix(dst, 16).ok() == Some(0)
            && u8::from_str_radix(len, 16).ok() == Some(0);
        let reject = u32::from_str_radix(flags, 16).map_or(true, |f| f & RTF_REJECT != 0);
        (default && !reject).then_some(iface)
    })
}

/// The default route of the calling thread's network namespace, if it has one. A table that
/// does not exist (no IPv6 in this kernel) counts as empty.
pub fn read_default_route() -> Result<Option<DefaultRoute>, RouteError> {
    let read = |path: &'static str| match std::fs::read_to_string(path) {
        Ok(text) => Ok(text),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(RouteError { path, source }),
    };
    Ok(default_route(&read(IPV4_ROUTES)?, &read(IPV6_ROUTES)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4_HEADER: &str =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n";
    /// The null entry every IPv6 table lists: `::/0` unreachable on `lo`.
    const V6_NULL: &str = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo\n";

    fn v4(rows: &[&str]) -> String {
        let mut t = V4_HEADER.to_string();
        for r in rows {
            t.push_str(r);
            t.push('\n');
        }
        t
    }

    fn on(iface: &str, family: Family) -> Option<DefaultRoute> {
        Some(DefaultRoute {
            iface: iface.into(),
            family,
        })
    }

    #[test]
    fn the_default_route_is_chosen_as_kube_vip_chooses_it() {
        let eth0_default = "eth0\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0";
        let eth0_subnet = "eth0\t0000A8C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0";
        let eth1_default = "eth1\t00000000\t0101A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0";
        let blackhole = "*\t00000000\t00000000\t0201\t0\t0\t0\t00000000\t0\t0\t0";
        let v6_default = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 00000400 00000001 00000000 00000003     ens3\n";
        let v6_subnet = "fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     ens3\n";
        let rows: &[(&str, String, String, Option<DefaultRoute>)] = &[
            (
                "the IPv4 default route's interface",
                v4(&[eth0_subnet, eth0_default]),
                String::new(),
                on("eth0", Family::Ipv4),
            ),
            (
                "the first of two default routes, as the kernel lists them (lowest metric first)",
                v4(&[eth0_default, eth1_default]),
                String::new(),
                on("eth0", Family::Ipv4),
            ),
            (
                "IPv4 before IPv6",
                v4(&[eth1_default]),
                format!("{V6_NULL}{v6_default}"),
                on("eth1", Family::Ipv4),
            ),
            (
                "a default route without a device is skipped",
                v4(&[blackhole, eth1_default]),
                String::new(),
                on("eth1", Family::Ipv4),
            ),
            (
                "no IPv4 default route: the IPv6 one",
                v4(&[eth0_subnet]),
                format!("{v6_subnet}{V6_NULL}{v6_default}"),
                on("ens3", Family::Ipv6),
            ),
            (
                "only subnet routes and IPv6's unreachable null entry: none",
                v4(&[eth0_subnet]),
                format!("{v6_subnet}{V6_NULL}"),
                None,
            ),
            (
                "empty tables (no IPv6 in the kernel): none",
                v4(&[]),
                String::new(),
                None,
            ),
            (
                "garbage lines are skipped",
                format!("{}garbage\neth9 zz\n{eth1_default}\n", V4_HEADER),
                "short line\n".into(),
                on("eth1", Family::Ipv4),
            ),
        ];
        for (rule, ipv4, ipv6, want) in rows {
            assert_eq!(&default_route(ipv4, ipv6), want, "{rule}");
        }
    }

    #[test]
    fn the_header_line_is_never_a_route() {
        // A header whose columns happen to be zeros is still the header.
        let table = "eth0 0 0 0 0 0 0 0\n";
        assert_eq!(default_route(table, ""), None);
    }

    #[test]
    fn reading_this_threads_tables_never_fails_on_linux() {
        // Whatever the machine's routes, the files exist and parse.
        read_default_route().unwrap();
    }
}
