//! Address arithmetic on `IpAddr` as a `u128`, so IPv4 and IPv6 share one code path.
//!
//! Every step is checked: a range may end at `255.255.255.255` or `ffff:...:ffff`, and walking
//! past it must end the walk instead of wrapping or panicking.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The address as an unsigned integer within its own family.
pub(crate) fn to_bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The address of the same family as `like` whose integer value is `bits`; `None` when `bits`
/// does not fit that family.
pub(crate) fn from_bits(like: IpAddr, bits: u128) -> Option<IpAddr> {
    match like {
        IpAddr::V4(_) => u32::try_from(bits)
            .ok()
            .map(|b| IpAddr::V4(Ipv4Addr::from(b))),
        IpAddr::V6(_) => Some(IpAddr::V6(Ipv6Addr::from(bits))),
    }
}

/// Whether both addresses belong to the same family.
pub(crate) fn same_family(a: IpAddr, b: IpAddr) -> bool {
    a.is_ipv4() == b.is_ipv4()
}

/// The next address, `None` past the end of the family.
pub(crate) fn next(ip: IpAddr) -> Option<IpAddr> {
    from_bits(ip, to_bits(ip).checked_add(1)?)
}

/// The previous address, `None` before the start of the family.
pub(crate) fn prev(ip: IpAddr) -> Option<IpAddr> {
    from_bits(ip, to_bits(ip).checked_sub(1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_stop_at_the_family_edges() {
        let v4_max = IpAddr::V4(Ipv4Addr::BROADCAST);
        let v6_max = IpAddr::V6(Ipv6Addr::from(u128::MAX));
        assert_eq!(next(v4_max), None);
        assert_eq!(next(v6_max), None);
        assert_eq!(prev(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), None);
        assert_eq!(
            next("10.0.0.255".parse().unwrap_or(v4_max)),
            "10.0.1.0".parse().ok()
        );
        assert_eq!(from_bits(v4_max, u128::from(u32::MAX) + 1), None);
    }
}
