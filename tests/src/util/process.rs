//! Child processes of the bed: each logs to a file, dies with the test process (PR_SET_PDEATHSIG)
//! and is killed and reaped when its handle is dropped.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::BedError;

pub struct Proc {
    pub name: String,
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr going to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Proc, BedError> {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).map_err(|e| BedError::Start {
            component: name.to_string(),
            log: log.clone(),
            reason: format!("creating the log file: {e}"),
        })?;
        let err = out.try_clone().map_err(|e| BedError::Start {
            component: name.to_string(),
            log: log.clone(),
            reason: e.to_string(),
        })?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        die_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|e| BedError::Start {
            component: name.to_string(),
            log: log.clone(),
            reason: format!("spawning {:?}: {e}", cmd.get_program()),
        })?;
        Ok(Proc {
            name: name.to_string(),
            log,
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// An error naming the component and its log if the process has exited.
    pub fn check_alive(&mut self) -> Result<(), BedError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(BedError::Died {
                component: self.name.clone(),
                log: self.log.clone(),
                status: status.to_string(),
                tail: tail(&self.log, 15),
            }),
            Err(e) => Err(BedError::Died {
                component: self.name.clone(),
                log: self.log.clone(),
                status: format!("unknown ({e})"),
                tail: tail(&self.log, 15),
            }),
        }
    }

    /// Kills and reaps the process (idempotent).
    pub fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last `n` lines of a log file, for error messages.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A binary of this workspace that cargo built next to the running executable
/// (`target/<profile>/<name>`: beside a binary, one level up from a test in `deps/`); panics
/// naming the `cargo build` that makes it if it is missing.
pub fn built_binary(name: &str) -> PathBuf {
    find_built_binary(name).unwrap_or_else(|e| panic!("{e}"))
}

/// [`built_binary`] for library code: `target/<profile>/<name>` seen from a test executable
/// (`target/<profile>/deps/`) or from a binary beside it, or an error naming the `cargo build`.
pub fn find_built_binary(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding {name}: {e}"))?;
    let dirs: Vec<&Path> = exe.ancestors().skip(1).take(2).collect();
    dirs.iter()
        .map(|d| d.join(name))
        .find(|b| b.is_file())
        .ok_or_else(|| {
            let want = dirs.last().map(|d| d.join(name)).unwrap_or_default();
            format!(
                "{} is not built: run `cargo build --bin {name}`",
                want.display()
            )
        })
}

/// The ports [`free_port`] hands out: below the kernel's ephemeral range (32768-60999 here), from
/// which every outgoing connection of the bed's etcds, API servers and clients takes its local
/// port, so a port handed out cannot be taken by one of them before its server binds it.
const HANDED_OUT: std::ops::Range<u16> = 20_000..32_000;

/// Where test processes reserve the ports they hand out: `<port>.lock`, flocked for as long as
/// the process lives (the kernel drops the lock when it exits, however it exits).
const RESERVATIONS: &str = "/tmp/harvester-testbed-ports";

/// A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range, and reserved
/// for this process until it exits: each call hands out the next port of [`HANDED_OUT`] (from an
/// offset per process) that no other test process holds (a flock on its file under
/// [`RESERVATIONS`]) and nothing has bound. So two tests, of one binary or of two running side by
/// side (parallel suites, two checkouts on one machine), never get the same port; only a
/// program outside the bed that binds a fixed port of the range can still take one, which the
/// components' starts retry ([`retry_on_addr_in_use`]).
pub fn free_port() -> Result<u16, BedError> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static HELD: std::sync::Mutex<Vec<File>> = std::sync::Mutex::new(Vec::new());
    let span = u32::from(HANDED_OUT.end - HANDED_OUT.start);
    let offset = std::process::id().wrapping_mul(2_654_435_761) % span;
    reservations_dir()?;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = HANDED_OUT.start + ((offset + n) % span) as u16;
        let Some(lock) = reserve(port) else { continue };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            HELD.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(lock);
            return Ok(port);
        }
    }
    Err(BedError::Setup(format!(
        "finding a free port: every port of {HANDED_OUT:?} on 127.0.0.1 is taken or reserved"
    )))
}

/// The lock of `port`'s reservation file, or `None` when another process holds it (or the file
/// cannot be opened: then the port is not ours to hand out either). A flock needs only a
/// read-only descriptor, so a file another user created (0644) serves every user.
fn reserve(port: u16) -> Option<File> {
    use rustix::fs::{FlockOperation, flock};
    let path = Path::new(RESERVATIONS).join(format!("{port}.lock"));
    let file = File::open(&path)
        .or_else(|_| {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        })
        .ok()?;
    flock(&file, FlockOperation::NonBlockingLockExclusive).ok()?;
    Some(file)
}

/// [`RESERVATIONS`], writable by every user (sticky, as `/tmp`): tests run as root and as
/// another user share it.
fn reservations_dir() -> Result<(), BedError> {
    use std::os::unix::fs::PermissionsExt;
    let dir = Path::new(RESERVATIONS);
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| BedError::Setup(format!("creating {RESERVATIONS}: {e}")))?;
    // Best effort: a process that lost the race to create it is not its owner.
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777));
    Ok(())
}

/// How often a component that lost its port is started again on a new one.
pub const PORT_RETRIES: usize = 3;

/// Runs `start` (which takes ports from [`free_port`]) until it succeeds, at most
/// [`PORT_RETRIES`] times, again only when it failed because a port was taken after it was
/// handed out: its error (with the log's last lines) says `address already in use`.
pub async fn retry_on_addr_in_use<T, F, Fut>(component: &str, mut start: F) -> Result<T, BedError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, BedError>>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        match start().await {
            Err(e) if tries < PORT_RETRIES && lost_its_port(&e) => {
                eprintln!(
                    "{component}: a port was taken before it bound it; starting again on new ports ({e})"
                );
            }
            other => return other,
        }
    }
}

/// A start that failed because a port was taken: the error (or the log tail it carries) says so
/// in the words of Go's net package and of Rust's std.
fn lost_its_port(e: &BedError) -> bool {
    let text = e.to_string();
    text.contains("address already in use") || text.contains("Address already in use")
}

/// Asks the kernel to SIGKILL the child when the thread that started it dies, so a test run that
/// is killed leaves no etcd or kube-apiserver behind.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only calls prctl, which is
    // async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Collects the lines a child writes to `stream` until it closes (the child exits).
pub fn collect_lines(
    stream: impl std::io::Read + Send + 'static,
) -> std::thread::JoinHandle<Vec<String>> {
    use std::io::BufRead;
    std::thread::spawn(move || {
        std::io::BufReader::new(stream)
            .lines()
            .map_while(Result::ok)
            .collect()
    })
}

/// The lines of a `--log-format json` log, parsed; panics on a line that is not a JSON object
/// with a `level`, or that holds key material (a PEM block, kubeconfig `*-data`, or any of the
/// `*-data:` values of the kubeconfig text `credentials`).
pub fn json_log(lines: &[String], credentials: &str) -> Vec<serde_json::Value> {
    assert!(!lines.is_empty(), "the program logged nothing");
    let secrets: Vec<&str> = credentials
        .lines()
        .filter(|l| l.contains("-data:"))
        .filter_map(|l| Some(l.split_once(':')?.1.trim()))
        .filter(|s| s.len() >= 16)
        .collect();
    lines
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}"));
            assert!(v.get("level").is_some(), "no level: {l}");
            assert!(
                !l.contains("BEGIN") && !l.contains("client-key-data"),
                "key material in the log: {l}"
            );
            assert!(
                secrets.iter().all(|s| !l.contains(s)),
                "a cloud-config secret in the log: {l}"
            );
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port handed out is outside the ephemeral range, distinct from the others, and held:
    /// another process (flock(1)) cannot take its reservation while this one lives.
    #[test]
    fn handed_out_ports_are_reserved_across_processes() {
        let ports: Vec<u16> = (0..3).map(|_| free_port().expect("a port")).collect();
        for p in &ports {
            assert!(HANDED_OUT.contains(p), "{p} outside {HANDED_OUT:?}");
            assert!(reserve(*p).is_none(), "{p} is held by this process");
            let lock = Path::new(RESERVATIONS).join(format!("{p}.lock"));
            let other = Command::new("flock")
                .arg("-n")
                .arg(&lock)
                .arg("true")
                .status()
                .expect("flock(1)");
            assert!(
                !other.success(),
                "another process took the reservation of {p}"
            );
        }
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
    }
}
