//! Mounts left behind by a failed test, demo or bench run: found in `/proc/self/mountinfo` and
//! unmounted, so no mount outlives its run.

use std::path::{Path, PathBuf};

/// Mount points under `dir`, from `/proc/self/mountinfo`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(&dir))
        .collect()
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
