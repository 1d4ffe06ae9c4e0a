//! How long a connection to the HTTPS port may stay and how many may be open: upstream's
//! timeouts (k8s.io/apiserver v0.34 pkg/server/secure_serving.go, `SecureServingInfo.Serve`:
//! `http.Server{ReadHeaderTimeout: 32s, IdleTimeout: 90s}` and `http2.Server{IdleTimeout: 90s,
//! MaxConcurrentStreams: 100}`) and a cap on open connections, which upstream does not have.
//!
//! - TLS handshake: [`HANDSHAKE_TIMEOUT`].
//! - HTTP/1.1 (chosen when the client does not offer `h2` in ALPN): the request header must be
//!   complete within [`HEADER_READ_TIMEOUT`] of the moment the server starts waiting for it, on
//!   a new connection and between requests of a kept-alive one alike (hyper's header-read timer
//!   runs on both; Go waits up to `IdleTimeout` for the first byte of a next request), so an
//!   idle HTTP/1.1 connection is closed after at most that long.
//! - HTTP/2 (ALPN `h2`, as Go's TLS server chooses it): at most [`MAX_CONCURRENT_STREAMS`]
//!   streams; a connection without a request in flight for [`IDLE_TIMEOUT`] is shut down
//!   (GOAWAY), as any other connection that stays that long without one.
//! - At most [`MAX_CONNECTIONS`] open (handshaking included). A new connection over the cap
//!   closes the one that has been without a request the longest, rather than being refused or
//!   made to wait: a client that holds many idle connections then cannot keep the kubelet's
//!   probes and the scrapers out (the liveness probe is on this port), and the memory stays
//!   bounded. Only when every open connection has a request in flight is the new one closed at
//!   once; requests end within the review timeout, so that does not last.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// How long a client may take over the TLS handshake (shorter than Go's, which bounds it by
/// `ReadHeaderTimeout`: a handshake takes milliseconds).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// k8s.io/apiserver v0.34 pkg/server/secure_serving.go: `ReadHeaderTimeout: 32 * time.Second`
/// ("just shy of requestTimeoutUpperBound").
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(32);
/// k8s.io/apiserver v0.34 pkg/server/secure_serving.go: `IdleTimeout: 90 * time.Second` of the
/// `http.Server` and of the `http2.Server` ("matches http.DefaultTransport keep-alive timeout").
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// k8s.io/apiserver v0.34 pkg/server/secure_serving.go: `http2Options.MaxConcurrentStreams = 100`
/// when `--http2-max-streams-per-connection` is 0 (its default).
pub const MAX_CONCURRENT_STREAMS: u32 = 100;
/// Open connections at most. No upstream counterpart (Go's server has no cap); the kubelet's
/// probes and a few scrapers need a handful, and 256 TLS connections stay within a few MiB.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a connection that is being closed (idle, or over the cap) may take to finish.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The timeouts of [`serve_tls`]; `Default` is the constants above (tests use shorter ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub handshake: Duration,
    pub header_read: Duration,
    pub idle: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake: HANDSHAKE_TIMEOUT,
            header_read: HEADER_READ_TIMEOUT,
            idle: IDLE_TIMEOUT,
        }
    }
}

/// The open connections, for the cap and the idle timeout.
pub struct Connections {
    cap: usize,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    open: HashMap<u64, Slot>,
}

struct Slot {
    /// Requests in flight.
    busy: usize,
    /// Since when no request has been in flight (the accept, or the end of the last one).
    idle_since: Instant,
    close: Arc<Notify>,
}

impl Connections {
    pub fn new(cap: usize) -> Arc<Connections> {
        Arc::new(Connections {
            cap,
            table: Mutex::default(),
        })
    }

    /// A place for a connection accepted at `now`: when the cap is reached, the connection
    /// without a request for the longest is told to close and its place taken; `None` when
    /// every open connection has a request in flight.
    pub fn admit(self: &Arc<Self>, now: Instant) -> Option<Conn> {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if t.open.len() >= self.cap {
            let victim = longest_idle(&t.open)?;
            if let Some(slot) = t.open.remove(&victim) {
                slot.close.notify_one();
            }
        }
        let id = t.next_id;
        t.next_id += 1;
        let close = Arc::new(Notify::new());
        t.open.insert(
            id,
            Slot {
                busy: 0,
                idle_since: now,
                close: close.clone(),
            },
        );
        Some(Conn {
            id,
            connections: self.clone(),
            close,
        })
    }

    /// Open connections.
    pub fn len(&self) -> usize {
        self.table.lock().map(|t| t.open.len()).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn with_slot<T>(&self, id: u64, f: impl FnOnce(&mut Slot) -> T) -> Option<T> {
        let mut t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        t.open.get_mut(&id).map(f)
    }
}

/// The connection without a request in flight for the longest.
fn longest_idle(open: &HashMap<u64, Slot>) -> Option<u64> {
    open.iter()
        .filter(|(_, s)| s.busy == 0)
        .min_by_key(|(id, s)| (s.idle_since, **id))
        .map(|(id, _)| *id)
}

/// One admitted connection; its place is given back when dropped.
pub struct Conn {
    id: u64,
    connections: Arc<Connections>,
    close: Arc<Notify>,
}

impl Conn {
    /// Marks a request in flight until the guard drops.
    fn request(self: &Arc<Self>) -> RequestGuard {
        self.connections.with_slot(self.id, |s| s.busy += 1);
        RequestGuard(self.clone())
    }

    /// How long no request has been in flight at `now`; `None` while one is (or once the
    /// connection was evicted).
    pub fn idle_for(&self, now: Instant) -> Option<Duration> {
        self.connections
            .with_slot(self.id, |s| {
                (s.busy == 0).then(|| now.saturating_duration_since(s.idle_since))
            })
            .flatten()
    }

    /// Resolves when the cap made room with this connection.
    pub async fn evicted(&self) {
        self.close.notified().await
    }

    /// Resolves once the connection has had no request in flight for `idle`, or was evicted.
    async fn done(&self, idle: Duration) {
        let watch = async {
            loop {
                let now = Instant::now();
                match self.idle_for(now) {
                    Some(d) if d >= idle => return,
                    Some(d) => tokio::time::sleep(idle - d).await,
                    None if self.connections.with_slot(self.id, |_| ()).is_none() => return,
                    None => tokio::time::sleep(idle).await,
                }
            }
        };
        tokio::select! {
            () = watch => {},
            () = self.evicted() => {},
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let mut t = self
            .connections
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        t.open.remove(&self.id);
    }
}

struct RequestGuard(Arc<Conn>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.connections.with_slot(self.0.id, |s| {
            s.busy = s.busy.saturating_sub(1);
            if s.busy == 0 {
                s.idle_since = Instant::now();
            }
        });
    }
}

/// Serves one accepted TCP connection holding place `conn`: the TLS handshake, then HTTP/2 or
/// HTTP/1.1 as ALPN chose, each request answered by `handler`, within `limits`.
pub async fn serve_tls<H, F>(
    tcp: TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    conn: Conn,
    limits: Limits,
    handler: H,
) where
    H: Fn(Request<hyper::body::Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let conn = Arc::new(conn);
    // A client that fails the handshake (a plain-HTTP probe, a scanner) or stalls in it just
    // goes.
    let stream = tokio::select! {
        r = tokio::time::timeout(limits.handshake, acceptor.accept(tcp)) => match r {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return tracing::debug!("TLS handshake: {e}"),
            Err(_) => {
                return tracing::debug!("TLS handshake: no end within {:?}", limits.handshake);
            }
        },
        () = conn.evicted() => return tracing::debug!("TLS handshake: closed to stay within the cap"),
    };
    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
    let svc = hyper::service::service_fn({
        let conn = conn.clone();
        move |req: Request<hyper::body::Incoming>| {
            let guard = conn.request();
            let response = handler(req);
            async move {
                let r = response.await;
                drop(guard);
                Ok::<_, Infallible>(r)
            }
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    let builder = if h2 {
        builder.http2_only()
    } else {
        builder.http1_only()
    };
    let connection = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        () = conn.done(limits.idle) => {}
    }
    // Idle or over the cap: HTTP/2 gets a GOAWAY, HTTP/1.1 is closed (nothing in flight).
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(CLOSE_GRACE, connection).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_makes_room_with_the_connection_idle_longest() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let c = Connections::new(3);
        let a = Arc::new(c.admit(at(0)).unwrap());
        let b = Arc::new(c.admit(at(1)).unwrap());
        let busy = Arc::new(c.admit(at(2)).unwrap());
        let _request = busy.request();
        assert_eq!(c.len(), 3);
        // Full: `a` (idle since 0) goes, the new one takes its place.
        let d = c.admit(at(3)).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(a.idle_for(at(4)), None, "evicted");
        assert_eq!(b.idle_for(at(4)), Some(Duration::from_secs(3)));
        assert_eq!(busy.idle_for(at(4)), None, "a request in flight");
        // Then `b`; then only busy ones and the new ones are left.
        let e = c.admit(at(4)).unwrap();
        assert_eq!(b.idle_for(at(5)), None);
        drop((d, e));
        assert_eq!(c.len(), 1, "places given back on drop");
    }

    #[test]
    fn a_full_table_of_busy_connections_refuses() {
        let t0 = Instant::now();
        let c = Connections::new(2);
        let x = Arc::new(c.admit(t0).unwrap());
        let y = Arc::new(c.admit(t0).unwrap());
        let (gx, gy) = (x.request(), y.request());
        assert!(c.admit(t0).is_none());
        drop(gx);
        let later = Instant::now();
        assert!(x.idle_for(later).is_some(), "idle again after its request");
        assert!(c.admit(later).is_some(), "x made room");
        drop(gy);
    }

    #[tokio::test]
    async fn an_idle_connection_is_done_after_the_idle_timeout_and_a_busy_one_is_not() {
        let c = Connections::new(4);
        let idle = Arc::new(c.admit(Instant::now()).unwrap());
        let t = Instant::now();
        idle.done(Duration::from_millis(100)).await;
        assert!(t.elapsed() >= Duration::from_millis(90));

        let busy = Arc::new(c.admit(Instant::now()).unwrap());
        let guard = busy.request();
        let waited = tokio::time::timeout(
            Duration::from_millis(300),
            busy.done(Duration::from_millis(100)),
        )
        .await;
        assert!(waited.is_err(), "not idle while a request is in flight");
        drop(guard);
        let t = Instant::now();
        busy.done(Duration::from_millis(100)).await;
        assert!(
            t.elapsed() >= Duration::from_millis(90),
            "idle from the end of the request"
        );
    }
}
