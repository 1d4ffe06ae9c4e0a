//! One IPPool range (`spec.ranges[*]`) with the CNI host-local defaults Harvester copies
//! (`pkg/ipam/allocator.go MakeRange`).

use std::fmt;
use std::net::IpAddr;

use ipnetwork::IpNetwork;

use super::addr::{next, prev, same_family, to_bits};

/// Why a range from an IPPool spec cannot be used. Each variant names the CR field
/// (`subnet`, `rangeStart`, `rangeEnd`, `gateway`) and the value that was given, so the message can
/// go straight into the pool's `Ready` condition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("invalid subnet {value:?}: {reason}")]
    InvalidSubnet { value: String, reason: String },
    #[error("invalid {field} {value:?}: not an IP address")]
    InvalidAddress { field: &'static str, value: String },
    #[error("{field} {value} is outside subnet {subnet}")]
    OutsideSubnet {
        field: &'static str,
        value: String,
        subnet: String,
    },
    #[error("{field} {value} is the network address of subnet {subnet}")]
    NetworkAddress {
        field: &'static str,
        value: String,
        subnet: String,
    },
    #[error("{field} {value} is the broadcast address of subnet {subnet}")]
    BroadcastAddress {
        field: &'static str,
        value: String,
        subnet: String,
    },
    #[error(
        "subnet {subnet} is too small to allocate from (use a /32 or /128 for a single address)"
    )]
    SubnetTooSmall { subnet: String },
}

/// A validated, inclusive address range inside a subnet, plus the gateway to skip.
///
/// Invariants (upheld by [`Range::parse`]): `start <= end`, both inside `subnet` and of its
/// family; the gateway, when present, is inside `subnet`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    subnet: IpNetwork,
    start: IpAddr,
    end: IpAddr,
    gateway: Option<IpAddr>,
}

/// The CR field names, used in errors so a user can find the bad value in their YAML.
const FIELD_START: &str = "rangeStart";
const FIELD_END: &str = "rangeEnd";
const FIELD_GATEWAY: &str = "gateway";

impl Range {
    /// Parses one `spec.ranges[*]` entry. Empty strings count as "not set", because the CR's Go
    /// type uses `omitempty` strings and `""` means "use the default".
    ///
    /// Defaults (host-local): start = network + 1, end = last address − 1 for IPv4 (broadcast
    /// excluded) or the last address for IPv6, gateway = network + 1. A /32 or /128 is the single
    /// address with no gateway. A start after the end is swapped rather than rejected, as upstream
    /// does.
    pub fn parse(
        subnet: &str,
        range_start: Option<&str>,
        range_end: Option<&str>,
        gateway: Option<&str>,
    ) -> Result<Range, RangeError> {
        let net = parse_subnet(subnet)?;
        let single = is_single_address(net);
        let start = match parse_field(FIELD_START, range_start, net)? {
            Some(ip) => ip,
            None => default_start(net)?,
        };
        let end = match parse_field(FIELD_END, range_end, net)? {
            Some(ip) => ip,
            None => default_end(net)?,
        };
        let (start, end) = if start > end {
            (end, start)
        } else {
            (start, end)
        };
        let gateway = match parse_field(FIELD_GATEWAY, gateway, net)? {
            Some(ip) => Some(ip),
            None if single => None,
            None => Some(default_start(net)?),
        };
        Ok(Range {
            subnet: net,
            start,
            end,
            gateway,
        })
    }

    /// The subnet, with host bits cleared (`192.168.1.7/24` is kept as `192.168.1.0/24`).
    pub fn subnet(&self) -> IpNetwork {
        self.subnet
    }

    /// First address of the range, inclusive.
    pub fn start(&self) -> IpAddr {
        self.start
    }

    /// Last address of the range, inclusive.
    pub fn end(&self) -> IpAddr {
        self.end
    }

    /// The gateway handed out with every allocation from this range; never allocated itself.
    pub fn gateway(&self) -> Option<IpAddr> {
        self.gateway
    }

    /// Whether `ip` lies between start and end (inclusive), gateway or not.
    pub fn contains(&self, ip: IpAddr) -> bool {
        same_family(ip, self.start) && self.start <= ip && ip <= self.end
    }

    /// Whether `ip` may be handed out from this range: inside it and not its gateway.
    pub fn is_allocatable(&self, ip: IpAddr) -> bool {
        self.contains(ip) && self.gateway != Some(ip)
    }

    /// How many addresses this range can hand out: `end − start + 1`, minus one when the gateway
    /// lies inside the range.
    pub fn size(&self) -> u128 {
        let span = (to_bits(self.end) - to_bits(self.start)).saturating_add(1);
        match self.gateway {
            Some(gw) if self.contains(gw) => span - 1,
            _ => span,
        }
    }

    /// The netmask as Harvester writes it into `status.allocatedAddress.mask`: Go's
    /// `net.IP(mask).String()`, i.e. `255.255.255.0` for IPv4 and `ffff:ffff:ffff:ffff::` for
    /// IPv6.
    pub fn mask(&self) -> String {
        self.subnet.mask().to_string()
    }
}

/// `start-end`, the form host-local uses in "no IP addresses available in range set: ...".
impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

/// Parses a CIDR. A prefix length is required (Go's `net.ParseCIDR` requires one too); host bits
/// are cleared like `net.ParseCIDR` does. IPv4 /31 and IPv6 /127 are refused: the defaults leave
/// no usable address in them and host-local refuses them as well.
fn parse_subnet(value: &str) -> Result<IpNetwork, RangeError> {
    let invalid = |reason: String| RangeError::InvalidSubnet {
        value: value.to_owned(),
        reason,
    };
    let (addr, prefix) = value
        .split_once('/')
        .ok_or_else(|| invalid("missing prefix length, e.g. 192.168.10.0/24".into()))?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| invalid(format!("{addr:?} is not an IP address")))?;
    let prefix: u8 = prefix
        .parse()
        .map_err(|_| invalid(format!("prefix length {prefix:?} is not a number")))?;
    let net = IpNetwork::new(addr, prefix)
        .and_then(|n| IpNetwork::new(n.network(), prefix))
        .map_err(|_| invalid(format!("prefix length {prefix} is too long")))?;
    if max_prefix(net) - net.prefix() == 1 {
        return Err(RangeError::SubnetTooSmall {
            subnet: net.to_string(),
        });
    }
    Ok(net)
}

/// Parses an optional address field and checks it against the subnet.
fn parse_field(
    field: &'static str,
    value: Option<&str>,
    net: IpNetwork,
) -> Result<Option<IpAddr>, RangeError> {
    let Some(text) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let ip = text
        .parse::<IpAddr>()
        .map_err(|_| RangeError::InvalidAddress {
            field,
            value: text.to_owned(),
        })?
        // `::ffff:10.0.0.1` is the IPv4 address to Go's net.ParseIP; treat it the same way.
        .to_canonical();
    check_inside(field, ip, net)?;
    Ok(Some(ip))
}

/// An explicit address must be inside the subnet and must not be the network or (IPv4) broadcast
/// address, except in a single-address subnet where that one address is the only host.
fn check_inside(field: &'static str, ip: IpAddr, net: IpNetwork) -> Result<(), RangeError> {
    let (value, subnet) = (ip.to_string(), net.to_string());
    if !net.contains(ip) {
        return Err(RangeError::OutsideSubnet {
            field,
            value,
            subnet,
        });
    }
    if is_single_address(net) {
        return Ok(());
    }
    if ip == net.network() {
        return Err(RangeError::NetworkAddress {
            field,
            value,
            subnet,
        });
    }
    if net.is_ipv4() && ip == net.broadcast() {
        return Err(RangeError::BroadcastAddress {
            field,
            value,
            subnet,
        });
    }
    Ok(())
}

/// Network + 1, or the address itself for a single-address subnet. Also the default gateway.
fn default_start(net: IpNetwork) -> Result<IpAddr, RangeError> {
    if is_single_address(net) {
        return Ok(net.network());
    }
    next(net.network()).ok_or_else(|| too_small(net))
}

/// The last address, minus one for IPv4 (the broadcast), or the address itself for a
/// single-address subnet.
fn default_end(net: IpNetwork) -> Result<IpAddr, RangeError> {
    if is_single_address(net) || net.is_ipv6() {
        return Ok(net.broadcast());
    }
    prev(net.broadcast()).ok_or_else(|| too_small(net))
}

fn too_small(net: IpNetwork) -> RangeError {
    RangeError::SubnetTooSmall {
        subnet: net.to_string(),
    }
}

fn max_prefix(net: IpNetwork) -> u8 {
    if net.is_ipv4() { 32 } else { 128 }
}

/// /32 or /128: the subnet is one address, which is both the range and not a gateway.
fn is_single_address(net: IpNetwork) -> bool {
    net.prefix() == max_prefix(net)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn range(subnet: &str, start: &str, end: &str, gw: &str) -> Result<Range, RangeError> {
        Range::parse(subnet, Some(start), Some(end), Some(gw))
    }

    /// (subnet, start, end, gateway) -> (start, end, gateway, size); "" = not given.
    #[test]
    fn defaults_and_explicit_values() {
        type Row<'a> = (
            &'a str,
            &'a str,
            &'a str,
            &'a str,
            &'a str,
            &'a str,
            &'a str,
            Option<&'a str>,
            u128,
        );
        let rows: &[Row] = &[
            // defaults copy host-local: .1 .. .254, gateway .1 skipped
            (
                "ipv4 defaults",
                "192.168.10.0/24",
                "",
                "",
                "",
                "192.168.10.1",
                "192.168.10.254",
                Some("192.168.10.1"),
                253,
            ),
            (
                "host bits cleared",
                "192.168.10.77/24",
                "",
                "",
                "",
                "192.168.10.1",
                "192.168.10.254",
                Some("192.168.10.1"),
                253,
            ),
            (
                "explicit start/end, default gw outside",
                "192.168.10.0/24",
                "192.168.10.10",
                "192.168.10.20",
                "",
                "192.168.10.10",
                "192.168.10.20",
                Some("192.168.10.1"),
                11,
            ),
            (
                "explicit gw inside range",
                "192.168.10.0/24",
                "192.168.10.10",
                "192.168.10.20",
                "192.168.10.15",
                "192.168.10.10",
                "192.168.10.20",
                Some("192.168.10.15"),
                10,
            ),
            (
                "start > end swapped",
                "192.168.10.0/24",
                "192.168.10.20",
                "192.168.10.10",
                "",
                "192.168.10.10",
                "192.168.10.20",
                Some("192.168.10.1"),
                11,
            ),
            (
                "/32 is one address, no gateway",
                "10.1.2.3/32",
                "",
                "",
                "",
                "10.1.2.3",
                "10.1.2.3",
                None,
                1,
            ),
            (
                "/32 explicit same address",
                "10.1.2.3/32",
                "10.1.2.3",
                "10.1.2.3",
                "",
                "10.1.2.3",
                "10.1.2.3",
                None,
                1,
            ),
            (
                "/30 two hosts minus gateway",
                "10.0.0.0/30",
                "",
                "",
                "",
                "10.0.0.1",
                "10.0.0.2",
                Some("10.0.0.1"),
                1,
            ),
            (
                "ipv6 defaults keep the last address",
                "fd00::/120",
                "",
                "",
                "",
                "fd00::1",
                "fd00::ff",
                Some("fd00::1"),
                254,
            ),
            (
                "ipv6 /128",
                "fd00::5/128",
                "",
                "",
                "",
                "fd00::5",
                "fd00::5",
                None,
                1,
            ),
            (
                "ipv6 /64 counts without enumerating",
                "fd00::/64",
                "",
                "",
                "",
                "fd00::1",
                "fd00::ffff:ffff:ffff:ffff",
                Some("fd00::1"),
                (1u128 << 64) - 2,
            ),
            (
                "mapped ipv4 in ipv4 subnet",
                "10.0.0.0/24",
                "::ffff:10.0.0.5",
                "",
                "",
                "10.0.0.5",
                "10.0.0.254",
                Some("10.0.0.1"),
                250,
            ),
        ];
        for (name, subnet, start, end, gw, want_start, want_end, want_gw, want_size) in rows {
            let r = range(subnet, start, end, gw).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(r.start(), ip(want_start), "{name}");
            assert_eq!(r.end(), ip(want_end), "{name}");
            assert_eq!(r.gateway(), want_gw.map(ip), "{name}");
            assert_eq!(r.size(), *want_size, "{name}");
        }
    }

    #[test]
    fn none_and_empty_string_both_mean_default() {
        let a = Range::parse("10.0.0.0/24", None, None, None).unwrap();
        let b = range("10.0.0.0/24", "", "", "").unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let rows: &[(&str, &str, &str, &str, &str)] = &[
            (
                "10.0.0.0/24",
                "10.0.1.5",
                "",
                "",
                "rangeStart 10.0.1.5 is outside subnet 10.0.0.0/24",
            ),
            (
                "10.0.0.0/24",
                "",
                "10.0.1.5",
                "",
                "rangeEnd 10.0.1.5 is outside subnet 10.0.0.0/24",
            ),
            (
                "10.0.0.0/24",
                "",
                "",
                "10.0.1.1",
                "gateway 10.0.1.1 is outside subnet 10.0.0.0/24",
            ),
            (
                "10.0.0.0/24",
                "fd00::1",
                "",
                "",
                "rangeStart fd00::1 is outside subnet 10.0.0.0/24",
            ),
            (
                "10.0.0.0/24",
                "10.0.0.0",
                "",
                "",
                "rangeStart 10.0.0.0 is the network address of subnet 10.0.0.0/24",
            ),
            (
                "10.0.0.0/24",
                "",
                "10.0.0.255",
                "",
                "rangeEnd 10.0.0.255 is the broadcast address of subnet 10.0.0.0/24",
            ),
            (
                "10.0.0.0/24",
                "",
                "",
                "10.0.0.255",
                "gateway 10.0.0.255 is the broadcast address of subnet 10.0.0.0/24",
            ),
            (
                "fd00::/120",
                "fd00::",
                "",
                "",
                "rangeStart fd00:: is the network address of subnet fd00::/120",
            ),
            (
                "10.0.0.0/24",
                "10.0.0.x",
                "",
                "",
                "invalid rangeStart \"10.0.0.x\": not an IP address",
            ),
            (
                "10.0.0.0/24",
                "",
                "",
                "gw",
                "invalid gateway \"gw\": not an IP address",
            ),
            (
                "10.0.0.0",
                "",
                "",
                "",
                "invalid subnet \"10.0.0.0\": missing prefix length, e.g. 192.168.10.0/24",
            ),
            (
                "10.0.0.0/33",
                "",
                "",
                "",
                "invalid subnet \"10.0.0.0/33\": prefix length 33 is too long",
            ),
            (
                "10.0.0/24",
                "",
                "",
                "",
                "invalid subnet \"10.0.0/24\": \"10.0.0\" is not an IP address",
            ),
            (
                "10.0.0.0/x",
                "",
                "",
                "",
                "invalid subnet \"10.0.0.0/x\": prefix length \"x\" is not a number",
            ),
            (
                "10.0.0.0/31",
                "",
                "",
                "",
                "subnet 10.0.0.0/31 is too small to allocate from (use a /32 or /128 for a single address)",
            ),
            (
                "10.0.0.9/32",
                "10.0.0.8",
                "",
                "",
                "rangeStart 10.0.0.8 is outside subnet 10.0.0.9/32",
            ),
        ];
        for (subnet, start, end, gw, want) in rows {
            match range(subnet, start, end, gw) {
                Ok(r) => panic!("{subnet} {start} {end} {gw}: expected {want:?}, got {r:?}"),
                Err(e) => assert_eq!(e.to_string(), *want),
            }
        }
    }

    #[test]
    fn mask_is_written_like_go_net_ip_string() {
        let rows = [
            ("10.0.0.0/24", "255.255.255.0"),
            ("10.0.0.0/20", "255.255.240.0"),
            ("10.0.0.1/32", "255.255.255.255"),
            ("fd00::/64", "ffff:ffff:ffff:ffff::"),
        ];
        for (subnet, want) in rows {
            let r = Range::parse(subnet, None, None, None).unwrap();
            assert_eq!(r.mask(), want, "{subnet}");
        }
    }

    #[test]
    fn display_is_start_dash_end() {
        let r = range("10.0.0.0/24", "10.0.0.10", "10.0.0.20", "").unwrap();
        assert_eq!(r.to_string(), "10.0.0.10-10.0.0.20");
    }

    #[test]
    fn contains_and_allocatable() {
        let r = range("10.0.0.0/24", "10.0.0.1", "10.0.0.3", "").unwrap();
        assert!(r.contains(ip("10.0.0.1")));
        assert!(!r.is_allocatable(ip("10.0.0.1")), "gateway");
        assert!(r.is_allocatable(ip("10.0.0.3")));
        assert!(!r.contains(ip("10.0.0.4")));
        assert!(!r.contains(ip("::a00:2")), "other family");
    }
}
