//! The rules for staging and target paths: what a `volume_path` may be, that a mount point is
//! a directory (or nothing yet) and never a symbolic link, what an unpublish may remove, and
//! how a retried read-only publish is finished.

use std::path::{Path, PathBuf};

use csi_proto::csi::v1::NodePublishVolumeResponse;

use super::mount::{self, MountInfo, run};
use crate::error::{ArgError, NodeError};
use crate::request::{self, required};

/// A `volume_path` of NodeGetVolumeStats / NodeExpandVolume: required; a path that is not
/// absolute and clean, or outside the kubelet's directory `root`, cannot be one this plugin
/// published, so it is NOT_FOUND (as csi-sanity expects for `some/path`).
pub fn published_path<'a>(value: &'a str, root: Option<&Path>) -> Result<&'a Path, NodeError> {
    let value = required("volume_path", value)?;
    match request::path_problem(value) {
        None if inside("volume_path", Path::new(value), root).is_ok() => Ok(Path::new(value)),
        _ => Err(NodeError::PathNotFound {
            path: PathBuf::from(value),
        }),
    }
}

/// A clean absolute node path must lie inside the kubelet's directory `root` when it is known
/// (component-wise: `/var/lib/kubelet-x` is not inside `/var/lib/kubelet`).
pub fn inside(field: &'static str, path: &Path, root: Option<&Path>) -> Result<(), ArgError> {
    match root {
        Some(root) if !path.starts_with(root) || path == root => Err(ArgError::Invalid {
            field,
            reason: format!(
                "{} is not inside the kubelet's directory {} (--kubelet-dir)",
                path.display(),
                root.display()
            ),
        }),
        _ => Ok(()),
    }
}

/// A staging or target path must not be a symbolic link: mounting at it or unmounting it would
/// act on wherever it points.
pub fn not_a_symlink(field: &'static str, path: &Path) -> Result<(), NodeError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(ArgError::Invalid {
            field,
            reason: format!("{} is a symbolic link", path.display()),
        }
        .into()),
        _ => Ok(()),
    }
}

/// A mount point: a directory, or nothing yet (the plugin creates it). A file there is a bad
/// request, not an internal error.
pub fn directory_or_nothing(field: &'static str, path: &Path) -> Result<(), NodeError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => Err(ArgError::Invalid {
            field,
            reason: format!(
                "{} is a {}, not a directory",
                path.display(),
                if m.is_file() {
                    "regular file"
                } else {
                    "special file"
                }
            ),
        }
        .into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NodeError::io("inspecting", path)(e)),
    }
}

/// What NodeUnpublishVolume may remove at an unmounted target.
#[derive(Debug, PartialEq, Eq)]
pub enum Removable {
    /// A directory (removed only if empty: `rmdir`).
    Dir,
    /// An empty regular file, as block publishes create.
    EmptyFile,
}

/// Whether what is left at a target may go: an (empty) directory or an empty regular file;
/// never a file with data, a link or a device node.
pub fn removable(meta: &std::fs::Metadata) -> Option<Removable> {
    let t = meta.file_type();
    if t.is_dir() {
        Some(Removable::Dir)
    } else if t.is_file() && meta.len() == 0 {
        Some(Removable::EmptyFile)
    } else {
        None
    }
}

/// Whether a publish that finds `existing` (from the right source) at its target must still make
/// it read-only: a read-only publish binds, then remounts read-only, and a plugin killed between
/// the two leaves a writable bind that a retry must not accept as done.
pub fn needs_read_only_remount(existing: &MountInfo, read_only: bool) -> bool {
    read_only && !existing.read_only
}

/// A publish already at `target` (a retry): done, after finishing the read-only remount if an
/// interrupted publish never made it.
pub async fn republish(
    target: &Path,
    existing: &MountInfo,
    read_only: bool,
) -> Result<NodePublishVolumeResponse, NodeError> {
    if needs_read_only_remount(existing, read_only) {
        tracing::info!(target = %target.display(), "finishing an interrupted read-only publish");
        remount_read_only(target).await?;
    }
    Ok(NodePublishVolumeResponse {})
}

/// Makes the bind at `target` read-only; if that fails, unmounts it rather than leave a writable
/// mount behind a read-only request.
pub async fn remount_read_only(target: &Path) -> Result<(), NodeError> {
    if let Err(e) = run(&mount::remount_ro_cmd(target)).await {
        let _ = mount::unmount_all(target).await;
        return Err(e);
    }
    Ok(())
}

pub fn other_mount(path: &Path, found: &MountInfo, wanted: &Path) -> NodeError {
    NodeError::OtherMount {
        path: path.to_path_buf(),
        found: format!(
            "{} ({}:{} {})",
            found.source, found.major, found.minor, found.root
        ),
        wanted: wanted.display().to_string(),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn node_paths_stay_inside_the_kubelet_dir() {
        let root = Some(Path::new("/var/lib/kubelet"));
        let ok = Path::new("/var/lib/kubelet/pods/p/volumes/v/mount");
        assert!(inside("target_path", ok, root).is_ok());
        assert!(inside("target_path", Path::new("/etc/shadow"), None).is_ok());
        for bad in ["/etc", "/var/lib/kubelet-x/a", "/var/lib/kubelet"] {
            let e = inside("target_path", Path::new(bad), root).unwrap_err();
            assert!(
                e.to_string().contains("target_path") && e.to_string().contains(bad),
                "{e}"
            );
        }
        assert!(published_path(ok.to_str().unwrap(), root).is_ok());
        assert!(matches!(
            published_path("/etc", root),
            Err(NodeError::PathNotFound { .. })
        ));
    }

    use super::*;

    #[test]
    fn a_retried_read_only_publish_finishes_the_remount() {
        let [rw, ro] = [
            "44 27 7:0 / /t rw,relatime - ext4 /dev/loop0 rw",
            "44 27 7:0 / /t ro,relatime - ext4 /dev/loop0 rw",
        ]
        .map(|l| mount::parse_mountinfo(l).remove(0));
        // (found at the target, read-only asked for) -> remount read-only
        assert!(
            needs_read_only_remount(&rw, true),
            "a writable bind left by a publish killed before its remount"
        );
        assert!(!needs_read_only_remount(&ro, true), "already read-only");
        assert!(!needs_read_only_remount(&rw, false), "writable asked for");
        assert!(
            !needs_read_only_remount(&ro, false),
            "read-only staging (a read-only access mode) binds read-only: accepted as before"
        );
    }
}
