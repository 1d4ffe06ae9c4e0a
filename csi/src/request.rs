//! CSI request fields parsed into typed values at the edge. Every failure is an [`ArgError`]
//! naming the field, which becomes `INVALID_ARGUMENT`.

use std::path::PathBuf;

use csi_proto::csi::v1::{
    CapacityRange, VolumeCapability, volume_capability::AccessType as ProtoAccessType,
    volume_capability::access_mode::Mode as ProtoMode,
};

use crate::error::ArgError;

/// A required string field: non-empty.
pub fn required<'a>(field: &'static str, value: &'a str) -> Result<&'a str, ArgError> {
    if value.is_empty() {
        Err(ArgError::Missing { field })
    } else {
        Ok(value)
    }
}

/// A node ID as the controller takes it: the name of a VM in the Harvester namespace, so a
/// DNS-1123 subdomain (lowercase letters, digits, '-' and '.', at most 253 characters); anything
/// else is refused before it can reach a Harvester URL.
pub fn node_id<'a>(field: &'static str, value: &'a str) -> Result<&'a str, ArgError> {
    let value = required(field, value)?;
    let label_ok = |l: &str| harvester_common::names::is_dns1123_label(l);
    if value.len() > 253 || !value.split('.').all(label_ok) {
        return Err(ArgError::Invalid {
            field,
            reason: format!("{value:?} is not a VM name (a DNS-1123 subdomain)"),
        });
    }
    Ok(value)
}

/// Filesystems the node plugin can create and grow.
pub const SUPPORTED_FS: [&str; 2] = ["ext4", "xfs"];
/// The filesystem of a mount volume that names none (upstream's default).
pub const DEFAULT_FS: &str = "ext4";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// A filesystem; `fs_type` is already defaulted and checked against [`SUPPORTED_FS`].
    Mount {
        fs_type: String,
        flags: Vec<String>,
    },
    Block,
}

/// Access modes this driver serves: one node at a time (the disk is hot-plugged into one VM),
/// or, for a filesystem, many nodes at once (an RWX volume: Longhorn's share manager serves it
/// over NFS through a NetworkFilesystem; `controller::nfs`, `node::nfs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeMultiWriter,
}

/// `fs_type`s an RWX (NFS) capability may name besides [`SUPPORTED_FS`]: the filesystem is the
/// share manager's, so the CO's choice is not used; an NFS name is what it really is.
pub const NFS_FS: [&str; 2] = ["nfs", "nfs4"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capability {
    pub access: Access,
    pub mode: Mode,
}

impl Capability {
    pub fn is_block(&self) -> bool {
        self.access == Access::Block
    }

    pub fn read_only(&self) -> bool {
        self.mode == Mode::SingleNodeReaderOnly
    }

    /// An RWX volume (MULTI_NODE_MULTI_WRITER).
    pub fn is_rwx(&self) -> bool {
        self.mode == Mode::MultiNodeMultiWriter
    }

    /// Parses one capability. Unsupported modes and filesystems are errors naming `field`.
    pub fn parse(field: &'static str, cap: &VolumeCapability) -> Result<Capability, ArgError> {
        let invalid = |reason: String| ArgError::Invalid { field, reason };
        let access = match &cap.access_type {
            None => return Err(invalid("access_type (mount or block) is required".into())),
            Some(ProtoAccessType::Block(_)) => Access::Block,
            Some(ProtoAccessType::Mount(m)) => {
                let fs_type = if m.fs_type.is_empty() {
                    DEFAULT_FS.to_string()
                } else {
                    m.fs_type.to_ascii_lowercase()
                };
                let multi = cap
                    .access_mode
                    .as_ref()
                    .is_some_and(|m| m.mode == ProtoMode::MultiNodeMultiWriter as i32);
                let nfs = multi && NFS_FS.contains(&fs_type.as_str());
                if !SUPPORTED_FS.contains(&fs_type.as_str()) && !nfs {
                    return Err(invalid(format!(
                        "fs_type {:?} is not supported (supported: {})",
                        m.fs_type,
                        SUPPORTED_FS.join(", ")
                    )));
                }
                if let Some(bad) = m.mount_flags.iter().find(|f| f.trim().is_empty()) {
                    return Err(invalid(format!("mount_flags has an empty flag {bad:?}")));
                }
                if let Some(bad) = m
                    .mount_flags
                    .iter()
                    .find(|f| f.chars().any(char::is_control))
                {
                    return Err(invalid(format!(
                        "mount_flags has a flag with a control character: {}",
                        shown(bad)
                    )));
                }
                Access::Mount {
                    fs_type,
                    flags: m.mount_flags.clone(),
                }
            }
        };
        let Some(mode) = &cap.access_mode else {
            return Err(invalid("access_mode is required".into()));
        };
        let mode = match ProtoMode::try_from(mode.mode) {
            Ok(ProtoMode::SingleNodeWriter) => Mode::SingleNodeWriter,
            Ok(ProtoMode::SingleNodeReaderOnly) => Mode::SingleNodeReaderOnly,
            Ok(ProtoMode::MultiNodeMultiWriter) if access == Access::Block => {
                return Err(invalid(
                    "access mode MULTI_NODE_MULTI_WRITER is served for filesystem (mount) volumes \
                     only, over NFS; a block volume is hot-plugged into one VM at a time"
                        .into(),
                ));
            }
            Ok(ProtoMode::MultiNodeMultiWriter) => Mode::MultiNodeMultiWriter,
            Ok(other) => {
                return Err(invalid(format!(
                    "access mode {} is not supported (supported: SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY, MULTI_NODE_MULTI_WRITER for mount volumes)",
                    other.as_str_name()
                )));
            }
            Err(_) => return Err(invalid(format!("unknown access mode {}", mode.mode))),
        };
        Ok(Capability { access, mode })
    }
}

/// A required capability field.
pub fn capability(
    field: &'static str,
    cap: Option<&VolumeCapability>,
) -> Result<Capability, ArgError> {
    Capability::parse(field, cap.ok_or(ArgError::Missing { field })?)
}

/// A required, non-empty list of capabilities.
pub fn capabilities(
    field: &'static str,
    caps: &[VolumeCapability],
) -> Result<Vec<Capability>, ArgError> {
    if caps.is_empty() {
        return Err(ArgError::Missing { field });
    }
    caps.iter().map(|c| Capability::parse(field, c)).collect()
}

/// Longest path the kernel takes (`PATH_MAX` 4096, the terminating NUL included).
pub const MAX_PATH_BYTES: usize = 4095;
/// Longest path component (`NAME_MAX`).
pub const MAX_NAME_BYTES: usize = 255;

/// A value as an error message shows it: quoted, and cut after 120 characters.
fn shown(value: &str) -> String {
    const MAX: usize = 120;
    match value.char_indices().nth(MAX) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &value[..cut], value.len()),
    }
}

/// Why `value` is not an absolute, clean path, if it is not one.
pub fn path_problem(value: &str) -> Option<String> {
    if value.contains('\0') {
        return Some("contains a NUL byte".into());
    }
    if !value.starts_with('/') {
        return Some(
            "is not an absolute path (it would resolve against the plugin's working directory)"
                .into(),
        );
    }
    if value.len() > MAX_PATH_BYTES {
        return Some(format!(
            "is {} bytes long, above the kernel's limit of {MAX_PATH_BYTES}",
            value.len()
        ));
    }
    if value == "/" {
        return Some("is the root directory".into());
    }
    for part in value[1..].split('/') {
        match part {
            "" => {
                return Some(
                    "is not clean: it has an empty component (\"//\" or a trailing \"/\")".into(),
                );
            }
            "." | ".." => return Some(format!("is not clean: it has a {part:?} component")),
            p if p.len() > MAX_NAME_BYTES => {
                return Some(format!(
                    "has a component of {} bytes, above the kernel's limit of {MAX_NAME_BYTES}",
                    p.len()
                ));
            }
            _ => {}
        }
    }
    None
}

/// A required node path (staging or target path): absolute and clean (no `.`, `..` or empty
/// components), as kubelet sends them. Anything else is an error naming the field and the value.
pub fn node_path(field: &'static str, value: &str) -> Result<PathBuf, ArgError> {
    let value = required(field, value)?;
    match path_problem(value) {
        None => Ok(PathBuf::from(value)),
        Some(reason) => Err(ArgError::Invalid {
            field,
            reason: format!("{} {reason}", shown(value)),
        }),
    }
}

/// `(required_bytes, limit_bytes)` of a capacity range (0 for an absent one); a negative bound
/// is an error naming the field.
pub fn range_bytes(
    field: &'static str,
    range: Option<&CapacityRange>,
) -> Result<(u64, u64), ArgError> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    let invalid = |reason: String| ArgError::Invalid { field, reason };
    let required = u64::try_from(required)
        .map_err(|_| invalid(format!("required_bytes {required} is negative")))?;
    let limit =
        u64::try_from(limit).map_err(|_| invalid(format!("limit_bytes {limit} is negative")))?;
    Ok((required, limit))
}

/// The smallest xfs filesystem `mkfs.xfs` makes: xfsprogs 5.19 and later refuse a data section
/// under 300 MiB ("Filesystem must be larger than 300MB.", `mkfs/xfs_mkfs.c`
/// `validate_min_size` since xfsprogs v5.19.0: `sb_dblocks < MEGABYTES(300, blocklog)`).
pub const XFS_MIN_BYTES: u64 = 300 << 20;

/// The lower bound a filesystem puts on its volume's size, if above the driver's minimum.
pub fn fs_floor(fs_type: &str) -> Option<FloorBytes> {
    (fs_type == "xfs").then_some((
        XFS_MIN_BYTES,
        "xfs needs 314572800 bytes (300 MiB): mkfs.xfs refuses smaller filesystems",
    ))
}

/// The largest lower bound of the filesystems in `caps` (CreateVolume's capabilities).
pub fn caps_floor(caps: &[Capability]) -> Option<FloorBytes> {
    caps.iter()
        .filter_map(|c| match &c.access {
            Access::Mount { fs_type, .. } => fs_floor(fs_type),
            Access::Block => None,
        })
        .max_by_key(|f| f.0)
}

/// Smallest volume (upstream's `MinimalVolumeSize`), also the size when none is asked for.
pub const MIN_VOLUME_BYTES: u64 = 10 << 20;
/// Longhorn sizes volumes in 2 MiB steps; Harvester PVCs are rounded up to it (as upstream).
pub const SIZE_ALIGN: u64 = 2 << 20;

/// The size to provision for a capacity range: `required` (or the minimum) rounded up to
/// [`SIZE_ALIGN`]; an error when that exceeds `limit`.
pub fn volume_size(field: &'static str, range: Option<&CapacityRange>) -> Result<u64, ArgError> {
    volume_size_at_least(field, range, None)
}

/// A filesystem's own lower bound on a volume's size: `(bytes, why)`.
pub type FloorBytes = (u64, &'static str);

/// [`volume_size`] for a volume that must also hold at least `floor` bytes (a filesystem's
/// minimum): the request is raised to it when the limit allows, else OUT_OF_RANGE saying why.
pub fn volume_size_at_least(
    field: &'static str,
    range: Option<&CapacityRange>,
    floor: Option<FloorBytes>,
) -> Result<u64, ArgError> {
    capacity(field, range, floor).map(|c| c.size)
}

/// A `capacity_range`, read once: what was asked (`required_bytes`, 0 for nothing), the limit
/// (`limit_bytes`, 0 for none) and the volume size that serves them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub asked: u64,
    pub limit: u64,
    pub size: u64,
}

/// [`Capacity`] of `range`, the size as [`volume_size_at_least`] rounds it.
pub fn capacity(
    field: &'static str,
    range: Option<&CapacityRange>,
    floor: Option<FloorBytes>,
) -> Result<Capacity, ArgError> {
    let (required, limit) = range_bytes(field, range)?;
    let invalid = |reason: String| ArgError::Invalid { field, reason };
    if limit > 0 && required > limit {
        return Err(invalid(format!(
            "required_bytes {required} is above limit_bytes {limit}"
        )));
    }
    let (floor_bytes, why) = floor.unwrap_or((0, ""));
    let size = required
        .max(MIN_VOLUME_BYTES)
        .max(floor_bytes)
        .checked_next_multiple_of(SIZE_ALIGN)
        .ok_or_else(|| invalid(format!("required_bytes {required} is too large")))?;
    if limit > 0 && size > limit {
        let floor = if floor_bytes > MIN_VOLUME_BYTES {
            format!("{why}, ")
        } else {
            String::new()
        };
        return Err(ArgError::OutOfRange {
            field,
            reason: format!(
                "the smallest volume that holds {required} bytes is {size} bytes ({floor}minimum \
                 {MIN_VOLUME_BYTES}, 2 MiB steps), above limit_bytes {limit}"
            ),
        });
    }
    Ok(Capacity {
        asked: required,
        limit,
        size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi_proto::csi::v1::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(access: Option<ProtoAccessType>, mode: Option<ProtoMode>) -> VolumeCapability {
        VolumeCapability {
            access_type: access,
            access_mode: mode.map(|m| AccessMode { mode: m as i32 }),
        }
    }

    fn mount(fs: &str) -> Option<ProtoAccessType> {
        Some(ProtoAccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        }))
    }

    #[test]
    fn capabilities_parse_with_defaults_and_name_the_field() {
        let c = Capability::parse("cap", &cap(mount(""), Some(ProtoMode::SingleNodeWriter)));
        assert_eq!(
            c.unwrap().access,
            Access::Mount {
                fs_type: "ext4".into(),
                flags: vec![]
            }
        );
        let c = Capability::parse(
            "cap",
            &cap(
                Some(ProtoAccessType::Block(BlockVolume {})),
                Some(ProtoMode::SingleNodeReaderOnly),
            ),
        )
        .unwrap();
        assert!(c.is_block() && c.read_only());
        for (bad, needle) in [
            (cap(None, Some(ProtoMode::SingleNodeWriter)), "access_type"),
            (cap(mount("xfs"), None), "access_mode"),
            (
                cap(mount("btrfs"), Some(ProtoMode::SingleNodeWriter)),
                "btrfs",
            ),
            (
                cap(
                    Some(ProtoAccessType::Block(Default::default())),
                    Some(ProtoMode::MultiNodeMultiWriter),
                ),
                "MULTI_NODE_MULTI_WRITER is served for filesystem (mount) volumes only",
            ),
            (
                cap(mount("ext4"), Some(ProtoMode::MultiNodeSingleWriter)),
                "MULTI_NODE_SINGLE_WRITER",
            ),
            (cap(mount("nfs"), Some(ProtoMode::SingleNodeWriter)), "nfs"),
        ] {
            let e = Capability::parse("volume_capability", &bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("volume_capability") && e.contains(needle), "{e}");
        }
        assert_eq!(
            capability("volume_capability", None)
                .unwrap_err()
                .to_string(),
            "volume_capability is required"
        );
        assert!(capabilities("volume_capabilities", &[]).is_err());
        // RWX: a filesystem served over NFS; the CO's fs_type may be its usual one or nfs.
        for fs in ["", "ext4", "nfs", "NFS4"] {
            let c = Capability::parse(
                "volume_capability",
                &cap(mount(fs), Some(ProtoMode::MultiNodeMultiWriter)),
            )
            .unwrap();
            assert!(c.is_rwx() && !c.read_only() && !c.is_block(), "{fs}: {c:?}");
        }
    }

    fn range(required: i64, limit: i64) -> Option<CapacityRange> {
        Some(CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        })
    }

    #[test]
    fn sizes_round_up_to_2mib_above_the_minimum() {
        const MI: u64 = 1 << 20;
        for (r, want) in [
            (None, Some(10 * MI)),
            (range(0, 0), Some(10 * MI)),
            (range(1, 0), Some(10 * MI)),
            (range(64 << 20, 0), Some(64 * MI)),
            (range((64 << 20) + 1, 0), Some(66 * MI)),
            (range(11 << 20, 12 << 20), Some(12 * MI)),
            (range(11 << 20, 11 << 20), None),
            (range(5 << 20, 4 << 20), None),
            (range(-1, 0), None),
            (range(0, 1 << 20), None),
        ] {
            assert_eq!(
                volume_size("capacity_range", r.as_ref()).ok(),
                want,
                "{r:?}"
            );
        }
        assert!(matches!(
            volume_size("capacity_range", range(11 << 20, 11 << 20).as_ref()),
            Err(ArgError::OutOfRange { .. })
        ));
    }

    #[test]
    fn xfs_volumes_round_up_to_the_mkfs_xfs_minimum() {
        const MI: u64 = 1 << 20;
        let xfs = fs_floor("xfs");
        assert_eq!(fs_floor("ext4"), None);
        // Measured on xfsprogs 6.1.0 (Debian 12): a 300 MiB file formats, 300 MiB - 4 KiB does not.
        assert_eq!(XFS_MIN_BYTES, 314_572_800);
        for (r, want) in [
            (None, Some(300 * MI)),
            (range(1, 0), Some(300 * MI)),
            (range(64 << 20, 400 << 20), Some(300 * MI)),
            (range(301 << 20, 0), Some(302 * MI)),
            (range(1, 300 << 20), Some(300 * MI)),
        ] {
            assert_eq!(
                volume_size_at_least("capacity_range", r.as_ref(), xfs).ok(),
                want,
                "{r:?}"
            );
        }
        let e = volume_size_at_least("capacity_range", range(64 << 20, 128 << 20).as_ref(), xfs)
            .unwrap_err();
        assert!(matches!(e, ArgError::OutOfRange { .. }), "{e}");
        assert!(
            e.to_string().contains("mkfs.xfs") && e.to_string().contains("314572800"),
            "{e}"
        );
    }

    #[test]
    fn node_paths_must_be_absolute_and_clean() {
        assert_eq!(
            node_path("target_path", "/var/lib/kubelet/pods/x/volumes/y/mount").unwrap(),
            PathBuf::from("/var/lib/kubelet/pods/x/volumes/y/mount")
        );
        for (bad, needle) in [
            ("-ostaging", "not an absolute path"),
            ("staging", "not an absolute path"),
            ("./x", "not an absolute path"),
            ("/a/../b", "\"..\" component"),
            ("/a/./b", "\".\" component"),
            ("/a//b", "empty component"),
            ("/a/b/", "empty component"),
            ("/", "root directory"),
            ("/a\0b", "NUL"),
        ] {
            let e = node_path("staging_target_path", bad)
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("staging_target_path: ") && e.contains(needle),
                "{bad:?}: {e}"
            );
            assert!(e.contains(&format!("{bad:?}")), "names the value: {e}");
        }
        assert_eq!(
            node_path("target_path", "").unwrap_err().to_string(),
            "target_path is required"
        );
        let long = format!("/{}", "a".repeat(256));
        assert!(
            node_path("target_path", &long)
                .unwrap_err()
                .to_string()
                .contains("255")
        );
        let long = "/aaaaaaaa".repeat(512);
        let e = node_path("target_path", &long).unwrap_err().to_string();
        assert!(e.contains("4095") && e.len() < 400, "{e}");
    }
}

#[cfg(test)]
mod proptests;
