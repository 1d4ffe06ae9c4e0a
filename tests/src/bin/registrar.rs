//! `registrar`: registers a CSI driver with the kubelet, like node-driver-registrar (which the
//! Go module proxy does not serve here). See `testbed::real::registrar`.

use std::process::ExitCode;

use clap::Parser;
use testbed::real::registrar::{self, Flags, RegistrarMode};

#[tokio::main]
async fn main() -> ExitCode {
    let flags = Flags::parse();
    let level = if flags.verbosity >= 4 {
        "debug"
    } else {
        "info"
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()),
        )
        .init();
    match run(&flags).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("registrar: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(flags: &Flags) -> Result<(), registrar::RegistrarError> {
    if flags.mode == RegistrarMode::KubeletRegistrationProbe {
        registrar::probe(flags)?;
        tracing::info!("kubelet plugin registration succeeded");
        return Ok(());
    }
    // Flags first, so a missing --kubelet-registration-path is reported without a driver.
    registrar::probe_file(flags)?;
    let driver = registrar::driver_name(flags).await?;
    let plan = registrar::plan(flags, &driver)?;
    registrar::serve(plan, shutdown()).await
}

/// SIGTERM or SIGINT.
async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        }
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(
                "installing the signal handlers: {e}; stopping only on a failed registration"
            );
            std::future::pending::<()>().await
        }
    }
}
