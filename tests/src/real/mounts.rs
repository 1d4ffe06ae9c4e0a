//! Mounts left behind by a failed test, demo or bench run: found in `/proc/self/mountinfo` and
//! unmounted, so no mount outlives its run.

use std::path::{Path, PathBuf};

/// Mount points under `dir` (itself included), from `/proc/self/mountinfo`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mount_points(&text)
        .filter(|p| p.starts_with(&dir))
        .collect()
}

/// The mount points of `/proc/self/mountinfo` text: each line's fifth field.
pub fn mount_points(mountinfo: &str) -> impl Iterator<Item = PathBuf> + '_ {
    mountinfo
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
}

/// Unmounts whatever is still mounted under its directory when dropped (also after a failure).
pub struct MountSweeper(pub PathBuf);

impl MountSweeper {
    /// Unmounts leftovers, innermost first, and returns what was left (a clean run leaves nothing).
    pub fn sweep(&self) -> Vec<PathBuf> {
        let left = mounts_under(&self.0);
        for p in left.iter().rev() {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(p)
                .status();
        }
        left
    }
}

impl Drop for MountSweeper {
    fn drop(&mut self) {
        let left = self.sweep();
        if !left.is_empty() {
            eprintln!("unmounted leftovers: {left:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_point_is_the_fifth_field_of_a_mountinfo_line() {
        // This machine's mountinfo on 4 Dec: /run/netns bound onto itself (mount 587), a Pod's
        // namespace mounted in it, the root mount.
        let mountinfo = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
            587 27 254:0 /run/netns /run/netns rw,relatime shared:10 - ext4 /dev/vda rw\n\
            877 587 0:4 net:[4026532450] /run/netns/cni-6bed8ca7 rw - nsfs nsfs rw\n";
        let is_mount_point =
            |text: &str, path: &str| mount_points(text).any(|p| p == Path::new(path));
        assert!(is_mount_point(mountinfo, "/run/netns"));
        assert!(is_mount_point(mountinfo, "/run/netns/cni-6bed8ca7"));
        // The root's line names /run/netns only as a mounted root, not as a mount point.
        assert!(!is_mount_point(
            &mountinfo.replace(
                "587 27 254:0 /run/netns /run/netns",
                "587 27 254:0 /run/netns /mnt"
            ),
            "/run/netns"
        ));
        assert!(!is_mount_point(mountinfo, "/run"));
    }
}
