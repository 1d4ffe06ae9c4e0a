//! `livenessprobe`: serves `/healthz` by calling the CSI driver's `Probe`, like
//! kubernetes-csi/livenessprobe (which the Go module proxy does not serve here). See
//! `testbed::real::livenessprobe`.

use std::process::ExitCode;

use clap::Parser;
use harvester_common::flags::{Syntax, normalize_args};
use harvester_common::telemetry::{LogFormat, init_logging, shutdown_signal};
use testbed::real::livenessprobe::{self, Flags, LivenessError};

#[tokio::main]
async fn main() -> ExitCode {
    let flags = match Flags::try_parse_from(normalize_args(std::env::args_os(), Syntax::GoFlag)) {
        Ok(f) => f,
        Err(e) => e.exit(),
    };
    let level = if flags.verbosity >= 5 {
        "debug"
    } else {
        "info"
    };
    init_logging(LogFormat::Text, level);
    match run(&flags).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("livenessprobe: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(flags: &Flags) -> Result<(), LivenessError> {
    // Flags first, so a bad one is reported without waiting for a driver.
    let addr = livenessprobe::listen_address(flags)?;
    let socket = livenessprobe::socket(flags)?;
    if !flags.metrics_address.is_empty() || !flags.http_endpoint.is_empty() {
        tracing::warn!(path = %flags.metrics_path, "metrics are not served by this livenessprobe");
    }
    tracing::info!(socket = %socket.display(), "calling the CSI driver to discover its name");
    let driver = livenessprobe::driver_name(&socket).await?;
    tracing::info!(%driver, "CSI driver name");
    let listener = livenessprobe::bind(addr).await?;
    tracing::info!(address = %addr, "serving /healthz");
    livenessprobe::serve(listener, socket, flags.probe_timeout, shutdown_signal()).await;
    Ok(())
}
