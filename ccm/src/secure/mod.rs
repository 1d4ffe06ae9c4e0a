//! `/healthz`, `/readyz`, `/livez` and `/metrics` over HTTPS with delegated authentication and
//! authorization: what upstream's cloud provider serves on `--bind-address`:`--secure-port`
//! (k8s.io/cloud-provider v0.34 app/controllermanager.go: `SecureServing.Serve` of the base
//! handler wrapped by `BuildHandlerChain`). [`tls`] picks the certificate, [`auth`] decides who
//! may read what.

pub mod auth;
pub mod tls;

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;

pub use auth::{AuthOptions, Decision, Delegated};
pub use tls::{CertOptions, ServingCert, TlsError};

use harvester_common::telemetry::Metrics;
use harvester_common::telemetry::server::{Readiness, route, serve_connection, text};

/// How long a client may take over the TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the endpoints over TLS on `listener` until `shutdown` resolves; every request passes
/// `auth` first.
pub async fn serve_on(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    auth: Arc<Delegated>,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: impl Future<Output = ()>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let handler = move |req: Request<hyper::body::Incoming>| {
        let (auth, metrics, readiness) = (auth.clone(), metrics.clone(), readiness.clone());
        async move {
            let authorization = req
                .headers()
                .get(http::header::AUTHORIZATION)
                .map(|v| v.as_bytes().to_vec());
            let path = req.uri().path().to_string();
            match auth
                .decide(authorization.as_deref(), req.method().as_str(), &path)
                .await
            {
                Decision::Allow => route(&path, &metrics, &readiness),
                Decision::Unauthorized => {
                    status(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized")
                }
                Decision::Forbidden(message) => {
                    status(StatusCode::FORBIDDEN, "Forbidden", &message)
                }
                Decision::Error(message) => {
                    status(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", &message)
                }
            }
        }
    };
    let accept = async {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, handler) = (acceptor.clone(), handler.clone());
            tokio::spawn(async move {
                // A client that fails the handshake (a plain-HTTP probe, a scanner) or stalls in
                // it just goes.
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => serve_connection(stream, handler).await,
                    Ok(Err(e)) => tracing::debug!("TLS handshake: {e}"),
                    Err(_) => tracing::debug!("TLS handshake: no end within {HANDSHAKE_TIMEOUT:?}"),
                }
            });
        }
    };
    tokio::select! {
        () = accept => {},
        () = shutdown => {},
    }
}

/// A `metav1.Status` body as the API server's filters write it (responsewriters).
fn status(code: StatusCode, reason: &str, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    text(code, format!("{body}\n"), "application/json")
}
