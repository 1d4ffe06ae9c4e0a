//! The Harvester "cloud-config": a kubeconfig for the Harvester cluster whose current context's
//! namespace is the namespace holding the guest VMs (same format and path as upstream).
//!
//! The client [`Harvester::load`] returns follows the file: when the cloud-config changes (a
//! rotated Secret shows up as a new file), the next requests go out with the new credentials, no
//! restart needed. It also keeps what an operator must know: when the token expires (JWT `exp`),
//! and whether Harvester last answered 401 Unauthorized.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use base64::Engine;
use http::{Request, Response};
use kube::client::Body;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::telemetry::{Metrics, Readiness};

/// Default path of the cloud-config inside the upstream charts' pods.
pub const DEFAULT_PATH: &str = "/etc/kubernetes/cloud-config";
/// How often the file is checked for a new version.
pub const DEFAULT_RELOAD_PERIOD: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum CloudConfigError {
    #[error("reading cloud-config {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("cloud-config {path} has no usable current context: {source}")]
    Context {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("building the Harvester client from cloud-config {path}: {source}")]
    Client {
        path: PathBuf,
        #[source]
        source: kube::Error,
    },
}

/// What is known about the credentials in use.
#[derive(Debug, Default)]
struct Status {
    /// `exp` of the token, if it is a JWT that has one.
    token_expiry: Option<jiff::Timestamp>,
    /// Set by a 401 from Harvester, cleared by the next success.
    unauthorized: Option<String>,
    /// Content of the file the current client was built from.
    loaded: Vec<u8>,
    /// When a request last got a success, and when one last got a 401 or no answer.
    answered: Option<Instant>,
    failed: Option<Instant>,
}

struct Shared {
    current: RwLock<kube::Client>,
    status: RwLock<Status>,
    path: PathBuf,
    metrics: Option<Metrics>,
}

/// A client for the Harvester cluster and the namespace that holds the guest VMs.
#[derive(Clone)]
pub struct Harvester {
    pub client: kube::Client,
    pub namespace: String,
    pub path: PathBuf,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Harvester {
    // The client holds credentials; never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harvester")
            .field("namespace", &self.namespace)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

struct Loaded {
    client: kube::Client,
    namespace: String,
    token_expiry: Option<jiff::Timestamp>,
    bytes: Vec<u8>,
    /// [`weakened_transport`] of the file.
    weakened: Vec<String>,
}

async fn build(path: &Path, metrics: Option<&Metrics>) -> Result<Loaded, CloudConfigError> {
    let bytes = std::fs::read(path).unwrap_or_default();
    let kubeconfig = Kubeconfig::read_from(path).map_err(|source| CloudConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let token_expiry = current_token(&kubeconfig).as_deref().and_then(jwt_expiry);
    let weakened = weakened_transport(&kubeconfig);
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| CloudConfigError::Context {
            path: path.to_path_buf(),
            source,
        })?;
    let namespace = config.default_namespace.clone();
    let client = crate::api_client::kube_client(config, metrics).map_err(|source| {
        CloudConfigError::Client {
            path: path.to_path_buf(),
            source,
        }
    })?;
    Ok(Loaded {
        client,
        namespace,
        token_expiry,
        bytes,
        weakened,
    })
}

/// What in the current context of `kc` weakens how the credential travels, each said in a
/// sentence naming the option: a plain-HTTP server, TLS verification turned off, credentials
/// from a program the cloud-config names. Kubernetes' clients honour all three, and so do the
/// programs (a drop-in cloud-config keeps working), but each is said once at start.
pub fn weakened_transport(kc: &Kubeconfig) -> Vec<String> {
    let Some(ctx) = current_context(kc) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let cluster = kc
        .clusters
        .iter()
        .find(|c| c.name == ctx.cluster)
        .and_then(|c| c.cluster.as_ref());
    if let Some(cluster) = cluster {
        if let Some(server) = cluster
            .server
            .as_deref()
            .filter(|s| s.starts_with("http://"))
        {
            found.push(format!(
                "server {server} is plain HTTP: the token and every request travel unencrypted"
            ));
        }
        if cluster.insecure_skip_tls_verify == Some(true) {
            found.push(
                "insecure-skip-tls-verify is true: Harvester's certificate is not verified, so \
                 anyone on the path can read the token"
                    .to_string(),
            );
        }
    }
    let exec = current_auth(kc).and_then(|a| a.exec.as_ref());
    if let Some(exec) = exec {
        found.push(format!(
            "the credentials come from running {:?} (exec): a program the cloud-config names runs \
             with this process's rights",
            exec.command.as_deref().unwrap_or_default()
        ));
    }
    found
}

/// The current context of `kc`.
fn current_context(kc: &Kubeconfig) -> Option<&kube::config::Context> {
    let name = kc.current_context.as_ref()?;
    kc.contexts
        .iter()
        .find(|c| &c.name == name)?
        .context
        .as_ref()
}

/// The credentials of the current context's user.
fn current_auth(kc: &Kubeconfig) -> Option<&kube::config::AuthInfo> {
    let user = current_context(kc)?.user.clone().unwrap_or_default();
    kc.auth_infos
        .iter()
        .find(|u| u.name == user)?
        .auth_info
        .as_ref()
}

/// The bearer token of the current context's user, if it has one inline or in a file.
fn current_token(kc: &Kubeconfig) -> Option<String> {
    let auth = current_auth(kc)?;
    if let Some(t) = &auth.token {
        use secrecy::ExposeSecret;
        return Some(t.expose_secret().to_string());
    }
    auth.token_file
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .map(|t| t.trim().to_string())
}

/// `exp` of a JWT (not verified: the server does that; we only want to warn in time).
pub fn jwt_expiry(token: &str) -> Option<jiff::Timestamp> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    jiff::Timestamp::from_second(claims.get("exp")?.as_i64()?).ok()
}

impl Harvester {
    /// Loads the cloud-config at `path`. The namespace is the current context's, `default` if unset.
    pub async fn load(path: &Path) -> Result<Self, CloudConfigError> {
        Self::load_with_metrics(path, None).await
    }

    /// As [`Harvester::load`], counting the client's API requests in `metrics` and exporting the
    /// token's remaining lifetime. The file is re-read every [`DEFAULT_RELOAD_PERIOD`] while a
    /// clone of the returned value lives.
    pub async fn load_with_metrics(
        path: &Path,
        metrics: Option<&Metrics>,
    ) -> Result<Self, CloudConfigError> {
        Self::load_with(path, metrics, DEFAULT_RELOAD_PERIOD).await
    }

    pub async fn load_with(
        path: &Path,
        metrics: Option<&Metrics>,
        reload_period: Duration,
    ) -> Result<Self, CloudConfigError> {
        let loaded = build(path, metrics).await?;
        for weak in &loaded.weakened {
            tracing::warn!(cloud_config = %path.display(), "{weak}");
        }
        let shared = Arc::new(Shared {
            current: RwLock::new(loaded.client.clone()),
            status: RwLock::new(Status {
                token_expiry: loaded.token_expiry,
                unauthorized: None,
                loaded: loaded.bytes,
                ..Status::default()
            }),
            path: path.to_path_buf(),
            metrics: metrics.cloned(),
        });
        let client = kube::Client::new(
            Following {
                shared: Arc::downgrade(&shared),
            },
            loaded.namespace.clone(),
        );
        let harvester = Harvester {
            client,
            namespace: loaded.namespace,
            path: path.to_path_buf(),
            shared: shared.clone(),
        };
        harvester.report_expiry();
        tokio::spawn(follow_file(Arc::downgrade(&shared), reload_period));
        Ok(harvester)
    }

    /// When the token expires, if it is a JWT with `exp`.
    pub fn token_expiry(&self) -> Option<jiff::Timestamp> {
        read(&self.shared.status).token_expiry
    }

    /// `Err` with a message naming the cloud-config while Harvester rejects our credentials.
    pub fn credentials_state(&self) -> Result<(), String> {
        match &read(&self.shared.status).unauthorized {
            None => Ok(()),
            Some(m) => Err(m.clone()),
        }
    }

    /// A warning when the token expires within `warn_before`, for a log line or Event.
    pub fn expiry_warning(&self, warn_before: Duration) -> Option<String> {
        expiry_warning(
            &self.path,
            self.token_expiry()?,
            jiff::Timestamp::now(),
            warn_before,
        )
    }

    fn report_expiry(&self) {
        report_expiry(&self.shared);
    }

    fn answered_cleanly_since(&self, t: Instant) -> bool {
        let status = read(&self.shared.status);
        answered_cleanly(status.answered, status.failed, t)
    }

    /// Keeps the readiness check `check` true while Harvester answers with the cloud-config's
    /// credentials (a 401 or an unreachable server makes it false, naming the file), asking every
    /// `period` ([`CREDENTIALS_CHECK_PERIOD`] in the programs) unless the program's own requests
    /// answered since the last check (a success and no 401 or unanswered request); warns at warn
    /// level, at most hourly, from `warn_before` before the token expires (readiness stays true
    /// then: the credentials still work, the operator must rotate them), and hands the warning
    /// to `on_warning` (the cloud provider makes it an Event on its Pod). Runs until dropped.
    pub async fn watch_credentials(
        &self,
        readiness: &Readiness,
        check: &str,
        warn_before: Duration,
        period: Duration,
        on_warning: impl Fn(&str),
    ) {
        let mut last_warning = None::<Instant>;
        let mut checked = None::<Instant>;
        loop {
            // The program's own requests answered the question since the last check: no probe.
            let answered = checked.is_some_and(|t| self.answered_cleanly_since(t));
            let state = if answered {
                self.credentials_state()
            } else {
                match self.client.apiserver_version().await {
                    Ok(_) => self.credentials_state(),
                    Err(e) => self.credentials_state().and(Err(format!(
                        "Harvester API unreachable with cloud-config {}: {e}",
                        self.path.display()
                    ))),
                }
            };
            // Taken after the probe: its own answer is not one of the program's requests.
            checked = Some(Instant::now());
            readiness.set(check, state);
            if let Some(w) = self.expiry_warning(warn_before)
                && last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(3600))
            {
                tracing::warn!("{w}");
                on_warning(&w);
                last_warning = Some(Instant::now());
            }
            tokio::time::sleep(period).await;
        }
    }
}

/// Pure: whether a request got a success (last at `answered`) since `since` and none got a 401
/// or no answer (last at `failed`).
fn answered_cleanly(answered: Option<Instant>, failed: Option<Instant>, since: Instant) -> bool {
    answered.is_some_and(|a| a > since) && failed.is_none_or(|f| f < since)
}

/// How often the programs' [`Harvester::watch_credentials`] asks Harvester.
pub const CREDENTIALS_CHECK_PERIOD: Duration = Duration::from_secs(30);

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

fn report_expiry(shared: &Shared) {
    if let (Some(m), Some(exp)) = (&shared.metrics, read(&shared.status).token_expiry) {
        let left = exp.as_second() - jiff::Timestamp::now().as_second();
        m.token_expiry_seconds.set(left as f64);
    }
}

/// Pure: the warning for a token expiring at `expiry`, seen at `now`.
pub fn expiry_warning(
    path: &Path,
    expiry: jiff::Timestamp,
    now: jiff::Timestamp,
    warn_before: Duration,
) -> Option<String> {
    let left = expiry.as_second() - now.as_second();
    let warn = i64::try_from(warn_before.as_secs()).unwrap_or(i64::MAX);
    if left > warn {
        return None;
    }
    Some(if left <= 0 {
        format!(
            "the token in cloud-config {} expired at {expiry}: Harvester will refuse every request; rotate the cloud-config Secret",
            path.display()
        )
    } else {
        format!(
            "the token in cloud-config {} expires at {expiry} (in {:.1} days); rotate the cloud-config Secret before then",
            path.display(),
            left as f64 / 86_400.0
        )
    })
}

/// Re-reads the file every `period` while the client lives; rebuilds the client when it changed.
async fn follow_file(shared: Weak<Shared>, period: Duration) {
    loop {
        tokio::time::sleep(period).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        report_expiry(&shared);
        let bytes = match std::fs::read(&shared.path) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(
                    "reading cloud-config {}: {e}; keeping the current credentials",
                    shared.path.display()
                );
                continue;
            }
        };
        if bytes == read(&shared.status).loaded {
            continue;
        }
        match build(&shared.path, shared.metrics.as_ref()).await {
            Ok(loaded) => {
                *write(&shared.current) = loaded.client;
                let mut status = write(&shared.status);
                status.token_expiry = loaded.token_expiry;
                status.loaded = loaded.bytes;
                status.unauthorized = None;
                drop(status);
                report_expiry(&shared);
                tracing::info!(
                    "cloud-config {} changed: the Harvester client now uses it",
                    shared.path.display()
                );
            }
            Err(e) => {
                tracing::warn!(
                    "cloud-config changed but cannot be used ({e}); keeping the current credentials"
                );
                // Do not retry the same broken content every period.
                write(&shared.status).loaded = bytes;
            }
        }
    }
}

/// The tower service under the public client: sends each request with the client built from the
/// current cloud-config, and notes 401s.
#[derive(Clone)]
struct Following {
    shared: Weak<Shared>,
}

impl tower::Service<Request<Body>> for Following {
    type Response = Response<Body>;
    type Error = kube::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, kube::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let shared = self.shared.upgrade();
        Box::pin(async move {
            let Some(shared) = shared else {
                return Err(kube::Error::Service(
                    "the Harvester client was dropped".into(),
                ));
            };
            let client = read(&shared.current).clone();
            let res = client.send(req).await;
            let mut status = write(&shared.status);
            match &res {
                Ok(r) if r.status() == http::StatusCode::UNAUTHORIZED => {
                    status.unauthorized = Some(format!(
                        "Harvester answered 401 Unauthorized: the credentials in cloud-config {} are invalid or expired",
                        shared.path.display()
                    ));
                    status.failed = Some(Instant::now());
                }
                Ok(r) if r.status().is_success() => {
                    status.unauthorized = None;
                    status.answered = Some(Instant::now());
                }
                Ok(_) => {}
                Err(_) => status.failed = Some(Instant::now()),
            }
            drop(status);
            res
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn options_that_weaken_transport_are_named() {
        let kc = |server: &str, extra_cluster: &str, user: &str| {
            Kubeconfig::from_yaml(&format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
                 clusters: [{{name: h, cluster: {{server: \"{server}\"{extra_cluster}}}}}]\n\
                 contexts: [{{name: c, context: {{cluster: h, user: u}}}}]\n\
                 users: [{{name: u, user: {user}}}]\n"
            ))
            .unwrap()
        };
        assert!(weakened_transport(&kc("https://h:6443", "", "{token: t}")).is_empty());
        let plain = weakened_transport(&kc("http://h:6443", "", "{token: t}"));
        assert!(
            plain.len() == 1 && plain[0].contains("plain HTTP"),
            "{plain:?}"
        );
        let skip = weakened_transport(&kc(
            "https://h:6443",
            ", insecure-skip-tls-verify: true",
            "{token: t}",
        ));
        assert!(
            skip.len() == 1 && skip[0].contains("insecure-skip-tls-verify"),
            "{skip:?}"
        );
        let exec = weakened_transport(&kc(
            "https://h:6443",
            "",
            "{exec: {apiVersion: client.authentication.k8s.io/v1, command: get-token}}",
        ));
        assert!(exec.len() == 1 && exec[0].contains("get-token"), "{exec:?}");
    }

    use super::*;

    fn jwt(exp: i64) -> String {
        let b64 = |v: serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        format!(
            "{}.{}.sig",
            b64(serde_json::json!({"alg": "RS256"})),
            b64(serde_json::json!({"sub": "system:serviceaccount:ns:sa", "exp": exp}))
        )
    }

    #[test]
    fn the_probe_is_skipped_only_after_a_success_and_no_failure_since_the_last_check() {
        let t0 = Instant::now();
        let (before, after) = (t0, t0 + Duration::from_secs(1));
        let check = t0 + Duration::from_millis(500);
        assert!(!answered_cleanly(None, None, check), "no request since");
        assert!(
            !answered_cleanly(Some(before), None, check),
            "success too old"
        );
        assert!(answered_cleanly(Some(after), None, check));
        assert!(
            answered_cleanly(Some(after), Some(before), check),
            "old failure"
        );
        assert!(
            !answered_cleanly(Some(after), Some(after), check),
            "a 401 or an unanswered request since"
        );
    }

    #[test]
    fn reads_the_expiry_of_a_jwt_and_nothing_else() {
        assert_eq!(
            jwt_expiry(&jwt(1_900_000_000)).map(|t| t.as_second()),
            Some(1_900_000_000)
        );
        assert_eq!(jwt_expiry("not-a-jwt"), None);
        assert_eq!(jwt_expiry("a.%%%.c"), None);
        assert_eq!(jwt_expiry("kubeconfig-user-xyz:abcdef"), None);
    }

    #[test]
    fn warns_within_the_window_and_names_the_file() {
        let path = Path::new("/etc/kubernetes/cloud-config");
        let now = jiff::Timestamp::from_second(1_000_000).unwrap();
        let week = Duration::from_secs(7 * 86_400);
        let later = |days: i64| jiff::Timestamp::from_second(1_000_000 + days * 86_400).unwrap();
        assert_eq!(expiry_warning(path, later(30), now, week), None);
        let soon = expiry_warning(path, later(3), now, week).unwrap();
        assert!(
            soon.contains("/etc/kubernetes/cloud-config") && soon.contains("3.0 days"),
            "{soon}"
        );
        let gone = expiry_warning(path, later(-1), now, week).unwrap();
        assert!(gone.contains("expired"), "{gone}");
    }
}
