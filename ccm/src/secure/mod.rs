//! `/healthz`, `/readyz`, `/livez` and `/metrics` over HTTPS with delegated authentication and
//! authorization: what upstream's cloud provider serves on `--bind-address`:`--secure-port`
//! (k8s.io/cloud-provider v0.34 app/controllermanager.go: `SecureServing.Serve` of the base
//! handler wrapped by `BuildHandlerChain`). [`tls`] picks the certificate, [`conn`] bounds the
//! connections' time and number, [`auth`] decides who may read what.

pub mod auth;
pub mod conn;
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
use harvester_common::telemetry::server::{Readiness, ReadyzDetail, route, text};

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
            let query = req.uri().query().map(str::to_string);
            match auth
                .decide(authorization.as_deref(), req.method().as_str(), &path)
                .await
            {
                Decision::Allow => route(
                    &path,
                    query.as_deref(),
                    &metrics,
                    &readiness,
                    ReadyzDetail::Withheld,
                ),
                Decision::TooManyRequests => {
                    let mut r = status(
                        StatusCode::TOO_MANY_REQUESTS,
                        "TooManyRequests",
                        "too many requests with unknown tokens, please try again later",
                    );
                    r.headers_mut().insert(
                        http::header::RETRY_AFTER,
                        http::HeaderValue::from_static("1"),
                    );
                    r
                }
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
    let connections = conn::Connections::new(conn::MAX_CONNECTIONS);
    let accept = async {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let Some(place) = connections.admit(std::time::Instant::now()) else {
                tracing::debug!(
                    "{} connections, each with a request in flight: closing a new one",
                    conn::MAX_CONNECTIONS
                );
                continue;
            };
            tokio::spawn(conn::serve_tls(
                tcp,
                acceptor.clone(),
                place,
                conn::Limits::default(),
                handler.clone(),
            ));
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
