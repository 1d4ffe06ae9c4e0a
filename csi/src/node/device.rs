//! Finding a hot-plugged disk: by its serial in the by-id directory
//! (`scsi-0QEMU_QEMU_HARDDISK_<serial>`), else in sysfs (`/sys/block/*/device/vpd_pg80` for SCSI,
//! `/sys/block/*/serial` for virtio), polling with a bound while the hot-plug completes.

use std::io::{Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::collections::HashMap;

use harvester_common::harvester::kubevirt::CONTEXT_SERIAL;

use super::mount::MountInfo;
use crate::error::NodeError;
use crate::naming;

/// The by-id name QEMU's SCSI disk gets from udev, before the serial.
pub const BY_ID_PREFIX: &str = "scsi-0QEMU_QEMU_HARDDISK_";
const POLL: Duration = Duration::from_millis(200);

/// How to recognise the disk of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskId {
    pub serial: String,
    /// Also accept a by-id name containing the volume ID: how the upstream driver finds disks it
    /// hot-plugged without a serial. Only set when the publish context carried no serial.
    pub volume: Option<String>,
}

/// Picks the by-id entry of a disk among directory entry names: exactly QEMU's SCSI name, else
/// any name ending in `_<serial>` or `-<serial>` (virtio, other buses), else (upstream disks)
/// a whole-disk name ending in `-<volume ID>` or `_<volume ID>` (libvirt's alias
/// `drive-ua-<volume>`). A name that merely contains the ID (`pvc-1` in `...pvc-10`) is another
/// disk; partitions (`-partN`) never match.
pub fn pick_by_id<'a>(names: &'a [String], id: &DiskId) -> Option<&'a str> {
    let exact = format!("{BY_ID_PREFIX}{}", id.serial);
    let whole = |n: &&String| !n.contains("-part");
    let ends_in = |n: &str, tail: &str| {
        n.strip_suffix(tail)
            .is_some_and(|p| p.ends_with('_') || p.ends_with('-'))
    };
    names
        .iter()
        .find(|n| **n == exact)
        .or_else(|| names.iter().filter(whole).find(|n| ends_in(n, &id.serial)))
        .or_else(|| {
            let v = id.volume.as_deref()?;
            names.iter().filter(whole).find(|n| ends_in(n, v))
        })
        .map(String::as_str)
}

/// The unit serial in a SCSI VPD page 0x80: 4 header bytes (length in byte 3), then the serial.
pub fn serial_from_vpd_pg80(page: &[u8]) -> Option<String> {
    let len = usize::from(*page.get(3)?);
    let raw = page.get(4..4 + len).or_else(|| page.get(4..))?;
    let s = String::from_utf8_lossy(raw);
    let s = s.trim_matches(|c: char| c.is_whitespace() || c == '\0');
    (!s.is_empty()).then(|| s.to_string())
}

fn by_id_lookup(dir: &Path, id: &DiskId) -> Option<PathBuf> {
    let names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let name = pick_by_id(&names, id)?;
    // A dangling link (the disk just went) is no disk.
    std::fs::canonicalize(dir.join(name)).ok()
}

fn sysfs_lookup(sysfs: &Path, serial: &str) -> Option<PathBuf> {
    let block = sysfs.join("block");
    for entry in std::fs::read_dir(block).ok()?.filter_map(|e| e.ok()) {
        let dir = entry.path();
        let found = std::fs::read_to_string(dir.join("serial"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .or_else(|| {
                std::fs::read(dir.join("device/vpd_pg80"))
                    .ok()
                    .and_then(|p| serial_from_vpd_pg80(&p))
            });
        if found.as_deref() == Some(serial) {
            let dev = Path::new("/dev").join(entry.file_name());
            if dev.exists() {
                return Some(dev);
            }
        }
    }
    None
}

/// The device node of disk `id`, if it is there now.
pub fn lookup(by_id: &Path, sysfs: &Path, id: &DiskId) -> Option<PathBuf> {
    by_id_lookup(by_id, id).or_else(|| sysfs_lookup(sysfs, &id.serial))
}

/// Waits up to `limit` for disk `id` to appear.
pub async fn wait_for(
    volume: &str,
    by_id: &Path,
    sysfs: &Path,
    id: &DiskId,
    limit: Duration,
) -> Result<PathBuf, NodeError> {
    let start = Instant::now();
    loop {
        if let Some(dev) = lookup(by_id, sysfs, id) {
            return Ok(dev);
        }
        if start.elapsed() >= limit {
            return Err(NodeError::DeviceNotFound {
                volume: volume.to_string(),
                serial: id.serial.clone(),
                dir: by_id.to_path_buf(),
                waited: limit,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Size in bytes of a block device (or of whatever `path` opens to).
pub fn size_of(path: &Path) -> Result<u64, NodeError> {
    let mut f = std::fs::File::open(path).map_err(NodeError::io("opening", path))?;
    f.seek(SeekFrom::End(0))
        .map_err(NodeError::io("measuring", path))
}

/// `(major, minor)` of a device node.
pub fn rdev_of(path: &Path) -> Result<(u32, u32), NodeError> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).map_err(NodeError::io("inspecting", path))?;
    Ok(super::mount::dev_major_minor(m.rdev()))
}

/// The block device behind a mount: its source when that is a device node with the mount's
/// numbers, else the `DEVNAME` sysfs gives for them.
pub fn device_of_mount(sysfs: &Path, m: &MountInfo) -> Option<PathBuf> {
    let src = Path::new(&m.source);
    if src.starts_with("/dev/") && rdev_of(src).ok() == Some((m.major, m.minor)) {
        return Some(src.to_path_buf());
    }
    let uevent =
        std::fs::read_to_string(sysfs.join(format!("dev/block/{}:{}/uevent", m.major, m.minor)))
            .ok()?;
    let name = uevent.lines().find_map(|l| l.strip_prefix("DEVNAME="))?;
    Some(Path::new("/dev").join(name))
}

/// How to recognise the disk of `volume`: the serial from the publish context, else the derived
/// serial or (upstream-attached disks without serial) the volume ID in the by-id name.
pub fn disk_id(volume: &str, publish_context: &HashMap<String, String>) -> DiskId {
    match publish_context
        .get(CONTEXT_SERIAL)
        .filter(|s| !s.is_empty())
    {
        Some(serial) => DiskId {
            serial: serial.clone(),
            volume: None,
        },
        None => DiskId {
            serial: naming::disk_serial(volume),
            volume: Some(volume.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_is_looked_up_by_the_published_serial() {
        let ctx = HashMap::from([(CONTEXT_SERIAL.to_string(), "abc".to_string())]);
        assert_eq!(
            disk_id("pvc-1", &ctx),
            DiskId {
                serial: "abc".into(),
                volume: None
            }
        );
        let d = disk_id("pvc-1", &HashMap::new());
        assert_eq!(d.serial, naming::disk_serial("pvc-1"));
        assert_eq!(d.volume.as_deref(), Some("pvc-1"));
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn by_id_names_match_the_serial_and_never_a_partition() {
        let id = DiskId {
            serial: "0123456789abcdef0123".into(),
            volume: None,
        };
        let n = names(&[
            "scsi-0QEMU_QEMU_HARDDISK_0123456789abcdef0123-part1",
            "virtio-0123456789abcdef0123",
            "scsi-0QEMU_QEMU_HARDDISK_0123456789abcdef0123",
        ]);
        assert_eq!(
            pick_by_id(&n, &id),
            Some("scsi-0QEMU_QEMU_HARDDISK_0123456789abcdef0123")
        );
        let n = names(&["virtio-0123456789abcdef0123", "wwn-0x1"]);
        assert_eq!(pick_by_id(&n, &id), Some("virtio-0123456789abcdef0123"));
        let n = names(&["scsi-0QEMU_QEMU_HARDDISK_x0123456789abcdef0123"]);
        assert_eq!(pick_by_id(&n, &id), None, "a longer serial is another disk");
        let upstream = DiskId {
            serial: id.serial.clone(),
            volume: Some("pvc-42".into()),
        };
        let n = names(&[
            "scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-42-part1",
            "scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-42",
        ]);
        assert_eq!(
            pick_by_id(&n, &upstream),
            Some("scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-42")
        );
        assert_eq!(pick_by_id(&n, &id), None, "volume match only when asked");
        let n = names(&[
            "scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-420",
            "scsi-0QEMU_QEMU_HARDDISK_drive-ua-pvc-42x",
            "scsi-0QEMU_QEMU_HARDDISK_drive-ua-xpvc-42",
        ]);
        assert_eq!(
            pick_by_id(&n, &upstream),
            None,
            "a name that only contains the volume ID is another disk"
        );
    }

    #[test]
    fn vpd_page_80_yields_the_serial() {
        let mut page = vec![0x00, 0x80, 0x00, 20];
        page.extend_from_slice(b"0123456789abcdef0123");
        assert_eq!(
            serial_from_vpd_pg80(&page).as_deref(),
            Some("0123456789abcdef0123")
        );
        let padded = [0, 0x80, 0, 6, b'a', b'b', b' ', b' ', 0, 0];
        assert_eq!(serial_from_vpd_pg80(&padded).as_deref(), Some("ab"));
        assert_eq!(serial_from_vpd_pg80(&[0, 0x80]), None);
        assert_eq!(serial_from_vpd_pg80(&[0, 0x80, 0, 2, b' ', 0]), None);
    }

    #[test]
    fn lookup_follows_links_and_falls_back_to_sysfs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let by_id = dir.path().join("by-id");
        let sys = dir.path().join("sys");
        std::fs::create_dir_all(&by_id).expect("by-id");
        std::fs::create_dir_all(sys.join("block/null/device")).expect("sysfs");
        let id = DiskId {
            serial: "s1".into(),
            volume: None,
        };
        assert_eq!(lookup(&by_id, &sys, &id), None);
        // sysfs fallback: /sys/block/null/serial -> /dev/null (exists everywhere)
        std::fs::write(sys.join("block/null/serial"), "s1\n").expect("serial");
        assert_eq!(lookup(&by_id, &sys, &id), Some(PathBuf::from("/dev/null")));
        // by-id wins, and its link is resolved
        std::os::unix::fs::symlink("/dev/zero", by_id.join(format!("{BY_ID_PREFIX}s1")))
            .expect("link");
        assert_eq!(lookup(&by_id, &sys, &id), Some(PathBuf::from("/dev/zero")));
    }
}
