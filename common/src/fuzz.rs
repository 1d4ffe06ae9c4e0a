//! Bodies of the fuzz targets in `common/fuzz/` (see `docs/fuzzing.md`): plain functions that
//! panic when an invariant breaks, so `cargo fuzz` and the unit tests below run the same code.
//! Each takes arbitrary bytes, as a string from outside would arrive. (The DHCP reply target lives
//! with its code in `ccm/dhcp/fuzz/`.)

use base64::Engine;

/// A cloud-config token: [`crate::cloud_config::jwt_expiry`] never panics on any string, and on a
/// token whose payload segment is these bytes it reads `exp` exactly when they are a JSON object
/// with an integer `exp` a timestamp can hold.
pub fn jwt_expiry(data: &[u8]) {
    let token = String::from_utf8_lossy(data);
    if crate::cloud_config::jwt_expiry(&token).is_some() {
        assert!(
            token.contains('.'),
            "an expiry from a token without segments"
        );
    }
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(data);
    let got = crate::cloud_config::jwt_expiry(&format!("eyJhbGciOiJSUzI1NiJ9.{payload}.sig"));
    let want = serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|v| v.get("exp")?.as_i64())
        .and_then(|s| jiff::Timestamp::from_second(s).ok());
    assert_eq!(got, want);
}

/// A Kubernetes quantity: [`crate::quantity::to_bytes`] never panics, and a byte count it returns
/// formats back to a quantity of the same size.
pub fn quantity(data: &[u8]) {
    let q = String::from_utf8_lossy(data);
    if let Some(bytes) = crate::quantity::to_bytes(&q) {
        let formatted = crate::quantity::from_bytes(bytes);
        assert_eq!(
            crate::quantity::to_bytes(&formatted),
            Some(bytes),
            "{q:?} -> {formatted}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwt_expiry_seeds() {
        for seed in [
            &br#"{"exp":1900000000}"#[..],
            br#"{"exp":-1e400}"#,
            br#"{"exp":99999999999999999}"#,
            br#"{"exp":"1"}"#,
            br#"[1,2]"#,
            b"a.b.c",
            b"..",
            b"\xff\xfe.\x00",
            b"",
        ] {
            jwt_expiry(seed);
        }
    }

    #[test]
    fn quantity_seeds() {
        for seed in [
            &b"64Mi"[..],
            b"1.5Gi",
            b".5",
            b"0.000000000000000001Ei",
            b"18446744073709551615",
            b"18446744073709551616",
            b"1..2",
            b" 7k ",
            b"\xff",
        ] {
            quantity(seed);
        }
    }

    proptest::proptest! {
        /// The bodies over random bytes, so `cargo test` covers a little of what `make fuzz` does.
        #[test]
        fn bodies_hold_on_random_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            jwt_expiry(&bytes);
            quantity(&bytes);
        }

        #[test]
        fn jwt_expiry_holds_for_any_exp(exp in proptest::prelude::any::<i64>()) {
            jwt_expiry(format!(r#"{{"sub":"x","exp":{exp}}}"#).as_bytes());
        }

        #[test]
        fn quantity_holds_for_any_number(
            number in "[0-9]{0,22}(\\.[0-9]{0,20})?",
            suffix in "(|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)",
        ) {
            quantity(format!("{number}{suffix}").as_bytes());
        }
    }
}
