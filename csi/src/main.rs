//! `harvester-csi-driver`: CSI driver passing Harvester volumes through to guest clusters.

use std::path::PathBuf;
use std::time::Duration;

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
    /// Address of the /healthz, /readyz and /metrics endpoints (`host:port` or `:port`); empty:
    /// not served.
    #[arg(long, default_value = "")]
    metrics_address: String,
    /// Warn this many days before the cloud-config's token expires.
    #[arg(long, default_value_t = 7)]
    token_expiry_warning_days: u16,
    /// Seconds RPCs in flight may take to finish after SIGTERM.
    #[arg(long, default_value_t = 25)]
    shutdown_grace_seconds: u16,
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
    config.metrics_address = harvester_common::telemetry::server::parse_address(
        "--metrics-address",
        &cli.metrics_address,
    )
    .map_err(anyhow::Error::msg)?;
    config.token_expiry_warning =
        Duration::from_secs(u64::from(cli.token_expiry_warning_days) * 86_400);
    config.shutdown_grace = Duration::from_secs(u64::from(cli.shutdown_grace_seconds));
    harvester_csi_driver::serve(config, harvester_common::telemetry::shutdown_signal())
        .await
        .context("harvester-csi-driver")
}
