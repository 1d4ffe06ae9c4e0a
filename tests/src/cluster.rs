//! etcd and kube-apiserver processes, their kubeconfigs and admin clients.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::certs::{CertFiles, Pki};
use crate::process::{Proc, free_port};
use crate::{BedError, tools};

const START_TIMEOUT: Duration = Duration::from_secs(120);

pub struct Etcd {
    pub url: String,
    pub proc: Proc,
}

impl Etcd {
    pub async fn start(dir: &Path) -> Result<Etcd, BedError> {
        let bin = tools::tool("etcd")?;
        let client = free_port()?;
        let peer = free_port()?;
        let url = format!("http://127.0.0.1:{client}");
        let mut cmd = Command::new(bin);
        cmd.arg("--name=testbed")
            .arg(format!("--data-dir={}", dir.join("etcd-data").display()))
            .arg(format!("--listen-client-urls={url}"))
            .arg(format!("--advertise-client-urls={url}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=testbed=http://127.0.0.1:{peer}"))
            .arg("--unsafe-no-fsync")
            .arg("--log-level=warn");
        let mut proc = Proc::spawn("etcd", cmd, dir)?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            proc.check_alive()?;
            if tokio::net::TcpStream::connect(("127.0.0.1", client))
                .await
                .is_ok()
            {
                return Ok(Etcd { url, proc });
            }
            if Instant::now() > deadline {
                return Err(BedError::Timeout {
                    component: "etcd".into(),
                    log: proc.log.clone(),
                    what: format!("listening on {url}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One kube-apiserver ("guest" or "harvester") with RBAC on and an admin client.
pub struct ApiServer {
    pub name: String,
    pub url: String,
    /// Admin kubeconfig (user `admin`, group `system:masters`).
    pub kubeconfig: PathBuf,
    pub client: kube::Client,
    pub proc: Proc,
}

pub struct ApiServerArgs<'a> {
    pub name: &'a str,
    pub etcd_url: &'a str,
    pub service_cidr: &'a str,
    /// Namespace of the kubeconfig's current context.
    pub namespace: &'a str,
}

impl ApiServer {
    pub async fn start(
        dir: &Path,
        pki: &Pki,
        args: ApiServerArgs<'_>,
    ) -> Result<ApiServer, BedError> {
        let bin = tools::tool("kube-apiserver")?;
        let port = free_port()?;
        let url = format!("https://127.0.0.1:{port}");
        let p = |f: &PathBuf| f.display().to_string();
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--etcd-servers={}", args.etcd_url))
            .arg(format!("--etcd-prefix=/{}", args.name))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={port}"))
            .arg(format!("--tls-cert-file={}", p(&pki.apiserver.cert)))
            .arg(format!("--tls-private-key-file={}", p(&pki.apiserver.key)))
            .arg(format!("--client-ca-file={}", p(&pki.ca.cert)))
            .arg("--authorization-mode=RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", p(&pki.sa_pub)))
            .arg(format!(
                "--service-account-signing-key-file={}",
                p(&pki.sa_key)
            ))
            .arg(format!("--service-cluster-ip-range={}", args.service_cidr))
            .arg(format!(
                "--requestheader-client-ca-file={}",
                p(&pki.front_proxy_ca.cert)
            ))
            .arg("--requestheader-allowed-names=front-proxy-client")
            .arg("--requestheader-username-headers=X-Remote-User")
            .arg("--requestheader-group-headers=X-Remote-Group")
            .arg("--requestheader-extra-headers-prefix=X-Remote-Extra-")
            .arg(format!(
                "--proxy-client-cert-file={}",
                p(&pki.front_proxy_client.cert)
            ))
            .arg(format!(
                "--proxy-client-key-file={}",
                p(&pki.front_proxy_client.key)
            ))
            .arg(format!(
                "--cert-dir={}",
                dir.join(format!("certs-{}", args.name)).display()
            ))
            .arg("--enable-priority-and-fairness=false")
            .arg("--profiling=false")
            .arg("--allow-privileged=true")
            .arg("--v=1");
        let mut proc = Proc::spawn(&format!("kube-apiserver-{}", args.name), cmd, dir)?;
        let kubeconfig = dir.join(format!("{}.kubeconfig", args.name));
        let text = kubeconfig_text(&url, pki, &pki.admin, "admin", args.namespace);
        std::fs::write(&kubeconfig, &text)
            .map_err(|e| BedError::Setup(format!("writing {}: {e}", kubeconfig.display())))?;
        let client = client_from_kubeconfig(&text).await?;
        wait_ready(&client, &mut proc).await?;
        Ok(ApiServer {
            name: args.name.to_string(),
            url,
            kubeconfig,
            client,
            proc,
        })
    }
}

async fn wait_ready(client: &kube::Client, proc: &mut Proc) -> Result<(), BedError> {
    let deadline = Instant::now() + START_TIMEOUT;
    let mut last = String::new();
    loop {
        proc.check_alive()?;
        let req = http::Request::get("/readyz").body(Vec::new());
        if let Ok(req) = req {
            match client.request_text(req).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => last = body,
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() > deadline {
            return Err(BedError::Timeout {
                component: proc.name.clone(),
                log: proc.log.clone(),
                what: format!("/readyz to answer ok (last: {last})"),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A kubeconfig (JSON, which every kubeconfig loader reads as YAML) with embedded certificates.
pub fn kubeconfig_text(
    server: &str,
    pki: &Pki,
    user_cert: &CertFiles,
    user: &str,
    namespace: &str,
) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": {
            "server": server,
            "certificate-authority-data": b64(&pki.ca.cert_pem),
        }}],
        "users": [{"name": user, "user": {
            "client-certificate-data": b64(&user_cert.cert_pem),
            "client-key-data": b64(&user_cert.key_pem),
        }}],
        "contexts": [{"name": "testbed", "context": {
            "cluster": "testbed", "user": user, "namespace": namespace,
        }}],
        "current-context": "testbed",
    })
    .to_string()
}

pub async fn client_from_kubeconfig(text: &str) -> Result<kube::Client, BedError> {
    let kc = Kubeconfig::from_yaml(text)
        .map_err(|e| BedError::Setup(format!("parsing a generated kubeconfig: {e}")))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| BedError::Setup(format!("loading a generated kubeconfig: {e}")))?;
    kube::Client::try_from(config).map_err(|e| BedError::Setup(format!("building a client: {e}")))
}
