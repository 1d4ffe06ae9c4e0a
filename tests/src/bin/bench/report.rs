//! The report: progress lines, statistics, table rows and targets, the machine the run was on,
//! and the rendering of `docs/benchmarks.md`.

use super::*;

pub(crate) static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

pub(crate) fn progress(msg: impl AsRef<str>) {
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    println!("[bench {t:6.1}s] {}", msg.as_ref());
}

/// Percentiles by nearest rank over a sample.
#[derive(Clone, Debug)]
pub(crate) struct Stats {
    pub(crate) n: usize,
    pub(crate) p50: Duration,
    pub(crate) p99: Duration,
    pub(crate) max: Duration,
    pub(crate) sum: Duration,
}

impl Stats {
    pub(crate) fn of(mut sample: Vec<Duration>) -> Option<Stats> {
        if sample.is_empty() {
            return None;
        }
        sample.sort();
        let rank = |p: f64| {
            let r = (p / 100.0 * sample.len() as f64).ceil() as usize;
            sample[r.clamp(1, sample.len()) - 1]
        };
        Some(Stats {
            n: sample.len(),
            p50: rank(50.0),
            p99: rank(99.0),
            max: sample[sample.len() - 1],
            sum: sample.iter().sum(),
        })
    }
}

pub(crate) fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 10.0 {
        format!("{s:.1} s")
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.0} ms", s * 1000.0)
    }
}

/// One line of the summary table.
pub(crate) struct Row {
    pub(crate) section: &'static str,
    pub(crate) what: String,
    pub(crate) n: String,
    pub(crate) total: String,
    pub(crate) p50: String,
    pub(crate) p99: String,
    pub(crate) figures: String,
}

impl Row {
    pub(crate) fn failed(
        section: &'static str,
        what: &str,
        n: usize,
        error: &anyhow::Error,
    ) -> Row {
        Row {
            section,
            what: what.to_string(),
            n: n.to_string(),
            total: "**failed**".into(),
            p50: "—".into(),
            p99: "—".into(),
            figures: format!("{error:#}").replace('|', "\\|").replace('\n', " "),
        }
    }
}

pub(crate) struct Target {
    pub(crate) what: String,
    pub(crate) target: String,
    pub(crate) measured: String,
    pub(crate) met: bool,
}

/// Everything the report is made of.
#[derive(Default)]
pub(crate) struct Report {
    pub(crate) rows: Vec<Row>,
    /// Extra sections (markdown) after the table.
    pub(crate) details: Vec<String>,
    /// Issue 18's targets: what, the target, the measured value, met.
    pub(crate) targets: Vec<Target>,
    pub(crate) failures: usize,
}

impl Report {
    /// A failed section becomes a row saying so (the others still run).
    pub(crate) fn record(
        &mut self,
        result: anyhow::Result<()>,
        section: &'static str,
        what: &str,
        n: usize,
    ) {
        if let Err(e) = result {
            progress(format!("  FAILED: {e:#}"));
            self.failures += 1;
            self.rows.push(Row::failed(section, what, n, &e));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The machine and the report

pub(crate) fn machine() -> Vec<(String, String)> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = read("/proc/meminfo");
    let mem = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| format!("{:.1} GiB ({kib} kB)", kib as f64 / 1024.0 / 1024.0))
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "unknown".into());
    vec![
        ("cores (nproc)".into(), cores),
        ("memory (MemTotal)".into(), mem),
        ("CPU".into(), model),
        (
            "kernel".into(),
            read("/proc/sys/kernel/osrelease").trim().to_string(),
        ),
    ]
}

pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown (not a git checkout)".into())
}

pub(crate) struct RunInfo {
    pub(crate) commit: String,
    pub(crate) started: jiff::Timestamp,
    pub(crate) took: Duration,
    pub(crate) load_before: String,
    pub(crate) load_after: String,
    pub(crate) smoke: bool,
    pub(crate) root: bool,
}

pub(crate) fn render(info: &RunInfo, report: &Report) -> String {
    let mut s = String::new();
    s.push_str("# Benchmarks\n\n");
    s.push_str(
        "Generated by `make bench` (`tests/src/bin/bench/`, `tests/benches/ipam.rs`); do not edit by hand.\n\n",
    );
    if info.smoke {
        s.push_str("**Smoke run (`--smoke`): small N, the figures mean nothing.**\n\n");
    }
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(
        s,
        "| commit | `{}` (`git rev-parse --short HEAD`; the working tree is measured as it is, uncommitted changes included) |",
        info.commit
    );
    let _ = writeln!(
        s,
        "| run | {} UTC, {} in total |",
        info.started.strftime("%Y-%m-%d %H:%M"),
        secs(info.took)
    );
    for (k, v) in machine() {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let _ = writeln!(
        s,
        "| load average (1/5/15 min) | {} before, {} after |",
        info.load_before, info.load_after
    );
    s.push_str("| build | release profile (fat LTO, one codegen unit; `make release` links the two programs static-pie), the programs under test run in-process or as the release binaries |\n");
    s.push_str("| test bed | real etcd 3.6.16 and two kube-apiserver 1.34.4 on loopback (`--unsafe-no-fsync`), the Harvester stand-in in the bench process |\n\n");
    s.push_str(
        "**The machine is noisy.** Two shared cores run etcd, both kube-apiservers, the stand-in, the \
         program under test and whatever else the machine is doing (see the load average). Absolute \
         times move by tens of percent between runs; the counts (API requests per object, distinct \
         addresses) are exact, and the ratios (Services/s, KiB per object, allocations/s) are what to \
         compare between commits.\n\n",
    );
    s.push_str("| # | measurement | N | all done in | p50 | p99 | figures |\n|---|---|---|---|---|---|---|\n");
    for r in &report.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.section, r.what, r.n, r.total, r.p50, r.p99, r.figures
        );
    }
    if !info.root {
        s.push_str(
            "\n(3) skipped: the volume round trip needs root (loop devices, mkfs, mount).\n",
        );
    }
    if !report.targets.is_empty() {
        s.push_str("\n## Targets\n\n| target | wanted | measured | met |\n|---|---|---|---|\n");
        for t in &report.targets {
            let _ = writeln!(
                s,
                "| {} | {} | **{}** | {} |",
                t.what,
                t.target,
                t.measured,
                if t.met { "yes" } else { "**no**" }
            );
        }
    }
    s.push_str("\n## How each figure is taken\n\n");
    s.push_str(METHOD);
    s.push('\n');
    for d in &report.details {
        s.push('\n');
        s.push_str(d);
    }
    s
}

pub(crate) const METHOD: &str = "\
1. **LoadBalancer convergence.** A fresh bed, one IPPool of a whole /16 matching every guest \
cluster, the cloud provider in-process (`harvester_cloud_provider::run_with`, every controller, \
default flags, `--cluster-name bench`). N Services of type LoadBalancer are created with 16 create \
requests in flight; a watch in the bench records when each Service first shows \
`status.loadBalancer.ingress`. Latency per Service = address seen − its create request sent; \"all \
done in\" = last address seen − first create sent. API requests are the provider's own \
`harvester_kube_api_requests_total` (guest and Harvester clients, Events included) from just before \
the first create until the counter has been still for 2 s after the last address, divided by N. The \
Harvester side (allocation, IPPool status) is the stand-in's LB controller, which handles one \
LoadBalancer at a time; its time is part of the latency, and the phase tables below separate it \
from the provider's (CR creation and address seen by watches of the bench).
2. **Node initialisation.** A fresh bed, one Harvester host and N running VMs (with VMIs and one \
IP each) created first; then the provider in-process; then N guest Nodes tainted \
`node.cloudprovider.kubernetes.io/uninitialized` created 16 at a time. A Node counts when it has a \
providerID and no uninitialized taint; latency from its create request.
3. **Volumes.** A fresh bed with the stand-in's hot-plug delay set to zero \
(`BedOptions { hotplug_delay: Duration::ZERO, .. }`; the default 200 ms imitates KubeVirt and is \
excluded here), a default StorageClass, one running VM; the CSI driver in-process in `all` mode \
over its unix socket. N volumes of 32 MiB (ext4) go one after another through CreateVolume → \
ControllerPublishVolume (KubeVirt `addvolume` through the real aggregation layer, wait for the VMI's \
volume to be Ready) → NodeStageVolume (find the disk by serial, `blkid`, `mkfs.ext4`, mount) → \
NodePublishVolume (bind mount), a file written, and back: NodeUnpublish → NodeUnstage → \
ControllerUnpublish (`removevolume`, wait until gone) → DeleteVolume. Each RPC is timed at the \
client. The disks are loop devices on sparse files (root). Then, on a fresh bed each, the driver in `controller` mode (in-process, counting its Harvester API requests in its own metrics) with 1 running VM in the namespace, and with 500 (`--smoke`: 20; the others are running VMs with VMIs that hold no volume): N volumes (30; `--smoke`: 2), after one uncounted warm-up volume, are created, published to the one VM, unpublished and deleted one after another; ControllerPublishVolume and ControllerUnpublishVolume are timed at the client and their requests counted from just before to just after each call. The targets compare the largest namespace with the smallest.
4. **Peak memory.** The release binaries as child processes. `harvester-cloud-provider \
--leader-elect=false --metrics-address= --secure-port=0` against a fresh bed: VmHWM 5 s after start (idle), then N \
VMs, their tainted Nodes and the LoadBalancer Services are created, and VmHWM (peak resident set, \
from `/proc/<pid>/status`) is read once every Service has its address and every Node is \
initialised, plus 5 s. `harvester-csi-driver --mode node` for one of the VMs: VmHWM 5 s after its \
socket appears, no RPC served.
5. **IPAM.** `cargo bench -p testbed --bench ipam -- --quick` (criterion, \
`tests/benches/ipam.rs`). One iteration = one `ipam::allocate` for an applicant that holds \
nothing, on a /16 (65 533 allocatable addresses) at 0, 90 and 99 % full, then the entry is removed \
again so every iteration sees the same pool. Layouts: *in order* = filled from the start, \
`lastAllocated` on the last one (a pool that never wrapped: the round robin starts at a free \
address); *scattered* = the free addresses spread evenly, walk from the start; *wrapped* = filled \
from the start with `lastAllocated` back at the start (the walk passes every allocated address). \
The estimates are read from criterion's `estimates.json`.
6. **Scale.** Per level (`--scale SERVICESxNODES,...`; default 100x20, 1000x200, 5000x1000) a fresh bed, the IPPool of section 1, N running VMs made first, then the **release binary** `harvester-cloud-provider --leader-elect=false --metrics-address=127.0.0.1:<port> --secure-port=0` (default flags otherwise) as a child process; its requests are read from its own `/metrics` (`harvester_kube_api_requests_total` by verb and resource). First the N tainted Nodes, 16 creates in flight, until every one is initialised and the request counter has been still for 2 s; then the Services, 16 creates in flight, plus one Service with a malformed annotation (`cloudprovider.harvesterhci.io/ipam: static`), until every other one shows an ingress address and the counter is still again. So each request is counted against the kind of object that caused it. The provider's own steps come from watches of the bench: Service created (its create request answered: from then it exists; the time from the request sent, the API server's create included, is given beside) → its LoadBalancer CR seen, and the stand-in's allocation seen → the Service's ingress seen; the time between (the stand-in, one LoadBalancer at a time, each write carrying the whole IPPool status) is Harvester's and reported apart. Node: created (its create answered; from the request sent beside it) → initialised seen, with the phases the bench's Node watch sees (the Node, its addresses, then initialised). VmHWM and CPU seconds (utime + stime from `/proc/<pid>/stat`, from ready to the end) of the provider process at the end. The malformed Service must get its Warning `SyncLoadBalancerFailed` naming the annotation and no CR, or the level fails.
";
