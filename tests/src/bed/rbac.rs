//! Running a program with exactly the RBAC of one ServiceAccount: a token from the TokenRequest
//! API (the bed's kube-apiservers sign them) in a kubeconfig that authenticates with it, and a
//! wait until the API server's authorizer has seen a new binding.

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};

use crate::bed::cluster::client_from_kubeconfig;
use crate::{BedError, bed::certs::Pki, util::wait};

/// Lifetime asked for every token (the API server may shorten it; tests are far shorter).
const TOKEN_SECONDS: i64 = 3600;

/// A token of ServiceAccount `namespace/name`, minted with `client` (an admin client of the API
/// server that holds the account).
pub async fn token(client: &kube::Client, namespace: &str, name: &str) -> Result<String, BedError> {
    token_for(client, namespace, name, TOKEN_SECONDS).await
}

/// [`token`] with a lifetime of `seconds`.
pub async fn token_for(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    seconds: i64,
) -> Result<String, BedError> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(seconds),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = api
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(|e| BedError::Api(format!("TokenRequest for {namespace}/{name}: {e}")))?;
    answer
        .status
        .map(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| BedError::Api(format!("TokenRequest for {namespace}/{name}: no token")))
}

/// A kubeconfig (JSON) for `server` that authenticates with the bearer `token`; `namespace` is
/// its context's namespace (for a cloud-config: the namespace of the guest VMs).
pub fn token_kubeconfig_text(server: &str, pki: &Pki, token: &str, namespace: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(&pki.ca.cert_pem);
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": {
            "server": server,
            "certificate-authority-data": ca,
        }}],
        "users": [{"name": "service-account", "user": {"token": token}}],
        "contexts": [{"name": "testbed", "context": {
            "cluster": "testbed", "user": "service-account", "namespace": namespace,
        }}],
        "current-context": "testbed",
    })
    .to_string()
}

/// One ServiceAccount's identity on one API server: its kubeconfig file and a client from it.
pub struct AccountAccess {
    pub kubeconfig: std::path::PathBuf,
    pub client: kube::Client,
}

/// Mints a token for `sa_namespace/sa` (minted with `admin` against `server`) and writes a
/// kubeconfig using it to `path`, with `context_namespace` as the context's namespace.
pub async fn account_kubeconfig(
    admin: &kube::Client,
    server: &str,
    pki: &Pki,
    (sa_namespace, sa): (&str, &str),
    context_namespace: &str,
    path: &Path,
) -> Result<AccountAccess, BedError> {
    let token = token(admin, sa_namespace, sa).await?;
    let text = token_kubeconfig_text(server, pki, &token, context_namespace);
    std::fs::write(path, &text)
        .map_err(|e| BedError::Setup(format!("writing {}: {e}", path.display())))?;
    Ok(AccountAccess {
        kubeconfig: path.to_path_buf(),
        client: client_from_kubeconfig(&text).await?,
    })
}

/// What a SelfSubjectAccessReview asks: may I `verb` `group`/`resource` (in `namespace`)?
#[derive(Clone, Debug, Default)]
pub struct Access<'a> {
    pub verb: &'a str,
    pub group: &'a str,
    pub resource: &'a str,
    pub subresource: Option<&'a str>,
    pub namespace: Option<&'a str>,
    pub name: Option<&'a str>,
}

/// Whether the caller of `client` may do `access` (SelfSubjectAccessReview, which every
/// authenticated user may ask).
pub async fn allowed(client: &kube::Client, access: &Access<'_>) -> Result<bool, BedError> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(access.verb.into()),
                group: Some(access.group.into()),
                resource: Some(access.resource.into()),
                subresource: access.subresource.map(Into::into),
                namespace: access.namespace.map(Into::into),
                name: access.name.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| BedError::Api(format!("SelfSubjectAccessReview {access:?}: {e}")))?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// Waits until the authorizer grants `access` to the caller of `client` (RBAC objects reach the
/// authorizer's cache a moment after they are written), so a program started next never sees
/// a Forbidden that only a race caused.
pub async fn wait_allowed(client: &kube::Client, access: &Access<'_>) -> Result<(), BedError> {
    wait::until(
        &format!("RBAC to allow {access:?}"),
        Duration::from_secs(10),
        || async {
            Ok(
                if allowed(client, access).await.map_err(|e| e.to_string())? {
                    Ok(())
                } else {
                    Err("denied")
                },
            )
        },
    )
    .await
    .map_err(BedError::Setup)
}

/// How many requests the API server of `admin` has refused for lack of permission so far
/// (`authorization_attempts_total` with result `no-opinion` — what RBAC answers when no rule
/// allows — or `denied`). Taken before and after a run, it counts that run's Forbidden
/// answers, whichever client got them and whether or not the program reported them.
pub async fn refusals(admin: &kube::Client) -> Result<u64, BedError> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .map_err(|e| BedError::Api(format!("building GET /metrics: {e}")))?;
    let text = admin
        .request_text(req)
        .await
        .map_err(|e| BedError::Api(format!("GET /metrics: {e}")))?;
    let mut total = 0u64;
    for line in text.lines() {
        for result in ["no-opinion", "denied"] {
            if let Some(value) = line.strip_prefix(&format!(
                "authorization_attempts_total{{result=\"{result}\"}} "
            )) {
                total += value
                    .trim()
                    .parse::<f64>()
                    .map_err(|e| BedError::Api(format!("metric line {line:?}: {e}")))?
                    as u64;
            }
        }
    }
    Ok(total)
}
