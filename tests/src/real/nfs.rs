//! A real NFS server for the RWX stand-in: nfs-ganesha 4.3 (Debian `nfs-ganesha`,
//! `nfs-ganesha-vfs`; `tests/scripts/tools.sh` installs them), a userspace server because the
//! host kernel has no nfsd. It runs as a child process bound to 127.0.0.1 on the standard NFS
//! port 2049, NFSv4 only, no grace period, one `EXPORT` per volume (FSAL VFS over a directory the
//! caller mounted). Exports are added and removed by rewriting the configuration and sending
//! SIGHUP: ganesha 4.3 rereads its exports then ("Reread exports complete" in its log; no D-Bus
//! here).
//!
//! Guests reach it at 10.0.2.2 (QEMU user networking forwards it to the host's 127.0.0.1) with
//! no port option: upstream's `status.mountOpts` is usually empty (networkfs-manager copies the
//! PV's `nfsOptions`), and the CSI node then mounts with `vers=4` alone, as it does against a
//! share manager. One server per machine can have the port: [`NfsServer::start`] takes the
//! lock file [`PORT_LOCK`] for its life and waits (bounded) for another bed's server to go.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::BedError;
use crate::util::process::{Proc, tail};

/// The server binary, from Debian's `nfs-ganesha`.
pub const GANESHA: &str = "ganesha.nfsd";
/// The line ganesha 4.3 logs once a SIGHUP's export reload is done.
const RELOADED: &str = "Reread exports complete";
/// The line it logs once it serves.
const STARTED: &str = "NFS SERVER INITIALIZED";
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The standard NFS port, where clients mounting without `port=` connect.
pub const NFS_PORT: u16 = 2049;
/// Held (flock) by the server that has [`NFS_PORT`] on this machine.
pub const PORT_LOCK: &str = "/tmp/harvester-testbed-nfs-2049.lock";
/// How long [`NfsServer::start`] waits for another bed's server to let the port go (an RWX
/// test takes about 80 s).
const PORT_WAIT: Duration = Duration::from_secs(600);
const RELOAD_TIMEOUT: Duration = Duration::from_secs(15);

/// One export: the directory served under `/<pseudo>` (NFSv4 pseudo filesystem path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Export {
    pub id: u32,
    pub path: PathBuf,
}

/// The ganesha configuration (pure, unit-tested): NFSv4 over TCP only on `127.0.0.1:<port>`, no
/// NLM/RQUOTA (v3 side protocols), no grace period (a fresh server has no clients to reclaim
/// state; with it every OPEN waits 90 s after a start), recovery files under `recovery`.
pub fn config(port: u16, recovery: &Path, exports: &BTreeMap<String, Export>) -> String {
    let mut s = format!(
        "NFS_CORE_PARAM {{\n    Bind_addr = 127.0.0.1;\n    NFS_Port = {port};\n    Protocols = 4;\n    \
         Enable_NLM = false;\n    Enable_RQUOTA = false;\n}}\n\
         NFSV4 {{\n    Graceless = true;\n    RecoveryBackend = fs;\n    RecoveryRoot = {};\n}}\n\
         NFS_KRB5 {{\n    Active_krb5 = false;\n}}\n",
        recovery.display()
    );
    for (pseudo, e) in exports {
        s.push_str(&format!(
            "EXPORT {{\n    Export_Id = {};\n    Path = {};\n    Pseudo = /{pseudo};\n    \
             Access_Type = RW;\n    Squash = No_Root_Squash;\n    Protocols = 4;\n    \
             Transports = TCP;\n    SecType = sys;\n    FSAL {{\n        Name = VFS;\n    }}\n}}\n",
            e.id,
            e.path.display()
        ));
    }
    s
}

struct State {
    exports: BTreeMap<String, Export>,
    next_id: u32,
    proc: Option<Proc>,
}

pub struct NfsServer {
    pub dir: PathBuf,
    pub port: u16,
    /// ganesha's own log (`-L`).
    pub log: PathBuf,
    conf: PathBuf,
    state: Mutex<State>,
    /// The flock on [`PORT_LOCK`], released when the server is dropped.
    _port_lock: std::fs::File,
}

/// Takes the exclusive flock on [`PORT_LOCK`], polling until `PORT_WAIT` has passed.
fn lock_port() -> Result<std::fs::File, BedError> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(PORT_LOCK)
        .map_err(|e| BedError::Setup(format!("opening {PORT_LOCK}: {e}")))?;
    let t0 = Instant::now();
    loop {
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(file),
            Err(rustix::io::Errno::WOULDBLOCK) if t0.elapsed() < PORT_WAIT => {
                std::thread::sleep(Duration::from_millis(250));
            }
            Err(e) => {
                return Err(BedError::Setup(format!(
                    "NFS port {NFS_PORT}: {PORT_LOCK} is held by another bed's NFS server \
                     after {:?} ({e}); only one RWX test runs at a time per machine",
                    t0.elapsed()
                )));
            }
        }
    }
}

fn count(log: &Path, line: &str) -> usize {
    std::fs::read_to_string(log)
        .map(|t| t.matches(line).count())
        .unwrap_or(0)
}

impl NfsServer {
    /// Starts ganesha in `<parent>/nfs` on 127.0.0.1:[`NFS_PORT`] with no exports and waits
    /// until it serves (first waiting, bounded, for [`PORT_LOCK`]).
    pub fn start(parent: &Path) -> Result<NfsServer, BedError> {
        let port_lock = lock_port()?;
        let dir = parent.join("nfs");
        let recovery = dir.join("recovery");
        std::fs::create_dir_all(&recovery)
            .map_err(|e| BedError::Setup(format!("creating {}: {e}", recovery.display())))?;
        let server = NfsServer {
            _port_lock: port_lock,
            port: NFS_PORT,
            log: dir.join("ganesha.log"),
            conf: dir.join("ganesha.conf"),
            dir,
            state: Mutex::new(State {
                exports: BTreeMap::new(),
                next_id: 1,
                proc: None,
            }),
        };
        server.start_again()?;
        Ok(server)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write_config(&self, exports: &BTreeMap<String, Export>) -> Result<(), BedError> {
        std::fs::write(
            &self.conf,
            config(self.port, &self.dir.join("recovery"), exports),
        )
        .map_err(|e| BedError::Setup(format!("writing {}: {e}", self.conf.display())))
    }

    /// (Re)starts the server on the same port with the current exports; waits until it serves.
    pub fn start_again(&self) -> Result<(), BedError> {
        let mut st = self.lock();
        if let Some(mut p) = st.proc.take() {
            p.stop();
        }
        self.write_config(&st.exports)?;
        let before = count(&self.log, STARTED);
        let mut cmd = Command::new(GANESHA);
        cmd.arg("-F")
            .arg("-f")
            .arg(&self.conf)
            .arg("-L")
            .arg(&self.log)
            .arg("-p")
            .arg(self.dir.join("ganesha.pid"))
            .arg("-N")
            .arg("NIV_EVENT");
        let mut proc = Proc::spawn("ganesha-stdout", cmd, &self.dir).map_err(|e| match e {
            BedError::Start { log, reason, .. } if reason.contains("No such file") => {
                BedError::MissingTool {
                    tool: GANESHA.into(),
                    path: log,
                    script: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/tools.sh"),
                }
            }
            other => other,
        })?;
        let t0 = Instant::now();
        loop {
            proc.check_alive().map_err(|e| BedError::Start {
                component: "nfs-ganesha".into(),
                log: self.log.clone(),
                reason: format!("{e}; ganesha's log:\n{}", tail(&self.log, 15)),
            })?;
            let serving = count(&self.log, STARTED) > before
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok();
            if serving {
                break;
            }
            if t0.elapsed() > START_TIMEOUT {
                return Err(BedError::Timeout {
                    component: "nfs-ganesha".into(),
                    log: self.log.clone(),
                    what: format!("serving NFSv4 on 127.0.0.1:{}", self.port),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        st.proc = Some(proc);
        Ok(())
    }

    /// Kills the server (the exports are kept for [`NfsServer::start_again`]).
    pub fn stop(&self) {
        if let Some(mut p) = self.lock().proc.take() {
            p.stop();
        }
    }

    /// Whether the server process is running.
    pub fn running(&self) -> bool {
        self.lock()
            .proc
            .as_mut()
            .is_some_and(|p| p.check_alive().is_ok())
    }

    /// Exports `path` as `/<pseudo>` (idempotent).
    pub fn export(&self, pseudo: &str, path: &Path) -> Result<(), BedError> {
        let mut st = self.lock();
        if st
            .exports
            .get(pseudo)
            .is_some_and(|e| e.path.as_path() == path)
        {
            return Ok(());
        }
        let id = st.next_id;
        st.next_id += 1;
        st.exports.insert(
            pseudo.to_string(),
            Export {
                id,
                path: path.to_path_buf(),
            },
        );
        self.reload(&st)
    }

    /// Removes export `/<pseudo>` (idempotent).
    pub fn unexport(&self, pseudo: &str) -> Result<(), BedError> {
        let mut st = self.lock();
        if st.exports.remove(pseudo).is_none() {
            return Ok(());
        }
        self.reload(&st)
    }

    /// The pseudo paths exported now.
    pub fn exports(&self) -> Vec<String> {
        self.lock().exports.keys().cloned().collect()
    }

    /// Writes the configuration and, if the server runs, SIGHUPs it and waits for the reload.
    fn reload(&self, st: &State) -> Result<(), BedError> {
        self.write_config(&st.exports)?;
        let Some(proc) = st.proc.as_ref() else {
            return Ok(());
        };
        let before = count(&self.log, RELOADED);
        let out = Command::new("kill")
            .arg("-HUP")
            .arg(proc.pid().to_string())
            .output()
            .map_err(|e| BedError::Setup(format!("kill -HUP ganesha: {e}")))?;
        if !out.status.success() {
            return Err(BedError::Setup(format!(
                "kill -HUP {}: {}",
                proc.pid(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let t0 = Instant::now();
        while count(&self.log, RELOADED) <= before {
            if t0.elapsed() > RELOAD_TIMEOUT {
                return Err(BedError::Timeout {
                    component: "nfs-ganesha".into(),
                    log: self.log.clone(),
                    what: format!("{RELOADED:?} after SIGHUP"),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_serves_nfsv4_on_loopback_with_one_export_per_volume() {
        let exports = BTreeMap::from([
            (
                "pvc-a".to_string(),
                Export {
                    id: 1,
                    path: "/srv/a".into(),
                },
            ),
            (
                "pvc-b".to_string(),
                Export {
                    id: 7,
                    path: "/srv/b".into(),
                },
            ),
        ]);
        let c = config(20490, Path::new("/r"), &exports);
        for want in [
            "Bind_addr = 127.0.0.1;",
            "NFS_Port = 20490;",
            "Protocols = 4;",
            "Graceless = true;",
            "RecoveryRoot = /r;",
            "Export_Id = 1;\n    Path = /srv/a;\n    Pseudo = /pvc-a;",
            "Export_Id = 7;\n    Path = /srv/b;\n    Pseudo = /pvc-b;",
            "Name = VFS;",
        ] {
            assert!(c.contains(want), "{want:?} in\n{c}");
        }
        assert_eq!(c.matches("EXPORT {").count(), 2);
        assert!(!config(1, Path::new("/r"), &BTreeMap::new()).contains("EXPORT"));
    }
}
