//! Deterministic names: CSI volume names -> Harvester PVC names, volume IDs -> disk serials.
//!
//! - A CSI name that already is a DNS-1123 label (`pvc-<uid>` from the external-provisioner) is
//!   kept, so volume IDs match the upstream driver's (volume ID = Harvester PVC name).
//! - Any other name (upper case, too long, odd characters; csi-sanity sends all of these) becomes
//!   `<sanitised prefix>-<10 hex of sha256(name)>`, at most 63 characters. The original name is
//!   kept in the PVC annotation [`ORIGINAL_NAME_ANNOTATION`] so a retry can be told from a clash.
//! - The disk serial is the first [`SERIAL_LEN`] hex characters of sha256(volume ID). QEMU's SCSI
//!   disk puts at most 20 characters of the serial into the VPD page that udev turns into
//!   `/dev/disk/by-id/scsi-0QEMU_QEMU_HARDDISK_<serial>`, so a 20-character serial is found by
//!   the same full name on every QEMU version (80 bits: collisions are not a practical concern).

use sha2::{Digest, Sha256};

/// Longest Kubernetes object name we produce (KubeVirt volume and disk names are DNS-1123 labels).
pub const MAX_NAME: usize = 63;
/// Length of a disk serial (QEMU's by-id limit for SCSI disks).
pub const SERIAL_LEN: usize = 20;
/// Hex characters of the hash suffix of a mapped name.
const HASH_LEN: usize = 10;
/// Annotation on a Harvester PVC holding the CSI name it was created for, when that differs.
pub const ORIGINAL_NAME_ANNOTATION: &str = "csi.harvesterhci.io/volume-name";

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub use harvester_common::names::is_dns1123_label;

/// The Harvester PVC name (= volume ID) for CSI volume name `name`.
pub fn host_volume_name(name: &str) -> String {
    if is_dns1123_label(name) {
        return name.to_string();
    }
    let mut prefix = String::new();
    for c in name.chars() {
        let c = c.to_ascii_lowercase();
        let c = if c.is_ascii_lowercase() || c.is_ascii_digit() {
            c
        } else {
            '-'
        };
        if c == '-' && (prefix.is_empty() || prefix.ends_with('-')) {
            continue;
        }
        prefix.push(c);
    }
    prefix.truncate(MAX_NAME - HASH_LEN - 1);
    let prefix = prefix.trim_end_matches('-');
    let hash = &sha256_hex(name)[..HASH_LEN];
    if prefix.is_empty() {
        format!("vol-{hash}")
    } else {
        format!("{prefix}-{hash}")
    }
}

/// The disk serial of volume `volume_id` (20 lower-case hex characters).
pub fn disk_serial(volume_id: &str) -> String {
    sha256_hex(volume_id)[..SERIAL_LEN].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provisioner_names_are_kept() {
        for name in [
            "pvc-0b1d4a8e-6a43-4a8e-9f7e-0e3f2a1b2c3d",
            "data",
            "a",
            "x-1",
        ] {
            assert_eq!(host_volume_name(name), name);
        }
    }

    #[test]
    fn other_names_map_to_labels_deterministically() {
        let long = "sanity-max-length-name-".repeat(6);
        for name in [
            "sanity-node-full-35A55673-604D59E1",
            long.as_str(),
            "UPPER",
            "-leading",
            "trailing-",
            "__",
            "a.b_c",
            "ünïcode",
        ] {
            let mapped = host_volume_name(name);
            assert!(is_dns1123_label(&mapped), "{name:?} -> {mapped:?}");
            assert_eq!(mapped, host_volume_name(name), "deterministic");
        }
        assert_eq!(
            &host_volume_name("sanity-node-full-35A55673-604D59E1")[..34],
            "sanity-node-full-35a55673-604d59e1"
        );
        assert!(host_volume_name("__").starts_with("vol-"));
    }

    #[test]
    fn names_differing_only_in_case_do_not_collide() {
        assert_ne!(host_volume_name("Data"), host_volume_name("DATA"));
        assert_ne!(host_volume_name("Data"), "data");
    }

    #[test]
    fn serials_fit_qemus_by_id_limit() {
        let s = disk_serial("pvc-0b1d4a8e-6a43-4a8e-9f7e-0e3f2a1b2c3d");
        assert_eq!(s.len(), SERIAL_LEN);
        assert!(s.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(s, disk_serial("pvc-0b1d4a8e-6a43-4a8e-9f7e-0e3f2a1b2c3d"));
        assert_ne!(s, disk_serial("pvc-other"));
    }

    use proptest::prelude::*;
    use std::collections::HashMap;

    fn label() -> impl Strategy<Value = String> {
        "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
    }

    /// CSI names of every kind: provisioner names, labels, csi-sanity-like names, anything.
    fn csi_name() -> impl Strategy<Value = String> {
        prop_oneof![
            "pvc-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            label(),
            "[-a-zA-Z0-9_.]{1,100}",
            any::<String>(),
        ]
    }

    proptest! {
        /// Every name maps to a DNS-1123 label, the same one each time; labels map to themselves.
        #[test]
        fn every_name_maps_to_a_label_deterministically(name in csi_name()) {
            let mapped = host_volume_name(&name);
            prop_assert!(is_dns1123_label(&mapped), "{name:?} -> {mapped:?}");
            prop_assert_eq!(&mapped, &host_volume_name(&name));
            if is_dns1123_label(&name) {
                prop_assert_eq!(&mapped, &name);
            }
        }

        /// Any other name becomes `<prefix>-<10 hex of sha256(name)>`, where the prefix keeps the
        /// name's ASCII letters and digits in order (lower-cased, cut), or is `vol` when it has none.
        #[test]
        fn mapped_names_are_a_readable_prefix_and_the_hash(
            name in csi_name().prop_filter("not a label", |n| !is_dns1123_label(n)),
        ) {
            let mapped = host_volume_name(&name);
            let (prefix, hash) = mapped.rsplit_once('-').unwrap();
            prop_assert_eq!(hash, &sha256_hex(&name)[..HASH_LEN]);
            let alnum: String = name
                .chars()
                .filter(|c| c.is_ascii_alphanumeric())
                .map(|c| c.to_ascii_lowercase())
                .collect();
            if alnum.is_empty() {
                prop_assert_eq!(prefix, "vol");
            } else {
                let kept = prefix.replace('-', "");
                prop_assert!(!kept.is_empty() && alnum.starts_with(&kept), "{name:?} -> {mapped:?}");
                prop_assert!(!prefix.contains("--"), "{mapped:?}");
            }
        }

        /// Distinct names give distinct volume names within a run. Not a guarantee for mapped
        /// names (a 40-bit hash; the original-name annotation tells a clash from a retry), but a
        /// collision here would mean the hash or the label rule is broken.
        #[test]
        fn distinct_names_do_not_collide(names in proptest::collection::hash_set(csi_name(), 1..24)) {
            let mut seen = HashMap::new();
            for name in &names {
                if let Some(other) = seen.insert(host_volume_name(name), name) {
                    prop_assert!(false, "{other:?} and {name:?} both map to {:?}", host_volume_name(name));
                }
            }
        }

        /// A serial is the first 20 lower-case hex digits of sha256(volume ID), the same each time,
        /// and distinct volume IDs get distinct serials within a run (80 bits).
        #[test]
        fn serials_are_20_hex_and_distinct(ids in proptest::collection::hash_set(csi_name(), 1..24)) {
            let mut seen = HashMap::new();
            for id in &ids {
                let s = disk_serial(id);
                prop_assert_eq!(s.len(), SERIAL_LEN);
                prop_assert!(s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)), "{s}");
                prop_assert_eq!(&s, &disk_serial(id));
                prop_assert!(sha256_hex(id).starts_with(&s));
                if let Some(other) = seen.insert(s.clone(), id) {
                    prop_assert!(false, "{other:?} and {id:?} share serial {s}");
                }
            }
        }
    }
}
