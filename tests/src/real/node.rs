//! A real guest node for the bed (issue 15): containerd (Debian) and a kubelet 1.34.4
//! (`tests/scripts/node-tools.sh`) registering against the bed's guest API server with
//! `--cloud-provider=external`, so the Node appears tainted `uninitialized` for the cloud
//! provider to initialise. Pods get addresses from the CNI bridge of [`crate::real::podnet`];
//! `crate::bed::guest_cluster` adds the control plane, the images and the charts.
//!
//! Pitfalls of a real kubelet and containerd on a shared machine (docs/testbed.md) handled here: containerd runs with
//! `restrict_oom_score_adj = true` (CAP_SYS_RESOURCE is not in the bounding set); the kernel
//! sysctls the kubelet rewrites are saved before and restored on drop; mounts under the node's
//! directory are swept, containerd's tasks killed before containerd stops (and their shims,
//! which containerd does not take with it, waited for or killed), and the `kubepods` cgroups
//! removed on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;

use crate::BedError;
use crate::real::mounts::MountSweeper;
use crate::util::leftovers;
use crate::util::process::{Proc, free_port};

/// The taint the kubelet puts on a Node with `--cloud-provider=external`
/// (k8s.io/cloud-provider v0.34.4 `api/well_known_taints.go`, `TaintExternalCloudProvider`).
pub const TAINT_UNINITIALIZED: &str = "node.cloudprovider.kubernetes.io/uninitialized";

/// The kernel tunables the kubelet sets (kubernetes v1.34.4
/// `pkg/kubelet/cm/container_manager_linux.go`, `setupKernelTunables`), as `/proc/sys` paths.
pub const KUBELET_SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// containerd's runc shim as `/proc/<pid>/comm` shows it (the first 15 bytes of
/// `containerd-shim-runc-v2`).
const SHIM_COMM: &str = "containerd-shim";
/// How long the teardown waits for the shims to exit by themselves, and then for killed ones.
const SHIMS_EXIT: Duration = Duration::from_secs(10);

/// The pause image containerd is told about (imported by a later step; not pulled).
pub const SANDBOX_IMAGE: &str = "localhost/pause:3.10";

/// Where the node tools are: `$HARVESTER_TESTBED_NODE_TOOLS` or `node-tools.sh --print-dir`.
pub fn node_tools_dir() -> Result<PathBuf, BedError> {
    crate::util::tools::print_dir("HARVESTER_TESTBED_NODE_TOOLS", &node_tools_script())
}

fn node_tools_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/node-tools.sh")
}

/// Node tool `name` (kubelet, kube-controller-manager, ...), or an error naming the script that
/// builds it.
pub fn node_tool(name: &str) -> Result<PathBuf, BedError> {
    need(node_tools_dir()?.join(name), name)
}

/// `path` if it is a file, else an error naming the tool and the script that provides it.
fn need(path: PathBuf, tool: &str) -> Result<PathBuf, BedError> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(BedError::MissingTool {
            tool: tool.to_string(),
            path,
            script: node_tools_script(),
        })
    }
}

/// The node's directories, all under one root.
#[derive(Debug, Clone)]
pub struct NodeDirs {
    pub root: PathBuf,
    pub containerd_root: PathBuf,
    pub containerd_state: PathBuf,
    pub containerd_socket: PathBuf,
    pub cni_conf: PathBuf,
    pub kubelet_root: PathBuf,
    /// The kubelet's `podLogsDir` (`<ns>_<pod>_<uid>/<container>/<n>.log`): in the bed's
    /// directory rather than the host's /var/log/pods, so a run leaves none behind and reads
    /// only its own ([`crate::real::pod_logs`]).
    pub pod_logs: PathBuf,
}

impl NodeDirs {
    pub fn under(root: &Path) -> NodeDirs {
        NodeDirs {
            root: root.to_path_buf(),
            containerd_root: root.join("containerd/root"),
            containerd_state: root.join("containerd/state"),
            containerd_socket: root.join("containerd/containerd.sock"),
            cni_conf: root.join("cni/net.d"),
            kubelet_root: root.join("kubelet"),
            pod_logs: root.join("pod-logs"),
        }
    }
}

/// containerd 1.6's config: own root, state and socket; cgroupfs; no AppArmor; CNI from Debian;
/// `restrict_oom_score_adj` (pitfall 1).
pub fn containerd_config(d: &NodeDirs) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{SANDBOX_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
        root = d.containerd_root.display(),
        state = d.containerd_state.display(),
        socket = d.containerd_socket.display(),
        cni = d.cni_conf.display(),
    )
}

/// The kubelet's configuration file: cgroupfs on cgroup v1, no swap check, containerd's socket,
/// serving on `address` (the node IP), no read-only port, webhook authn/authz against the guest
/// API server; eviction only when the machine is nearly full (the bed shares its disk with
/// builds), no cluster DNS (none runs; Pods fall back to the host's resolver). A running Pod is
/// synced every 10 s instead of the default minute: the kubelet grows a mounted volume
/// (NodeExpandVolume) only in a sync of a Pod using it, so `real_cluster`'s online growth waited
/// up to a minute for the next one (13.9 s to 84.5 s across runs of 4 Dec); the growth itself
/// is unchanged.
pub fn kubelet_config(
    d: &NodeDirs,
    ca: &Path,
    address: &str,
    port: u16,
    healthz_port: u16,
) -> String {
    let sock = d.containerd_socket.display();
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{sock}
imageServiceEndpoint: unix://{sock}
address: {address}
port: {port}
readOnlyPort: 0
syncFrequency: 10s
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
healthzBindAddress: 127.0.0.1
healthzPort: {healthz_port}
podLogsDir: {pod_logs}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
"#,
        ca = ca.display(),
        pod_logs = d.pod_logs.display(),
    )
}

/// The kernel tunables as they were before the kubelet ran (pitfall 2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysctlSnapshot(pub Vec<(PathBuf, String)>);

impl SysctlSnapshot {
    pub fn save(proc_sys: &Path, names: &[&str]) -> Result<SysctlSnapshot, BedError> {
        names
            .iter()
            .map(|n| {
                let p = proc_sys.join(n);
                std::fs::read_to_string(&p)
                    .map(|v| (p.clone(), v.trim().to_string()))
                    .map_err(|e| BedError::Setup(format!("reading {}: {e}", p.display())))
            })
            .collect::<Result<_, _>>()
            .map(SysctlSnapshot)
    }

    /// Writes back every value that changed; returns the ones that could not be restored.
    pub fn restore(&self) -> Vec<String> {
        let mut failed = Vec::new();
        for (p, v) in &self.0 {
            let now = std::fs::read_to_string(p).unwrap_or_default();
            if now.trim() != v
                && let Err(e) = std::fs::write(p, v)
            {
                failed.push(format!("{} = {v}: {e}", p.display()));
            }
        }
        failed
    }
}

/// The kubelet's cgroups (`kubepods` in each cgroup v1 hierarchy, cgroupfs driver), deepest
/// first, so `rmdir` can remove them.
pub fn kubepods_cgroups(cgroup_root: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    walk(&e.path(), out);
                }
            }
        }
        out.push(dir.to_path_buf());
    }
    let mut out = Vec::new();
    if let Ok(hierarchies) = std::fs::read_dir(cgroup_root) {
        for h in hierarchies.flatten() {
            let pods = h.path().join("kubepods");
            if pods.is_dir() {
                walk(&pods, &mut out);
            }
        }
    }
    out
}

/// containerd and a kubelet registered as Node `name` in the guest cluster. Dropping it stops
/// both and undoes what they changed on the host.
pub struct RealNode {
    pub name: String,
    pub dirs: NodeDirs,
    kubelet: Option<Proc>,
    containerd: Option<Proc>,
    sysctls: SysctlSnapshot,
    sweeper: MountSweeper,
}

impl RealNode {
    /// Starts containerd, then the kubelet for Node `name` with address `node_ip` against the
    /// guest API server whose admin kubeconfig is `kubeconfig` (CA `ca`); returns once the Node
    /// object exists. `before_kubelet` runs once containerd serves (the bed imports its images
    /// there, so no Pod waits for one).
    pub async fn start(
        dir: &Path,
        name: &str,
        node_ip: &str,
        kubeconfig: &Path,
        ca: &Path,
        client: &kube::Client,
        before_kubelet: impl FnOnce(&NodeDirs) -> Result<(), BedError>,
    ) -> Result<RealNode, BedError> {
        let kubelet_bin = node_tool("kubelet")?;
        let containerd_bin = need(PathBuf::from("/usr/bin/containerd"), "containerd")?;
        need(PathBuf::from("/usr/sbin/runc"), "runc")?;
        let dirs = NodeDirs::under(&dir.join(format!("node-{name}")));
        for d in [
            &dirs.containerd_root,
            &dirs.containerd_state,
            &dirs.cni_conf,
            &dirs.kubelet_root,
            &dirs.pod_logs,
        ] {
            std::fs::create_dir_all(d)
                .map_err(|e| BedError::Setup(format!("creating {}: {e}", d.display())))?;
        }
        let write = |p: PathBuf, text: String| {
            std::fs::write(&p, text)
                .map_err(|e| BedError::Setup(format!("writing {}: {e}", p.display())))
                .map(|()| p)
        };
        let sysctls = SysctlSnapshot::save(Path::new("/proc/sys"), KUBELET_SYSCTLS)?;
        let mut node = RealNode {
            name: name.to_string(),
            sweeper: MountSweeper(dirs.root.clone()),
            dirs: dirs.clone(),
            kubelet: None,
            containerd: None,
            sysctls,
        };

        write(
            dirs.cni_conf.join("10-testbed.conflist"),
            crate::real::podnet::cni_conflist(&dirs.root.join("cni/ipam")),
        )?;
        let config = write(dirs.root.join("containerd.toml"), containerd_config(&dirs))?;
        crate::real::podnet::ensure_netns_run_dir()?;
        let mut cmd = Command::new(containerd_bin);
        cmd.arg("--config").arg(&config);
        let proc = Proc::spawn(&format!("containerd-{name}"), cmd, dir)?;
        let proc = node.containerd.insert(proc);
        wait_for(proc, Duration::from_secs(30), "its socket", || {
            std::os::unix::net::UnixStream::connect(&dirs.containerd_socket).is_ok()
        })
        .await?;
        before_kubelet(&dirs)?;

        let config = write(
            dirs.root.join("kubelet.yaml"),
            kubelet_config(&dirs, ca, node_ip, free_port()?, free_port()?),
        )?;
        let mut cmd = Command::new(kubelet_bin);
        cmd.arg(format!("--config={}", config.display()))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--root-dir={}", dirs.kubelet_root.display()))
            .arg(format!(
                "--cert-dir={}",
                dirs.root.join("kubelet-pki").display()
            ))
            .arg("--cloud-provider=external")
            .arg(format!("--hostname-override={name}"))
            .arg(format!("--node-ip={node_ip}"))
            .arg("--v=2");
        let proc = Proc::spawn(&format!("kubelet-{name}"), cmd, dir)?;
        let nodes = kube::Api::<Node>::all(client.clone());
        let proc = node.kubelet.insert(proc);
        let start = Instant::now();
        loop {
            proc.check_alive()?;
            if nodes
                .get_opt(name)
                .await
                .map_err(|e| BedError::Api(e.to_string()))?
                .is_some()
            {
                return Ok(node);
            }
            if start.elapsed() > Duration::from_secs(90) {
                return Err(BedError::Timeout {
                    component: proc.name.clone(),
                    log: proc.log.clone(),
                    what: format!("Node {name} to be registered (90s)"),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl RealNode {
    /// The last `n` lines of the kubelet's log that contain `needle` (a Pod's name, say), for a
    /// failure message.
    pub fn kubelet_log_lines(&self, needle: &str, n: usize) -> String {
        let Some(kubelet) = &self.kubelet else {
            return "(the kubelet is stopped)".into();
        };
        let text = std::fs::read_to_string(&kubelet.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(needle)).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Pids of containerd and the kubelet.
    pub fn pids(&self) -> Vec<u32> {
        self.containerd
            .iter()
            .chain(self.kubelet.iter())
            .map(Proc::pid)
            .collect()
    }
}

async fn wait_for(
    proc: &mut Proc,
    bound: Duration,
    what: &str,
    mut ready: impl FnMut() -> bool,
) -> Result<(), BedError> {
    let start = Instant::now();
    while !ready() {
        proc.check_alive()?;
        if start.elapsed() > bound {
            return Err(BedError::Timeout {
                component: proc.name.clone(),
                log: proc.log.clone(),
                what: format!("{what} ({bound:?})"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

impl Drop for RealNode {
    fn drop(&mut self) {
        if let Some(mut k) = self.kubelet.take() {
            k.stop();
        }
        let mut namespaces = Vec::new();
        // Containers outlive a stopped containerd (pitfall 4): kill its tasks first.
        if let Some(mut c) = self.containerd.take() {
            let ctr = |args: &[&str]| {
                Command::new("ctr")
                    .arg("--address")
                    .arg(&self.dirs.containerd_socket)
                    .args(["-n", "k8s.io"])
                    .args(args)
                    .output()
            };
            if let Ok(out) = ctr(&["tasks", "ls", "-q"]) {
                for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
                }
            }
            // The Pods' network namespaces: containerd's CRI plugin removes one when the kubelet
            // stops its sandbox, which no one does now; left, each keeps a namespace and its veth.
            if let Ok(out) = ctr(&["containers", "ls", "-q"]) {
                for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    if let Ok(info) = ctr(&["containers", "info", id]) {
                        namespaces.extend(pod_netns(&String::from_utf8_lossy(&info.stdout)));
                    }
                }
            }
            // Each Pod's shim exits once containerd's CRI plugin has seen its tasks exit and
            // deleted them; a containerd killed before that (the last Pod's, killed just
            // before it) leaves the shim running for good: wait for them, then kill the rest.
            let socket = self.dirs.containerd_socket.display().to_string();
            let shims = || leftovers::find(SHIM_COMM, &["-address", &socket]);
            let _ = leftovers::wait_gone(&shims(), SHIMS_EXIT);
            c.stop();
            let left = shims();
            if !left.is_empty() {
                let alive = leftovers::kill(&left, SHIMS_EXIT);
                eprintln!(
                    "real node {}: killed containerd shims {left:?} left after containerd \
                     stopped{}",
                    self.name,
                    if alive.is_empty() {
                        String::new()
                    } else {
                        format!("; still alive: {alive:?}")
                    }
                );
            }
        }
        let left = self.sweeper.sweep();
        if !left.is_empty() {
            eprintln!("real node {}: unmounted leftovers {left:?}", self.name);
        }
        for ns in namespaces {
            // Quiet: containerd has often unmounted it already ("no mount point specified").
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&ns)
                .stderr(std::process::Stdio::null())
                .status();
            let _ = std::fs::remove_file(&ns);
        }
        for cg in kubepods_cgroups(Path::new("/sys/fs/cgroup")) {
            let _ = std::fs::remove_dir(&cg);
        }
        let failed = self.sysctls.restore();
        if !failed.is_empty() {
            eprintln!(
                "real node {}: could not restore sysctls {failed:?}",
                self.name
            );
        }
    }
}

/// The network namespace file of a Pod sandbox from `ctr containers info` (a container record
/// with its OCI spec under `Spec`): the `network` entry of `linux.namespaces` when it is a
/// `cni-*` file of [`crate::real::podnet::NETNS_RUN_DIR`] (containerd 1.6 names it
/// `/var/run/netns/cni-<id>`); `None` for an app container, which joins its sandbox's namespace
/// by `/proc/<pid>/ns/net`.
pub fn pod_netns(info: &str) -> Option<PathBuf> {
    let info: serde_json::Value = serde_json::from_str(info).ok()?;
    let path = info["Spec"]["linux"]["namespaces"]
        .as_array()?
        .iter()
        .find(|n| n["type"] == "network")?["path"]
        .as_str()?;
    let run_dir = Path::new(crate::real::podnet::NETNS_RUN_DIR);
    // `/var/run` is a link to `/run`.
    let path = path
        .strip_prefix("/var")
        .filter(|p| p.starts_with("/run/"))
        .unwrap_or(path);
    let name = Path::new(path).strip_prefix(run_dir).ok()?.to_str()?;
    (name.starts_with("cni-") && !name.contains('/')).then(|| run_dir.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_s_network_namespace_is_its_cni_file_and_an_app_container_has_none() {
        let info = |path: &str| {
            json_info(serde_json::json!([
                {"type": "pid"},
                {"type": "network", "path": path},
                {"type": "mount"},
            ]))
        };
        assert_eq!(
            pod_netns(&info("/var/run/netns/cni-a1a887ac-d613")),
            Some(PathBuf::from("/run/netns/cni-a1a887ac-d613"))
        );
        assert_eq!(
            pod_netns(&info("/run/netns/cni-b2")),
            Some(PathBuf::from("/run/netns/cni-b2"))
        );
        // An app container joins its sandbox's namespace; nothing else is ours to remove.
        assert_eq!(pod_netns(&info("/proc/4242/ns/net")), None);
        assert_eq!(pod_netns(&info("/var/run/netns/hdhcp-1-0-srv")), None);
        assert_eq!(pod_netns(&info("/var/run/netns/../cni-x")), None);
        assert_eq!(
            pod_netns(&json_info(serde_json::json!([{"type": "network"}]))),
            None
        );
        assert_eq!(pod_netns("not JSON"), None);
    }

    fn json_info(namespaces: serde_json::Value) -> String {
        serde_json::json!({
            "ID": "3da54fcd",
            "Spec": {"ociVersion": "1.0.2-dev", "linux": {"namespaces": namespaces}},
        })
        .to_string()
    }

    #[test]
    fn containerd_config_handles_the_pitfalls() {
        let d = NodeDirs::under(Path::new("/t/n"));
        let c = containerd_config(&d);
        for line in [
            "restrict_oom_score_adj = true",
            "SystemdCgroup = false",
            "disable_apparmor = true",
            "address = \"/t/n/containerd/containerd.sock\"",
            "bin_dir = \"/usr/lib/cni\"",
            "conf_dir = \"/t/n/cni/net.d\"",
        ] {
            assert!(
                c.lines().any(|l| l.trim() == line),
                "missing {line:?} in\n{c}"
            );
        }
        let k = kubelet_config(&d, Path::new("/t/ca.crt"), "10.1.2.3", 10250, 10248);
        for line in [
            "cgroupDriver: cgroupfs",
            "failCgroupV1: false",
            "containerRuntimeEndpoint: unix:///t/n/containerd/containerd.sock",
            "readOnlyPort: 0",
            "syncFrequency: 10s",
            "port: 10250",
            "address: 10.1.2.3",
            "nodefs.available: 1%",
            "podLogsDir: /t/n/pod-logs",
        ] {
            assert!(
                k.lines().any(|l| l.trim() == line),
                "missing {line:?} in\n{k}"
            );
        }
    }

    #[test]
    fn a_missing_node_tool_names_the_script_that_builds_it() {
        let e = need(PathBuf::from("/nonexistent/kubelet"), "kubelet")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("kubelet")
                && e.contains("/nonexistent/kubelet")
                && e.contains("node-tools.sh"),
            "{e}"
        );
    }

    #[test]
    fn sysctls_are_restored() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("kernel")).unwrap();
        std::fs::write(dir.path().join("kernel/panic"), "1\n").unwrap();
        let snap = SysctlSnapshot::save(dir.path(), &["kernel/panic"]).unwrap();
        std::fs::write(dir.path().join("kernel/panic"), "10\n").unwrap();
        assert!(snap.restore().is_empty());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("kernel/panic")).unwrap(),
            "1"
        );
        let e = SysctlSnapshot::save(dir.path(), &["vm/missing"]).unwrap_err();
        assert!(e.to_string().contains("vm/missing"), "{e}");
    }
}
