//! `harvester-cloud-provider`: the cloud controller manager of Kubernetes guest clusters on
//! Harvester HCI.

use std::path::PathBuf;

use clap::Parser;

/// Flags compatible with the upstream harvester-cloud-provider (same names and defaults).
#[derive(Parser, Debug)]
#[command(
    version,
    about = "Cloud controller manager for Kubernetes guest clusters on Harvester HCI"
)]
struct Cli {
    /// The Harvester kubeconfig; its current context's namespace holds the guest VMs.
    #[arg(long, env = "CLOUD_CONFIG", default_value = harvester_common::cloud_config::DEFAULT_PATH)]
    cloud_config: PathBuf,
    /// Kubeconfig of the guest cluster (in-cluster config when unset).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Name of the guest cluster (labels and names of Harvester LoadBalancers).
    #[arg(long, default_value = "kubernetes")]
    cluster_name: String,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    anyhow::bail!(
        "harvester-cloud-provider {}: no controllers are built into this version yet \
         (cloud-config {}, cluster {})",
        env!("CARGO_PKG_VERSION"),
        cli.cloud_config.display(),
        cli.cluster_name
    )
}
