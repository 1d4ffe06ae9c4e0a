//! `make bench`: the end-to-end figures of the cloud provider and the CSI driver on the test bed
//! (real etcd and kube-apiservers, the Harvester stand-in), the peak memory of both release
//! binaries, and criterion's estimates for `testbed::sim::ipam`, written to
//! `docs/benchmarks.md`.
//!
//! A program, not a test: it measures and reports, it does not judge. Each section runs on a
//! fresh bed; a section that fails (or times out) is reported as such in the table and the
//! program exits non-zero after writing the report. Run it through `make bench`, which builds the
//! release binaries next to it and runs the criterion bench first.
//!
//! One file per section ([`lb`], [`nodes`], [`volumes`], [`memory`], [`ipam`], [`scale`]), each
//! writing its rows into the one [`report::Report`]; [`provider`] holds the bed and the provider
//! under measurement that the sections share. This file holds the flags and the run.

mod ipam;
mod lb;
mod memory;
mod nodes;
mod provider;
mod report;
mod scale;
mod volumes;

use ipam::*;
use lb::*;
use memory::*;
use nodes::*;
use provider::*;
use report::*;
use scale::*;
use volumes::*;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::node_client::NodeClient;
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
use testbed::util::observe::{Seen, observe, observe_each, seen_now};
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
            let (others, n) = if args.smoke { (19, 2) } else { (499, 30) };
            let mut costs = Vec::new();
            for others in [0, others] {
                match publish_in_namespace(others, n).await {
                    Ok(c) => costs.push(c),
                    Err(e) => report.record(Err(e), "3", "publish in a namespace of VMs", n),
                }
            }
            let r = namespace_rows(&costs, &mut report);
            report.record(r, "3", "publish in a namespace of VMs", n);
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
            if !levels.is_empty() {
                report.targets.extend(scale_targets(&levels));
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
