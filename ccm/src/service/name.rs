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
}
