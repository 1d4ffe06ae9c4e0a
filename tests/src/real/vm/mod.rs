//! A real guest: QEMU (software emulation) booting a stock Debian kernel with the bed's initramfs
//! (`tests/scripts/guest.sh`). The guest has a virtio-scsi controller for hot-plugged disks, a
//! user-mode network (the host's loopback is 10.0.2.2; chosen guest ports are forwarded to
//! ephemeral ports on 127.0.0.1), a 9p share at `/mnt/share`, qemu-guest-agent's virtio-serial
//! channel and a command channel (one `sh` per TCP connection).
//!
//! QEMU dies with the test process (PR_SET_PDEATHSIG) and is killed and reaped when the [`Vm`]
//! is dropped; its PID is also in `<dir>/qemu.pid`.

pub mod qmp;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::BedError;
use crate::util::process::{Proc, free_port, tail};
use qmp::Qmp;

/// The guest port of the command channel (`guest.shell=` on the kernel command line).
pub const SHELL_PORT: u16 = 2222;
/// The MAC of the guest's NIC (KubeVirt matches agent-reported interfaces to the VMI by MAC).
pub const GUEST_MAC: &str = "52:54:00:12:34:56";
/// The address the guest reaches the host's 127.0.0.1 at (QEMU's user network).
pub const HOST_FROM_GUEST: &str = "10.0.2.2";
/// Where the share directory is mounted in the guest.
pub const GUEST_SHARE: &str = "/mnt/share";
/// The virtio-scsi bus hot-plugged disks go on.
const SCSI_BUS: &str = "scsi0.0";
/// Bound of a shell command in the guest unless the caller says otherwise.
const SHELL_TIMEOUT: Duration = Duration::from_secs(180);
/// Bound of a guest-agent call (no agent: the call never gets an answer).
const AGENT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub struct VmOptions {
    pub name: String,
    /// Start udev in the guest (by-id links); without it disks are only in sysfs.
    pub udev: bool,
    /// Start qemu-guest-agent in the guest.
    pub agent: bool,
    pub memory_mb: u32,
    /// From QEMU's start to the command channel answering.
    pub boot_timeout: Duration,
    /// Guest TCP ports forwarded to ephemeral ports on the host's 127.0.0.1.
    pub forward: Vec<u16>,
}

impl VmOptions {
    pub fn new(name: &str) -> VmOptions {
        VmOptions {
            name: name.into(),
            udev: true,
            agent: true,
            memory_mb: 768,
            boot_timeout: Duration::from_secs(240),
            forward: Vec::new(),
        }
    }
    pub fn without_udev(mut self) -> Self {
        self.udev = false;
        self
    }
    pub fn without_agent(mut self) -> Self {
        self.agent = false;
        self
    }
    pub fn forward(mut self, guest_port: u16) -> Self {
        self.forward.push(guest_port);
        self
    }
}

/// What a shell command in the guest printed (stdout and stderr) and its exit code.
#[derive(Clone, Debug)]
pub struct ShellOutput {
    pub code: i32,
    pub output: String,
}

pub struct Vm {
    pub name: String,
    pub options: VmOptions,
    /// `<bed dir>/vm-<name>`: QEMU's log, the console log, sockets, the share.
    pub dir: PathBuf,
    /// Host directory shared into the guest at [`GUEST_SHARE`].
    pub share: PathBuf,
    pub console: PathBuf,
    /// From QEMU's start to the command channel answering.
    pub booted_in: Duration,
    shell_port: u16,
    forwards: Vec<(u16, u16)>,
    qga_socket: PathBuf,
    qmp: tokio::sync::Mutex<Qmp>,
    next_lun: AtomicU32,
    plugged: Mutex<HashMap<String, String>>,
    qemu: Mutex<Proc>,
    /// Measurements: `device_add` to the guest kernel showing the disk, per hot-plug; how each
    /// unplug's completion was seen (`DEVICE_DELETED` or the `qom-list` fallback).
    pub stats: Mutex<HotplugStats>,
}

#[derive(Clone, Debug, Default)]
pub struct HotplugStats {
    pub plug_to_guest: Vec<Duration>,
    pub unplug_seen_by: Vec<&'static str>,
}

/// The guest image directory (`tests/scripts/guest.sh --print-dir`), or `$HARVESTER_TESTBED_GUEST`.
pub fn guest_dir() -> Result<PathBuf, BedError> {
    crate::util::tools::print_dir("HARVESTER_TESTBED_GUEST", &guest_script())
}

fn guest_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/guest.sh")
}

/// `kvm` only with a hardware KVM module; this machine's `kvm_pvm` hangs a stock kernel, and QEMU
/// does not fall back from a KVM that initialised (`-accel kvm -accel tcg` hangs too).
pub fn accelerator() -> &'static str {
    if Path::new("/sys/module/kvm_intel").exists() || Path::new("/sys/module/kvm_amd").exists() {
        "kvm"
    } else {
        "tcg"
    }
}

/// The guest CPU: the host's under KVM; under TCG the x86-64 baseline, which boots the guest to
/// its command channel in 11.7-12.8 CPU seconds against 15.6-15.7 with `max` and 16.8 with
/// Nehalem (4 Dec): with SSE4.2 or more on offer the guest's kernel and glibc take paths that
/// TCG emulates slowly, and nothing in the guest needs more than the baseline.
pub fn cpu_model(accelerator: &str) -> &'static str {
    if accelerator == "kvm" {
        "max"
    } else {
        "qemu64"
    }
}

/// A QMP node / device id for a volume name: `hp-<name>` with letters, digits, `-`, `.`, `_`
/// only; a name too long for QMP's 31-character node names (with the `-file` suffix
/// [`Vm::plug`] adds) becomes `hp-<16 hex digits of its FNV-1a hash>`.
pub fn device_id(volume: &str) -> String {
    const MAX: usize = 31 - "-file".len();
    let clean: String = volume
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let id = format!("hp-{clean}");
    if id.len() <= MAX {
        return id;
    }
    let hash = volume.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("hp-{hash:016x}")
}

/// The QEMU command line (pure: no I/O), for [`Vm::start`] and its unit test.
pub fn qemu_args(
    image: &Path,
    dir: &Path,
    share: &Path,
    opts: &VmOptions,
    shell_port: u16,
    forwards: &[(u16, u16)],
) -> Vec<String> {
    let mut net = format!("user,id=n0,hostfwd=tcp:127.0.0.1:{shell_port}-:{SHELL_PORT}");
    for (guest, host) in forwards {
        net.push_str(&format!(",hostfwd=tcp:127.0.0.1:{host}-:{guest}"));
    }
    let append = format!(
        "console=ttyS0 panic=-1 quiet guest.udev={} guest.agent={} guest.shell={SHELL_PORT}",
        u8::from(opts.udev),
        u8::from(opts.agent)
    );
    let d = |name: &str| dir.join(name).display().to_string();
    [
        "-name",
        &opts.name,
        "-accel",
        accelerator(),
        "-cpu",
        cpu_model(accelerator()),
        "-machine",
        "q35",
        "-m",
        &opts.memory_mb.to_string(),
        "-smp",
        "1",
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        &image.join("vmlinuz").display().to_string(),
        "-initrd",
        &image.join("initramfs.cpio").display().to_string(),
        "-append",
        &append,
        "-serial",
        &format!("file:{}", d("console.log")),
        "-qmp",
        &format!("unix:{},server=on,wait=off", d("qmp.sock")),
        "-pidfile",
        &d("qemu.pid"),
        "-device",
        "virtio-scsi-pci,id=scsi0",
        "-netdev",
        &net,
        "-device",
        &format!("virtio-net-pci,netdev=n0,mac={GUEST_MAC}"),
        "-device",
        "virtio-serial-pci,id=vser0",
        "-chardev",
        &format!("socket,path={},server=on,wait=off,id=qga0", d("qga.sock")),
        "-device",
        "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
        "-virtfs",
        &format!(
            "local,path={},mount_tag=hostshare,security_model=none,id=fs0",
            share.display()
        ),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

impl Vm {
    /// Boots the guest in `<parent>/vm-<name>` and waits (bounded by `opts.boot_timeout`) until
    /// its command channel answers. A QEMU that exits, or a guest that does not come up, is an
    /// error with the console log's last lines.
    pub async fn start(parent: &Path, opts: VmOptions) -> Result<Vm, BedError> {
        let image = guest_dir()?;
        for f in ["vmlinuz", "initramfs.cpio"] {
            if !image.join(f).is_file() {
                return Err(BedError::MissingTool {
                    tool: format!("guest image {f}"),
                    path: image.join(f),
                    script: guest_script(),
                });
            }
        }
        let qemu_bin = "qemu-system-x86_64";
        let dir = parent.join(format!("vm-{}", opts.name));
        let share = dir.join("share");
        std::fs::create_dir_all(&share)
            .map_err(|e| BedError::Setup(format!("creating {}: {e}", share.display())))?;
        let shell_port = free_port()?;
        let mut forwards = Vec::new();
        for g in &opts.forward {
            forwards.push((*g, free_port()?));
        }
        let mut cmd = Command::new(qemu_bin);
        cmd.args(qemu_args(
            &image, &dir, &share, &opts, shell_port, &forwards,
        ));
        let component = format!("qemu-{}", opts.name);
        let console = dir.join("console.log");
        let t0 = Instant::now();
        let mut proc = Proc::spawn(&component, cmd, &dir).map_err(|e| match e {
            BedError::Start { log, reason, .. } if reason.contains("No such file") => {
                BedError::MissingTool {
                    tool: qemu_bin.into(),
                    path: log,
                    script: guest_script(),
                }
            }
            other => other,
        })?;
        let failed = |reason: String, proc_log: &Path| BedError::Start {
            component: component.clone(),
            log: console.clone(),
            reason: format!(
                "{reason}; console's last lines:\n{}\nQEMU's log ({}):\n{}",
                tail(&console, 25),
                proc_log.display(),
                tail(proc_log, 10)
            ),
        };
        // Up: the init printed GUEST-READY and the command channel answers.
        loop {
            if let Err(e) = proc.check_alive() {
                return Err(failed(format!("QEMU exited: {e}"), &proc.log));
            }
            let ready = std::fs::read_to_string(&console)
                .map(|c| c.contains("GUEST-READY"))
                .unwrap_or(false);
            if ready
                && shell_once(shell_port, "echo up", Duration::from_secs(10))
                    .await
                    .is_ok_and(|o| o.code == 0 && o.output.contains("up"))
            {
                break;
            }
            if t0.elapsed() > opts.boot_timeout {
                return Err(failed(
                    format!("the guest did not come up within {:?}", opts.boot_timeout),
                    &proc.log,
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let booted_in = t0.elapsed();
        let qmp = match Qmp::connect(&dir.join("qmp.sock")).await {
            Ok(q) => q,
            Err(e) => return Err(failed(format!("QMP: {e}"), &proc.log)),
        };
        tracing::info!(vm = %opts.name, "guest up in {booted_in:?}");
        Ok(Vm {
            name: opts.name.clone(),
            options: opts,
            share,
            console,
            booted_in,
            shell_port,
            forwards,
            qga_socket: dir.join("qga.sock"),
            dir,
            qmp: tokio::sync::Mutex::new(qmp),
            next_lun: AtomicU32::new(0),
            plugged: Mutex::new(HashMap::new()),
            qemu: Mutex::new(proc),
            stats: Mutex::new(HotplugStats::default()),
        })
    }

    /// The host port (on 127.0.0.1) forwarded to `guest_port`.
    pub fn host_port(&self, guest_port: u16) -> Option<u16> {
        self.forwards
            .iter()
            .find(|(g, _)| *g == guest_port)
            .map(|(_, h)| *h)
    }

    /// The host port (on 127.0.0.1) of the command channel: one `sh` per connection, reading
    /// the script until the connection's write side closes or the script says `exit`.
    pub fn shell_port(&self) -> u16 {
        self.shell_port
    }

    /// The console log's last `n` lines.
    pub fn console_tail(&self, n: usize) -> String {
        tail(&self.console, n)
    }

    /// Runs `script` with `sh` in the guest; its output (stdout and stderr) and exit code.
    pub async fn shell(&self, script: &str) -> Result<ShellOutput, BedError> {
        self.shell_within(script, SHELL_TIMEOUT).await
    }

    /// [`Vm::shell`] with its own bound.
    pub async fn shell_within(
        &self,
        script: &str,
        timeout: Duration,
    ) -> Result<ShellOutput, BedError> {
        self.alive()?;
        shell_once(self.shell_port, script, timeout)
            .await
            .map_err(|e| {
                BedError::Setup(format!(
                    "guest {}: shell {script:?}: {e}; console's last lines:\n{}",
                    self.name,
                    self.console_tail(10)
                ))
            })
    }

    /// [`Vm::shell`] that must exit 0; the output, or an error with the output.
    pub async fn run(&self, script: &str) -> Result<String, BedError> {
        let out = self.shell(script).await?;
        if out.code != 0 {
            return Err(BedError::Setup(format!(
                "guest {}: {script:?} exited {}: {}",
                self.name,
                out.code,
                out.output.trim()
            )));
        }
        Ok(out.output)
    }

    /// An error naming QEMU's exit if it is gone.
    pub fn alive(&self) -> Result<(), BedError> {
        self.qemu
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .check_alive()
    }

    /// Runs one QMP command.
    pub async fn qmp(&self, command: &str, arguments: Value) -> Result<Value, BedError> {
        self.alive()?;
        Ok(self.qmp.lock().await.execute(command, arguments).await?)
    }

    /// Hot-plugs `source` (a file or block device) as a SCSI disk with `serial`:
    /// `blockdev-add` (file or host_device, then raw) and `device_add scsi-hd`. `id` names the
    /// QMP nodes and the device ([`device_id`]).
    pub async fn plug(&self, id: &str, source: &Path, serial: &str) -> Result<(), BedError> {
        use std::os::unix::fs::FileTypeExt;
        let driver = match std::fs::metadata(source) {
            Ok(m) if m.file_type().is_block_device() => "host_device",
            Ok(_) => "file",
            Err(e) => {
                return Err(BedError::Setup(format!(
                    "hot-plug source {}: {e}",
                    source.display()
                )));
            }
        };
        let file = format!("{id}-file");
        let lun = self.next_lun.fetch_add(1, Ordering::Relaxed) % 16_384;
        let mut q = self.qmp.lock().await;
        q.execute(
            "blockdev-add",
            json!({"driver": driver, "node-name": file, "filename": source}),
        )
        .await?;
        q.execute(
            "blockdev-add",
            json!({"driver": "raw", "node-name": id, "file": file}),
        )
        .await?;
        q.execute(
            "device_add",
            json!({"driver": "scsi-hd", "bus": SCSI_BUS, "channel": 0, "scsi-id": 0,
                   "lun": lun, "drive": id, "serial": serial, "id": format!("{id}-dev")}),
        )
        .await?;
        self.plugged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), serial.to_string());
        Ok(())
    }

    /// Whether disk `id` is plugged (by [`Vm::plug`], not yet unplugged).
    pub fn is_plugged(&self, id: &str) -> bool {
        self.plugged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(id)
    }

    /// A copy of the measurements so far.
    pub fn hotplug_stats(&self) -> HotplugStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits until the guest kernel has a SCSI disk with `serial` (its unit serial number page,
    /// `/sys/block/*/device/vpd_pg80`) and returns its name (`sdb`).
    pub async fn wait_for_disk(&self, serial: &str, timeout: Duration) -> Result<String, BedError> {
        let tenths = timeout.as_millis() / 100;
        let script = format!(
            "i=0; while [ $i -lt {tenths} ]; do \
               for d in /sys/block/sd*; do \
                 [ -r $d/device/vpd_pg80 ] || continue; \
                 s=$(tail -c +5 $d/device/vpd_pg80 | tr -d '\\000 '); \
                 [ \"$s\" = '{serial}' ] && echo ${{d##*/}} && exit 0; \
               done; sleep 0.1; i=$((i+1)); done; exit 1"
        );
        let out = self
            .shell_within(&script, timeout + Duration::from_secs(30))
            .await?;
        if out.code != 0 {
            return Err(BedError::Setup(format!(
                "guest {}: no disk with serial {serial} in /sys/block within {timeout:?}",
                self.name
            )));
        }
        Ok(out.output.trim().to_string())
    }

    /// Unplugs disk `id`: `device_del`, then waits for `DEVICE_DELETED` (or, as a fallback,
    /// for the device to leave `qom-list /machine/peripheral`), then `blockdev-del` of both
    /// nodes. Returns how the removal was seen (`"DEVICE_DELETED"` or `"qom-list"`).
    pub async fn unplug(&self, id: &str) -> Result<&'static str, BedError> {
        let dev = format!("{id}-dev");
        let mut q = self.qmp.lock().await;
        q.execute("device_del", json!({"id": dev})).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        // QEMU takes the device out of the QOM tree first and emits DEVICE_DELETED once it is
        // finalised; qom-list (which also reads the events queued before its reply) notices a
        // removal whose event never comes.
        let mut gone_since: Option<Instant> = None;
        let seen = loop {
            let deleted = q.take_events().iter().any(|e| {
                e["event"] == "DEVICE_DELETED" && e["data"]["device"].as_str() == Some(&dev)
            });
            if deleted {
                break "DEVICE_DELETED";
            }
            if gone_since.is_some_and(|t| t.elapsed() > Duration::from_secs(2)) {
                break "qom-list";
            }
            let peripherals = q
                .execute("qom-list", json!({"path": "/machine/peripheral"}))
                .await?;
            let present = peripherals
                .as_array()
                .is_some_and(|a| a.iter().any(|p| p["name"].as_str() == Some(&dev)));
            if !present && gone_since.is_none() {
                gone_since = Some(Instant::now());
            }
            if Instant::now() > deadline {
                return Err(BedError::Setup(format!(
                    "guest {}: device {dev} still present 30s after device_del",
                    self.name
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // The device lets go of its drive when it is finalised, which QEMU may do a moment
        // after DEVICE_DELETED: until then blockdev-del says the node "is in use".
        for node in [id.to_string(), format!("{id}-file")] {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match q.execute("blockdev-del", json!({"node-name": node})).await {
                    Ok(_) => break,
                    Err(qmp::QmpError::Command { desc, .. })
                        if desc.contains("in use") && Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        self.plugged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unplug_seen_by
            .push(seen);
        Ok(seen)
    }

    /// Grows plugged disk `id` to `size` bytes (QMP `block_resize`; a block device must have
    /// grown already).
    pub async fn resize(&self, id: &str, size: u64) -> Result<(), BedError> {
        self.qmp("block_resize", json!({"node-name": id, "size": size}))
            .await
            .map(|_| ())
    }

    /// qemu-guest-agent's `guest-network-get-interfaces` over its virtio-serial channel.
    pub async fn agent_interfaces(&self) -> Result<Value, BedError> {
        self.agent("guest-network-get-interfaces").await
    }

    /// qemu-guest-agent's `guest-get-host-name` (`{"host-name": ...}`), which virt-launcher asks
    /// for the `hostname` of KubeVirt's `guestosinfo`.
    pub async fn agent_host_name(&self) -> Result<String, BedError> {
        let reply = self.agent("guest-get-host-name").await?;
        reply
            .get("host-name")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| {
                BedError::Setup(format!(
                    "guest {}: guest-get-host-name answered {reply}",
                    self.name
                ))
            })
    }

    /// One argument-less qemu-guest-agent command over its virtio-serial channel, bounded.
    async fn agent(&self, command: &str) -> Result<Value, BedError> {
        self.alive()?;
        let ask = async {
            let mut a = Qmp::connect_agent(&self.qga_socket).await?;
            a.execute(command, json!({})).await
        };
        match tokio::time::timeout(AGENT_TIMEOUT, ask).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(BedError::Setup(format!(
                "guest {}: qemu-guest-agent did not answer within {AGENT_TIMEOUT:?}",
                self.name
            ))),
        }
    }

    /// Stops QEMU (QMP `quit`, then kill) and reaps it.
    pub async fn stop(&self) {
        if let Ok(mut q) = tokio::time::timeout(Duration::from_secs(2), self.qmp.lock()).await {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), q.execute("quit", json!({}))).await;
        }
        self.qemu.lock().unwrap_or_else(|p| p.into_inner()).stop();
    }
}

/// One connection to the command channel: `script` runs in a fresh `sh`; returns its output and
/// exit code.
async fn shell_once(port: u16, script: &str, timeout: Duration) -> Result<ShellOutput, String> {
    const MARK: &str = "__guest_rc=";
    let run = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connecting to 127.0.0.1:{port}: {e}"))?;
        // A subshell, so that `exit` in the script still leaves the exit code to report.
        let text = format!("(\n{script}\n) </dev/null 2>&1; echo \"{MARK}$?\"\nexit\n");
        s.write_all(text.as_bytes())
            .await
            .map_err(|e| format!("writing: {e}"))?;
        s.shutdown().await.map_err(|e| format!("shutdown: {e}"))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)
            .await
            .map_err(|e| format!("reading: {e}"))?;
        Ok::<_, String>(String::from_utf8_lossy(&out).to_string())
    };
    let text = tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))??;
    let (output, code) = text
        .rsplit_once(MARK)
        .ok_or_else(|| format!("the shell ended without an exit code; it printed {text:?}"))?;
    let code = code
        .trim()
        .parse()
        .map_err(|_| format!("unreadable exit code {:?}", code.trim()))?;
    Ok(ShellOutput {
        code,
        output: output.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_are_qmp_ids() {
        assert_eq!(device_id("pvc-1a2b"), "hp-pvc-1a2b");
        assert_eq!(device_id("a b/c"), "hp-a_b_c");
        let long = device_id("sanity-max-attach-limit-vol-0-d9454532-ed5503f5-baaa9f87c8");
        assert!(long.len() + "-file".len() <= 31, "{long}");
        assert_ne!(
            long,
            device_id("sanity-max-attach-limit-vol-1-d9454532-ed5503f5-baaa9f87c8")
        );
    }

    #[test]
    fn the_command_line_forwards_ports_and_passes_switches() {
        let opts = VmOptions::new("w1").without_udev().forward(10000);
        let args = qemu_args(
            Path::new("/img"),
            Path::new("/d"),
            Path::new("/d/share"),
            &opts,
            4000,
            &[(10000, 4001)],
        );
        let after = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .map(|i| args[i + 1].clone())
                .unwrap_or_else(|| panic!("no {flag} in {args:?}"))
        };
        assert_eq!(
            after("-netdev"),
            "user,id=n0,hostfwd=tcp:127.0.0.1:4000-:2222,hostfwd=tcp:127.0.0.1:4001-:10000"
        );
        assert!(after("-append").contains("guest.udev=0 guest.agent=1"));
        assert_eq!(after("-pidfile"), "/d/qemu.pid");
        assert_eq!(after("-kernel"), "/img/vmlinuz");
    }
}
