//! `/healthz` (the process serves), `/readyz` (every readiness check passes) and `/metrics`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use super::metrics::Metrics;

/// Named readiness checks; ready when all pass. A check not yet reported counts as failing.
#[derive(Clone, Default)]
pub struct Readiness {
    checks: Arc<Mutex<BTreeMap<String, Result<(), String>>>>,
}

impl Readiness {
    /// A readiness with `names` registered as not yet passing.
    pub fn with_checks(names: &[&str]) -> Readiness {
        let r = Readiness::default();
        for n in names {
            r.set(n, Err("not checked yet".into()));
        }
        r
    }

    pub fn set(&self, name: &str, state: Result<(), String>) {
        self.checks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), state);
    }

    /// Every check by name, with its state.
    pub fn checks(&self) -> Vec<(String, Result<(), String>)> {
        let checks = self.checks.lock().unwrap_or_else(|p| p.into_inner());
        checks.iter().map(|(n, s)| (n.clone(), s.clone())).collect()
    }

    /// `Ok` when ready, else the failing checks with their reasons.
    pub fn status(&self) -> Result<(), Vec<String>> {
        let checks = self.checks.lock().unwrap_or_else(|p| p.into_inner());
        let failing: Vec<String> = checks
            .iter()
            .filter_map(|(n, s)| s.as_ref().err().map(|e| format!("{n}: {e}")))
            .collect();
        if failing.is_empty() {
            Ok(())
        } else {
            Err(failing)
        }
    }
}

/// A response with `body` and its content type.
pub fn text(code: StatusCode, body: String, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    r
}

/// What `/readyz` tells of the checks that fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadyzDetail {
    /// Each failing check with its reason (the plain-HTTP endpoints: the CSI driver's and the
    /// provider's `--metrics-address`).
    Reasons,
    /// Upstream's public `/readyz` (k8s.io/apiserver v0.34 pkg/server/healthz/healthz.go
    /// `handleRootHealth`: "don't include the error since this endpoint is public"): `[+]name
    /// ok` / `[-]name failed: reason withheld` lines and `readyz check failed`; `ok` when ready,
    /// the list with `?verbose`. The reason of one check is at `/readyz/<check>` (upstream's
    /// `InstallPathHandler` installs one path per check), which is not an always-allowed path:
    /// only a caller authorised for `get` on it reads it (the provider's HTTPS port).
    Withheld,
}

/// The endpoints' answers, by path and query.
pub fn route(
    path: &str,
    query: Option<&str>,
    metrics: &Metrics,
    readiness: &Readiness,
    detail: ReadyzDetail,
) -> Response<Full<Bytes>> {
    match (path, detail) {
        ("/healthz" | "/livez", _) => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        ("/readyz", ReadyzDetail::Reasons) => match readiness.status() {
            Ok(()) => text(StatusCode::OK, "ok\n".into(), "text/plain"),
            Err(failing) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready:\n{}\n", failing.join("\n")),
                "text/plain",
            ),
        },
        ("/readyz", ReadyzDetail::Withheld) => {
            let (code, body) = readyz_withheld(&readiness.checks(), verbose(query));
            text(code, body, "text/plain")
        }
        ("/metrics", _) => text(
            StatusCode::OK,
            metrics.encode(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        (other, ReadyzDetail::Withheld) => match other
            .strip_prefix("/readyz/")
            .and_then(|name| readiness.checks().into_iter().find(|(n, _)| n == name))
        {
            Some((_, Ok(()))) => text(StatusCode::OK, "ok\n".into(), "text/plain"),
            Some((name, Err(reason))) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("[-]{name} failed: {reason}\n"),
                "text/plain",
            ),
            None => text(StatusCode::NOT_FOUND, "not found\n".into(), "text/plain"),
        },
        _ => text(StatusCode::NOT_FOUND, "not found\n".into(), "text/plain"),
    }
}

/// Whether the query has a `verbose` parameter (with or without a value), as upstream reads it.
fn verbose(query: Option<&str>) -> bool {
    query
        .unwrap_or_default()
        .split('&')
        .any(|kv| kv.split('=').next() == Some("verbose"))
}

/// Upstream's public `/readyz` answer: the check names, never the reasons.
fn readyz_withheld(checks: &[(String, Result<(), String>)], verbose: bool) -> (StatusCode, String) {
    let lines: String = checks
        .iter()
        .map(|(name, state)| match state {
            Ok(()) => format!("[+]{name} ok\n"),
            Err(_) => format!("[-]{name} failed: reason withheld\n"),
        })
        .collect();
    if checks.iter().any(|(_, s)| s.is_err()) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{lines}readyz check failed\n"),
        )
    } else if verbose {
        (StatusCode::OK, format!("{lines}readyz check passed\n"))
    } else {
        (StatusCode::OK, "ok\n".into())
    }
}

/// The value of a listen-address flag such as `--metrics-address`: `host:port`, `:port` (all
/// IPv4 interfaces, as Go programs read it) or empty (endpoint off).
pub fn parse_address(flag: &str, raw: &str) -> Result<Option<SocketAddr>, String> {
    let raw = raw.trim();
    if raw.is_empty() {
        return Ok(None);
    }
    let full = match raw.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => raw.to_string(),
    };
    full.parse::<SocketAddr>().map(Some).map_err(|e| {
        format!("invalid value {raw:?} for {flag}: {e} (want host:port, :port or empty)")
    })
}

/// Binds `addr` and serves until `shutdown` resolves. Returns the bound address through `bound`
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!("health and metrics on http://{}", listener.local_addr()?);
    serve_on(listener, metrics, readiness, shutdown).await;
    Ok(())
}

/// Serves on an already bound listener until `shutdown` resolves.
pub async fn serve_on(
    listener: TcpListener,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: impl Future<Output = ()>,
) {
    let handler = move |req: Request<hyper::body::Incoming>| {
        let r = route(
            req.uri().path(),
            req.uri().query(),
            &metrics,
            &readiness,
            ReadyzDetail::Reasons,
        );
        async move { r }
    };
    serve_with(listener, handler, shutdown).await
}

/// Serves HTTP/1 and HTTP/2 on `listener`, answering each request with `handler`, until
/// `shutdown` resolves.
pub async fn serve_with<H, F>(listener: TcpListener, handler: H, shutdown: impl Future<Output = ()>)
where
    H: Fn(Request<hyper::body::Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let accept = async {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(serve_connection(tcp, handler.clone()));
        }
    };
    tokio::select! {
        () = accept => {},
        () = shutdown => {},
    }
}

/// Serves HTTP/1 and HTTP/2 on one connection (plain TCP or TLS), answering with `handler`.
pub async fn serve_connection<IO, H, F>(io: IO, handler: H)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<hyper::body::Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let response = handler(req);
        async move { Ok::<_, Infallible>(response.await) }
    });
    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(io), svc)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_lists_failing_checks() {
        let r = Readiness::with_checks(&["harvester", "caches"]);
        assert_eq!(r.status().unwrap_err().len(), 2);
        r.set("caches", Ok(()));
        r.set(
            "harvester",
            Err("401 Unauthorized from cloud-config /etc/kubernetes/cloud-config".into()),
        );
        let failing = r.status().unwrap_err();
        assert_eq!(
            failing,
            vec!["harvester: 401 Unauthorized from cloud-config /etc/kubernetes/cloud-config"]
        );
        r.set("harvester", Ok(()));
        assert!(r.status().is_ok());
    }

    async fn answer(resp: Response<Full<Bytes>>) -> (u16, String) {
        use http_body_util::BodyExt;
        let code = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (code, String::from_utf8(bytes.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn public_readyz_names_failing_checks_without_their_reasons() {
        let r = Readiness::with_checks(&["clients", "harvester"]);
        r.set("clients", Ok(()));
        r.set("harvester", Err("401 from cloud-config /etc/cc".into()));
        let m = Metrics::new();
        let get = |path, query| answer(route(path, query, &m, &r, ReadyzDetail::Withheld));
        let failed = "[+]clients ok\n[-]harvester failed: reason withheld\nreadyz check failed\n";
        assert_eq!(get("/readyz", None).await, (503, failed.into()));
        assert_eq!(get("/readyz", Some("verbose")).await, (503, failed.into()));
        assert_eq!(
            get("/readyz/harvester", None).await,
            (
                503,
                "[-]harvester failed: 401 from cloud-config /etc/cc\n".into()
            )
        );
        assert_eq!(get("/readyz/clients", None).await, (200, "ok\n".into()));
        assert_eq!(get("/readyz/nope", None).await.0, 404);
        // The plain-HTTP endpoints keep the reasons in /readyz, and have no per-check paths.
        let plain = |path| answer(route(path, None, &m, &r, ReadyzDetail::Reasons));
        assert_eq!(
            plain("/readyz").await,
            (
                503,
                "not ready:\nharvester: 401 from cloud-config /etc/cc\n".into()
            )
        );
        assert_eq!(plain("/readyz/harvester").await.0, 404);
        r.set("harvester", Ok(()));
        assert_eq!(get("/readyz", None).await, (200, "ok\n".into()));
        assert_eq!(
            get("/readyz", Some("a=1&verbose")).await,
            (
                200,
                "[+]clients ok\n[+]harvester ok\nreadyz check passed\n".into()
            )
        );
    }

    #[test]
    fn listen_addresses_parse_or_name_the_flag() {
        let p = |raw| parse_address("--metrics-address", raw);
        assert_eq!(p(""), Ok(None));
        assert_eq!(p(" "), Ok(None));
        assert_eq!(p(":9810"), Ok(Some("0.0.0.0:9810".parse().unwrap())));
        assert_eq!(p("127.0.0.1:1"), Ok(Some("127.0.0.1:1".parse().unwrap())));
        assert_eq!(p("[::1]:80"), Ok(Some("[::1]:80".parse().unwrap())));
        for bad in ["9810", "localhost:80", ":http", "1.2.3.4:99999"] {
            let e = p(bad).unwrap_err();
            assert!(e.contains("--metrics-address") && e.contains(bad), "{e}");
        }
    }

    #[tokio::test]
    async fn serves_health_readiness_and_metrics_over_http() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Metrics::new();
        drop(metrics.reconcile_started("service"));
        let readiness = Readiness::with_checks(&["harvester"]);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_on(listener, metrics, readiness.clone(), async {
            let _ = rx.await;
        }));
        let get = |path: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
        let not_ready = get("/readyz").await;
        assert!(
            not_ready.starts_with("HTTP/1.1 503") && not_ready.contains("harvester"),
            "{not_ready}"
        );
        readiness.set("harvester", Ok(()));
        assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
        let m = get("/metrics").await;
        assert!(
            m.contains(r#"harvester_reconciles_total{controller="service"} 1"#),
            "{m}"
        );
        drop(tx);
        server.await.unwrap();
    }
}
