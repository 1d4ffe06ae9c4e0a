//! The serving certificate of the HTTPS endpoint, as upstream picks it (k8s.io/apiserver v0.34
//! pkg/server/options/serving.go `MaybeDefaultWithSelfSignedCerts`, which k8s.io/cloud-provider
//! options.go calls with pair name `cloud-controller-manager` and no cert dir):
//! `--tls-cert-file` + `--tls-private-key-file` when given; else `<--cert-dir>/<pair>.crt|.key`
//! when both can be read; else a fresh self-signed certificate for `localhost` and 127.0.0.1
//! (plus the bind address when it is not a wildcard), written to `--cert-dir` when one is set and
//! kept in memory otherwise.

use std::io::BufReader;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

/// Where the certificate comes from (the flags, typed).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CertOptions {
    /// `--tls-cert-file`.
    pub cert_file: Option<PathBuf>,
    /// `--tls-private-key-file`.
    pub key_file: Option<PathBuf>,
    /// `--cert-dir`: where a generated pair is written (and read back on the next start).
    pub cert_dir: Option<PathBuf>,
    /// File name of the pair in `cert_dir` (upstream: `cloud-controller-manager`).
    pub pair_name: String,
    /// `--bind-address`: in the generated certificate unless it is a wildcard.
    pub bind: Option<IpAddr>,
}

/// Why no certificate could be served: names the flag and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{flag} {path}: {reason}")]
    Parse {
        flag: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{given} is set but {missing} is not: both or neither")]
    Half {
        given: &'static str,
        missing: &'static str,
    },
    /// `origin`: [`ServingCert::origin`], naming the flags and files.
    #[error("{origin}: {reason}")]
    Mismatch { origin: String, reason: String },
    #[error("--cert-dir {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("generating a self-signed certificate: {0}")]
    Generate(String),
}

/// A certificate chain, its key, and where they came from (the flags and files, or how it was
/// made: the start-up log line and [`TlsError::Mismatch`]).
pub struct ServingCert {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
    pub origin: String,
}

const CERT_FLAG: &str = "--tls-cert-file";
const KEY_FLAG: &str = "--tls-private-key-file";

/// The certificate to serve, following upstream's order (module docs).
pub fn serving_cert(opts: &CertOptions) -> Result<ServingCert, TlsError> {
    match (&opts.cert_file, &opts.key_file) {
        (Some(cert), Some(key)) => return read_pair(CERT_FLAG, cert, KEY_FLAG, key),
        (Some(_), None) => {
            return Err(TlsError::Half {
                given: CERT_FLAG,
                missing: KEY_FLAG,
            });
        }
        (None, Some(_)) => {
            return Err(TlsError::Half {
                given: KEY_FLAG,
                missing: CERT_FLAG,
            });
        }
        (None, None) => {}
    }
    let Some(dir) = &opts.cert_dir else {
        let (cert_pem, key_pem) = self_signed(opts.bind)?;
        let chain = parse_certs(CERT_FLAG, Path::new("(generated)"), &cert_pem)?;
        let key = parse_key(KEY_FLAG, Path::new("(generated)"), &key_pem)?;
        return Ok(ServingCert {
            chain,
            key,
            origin: "self-signed, in memory".into(),
        });
    };
    let cert = dir.join(format!("{}.crt", opts.pair_name));
    let key = dir.join(format!("{}.key", opts.pair_name));
    // Upstream's CanReadCertAndKey: both files readable means "use them".
    if std::fs::File::open(&cert).is_ok() && std::fs::File::open(&key).is_ok() {
        return read_pair("--cert-dir", &cert, "--cert-dir", &key);
    }
    let (cert_pem, key_pem) = self_signed(opts.bind)?;
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
        path: dir.clone(),
        source,
    })?;
    write_private(&cert, &cert_pem)?;
    write_private(&key, &key_pem)?;
    let mut pair = read_pair("--cert-dir", &cert, "--cert-dir", &key)?;
    pair.origin = format!(
        "self-signed, written to {} and {}",
        cert.display(),
        key.display()
    );
    Ok(pair)
}

/// The certificate the endpoint serves, swapped when the files named by `--tls-cert-file` and
/// `--tls-private-key-file` change (a renewed Secret): upstream's apiserver follows them too
/// (k8s.io/apiserver v0.34 pkg/server/dynamiccertificates `DynamicCertKeyPairContent`, re-read
/// on file events and every minute). New handshakes get the new certificate; open connections
/// keep theirs.
#[derive(Debug)]
pub struct ServedCert {
    current: std::sync::RwLock<Arc<CertifiedKey>>,
}

impl ServedCert {
    fn get(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set(&self, key: Arc<CertifiedKey>) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = key;
    }
}

impl rustls::server::ResolvesServerCert for ServedCert {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

/// The chain and key as rustls serves them; refuses a key that does not belong to the
/// certificate.
fn certified(cert: ServingCert) -> Result<Arc<CertifiedKey>, TlsError> {
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(cert.chain, cert.key, &provider)
        .map(Arc::new)
        .map_err(|e| TlsError::Mismatch {
            origin: cert.origin,
            reason: e.to_string(),
        })
}

/// A rustls server configuration serving `cert` with HTTP/2 and HTTP/1.1 (ALPN), and the handle
/// [`follow`] swaps it through. Refuses a key that does not belong to the certificate.
pub fn server_config(
    cert: ServingCert,
) -> Result<(rustls::ServerConfig, Arc<ServedCert>), TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let served = Arc::new(ServedCert {
        current: std::sync::RwLock::new(certified(cert)?),
    });
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Generate(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(served.clone());
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok((config, served))
}

/// How often [`follow`] reads the certificate files again.
pub const CERT_CHECK_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);

/// Re-reads `--tls-cert-file` and `--tls-private-key-file` every `period` and serves them once
/// their content changed and they make a pair; a pair that does not is logged once and the
/// working certificate stays. Nothing to follow for a generated certificate.
pub async fn follow(served: Arc<ServedCert>, opts: CertOptions, period: std::time::Duration) {
    let (Some(cert), Some(key)) = (opts.cert_file, opts.key_file) else {
        return;
    };
    let contents = || (std::fs::read(&cert).ok(), std::fs::read(&key).ok());
    let mut seen = contents();
    loop {
        tokio::time::sleep(period).await;
        let now = contents();
        if now == seen {
            continue;
        }
        seen = now;
        match read_pair(CERT_FLAG, &cert, KEY_FLAG, &key).and_then(certified) {
            Ok(key) => {
                served.set(key);
                tracing::info!(
                    "serving certificate {} changed: new connections get it",
                    cert.display()
                );
            }
            Err(e) => tracing::warn!(
                "serving certificate changed but cannot be served ({e}); keeping the current one"
            ),
        }
    }
}

fn read_pair(
    cert_flag: &'static str,
    cert: &Path,
    key_flag: &'static str,
    key: &Path,
) -> Result<ServingCert, TlsError> {
    let read = |flag, path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            flag,
            path: path.to_path_buf(),
            source,
        })
    };
    let chain = parse_certs(cert_flag, cert, &read(cert_flag, cert)?)?;
    let key_der = parse_key(key_flag, key, &read(key_flag, key)?)?;
    Ok(ServingCert {
        chain,
        key: key_der,
        origin: format!(
            "{cert_flag} {} and {key_flag} {}",
            cert.display(),
            key.display()
        ),
    })
}

fn parse_certs(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let parse_error = |reason: String| TlsError::Parse {
        flag,
        path: path.to_path_buf(),
        reason,
    };
    let chain = rustls_pemfile::certs(&mut BufReader::new(pem))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| parse_error(format!("not PEM: {e}")))?;
    if chain.is_empty() {
        return Err(parse_error("no PEM CERTIFICATE block".into()));
    }
    // rustls would only notice a broken certificate at the first handshake.
    for c in &chain {
        rustls::server::ParsedCertificate::try_from(c)
            .map_err(|e| parse_error(format!("not an X.509 certificate: {e}")))?;
    }
    Ok(chain)
}

fn parse_key(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<PrivateKeyDer<'static>, TlsError> {
    let parse_error = |reason: String| TlsError::Parse {
        flag,
        path: path.to_path_buf(),
        reason,
    };
    let key = rustls_pemfile::private_key(&mut BufReader::new(pem))
        .map_err(|e| parse_error(format!("not PEM: {e}")))?
        .ok_or_else(|| parse_error("no PEM PRIVATE KEY block".into()))?;
    rustls::crypto::ring::default_provider()
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| parse_error(format!("unusable private key: {e}")))?;
    Ok(key)
}

/// A self-signed certificate and its key (PEM), for `localhost` and 127.0.0.1 like upstream's
/// (client-go util/cert `GenerateSelfSignedCertKeyWithFixtures("localhost", [127.0.0.1], ..)`):
/// CN `localhost@<unix time>`, valid one year. Upstream signs it with a throw-away CA; here it
/// signs itself (a client either skips verification or pins this certificate alike).
fn self_signed(bind: Option<IpAddr>) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let generate = |e: rcgen::Error| TlsError::Generate(e.to_string());
    let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    if let Some(ip) = bind.filter(|ip| !ip.is_unspecified()) {
        names.push(ip.to_string());
    }
    let mut params = rcgen::CertificateParams::new(names).map_err(generate)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("localhost@{now}"));
    let start = jiff::Timestamp::now();
    let to_offset = |t: jiff::Timestamp| {
        rcgen::date_time_ymd(1970, 1, 1)
            + std::time::Duration::from_secs(u64::try_from(t.as_second()).unwrap_or_default())
    };
    params.not_before = to_offset(start - jiff::SignedDuration::from_hours(1));
    params.not_after = to_offset(start + jiff::SignedDuration::from_hours(24 * 365));
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = rcgen::KeyPair::generate().map_err(generate)?;
    let cert = params.self_signed(&key).map_err(generate)?;
    Ok((cert.pem().into_bytes(), key.serialize_pem().into_bytes()))
}

/// Writes `pem` readable by the owner only (a key must not be world-readable).
fn write_private(path: &Path, pem: &[u8]) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let write = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(write)?;
    f.write_all(pem).map_err(write)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "secure-tls-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn rand_suffix() -> u64 {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(0u8)
    }

    #[test]
    fn generates_in_memory_without_files_or_dir() {
        let c = serving_cert(&CertOptions::default()).unwrap();
        assert_eq!(c.chain.len(), 1);
        assert!(c.origin.contains("in memory"));
        server_config(c).unwrap();
    }

    #[test]
    fn cert_dir_pair_is_written_then_reused() {
        let d = dir();
        let opts = CertOptions {
            cert_dir: Some(d.clone()),
            pair_name: "cloud-controller-manager".into(),
            ..CertOptions::default()
        };
        let first = serving_cert(&opts).unwrap();
        assert!(d.join("cloud-controller-manager.crt").exists());
        let second = serving_cert(&opts).unwrap();
        assert_eq!(first.chain, second.chain, "the written pair is read back");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn bad_files_name_the_flag_and_file() {
        let d = dir();
        let (cert_pem, key_pem) = self_signed(None).unwrap();
        let (_, other_key) = self_signed(None).unwrap();
        let write = |name: &str, body: &[u8]| {
            let p = d.join(name);
            std::fs::write(&p, body).unwrap();
            p
        };
        let cert = write("c.pem", &cert_pem);
        let key = write("k.pem", &key_pem);
        let junk = write("junk.pem", b"not a certificate\n");
        let other = write("other.pem", &other_key);
        let files = |c: &Path, k: &Path| CertOptions {
            cert_file: Some(c.to_path_buf()),
            key_file: Some(k.to_path_buf()),
            ..CertOptions::default()
        };
        let err = |o: CertOptions| match serving_cert(&o) {
            Err(e) => e.to_string(),
            Ok(c) => server_config(c).map(|_| ()).unwrap_err().to_string(),
        };
        let e = err(files(&junk, &key));
        assert!(
            e.contains("--tls-cert-file") && e.contains("junk.pem"),
            "{e}"
        );
        let e = err(files(&cert, &junk));
        assert!(
            e.contains("--tls-private-key-file") && e.contains("junk.pem"),
            "{e}"
        );
        let e = err(files(&d.join("missing.pem"), &key));
        assert!(
            e.contains("--tls-cert-file") && e.contains("missing.pem"),
            "{e}"
        );
        let e = err(files(&cert, &other));
        assert!(
            e.contains("--tls-private-key-file") && e.contains("other.pem"),
            "{e}"
        );
        let e = err(CertOptions {
            cert_file: Some(cert.clone()),
            ..CertOptions::default()
        });
        assert!(e.contains("--tls-private-key-file"), "{e}");
        let _ = std::fs::remove_dir_all(d);
    }
}
