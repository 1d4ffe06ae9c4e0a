//! The bed's livenessprobe: what kubernetes-csi/livenessprobe does (the Go module proxy does not
//! serve it here), for the `liveness-probe` containers of the CSI driver chart on the real node.
//!
//! Behaviour and flags follow kubernetes-csi/livenessprobe `cmd/livenessprobe/main.go` (commit
//! f3b0982dcec9e3293a7549c25d7266ca028fac01) and csi-lib-utils `rpc/common.go` (commit
//! 26e98549befef91996ca8c80f1d676c8cc48bb41):
//! - flags `--csi-address` (default `/run/csi/socket`), `--probe-timeout` (Go duration, default
//!   1s), `--http-endpoint` (default empty), `--health-port` (deprecated, default 9808),
//!   `--metrics-address` (deprecated), `--metrics-path`, klog's `--v`; `--health-port` other than
//!   9808 or `--metrics-address` together with `--http-endpoint` is an error; without
//!   `--http-endpoint` it listens on `0.0.0.0:<health-port>`;
//! - at start it waits (for ever) for the driver's socket and asks `GetPluginInfo` for the
//!   driver's name; an error or an empty name ends the process with status 1;
//! - `GET /healthz` dials the socket and calls `Probe` within `--probe-timeout`: 200 `ok` when the
//!   driver is ready (a missing `ready` counts as ready), else 500 with the error, or `driver
//!   responded but is not ready`.
//!
//! Not served: the Prometheus metrics of csi-lib-utils (`--metrics-address` and `--metrics-path`
//! are accepted and checked, and a warning says no metrics are served).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_proto::csi::v1::identity_client::IdentityClient;
use csi_proto::csi::v1::{GetPluginInfoRequest, ProbeRequest};
use harvester_common::telemetry::server::{serve_with, text};
use http::StatusCode;

/// Upstream's `defaultHealthzPort`.
pub const DEFAULT_HEALTH_PORT: &str = "9808";
/// What `/healthz` answers when `Probe` says the driver is not ready (upstream's text).
pub const NOT_READY: &str = "driver responded but is not ready";
const PLAIN: &str = "text/plain; charset=utf-8";

#[derive(Debug, clap::Parser)]
#[command(
    name = "livenessprobe",
    version,
    about = "Serves /healthz by calling the CSI driver's Probe, like kubernetes-csi/livenessprobe"
)]
pub struct Flags {
    /// Address of the CSI driver socket (a path or unix:// URL).
    #[arg(long, default_value = "/run/csi/socket")]
    pub csi_address: String,
    /// Timeout of one Probe (Go duration: 1s, 500ms, 2m).
    #[arg(long, default_value = "1s", value_parser = harvester_common::flags::parse_go_duration)]
    pub probe_timeout: Duration,
    /// (deprecated) TCP port of /healthz on 0.0.0.0; not together with --http-endpoint.
    #[arg(long)]
    pub health_port: Option<String>,
    /// (deprecated) Address of a separate metrics endpoint; accepted, no metrics are served.
    #[arg(long, default_value = "")]
    pub metrics_address: String,
    /// host:port (or :port) of the HTTP server for /healthz.
    #[arg(long, default_value = "")]
    pub http_endpoint: String,
    /// Path of the metrics (accepted; no metrics are served).
    #[arg(long, default_value = "/metrics")]
    pub metrics_path: String,
    /// Log verbosity as klog's -v: 5 and above log each probe.
    #[arg(long = "v", default_value_t = 0)]
    pub verbosity: u8,
}

#[derive(Debug, thiserror::Error)]
pub enum LivenessError {
    #[error("only one of `--health-port` and `--http-endpoint` can be explicitly set")]
    HealthPortAndEndpoint,
    #[error("only one of `--metrics-address` and `--http-endpoint` can be explicitly set")]
    MetricsAddressAndEndpoint,
    #[error("{0}")]
    Address(String),
    #[error("--csi-address {address:?}: {reason}")]
    CsiAddress { address: String, reason: String },
    #[error("getting the CSI driver's name from {address:?}: {reason}")]
    DriverName { address: String, reason: String },
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Where `/healthz` listens, from the flags, with upstream's checks.
pub fn listen_address(flags: &Flags) -> Result<SocketAddr, LivenessError> {
    let port = flags.health_port.as_deref().unwrap_or(DEFAULT_HEALTH_PORT);
    if port != DEFAULT_HEALTH_PORT && !flags.http_endpoint.is_empty() {
        return Err(LivenessError::HealthPortAndEndpoint);
    }
    if !flags.metrics_address.is_empty() && !flags.http_endpoint.is_empty() {
        return Err(LivenessError::MetricsAddressAndEndpoint);
    }
    let (flag, raw) = if flags.http_endpoint.is_empty() {
        ("--health-port", format!("0.0.0.0:{port}"))
    } else {
        ("--http-endpoint", flags.http_endpoint.clone())
    };
    harvester_common::telemetry::server::parse_address(flag, &raw)
        .map_err(LivenessError::Address)?
        .ok_or_else(|| LivenessError::Address(format!("{flag} is empty")))
}

/// The driver socket named by `--csi-address`.
pub fn socket(flags: &Flags) -> Result<PathBuf, LivenessError> {
    harvester_csi_driver::socket_path(&flags.csi_address).map_err(|e| LivenessError::CsiAddress {
        address: flags.csi_address.clone(),
        reason: e.to_string(),
    })
}

/// A gRPC error as Go's `status.Error` prints it, which upstream writes into the response.
fn grpc_error(s: &tonic::Status) -> String {
    format!("rpc error: code = {:?} desc = {}", s.code(), s.message())
}

/// Waits until the driver's socket accepts a connection (retrying every second, for ever, as
/// upstream's `connlib.Connect(..., WithTimeout(0))`), then asks for the driver's name.
pub async fn driver_name(socket: &Path) -> Result<String, LivenessError> {
    let failed = |reason: String| LivenessError::DriverName {
        address: socket.display().to_string(),
        reason,
    };
    let channel = loop {
        match harvester_csi_driver::connect(socket).await {
            Ok(c) => break c,
            Err(e) => {
                tracing::info!(socket = %socket.display(), "still connecting to the CSI driver: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let name = IdentityClient::new(channel)
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .map_err(|s| failed(grpc_error(&s)))?
        .into_inner()
        .name;
    if name.is_empty() {
        return Err(failed("driver name is empty".into()));
    }
    Ok(name)
}

/// What a probe found: `Ok(ready)` from the driver's answer (`None`: no `ready` field), or the
/// error of the connection or call.
pub type ProbeOutcome = Result<Option<bool>, String>;

/// The `/healthz` answer for a probe's outcome (upstream's `checkProbe`).
pub fn health_response(outcome: &ProbeOutcome) -> (StatusCode, String) {
    match outcome {
        // "If not present, the caller SHALL assume that the plugin is in a ready state"
        Ok(None) | Ok(Some(true)) => (StatusCode::OK, "ok".into()),
        Ok(Some(false)) => (StatusCode::INTERNAL_SERVER_ERROR, NOT_READY.into()),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.clone()),
    }
}

/// Dials the driver and calls `Probe`, all within `timeout`.
pub async fn probe(socket: &Path, timeout: Duration) -> ProbeOutcome {
    let call = async {
        let channel = harvester_csi_driver::connect(socket)
            .await
            .map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
        IdentityClient::new(channel)
            .probe(ProbeRequest {})
            .await
            .map(|r| r.into_inner().ready)
            .map_err(|s| grpc_error(&s))
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(outcome) => outcome,
        Err(_) => Err(format!(
            "rpc error: code = DeadlineExceeded desc = no answer from {} within {timeout:?} (--probe-timeout)",
            socket.display()
        )),
    }
}

/// Serves `/healthz` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    socket: PathBuf,
    timeout: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let handler = move |req: http::Request<hyper::body::Incoming>| {
        let socket = socket.clone();
        async move {
            if req.uri().path() != "/healthz" {
                return text(StatusCode::NOT_FOUND, "404 page not found\n".into(), PLAIN);
            }
            let outcome = probe(&socket, timeout).await;
            match &outcome {
                Err(e) => tracing::error!("health check failed: {e}"),
                Ok(Some(false)) => tracing::error!("{NOT_READY}"),
                Ok(_) => tracing::debug!("health check succeeded"),
            }
            let (code, body) = health_response(&outcome);
            text(code, body, PLAIN)
        }
    };
    serve_with(listener, handler, shutdown).await
}

/// Binds the `/healthz` address.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, LivenessError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| LivenessError::Listen { addr, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn flags(args: &[&str]) -> Flags {
        let argv = harvester_common::flags::normalize_args(
            std::iter::once("livenessprobe").chain(args.iter().copied()),
            harvester_common::flags::Syntax::GoFlag,
        );
        Flags::try_parse_from(argv).expect("flags parse")
    }

    #[test]
    fn defaults_and_listen_address_follow_upstream() {
        let f = flags(&[]);
        assert_eq!(f.csi_address, "/run/csi/socket");
        assert_eq!(f.probe_timeout, Duration::from_secs(1));
        assert_eq!(listen_address(&f).unwrap(), "0.0.0.0:9808".parse().unwrap());
        // The chart's arguments, and Go's single-dash spelling.
        let f = flags(&[
            "--csi-address=/csi/csi.sock",
            "--http-endpoint=:9808",
            "-probe-timeout=6s",
        ]);
        assert_eq!(f.probe_timeout, Duration::from_secs(6));
        assert_eq!(listen_address(&f).unwrap(), "0.0.0.0:9808".parse().unwrap());
        assert_eq!(
            listen_address(&flags(&["--health-port=9909"])).unwrap(),
            "0.0.0.0:9909".parse().unwrap()
        );
        // The default port given explicitly is not "explicitly set" upstream.
        assert!(listen_address(&flags(&["--health-port=9808", "--http-endpoint=:1"])).is_ok());
    }

    #[test]
    fn conflicting_and_bad_flags_are_named() {
        let e = listen_address(&flags(&["--health-port=1", "--http-endpoint=:2"])).unwrap_err();
        assert!(
            e.to_string()
                .contains("`--health-port` and `--http-endpoint`"),
            "{e}"
        );
        let e =
            listen_address(&flags(&["--metrics-address=:3", "--http-endpoint=:2"])).unwrap_err();
        assert!(
            e.to_string()
                .contains("`--metrics-address` and `--http-endpoint`"),
            "{e}"
        );
        let e = listen_address(&flags(&["--http-endpoint=nowhere"])).unwrap_err();
        assert!(
            e.to_string().contains("--http-endpoint") && e.to_string().contains("nowhere"),
            "{e}"
        );
        let e = listen_address(&flags(&["--health-port=x"])).unwrap_err();
        assert!(e.to_string().contains("--health-port"), "{e}");
        let e = Flags::try_parse_from(["livenessprobe", "--probe-timeout=soon"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"soon\" is not a duration"), "{e}");
        let e = socket(&flags(&["--csi-address=tcp://h:1"])).unwrap_err();
        assert!(e.to_string().contains("tcp://h:1"), "{e}");
    }

    #[test]
    fn health_answers_follow_check_probe() {
        for (outcome, code, body) in [
            (Ok(Some(true)), 200, "ok"),
            (Ok(None), 200, "ok"),
            (Ok(Some(false)), 500, NOT_READY),
            (
                Err("rpc error: code = Unavailable desc = x".to_string()),
                500,
                "rpc error: code = Unavailable desc = x",
            ),
        ] {
            let (c, b) = health_response(&outcome);
            assert_eq!((c.as_u16(), b.as_str()), (code, body), "{outcome:?}");
        }
    }
}
