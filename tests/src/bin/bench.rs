//! `make bench`: the end-to-end figures of the cloud provider and the CSI driver on the test bed
//! (real etcd and kube-apiservers, the Harvester stand-in), the peak memory of both release
//! binaries, and criterion's estimates for `harvester_common::ipam`, written to
//! `docs/benchmarks.md`.
//!
//! A program, not a test: it measures and reports, it does not judge. Each section runs on a
//! fresh bed; a section that fails (or times out) is reported as such in the table and the
//! program exits non-zero after writing the report. Run it through `make bench`, which builds the
//! release binaries next to it and runs the criterion bench first.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::node_client::NodeClient;
use csi_proto::csi::v1::volume_capability::access_mode::Mode;
use csi_proto::csi::v1::volume_capability::{AccessMode, AccessType, MountVolume};
use csi_proto::csi::v1::*;
use futures::{StreamExt, TryStreamExt};
use harvester_cloud_provider::node::patch::UNINITIALIZED_TAINT;
use harvester_cloud_provider::service::plan::LABEL_SERVICE_NAME;
use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_cloud_provider::{Config, Telemetry};
use harvester_common::harvester::LoadBalancer;
use harvester_common::telemetry::Metrics;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Service};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use serde_json::json;
use testbed::sim::GuestVm;
use testbed::util::observe::{Seen, observe, seen_now};
use testbed::util::process::Proc;
use testbed::{BedOptions, TestBed};
use tonic::transport::Channel;

const CLUSTER: &str = "bench";
const HOST: &str = "harvester-1";
/// Concurrent create requests when N objects are created "at once".
const CREATE_CONCURRENCY: usize = 16;

#[derive(Parser, Debug)]
#[command(about = "Benchmarks on the test bed; writes docs/benchmarks.md")]
struct Args {
    /// Where to write the report.
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: PathBuf,
    /// Criterion's output directory (default: `criterion/` in this program's target directory).
    #[arg(long)]
    criterion_dir: Option<PathBuf>,
    /// Small N everywhere: checks the program itself, the figures mean nothing.
    #[arg(long)]
    smoke: bool,
    /// Run only these sections (1 lb, 2 nodes, 3 volumes, 4 memory, 5 ipam, 6 scale); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<u8>,
    /// Levels of the scale section as SERVICESxNODES, each on a fresh bed (default
    /// 100x20,1000x200,5000x1000; with --smoke 20x5).
    #[arg(long, value_delimiter = ',', value_parser = parse_level)]
    scale: Vec<Level>,
    /// Log the programs under test (in-process) and the stand-in to stderr (`RUST_LOG` filter,
    /// default `info`).
    #[arg(long)]
    log: bool,
}

impl Args {
    fn runs(&self, section: u8) -> bool {
        self.only.is_empty() || self.only.contains(&section)
    }
}

fn parse_level(s: &str) -> Result<Level, String> {
    let (services, nodes) = s
        .split_once('x')
        .ok_or_else(|| format!("scale level {s:?}: expected SERVICESxNODES, e.g. 5000x1000"))?;
    let number = |what: &str, v: &str| {
        v.parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("scale level {s:?}: {what} {v:?} is not a positive number"))
    };
    Ok(Level {
        services: number("Services", services)?,
        nodes: number("Nodes", nodes)?,
    })
}

struct Sizes {
    lb: Vec<usize>,
    nodes: usize,
    volumes: usize,
    memory_services: usize,
    memory_nodes: usize,
    scale: Vec<Level>,
}

impl Sizes {
    fn new(smoke: bool) -> Sizes {
        if smoke {
            Sizes {
                lb: vec![10, 20],
                nodes: 10,
                volumes: 3,
                memory_services: 20,
                memory_nodes: 10,
                scale: vec![Level {
                    services: 20,
                    nodes: 5,
                }],
            }
        } else {
            Sizes {
                lb: vec![100, 500],
                nodes: 100,
                volumes: 50,
                memory_services: 500,
                memory_nodes: 100,
                scale: [(100, 20), (1000, 200), (5000, 1000)]
                    .map(|(services, nodes)| Level { services, nodes })
                    .to_vec(),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Progress, statistics, report rows

static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn progress(msg: impl AsRef<str>) {
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    println!("[bench {t:6.1}s] {}", msg.as_ref());
}

/// Percentiles by nearest rank over a sample.
#[derive(Clone, Debug)]
struct Stats {
    n: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
    sum: Duration,
}

impl Stats {
    fn of(mut sample: Vec<Duration>) -> Option<Stats> {
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

fn secs(d: Duration) -> String {
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
struct Row {
    section: &'static str,
    what: String,
    n: String,
    total: String,
    p50: String,
    p99: String,
    figures: String,
}

impl Row {
    fn failed(section: &'static str, what: &str, n: usize, error: &anyhow::Error) -> Row {
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

struct Target {
    what: String,
    target: String,
    measured: String,
    met: bool,
}

/// Everything the report is made of.
#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    /// Extra sections (markdown) after the table.
    details: Vec<String>,
    /// Issue 18's targets: what, the target, the measured value, met.
    targets: Vec<Target>,
    failures: usize,
}

impl Report {
    /// A failed section becomes a row saying so (the others still run).
    fn record(&mut self, result: anyhow::Result<()>, section: &'static str, what: &str, n: usize) {
        if let Err(e) = result {
            progress(format!("  FAILED: {e:#}"));
            self.failures += 1;
            self.rows.push(Row::failed(section, what, n, &e));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kubernetes API request counts from the provider's own metrics

/// `(verb, resource) -> requests` from the OpenMetrics text.
fn api_requests(metrics: &Metrics) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for line in metrics.encode().lines() {
        let Some(rest) = line.strip_prefix("harvester_kube_api_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let v: u64 = value.trim().parse().unwrap_or(0);
        *out.entry((label("verb"), label("resource"))).or_insert(0) += v;
    }
    out
}

fn delta(
    after: &BTreeMap<(String, String), u64>,
    before: &BTreeMap<(String, String), u64>,
) -> BTreeMap<(String, String), u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

fn breakdown_table(
    title: &str,
    per: &str,
    n: usize,
    d: &BTreeMap<(String, String), u64>,
) -> String {
    let total: u64 = d.values().sum();
    let mut rows: Vec<_> = d.iter().collect();
    rows.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let mut s = format!(
        "### {title}\n\n{total} requests for {n} {per}s = **{:.1} per {per}**.\n\n| verb | resource | requests | per {per} |\n|---|---|---|---|\n",
        total as f64 / n as f64
    );
    for ((verb, resource), v) in rows {
        let _ = writeln!(
            s,
            "| {verb} | {resource} | {v} | {:.2} |",
            *v as f64 / n as f64
        );
    }
    s
}

/// Sum and count of a histogram in the OpenMetrics text.
fn histogram_mean(metrics: &Metrics, name: &str) -> Option<(f64, u64)> {
    let text = metrics.encode();
    let value = |suffix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_{suffix} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    let count = value("count")? as u64;
    (count > 0).then(|| (value("sum").unwrap_or(0.0) / count as f64, count))
}

/// Waits until the provider's request counter has not moved for `quiet` (its watches are up).
async fn settle(metrics: &Metrics, quiet: Duration, limit: Duration) {
    let start = Instant::now();
    let mut last = metrics.api_request_total();
    let mut since = Instant::now();
    while start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = metrics.api_request_total();
        if now != last {
            last = now;
            since = Instant::now();
        } else if last > 0 && since.elapsed() >= quiet {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The bed and the provider

async fn bed(hotplug_delay: Option<Duration>) -> anyhow::Result<TestBed> {
    let mut opts = BedOptions::default();
    if let Some(d) = hotplug_delay {
        opts.hotplug_delay = d;
    }
    let bed = TestBed::start(opts).await?;
    Ok(bed)
}

fn provider_args(bed: &TestBed) -> Vec<String> {
    vec![
        "--cloud-config".into(),
        bed.cloud_config.display().to_string(),
        "--kubeconfig".into(),
        bed.guest.kubeconfig.display().to_string(),
        "--cluster-name".into(),
        CLUSTER.into(),
    ]
}

/// The cloud provider running in this process, counting its API requests into `telemetry`.
struct InProcess {
    telemetry: Telemetry,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), harvester_cloud_provider::Error>>,
}

impl InProcess {
    async fn start(bed: &TestBed) -> anyhow::Result<InProcess> {
        let mut argv = vec!["harvester-cloud-provider".to_string()];
        argv.extend(provider_args(bed));
        let config = Config::from_args(argv)?;
        let telemetry = Telemetry::new();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(harvester_cloud_provider::run_with(
            config,
            telemetry.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        // Its lists and watches are up once the request counter stands still.
        settle(
            &telemetry.metrics,
            Duration::from_secs(1),
            Duration::from_secs(20),
        )
        .await;
        if task.is_finished() {
            bail!("the cloud provider ended at start: {:?}", task.await);
        }
        Ok(InProcess {
            telemetry,
            stop: Some(stop),
            task,
        })
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if tokio::time::timeout(Duration::from_secs(20), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

async fn create_pool(bed: &TestBed) -> anyhow::Result<()> {
    bed.sim.create_pool("bench-pool", "10.128.0.0/16").await?;
    Ok(())
}

/// A LoadBalancer Service without NodePorts (kube-vip announces the address itself): the guest
/// API server's NodePort range (30000-32767) holds 2 768 Services, the scale section makes 5 000.
fn lb_service(name: &str) -> anyhow::Result<Service> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"type": "LoadBalancer", "selector": {"app": name},
                 "allocateLoadBalancerNodePorts": false,
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    }))?)
}

fn initialised(node: &Node) -> bool {
    let spec = node.spec.as_ref();
    spec.and_then(|s| s.provider_id.as_ref()).is_some()
        && !spec
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
}

/// Waits until `seen` holds every name in `names`; Err with the count when `limit` passes.
async fn wait_all(
    what: &str,
    seen: &Seen,
    names: &[String],
    limit: Duration,
) -> Result<HashMap<String, (Instant, String)>, String> {
    let start = Instant::now();
    let mut last_print = Instant::now();
    loop {
        let now = seen_now(seen);
        let done = names.iter().filter(|n| now.contains_key(*n)).count();
        if done == names.len() {
            return Ok(now);
        }
        if start.elapsed() > limit {
            return Err(format!(
                "{done} of {} {what} after {}",
                names.len(),
                secs(limit)
            ));
        }
        if last_print.elapsed() > Duration::from_secs(5) {
            progress(format!("  {done}/{} {what}", names.len()));
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `make(i)` for `0..n` with [`CREATE_CONCURRENCY`] in flight; returns name -> send time.
/// The guest Node of each VM in `vms` (tainted, as the kubelet registers it), with the time each
/// create was sent.
async fn create_nodes(bed: &TestBed, vms: &[String]) -> anyhow::Result<HashMap<String, Instant>> {
    create_all(vms.len(), |i| {
        let name = vms[i].clone();
        async move {
            bed.sim
                .create_guest_node(&name)
                .await
                .with_context(|| format!("creating Node {name}"))?;
            Ok(name)
        }
    })
    .await
}

async fn create_all<F, Fut>(n: usize, make: F) -> anyhow::Result<HashMap<String, Instant>>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
{
    let make = &make;
    futures::stream::iter(0..n)
        .map(|i| async move {
            let t = Instant::now();
            make(i).await.map(|name| (name, t))
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_collect()
        .await
}

fn latencies(
    sent: &HashMap<String, Instant>,
    seen: &HashMap<String, (Instant, String)>,
) -> Vec<Duration> {
    sent.iter()
        .filter_map(|(name, t)| seen.get(name).map(|(s, _)| s.saturating_duration_since(*t)))
        .collect()
}

/// `to − from` for every key both saw.
fn between(
    from: &HashMap<String, (Instant, String)>,
    to: &HashMap<String, (Instant, String)>,
) -> Vec<Duration> {
    from.iter()
        .filter_map(|(k, (f, _))| to.get(k).map(|(t, _)| t.saturating_duration_since(*f)))
        .collect()
}

fn service_address(svc: &Service) -> Option<(String, String)> {
    Some((svc.name_any(), ingress_ip(svc)?))
}

fn node_initialised(node: &Node) -> Option<(String, String)> {
    initialised(node).then(|| (node.name_any(), String::new()))
}

/// The Service a CR belongs to (by its labels), once the CR exists.
fn cr_created(lb: &LoadBalancer) -> Option<(String, String)> {
    Some((lb.labels().get(LABEL_SERVICE_NAME)?.clone(), String::new()))
}

/// The Service a CR belongs to, once Harvester (the stand-in) allocated its address.
fn cr_allocated(lb: &LoadBalancer) -> Option<(String, String)> {
    let ip = lb.allocated_ip()?.to_string();
    Some((lb.labels().get(LABEL_SERVICE_NAME)?.clone(), ip))
}

// ---------------------------------------------------------------------------------------------
// 1. LoadBalancer convergence

async fn lb_convergence(n: usize, report: &mut Report) -> anyhow::Result<()> {
    progress(format!("1. LoadBalancer convergence, N = {n}"));
    let bed = bed(None).await?;
    create_pool(&bed).await?;
    let ccm = InProcess::start(&bed).await?;
    let services: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let (seen, watch) = observe(services.clone(), service_address);
    let (cr_seen, cr_watch) = observe(crs.clone(), cr_created);
    let (alloc_seen, alloc_watch) = observe(crs, cr_allocated);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let before = api_requests(&ccm.telemetry.metrics);
    let t0 = Instant::now();
    let sent = create_all(n, |i| {
        let services = services.clone();
        async move {
            let name = format!("bench-lb-{i:04}");
            services
                .create(&PostParams::default(), &lb_service(&name)?)
                .await
                .with_context(|| format!("creating Service {name}"))?;
            Ok(name)
        }
    })
    .await?;
    let created_in = t0.elapsed();
    progress(format!("  {n} Services created in {}", secs(created_in)));
    let names: Vec<String> = sent.keys().cloned().collect();
    let limit = Duration::from_secs(60 + n as u64 / 2);
    let result = wait_all("Services with an address", &seen, &names, limit).await;
    let at_convergence = api_requests(&ccm.telemetry.metrics);
    // Let trailing work (events, the CR's status mirror, the reconcile its own patch causes)
    // finish, so the count is the whole cost of a Service.
    settle(
        &ccm.telemetry.metrics,
        Duration::from_secs(2),
        Duration::from_secs(20),
    )
    .await;
    let after = api_requests(&ccm.telemetry.metrics);
    let address_metric =
        histogram_mean(&ccm.telemetry.metrics, "harvester_service_address_seconds");
    for w in [watch, cr_watch, alloc_watch] {
        w.abort();
    }
    ccm.stop().await;
    let seen = result.map_err(anyhow::Error::msg)?;
    let (cr_seen, alloc_seen) = (seen_now(&cr_seen), seen_now(&alloc_seen));

    let all_in = seen
        .values()
        .map(|(t, _)| t.saturating_duration_since(t0))
        .max()
        .unwrap_or_default();
    let stats = Stats::of(latencies(&sent, &seen)).context("no latencies")?;
    let distinct: HashSet<&String> = seen.values().map(|(_, ip)| ip).collect();
    let d_conv: u64 = delta(&at_convergence, &before).values().sum();
    let d = delta(&after, &before);
    let total: u64 = d.values().sum();
    // Where the time goes: the provider before the CR exists, the stand-in allocating (one
    // LoadBalancer at a time), the provider from the allocation to the Service's address.
    let sent_seen: HashMap<String, (Instant, String)> = sent
        .iter()
        .map(|(k, t)| (k.clone(), (*t, String::new())))
        .collect();
    let phases: [(&str, Vec<Duration>); 4] = [
        (
            "provider: Service created → its LoadBalancer CR exists",
            between(&sent_seen, &cr_seen),
        ),
        (
            "Harvester stand-in: CR exists → address allocated",
            between(&cr_seen, &alloc_seen),
        ),
        (
            "provider: address allocated → Service ingress seen",
            between(&alloc_seen, &seen),
        ),
        (
            "whole: Service created → ingress seen",
            latencies(&sent, &seen),
        ),
    ];
    let mut figures = format!(
        "**{:.1} API requests/Service** ({:.1} when the last address was seen); {:.1} Services/s; {} distinct addresses for {n} Services; the {n} creates took {}",
        total as f64 / n as f64,
        d_conv as f64 / n as f64,
        n as f64 / all_in.as_secs_f64(),
        distinct.len(),
        secs(created_in),
    );
    if let Some((mean, count)) = address_metric {
        let _ = write!(
            figures,
            "; the provider's own `service_address_seconds`: mean {} over {count} (from `creationTimestamp`, whole seconds)",
            secs(Duration::from_secs_f64(mean))
        );
    }
    let p50 = |i: usize| {
        Stats::of(phases[i].1.clone())
            .map(|s| secs(s.p50))
            .unwrap_or_default()
    };
    let _ = write!(
        figures,
        "; per Service (p50) the provider took {} to create the CR and {} from allocation to address, the stand-in {} to allocate (one LoadBalancer at a time)",
        p50(0),
        p50(2),
        p50(1)
    );
    report.rows.push(Row {
        section: "1",
        what: "LoadBalancer Services created at once → ingress address".into(),
        n: n.to_string(),
        total: secs(all_in),
        p50: secs(stats.p50),
        p99: secs(stats.p99),
        figures,
    });

    let mut table = format!(
        "### Where a Service's time goes, N = {n}\n\nEach phase from the watches of the bench (Services in the guest, LoadBalancer CRs in Harvester).\n\n| phase | p50 | p99 | max |\n|---|---|---|---|\n"
    );
    for (what, sample) in &phases {
        if let Some(s) = Stats::of(sample.clone()) {
            let _ = writeln!(
                table,
                "| {what} | {} | {} | {} |",
                secs(s.p50),
                secs(s.p99),
                secs(s.max)
            );
        }
    }
    report.details.push(table);
    report.details.push(breakdown_table(
        &format!("Cloud provider API requests, {n} LoadBalancer Services"),
        "Service",
        n,
        &d,
    ));
    progress(format!(
        "  all {n} addressed in {} (p50 {}, p99 {}), {:.1} requests/Service",
        secs(all_in),
        secs(stats.p50),
        secs(stats.p99),
        total as f64 / n as f64
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Node initialisation

fn vm_ip(i: usize) -> String {
    format!("10.52.{}.{}", i / 200, i % 200 + 10)
}

async fn create_vms(bed: &TestBed, n: usize) -> anyhow::Result<Vec<String>> {
    bed.sim
        .create_host(HOST, Some("region-a"), Some("zone-1"))
        .await?;
    let names = create_all(n, |i| async move {
        let name = format!("bench-node-{i:03}");
        bed.sim
            .create_vm(&GuestVm::new(&name).on_host(HOST).ip(&vm_ip(i)))
            .await
            .with_context(|| format!("creating VM {name}"))?;
        Ok(name)
    })
    .await?;
    let mut names: Vec<String> = names.into_keys().collect();
    names.sort();
    Ok(names)
}

async fn node_initialisation(n: usize, report: &mut Report) -> anyhow::Result<()> {
    progress(format!("2. Node initialisation, N = {n}"));
    let bed = bed(None).await?;
    let vms = create_vms(&bed, n).await?;
    progress(format!("  {n} VMs running"));
    let ccm = InProcess::start(&bed).await?;
    let nodes: Api<Node> = Api::all(bed.guest.client.clone());
    let (seen, watch) = observe(nodes, node_initialised);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let before = api_requests(&ccm.telemetry.metrics);
    let t0 = Instant::now();
    let sent = create_nodes(&bed, &vms).await?;
    let created_in = t0.elapsed();
    let result = wait_all(
        "Nodes initialised",
        &seen,
        &vms,
        Duration::from_secs(60 + n as u64),
    )
    .await;
    settle(
        &ccm.telemetry.metrics,
        Duration::from_secs(2),
        Duration::from_secs(20),
    )
    .await;
    let d = delta(&api_requests(&ccm.telemetry.metrics), &before);
    watch.abort();
    ccm.stop().await;
    let seen = result.map_err(anyhow::Error::msg)?;
    let all_in = seen
        .values()
        .map(|(t, _)| t.saturating_duration_since(t0))
        .max()
        .unwrap_or_default();
    let stats = Stats::of(latencies(&sent, &seen)).context("no latencies")?;
    let total: u64 = d.values().sum();
    report.rows.push(Row {
        section: "2",
        what: "tainted Nodes (VMs running) → initialised (providerID, addresses, zone, taint removed)".into(),
        n: n.to_string(),
        total: secs(all_in),
        p50: secs(stats.p50),
        p99: secs(stats.p99),
        figures: format!(
            "**{:.1} API requests/Node**; {:.0} Nodes/s with `--concurrent-node-syncs=1` (the default); creating took {}",
            total as f64 / n as f64,
            n as f64 / all_in.as_secs_f64(),
            secs(created_in)
        ),
    });
    report.details.push(breakdown_table(
        &format!("Cloud provider API requests, {n} Nodes"),
        "Node",
        n,
        &d,
    ));
    progress(format!(
        "  all {n} initialised in {} (p50 {}, p99 {})",
        secs(all_in),
        secs(stats.p50),
        secs(stats.p99)
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. Volumes

const VOLUME_NODE: &str = "worker-1";
const STEPS: [&str; 8] = [
    "CreateVolume",
    "ControllerPublishVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteVolume",
];

fn mount_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
    }
}

async fn install_default_storage_class(bed: &TestBed) -> anyhow::Result<()> {
    let sc: k8s_openapi::api::storage::v1::StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "harvester-longhorn",
                     "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
        "provisioner": "driver.longhorn.io",
        "allowVolumeExpansion": true,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate"
    }))?;
    Api::<k8s_openapi::api::storage::v1::StorageClass>::all(bed.harvester.client.clone())
        .create(&PostParams::default(), &sc)
        .await?;
    Ok(())
}

/// Waits until the stand-in has bound Harvester PVC `name` (its binder also detaches the loop
/// devices of deleted volumes, one at a time); that wait is the stand-in's, not the driver's.
async fn wait_bound(pvcs: &Api<PersistentVolumeClaim>, name: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    loop {
        let pvc = pvcs.get(name).await?;
        if pvc.status.and_then(|s| s.phase).as_deref() == Some("Bound") {
            return Ok(t.elapsed());
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("PVC {name} not Bound after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One volume up and down; the duration of each step in [`STEPS`] order, and the wait for the
/// stand-in to bind the PVC (between CreateVolume and ControllerPublishVolume, not in either).
async fn volume_round_trip(
    controller: &mut ControllerClient<Channel>,
    node: &mut NodeClient<Channel>,
    pvcs: &Api<PersistentVolumeClaim>,
    dir: &Path,
    i: usize,
) -> anyhow::Result<([Duration; 8], Duration)> {
    let mut took = [Duration::ZERO; 8];
    let name = format!("pvc-bench-{i:03}");
    let staging = dir.join(format!("{name}-staging"));
    let target = dir.join(format!("{name}-target"));
    let t = Instant::now();
    let volume = controller
        .create_volume(CreateVolumeRequest {
            name: name.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 32 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap()],
            ..Default::default()
        })
        .await
        .context("CreateVolume")?
        .into_inner()
        .volume
        .context("CreateVolume returned no volume")?;
    took[0] = t.elapsed();
    let id = volume.volume_id;
    let bound = wait_bound(pvcs, &id).await?;
    let t = Instant::now();
    let ctx = controller
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: id.clone(),
            node_id: VOLUME_NODE.into(),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .context("ControllerPublishVolume")?
        .into_inner()
        .publish_context;
    took[1] = t.elapsed();
    let t = Instant::now();
    node.node_stage_volume(NodeStageVolumeRequest {
        volume_id: id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    })
    .await
    .context("NodeStageVolume")?;
    took[2] = t.elapsed();
    let t = Instant::now();
    node.node_publish_volume(NodePublishVolumeRequest {
        volume_id: id.clone(),
        publish_context: ctx,
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    })
    .await
    .context("NodePublishVolume")?;
    took[3] = t.elapsed();
    std::fs::write(target.join("bench.txt"), name.as_bytes())
        .context("writing into the published volume")?;
    let t = Instant::now();
    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await
    .context("NodeUnpublishVolume")?;
    took[4] = t.elapsed();
    let t = Instant::now();
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .context("NodeUnstageVolume")?;
    took[5] = t.elapsed();
    let t = Instant::now();
    controller
        .controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: VOLUME_NODE.into(),
            ..Default::default()
        })
        .await
        .context("ControllerUnpublishVolume")?;
    took[6] = t.elapsed();
    let t = Instant::now();
    controller
        .delete_volume(DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .context("DeleteVolume")?;
    took[7] = t.elapsed();
    Ok((took, bound))
}

async fn volumes(n: usize, report: &mut Report) -> anyhow::Result<()> {
    progress(format!(
        "3. Volumes, N = {n} (one after another, hot-plug delay 0)"
    ));
    let bed = bed(Some(Duration::ZERO)).await?;
    install_default_storage_class(&bed).await?;
    bed.sim
        .create_host(HOST, Some("region-a"), Some("zone-1"))
        .await?;
    bed.sim
        .create_vm(&GuestVm::new(VOLUME_NODE).on_host(HOST).ip("10.52.0.11"))
        .await?;
    let dir = bed.dir.path().join("bench-csi");
    std::fs::create_dir_all(&dir)?;
    let _sweep = testbed::real::mounts::MountSweeper(dir.clone());
    let socket = dir.join("csi.sock");
    let mut config = harvester_csi_driver::Config::new(
        format!("unix://{}", socket.display()),
        &bed.cloud_config,
    );
    config.node_id = Some(VOLUME_NODE.into());
    config.disk_by_id_dir = bed.sim.by_id_dir(VOLUME_NODE);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(harvester_csi_driver::serve(config, async {
        let _ = stopped.await;
    }));
    wait_for_socket(&socket, || server.is_finished()).await?;
    let channel = harvester_csi_driver::connect(&socket).await?;
    let mut controller = ControllerClient::new(channel.clone());
    let mut node = NodeClient::new(channel);

    let pvcs: Api<PersistentVolumeClaim> =
        Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let mut binding = Vec::new();
    let mut per_step: Vec<Vec<Duration>> = vec![Vec::new(); STEPS.len()];
    let mut round_trips = Vec::new();
    let t0 = Instant::now();
    let mut last_print = Instant::now();
    let mut outcome = Ok(());
    for i in 0..n {
        match volume_round_trip(&mut controller, &mut node, &pvcs, &dir, i).await {
            Ok((took, bound)) => {
                binding.push(bound);
                for (s, d) in took.iter().enumerate() {
                    per_step[s].push(*d);
                }
                round_trips.push(took.iter().sum::<Duration>());
            }
            Err(e) => {
                outcome = Err(e.context(format!("volume {i}")));
                break;
            }
        }
        if last_print.elapsed() > Duration::from_secs(5) {
            progress(format!("  {}/{n} volumes up and down", i + 1));
            last_print = Instant::now();
        }
    }
    let all_in = t0.elapsed();
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), server).await;
    outcome?;

    for (s, sample) in per_step.into_iter().enumerate() {
        let stats = Stats::of(sample).context("no samples")?;
        report.rows.push(Row {
            section: "3",
            what: format!("volume step `{}`", STEPS[s]),
            n: stats.n.to_string(),
            total: "—".into(),
            p50: secs(stats.p50),
            p99: secs(stats.p99),
            figures: format!("max {}", secs(stats.max)),
        });
    }
    let rt = Stats::of(round_trips).context("no round trips")?;
    let mean = rt.sum / rt.n as u32;
    report.rows.push(Row {
        section: "3",
        what: "volume round trip (all 8 steps, 32 MiB ext4, one after another)".into(),
        n: n.to_string(),
        total: secs(all_in),
        p50: secs(rt.p50),
        p99: secs(rt.p99),
        figures: format!(
            "mean {}; {:.2} volumes/s up and down (wall clock, stand-in binding included); stand-in hot-plug delay set to 0 (`BedOptions::hotplug_delay = Duration::ZERO`)",
            secs(mean),
            n as f64 / all_in.as_secs_f64()
        ),
    });
    let b = Stats::of(binding).context("no binding times")?;
    report.rows.push(Row {
        section: "3",
        what: "(not the driver) stand-in binds the Harvester PVC after CreateVolume".into(),
        n: b.n.to_string(),
        total: "—".into(),
        p50: secs(b.p50),
        p99: secs(b.p99),
        figures: format!(
            "max {}; waited for by the bench between CreateVolume and ControllerPublishVolume and kept out of both (the stand-in's binder also detaches the previous volume's loop device)",
            secs(b.max)
        ),
    });
    progress(format!(
        "  {n} volumes up and down in {} (round trip p50 {}, p99 {})",
        secs(all_in),
        secs(rt.p50),
        secs(rt.p99)
    ));
    Ok(())
}

async fn wait_for_socket(socket: &Path, mut died: impl FnMut() -> bool) -> anyhow::Result<()> {
    let start = Instant::now();
    while !socket.exists() {
        if died() {
            bail!("the CSI driver stopped while starting");
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the CSI driver socket {} did not appear", socket.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4. Peak resident memory of the binaries

/// `VmHWM` and `VmRSS` of a process, in KiB.
fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .with_context(|| format!("{name} in /proc/{pid}/status"))
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// The release binaries `cargo build --release --bins` put next to this program.
fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{} is not built: run `cargo build --release --bins` (make bench does)",
            path.display()
        );
    }
    Ok(path)
}

fn binary_size(path: &Path) -> String {
    std::fs::metadata(path)
        .map(|m| mib(m.len() / 1024))
        .unwrap_or_else(|_| "?".into())
}

async fn memory(services: usize, nodes: usize, report: &mut Report) -> anyhow::Result<()> {
    progress(format!(
        "4. Peak memory: the cloud provider binary with {services} Services and {nodes} Nodes, the idle CSI node plugin"
    ));
    let ccm_bin = sibling_binary("harvester-cloud-provider")?;
    let csi_bin = sibling_binary("harvester-csi-driver")?;
    let bed = bed(None).await?;
    create_pool(&bed).await?;
    let log_dir = bed.dir.path();
    let mut cmd = Command::new(&ccm_bin);
    cmd.args(provider_args(&bed)).args([
        "--leader-elect=false",
        "--metrics-address=",
        "--secure-port=0",
    ]);
    let mut ccm = Proc::spawn("harvester-cloud-provider", cmd, log_dir)?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    ccm.check_alive()?;
    let (idle_hwm, idle_rss) = memory_kib(ccm.pid())?;
    progress(format!(
        "  provider idle: VmHWM {}, VmRSS {}",
        mib(idle_hwm),
        mib(idle_rss)
    ));

    let vms = create_vms(&bed, nodes).await?;
    let svc_api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let node_api: Api<Node> = Api::all(bed.guest.client.clone());
    let (svc_seen, svc_watch) = observe(svc_api.clone(), service_address);
    let (node_seen, node_watch) = observe(node_api, node_initialised);
    let node_names = create_all(nodes, |i| {
        let name = vms[i].clone();
        let bed = &bed;
        async move {
            bed.sim.create_guest_node(&name).await?;
            Ok(name)
        }
    })
    .await?;
    let svc_names = create_all(services, |i| {
        let api = svc_api.clone();
        async move {
            let name = format!("bench-lb-{i:04}");
            api.create(&PostParams::default(), &lb_service(&name)?)
                .await?;
            Ok(name)
        }
    })
    .await?;
    let svc_names: Vec<String> = svc_names.into_keys().collect();
    let node_names: Vec<String> = node_names.into_keys().collect();
    let limit = Duration::from_secs(120 + services as u64 / 2);
    let waited = async {
        wait_all("Services with an address", &svc_seen, &svc_names, limit).await?;
        wait_all("Nodes initialised", &node_seen, &node_names, limit).await
    }
    .await;
    svc_watch.abort();
    node_watch.abort();
    ccm.check_alive()?;
    waited.map_err(anyhow::Error::msg)?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (hwm, rss) = memory_kib(ccm.pid())?;
    ccm.stop();
    let objects = (services + nodes) as u64;
    report.rows.push(Row {
        section: "4",
        what: format!(
            "peak RSS of the `harvester-cloud-provider` binary holding {services} LoadBalancer Services and {nodes} Nodes"
        ),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "**VmHWM {}** (VmRSS {} after 5 s quiet); idle after start: VmHWM {} → {:.1} KiB per object held; binary {}",
            mib(hwm),
            mib(rss),
            mib(idle_hwm),
            hwm.saturating_sub(idle_hwm) as f64 / objects as f64,
            binary_size(&ccm_bin)
        ),
    });
    progress(format!(
        "  provider with {services} Services + {nodes} Nodes: VmHWM {}, VmRSS {}",
        mib(hwm),
        mib(rss)
    ));

    // The node plugin of VM bench-node-000, serving nothing.
    let socket = bed.dir.path().join("csi-node.sock");
    let mut cmd = Command::new(&csi_bin);
    cmd.args(["--mode", "node"])
        .arg(format!("--endpoint=unix://{}", socket.display()))
        .arg(format!("--nodeid={}", vms[0]))
        .arg(format!("--kubeconfig={}", bed.cloud_config.display()))
        .arg(format!(
            "--disk-by-id-dir={}",
            bed.sim.by_id_dir(&vms[0]).display()
        ));
    let mut csi = Proc::spawn("harvester-csi-driver-node", cmd, log_dir)?;
    wait_for_socket(&socket, || csi.check_alive().is_err()).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    csi.check_alive()?;
    let (hwm, rss) = memory_kib(csi.pid())?;
    csi.stop();
    report.targets.push(Target {
        what: "CSI node plugin idle VmHWM".into(),
        target: "≤ 8 MiB".into(),
        measured: mib(hwm),
        met: hwm <= 8 * 1024,
    });
    report.rows.push(Row {
        section: "4",
        what: "peak RSS of the idle `harvester-csi-driver --mode node` binary".into(),
        n: "—".into(),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "**VmHWM {}** (VmRSS {}), 5 s after its socket appeared; binary {}",
            mib(hwm),
            mib(rss),
            binary_size(&csi_bin)
        ),
    });
    progress(format!(
        "  idle CSI node plugin: VmHWM {}, VmRSS {}",
        mib(hwm),
        mib(rss)
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. IPAM (criterion)

fn criterion_dir(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(d) = &args.criterion_dir {
        return Ok(d.clone());
    }
    // <target>/release/bench -> <target>/criterion
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(Path::parent)
        .context("no target directory above this program")?;
    Ok(target.join("criterion"))
}

fn ipam(dir: &Path, report: &mut Report) -> anyhow::Result<()> {
    progress(format!(
        "5. IPAM: criterion estimates from {}",
        dir.display()
    ));
    let layouts = [
        ("in_order", "in order"),
        ("scattered", "scattered"),
        ("wrapped", "wrapped (worst case)"),
    ];
    for (layout, how) in layouts {
        let mut empty = None;
        for percent in [0, 90, 99] {
            let file = dir
                .join(format!("ipam_slash16_{layout}"))
                .join(percent.to_string())
                .join("new/estimates.json");
            let text = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "{} (run `cargo bench -p harvester-common --bench ipam` first; make bench does)",
                    file.display()
                )
            })?;
            let age = std::fs::metadata(&file)?
                .modified()?
                .elapsed()
                .unwrap_or_default();
            let v: serde_json::Value = serde_json::from_str(&text)?;
            let ns = |k: &str| v[k]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            let (mean, median) = (ns("mean"), ns("median"));
            let bound = |k: &str| {
                v["mean"]["confidence_interval"][k]
                    .as_f64()
                    .unwrap_or(f64::NAN)
            };
            let stale = if age > Duration::from_secs(3600) {
                format!(" (**stale: {} h old**)", age.as_secs() / 3600)
            } else {
                String::new()
            };
            let ratio = match empty {
                Some(e) if percent > 0 => format!("; **{:.0}×** the empty pool's time", mean / e),
                _ => String::new(),
            };
            empty = empty.or(Some(mean));
            report.rows.push(Row {
                section: "5",
                what: format!("`ipam::allocate`, /16 {percent} % full, {how}"),
                n: "criterion `--quick`".into(),
                total: "—".into(),
                p50: format!("{} (median)", nanos(median)),
                p99: "—".into(),
                figures: format!(
                    "**{} allocations/s**; mean {} (95 % CI {} – {}){ratio}{stale}",
                    per_second(mean),
                    nanos(mean),
                    nanos(bound("lower_bound")),
                    nanos(bound("upper_bound"))
                ),
            });
        }
    }
    Ok(())
}

fn nanos(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

fn per_second(ns: f64) -> String {
    let per = 1e9 / ns;
    if per >= 1e6 {
        format!("{:.1} M", per / 1e6)
    } else if per >= 1e3 {
        format!("{:.0} k", per / 1e3)
    } else {
        format!("{per:.0}")
    }
}

// ---------------------------------------------------------------------------------------------
// The machine and the report

fn machine() -> Vec<(String, String)> {
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

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown (not a git checkout)".into())
}

struct RunInfo {
    commit: String,
    started: jiff::Timestamp,
    took: Duration,
    load_before: String,
    load_after: String,
    smoke: bool,
    root: bool,
}

fn render(info: &RunInfo, report: &Report) -> String {
    let mut s = String::new();
    s.push_str("# Benchmarks\n\n");
    s.push_str(
        "Generated by `make bench` (`tests/src/bin/bench.rs`, `common/benches/ipam.rs`); do not edit by hand.\n\n",
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
    s.push_str("| build | release profile (`cargo build --release`), the programs under test run in-process or as the release binaries |\n");
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

const METHOD: &str = "\
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
client. The disks are loop devices on sparse files (root).
4. **Peak memory.** The release binaries as child processes. `harvester-cloud-provider \
--leader-elect=false --metrics-address= --secure-port=0` against a fresh bed: VmHWM 5 s after start (idle), then N \
VMs, their tainted Nodes and the LoadBalancer Services are created, and VmHWM (peak resident set, \
from `/proc/<pid>/status`) is read once every Service has its address and every Node is \
initialised, plus 5 s. `harvester-csi-driver --mode node` for one of the VMs: VmHWM 5 s after its \
socket appears, no RPC served.
5. **IPAM.** `cargo bench -p harvester-common --bench ipam -- --quick` (criterion, \
`common/benches/ipam.rs`). One iteration = one `ipam::allocate` for an applicant that holds \
nothing, on a /16 (65 533 allocatable addresses) at 0, 90 and 99 % full, then the entry is removed \
again so every iteration sees the same pool. Layouts: *in order* = filled from the start, \
`lastAllocated` on the last one (a pool that never wrapped: the round robin starts at a free \
address); *scattered* = the free addresses spread evenly, walk from the start; *wrapped* = filled \
from the start with `lastAllocated` back at the start (the walk passes every allocated address). \
The estimates are read from criterion's `estimates.json`.
6. **Scale.** Per level (`--scale SERVICESxNODES,...`; default 100x20, 1000x200, 5000x1000) a fresh bed, the IPPool of section 1, N running VMs made first, then the **release binary** `harvester-cloud-provider --leader-elect=false --metrics-address=127.0.0.1:<port> --secure-port=0` (default flags otherwise) as a child process; its requests are read from its own `/metrics` (`harvester_kube_api_requests_total` by verb and resource). First the N tainted Nodes, 16 creates in flight, until every one is initialised and the request counter has been still for 2 s; then the Services, 16 creates in flight, plus one Service with a malformed annotation (`cloudprovider.harvesterhci.io/ipam: static`), until every other one shows an ingress address and the counter is still again. So each request is counted against the kind of object that caused it. The provider's own steps come from watches of the bench: Service create request sent → its LoadBalancer CR seen, and the stand-in's allocation seen → the Service's ingress seen; the time between (the stand-in, one LoadBalancer at a time, each write carrying the whole IPPool status) is Harvester's and reported apart. Node: create request sent → initialised seen. VmHWM and CPU seconds (utime + stime from `/proc/<pid>/stat`, from ready to the end) of the provider process at the end. The malformed Service must get its Warning `SyncLoadBalancerFailed` naming the annotation and no CR, or the level fails.
";

// ---------------------------------------------------------------------------------------------

fn main() -> anyhow::Result<std::process::ExitCode> {
    let args = Args::parse();
    START.get_or_init(Instant::now);
    let mut sizes = Sizes::new(args.smoke);
    if !args.scale.is_empty() {
        sizes.scale = args.scale.clone();
    }
    let started = jiff::Timestamp::now();
    let load_before = load_average();
    let root = testbed::sim::storage::is_root();
    let runtime = tokio::runtime::Runtime::new()?;
    let mut report = Report::default();

    if args.log {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .with_writer(std::io::stderr)
            .init();
    }
    runtime.block_on(async {
        for &n in sizes.lb.iter().filter(|_| args.runs(1)) {
            let r = lb_convergence(n, &mut report).await;
            report.record(
                r,
                "1",
                "LoadBalancer Services created at once → ingress address",
                n,
            );
        }
        if args.runs(2) {
            let r = node_initialisation(sizes.nodes, &mut report).await;
            report.record(r, "2", "tainted Nodes → initialised", sizes.nodes);
        }
        if args.runs(3) && root {
            let r = volumes(sizes.volumes, &mut report).await;
            report.record(r, "3", "volume round trip", sizes.volumes);
        } else if args.runs(3) {
            progress("3. Volumes: skipped, not root (loop devices, mkfs, mount)");
            report.rows.push(Row {
                section: "3",
                what: "volume round trip".into(),
                n: sizes.volumes.to_string(),
                total: "**skipped**".into(),
                p50: "—".into(),
                p99: "—".into(),
                figures: "not run as root: loop devices, mkfs and mount need root".into(),
            });
        }
        if args.runs(4) {
            let r = memory(sizes.memory_services, sizes.memory_nodes, &mut report).await;
            report.record(r, "4", "peak RSS of the binaries", sizes.memory_services);
        }
        if args.runs(6) {
            let mut levels = Vec::new();
            for &level in &sizes.scale {
                match scale(level, &mut report).await {
                    Ok(l) => levels.push(l),
                    Err(e) => report.record(Err(e), "6", "scale", level.services),
                }
            }
            if let Some(largest) = levels.iter().max_by_key(|l| l.level.services) {
                report.targets.extend(scale_targets(largest));
                report.details.push(growth_table(&levels));
            }
        }
    });
    drop(runtime);
    if args.runs(5) {
        let r = criterion_dir(&args).and_then(|dir| ipam(&dir, &mut report));
        report.record(r, "5", "ipam::allocate (criterion)", 0);
    }

    let info = RunInfo {
        commit: commit(),
        started,
        took: START.get_or_init(Instant::now).elapsed(),
        load_before,
        load_after: load_average(),
        smoke: args.smoke,
        root,
    };
    let text = render(&info, &report);
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent).ok();
    }
    std::fs::write(&args.out, &text).with_context(|| format!("writing {}", args.out.display()))?;
    println!("\n{text}");
    progress(format!(
        "wrote {} ({} failed section(s))",
        args.out.display(),
        report.failures
    ));
    if report.failures > 0 {
        eprintln!(
            "bench: {} section(s) failed; see {}",
            report.failures,
            args.out.display()
        );
        return Ok(std::process::ExitCode::FAILURE);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

// ---------------------------------------------------------------------------------------------
// 6. Scale: many Services and Nodes on one bed, the release binary of the provider

/// One scale level: this many LoadBalancer Services and tainted Nodes on one fresh bed.
#[derive(Clone, Copy, Debug)]
struct Level {
    services: usize,
    nodes: usize,
}

/// The figures of one level, for its rows and the growth table.
struct Scaled {
    level: Level,
    svc_to_cr: Stats,
    alloc_to_address: Stats,
    standin: Option<Stats>,
    node_init: Stats,
    per_service: f64,
    per_node: f64,
    hwm_kib: u64,
    cpu_s: f64,
}

/// The Service with a malformed annotation among the others.
const BAD_SERVICE: &str = "bench-bad-annotation";

/// `(verb, resource) -> requests` scraped from a provider process's `/metrics`.
async fn scraped_requests(port: u16) -> anyhow::Result<BTreeMap<(String, String), u64>> {
    let (code, body) = testbed::util::scrape::get(port, "/metrics")
        .await
        .map_err(anyhow::Error::msg)?;
    if code != 200 {
        bail!("/metrics answered {code}");
    }
    let samples = testbed::util::scrape::parse(&body).map_err(anyhow::Error::msg)?;
    let mut out = BTreeMap::new();
    for s in samples
        .iter()
        .filter(|s| s.name == "harvester_kube_api_requests_total")
    {
        let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
        *out.entry((label("verb"), label("resource"))).or_insert(0) += s.value as u64;
    }
    Ok(out)
}

/// Reconciles and their mean duration per controller, from a provider process's `/metrics`:
/// how much of a latency is the provider's own work (its API round trips included) and how much
/// is waiting (watch delivery, queue).
async fn reconcile_figures(port: u16) -> anyhow::Result<String> {
    let (_, body) = testbed::util::scrape::get(port, "/metrics")
        .await
        .map_err(anyhow::Error::msg)?;
    let samples = testbed::util::scrape::parse(&body).map_err(anyhow::Error::msg)?;
    let mut per: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for s in &samples {
        let Some(c) = s.labels.get("controller") else {
            continue;
        };
        let e = per.entry(c.clone()).or_default();
        match s.name.as_str() {
            "harvester_reconcile_duration_seconds_sum" => e.0 += s.value,
            "harvester_reconcile_duration_seconds_count" => e.1 += s.value,
            _ => {}
        }
    }
    Ok(per
        .iter()
        .filter(|(_, (_, n))| *n > 0.0)
        .map(|(c, (sum, n))| format!("{c} {n:.0} × {}", secs(Duration::from_secs_f64(sum / n))))
        .collect::<Vec<_>>()
        .join(", "))
}

/// Waits until the process's request counter has not moved for `quiet` (at most `limit`).
async fn settle_scraped(port: u16, quiet: Duration, limit: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut last: u64 = scraped_requests(port).await?.values().sum();
    let mut since = Instant::now();
    while start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now: u64 = scraped_requests(port).await?.values().sum();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            return Ok(());
        }
    }
    Ok(())
}

/// User + system CPU time of a process, from `/proc/<pid>/stat` (fields 14 and 15, clock ticks).
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count from the closing parenthesis.
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("no ')' in /proc/<pid>/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': field 3 is index 0, so utime (14) is 11 and stime (15) is 12.
    let tick = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("field {} of /proc/{pid}/stat", i + 3))
    };
    // The kernel reports these in USER_HZ, which is 100 on x86_64 and aarch64.
    Ok((tick(11)? + tick(12)?) as f64 / 100.0)
}

fn stats_cell(s: &Stats) -> String {
    format!("{} / {} / {}", secs(s.p50), secs(s.p99), secs(s.max))
}

async fn scale(level: Level, report: &mut Report) -> anyhow::Result<Scaled> {
    let Level { services, nodes } = level;
    progress(format!(
        "6. Scale: {services} LoadBalancer Services and {nodes} tainted Nodes on one bed"
    ));
    let ccm_bin = sibling_binary("harvester-cloud-provider")?;
    let bed = bed(None).await?;
    create_pool(&bed).await?;
    let vms = create_vms(&bed, nodes).await?;
    progress(format!("  {nodes} VMs running"));
    let port = testbed::util::process::free_port()?;
    let mut cmd = Command::new(&ccm_bin);
    cmd.args(provider_args(&bed)).args([
        "--leader-elect=false".to_string(),
        format!("--metrics-address=127.0.0.1:{port}"),
        "--secure-port=0".to_string(),
    ]);
    let mut ccm = Proc::spawn("harvester-cloud-provider", cmd, bed.dir.path())?;
    testbed::util::scrape::wait_for_200(port, "/readyz", Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("the provider did not get ready: {e}"))?;
    settle_scraped(port, Duration::from_secs(1), Duration::from_secs(20)).await?;
    ccm.check_alive()?;
    let cpu_start = cpu_seconds(ccm.pid())?;

    // Nodes first, on their own, so each request is counted against the right kind of object.
    let (node_seen, node_watch) =
        observe(Api::<Node>::all(bed.guest.client.clone()), node_initialised);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = scraped_requests(port).await?;
    let node_sent = create_nodes(&bed, &vms).await?;
    let node_result = wait_all(
        "Nodes initialised",
        &node_seen,
        &vms,
        Duration::from_secs(60 + nodes as u64 / 2),
    )
    .await;
    settle_scraped(port, Duration::from_secs(2), Duration::from_secs(30)).await?;
    let after_nodes = scraped_requests(port).await?;
    node_watch.abort();
    let node_seen = node_result.map_err(anyhow::Error::msg)?;
    let node_req = delta(&after_nodes, &before);
    let node_init = Stats::of(latencies(&node_sent, &node_seen)).context("no Node latencies")?;
    progress(format!(
        "  {nodes} Nodes initialised: p50 {}, p99 {}",
        secs(node_init.p50),
        secs(node_init.p99)
    ));

    // Then the Services, 16 creates in flight, one of them with a malformed annotation.
    let svc_api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let (seen, watch) = observe(svc_api.clone(), service_address);
    let (cr_seen, cr_watch) = observe(crs.clone(), cr_created);
    let (alloc_seen, alloc_watch) = observe(crs, cr_allocated);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    let sent = create_all(services, |i| {
        let api = svc_api.clone();
        async move {
            let name = format!("bench-lb-{i:05}");
            api.create(&PostParams::default(), &lb_service(&name)?)
                .await
                .with_context(|| format!("creating Service {name}"))?;
            Ok(name)
        }
    })
    .await?;
    let mut bad = lb_service(BAD_SERVICE)?;
    bad.annotations_mut()
        .insert("cloudprovider.harvesterhci.io/ipam".into(), "static".into());
    svc_api
        .create(&PostParams::default(), &bad)
        .await
        .context("creating the Service with a malformed annotation")?;
    progress(format!(
        "  {services} Services created in {}",
        secs(t0.elapsed())
    ));
    let names: Vec<String> = sent.keys().cloned().collect();
    // The stand-in allocates one LoadBalancer at a time, each write carrying the whole IPPool
    // status: the limit grows with N.
    let limit = Duration::from_secs(120 + services as u64 * 3 / 5);
    let result = wait_all("Services with an address", &seen, &names, limit).await;
    settle_scraped(port, Duration::from_secs(2), Duration::from_secs(60)).await?;
    let after = scraped_requests(port).await?;
    for w in [watch, cr_watch, alloc_watch] {
        w.abort();
    }
    ccm.check_alive()?;
    let cpu_s = cpu_seconds(ccm.pid())? - cpu_start;
    let reconciles = reconcile_figures(port).await?;
    let (hwm_kib, rss_kib) = memory_kib(ccm.pid())?;
    let seen = result.map_err(anyhow::Error::msg)?;
    let bad_note = bad_annotation_event(&bed).await?;
    let bad_has_cr = seen_now(&cr_seen).contains_key(BAD_SERVICE);
    ccm.stop();
    if bad_has_cr {
        bail!("{BAD_SERVICE} got a LoadBalancer CR from a malformed annotation");
    }
    let (cr_seen, alloc_seen) = (seen_now(&cr_seen), seen_now(&alloc_seen));
    let sent_seen: HashMap<String, (Instant, String)> = sent
        .iter()
        .map(|(k, t)| (k.clone(), (*t, String::new())))
        .collect();
    let svc_to_cr = Stats::of(between(&sent_seen, &cr_seen)).context("no CR latencies")?;
    let alloc_to_address =
        Stats::of(between(&alloc_seen, &seen)).context("no address latencies")?;
    let standin = Stats::of(between(&cr_seen, &alloc_seen));
    let whole = Stats::of(latencies(&sent, &seen)).context("no latencies")?;
    let svc_req = delta(&after, &after_nodes);
    let per = |d: &BTreeMap<(String, String), u64>, n: usize| {
        d.values().sum::<u64>() as f64 / n.max(1) as f64
    };
    let (per_service, per_node) = (per(&svc_req, services), per(&node_req, nodes));
    let all_in = seen
        .values()
        .map(|(t, _)| t.saturating_duration_since(t0))
        .max()
        .unwrap_or_default();
    report.rows.push(Row {
        section: "6",
        what: "scale: provider's own step Service created → its LoadBalancer CR exists".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: secs(svc_to_cr.p50),
        p99: secs(svc_to_cr.p99),
        figures: format!(
            "max {}; **{per_service:.1} API requests/Service**; all {services} addressed {} after the first create (the stand-in allocates one at a time: p50 {} from CR to address); whole Service created → ingress p50 {}, p99 {}",
            secs(svc_to_cr.max),
            secs(all_in),
            standin.as_ref().map(|s| secs(s.p50)).unwrap_or_default(),
            secs(whole.p50),
            secs(whole.p99)
        ),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: provider's own step CR allocated → Service ingress seen".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: secs(alloc_to_address.p50),
        p99: secs(alloc_to_address.p99),
        figures: format!("max {}", secs(alloc_to_address.max)),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: Node tainted → initialised".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: secs(node_init.p50),
        p99: secs(node_init.p99),
        figures: format!(
            "max {}; **{per_node:.1} API requests/Node**",
            secs(node_init.max)
        ),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: the `harvester-cloud-provider` release binary holding them".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "**VmHWM {}** (VmRSS {}); **{cpu_s:.1} CPU seconds** (user + system) from ready to the last Service settled; reconciles (count × mean duration, API round trips included): {reconciles}",
            mib(hwm_kib),
            mib(rss_kib)
        ),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: one Service with a malformed annotation among them".into(),
        n: "1".into(),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "Warning `SyncLoadBalancerFailed`: {}; no CR; the other {services} all addressed",
            bad_note.replace('|', "\\|")
        ),
    });
    report.details.push(breakdown_table(
        &format!("Scale: cloud provider API requests, {services} LoadBalancer Services (with {nodes} Nodes held)"),
        "Service",
        services,
        &svc_req,
    ));
    report.details.push(breakdown_table(
        &format!("Scale: cloud provider API requests, {nodes} Nodes"),
        "Node",
        nodes,
        &node_req,
    ));
    progress(format!(
        "  {services} Services: CR p99 {}, address p99 {}, {per_service:.1} req/Service, {per_node:.1} req/Node, VmHWM {}, {cpu_s:.1} CPU s",
        secs(svc_to_cr.p99),
        secs(alloc_to_address.p99),
        mib(hwm_kib)
    ));
    Ok(Scaled {
        level,
        svc_to_cr,
        alloc_to_address,
        standin,
        node_init,
        per_service,
        per_node,
        hwm_kib,
        cpu_s,
    })
}

/// The note of the Warning Event on [`BAD_SERVICE`] that names the malformed annotation.
async fn bad_annotation_event(bed: &TestBed) -> anyhow::Result<String> {
    let api: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(bed.guest.client.clone(), "default");
    let start = Instant::now();
    loop {
        let events = api
            .list(
                &kube::api::ListParams::default().fields(&format!("regarding.name={BAD_SERVICE}")),
            )
            .await?;
        if let Some(note) = events.items.iter().find_map(|e| {
            (e.type_.as_deref() == Some("Warning")
                && e.reason.as_deref() == Some("SyncLoadBalancerFailed"))
            .then(|| e.note.clone().unwrap_or_default())
            .filter(|n| n.contains("cloudprovider.harvesterhci.io/ipam") && n.contains("static"))
        }) {
            return Ok(note);
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!(
                "no Warning SyncLoadBalancerFailed naming the annotation on {BAD_SERVICE}; its events: {:?}",
                events
                    .items
                    .iter()
                    .map(|e| (e.reason.clone(), e.note.clone()))
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Issue 18's targets for the provider, measured at the largest level.
fn scale_targets(l: &Scaled) -> Vec<Target> {
    let at = format!("{} Services + {} Nodes", l.level.services, l.level.nodes);
    let limit = Duration::from_millis(50);
    let p99 = |what: &str, s: &Stats| Target {
        what: format!("provider's own step p99, {what} ({at})"),
        target: "≤ 50 ms".into(),
        measured: secs(s.p99),
        met: s.p99 <= limit,
    };
    vec![
        p99("Service created → its LoadBalancer CR", &l.svc_to_cr),
        p99("CR allocated → Service address", &l.alloc_to_address),
        p99("Node tainted → initialised", &l.node_init),
        Target {
            what: format!("API requests per Service ({at})"),
            target: "≤ 5".into(),
            measured: format!("{:.2}", l.per_service),
            met: l.per_service <= 5.0,
        },
        Target {
            what: format!("API requests per Node ({at})"),
            target: "≤ 3".into(),
            measured: format!("{:.2}", l.per_node),
            met: l.per_node <= 3.0,
        },
        Target {
            what: format!("provider VmHWM ({at})"),
            target: "≤ 24 MiB".into(),
            measured: mib(l.hwm_kib),
            met: l.hwm_kib <= 24 * 1024,
        },
    ]
}

/// How each figure grows from the first level to the others.
fn growth_table(levels: &[Scaled]) -> String {
    let Some(first) = levels.first() else {
        return String::new();
    };
    let mut s = String::from(
        "### Scale: how the figures grow\n\nEach level on a fresh bed; the provider's own steps as p50 / p99 / max; ratios to the first level in brackets.\n\n| Services + Nodes | Service → CR | CR allocated → address | Node tainted → initialised | stand-in CR → allocated (p50) | requests/Service | requests/Node | VmHWM | CPU seconds |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            format!(" ({:.1}×)", a / b)
        } else {
            String::new()
        }
    };
    for l in levels {
        let _ = writeln!(
            s,
            "| {} + {} | {}{} | {}{} | {}{} | {} | {:.2} | {:.2} | {}{} | {:.1}{} |",
            l.level.services,
            l.level.nodes,
            stats_cell(&l.svc_to_cr),
            ratio(
                l.svc_to_cr.p99.as_secs_f64(),
                first.svc_to_cr.p99.as_secs_f64()
            ),
            stats_cell(&l.alloc_to_address),
            ratio(
                l.alloc_to_address.p99.as_secs_f64(),
                first.alloc_to_address.p99.as_secs_f64()
            ),
            stats_cell(&l.node_init),
            ratio(
                l.node_init.p99.as_secs_f64(),
                first.node_init.p99.as_secs_f64()
            ),
            l.standin.as_ref().map(|s| secs(s.p50)).unwrap_or_default(),
            l.per_service,
            l.per_node,
            mib(l.hwm_kib),
            ratio(l.hwm_kib as f64, first.hwm_kib as f64),
            l.cpu_s,
            ratio(l.cpu_s, first.cpu_s),
        );
    }
    s.push_str("\n(The ratio in a latency column is that of the p99.)\n");
    s
}
