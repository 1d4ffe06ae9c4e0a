//! The one kube client both programs use: kube's middleware (base URI, retries of 429/503/504,
//! authentication, extra headers) over a few HTTP/2 connections to each API server, as client-go
//! speaks it, with every watch on an HTTP/1.1 connection of its own.
//!
//! kube's own `ClientBuilder::try_from` offers only HTTP/1.1, where every request in flight holds
//! a TLS connection of its own and the pool keeps it afterwards: at 5 000 Services + 1 000 Nodes
//! about 95 connections, VmHWM 67.6-68.7 MiB (one HTTP/2 connection: 61.9; this design: 66.2 in
//! an experiment build, 66.3-67.4 in the full benches of 6 Dec; 55.5 in one run with the resync
//! paced, ccm/src/controller.rs `RESYNC_GAP`). One HTTP/2 connection, as client-go keeps, was
//! the provider's bottleneck under a burst instead: the Go API server passes every frame of a
//! connection through that connection's one frame-writing goroutine, so on the busy 2-core bed
//! the provider's Node watch saw each Node 0.3-1.2 s after the bench's own HTTP/1.1 watch did
//! (the server closed it as unresponsive about 20 times in a burst of 1 000 Nodes), and with the
//! watches moved off it the answers to the Node writes queued instead. Hence
//! [`SHARED_CONNECTIONS`] connections taken in turn for requests, and the watches, which stream
//! for minutes, over HTTP/1.1 where the server's handler writes each event itself (docs/ccm.md,
//! "Under a burst").

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kube::client::retry::RetryPolicy;
use kube::client::{ConfigExt, RustlsTlsError};
use tower::retry::RetryLayer;
use tower::{BoxError, ServiceBuilder};

use crate::telemetry::{ApiMetricsLayer, Metrics};

/// client-go's HTTP/2 health check (`HTTP2_READ_IDLE_TIMEOUT_SECONDS`, `HTTP2_PING_TIMEOUT_SECONDS`):
/// a ping after this long without a frame, and the connection dropped if its answer takes longer
/// than [`PING_TIMEOUT`]. It finds a dead API server that HTTP/1.1 would only see at the next
/// request's timeout.
const PING_EVERY: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(15);
/// An HTTP/2 connection's flow-control window (client-go's: 1 GiB). An answer whose reader is
/// behind holds at most its stream window (hyper's default, 2 MiB), never the whole connection.
const CONNECTION_WINDOW: u32 = 1 << 30;

/// Connections (HTTP/2 when the server offers it) that requests other than watches take in turn.
/// Initialising 1 000 Nodes arriving 16 at a time (20x1000 bench, 6 Dec), p99 Node tainted ->
/// initialised: everything on 1 connection 1.75-3.45 s; with the watches apart on HTTP/1.1,
/// 1 connection 4.4 s, 4: 1.4 s, 8: 0.53 s, 16: 0.39 s; HTTP/1.1 throughout 0.41 s.
const SHARED_CONNECTIONS: usize = 8;

/// A client for `config`'s API server, its requests counted in `metrics` (when given).
pub fn kube_client(
    config: kube::Config,
    metrics: Option<&Metrics>,
) -> Result<kube::Client, kube::Error> {
    let tls = config.rustls_client_config()?;
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_connect_timeout(config.connect_timeout);
    // client-go's dialer keep-alive: a dead peer is found on an HTTP/1.1 connection (a watch) too.
    tcp.set_keepalive(Some(PING_EVERY));
    tcp.set_keepalive_interval(Some(PING_EVERY));
    // Go's default too. HTTP/2 writes a request's HEADERS and DATA frames, and the flow-control
    // and ping frames, as separate small writes; with Nagle each waited for the server's delayed
    // ACK (the CR allocated -> Service address step went from 7 to 48 ms at its median).
    tcp.set_nodelay(true);
    let server_name = config
        .tls_server_name
        .as_ref()
        .map(|name| {
            rustls::pki_types::ServerName::try_from(name.clone())
                .map_err(|e| kube::Error::RustlsTls(RustlsTlsError::InvalidServerName(e)))
        })
        .transpose()?;
    let https = |versions: Versions| {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http();
        let https = match &server_name {
            Some(name) => https.with_server_name_resolver(
                hyper_rustls::FixedServerNameResolver::new(name.clone()),
            ),
            None => https,
        };
        // ALPN: h2 and http/1.1, or http/1.1 alone.
        match versions {
            Versions::Both => https.enable_all_versions().wrap_connector(tcp.clone()),
            Versions::Http1 => https.enable_http1().wrap_connector(tcp.clone()),
        }
    };
    // Each built client has a pool of its own: over HTTP/2, one connection.
    let mut builder =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .http2_keep_alive_interval(PING_EVERY)
        .http2_keep_alive_timeout(PING_TIMEOUT)
        .http2_keep_alive_while_idle(true)
        .http2_initial_connection_window_size(CONNECTION_WINDOW);
    let h2_or_http1 = https(Versions::Both);
    let shared = (0..SHARED_CONNECTIONS)
        .map(|_| builder.build(h2_or_http1.clone()))
        .collect();
    let http = WatchesApart {
        shared: Arc::new(shared),
        turn: Arc::new(AtomicUsize::new(0)),
        watches: builder.build(https(Versions::Http1)),
    };
    let service = ServiceBuilder::new()
        .option_layer(metrics.map(|m| ApiMetricsLayer::new(m.clone())))
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(http);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// The protocols a connector offers in ALPN.
enum Versions {
    Both,
    Http1,
}

type HttpClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    kube::client::Body,
>;

/// Sends each watch over an HTTP/1.1 connection of its own and every other request over the
/// next of the shared connections. Clone (shared state behind `Arc`s) because tower's retry
/// layer clones the service it wraps.
#[derive(Clone)]
struct WatchesApart {
    shared: Arc<Vec<HttpClient>>,
    turn: Arc<AtomicUsize>,
    watches: HttpClient,
}

impl tower::Service<http::Request<kube::client::Body>> for WatchesApart {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper_util::client::legacy::Error;
    type Future = hyper_util::client::legacy::ResponseFuture;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<kube::client::Body>) -> Self::Future {
        if is_watch(req.uri()) {
            return self.watches.request(req);
        }
        let i = self.turn.fetch_add(1, Ordering::Relaxed) % self.shared.len();
        self.shared[i].request(req)
    }
}

/// Whether the request is a watch (`watch=true` or `watch=1` in the query, as the API server
/// reads it).
fn is_watch(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&')
            .any(|kv| matches!(kv, "watch=true" | "watch=1"))
    })
}

#[cfg(test)]
mod tests {
    use super::is_watch;

    #[test]
    fn only_watch_requests_count_as_watches() {
        let watch = |u: &str| is_watch(&u.parse().expect("uri"));
        assert!(watch(
            "/api/v1/nodes?watch=true&resourceVersion=5&timeoutSeconds=290"
        ));
        assert!(watch("/api/v1/nodes?resourceVersion=5&watch=1"));
        assert!(!watch("/api/v1/nodes"));
        assert!(!watch("/api/v1/nodes?limit=500&resourceVersion=0"));
        assert!(!watch("/api/v1/nodes?watch=false"));
        assert!(!watch(
            "/api/v1/namespaces/watch/services?labelSelector=watch%3Dtrue"
        ));
    }
}
