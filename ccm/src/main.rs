//! `harvester-cloud-provider`: the cloud controller manager of Kubernetes guest clusters on
//! Harvester HCI. Flags are parsed and checked here; the controllers are in the library.

use std::process::ExitCode;

use clap::Parser;
use harvester_cloud_provider::config::{Config, Flags};
use harvester_cloud_provider::error::one_line;

fn main() -> ExitCode {
    let flags = Flags::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| Config::log_filter(flags.common.verbosity).into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match start(flags) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("harvester-cloud-provider: {}", one_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn start(flags: Flags) -> anyhow::Result<()> {
    let config = Config::from_flags(flags)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(harvester_cloud_provider::run(config, shutdown_signal()))?;
    Ok(())
}

/// SIGTERM (Kubernetes stopping the pod) or Ctrl-C.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {},
                    _ = tokio::signal::ctrl_c() => {},
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("shutdown requested");
}
