//! What every CSI RPC goes through: a tower layer that counts it by method and gRPC code and
//! times it (the `/metrics` families `harvester_csi_rpcs` and `harvester_csi_rpc_duration_seconds`),
//! and [`rpc`], which runs a handler in a span with the volume's key and maps its error to a
//! `Status` in one place.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use harvester_common::telemetry::Metrics;
use harvester_common::telemetry::metrics::{MethodLabels, RpcLabels};
use tonic::{Response, Status};
use tracing::Instrument;

/// Counts and times every request of the wrapped gRPC server.
#[derive(Clone)]
pub struct RpcMetricsLayer {
    metrics: Metrics,
}

impl RpcMetricsLayer {
    pub fn new(metrics: Metrics) -> Self {
        RpcMetricsLayer { metrics }
    }
}

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;

    fn layer(&self, inner: S) -> RpcMetrics<S> {
        RpcMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RpcMetrics<S> {
    inner: S,
    metrics: Metrics,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, R> tower::Service<http::Request<B>> for RpcMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_name(req.uri().path()).to_string();
        let span = tracing::info_span!("rpc", method);
        let response = self.inner.call(req);
        let metrics = self.metrics.clone();
        Box::pin(
            async move {
                let start = Instant::now();
                let mut result = response.await;
                if let Ok(r) = &mut result {
                    undecodable_request_is_invalid_argument(r.headers_mut());
                }
                let code = match &result {
                    Ok(r) => status_code(r.headers()),
                    // The transport failed before a status was sent.
                    Err(_) => "Unknown",
                };
                record(&metrics, &method, code, start.elapsed().as_secs_f64());
                result
            }
            .instrument(span),
        )
    }
}

/// tonic answers a request it cannot decode (say, invalid UTF-8 in a `string` field) with
/// INTERNAL "failed to decode Protobuf message: <Message>.<field>: ..."; the fault is the
/// caller's, so the code becomes INVALID_ARGUMENT (the message, naming the field, stays).
pub fn undecodable_request_is_invalid_argument(headers: &mut http::HeaderMap) {
    const INTERNAL: &[u8] = b"13";
    // grpc-message is percent-encoded on the wire; tonic encodes spaces as %20.
    const PREFIXES: [&[u8]; 2] = [
        b"failed to decode Protobuf message",
        b"failed%20to%20decode%20Protobuf%20message",
    ];
    let internal = headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == INTERNAL);
    let undecodable = headers
        .get("grpc-message")
        .is_some_and(|m| PREFIXES.iter().any(|p| m.as_bytes().starts_with(p)));
    if internal && undecodable {
        headers.insert(
            "grpc-status",
            http::HeaderValue::from_static("3"), // INVALID_ARGUMENT
        );
    }
}

fn record(metrics: &Metrics, method: &str, code: &str, seconds: f64) {
    metrics
        .csi_rpcs
        .get_or_create(&RpcLabels {
            method: method.to_string(),
            code: code.to_string(),
        })
        .inc();
    metrics
        .csi_rpc_duration
        .get_or_create(&MethodLabels {
            method: method.to_string(),
        })
        .observe(seconds);
}

/// The RPC's name from a gRPC path (`/csi.v1.Controller/CreateVolume` -> `CreateVolume`); any
/// other path counts as `unknown` so a client cannot grow the label set without bound.
fn method_name(path: &str) -> &str {
    match path
        .strip_prefix("/csi.v1.")
        .and_then(|p| p.split_once('/'))
    {
        Some((_, m))
            if !m.is_empty() && m.len() <= 64 && m.bytes().all(|b| b.is_ascii_alphanumeric()) =>
        {
            m
        }
        _ => "unknown",
    }
}

/// The gRPC code of a unary response as the server sends it: a failed call carries
/// `grpc-status` in its headers ("trailers-only"); a successful one carries it in the trailers,
/// after the message, with code 0. Names as gRPC's Go API prints them (`OK`, `NotFound`, ...).
fn status_code(headers: &http::HeaderMap) -> &'static str {
    let Some(raw) = headers.get("grpc-status") else {
        return "OK";
    };
    let code = raw
        .to_str()
        .ok()
        .and_then(|s| s.parse::<i32>().ok())
        .map(tonic::Code::from)
        .unwrap_or(tonic::Code::Unknown);
    code_name(code)
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// Runs an RPC handler in a span naming the volume (or snapshot, or new volume's name), logs its
/// outcome and turns its error into a `Status` (the one mapping point).
pub(crate) async fn rpc<T, E>(
    method: &'static str,
    key: &str,
    handler: impl Future<Output = Result<T, E>>,
) -> Result<Response<T>, Status>
where
    E: Into<Status> + std::fmt::Display,
{
    let span = tracing::info_span!("volume", id = key);
    async move {
        match handler.await {
            Ok(v) => {
                tracing::debug!(method, "ok");
                Ok(Response::new(v))
            }
            Err(e) => {
                tracing::warn!(method, "{e}");
                Err(e.into())
            }
        }
    }
    .instrument(span)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(status: &'static str, message: &'static str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", http::HeaderValue::from_static(status));
        h.insert("grpc-message", http::HeaderValue::from_static(message));
        h
    }

    #[test]
    fn an_undecodable_request_is_the_callers_fault() {
        // (grpc-status, grpc-message) -> grpc-status after the layer
        for (status, message, want) in [
            (
                "13",
                "failed%20to%20decode%20Protobuf%20message:%20NodeUnpublishVolumeRequest.target_path",
                "3",
            ),
            ("13", "failed to decode Protobuf message: x", "3"),
            ("13", "mkfs.xfs failed", "13"),
            ("5", "failed%20to%20decode%20Protobuf%20message", "5"),
        ] {
            let mut h = headers(status, message);
            undecodable_request_is_invalid_argument(&mut h);
            assert_eq!(h["grpc-status"], want, "{status} {message}");
            assert_eq!(h["grpc-message"], message, "the message stays");
        }
        let mut ok = http::HeaderMap::new();
        undecodable_request_is_invalid_argument(&mut ok);
        assert!(ok.is_empty(), "a success has no status header to change");
    }

    #[test]
    fn methods_come_from_csi_paths_only() {
        assert_eq!(
            method_name("/csi.v1.Controller/CreateVolume"),
            "CreateVolume"
        );
        assert_eq!(
            method_name("/csi.v1.Node/NodeStageVolume"),
            "NodeStageVolume"
        );
        assert_eq!(method_name("/csi.v1.Identity/Probe"), "Probe");
        for other in [
            "/",
            "",
            "/csi.v1.Controller/",
            "/csi.v1.Controller",
            "/grpc.health.v1.Health/Check",
            "/csi.v1.Node/Node Stage",
            "/csi.v1.Node/a/b",
        ] {
            assert_eq!(method_name(other), "unknown", "{other:?}");
        }
        let long = format!("/csi.v1.Node/{}", "A".repeat(65));
        assert_eq!(method_name(&long), "unknown");
    }

    #[test]
    fn codes_come_from_the_grpc_status_header() {
        let mut h = http::HeaderMap::new();
        assert_eq!(status_code(&h), "OK");
        h.insert("grpc-status", http::HeaderValue::from_static("5"));
        assert_eq!(status_code(&h), "NotFound");
        h.insert("grpc-status", http::HeaderValue::from_static("3"));
        assert_eq!(status_code(&h), "InvalidArgument");
        h.insert("grpc-status", http::HeaderValue::from_static("0"));
        assert_eq!(status_code(&h), "OK");
        h.insert("grpc-status", http::HeaderValue::from_static("x"));
        assert_eq!(status_code(&h), "Unknown");
    }

    #[tokio::test]
    async fn the_layer_counts_and_times_each_call_by_method_and_code() {
        use tower::{Layer, Service, ServiceExt};
        let metrics = Metrics::new();
        let inner = tower::service_fn(|req: http::Request<()>| async move {
            let mut resp = http::Response::new(());
            if req.uri().path().ends_with("DeleteVolume") {
                resp.headers_mut()
                    .insert("grpc-status", http::HeaderValue::from_static("5"));
            }
            Ok::<_, std::convert::Infallible>(resp)
        });
        let mut svc = RpcMetricsLayer::new(metrics.clone()).layer(inner);
        for path in [
            "/csi.v1.Controller/CreateVolume",
            "/csi.v1.Controller/CreateVolume",
            "/csi.v1.Controller/DeleteVolume",
        ] {
            let req = http::Request::builder().uri(path).body(()).unwrap();
            svc.ready().await.unwrap().call(req).await.unwrap();
        }
        let text = metrics.encode();
        for want in [
            r#"harvester_csi_rpcs_total{method="CreateVolume",code="OK"} 2"#,
            r#"harvester_csi_rpcs_total{method="DeleteVolume",code="NotFound"} 1"#,
            r#"harvester_csi_rpc_duration_seconds_count{method="CreateVolume"} 2"#,
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
    }
}
