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

/// ServiceAccount `default/<name>`, bound to a ClusterRole with `get` on the non-resource URLs
/// `may_get` (none: no role); its token.
async fn account(bed: &TestBed, name: &str, may_get: &[&str]) -> String {
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
    if !may_get.is_empty() {
        // What docs/operations.md tells Prometheus' account to get.
        Api::<ClusterRole>::all(admin.clone())
            .create(
                &pp,
                &ClusterRole {
                    metadata: meta(name),
                    rules: Some(vec![PolicyRule {
                        non_resource_urls: Some(may_get.iter().map(|u| u.to_string()).collect()),
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
        let path = may_get[0].replace('*', "x");
        wait::until("RBAC allows the role", Duration::from_secs(10), || {
            let (admin, user, path) = (admin.clone(), user.clone(), path.clone());
            async move {
                let review = SubjectAccessReview {
                    spec: SubjectAccessReviewSpec {
                        user: Some(user),
                        non_resource_attributes: Some(NonResourceAttributes {
                            path: Some(path),
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
    let scraper = account(&bed, "scraper", &["/metrics"]).await;
    let stranger = account(&bed, "stranger", &[]).await;
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

    // Renewed in place (a Secret mounted as a directory): a pair that does not match is not
    // served, the old certificate stays; the new pair is served without a restart.
    let renewed_key = rcgen::KeyPair::generate().unwrap();
    let renewed = rcgen::CertificateParams::new(vec!["metrics.example".to_string()])
        .unwrap()
        .self_signed(&renewed_key)
        .unwrap();
    std::fs::write(&cert_file, renewed.pem()).unwrap();
    tokio::time::sleep(harvester_cloud_provider::secure::tls::CERT_CHECK_PERIOD * 2).await;
    assert_eq!(
        get(port, "/healthz", None).await.server_cert,
        cert.der().to_vec(),
        "a certificate without its key is not served"
    );
    std::fs::write(&key_file, renewed_key.serialize_pem()).unwrap();
    wait::until(
        "the renewed certificate to be served",
        harvester_cloud_provider::secure::tls::CERT_CHECK_PERIOD * 3,
        || async {
            let served = get(port, "/healthz", None).await.server_cert;
            Ok(if served == renewed.der().to_vec() {
                Ok(())
            } else {
                Err("the old certificate")
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    p.check_alive().expect("the provider kept running");
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

/// `n` TLS connections to `port` (handshake done, nothing sent), opened from 8 threads.
async fn idle_connections(port: u16, n: usize) -> Vec<scrape::TlsStream> {
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                (t..n)
                    .step_by(8)
                    .filter_map(|_| scrape::tls_connect(port, &[]).ok())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    tokio::task::spawn_blocking(move || {
        threads
            .into_iter()
            .flat_map(|t| t.join().expect("connect thread"))
            .collect()
    })
    .await
    .unwrap()
}

/// How many of `conns` the server has closed, each given `wait` to show it.
async fn count_closed(
    conns: Vec<scrape::TlsStream>,
    wait: Duration,
) -> (usize, Vec<scrape::TlsStream>) {
    tokio::task::spawn_blocking(move || {
        let (closed, open): (Vec<_>, Vec<_>) = conns
            .into_iter()
            .map(|mut c| (scrape::closed_by_server(&mut c, wait), c))
            .partition(|(closed, _)| *closed);
        (closed.len(), open.into_iter().map(|(_, c)| c).collect())
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn a_client_that_sends_no_full_header_is_cut_after_the_header_timeout() {
    use harvester_cloud_provider::secure::conn::HEADER_READ_TIMEOUT;
    let bed = TestBed::started().await;
    let scraper = account(&bed, "slow-header-scraper", &["/metrics"]).await;
    let port = testbed::util::process::free_port().unwrap();
    let mut p = provider(&bed, "slow-header", port, &[]);
    up(&mut p, port).await;

    // One sends nothing after the handshake; the other a header line every 5 s, never the end
    // of the header (the deadline holds from the first byte awaited, as Go's ReadHeaderTimeout).
    let silent = scrape::tls_connect(port, &[]).expect("TLS");
    let mut dripping = scrape::tls_connect(port, &[]).expect("TLS");
    let t0 = std::time::Instant::now();
    let silent = std::thread::spawn(move || {
        let mut silent = silent;
        let closed = scrape::closed_by_server(&mut silent, HEADER_READ_TIMEOUT + MARGIN);
        (closed, t0.elapsed())
    });
    let dripping = std::thread::spawn(move || {
        use std::io::Write;
        let _ = write!(dripping, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n");
        let _ = dripping.flush();
        let mut line = 0;
        loop {
            if scrape::closed_by_server(&mut dripping, Duration::from_secs(5)) {
                return (true, t0.elapsed());
            }
            if t0.elapsed() > HEADER_READ_TIMEOUT + MARGIN {
                return (false, t0.elapsed());
            }
            line += 1;
            let _ = write!(dripping, "X-Slow-{line}: a\r\n");
            let _ = dripping.flush();
        }
    });

    // Meanwhile a scrape is served.
    let scraped = get(port, "/metrics", Some(&scraper)).await;
    assert_eq!(scraped.code, 200, "{scraped:?}");

    for (what, client) in [("silent", silent), ("dripping", dripping)] {
        let (closed, after) = tokio::task::spawn_blocking(move || client.join().unwrap())
            .await
            .unwrap();
        assert!(
            closed,
            "{what}: still open after {after:?} (header timeout {HEADER_READ_TIMEOUT:?})"
        );
        // Not cut by something else first (the handshake timeout, a cap).
        assert!(
            after + Duration::from_secs(2) >= HEADER_READ_TIMEOUT,
            "{what}: cut after {after:?}, before the header timeout {HEADER_READ_TIMEOUT:?}"
        );
    }
    let scraped = get(port, "/metrics", Some(&scraper)).await;
    assert_eq!(scraped.code, 200, "{scraped:?}");
    p.check_alive().expect("the provider still runs");
}

/// Slack for timers on a loaded 2-core machine.
const MARGIN: Duration = Duration::from_secs(15);

#[tokio::test]
async fn a_thousand_idle_connections_are_capped_and_cut_while_scrapes_are_served() {
    use harvester_cloud_provider::secure::conn::{HEADER_READ_TIMEOUT, MAX_CONNECTIONS};
    let bed = TestBed::started().await;
    let scraper = account(&bed, "flood-scraper", &["/metrics"]).await;
    let port = testbed::util::process::free_port().unwrap();
    let mut p = provider(&bed, "flood", port, &[]);
    up(&mut p, port).await;

    let conns = idle_connections(port, 1000).await;
    let opened = conns.len();
    let (closed, held) = count_closed(conns, Duration::from_millis(20)).await;
    assert!(
        held.len() <= MAX_CONNECTIONS,
        "{} of {opened} idle connections open, cap {MAX_CONNECTIONS} ({closed} closed)",
        held.len()
    );
    assert!(!held.is_empty(), "the newest idle connections are kept");

    // With the cap full of idle connections, a scraper (and the kubelet's probe) still gets in:
    // the connection idle longest makes room.
    let scraped = get(port, "/metrics", Some(&scraper)).await;
    assert_eq!(scraped.code, 200, "{scraped:?}");
    assert_eq!(get(port, "/healthz", None).await.code, 200);

    // The held ones never sent a request: cut when the header timeout runs out.
    let (cut, still) = count_closed(held, HEADER_READ_TIMEOUT + MARGIN).await;
    assert!(
        still.is_empty(),
        "{} idle connections still open after {:?} ({cut} cut)",
        still.len(),
        HEADER_READ_TIMEOUT + MARGIN
    );
    let scraped = get(port, "/metrics", Some(&scraper)).await;
    assert_eq!(scraped.code, 200, "{scraped:?}");
    p.check_alive().expect("the provider still runs");
}

/// TokenReviews the provider has sent (its own API request counter, read with `token`).
async fn token_reviews(port: u16, token: &str) -> f64 {
    let r = get(port, "/metrics", Some(token)).await;
    assert_eq!(r.code, 200, "{r:?}");
    let samples = scrape::parse(&r.body).expect("OpenMetrics text");
    scrape::sum(
        &samples,
        "harvester_kube_api_requests_total",
        &[("verb", "create"), ("resource", "tokenreviews")],
    )
}

#[tokio::test]
async fn bogus_tokens_cost_a_bounded_number_of_token_reviews() {
    use harvester_cloud_provider::secure::auth::{REVIEW_BURST, REVIEWS_PER_SECOND};
    let bed = TestBed::started().await;
    let scraper = account(&bed, "review-scraper", &["/metrics"]).await;
    let port = testbed::util::process::free_port().unwrap();
    let mut p = provider(&bed, "reviews", port, &[]);
    up(&mut p, port).await;
    // The scraper's own token is reviewed once here, then cached (10 s).
    let before = token_reviews(port, &scraper).await;

    // 200 distinct bogus tokens at once (8 clients): each is 401 (reviewed, rejected) or 429
    // (over the review rate).
    let t0 = std::time::Instant::now();
    let answers: Vec<u16> = futures::future::join_all((0..8).map(|c| async move {
        let mut codes = Vec::new();
        for i in (c..200).step_by(8) {
            codes.push(
                get(port, "/healthz", Some(&format!("bogus-{i}")))
                    .await
                    .code,
            );
        }
        codes
    }))
    .await
    .concat();
    let burst_time = t0.elapsed();
    let after_burst = token_reviews(port, &scraper).await;
    assert!(
        answers.iter().all(|c| *c == 401 || *c == 429),
        "{answers:?}"
    );
    // The bound of auth.rs, plus the scraper's token reviewed again if its answer expired.
    let bound = REVIEW_BURST as f64 + REVIEWS_PER_SECOND * burst_time.as_secs_f64().ceil() + 1.0;
    assert!(
        bound < 200.0,
        "the burst took {burst_time:?}: too slow to tell a bound from none"
    );
    let reviews = after_burst - before;
    assert!(
        reviews <= bound,
        "{reviews} TokenReviews for 200 bogus tokens in {burst_time:?}; bound {bound}"
    );

    // Once the rate allows again, one bogus token repeated is reviewed once: the rejection is
    // cached (upstream's failure TTL).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = token_reviews(port, &scraper).await;
    let t0 = std::time::Instant::now();
    for _ in 0..50 {
        let r = get(port, "/healthz", Some("bogus-repeated")).await;
        assert_eq!(r.code, 401, "{r:?}");
    }
    let reviews = token_reviews(port, &scraper).await - before;
    // Once, and once more per cache TTL (10 s) gone by, for it and for the scraper's token.
    let ttls = (t0.elapsed().as_secs_f64() / 10.0).floor();
    assert!(
        reviews <= 2.0 + 2.0 * ttls,
        "{reviews} TokenReviews for one bogus token sent 50 times in {:?}",
        t0.elapsed()
    );
    // A token accepted before is reviewed again without the budget: once its answer has
    // expired, bogus tokens that spend the budget do not keep the scraper out.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let codes = futures::future::join_all((0..6 * REVIEW_BURST).map(|i| async move {
        get(port, "/healthz", Some(&format!("bogus-again-{i}")))
            .await
            .code
    }))
    .await;
    assert!(codes.contains(&429), "the budget is spent: {codes:?}");
    let scraped = get(port, "/metrics", Some(&scraper)).await;
    assert_eq!(scraped.code, 200, "{scraped:?}");
    p.check_alive().expect("the provider still runs");
}

#[tokio::test]
async fn readyz_withholds_reasons_from_anonymous_callers_and_shows_them_to_authorised_ones() {
    use base64::Engine as _;
    let bed = TestBed::started().await;
    let operator = account(&bed, "readyz-operator", &["/readyz/*"]).await;
    // Credentials Harvester refuses: the `harvester` check fails, naming the file.
    let cloud_config = bed.dir.path().join("refused-cloud-config");
    let ca = base64::engine::general_purpose::STANDARD.encode(&bed.pki.ca.cert_pem);
    let kubeconfig = serde_json::json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "h", "cluster": {"server": bed.harvester.url, "certificate-authority-data": ca}}],
        "users": [{"name": "u", "user": {"token": "refused-token"}}],
        "contexts": [{"name": "h", "context": {"cluster": "h", "user": "u", "namespace": bed.vm_namespace}}],
        "current-context": "h",
    });
    std::fs::write(&cloud_config, kubeconfig.to_string()).unwrap();
    let port = testbed::util::process::free_port().unwrap();
    let mut cmd = Command::new(testbed::util::process::built_binary(
        "harvester-cloud-provider",
    ));
    cmd.args(["--cloud-config", &cloud_config.to_string_lossy()])
        .args(["--kubeconfig", &bed.guest.kubeconfig.to_string_lossy()])
        .args(["--cluster-name", "secure", "--leader-elect=false"])
        .args(["--bind-address=127.0.0.1", &format!("--secure-port={port}")]);
    let mut p = Proc::spawn("refused", cmd, bed.dir.path()).expect("start the provider");
    up(&mut p, port).await;

    // The authorised caller sees why, once the check has run.
    let detail = wait::until(
        "/readyz/harvester names the 401",
        Duration::from_secs(30),
        || {
            let operator = operator.clone();
            async move {
                let r = get(port, "/readyz/harvester", Some(&operator)).await;
                Ok(if r.code == 503 && r.body.contains("401") {
                    Ok(r.body)
                } else {
                    Err((r.code, r.body))
                })
            }
        },
    )
    .await
    .unwrap();
    assert!(
        detail.contains(&cloud_config.display().to_string()),
        "{detail}"
    );

    // Anonymous callers: the status, the failing check's name, no reason.
    for path in ["/readyz", "/readyz?verbose"] {
        let r = get(port, path, None).await;
        assert_eq!(r.code, 503, "{path}: {r:?}");
        assert!(
            !r.body.contains("401") && !r.body.contains("cloud-config"),
            "{path} tells anonymous callers why: {}",
            r.body
        );
        assert!(r.body.contains("harvester"), "{path}: {}", r.body);
    }
    // The per-check path is not open to them (nor to a token without the role).
    let r = get(port, "/readyz/harvester", None).await;
    assert_eq!(r.code, 403, "{r:?}");
    p.check_alive().expect("the provider still runs");
}
