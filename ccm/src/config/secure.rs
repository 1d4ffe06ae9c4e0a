//! Flags of the HTTPS endpoints, as upstream's cloud provider takes them (k8s.io/cloud-provider
//! v0.34 options/options.go: `SecureServingOptions` with port 10258 and pair name
//! `cloud-controller-manager`, `DelegatingAuthenticationOptions`, `DelegatingAuthorizationOptions`;
//! defaults in k8s.io/apiserver pkg/server/options), parsed into a typed [`SecureServing`].
//! The files named by the TLS flags are read at start (`main`), not here.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use crate::secure::auth::{AuthOptions, check_allow_path};
use crate::secure::tls::CertOptions;
use clap::Args;

use super::{ConfigError, parse_go_duration};

/// `cloudprovider.CloudControllerManagerPort` (k8s.io/cloud-provider ports.go).
pub const DEFAULT_SECURE_PORT: u16 = 10258;
/// The generated pair's file name in `--cert-dir` (options.go `ServerCert.PairName`).
const PAIR_NAME: &str = "cloud-controller-manager";

/// Secure serving, authentication and authorization flags.
#[derive(Args, Debug, Clone)]
pub struct SecureFlags {
    /// Address of the HTTPS endpoints (/healthz, /readyz, /livez, /metrics); 0.0.0.0 or :: for
    /// every interface.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind_address: IpAddr,
    /// Port of the HTTPS endpoints; 0 turns them off.
    #[arg(long, default_value_t = DEFAULT_SECURE_PORT)]
    pub secure_port: u16,
    /// Where a generated self-signed pair is written and read back (in memory when empty).
    #[arg(long, default_value = "")]
    pub cert_dir: String,
    /// Serving certificate (PEM, chain after it); self-signed when neither this nor
    /// --tls-private-key-file is given.
    #[arg(long, default_value = "")]
    pub tls_cert_file: String,
    /// Key of --tls-cert-file (PEM).
    #[arg(long, default_value = "")]
    pub tls_private_key_file: String,
    /// Paths served without a token or an authorization check (a trailing `*` is a prefix).
    #[arg(long, value_delimiter = ',', default_value = "/healthz,/readyz,/livez")]
    pub authorization_always_allow_paths: Vec<String>,
    /// Kubeconfig of the API server that answers TokenReviews; the guest cluster client
    /// (--kubeconfig or in-cluster) when empty.
    #[arg(long, default_value = "")]
    pub authentication_kubeconfig: String,
    /// Kubeconfig of the API server that answers SubjectAccessReviews; as above when empty.
    #[arg(long, default_value = "")]
    pub authorization_kubeconfig: String,
    /// How long a TokenReview's answer is reused.
    #[arg(long, default_value = "10s")]
    pub authentication_token_webhook_cache_ttl: String,
    /// How long an allowing SubjectAccessReview's answer is reused.
    #[arg(long, default_value = "10s")]
    pub authorization_webhook_cache_authorized_ttl: String,
    /// How long a denying SubjectAccessReview's answer is reused.
    #[arg(long, default_value = "10s")]
    pub authorization_webhook_cache_unauthorized_ttl: String,
}

/// The HTTPS endpoints' configuration; `addr` is `None` with `--secure-port=0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecureServing {
    pub addr: Option<SocketAddr>,
    pub cert: CertOptions,
    pub auth: AuthOptions,
    /// `--authentication-kubeconfig`; `None`: the guest cluster client.
    pub authentication_kubeconfig: Option<PathBuf>,
    /// `--authorization-kubeconfig`; `None`: the guest cluster client.
    pub authorization_kubeconfig: Option<PathBuf>,
}

impl SecureServing {
    pub fn from_flags(f: &SecureFlags) -> Result<SecureServing, ConfigError> {
        let path =
            |raw: &str| Some(PathBuf::from(raw.trim())).filter(|p| !p.as_os_str().is_empty());
        let ttl = |flag: &'static str, raw: &str| {
            parse_go_duration(raw).map_err(|r| ConfigError::new(flag, raw, r))
        };
        let always_allow_paths = f
            .authorization_always_allow_paths
            .iter()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .map(|p| {
                check_allow_path(&p)
                    .map(|()| p.clone())
                    .map_err(|r| ConfigError::new("--authorization-always-allow-paths", &p, r))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SecureServing {
            authentication_kubeconfig: path(&f.authentication_kubeconfig),
            authorization_kubeconfig: path(&f.authorization_kubeconfig),
            addr: (f.secure_port != 0).then(|| SocketAddr::new(f.bind_address, f.secure_port)),
            cert: CertOptions {
                cert_file: path(&f.tls_cert_file),
                key_file: path(&f.tls_private_key_file),
                cert_dir: path(&f.cert_dir),
                pair_name: PAIR_NAME.into(),
                bind: Some(f.bind_address),
            },
            auth: AuthOptions {
                always_allow_paths,
                token_cache_ttl: ttl(
                    "--authentication-token-webhook-cache-ttl",
                    &f.authentication_token_webhook_cache_ttl,
                )?,
                allowed_cache_ttl: ttl(
                    "--authorization-webhook-cache-authorized-ttl",
                    &f.authorization_webhook_cache_authorized_ttl,
                )?,
                denied_cache_ttl: ttl(
                    "--authorization-webhook-cache-unauthorized-ttl",
                    &f.authorization_webhook_cache_unauthorized_ttl,
                )?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_args;
    use std::time::Duration;

    fn secure(args: &[&str]) -> Result<SecureServing, String> {
        let argv = std::iter::once("harvester-cloud-provider").chain(args.iter().copied());
        let parsed = parse_args(argv).map_err(|o| format!("{o:?}"))?;
        SecureServing::from_flags(&parsed.flags.secure).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_are_upstreams() {
        let s = secure(&[]).unwrap();
        assert_eq!(s.addr, Some("0.0.0.0:10258".parse().unwrap()));
        assert_eq!(s.cert.cert_file, None);
        assert_eq!(s.cert.cert_dir, None);
        assert_eq!(s.authentication_kubeconfig, None);
        assert_eq!(s.cert.pair_name, "cloud-controller-manager");
        assert_eq!(s.auth, AuthOptions::default());
        assert_eq!(s.auth.always_allow_paths, ["/healthz", "/readyz", "/livez"]);
        assert_eq!(s.auth.token_cache_ttl, Duration::from_secs(10));
    }

    #[test]
    fn flags_set_what_upstream_sets() {
        let s = secure(&[
            "--bind-address=127.0.0.1",
            "--secure-port=8443",
            "--tls-cert-file=/c.pem",
            "--tls-private-key-file=/k.pem",
            "--cert-dir=/d",
            "--authentication-kubeconfig=/authn",
            "--authorization-kubeconfig=/authz",
            "--authorization-always-allow-paths=/healthz,/debug/*",
            "--authentication-token-webhook-cache-ttl=1m",
            "--authorization-webhook-cache-authorized-ttl=5s",
            "--authorization-webhook-cache-unauthorized-ttl=0s",
        ])
        .unwrap();
        assert_eq!(s.addr, Some("127.0.0.1:8443".parse().unwrap()));
        assert_eq!(s.cert.cert_file, Some("/c.pem".into()));
        assert_eq!(s.cert.key_file, Some("/k.pem".into()));
        assert_eq!(s.cert.cert_dir, Some("/d".into()));
        assert_eq!(s.authentication_kubeconfig, Some("/authn".into()));
        assert_eq!(s.authorization_kubeconfig, Some("/authz".into()));
        assert_eq!(s.auth.always_allow_paths, ["/healthz", "/debug/*"]);
        assert_eq!(s.auth.token_cache_ttl, Duration::from_secs(60));
        assert_eq!(s.auth.allowed_cache_ttl, Duration::from_secs(5));
        assert_eq!(s.auth.denied_cache_ttl, Duration::ZERO);
        assert_eq!(secure(&["--secure-port=0"]).unwrap().addr, None);
        let none = secure(&["--authorization-always-allow-paths="]).unwrap();
        assert!(none.auth.always_allow_paths.is_empty());
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (args, flag) in [
            (&["--secure-port=70000"][..], "--secure-port"),
            (&["--bind-address=nowhere"][..], "--bind-address"),
            (
                &["--authorization-always-allow-paths=/a*b"][..],
                "--authorization-always-allow-paths",
            ),
            (
                &["--authentication-token-webhook-cache-ttl=soon"][..],
                "--authentication-token-webhook-cache-ttl",
            ),
        ] {
            let e = secure(args).unwrap_err();
            assert!(e.contains(flag), "{args:?}: {e}");
        }
    }
}
