//! `harvester-csi-driver`: CSI driver passing Harvester volumes through to guest clusters.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use harvester_csi_driver::{Config, Mode};

/// Flags compatible with the upstream harvester-csi-driver where they exist.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "CSI driver passing Harvester storage through to guest clusters"
)]
struct Cli {
    /// CSI endpoint, `unix:///path/csi.sock`.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Node ID: the guest node's name (the hostname); the VM name is discovered from it.
    #[arg(long, env = "NODE_ID")]
    nodeid: Option<String>,
    /// The Harvester cloud-config (kubeconfig; its context namespace holds the guest VMs).
    #[arg(long, default_value = harvester_common::cloud_config::DEFAULT_PATH)]
    kubeconfig: PathBuf,
    /// Harvester StorageClass for new volumes when the guest StorageClass has no `hostStorageClass`.
    #[arg(long, env = "HOST_STORAGE_CLASS")]
    host_storage_class: Option<String>,
    /// Which CSI services to serve (Identity is always served).
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
    /// Where hot-plugged disks appear by id.
    #[arg(long, default_value = "/dev/disk/by-id")]
    disk_by_id_dir: PathBuf,
    /// Volumes a node can take (NodeGetInfo); default: 256 minus the VM's own disks.
    #[arg(long)]
    max_volumes_per_node: Option<u32>,
    /// Debug logging (as upstream's `--debug`).
    #[arg(long, env = "DEBUG")]
    debug: bool,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: harvester_common::telemetry::LogFormat,
}

/// The shutdown signal: SIGTERM (kubelet stopping the pod) or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: stopping"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
            }
        }
        Err(e) => {
            tracing::warn!("cannot watch SIGTERM ({e}); stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let default_filter = if cli.debug { "debug" } else { "info" };
    harvester_common::telemetry::init_logging(cli.log_format, default_filter);
    let mut config = Config::new(cli.endpoint, cli.kubeconfig);
    config.mode = cli.mode;
    config.node_id = cli.nodeid;
    config.host_storage_class = cli.host_storage_class;
    config.disk_by_id_dir = cli.disk_by_id_dir;
    config.max_volumes_per_node = cli.max_volumes_per_node;
    harvester_csi_driver::serve(config, shutdown_signal())
        .await
        .context("harvester-csi-driver")
}
