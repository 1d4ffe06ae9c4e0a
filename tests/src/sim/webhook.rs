//! One HTTPS server for every admission webhook the bed plays (Harvester's LoadBalancer mutator
//! and validator, Harvester's own validators, KubeVirt's ...), each a real admission webhook of
//! the Harvester kube-apiserver, routed by URL path.
//!
//! How to add one:
//! 1. write a handler: an async function from the AdmissionReview's `request` (JSON, with
//!    `request.object.metadata.namespace` filled from `request.namespace` when the object has
//!    none) to a [`Verdict`], and wrap it with [`handler`];
//! 2. `server.route(path, handler)` on the bed's server (`bed.webhooks`);
//! 3. `server.register(client, &Registration { .. })`: a Mutating- or ValidatingWebhookConfiguration
//!    with `clientConfig.url = https://127.0.0.1:<port><path>` and `caBundle` = the server's CA
//!    (`pki.lb_webhook_ca`; its serving cert `pki.lb_webhook` names 127.0.0.1).
//!
//! ```ignore
//! server.route("/kubevirt/vm-validate", handler(|req| async move {
//!     if req["operation"] == "DELETE" { Verdict::Allow } else { Verdict::Refuse(Refusal::invalid("no")) }
//! }));
//! server.register(&client, &Registration::validating("kubevirt-validator", "vm.kubevirt.io",
//!     "/kubevirt/vm-validate", vec![Rule::new(&["CREATE"], "kubevirt.io", "v1", "virtualmachines", "Namespaced")])).await?;
//! ```
//!
//! Each path is one upstream server's endpoint; where two upstream servers use the same path
//! (harvester/webhook serves every server's validators on `/v1/webhook/validation`), the later
//! one is routed under a prefix naming it. The answer's shape is harvester/webhook v0.1.5
//! `pkg/server/admission/admission.go` (`allowed`, a JSONPatch, or `allowed: false` with a
//! `metav1.Status` whose code and reason come from `pkg/error/error.go`). Unknown paths are 404,
//! bodies that are not an AdmissionReview 400: nothing panics on bad input.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use base64::Engine;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::BedError;
use crate::bed::certs::Pki;

/// What a webhook answers.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Allow,
    /// Allowed with this JSONPatch (an empty one is a plain allow).
    Patch(Vec<Value>),
    Refuse(Refusal),
}

/// `allowed: false` with this `metav1.Status` (harvester/webhook `pkg/error/error.go`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: u16,
    pub reason: String,
    pub message: String,
    /// `details.causes` of the Status (KubeVirt's admitters give one per rule broken: `type`,
    /// `message`, `field`); empty: no `details`.
    pub causes: Vec<Value>,
}

impl Refusal {
    /// 500 InternalError: also what harvester/webhook makes of a plain Go `error`.
    pub fn internal(message: impl Into<String>) -> Refusal {
        Refusal::new(500, "InternalError", message)
    }
    /// 400 BadRequest (`werror.NewBadRequest`).
    pub fn bad_request(message: impl Into<String>) -> Refusal {
        Refusal::new(400, "BadRequest", message)
    }
    /// 422 Invalid (`werror.NewInvalidError`).
    pub fn invalid(message: impl Into<String>) -> Refusal {
        Refusal::new(422, "Invalid", message)
    }
    /// 409 Conflict (`werror.NewConflict`).
    pub fn conflict(message: impl Into<String>) -> Refusal {
        Refusal::new(409, "Conflict", message)
    }
    pub fn new(code: u16, reason: &str, message: impl Into<String>) -> Refusal {
        Refusal {
            code,
            reason: reason.into(),
            message: message.into(),
            causes: Vec::new(),
        }
    }
    /// The same refusal with `details.causes`.
    pub fn with_causes(mut self, causes: Vec<Value>) -> Refusal {
        self.causes = causes;
        self
    }
}

/// An admission webhook: the AdmissionReview's `request` in, the verdict out.
pub type Handler =
    Arc<dyn Fn(Value) -> Pin<Box<dyn Future<Output = Verdict> + Send>> + Send + Sync>;

/// Wraps an async function as a [`Handler`].
pub fn handler<F, Fut>(f: F) -> Handler
where
    F: Fn(Value) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Verdict> + Send + 'static,
{
    Arc::new(move |req| Box::pin(f(req)))
}

/// Mutating or validating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Mutating,
    Validating,
}

/// One rule of a webhook: operations on a resource.
#[derive(Clone, Debug)]
pub struct Rule {
    pub operations: Vec<String>,
    pub group: String,
    pub version: String,
    pub resource: String,
    /// `Namespaced`, `Cluster` or `*`.
    pub scope: String,
}

impl Rule {
    pub fn new(
        operations: &[&str],
        group: &str,
        version: &str,
        resource: &str,
        scope: &str,
    ) -> Rule {
        Rule {
            operations: operations.iter().map(|s| s.to_string()).collect(),
            group: group.into(),
            version: version.into(),
            resource: resource.into(),
            scope: scope.into(),
        }
    }
}

/// A webhook configuration with one webhook, served at `path` of the bed's server.
#[derive(Clone, Debug)]
pub struct Registration {
    pub kind: Kind,
    /// The configuration object's name.
    pub config: String,
    /// The webhook's name in it.
    pub webhook: String,
    pub path: String,
    pub rules: Vec<Rule>,
    /// `Fail` or `Ignore`.
    pub failure_policy: String,
}

impl Registration {
    /// harvester/webhook's defaults for a mutator: `failurePolicy: Ignore`.
    pub fn mutating(config: &str, webhook: &str, path: &str, rules: Vec<Rule>) -> Registration {
        Registration {
            kind: Kind::Mutating,
            config: config.into(),
            webhook: webhook.into(),
            path: path.into(),
            rules,
            failure_policy: "Ignore".into(),
        }
    }
    /// harvester/webhook's defaults for a validator: `failurePolicy: Fail`.
    pub fn validating(config: &str, webhook: &str, path: &str, rules: Vec<Rule>) -> Registration {
        Registration {
            kind: Kind::Validating,
            failure_policy: "Fail".into(),
            ..Registration::mutating(config, webhook, path, rules)
        }
    }

    /// The configuration object (`sideEffects: None`, review versions v1 and v1beta1).
    pub fn object(&self, port: u16, ca_bundle_b64: &str) -> Value {
        let kind = match self.kind {
            Kind::Mutating => "MutatingWebhookConfiguration",
            Kind::Validating => "ValidatingWebhookConfiguration",
        };
        let rules: Vec<Value> = self
            .rules
            .iter()
            .map(|r| {
                json!({"operations": r.operations, "apiGroups": [r.group], "apiVersions": [r.version],
                       "resources": [r.resource], "scope": r.scope})
            })
            .collect();
        json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
            "metadata": {"name": self.config},
            "webhooks": [{
                "name": self.webhook,
                "clientConfig": {"url": format!("https://127.0.0.1:{port}{}", self.path), "caBundle": ca_bundle_b64},
                "rules": rules,
                "failurePolicy": self.failure_policy,
                "sideEffects": "None",
                "admissionReviewVersions": ["v1", "v1beta1"],
            }]
        })
    }
}

type Routes = Arc<Mutex<BTreeMap<String, Handler>>>;

/// The webhook server; dropping it stops serving.
pub struct WebhookServer {
    pub port: u16,
    routes: Routes,
    calls: Arc<Mutex<BTreeMap<String, usize>>>,
    tasks: JoinSet<()>,
}

impl WebhookServer {
    /// Serves on 127.0.0.1 (a free port) with the bed's webhook serving cert.
    pub async fn start(pki: &Pki) -> Result<WebhookServer, BedError> {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls_config(pki)?));
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| BedError::Setup(format!("webhook server: binding 127.0.0.1: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| BedError::Setup(format!("webhook server: {e}")))?
            .port();
        let routes: Routes = Default::default();
        let calls: Arc<Mutex<BTreeMap<String, usize>>> = Default::default();
        let mut tasks = JoinSet::new();
        tasks.spawn(serve(listener, acceptor, routes.clone(), calls.clone()));
        Ok(WebhookServer {
            port,
            routes,
            calls,
            tasks,
        })
    }

    /// Serves `handler` at `path` (replacing one already there).
    pub fn route(&self, path: &str, handler: Handler) {
        lock(&self.routes).insert(path.to_string(), handler);
    }

    /// Admission requests answered at `path` (any outcome).
    pub fn calls(&self, path: &str) -> usize {
        lock(&self.calls).get(path).copied().unwrap_or(0)
    }

    /// Routes `admit` at `path` (each call gets a clone of `client` to read with) and registers
    /// `reg`: what every validator of the bed does to install itself.
    pub async fn install<F, Fut>(
        &self,
        client: &kube::Client,
        pki: &Pki,
        reg: &Registration,
        path: &str,
        admit: F,
    ) -> Result<(), BedError>
    where
        F: Fn(kube::Client, Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Verdict> + Send + 'static,
    {
        let c = client.clone();
        self.route(path, handler(move |request| admit(c.clone(), request)));
        self.register(client, pki, reg).await
    }

    /// Creates or updates the webhook configuration of `reg`, pointing at this server. The API
    /// server may take a moment to call it: wait with a probe of your own.
    pub async fn register(
        &self,
        client: &kube::Client,
        pki: &Pki,
        reg: &Registration,
    ) -> Result<(), BedError> {
        let ca = base64::engine::general_purpose::STANDARD.encode(&pki.lb_webhook_ca.cert_pem);
        crate::bed::apply::apply_yaml(client, &reg.object(self.port, &ca).to_string(), "default")
            .await
            .map(|_| ())
    }
}

impl Drop for WebhookServer {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The AdmissionReview answering `review` with `verdict` (same apiVersion and uid).
pub fn review_response(review: &Value, verdict: Verdict) -> Value {
    let uid = review
        .pointer("/request/uid")
        .cloned()
        .unwrap_or(Value::String(String::new()));
    let api_version = review
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("admission.k8s.io/v1");
    let response = match verdict {
        Verdict::Allow => json!({"uid": uid, "allowed": true}),
        Verdict::Patch(patch) if patch.is_empty() => json!({"uid": uid, "allowed": true}),
        Verdict::Patch(patch) => json!({
            "uid": uid, "allowed": true, "patchType": "JSONPatch",
            "patch": base64::engine::general_purpose::STANDARD.encode(Value::Array(patch).to_string()),
        }),
        Verdict::Refuse(r) => {
            let mut status = json!({"status": "Failure", "message": r.message, "reason": r.reason, "code": r.code});
            if !r.causes.is_empty() {
                status["details"] = json!({"causes": r.causes});
            }
            json!({"uid": uid, "allowed": false, "status": status})
        }
    };
    json!({"apiVersion": api_version, "kind": "AdmissionReview", "response": response})
}

fn tls_config(pki: &Pki) -> Result<rustls::ServerConfig, BedError> {
    let e = |what: &str, e: &dyn std::fmt::Display| {
        BedError::Setup(format!("webhook server TLS {what}: {e}"))
    };
    let certs: Vec<CertificateDer<'static>> =
        rustls_pemfile::certs(&mut pki.lb_webhook.cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|x| e("cert", &x))?;
    let key: PrivateKeyDer<'static> =
        rustls_pemfile::private_key(&mut pki.lb_webhook.key_pem.as_bytes())
            .map_err(|x| e("key", &x))?
            .ok_or_else(|| BedError::Setup("webhook server TLS key: none in PEM".into()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|x| e("versions", &x))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|x| e("cert", &x))?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

async fn serve(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    routes: Routes,
    calls: Arc<Mutex<BTreeMap<String, usize>>>,
) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let acceptor = acceptor.clone();
        let (routes, calls) = (routes.clone(), calls.clone());
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(tls) => tls,
                Err(e) => {
                    tracing::debug!("webhook server: TLS handshake: {e}");
                    return;
                }
            };
            let svc = hyper::service::service_fn(move |req| {
                let (routes, calls) = (routes.clone(), calls.clone());
                async move { Ok::<_, Infallible>(handle(req, &routes, &calls).await) }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), svc)
                .await;
        });
    }
}

fn reply(code: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

async fn handle(
    req: Request<Incoming>,
    routes: &Routes,
    calls: &Mutex<BTreeMap<String, usize>>,
) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let Some(h) = lock(routes).get(&path).cloned() else {
        return reply(StatusCode::NOT_FOUND, "{}".into());
    };
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return reply(
                StatusCode::BAD_REQUEST,
                json!({"error": e.to_string()}).to_string(),
            );
        }
    };
    let review: Value = match serde_json::from_slice::<Value>(&body) {
        Ok(v) if v.get("request").is_some_and(Value::is_object) => v,
        Ok(_) => {
            return reply(
                StatusCode::BAD_REQUEST,
                json!({"error": "not an AdmissionReview: no request"}).to_string(),
            );
        }
        Err(e) => {
            return reply(
                StatusCode::BAD_REQUEST,
                json!({"error": format!("not an AdmissionReview: {e}")}).to_string(),
            );
        }
    };
    *lock(calls).entry(path.clone()).or_default() += 1;
    let request = with_namespace(review.get("request").cloned().unwrap_or(Value::Null));
    let verdict = h(request).await;
    if let Verdict::Refuse(r) = &verdict {
        tracing::info!("webhook {path} refuses: {}", r.message);
    }
    reply(
        StatusCode::OK,
        review_response(&review, verdict).to_string(),
    )
}

/// Upstream decodes the object from the request, whose namespace the API server sets: an object
/// sent without `metadata.namespace` (a create in a namespace) gets `request.namespace`.
fn with_namespace(mut request: Value) -> Value {
    let ns = request
        .get("namespace")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if ns.is_empty() {
        return request;
    }
    for key in ["object", "oldObject"] {
        let Some(obj) = request.get_mut(key).and_then(Value::as_object_mut) else {
            continue;
        };
        let Some(meta) = obj
            .entry("metadata")
            .or_insert_with(|| json!({}))
            .as_object_mut()
        else {
            continue;
        };
        let missing = meta
            .get("namespace")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty);
        if missing {
            meta.insert("namespace".into(), ns.clone().into());
        }
    }
    request
}

/// Waits, 30 s at most, until the API server calls validating webhook `webhook_name`: a dry-run
/// create of `probe`, which the webhook refuses, comes back refused by it. `what` names the wait.
pub async fn wait_refused<K>(
    api: kube::Api<K>,
    probe: K,
    webhook_name: &str,
    what: &str,
) -> Result<(), BedError>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned,
{
    let params = kube::api::PostParams {
        dry_run: true,
        ..Default::default()
    };
    crate::util::wait::until(what, std::time::Duration::from_secs(30), || {
        let (api, probe, params) = (api.clone(), probe.clone(), params.clone());
        async move {
            Ok(match api.create(&params, &probe).await {
                Err(kube::Error::Api(s)) if s.message.contains(webhook_name) => Ok(()),
                other => Err(other.map(|_| "admitted").map_err(|e| e.to_string())),
            })
        }
    })
    .await
    .map_err(BedError::Setup)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn review_response_carries_uid_and_a_base64_json_patch() {
        let review = json!({"apiVersion": "admission.k8s.io/v1", "request": {"uid": "u-1"}});
        let r = review_response(
            &review,
            Verdict::Patch(vec![json!({"op": "add", "path": "/a", "value": 1})]),
        );
        assert_eq!(r["response"]["uid"], "u-1");
        assert_eq!(r["response"]["patchType"], "JSONPatch");
        let raw = base64::engine::general_purpose::STANDARD
            .decode(r["response"]["patch"].as_str().unwrap())
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&raw).unwrap()[0]["path"],
            "/a"
        );
        let no = review_response(&review, Verdict::Refuse(Refusal::internal("boom")));
        assert_eq!(no["response"]["allowed"], false);
        assert_eq!(no["response"]["status"]["code"], 500);
        assert_eq!(no["response"]["status"]["reason"], "InternalError");
        assert_eq!(no["response"]["status"]["message"], "boom");
        assert_eq!(
            review_response(&review, Verdict::Patch(vec![]))["response"].get("patch"),
            None
        );
        assert_eq!(
            review_response(&review, Verdict::Allow)["response"]["allowed"],
            true
        );
    }

    #[test]
    fn the_request_namespace_fills_objects_without_one() {
        let r = with_namespace(
            json!({"namespace": "ns1", "object": {"metadata": {"name": "a"}},
                                      "oldObject": {"metadata": {"namespace": "kept"}}}),
        );
        assert_eq!(r["object"]["metadata"]["namespace"], "ns1");
        assert_eq!(r["oldObject"]["metadata"]["namespace"], "kept");
        for bad in [
            json!(null),
            json!({"namespace": 3}),
            json!({"namespace": "x", "object": 1}),
            json!({"namespace": "x", "object": {"metadata": []}}),
        ] {
            let _ = with_namespace(bad);
            let _ = review_response(&json!(7), Verdict::Allow);
        }
    }

    #[test]
    fn registrations_have_upstreams_defaults() {
        let rule = Rule::new(&["CREATE"], "g", "v1", "things", "Namespaced");
        let m = Registration::mutating("c", "w", "/m", vec![rule.clone()]).object(8443, "Q0E=");
        assert_eq!(m["kind"], "MutatingWebhookConfiguration");
        assert_eq!(m["webhooks"][0]["failurePolicy"], "Ignore");
        assert_eq!(
            m["webhooks"][0]["clientConfig"]["url"],
            "https://127.0.0.1:8443/m"
        );
        let v = Registration::validating("c", "w", "/v", vec![rule]).object(1, "");
        assert_eq!(v["kind"], "ValidatingWebhookConfiguration");
        assert_eq!(v["webhooks"][0]["failurePolicy"], "Fail");
        assert_eq!(v["webhooks"][0]["sideEffects"], "None");
        assert_eq!(v["webhooks"][0]["rules"][0]["resources"][0], "things");
    }
}
