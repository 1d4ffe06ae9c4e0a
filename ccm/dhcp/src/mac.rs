//! Synthetic MAC addresses: one stable, locally administered unicast MAC per seed (the Service
//! UID), and the `aa:bb:cc:dd:ee:ff` text form of the `kube-vip.io/hwaddr` annotation.

use super::DhcpError;

/// A stable MAC for `seed`: the same seed gives the same MAC in every process and release. The
/// first octet has the locally-administered bit set and the multicast bit clear (`x2`, `x6`, `xa`,
/// `xe`), so it can never clash with a vendor-assigned NIC address. 46 bits come from a 64-bit
/// FNV-1a hash of the seed, finalised with splitmix64.
pub fn mac_for(seed: &str) -> [u8; 6] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in seed.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let b = splitmix64(h).to_be_bytes();
    [(b[0] & 0xfc) | 0x02, b[1], b[2], b[3], b[4], b[5]]
}

pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `02:ab:cd:ef:01:23` (lowercase, as Go's `net.HardwareAddr.String()` and kube-vip write it).
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses `aa:bb:cc:dd:ee:ff` (or `aa-bb-...`, any case) into a unicast MAC. Rejects other
/// lengths, non-hex digits, the all-zero address and multicast/broadcast addresses (a DHCP client
/// identity must be a unicast MAC).
pub fn parse_mac(value: &str) -> Result<[u8; 6], DhcpError> {
    let bad = |reason| DhcpError::BadMac {
        value: value.to_string(),
        reason,
    };
    let trimmed = value.trim();
    let sep = if trimmed.contains('-') { '-' } else { ':' };
    let parts: Vec<&str> = trimmed.split(sep).collect();
    if parts.len() != 6 {
        return Err(bad("expected six hex octets separated by ':' or '-'"));
    }
    let mut mac = [0u8; 6];
    for (slot, part) in mac.iter_mut().zip(&parts) {
        if part.len() != 2 || !part.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad("each octet must be two hex digits"));
        }
        *slot =
            u8::from_str_radix(part, 16).map_err(|_| bad("each octet must be two hex digits"))?;
    }
    if mac == [0; 6] {
        return Err(bad("the all-zero address is not a client address"));
    }
    if mac[0] & 0x01 != 0 {
        return Err(bad(
            "a multicast or broadcast address is not a client address",
        ));
    }
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_mac_and_known_value() {
        let uid = "0d3b5a3e-5c1f-4a7e-9a34-6a0c2b1f9e11";
        assert_eq!(mac_for(uid), mac_for(uid));
        // Pinned: changing the derivation would move every Service without an annotation.
        assert_eq!(format_mac(&mac_for(uid)), GOLDEN);
    }
    const GOLDEN: &str = "3e:85:a1:e8:ab:c6";

    #[test]
    fn macs_are_local_unicast_and_distinct() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..10_000 {
            let mac = mac_for(&format!("service-uid-{i}"));
            assert_eq!(mac[0] & 0x02, 0x02, "locally administered: {mac:02x?}");
            assert_eq!(mac[0] & 0x01, 0x00, "unicast: {mac:02x?}");
            assert!(seen.insert(mac), "collision at {i}");
        }
    }

    #[test]
    fn format_and_parse_round_trip() {
        let mac = [0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0x01];
        assert_eq!(format_mac(&mac), "02:aa:bb:cc:dd:01");
        assert_eq!(parse_mac("02:aa:bb:cc:dd:01").ok(), Some(mac));
        assert_eq!(parse_mac("02-AA-BB-CC-DD-01").ok(), Some(mac));
        assert_eq!(parse_mac(" 02:aa:bb:cc:dd:01 ").ok(), Some(mac));
    }

    #[test]
    fn parse_rejects_bad_text() {
        for bad in [
            "",
            "02:aa:bb:cc:dd",
            "02:aa:bb:cc:dd:01:02",
            "02:aa:bb:cc:dd:1",
            "02:aa:bb:cc:dd:0g",
            "02:aa:bb:cc:dd:+1",
            "00:00:00:00:00:00",
            "01:00:5e:00:00:01",
            "ff:ff:ff:ff:ff:ff",
            "02aabbccdd01",
            "02:aa-bb:cc:dd:01",
        ] {
            assert!(
                matches!(parse_mac(bad), Err(DhcpError::BadMac { .. })),
                "{bad:?}"
            );
        }
    }
}
