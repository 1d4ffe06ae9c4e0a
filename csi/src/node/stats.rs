//! What NodeGetVolumeStats reports: usage in bytes or inodes, and the volume's condition.

use csi_proto::csi::v1::{VolumeCondition, VolumeUsage, volume_usage};

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
