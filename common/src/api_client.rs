//! The one kube client both programs use: kube's middleware (base URI, retries of 429/503/504,
//! authentication, extra headers) over a connection that speaks HTTP/2 when the API server offers
//! it, as client-go's does.
//!
//! kube's own `ClientBuilder::try_from` offers only HTTP/1.1, where every request in flight holds
//! a TLS connection of its own and the pool keeps it afterwards: the provider's 64 concurrent
//! Service reconciles, its Node syncs and its watches held well over a hundred connections to the
//! two API servers at 5 000 Services, each with its TLS and HTTP buffers. Over HTTP/2 they share
//! one connection per API server.

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
/// The connection's flow-control window (client-go's: 1 GiB). A watch whose consumer is behind
/// holds at most its stream window (hyper's default, 2 MiB) and never the whole connection, so a
/// paused watch cannot stall the answers that would let its consumer go on.
const CONNECTION_WINDOW: u32 = 1 << 30;

/// A client for `config`'s API server, its requests counted in `metrics` (when given).
pub fn kube_client(
    config: kube::Config,
    metrics: Option<&Metrics>,
) -> Result<kube::Client, kube::Error> {
    let tls = config.rustls_client_config()?;
    let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_connect_timeout(config.connect_timeout);
    // client-go's dialer keep-alive: a dead peer is found on an HTTP/1.1 connection too.
    tcp.set_keepalive(Some(PING_EVERY));
    // Go's default too. HTTP/2 writes a request's HEADERS and DATA frames, and the flow-control
    // and ping frames, as separate small writes; with Nagle each waited for the server's delayed
    // ACK (the CR allocated -> Service address step went from 7 to 48 ms at its median).
    tcp.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    let https = match &config.tls_server_name {
        Some(name) => {
            let name = rustls::pki_types::ServerName::try_from(name.clone())
                .map_err(|e| kube::Error::RustlsTls(RustlsTlsError::InvalidServerName(e)))?;
            https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
        }
        None => https,
    };
    // ALPN offers h2 and http/1.1; the pool shares an h2 connection among all requests.
    let connector = https.enable_all_versions().wrap_connector(tcp);
    let http: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .http2_keep_alive_interval(PING_EVERY)
            .http2_keep_alive_timeout(PING_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .http2_initial_connection_window_size(CONNECTION_WINDOW)
            .build(connector);
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
