//! Filesystems: how to create, mount and grow each one, and the rule that decides whether a
//! device may be formatted (only when `blkid -p` finds neither a filesystem nor a partition
//! table: data is never reformatted).

use std::path::Path;

use super::mount::Cmd;

/// A filesystem the node plugin can create, mount and grow. Methods build commands; running
/// them is the caller's business, so the rules are testable without devices.
pub trait Filesystem: Send + Sync {
    fn name(&self) -> &'static str;
    /// Creates the filesystem on a blank device.
    fn format(&self, device: &Path) -> Cmd;
    /// Options always added when mounting it.
    fn mount_options(&self) -> &'static [&'static str];
    /// Grows the mounted filesystem to fill its (grown) device.
    fn grow(&self, device: &Path, mount_point: &Path) -> Cmd;
    /// The smallest device `format` accepts (0: no minimum the driver's own does not cover).
    fn min_bytes(&self) -> u64 {
        0
    }
}

pub struct Ext4;
pub struct Xfs;

impl Filesystem for Ext4 {
    fn name(&self) -> &'static str {
        "ext4"
    }
    fn format(&self, device: &Path) -> Cmd {
        // No -F: mke2fs refuses a device that holds something, a second guard behind blkid.
        // -m0: no root reserve on a data volume (as kubelet's mount-utils).
        Cmd::new("mkfs.ext4")
            .arg("-q")
            .arg("-m0")
            .arg(device)
            .dies_with_plugin()
    }
    fn mount_options(&self) -> &'static [&'static str] {
        &[]
    }
    fn grow(&self, device: &Path, _mount_point: &Path) -> Cmd {
        // Online when mounted; "Nothing to do" (exit 0) when already full size.
        Cmd::new("resize2fs").arg(device)
    }
}

impl Filesystem for Xfs {
    fn name(&self) -> &'static str {
        "xfs"
    }
    fn format(&self, device: &Path) -> Cmd {
        // No -f: mkfs.xfs refuses a device with an existing signature.
        Cmd::new("mkfs.xfs")
            .arg("-q")
            .arg(device)
            .dies_with_plugin()
    }
    fn mount_options(&self) -> &'static [&'static str] {
        // A restored snapshot has the same UUID as its source; XFS refuses that without nouuid.
        &["nouuid"]
    }
    fn grow(&self, _device: &Path, mount_point: &Path) -> Cmd {
        Cmd::new("xfs_growfs").arg(mount_point)
    }
    fn min_bytes(&self) -> u64 {
        crate::request::XFS_MIN_BYTES
    }
}

/// The filesystem called `name`, if supported.
pub fn by_name(name: &str) -> Option<&'static dyn Filesystem> {
    match name {
        "ext4" => Some(&Ext4),
        "xfs" => Some(&Xfs),
        _ => None,
    }
}

/// `blkid -p -o export <device>`: low-level probing, no cache.
pub fn probe_cmd(device: &Path) -> Cmd {
    Cmd::new("blkid")
        .arg("-p")
        .arg("-o")
        .arg("export")
        .arg(device)
}

/// What `blkid -p` found on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// Exit 2: no signature of any kind.
    Blank,
    Filesystem(String),
    PartitionTable(String),
    /// Anything else (ambivalent result, other signature, probing error): never format.
    Unclear(String),
}

/// Classifies `blkid -p -o export` output by its exit code and `TYPE=`/`PTTYPE=` lines.
pub fn classify(code: Option<i32>, stdout: &str, stderr: &str) -> Probe {
    let value = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .map(str::to_string)
    };
    match code {
        Some(2) => Probe::Blank,
        Some(0) => {
            if let Some(pt) = value("PTTYPE") {
                Probe::PartitionTable(pt)
            } else if let Some(t) = value("TYPE") {
                Probe::Filesystem(t)
            } else {
                Probe::Unclear(format!("blkid found a signature: {}", stdout.trim()))
            }
        }
        other => Probe::Unclear(format!(
            "blkid -p exited {other:?}: {}",
            if stderr.trim().is_empty() {
                stdout.trim()
            } else {
                stderr.trim()
            }
        )),
    }
}

/// What staging does with a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prepare {
    /// Blank: create the filesystem, then mount.
    Format,
    /// Holds the wanted filesystem: mount it as it is.
    Mount,
    /// Holds something else: refuse, with the reason.
    Refuse(String),
}

/// The staging rule: format only a blank device; mount the wanted filesystem; refuse the rest.
pub fn prepare(probe: &Probe, wanted: &str) -> Prepare {
    match probe {
        Probe::Blank => Prepare::Format,
        Probe::Filesystem(t) if t == wanted => Prepare::Mount,
        Probe::Filesystem(t) => Prepare::Refuse(format!(
            "it holds a {t} filesystem but the volume asks for {wanted}; its data is kept"
        )),
        Probe::PartitionTable(pt) => {
            Prepare::Refuse(format!("it holds a {pt} partition table; its data is kept"))
        }
        Probe::Unclear(why) => Prepare::Refuse(why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_blank_devices_are_formatted() {
        let ext4 = "DEVNAME=/dev/loop0\nUUID=x\nTYPE=ext4\nUSAGE=filesystem\n";
        let gpt = "DEVNAME=/dev/loop0\nPTUUID=y\nPTTYPE=gpt\n";
        for (code, out, wanted, want) in [
            (Some(2), "", "ext4", Prepare::Format),
            (Some(0), ext4, "ext4", Prepare::Mount),
            (Some(0), ext4, "xfs", Prepare::Refuse(String::new())),
            (Some(0), gpt, "ext4", Prepare::Refuse(String::new())),
            (
                Some(0),
                "DEVNAME=/dev/x\n",
                "ext4",
                Prepare::Refuse(String::new()),
            ),
            (Some(8), "", "ext4", Prepare::Refuse(String::new())),
            (Some(4), "", "ext4", Prepare::Refuse(String::new())),
            (None, "", "ext4", Prepare::Refuse(String::new())),
        ] {
            let got = prepare(&classify(code, out, ""), wanted);
            match (&got, &want) {
                (Prepare::Refuse(_), Prepare::Refuse(_)) => {}
                _ => assert_eq!(got, want, "{code:?} {out:?} {wanted}"),
            }
        }
        match prepare(&classify(Some(0), gpt, ""), "ext4") {
            Prepare::Refuse(r) => assert!(r.contains("gpt partition table"), "{r}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn filesystems_build_their_commands() {
        let d = Path::new("/dev/sdb");
        let m = Path::new("/stage");
        let xfs = by_name("xfs").expect("xfs");
        assert_eq!(xfs.mount_options(), ["nouuid"]);
        assert_eq!(xfs.grow(d, m).program, "xfs_growfs");
        assert_eq!(xfs.grow(d, m).args, vec![m.as_os_str().to_owned()]);
        let ext4 = by_name("ext4").expect("ext4");
        assert_eq!(ext4.format(d).program, "mkfs.ext4");
        assert!(
            !ext4.format(d).args.iter().any(|a| a == "-F"),
            "never forced"
        );
        assert_eq!(ext4.grow(d, m).args, vec![d.as_os_str().to_owned()]);
        assert!(ext4.format(d).dies_with_plugin && xfs.format(d).dies_with_plugin);
        assert!(!ext4.grow(d, m).dies_with_plugin);
        assert!(by_name("btrfs").is_none());
        assert_eq!(
            probe_cmd(d)
                .args
                .first()
                .map(|a| a.to_string_lossy().into_owned()),
            Some("-p".into())
        );
    }
}
