//! The name of the Harvester LoadBalancer CR for a guest Service, computed exactly as upstream
//! (`loadBalancerName`), so a cluster can switch between the Go and Rust providers in place.

const MAX_BASE: usize = 55;

/// DNS-1035 label: lower-case letter first, then letters, digits and `-`, ending alphanumeric.
fn is_dns1035_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[b.len() - 1] != b'-'
}

/// `<cluster>-<namespace>-<name>-` truncated to 55 characters, then the CRC-32 (IEEE) of the
/// untruncated base plus the Service UID as 8 hex digits. A cluster name that is not a DNS-1035
/// label is prefixed with `a`.
pub fn lb_name(cluster: &str, namespace: &str, name: &str, uid: &str) -> String {
    let cluster = if is_dns1035_label(cluster) {
        cluster.to_string()
    } else {
        format!("a{cluster}")
    };
    let base = format!("{cluster}-{namespace}-{name}-");
    let suffix = format!("{:08x}", crc32fast::hash(format!("{base}{uid}").as_bytes()));
    let cut = base
        .char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(base.len()))
        .take_while(|i| *i <= MAX_BASE)
        .last()
        .unwrap_or(0);
    format!("{}{suffix}", &base[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_keep_the_whole_base() {
        let n = lb_name(
            "rke2",
            "default",
            "web",
            "8a5b7c3e-0000-4000-8000-000000000001",
        );
        let crc = crc32fast::hash(b"rke2-default-web-8a5b7c3e-0000-4000-8000-000000000001");
        assert_eq!(n, format!("rke2-default-web-{crc:08x}"));
    }

    #[test]
    fn long_names_are_cut_to_63() {
        let long = "a".repeat(80);
        let n = lb_name("cluster", "default", &long, "uid");
        assert_eq!(n.len(), 63);
        assert!(n.starts_with("cluster-default-aaaa"));
        let crc = crc32fast::hash(format!("cluster-default-{long}-uid").as_bytes());
        assert!(n.ends_with(&format!("{crc:08x}")));
    }

    #[test]
    fn a_cluster_name_that_is_not_a_dns1035_label_gets_a_prefix() {
        assert!(lb_name("1cluster", "ns", "svc", "u").starts_with("a1cluster-ns-svc-"));
        assert!(lb_name("", "ns", "svc", "u").starts_with("a-ns-svc-"));
        assert!(lb_name("rke2", "ns", "svc", "u").starts_with("rke2-ns-svc-"));
    }

    #[test]
    fn the_uid_changes_the_name() {
        assert_ne!(
            lb_name("c", "ns", "svc", "u1"),
            lb_name("c", "ns", "svc", "u2")
        );
    }

    use proptest::prelude::*;

    fn dns1123_label() -> impl Strategy<Value = String> {
        "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
    }

    /// Service names are DNS-1035 labels.
    fn dns1035_label() -> impl Strategy<Value = String> {
        "[a-z]([-a-z0-9]{0,61}[a-z0-9])?"
    }

    /// A cluster name as `--cluster-name` expects it (a DNS-1123 label, so possibly starting with
    /// a digit), or empty.
    fn cluster() -> impl Strategy<Value = String> {
        prop_oneof![dns1123_label(), Just(String::new())]
    }

    fn uid() -> impl Strategy<Value = String> {
        "[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    }

    /// The untruncated base as the doc comment describes it.
    fn base(cluster: &str, namespace: &str, name: &str) -> String {
        let cluster = if is_dns1035_label(cluster) {
            cluster.to_string()
        } else {
            format!("a{cluster}")
        };
        format!("{cluster}-{namespace}-{name}-")
    }

    proptest! {
        /// Valid names give a DNS-1035 label of at most 63 characters: the base cut to 55
        /// characters, then 8 lower-case hex digits; the same inputs give the same name.
        #[test]
        fn valid_inputs_give_a_dns1035_label(
            cluster in cluster(),
            namespace in dns1123_label(),
            name in dns1035_label(),
            uid in uid(),
        ) {
            let n = lb_name(&cluster, &namespace, &name, &uid);
            prop_assert!(is_dns1035_label(&n), "{n:?}");
            let base = base(&cluster, &namespace, &name);
            let (head, suffix) = n.split_at(n.len() - 8);
            prop_assert_eq!(head, &base[..base.len().min(MAX_BASE)]);
            prop_assert!(suffix.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
            prop_assert_eq!(n.clone(), lb_name(&cluster, &namespace, &name, &uid));
        }

        /// Any strings (non-ASCII too) never panic and never give more than 63 bytes.
        #[test]
        fn any_input_fits_63_bytes(cluster in ".*", namespace in ".*", name in ".*", uid in ".*") {
            let n = lb_name(&cluster, &namespace, &name, &uid);
            prop_assert!(n.len() <= 63 && n.len() >= 8, "{n:?}");
        }

        /// Distinct names with distinct cut bases never collide: the cut base is the name's
        /// prefix. (Bases can coincide: `a-b`/`c` and `a`/`b-c`, or names past 55 characters;
        /// then only the UID's CRC separates them, see the next property.)
        #[test]
        fn distinct_cut_bases_give_distinct_names(
            a in (cluster(), dns1123_label(), dns1035_label()),
            b in (cluster(), dns1123_label(), dns1035_label()),
            uid_a in uid(),
            uid_b in uid(),
        ) {
            let (ba, bb) = (base(&a.0, &a.1, &a.2), base(&b.0, &b.1, &b.2));
            prop_assume!(ba[..ba.len().min(MAX_BASE)] != bb[..bb.len().min(MAX_BASE)]);
            prop_assert_ne!(lb_name(&a.0, &a.1, &a.2, &uid_a), lb_name(&b.0, &b.1, &b.2, &uid_b));
        }

        /// For the same base, two UIDs of the same length that differ only within 4 consecutive
        /// bytes always give different names: CRC-32 detects every error burst of up to 32 bits.
        /// (UIDs differing more widely collide with probability 2^-32; not a guarantee, not
        /// tested.)
        #[test]
        fn uids_differing_in_a_short_burst_give_distinct_names(
            cluster in cluster(),
            namespace in dns1123_label(),
            name in dns1035_label(),
            uid in uid(),
            at in 0usize..33,
            burst in proptest::collection::vec("[0-9a-f]", 1..=4),
        ) {
            let mut other: Vec<u8> = uid.clone().into_bytes();
            for (i, c) in burst.iter().enumerate() {
                other[at + i] = c.as_bytes()[0];
            }
            let other = String::from_utf8(other).unwrap();
            prop_assume!(other != uid);
            prop_assert_ne!(
                lb_name(&cluster, &namespace, &name, &uid),
                lb_name(&cluster, &namespace, &name, &other)
            );
        }
    }
}
