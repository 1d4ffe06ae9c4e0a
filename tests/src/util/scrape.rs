//! Scraping the programs' HTTP endpoints as Prometheus and the kubelet would: a plain HTTP/1.1
//! GET, the same over TLS with an optional bearer token (what a Prometheus job with
//! `insecure_skip_verify` and a ServiceAccount token sends), and a parser for the OpenMetrics
//! text of `/metrics`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

/// `GET path` on 127.0.0.1:`port`: the status code and the body.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String), String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    let code = out
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP response: {out:?}"))?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// What an HTTPS GET got back: the status, the body and the server's leaf certificate (DER).
#[derive(Debug, Clone)]
pub struct HttpsResponse {
    pub code: u16,
    pub body: String,
    pub server_cert: Vec<u8>,
}

/// `GET path` over TLS on 127.0.0.1:`port` with `Authorization: Bearer <token>` when given. The
/// server's certificate is not verified (as a scraper with `insecure_skip_verify`, or the
/// kubelet's HTTPS probes) but returned, so a test can compare it with the one it expects.
pub fn https_get(port: u16, path: &str, token: Option<&str>) -> Result<HttpsResponse, String> {
    let mut tls = tls_connect(port, &[])?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n"
    )
    .map_err(|e| format!("TLS to 127.0.0.1:{port}: {e}"))?;
    let mut raw = Vec::new();
    // A server that closes without close_notify is an error to rustls; what was read counts.
    if let Err(e) = tls.read_to_end(&mut raw)
        && raw.is_empty()
    {
        return Err(format!("reading from 127.0.0.1:{port}: {e}"));
    }
    let server_cert = tls
        .conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or("no server certificate")?;
    let out = String::from_utf8_lossy(&raw).to_string();
    let code = out
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP response: {out:?}"))?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok(HttpsResponse {
        code,
        body,
        server_cert,
    })
}

/// A TLS client connection to 127.0.0.1:`port`, handshake done, offering the ALPN protocols
/// `alpn` (none: the server picks HTTP/1.1); the server's certificate is not verified. Reads
/// time out after 10 s.
pub fn tls_connect(port: u16, alpn: &[&[u8]]) -> Result<TlsStream, String> {
    use std::sync::Arc;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = rustls::pki_types::ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let mut conn =
        rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)
            .map_err(|e| format!("TLS handshake with 127.0.0.1:{port}: {e}"))?;
    }
    Ok(rustls::StreamOwned::new(conn, tcp))
}

/// A client TLS connection of [`tls_connect`].
pub type TlsStream = rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>;

/// Whether the server has closed `tls`: a read within `wait` ends the stream (end of file, an
/// error, a reset) rather than timing out. Bytes the server sends are read and dropped.
pub fn closed_by_server(tls: &mut TlsStream, wait: Duration) -> bool {
    let deadline = std::time::Instant::now() + wait;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        if tls.sock.set_read_timeout(Some(left)).is_err() {
            return true;
        }
        match tls.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// Polls `https_get(port, path, None)` until it answers 200, up to `within`.
pub async fn wait_for_https_200(port: u16, path: &str, within: Duration) -> Result<(), String> {
    crate::util::wait::until(&format!("https {path} 200"), within, || async {
        let p = path.to_string();
        let got = tokio::task::spawn_blocking(move || https_get(port, &p, None))
            .await
            .map_err(|e| e.to_string())?;
        Ok(match got {
            Ok(r) if r.code == 200 => Ok(()),
            other => Err(other.map(|r| (r.code, r.body))),
        })
    })
    .await
}

/// Accepts any server certificate; signatures are still checked with ring's algorithms.
#[derive(Debug)]
struct AnyCert(std::sync::Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// One sample of a metric family.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of an OpenMetrics text exposition; fails on a line that is neither a comment nor
/// a sample, or when the closing `# EOF` is missing.
pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut samples = Vec::new();
    let mut eof = false;
    for line in text.lines() {
        if line == "# EOF" {
            eof = true;
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if eof {
            return Err(format!("a sample after # EOF: {line:?}"));
        }
        samples.push(parse_sample(line).ok_or_else(|| format!("not a sample: {line:?}"))?);
    }
    if !eof {
        return Err("no # EOF line at the end".into());
    }
    Ok(samples)
}

fn parse_sample(line: &str) -> Option<Sample> {
    let (name, rest) = match line.find('{') {
        Some(i) => {
            let end = line.rfind('}')?;
            let labels = parse_labels(&line[i + 1..end])?;
            (line[..i].to_string(), (labels, &line[end + 1..]))
        }
        None => {
            let (name, rest) = line.split_once(' ')?;
            (name.to_string(), (BTreeMap::new(), rest))
        }
    };
    let (labels, rest) = rest;
    // A value, optionally followed by a timestamp.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let valid_name = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':');
    valid_name.then_some(Sample {
        name,
        labels,
        value,
    })
}

/// `a="x",b="y"` (values with `\"`, `\\` and `\n` escapes).
fn parse_labels(text: &str) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        labels.insert(key.trim().to_string(), value);
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(labels)
}

/// The sum of the samples named `name` whose labels include every pair of `labels`.
pub fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// [`http_get`] off the async runtime (the server may run on the same runtime as the caller).
pub async fn get(port: u16, path: &str) -> Result<(u16, String), String> {
    let path = path.to_string();
    tokio::task::spawn_blocking(move || http_get(port, &path))
        .await
        .map_err(|e| e.to_string())?
}

/// Waits until `GET path` on `port` answers 200.
pub async fn wait_for_200(port: u16, path: &str, within: Duration) -> Result<(), String> {
    crate::util::wait::until(&format!("{path} 200"), within, || async {
        Ok(match get(port, path).await {
            Ok((200, _)) => Ok(()),
            other => Err(other),
        })
    })
    .await
}

/// `GET /metrics` on `port`, parsed.
pub fn metrics(port: u16) -> Result<Vec<Sample>, String> {
    match http_get(port, "/metrics")? {
        (200, body) => parse(&body),
        (code, body) => Err(format!("/metrics answered {code}: {body}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counters_histograms_and_escaped_labels() {
        let text = "# HELP x_total X.\n# TYPE x counter\nx_total{verb=\"get\",code=\"200\"} 3\n\
                    x_total{verb=\"list\",code=\"200\"} 2\nh_bucket{le=\"+Inf\"} 4\n\
                    g 1.5\nq{msg=\"a \\\"b\\\", c\"} 1\n# EOF\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 5);
        assert_eq!(sum(&s, "x_total", &[]), 5.0);
        assert_eq!(sum(&s, "x_total", &[("verb", "get")]), 3.0);
        assert_eq!(sum(&s, "g", &[]), 1.5);
        assert_eq!(s[4].labels["msg"], "a \"b\", c");
        assert_eq!(sum(&s, "missing", &[]), 0.0);
    }

    #[test]
    fn rejects_garbage_and_a_missing_eof() {
        assert!(parse("x 1\n").is_err());
        assert!(parse("x{a=\"1\" 1\n# EOF\n").is_err());
        assert!(parse("not a sample\n# EOF\n").is_err());
        assert!(parse("x 1\n# EOF\ny 2\n").is_err());
    }
}
