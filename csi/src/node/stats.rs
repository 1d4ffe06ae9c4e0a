//! What NodeGetVolumeStats reports: usage in bytes or inodes, and the volume's condition.

use csi_proto::csi::v1::{VolumeCondition, VolumeUsage, volume_usage};

/// Bytes and inodes of a mounted filesystem, as `statvfs` reports them.
pub fn filesystem_usage(st: &rustix::fs::StatVfs) -> Vec<VolumeUsage> {
    let frsize = st.f_frsize;
    vec![
        usage(
            volume_usage::Unit::Bytes,
            st.f_blocks.saturating_mul(frsize),
            st.f_bavail.saturating_mul(frsize),
            st.f_blocks
                .saturating_sub(st.f_bfree)
                .saturating_mul(frsize),
        ),
        usage(
            volume_usage::Unit::Inodes,
            st.f_files,
            st.f_ffree,
            st.f_files.saturating_sub(st.f_ffree),
        ),
    ]
}

pub fn usage(unit: volume_usage::Unit, total: u64, available: u64, used: u64) -> VolumeUsage {
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    VolumeUsage {
        available: i(available),
        total: i(total),
        used: i(used),
        unit: unit as i32,
    }
}

pub fn normal() -> VolumeCondition {
    VolumeCondition {
        abnormal: false,
        message: "volume is mounted".into(),
    }
}

pub fn abnormal(message: String) -> VolumeCondition {
    VolumeCondition {
        abnormal: true,
        message,
    }
}
