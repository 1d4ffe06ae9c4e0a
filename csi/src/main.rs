//! `harvester-csi-driver`: CSI driver passing Harvester volumes through to guest clusters.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    Controller,
    Node,
    All,
}

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
    /// Node ID (the guest node name, which is the VM name).
    #[arg(long, env = "NODE_ID")]
    nodeid: Option<String>,
    /// The Harvester cloud-config (kubeconfig).
    #[arg(long, default_value = harvester_common::cloud_config::DEFAULT_PATH)]
    kubeconfig: PathBuf,
    /// Which CSI services to serve.
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    anyhow::bail!(
        "harvester-csi-driver {} (CSI {}): the {:?} services are not built into this version yet \
         (endpoint {}, node {:?}, cloud-config {})",
        env!("CARGO_PKG_VERSION"),
        csi_proto::CSI_SPEC_VERSION,
        cli.mode,
        cli.endpoint,
        cli.nodeid,
        cli.kubeconfig.display()
    )
}
