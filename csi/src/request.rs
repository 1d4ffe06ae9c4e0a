//! CSI request fields parsed into typed values at the edge. Every failure is an [`ArgError`]
//! naming the field, which becomes `INVALID_ARGUMENT`.

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

/// Access modes this driver serves: one node at a time (the disk is hot-plugged into one VM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
}

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
                if !SUPPORTED_FS.contains(&fs_type.as_str()) {
                    return Err(invalid(format!(
                        "fs_type {:?} is not supported (supported: {})",
                        m.fs_type,
                        SUPPORTED_FS.join(", ")
                    )));
                }
                if let Some(bad) = m.mount_flags.iter().find(|f| f.trim().is_empty()) {
                    return Err(invalid(format!("mount_flags has an empty flag {bad:?}")));
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
            Ok(other) => {
                return Err(invalid(format!(
                    "access mode {} is not supported (supported: SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY)",
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

/// Smallest volume (upstream's `MinimalVolumeSize`), also the size when none is asked for.
pub const MIN_VOLUME_BYTES: u64 = 10 << 20;
/// Longhorn sizes volumes in 2 MiB steps; Harvester PVCs are rounded up to it (as upstream).
pub const SIZE_ALIGN: u64 = 2 << 20;

/// The size to provision for a capacity range: `required` (or the minimum) rounded up to
/// [`SIZE_ALIGN`]; an error when that exceeds `limit`.
pub fn volume_size(field: &'static str, range: Option<&CapacityRange>) -> Result<u64, ArgError> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    let invalid = |reason: String| ArgError::Invalid { field, reason };
    let required = u64::try_from(required)
        .map_err(|_| invalid(format!("required_bytes {required} is negative")))?;
    let limit =
        u64::try_from(limit).map_err(|_| invalid(format!("limit_bytes {limit} is negative")))?;
    if limit > 0 && required > limit {
        return Err(invalid(format!(
            "required_bytes {required} is above limit_bytes {limit}"
        )));
    }
    let size = required
        .max(MIN_VOLUME_BYTES)
        .checked_next_multiple_of(SIZE_ALIGN)
        .ok_or_else(|| invalid(format!("required_bytes {required} is too large")))?;
    if limit > 0 && size > limit {
        return Err(ArgError::OutOfRange {
            field,
            reason: format!(
                "the smallest volume that holds {required} bytes is {size} bytes (minimum \
                 {MIN_VOLUME_BYTES}, 2 MiB steps), above limit_bytes {limit}"
            ),
        });
    }
    Ok(size)
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
                cap(mount("ext4"), Some(ProtoMode::MultiNodeMultiWriter)),
                "MULTI_NODE_MULTI_WRITER",
            ),
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
}

#[cfg(test)]
mod proptests;
