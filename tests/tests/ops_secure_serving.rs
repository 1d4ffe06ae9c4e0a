//! The provider's HTTPS endpoints as upstream's cloud provider serves them (k8s.io/cloud-provider
//! `--secure-port`, default 10258): `/healthz`, `/readyz`, `/livez` open to anyone, `/metrics`
//! to a bearer token the guest API server authenticates (TokenReview) and authorises for `get` on
//! the path (SubjectAccessReview); the certificate given with `--tls-cert-file` or a self-signed
//! one. Against the bed's real kube-apiserver, with real ServiceAccount tokens and RBAC.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, PostParams};
use testbed::util::process::Proc;
use testbed::util::scrape::{self, HttpsResponse, https_get};
use testbed::{TestBed, util::wait};

/// The provider binary against the bed with its HTTPS endpoints on 127.0.0.1:`port`, no plain
/// HTTP listener; `extra` flags after the bed's.
fn provider(bed: &TestBed, name: &str, port: u16, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(testbed::util::process::built_binary(
        "harvester-cloud-provider",
    ));
    cmd.args(["--cloud-config", &bed.cloud_config.to_string_lossy()])
        .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
        .args(["--cluster-name", "secure", "--leader-elect=false"])
        .args(["--bind-address=127.0.0.1", &format!("--secure-port={port}")])
        .args(extra);
    Proc::spawn(name, cmd, bed.dir.path()).expect("start the cloud provider binary")
}

async fn get(port: u16, path: &str, token: Option<&str>) -> HttpsResponse {
    let (path, token) = (path.to_string(), token.map(str::to_string));
    tokio::task::spawn_blocking(move || https_get(port, &path, token.as_deref()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("HTTPS GET: {e}"))
}

async fn up(p: &mut Proc, port: u16) {
    if let Err(e) = scrape::wait_for_https_200(port, "/healthz", Duration::from_secs(30)).await {
        panic!("{e}; provider: {:?}", p.check_alive());
    }
}

/// ServiceAccount `default/<name>`, bound to a ClusterRole with `get` on `/metrics` when
/// `may_scrape`; its token.
async fn account(bed: &TestBed, name: &str, may_scrape: bool) -> String {
    let admin = bed.guest.client.clone();
    let meta = |n: &str| ObjectMeta {
        name: Some(n.into()),
        ..ObjectMeta::default()
    };
    let pp = PostParams::default();
    Api::<ServiceAccount>::namespaced(admin.clone(), "default")
        .create(
            &pp,
            &ServiceAccount {
                metadata: meta(name),
                ..ServiceAccount::default()
            },
        )
        .await
        .expect("create ServiceAccount");
    if may_scrape {
        // What docs/operations.md tells Prometheus' account to get.
        Api::<ClusterRole>::all(admin.clone())
            .create(
                &pp,
                &ClusterRole {
                    metadata: meta(name),
                    rules: Some(vec![PolicyRule {
                        non_resource_urls: Some(vec!["/metrics".into()]),
                        verbs: vec!["get".into()],
                        ..PolicyRule::default()
                    }]),
                    ..ClusterRole::default()
                },
            )
            .await
            .expect("create ClusterRole");
        Api::<ClusterRoleBinding>::all(admin.clone())
            .create(
                &pp,
                &ClusterRoleBinding {
                    metadata: meta(name),
                    role_ref: RoleRef {
                        api_group: "rbac.authorization.k8s.io".into(),
                        kind: "ClusterRole".into(),
                        name: name.into(),
                    },
                    subjects: Some(vec![Subject {
                        kind: "ServiceAccount".into(),
                        name: name.into(),
                        namespace: Some("default".into()),
                        ..Subject::default()
                    }]),
                },
            )
            .await
            .expect("create ClusterRoleBinding");
        // The authorizer sees a binding a moment after it is written; the provider caches a
        // denial for 10 s, so ask only once the API server allows.
        let user = format!("system:serviceaccount:default:{name}");
        wait::until("RBAC allows get /metrics", Duration::from_secs(10), || {
            let (admin, user) = (admin.clone(), user.clone());
            async move {
                let review = SubjectAccessReview {
                    spec: SubjectAccessReviewSpec {
                        user: Some(user),
                        non_resource_attributes: Some(NonResourceAttributes {
                            path: Some("/metrics".into()),
                            verb: Some("get".into()),
                        }),
                        ..SubjectAccessReviewSpec::default()
                    },
                    ..SubjectAccessReview::default()
                };
                let answer = Api::<SubjectAccessReview>::all(admin)
                    .create(&PostParams::default(), &review)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(if answer.status.as_ref().is_some_and(|s| s.allowed) {
                    Ok(())
                } else {
                    Err(answer.status)
                })
            }
        })
        .await
        .unwrap();
    }
    testbed::bed::rbac::token(&admin, "default", name)
        .await
        .expect("token")
}

#[tokio::test]
async fn metrics_need_a_token_allowed_to_get_the_path_and_probes_need_none() {
    let bed = TestBed::started().await;
    let scraper = account(&bed, "scraper", true).await;
    let stranger = account(&bed, "stranger", false).await;
    let port = testbed::util::process::free_port().unwrap();
    let mut p = provider(&bed, "provider", port, &[]);
    up(&mut p, port).await;

    // Probes: open without a token (upstream's --authorization-always-allow-paths).
    for path in ["/healthz", "/livez"] {
        let r = get(port, path, None).await;
        assert_eq!((r.code, r.body.as_str()), (200, "ok\n"), "{path}");
    }
    let ready = get(port, "/readyz", None).await;
    assert!(ready.code == 200 || ready.code == 503, "{ready:?}");

    // Anonymous: authenticated as system:anonymous, then refused by the SubjectAccessReview.
    let anonymous = get(port, "/metrics", None).await;
    assert_eq!(anonymous.code, 403, "{anonymous:?}");
    assert!(
        anonymous
            .body
            .contains(r#"User \"system:anonymous\" cannot get path \"/metrics\""#),
        "{}",
        anonymous.body
    );

    // A ServiceAccount bound to `get` on /metrics: Prometheus text.
    let scraped = get(port, "/metrics", Some(&scraper)).await;
    assert_eq!(scraped.code, 200, "{scraped:?}");
    let samples = scrape::parse(&scraped.body).expect("OpenMetrics text");
    assert!(
        samples
            .iter()
            .any(|s| s.name == "harvester_kube_api_requests_total"),
        "{}",
        scraped.body
    );

    // Authenticated but not allowed: 403 naming the account.
    let denied = get(port, "/metrics", Some(&stranger)).await;
    assert_eq!(denied.code, 403, "{denied:?}");
    assert!(
        denied
            .body
            .contains("system:serviceaccount:default:stranger"),
        "{}",
        denied.body
    );

    // A token the API server does not accept: 401, on an always-allowed path too (authentication
    // comes before authorization, as upstream's handler chain).
    for path in ["/metrics", "/healthz"] {
        let r = get(port, path, Some("not-a-token")).await;
        assert_eq!(r.code, 401, "{path}: {r:?}");
    }
    p.check_alive().expect("the provider still runs");
    drop(p);

    // --authentication-kubeconfig / --authorization-kubeconfig: the reviews go where they say.
    // An account that may not create reviews: the scraper's valid token is refused (401 for the
    // TokenReview, 500 for the SubjectAccessReview, as upstream's chain answers errors).
    let kubeconfig = |who: &'static str| {
        let (admin, url, pki, dir) = (
            bed.guest.client.clone(),
            bed.guest.url.clone(),
            &bed.pki,
            bed.dir.path().to_path_buf(),
        );
        async move {
            let path = dir.join(format!("{who}.kubeconfig"));
            testbed::bed::rbac::account_kubeconfig(
                &admin,
                &url,
                pki,
                ("default", who),
                "default",
                &path,
            )
            .await
            .expect("account kubeconfig");
            format!("{}", path.display())
        }
    };
    let stranger_kubeconfig = kubeconfig("stranger").await;
    for (flag, code) in [
        ("--authentication-kubeconfig", 401),
        ("--authorization-kubeconfig", 500),
    ] {
        let port = testbed::util::process::free_port().unwrap();
        let mut p = provider(
            &bed,
            "reviews-elsewhere",
            port,
            &[&format!("{flag}={stranger_kubeconfig}")],
        );
        up(&mut p, port).await;
        let r = get(port, "/metrics", Some(&scraper)).await;
        assert_eq!(
            r.code, code,
            "{flag} of an account without review rights: {r:?}"
        );
    }
}

#[tokio::test]
async fn serves_the_given_certificate_else_a_self_signed_one() {
    let bed = TestBed::started().await;
    let dir = tempfile::tempdir().unwrap();

    // No files: a self-signed certificate for localhost, made in memory.
    let port = testbed::util::process::free_port().unwrap();
    let mut p = provider(&bed, "self-signed", port, &[]);
    up(&mut p, port).await;
    let generated = get(port, "/healthz", None).await.server_cert;
    // Its subjectAltName holds the DNS name as plain bytes (IA5String).
    assert!(
        generated.windows(9).any(|w| w == b"localhost"),
        "a certificate for localhost"
    );
    drop(p);

    // Given files: exactly that certificate.
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["metrics.example".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (cert_file, key_file) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert_file, cert.pem()).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    let port = testbed::util::process::free_port().unwrap();
    let mut p = provider(
        &bed,
        "given",
        port,
        &[
            &format!("--tls-cert-file={}", cert_file.display()),
            &format!("--tls-private-key-file={}", key_file.display()),
        ],
    );
    up(&mut p, port).await;
    assert_eq!(
        get(port, "/healthz", None).await.server_cert,
        cert.der().to_vec()
    );
    drop(p);

    // --cert-dir: the generated pair is written there and served.
    let cert_dir = dir.path().join("certs");
    let port = testbed::util::process::free_port().unwrap();
    let mut p = provider(
        &bed,
        "cert-dir",
        port,
        &[&format!("--cert-dir={}", cert_dir.display())],
    );
    up(&mut p, port).await;
    let written = pem_der(&cert_dir.join("cloud-controller-manager.crt"));
    assert_eq!(get(port, "/healthz", None).await.server_cert, written);
}

/// The first certificate of a PEM file, DER.
fn pem_der(path: &Path) -> Vec<u8> {
    let pem = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    rustls_pemfile::certs(&mut pem.as_slice())
        .next()
        .expect("a certificate")
        .expect("PEM")
        .to_vec()
}
