//! The cloud-config client against the real Harvester API server: rotation without restart, 401
//! reported with the file's name, token expiry read from a real ServiceAccount token.

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use harvester_common::cloud_config::Harvester;
use harvester_common::harvester::VirtualMachine;
use harvester_common::telemetry::Metrics;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use testbed::{TestBed, util::wait};

const RELOAD: Duration = Duration::from_millis(200);

fn token_kubeconfig(bed: &TestBed, token: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(&bed.pki.ca.cert_pem);
    json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "h", "cluster": {"server": bed.harvester.url, "certificate-authority-data": ca}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "h", "context": {"cluster": "h", "user": "u", "namespace": bed.vm_namespace}}],
        "current-context": "h",
    })
    .to_string()
}

fn user_kubeconfig(bed: &TestBed, user: &str) -> String {
    let cert = bed
        .pki
        .client_cert(bed.dir.path(), user, &[])
        .expect("client cert");
    testbed::bed::cluster::kubeconfig_text(
        &bed.harvester.url,
        &bed.pki,
        &cert,
        user,
        &bed.vm_namespace,
    )
}

/// Replaces the file atomically, as the kubelet does for a Secret volume.
fn rotate(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn list_vms(h: &Harvester) -> Result<(), u16> {
    let api: Api<VirtualMachine> = Api::namespaced(h.client.clone(), &h.namespace);
    match api.list(&ListParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err(s.code),
        Err(e) => panic!("unexpected error {e}"),
    }
}

async fn until_list_gives(h: &Harvester, want: Result<(), u16>) {
    wait::until(
        &format!("listing VMs gives {want:?}"),
        Duration::from_secs(10),
        || async {
            let got = list_vms(h).await;
            Ok(if got == want { Ok(()) } else { Err(got) })
        },
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn cloud_config_rotation_switches_credentials_without_a_restart() {
    let bed = TestBed::started().await;
    let path = bed.dir.path().join("rotating-cloud-config");
    std::fs::write(&path, std::fs::read_to_string(&bed.cloud_config).unwrap()).unwrap();
    let h = Harvester::load_with(&path, None, RELOAD)
        .await
        .expect("load");
    assert_eq!(h.namespace, bed.vm_namespace);
    assert_eq!(list_vms(&h).await, Ok(()));

    // A user without RBAC: the same client object now gets 403.
    rotate(&path, &user_kubeconfig(&bed, "nobody"));
    until_list_gives(&h, Err(403)).await;
    // Back to the admin credentials.
    rotate(&path, &std::fs::read_to_string(&bed.cloud_config).unwrap());
    until_list_gives(&h, Ok(())).await;
    // A broken file is ignored: the working credentials stay.
    rotate(&path, "this is not a kubeconfig");
    tokio::time::sleep(RELOAD * 3).await;
    assert_eq!(list_vms(&h).await, Ok(()));
}

/// Requests at once share one HTTP/2 connection (ALPN h2, as client-go), not a TLS connection each.
#[tokio::test]
async fn concurrent_requests_to_harvester_go_over_http2() {
    let bed = TestBed::started().await;
    let h = Harvester::load_with(&bed.cloud_config, None, RELOAD)
        .await
        .expect("load");
    let versions = futures::future::join_all((0..32).map(|_| {
        let client = h.client.clone();
        async move {
            let req = http::Request::get("/version")
                .body(kube::client::Body::empty())
                .unwrap();
            let res = client.send(req).await.expect("GET /version");
            assert!(res.status().is_success(), "GET /version: {}", res.status());
            res.version()
        }
    }))
    .await;
    assert!(
        versions.iter().all(|v| *v == http::Version::HTTP_2),
        "answered over {versions:?}"
    );
}

#[tokio::test]
async fn a_401_from_harvester_marks_the_credentials_bad_naming_the_file() {
    let bed = TestBed::started().await;
    let path = bed.dir.path().join("bad-cloud-config");
    std::fs::write(&path, token_kubeconfig(&bed, "not-a-valid-token")).unwrap();
    let h = Harvester::load_with(&path, None, RELOAD)
        .await
        .expect("load");
    assert_eq!(
        h.credentials_state(),
        Ok(()),
        "nothing known before the first request"
    );
    assert_eq!(list_vms(&h).await, Err(401));
    let err = h.credentials_state().unwrap_err();
    assert!(
        err.contains("401") && err.contains(&path.display().to_string()),
        "{err}"
    );
    rotate(&path, &std::fs::read_to_string(&bed.cloud_config).unwrap());
    until_list_gives(&h, Ok(())).await;
    assert_eq!(
        h.credentials_state(),
        Ok(()),
        "a success after rotation clears it"
    );
}

#[tokio::test]
async fn the_expiry_of_a_service_account_token_is_exported_and_warned_about() {
    let bed = TestBed::started().await;
    let c = bed.harvester.client.clone();
    let sas: Api<ServiceAccount> = Api::namespaced(c.clone(), &bed.vm_namespace);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "ccm"}})).unwrap(),
    )
    .await
    .expect("service account");
    let req: TokenRequest =
        serde_json::from_value(json!({"spec": {"expirationSeconds": 2 * 86_400}})).unwrap();
    let issued = sas
        .create_token_request("ccm", &PostParams::default(), &req)
        .await
        .expect("TokenRequest");
    let token = issued.status.expect("token status").token;
    let path = bed.dir.path().join("sa-cloud-config");
    std::fs::write(&path, token_kubeconfig(&bed, &token)).unwrap();
    let metrics = Metrics::new();
    let h = Harvester::load_with(&path, Some(&metrics), RELOAD)
        .await
        .expect("load");
    let left = h
        .token_expiry()
        .expect("a ServiceAccount token is a JWT with exp")
        .as_second()
        - jiff::Timestamp::now().as_second();
    assert!(
        (2 * 86_400 - 120..=2 * 86_400).contains(&left),
        "expires in {left} s"
    );
    let warning = h
        .expiry_warning(Duration::from_secs(7 * 86_400))
        .expect("within 7 days");
    assert!(warning.contains(&path.display().to_string()), "{warning}");
    assert_eq!(h.expiry_warning(Duration::from_secs(60)), None);
    let text = metrics.encode();
    let gauge = text
        .lines()
        .find(|l| l.starts_with("harvester_cloud_config_token_expiry_seconds "))
        .expect("gauge exported");
    let secs: f64 = gauge.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((172_680.0..=172_800.0).contains(&secs), "{gauge}");
    // The API requests of this client are counted.
    let _ = list_vms(&h).await;
    assert!(metrics.api_request_total() >= 1);
}

/// A ServiceAccount in the VM namespace allowed to list VMs, and a token for it.
async fn reader_token(bed: &TestBed, name: &str) -> String {
    let yaml = format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata: {{name: {name}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: vm-reader}}
rules: [{{apiGroups: [kubevirt.io], resources: [virtualmachines], verbs: [list]}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: {name}-vm-reader}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: vm-reader}}
subjects: [{{kind: ServiceAccount, name: {name}, namespace: {ns}}}]
"#,
        ns = bed.vm_namespace
    );
    testbed::bed::apply::apply_yaml(&bed.harvester.client, &yaml, &bed.vm_namespace)
        .await
        .expect("service account and RBAC");
    let sas: Api<ServiceAccount> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let req: TokenRequest = serde_json::from_value(json!({"spec": {}})).unwrap();
    sas.create_token_request(name, &PostParams::default(), &req)
        .await
        .expect("TokenRequest")
        .status
        .expect("token")
        .token
}

#[tokio::test]
async fn a_new_service_account_token_is_used_after_the_old_one_is_revoked() {
    let bed = TestBed::started().await;
    let old = reader_token(&bed, "ccm-old").await;
    let new = reader_token(&bed, "ccm-new").await;
    let path = bed.dir.path().join("sa-rotation");
    std::fs::write(&path, token_kubeconfig(&bed, &old)).unwrap();
    let h = Harvester::load_with(&path, None, RELOAD)
        .await
        .expect("load");
    assert_eq!(list_vms(&h).await, Ok(()));
    rotate(&path, &token_kubeconfig(&bed, &new));
    // Revoke the old token: deleting its ServiceAccount invalidates every token bound to it.
    let sas: Api<ServiceAccount> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    sas.delete("ccm-old", &Default::default())
        .await
        .expect("revoke");
    until_list_gives(&h, Ok(())).await;
    tokio::time::sleep(RELOAD * 3).await;
    assert_eq!(
        list_vms(&h).await,
        Ok(()),
        "the same client works with the new token"
    );
    assert_eq!(h.credentials_state(), Ok(()));
}
