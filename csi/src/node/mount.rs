//! Mounts: reading `/proc/self/mountinfo`, and mounting with util-linux `mount`/`umount`.
//!
//! Why the `mount` command and not the mount(2) syscall (rustix, sys-mount): CSI `mount_flags`
//! are mount(8) option strings (`noatime`, `discard`, `context=...`, `nouuid`), and util-linux is
//! the parser every user of those flags expects — translating them to MS_* bits and filesystem
//! data by hand would silently differ. It also keeps `unsafe`-free code and is what kubelet's
//! mount-utils do. Reading mounts is done here, in Rust, from mountinfo.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::error::NodeError;

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// `st_dev` of the mounted filesystem (for a block filesystem: the device's rdev).
    pub major: u32,
    pub minor: u32,
    /// The path inside the filesystem that is mounted (`/` unless a bind of a subpath).
    pub root: String,
    pub mount_point: PathBuf,
    /// The per-mount `ro` option (a read-only bind of a writable filesystem has it).
    pub read_only: bool,
    pub fs_type: String,
    pub source: String,
}

/// Undoes mountinfo's octal escapes (`\040` for space, `\011`, `\012`, `\134`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        if let (b'\\', Some(d)) = (b[i], octal) {
            let v = d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            out.push(u8::try_from(v).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text; malformed lines are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            let (major, minor) = fields.get(2)?.split_once(':')?;
            Some(MountInfo {
                major: major.parse().ok()?,
                minor: minor.parse().ok()?,
                root: unescape(fields.get(3)?),
                mount_point: PathBuf::from(unescape(fields.get(4)?)),
                read_only: fields.get(5)?.split(',').any(|o| o == "ro"),
                fs_type: fields.get(sep + 1)?.to_string(),
                source: unescape(fields.get(sep + 2).copied().unwrap_or("none")),
            })
        })
        .collect()
}

/// The current mounts of this process's mount namespace.
pub fn mounts() -> Result<Vec<MountInfo>, NodeError> {
    let path = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(NodeError::io("reading", path))?;
    Ok(parse_mountinfo(&text))
}

/// The topmost mount at `path` (which should be canonical), if any.
pub fn mount_at<'a>(mounts: &'a [MountInfo], path: &Path) -> Option<&'a MountInfo> {
    mounts.iter().rev().find(|m| m.mount_point == path)
}

/// `path` made absolute and free of symlinks when it exists; as given otherwise.
pub fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Major and minor of a Linux `dev_t`.
pub fn dev_major_minor(dev: u64) -> (u32, u32) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

/// A command line to run (built by pure code, run by [`run`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cmd {
    pub program: &'static str,
    pub args: Vec<OsString>,
    /// Killed (SIGKILL) when the plugin dies, through util-linux `setpriv --pdeathsig`: an mkfs
    /// left running after the plugin was killed would race the retried one on the same device.
    pub dies_with_plugin: bool,
}

impl Cmd {
    pub fn new(program: &'static str) -> Cmd {
        Cmd {
            program,
            args: Vec::new(),
            dies_with_plugin: false,
        }
    }
    pub fn dies_with_plugin(mut self) -> Cmd {
        self.dies_with_plugin = true;
        self
    }
    /// The program and arguments to execute.
    fn argv(&self) -> (&'static str, Vec<OsString>) {
        if !self.dies_with_plugin {
            return (self.program, self.args.clone());
        }
        let mut args: Vec<OsString> = ["--pdeathsig", "KILL", "--", self.program]
            .iter()
            .map(OsString::from)
            .collect();
        args.extend(self.args.iter().cloned());
        ("setpriv", args)
    }
    pub fn arg(mut self, a: impl Into<OsString>) -> Cmd {
        self.args.push(a.into());
        self
    }
    fn display(&self) -> String {
        let mut s = self.program.to_string();
        for a in &self.args {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        s
    }
}

/// Output of a finished command.
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` with no stdin and returns its output whatever the exit status.
pub async fn run_any(cmd: &Cmd) -> Result<Output, NodeError> {
    let (program, args) = cmd.argv();
    let out = tokio::process::Command::new(program)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| NodeError::Command {
            command: cmd.display(),
            status: "could not start".into(),
            stderr: e.to_string(),
        })?;
    Ok(Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// How long a killed command may take to exit before it is left to the runtime to reap (a mount
/// helper inside an NFS call exits on SIGKILL once the kernel's RPC notices).
const REAP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs `cmd` as [`run_any`] does, for at most `limit`: `None` when it had not finished by then.
/// It is then killed (SIGKILL) and waited for (at most [`REAP_WAIT`]), so no helper outlives
/// the answer saying it was killed; dropping a `kill_on_drop` future instead leaves the child to
/// be reaped later, and a check right after the answer still finds it.
pub async fn run_bounded(
    cmd: &Cmd,
    limit: std::time::Duration,
) -> Result<Option<Output>, NodeError> {
    use tokio::io::AsyncReadExt;
    let (program, args) = cmd.argv();
    let failed = |status: &str, e: std::io::Error| NodeError::Command {
        command: cmd.display(),
        status: status.into(),
        stderr: e.to_string(),
    };
    let mut child = tokio::process::Command::new(program)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| failed("could not start", e))?;
    let (mut stdout, mut stderr) = (child.stdout.take(), child.stderr.take());
    let finished = tokio::time::timeout(limit, async {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let read_out = async {
            if let Some(s) = stdout.as_mut() {
                let _ = s.read_to_end(&mut out).await;
            }
        };
        let read_err = async {
            if let Some(s) = stderr.as_mut() {
                let _ = s.read_to_end(&mut err).await;
            }
        };
        let (status, (), ()) = tokio::join!(child.wait(), read_out, read_err);
        status.map(|status| Output {
            code: status.code(),
            stdout: String::from_utf8_lossy(&out).into_owned(),
            stderr: String::from_utf8_lossy(&err).into_owned(),
        })
    })
    .await;
    match finished {
        Ok(out) => out
            .map(Some)
            .map_err(|e| failed("could not be waited for", e)),
        Err(_) => {
            let _ = child.start_kill();
            if tokio::time::timeout(REAP_WAIT, child.wait()).await.is_err() {
                tracing::warn!(command = %cmd.display(), "killed after {limit:?} but not gone after {REAP_WAIT:?}");
            }
            Ok(None)
        }
    }
}

/// Runs `cmd`; a non-zero exit is an error carrying its stderr.
pub async fn run(cmd: &Cmd) -> Result<String, NodeError> {
    let out = run_any(cmd).await?;
    if out.code == Some(0) {
        Ok(out.stdout)
    } else {
        Err(NodeError::Command {
            command: cmd.display(),
            status: out
                .code
                .map_or("killed by a signal".into(), |c| format!("exit {c}")),
            stderr: out.stderr.trim().to_string(),
        })
    }
}

/// `mount -t <fs> [-o <opts>] <device> <target>`.
pub fn mount_cmd(device: &Path, target: &Path, fs: &str, options: &[String]) -> Cmd {
    let mut c = Cmd::new("mount").arg("-t").arg(fs);
    if !options.is_empty() {
        c = c.arg("-o").arg(options.join(","));
    }
    c.arg(device).arg(target)
}

/// `mount --bind <source> <target>`.
pub fn bind_cmd(source: &Path, target: &Path) -> Cmd {
    Cmd::new("mount").arg("--bind").arg(source).arg(target)
}

/// `mount -o remount,bind,ro <target>`: makes a bind mount read-only.
pub fn remount_ro_cmd(target: &Path) -> Cmd {
    Cmd::new("mount")
        .arg("-o")
        .arg("remount,bind,ro")
        .arg(target)
}

/// Unmounts everything stacked at `path` (idempotent).
pub async fn unmount_all(path: &Path) -> Result<(), NodeError> {
    let path = canonical(path);
    for _ in 0..16 {
        if mount_at(&mounts()?, &path).is_none() {
            return Ok(());
        }
        run(&Cmd::new("umount").arg(&path)).await?;
    }
    Err(NodeError::Unsupported {
        path,
        reason: "still mounted after 16 unmounts".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bounded_command_reports_its_output_or_is_killed_and_reaped() {
        let quick = Cmd::new("sh")
            .arg("-c")
            .arg("echo out; echo err >&2; exit 3");
        let out = run_bounded(&quick, std::time::Duration::from_secs(10))
            .await
            .expect("sh runs")
            .expect("sh finishes in time");
        assert_eq!(
            (out.code, out.stdout.as_str(), out.stderr.as_str()),
            (Some(3), "out\n", "err\n")
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("pid");
        let slow = Cmd::new("sh")
            .arg("-c")
            .arg(format!("echo $$ > {}; exec sleep 30", pid_file.display()));
        let t = std::time::Instant::now();
        let out = run_bounded(&slow, std::time::Duration::from_millis(300))
            .await
            .expect("sh runs");
        assert!(out.is_none(), "not finished within the limit");
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t.elapsed()
        );
        let pid = std::fs::read_to_string(&pid_file).expect("pid written");
        // A zombie keeps its /proc entry: gone means killed and reaped.
        assert!(
            !Path::new(&format!("/proc/{}", pid.trim())).exists(),
            "the killed command is reaped by the time the answer comes"
        );
    }

    #[test]
    fn a_command_that_dies_with_the_plugin_runs_under_setpriv() {
        let plain = Cmd::new("mkfs.ext4").arg("/dev/sdb");
        assert_eq!(
            plain.argv(),
            ("mkfs.ext4", vec![OsString::from("/dev/sdb")])
        );
        let (program, args) = plain.dies_with_plugin().argv();
        assert_eq!(program, "setpriv");
        assert_eq!(
            args,
            ["--pdeathsig", "KILL", "--", "mkfs.ext4", "/dev/sdb"]
                .map(OsString::from)
                .to_vec()
        );
    }

    const SAMPLE: &str = "\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
42 27 7:0 / /tmp/stage rw,relatime - ext4 /dev/loop0 rw
43 27 7:0 / /tmp/pub\\040dir ro,relatime shared:5 master:1 - ext4 /dev/loop0 rw
44 27 0:5 /loop3 /tmp/block-target rw,nosuid - devtmpfs udev rw,size=1k
garbage line
";

    #[test]
    fn mountinfo_lines_parse_with_escapes_and_optional_fields() {
        let m = parse_mountinfo(SAMPLE);
        assert_eq!(m.len(), 4);
        assert_eq!((m[1].major, m[1].minor), (7, 0));
        assert_eq!(m[1].fs_type, "ext4");
        assert_eq!(m[1].source, "/dev/loop0");
        assert_eq!(m[2].mount_point, PathBuf::from("/tmp/pub dir"));
        assert!(
            m[2].read_only && !m[1].read_only,
            "per-mount options, not the filesystem's"
        );
        assert_eq!(m[3].root, "/loop3");
        assert_eq!(m[3].fs_type, "devtmpfs");
        assert_eq!(
            mount_at(&m, Path::new("/tmp/stage")).map(|m| m.minor),
            Some(0)
        );
        assert!(mount_at(&m, Path::new("/tmp/none")).is_none());
    }

    #[test]
    fn dev_t_splits_like_glibc() {
        assert_eq!(dev_major_minor(0x0703), (7, 3));
        assert_eq!(dev_major_minor((259 << 8) | 1), (259, 1));
        // minor above 255 lives in the high bits
        assert_eq!(dev_major_minor((7 << 8) | (0x100 << 12)), (7, 0x100));
    }

    #[test]
    fn commands_are_built_without_a_shell() {
        let c = mount_cmd(
            Path::new("/dev/loop0"),
            Path::new("/t"),
            "xfs",
            &["nouuid".into(), "noatime".into()],
        );
        assert_eq!(c.display(), "mount -t xfs -o nouuid,noatime /dev/loop0 /t");
        assert_eq!(
            mount_cmd(Path::new("/d"), Path::new("/t"), "ext4", &[]).display(),
            "mount -t ext4 /d /t"
        );
        assert_eq!(
            bind_cmd(Path::new("/s"), Path::new("/t")).display(),
            "mount --bind /s /t"
        );
    }
}
