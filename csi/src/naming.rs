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

/// Whether `s` is a DNS-1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

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
}
