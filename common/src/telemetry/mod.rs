//! What an operator needs from both programs: structured logs, Prometheus metrics, `/healthz`,
//! `/readyz` and `/metrics` over HTTP (and over HTTPS with delegated authentication: [`secure`]), Kubernetes API request counts, leader election with a
//! Lease, and a shutdown signal.

pub mod api_metrics;
pub mod leader;
pub mod logging;
pub mod metrics;
pub mod secure;
pub mod server;

pub use api_metrics::{ApiMetricsLayer, kube_client};
pub use leader::{LeaderConfig, LeaderError, run_as_leader};
pub use logging::{LogFormat, init_logging};
pub use metrics::Metrics;
pub use server::{Readiness, serve};

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = term => tracing::info!("SIGTERM received, shutting down"),
        r = tokio::signal::ctrl_c() => {
            if r.is_ok() {
                tracing::info!("interrupt received, shutting down");
            }
        }
    }
}
