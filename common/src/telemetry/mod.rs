//! What an operator needs from both programs: structured logs, Prometheus metrics, `/healthz`,
//! `/readyz` and `/metrics` over HTTP, Kubernetes API request counts, and a shutdown signal.
//! (The provider's HTTPS serving and its Lease election are the provider's own:
//! `harvester_cloud_provider::{secure, leader}`.)

pub mod api_metrics;
pub mod logging;
pub mod metrics;
pub mod server;

pub use api_metrics::ApiMetricsLayer;
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
