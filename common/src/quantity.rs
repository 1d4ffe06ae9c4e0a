//! Kubernetes resource quantities (`64Mi`, `1G`, `1073741824`) as byte counts.

/// Bytes of a storage quantity. Fractions round up; `None` for anything that is not a quantity
/// or does not fit in a `u64`.
pub fn to_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let multiplier: u128 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        _ => return None,
    };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return None;
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let scale = 10u128.pow(frac.len() as u32);
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let total = int
        .checked_mul(multiplier)?
        .checked_add((frac.checked_mul(multiplier)?).div_ceil(scale))?;
    u64::try_from(total).ok()
}

/// A byte count as a quantity string (`Mi`/`Gi` when exact, plain bytes otherwise).
pub fn from_bytes(bytes: u64) -> String {
    const GI: u64 = 1 << 30;
    const MI: u64 = 1 << 20;
    if bytes != 0 && bytes.is_multiple_of(GI) {
        format!("{}Gi", bytes / GI)
    } else if bytes != 0 && bytes.is_multiple_of(MI) {
        format!("{}Mi", bytes / MI)
    } else {
        bytes.to_string()
    }
}

/// The `storage` request of a claim spec, in bytes: the size of a PVC, or of the PVC a
/// Harvester backup was taken of.
pub fn storage_request(
    spec: &k8s_openapi::api::core::v1::PersistentVolumeClaimSpec,
) -> Option<u64> {
    to_bytes(
        &spec
            .resources
            .as_ref()?
            .requests
            .as_ref()?
            .get("storage")?
            .0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_quantities() {
        for (q, want) in [
            ("64Mi", Some(64 << 20)),
            ("1Gi", Some(1 << 30)),
            ("1G", Some(1_000_000_000)),
            ("1073741824", Some(1 << 30)),
            ("1.5Gi", Some(3 << 29)),
            ("0.1", Some(1)),
            ("", None),
            ("Mi", None),
            ("12x", None),
            ("1.2.3", None),
            ("-1", None),
            ("99999999999Ei", None),
        ] {
            assert_eq!(to_bytes(q), want, "quantity {q:?}");
        }
    }

    #[test]
    fn formats_round_trip() {
        for b in [0u64, 1, 5 << 20, 3 << 30, (1 << 30) + 1] {
            assert_eq!(to_bytes(&from_bytes(b)), Some(b));
        }
        assert_eq!(from_bytes(64 << 20), "64Mi");
        assert_eq!(from_bytes(2 << 30), "2Gi");
    }
}
