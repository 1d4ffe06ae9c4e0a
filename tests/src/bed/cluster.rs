//! etcd and kube-apiserver processes, their kubeconfigs and admin clients.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::bed::certs::{CertFiles, Pki};
use crate::util::process::{Proc, free_port, retry_on_addr_in_use};
use crate::{BedError, util::tools};

const START_TIMEOUT: Duration = Duration::from_secs(120);

pub struct Etcd {
    pub url: String,
    pub proc: Proc,
}

impl Etcd {
    /// Starts etcd on two ports of [`free_port`]; a start that lost a port to another program
    /// is made again on new ones ([`retry_on_addr_in_use`]).
    pub async fn start(dir: &Path) -> Result<Etcd, BedError> {
        retry_on_addr_in_use("etcd", || Etcd::start_once(dir)).await
    }

    async fn start_once(dir: &Path) -> Result<Etcd, BedError> {
        let bin = tools::tool("etcd")?;
        let client = free_port()?;
        let peer = free_port()?;
        let url = format!("http://127.0.0.1:{client}");
        let data = dir.join("etcd-data");
        // A data directory from a start that lost its port names the old peer URL.
        let _ = std::fs::remove_dir_all(&data);
        let mut cmd = Command::new(bin);
        cmd.arg("--name=testbed")
            .arg(format!("--data-dir={}", data.display()))
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
            // Ours answers /health; a program that took the port first would not, and ours
            // then exits with `bind: address already in use`.
            if etcd_healthy(client).await {
                proc.check_alive()?;
                return Ok(Etcd { url, proc });
            }
            if Instant::now() > deadline {
                return Err(BedError::Timeout {
                    component: "etcd".into(),
                    log: proc.log.clone(),
                    what: format!("/health on {url}"),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Does the etcd on `port` answer `GET /health` with `"health":"true"`?
async fn etcd_healthy(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let asked = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        let mut body = Vec::new();
        s.read_to_end(&mut body).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&body).contains("\"health\":\"true\""))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), asked).await,
        Ok(Ok(true))
    )
}

/// One kube-apiserver ("guest" or "harvester") with RBAC on and an admin client.
pub struct ApiServer {
    pub name: String,
    pub url: String,
    /// Admin kubeconfig (user `admin`, group `system:masters`).
    pub kubeconfig: PathBuf,
    pub client: kube::Client,
    pub proc: Proc,
    /// How often [`ApiServer::restart`] ran.
    pub restarts: u32,
    /// The command line, to start it again on the same port with the same flags.
    args: Vec<String>,
    dir: PathBuf,
}

pub struct ApiServerArgs<'a> {
    pub name: &'a str,
    pub etcd_url: &'a str,
    pub service_cidr: &'a str,
    /// Namespace of the kubeconfig's current context.
    pub namespace: &'a str,
}

impl ApiServer {
    /// Starts the server on a port of [`free_port`]; a start that lost its port to another
    /// program is made again on a new one ([`retry_on_addr_in_use`]).
    pub async fn start(
        dir: &Path,
        pki: &Pki,
        args: ApiServerArgs<'_>,
    ) -> Result<ApiServer, BedError> {
        let name = format!("kube-apiserver-{}", args.name);
        retry_on_addr_in_use(&name, || ApiServer::start_once(dir, pki, &args)).await
    }

    async fn start_once(
        dir: &Path,
        pki: &Pki,
        args: &ApiServerArgs<'_>,
    ) -> Result<ApiServer, BedError> {
        let port = free_port()?;
        let url = format!("https://127.0.0.1:{port}");
        let p = |f: &PathBuf| f.display().to_string();
        let flags: Vec<String> = vec![
            format!("--etcd-servers={}", args.etcd_url),
            format!("--etcd-prefix=/{}", args.name),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            format!("--tls-cert-file={}", p(&pki.apiserver.cert)),
            format!("--tls-private-key-file={}", p(&pki.apiserver.key)),
            format!("--client-ca-file={}", p(&pki.ca.cert)),
            "--authorization-mode=RBAC".into(),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-account-key-file={}", p(&pki.sa_pub)),
            format!("--service-account-signing-key-file={}", p(&pki.sa_key)),
            format!("--service-cluster-ip-range={}", args.service_cidr),
            format!(
                "--requestheader-client-ca-file={}",
                p(&pki.front_proxy_ca.cert)
            ),
            "--requestheader-allowed-names=front-proxy-client".into(),
            "--requestheader-username-headers=X-Remote-User".into(),
            "--requestheader-group-headers=X-Remote-Group".into(),
            "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
            format!(
                "--proxy-client-cert-file={}",
                p(&pki.front_proxy_client.cert)
            ),
            format!("--proxy-client-key-file={}", p(&pki.front_proxy_client.key)),
            format!(
                "--cert-dir={}",
                dir.join(format!("certs-{}", args.name)).display()
            ),
            "--enable-priority-and-fairness=false".into(),
            "--profiling=false".into(),
            "--allow-privileged=true".into(),
            // `kubectl logs/exec` through a real node's kubelet (admin: its webhook authz allows).
            format!("--kubelet-client-certificate={}", p(&pki.admin.cert)),
            format!("--kubelet-client-key={}", p(&pki.admin.key)),
            // The node's name does not resolve here; its InternalIP does.
            "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname".into(),
            "--v=1".into(),
        ];
        let cmd = apiserver_command(&flags)?;
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
            restarts: 0,
            args: flags,
            dir: dir.to_path_buf(),
        })
    }

    /// Kills the server (SIGKILL: in-flight requests and watches are cut, as in a crash or an
    /// OOM kill) and starts it again on the same port with the same flags and certificates, then
    /// waits for `/readyz`. Its log goes to `kube-apiserver-<name>-restart<n>.log`.
    pub async fn restart(&mut self) -> Result<(), BedError> {
        self.stop();
        self.start_again().await
    }

    /// Kills the server (SIGKILL); [`ApiServer::start_again`] brings it back.
    pub fn stop(&mut self) {
        self.proc.stop();
    }

    /// Starts a stopped server again on the same port with the same flags and waits for
    /// `/readyz`.
    pub async fn start_again(&mut self) -> Result<(), BedError> {
        self.restarts += 1;
        let name = format!("kube-apiserver-{}-restart{}", self.name, self.restarts);
        self.proc = Proc::spawn(&name, apiserver_command(&self.args)?, &self.dir)?;
        wait_ready(&self.client, &mut self.proc).await
    }
}

fn apiserver_command(flags: &[String]) -> Result<Command, BedError> {
    let mut cmd = Command::new(tools::tool("kube-apiserver")?);
    cmd.args(flags);
    // The suites start about 300 API servers and they were over half of `make test`'s CPU, most
    // of it in their start (OpenAPI specs, the loopback certificate's RSA key, garbage
    // collection). GOGC=400 takes a start from 2.5-3.1 to 1.8-2.1 CPU seconds (4 Dec) for about
    // 100 MiB more resident per server: the bed's processes are short-lived and memory is not
    // what these machines lack.
    cmd.env("GOGC", "400");
    Ok(cmd)
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
