//! KubeVirt's own virt-api and virt-controller in the bed (`BedOptions { kubevirt: Some(..) }`):
//! what virt-operator would install (the output of `tests/kubevirt/install-manifests`, built with
//! the binaries by `tests/scripts/kubevirt.sh`), adapted to a bed without Pods or cluster DNS,
//! and the two binaries as processes. The steps and their reasons are those of
//! `tests/kubevirt/smoke.sh` (docs/testbed.md, "Real KubeVirt").

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use futures::{StreamExt, TryStreamExt};
use harvester_common::harvester::HotplugMode;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use crate::BedError;
use crate::bed::apply::{apply_value, apply_yaml};
use crate::bed::certs::{KeyUsage, Pki};
use crate::bed::cluster::client_from_kubeconfig;
use crate::bed::crds::wait_established;
use crate::util::process::{Proc, free_port, tail};

/// KubeVirt's namespace: with no service-account namespace file both binaries take it
/// (kubevirt/kubevirt `staging/src/kubevirt.io/client-go/util/util.go` `GetNamespace`).
pub const NAMESPACE: &str = "kubevirt";

/// The feature gate of KubeVirt's `addvolume`/`removevolume` requests.
pub const HOTPLUG_VOLUMES: &str = "HotplugVolumes";
/// The feature gate of hot-plug by VM spec edits.
pub const DECLARATIVE_HOTPLUG_VOLUMES: &str = "DeclarativeHotplugVolumes";

/// One KubeVirt line as a Harvester release runs it: the upstream tag built by
/// `tests/scripts/kubevirt.sh`, the hot-plug feature gates Harvester's chart enables, and the
/// release's `server-version` mode. docs/compatibility.md says which releases each stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KubevirtLine {
    /// Upstream tag without the `v` (`1.7.0`).
    pub version: &'static str,
    /// The KubeVirt CR's `developerConfiguration.featureGates`.
    pub gates: &'static [&'static str],
    /// What Harvester's `server-version` tells the driver.
    pub harvester: HotplugMode,
}

impl KubevirtLine {
    /// Harvester v1.7 (KubeVirt v1.6): `HotplugVolumes`.
    pub const V1_6_HOTPLUG: KubevirtLine = KubevirtLine {
        version: "1.6.1",
        gates: &[HOTPLUG_VOLUMES],
        harvester: HotplugMode::Subresource,
    };
    /// Harvester v1.8 (KubeVirt v1.7): `DeclarativeHotplugVolumes` alone.
    pub const V1_7_DECLARATIVE: KubevirtLine = KubevirtLine {
        version: "1.7.0",
        gates: &[DECLARATIVE_HOTPLUG_VOLUMES],
        harvester: HotplugMode::Declarative,
    };
    /// Harvester v1.8 with `HotplugVolumes` enabled again by an administrator.
    pub const V1_7_BOTH: KubevirtLine = KubevirtLine {
        version: "1.7.0",
        gates: &[HOTPLUG_VOLUMES, DECLARATIVE_HOTPLUG_VOLUMES],
        harvester: HotplugMode::Declarative,
    };
    /// Harvester v1.9 (KubeVirt v1.8): `DeclarativeHotplugVolumes` alone.
    pub const V1_8_DECLARATIVE: KubevirtLine = KubevirtLine {
        version: "1.8.0",
        gates: &[DECLARATIVE_HOTPLUG_VOLUMES],
        harvester: HotplugMode::Declarative,
    };

    /// Every line and gate set, by the name `TESTBED_KUBEVIRT` gives it.
    pub const NAMED: [(&'static str, KubevirtLine); 4] = [
        ("v1.6-hotplug", KubevirtLine::V1_6_HOTPLUG),
        ("v1.7-declarative", KubevirtLine::V1_7_DECLARATIVE),
        ("v1.7-both", KubevirtLine::V1_7_BOTH),
        ("v1.8-declarative", KubevirtLine::V1_8_DECLARATIVE),
    ];

    /// The line `TESTBED_KUBEVIRT` names (`make test` reruns the CSI suites under some); unset
    /// or empty: none, the stand-in.
    pub fn from_env() -> Option<KubevirtLine> {
        let name = std::env::var("TESTBED_KUBEVIRT").unwrap_or_default();
        if name.is_empty() {
            return None;
        }
        match Self::NAMED.iter().find(|(n, _)| *n == name) {
            Some((_, line)) => Some(*line),
            None => panic!(
                "TESTBED_KUBEVIRT={name:?}: expected one of {:?}",
                Self::NAMED.map(|(n, _)| n)
            ),
        }
    }

    pub fn has_gate(&self, gate: &str) -> bool {
        self.gates.contains(&gate)
    }

    /// Where `tests/scripts/kubevirt.sh` puts this line (its `kv_dir`).
    pub fn dir(&self) -> PathBuf {
        cache_root().join(format!("kubevirt-v{}", self.version))
    }

    /// The build's log (`kubevirt.sh`'s `logs/build-kubevirt-vX.log`).
    pub fn build_log(&self) -> PathBuf {
        cache_root()
            .join("logs")
            .join(format!("build-kubevirt-v{}.log", self.version))
    }

    /// Ok when every binary of the line is built, else an error with the build's log.
    pub fn check_built(&self) -> Result<(), BedError> {
        for name in ["virt-api", "virt-controller", "install-manifests"] {
            self.binary(name)?;
        }
        Ok(())
    }

    /// A built binary of the line, or an error with the build's log.
    fn binary(&self, name: &str) -> Result<PathBuf, BedError> {
        let path = self.dir().join(name);
        if path.is_file() {
            return Ok(path);
        }
        let log = self.build_log();
        Err(BedError::Setup(format!(
            "KubeVirt v{} is not built ({} is missing): run KUBEVIRT_VERSIONS={} tests/scripts/kubevirt.sh \
             (`make test` does); its build log {}:\n{}",
            self.version,
            path.display(),
            self.version,
            log.display(),
            if log.is_file() {
                tail(&log, 30)
            } else {
                "(no log: never built)".into()
            }
        )))
    }
}

/// `$HARVESTER_TESTBED_CACHE`, else `~/.cache/harvester-testbed` (as the build scripts).
fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("HARVESTER_TESTBED_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/harvester-testbed")
}

/// virt-api and virt-controller of one line, running against the Harvester API server; dropping
/// it stops both.
pub struct RealKubevirt {
    pub line: KubevirtLine,
    pub virt_api: Proc,
    pub virt_controller: Proc,
    pub virt_api_port: u16,
    /// kubevirt-handler's client: the node play writes VMIs as virt-handler does, since
    /// virt-api's VMI mutator puts back the status any other identity writes
    /// (`pkg/virt-api/webhooks/mutating-webhook/mutators/vmi-mutator.go`,
    /// `pkg/virt-api/webhooks/serviceaccounts.go`).
    pub handler: kube::Client,
    /// The APIServices, registered by [`RealKubevirt::wait_serving`] once virt-api listens.
    unregistered: Vec<Value>,
    launched: Instant,
}

impl RealKubevirt {
    /// Installs the line into the API server of `client` (at `server`) and starts virt-api and
    /// virt-controller; [`RealKubevirt::wait_serving`] waits until they serve, so that the bed
    /// sets up its other parts meanwhile.
    pub async fn launch(
        line: KubevirtLine,
        dir: &Path,
        pki: &Pki,
        client: &kube::Client,
        server: &str,
    ) -> Result<RealKubevirt, BedError> {
        let virt_api_bin = line.binary("virt-api")?;
        let virt_controller_bin = line.binary("virt-controller")?;
        let manifests = install_manifests(&line, dir)?;
        // Certificates apart from the logs: both binaries watch their certificates' directory
        // (fsnotify, `bootstrap.NewFileCertificateManager`) and reload on every change in it.
        let certs = dir.join("kubevirt-certs");
        std::fs::create_dir_all(&certs)
            .map_err(|e| BedError::Setup(format!("creating {}: {e}", certs.display())))?;
        let serving = pki.leaf(
            &certs,
            "virt-api",
            "virt-api",
            &[],
            &["virt-api.kubevirt.svc", "localhost", "127.0.0.1"],
            KeyUsage::ServerAuth,
        )?;
        // Must exist as files; nothing dials virt-handler or scrapes metrics here.
        let handler_client = pki.leaf(
            &certs,
            "virt-handler-client",
            "kubevirt.io:system:client:virt-handler",
            &[],
            &[],
            KeyUsage::ClientAuth,
        )?;
        let metrics = pki.leaf(
            &certs,
            "virt-controller-metrics",
            "virt-controller",
            &[],
            &["localhost", "127.0.0.1"],
            KeyUsage::ServerAuth,
        )?;
        let virt_api_port = free_port()?;
        let apiservices = install(
            client,
            &manifests.docs,
            &pki.ca.cert_pem,
            virt_api_port,
            &line,
        )
        .await?;

        let mut kubeconfigs = Vec::new();
        for sa in [
            "kubevirt-apiserver",
            "kubevirt-controller",
            "kubevirt-handler",
        ] {
            let text = token_kubeconfig(server, pki, &token(client, sa).await?);
            let path = dir.join(format!("{sa}.kubeconfig"));
            std::fs::write(&path, &text)
                .map_err(|e| BedError::Setup(format!("writing {}: {e}", path.display())))?;
            kubeconfigs.push((path, text));
        }
        let handler = client_from_kubeconfig(&kubeconfigs[2].1).await?;
        let p = |f: &Path| f.display().to_string();

        let mut cmd = Command::new(virt_api_bin);
        cmd.arg(format!("--kubeconfig={}", p(&kubeconfigs[0].0)))
            .arg("--listen=127.0.0.1")
            .arg(format!("--port={virt_api_port}"))
            .arg(format!("--tls-cert-file={}", p(&serving.cert)))
            .arg(format!("--tls-key-file={}", p(&serving.key)))
            .arg(format!("--handler-cert-file={}", p(&handler_client.cert)))
            .arg(format!("--handler-key-file={}", p(&handler_client.key)));
        let virt_api = Proc::spawn("virt-api", cmd, dir)?;
        let mut cmd = Command::new(virt_controller_bin);
        let v = line.version;
        cmd.arg(format!("--kubeconfig={}", p(&kubeconfigs[1].0)))
            .arg("--listen=127.0.0.1")
            .arg(format!("--port={}", free_port()?))
            .arg(format!(
                "--launcher-image=quay.io/kubevirt/virt-launcher:v{v}"
            ))
            .arg(format!(
                "--exporter-image=quay.io/kubevirt/virt-exportserver:v{v}"
            ))
            .arg(format!("--prom-cert-file={}", p(&metrics.cert)))
            .arg(format!("--prom-key-file={}", p(&metrics.key)));
        let virt_controller = Proc::spawn("virt-controller", cmd, dir)?;
        Ok(RealKubevirt {
            line,
            virt_api,
            virt_controller,
            virt_api_port,
            handler,
            unregistered: apiservices,
            launched: Instant::now(),
        })
    }

    /// Registers the APIServices once virt-api listens, then waits until the aggregator calls
    /// them Available and virt-controller holds its Lease; fails with the log of the one that
    /// died or did not get there.
    pub async fn wait_serving(&mut self, client: &kube::Client) -> Result<(), BedError> {
        let t0 = self.launched;
        let limit = Duration::from_secs(120);
        let (v, virt_api_port) = (self.line.version, self.virt_api_port);
        // The APIServices are registered once virt-api listens: the aggregator's first
        // availability check of one registered earlier fails, and its next comes about 5 s later.
        let mut unregistered = Some(std::mem::take(&mut self.unregistered));
        let apiservices: Api<APIService> = Api::all(client.clone());
        let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
        loop {
            self.virt_api.check_alive()?;
            self.virt_controller.check_alive()?;
            if unregistered.is_some()
                && tokio::net::TcpStream::connect(("127.0.0.1", virt_api_port))
                    .await
                    .is_ok()
            {
                for doc in unregistered.take().into_iter().flatten() {
                    apply_value(client, doc, NAMESPACE).await?;
                }
            }
            let listening = unregistered.is_none();
            let available = listening
                && apiservices
                    .get_opt("v1.subresources.kubevirt.io")
                    .await?
                    .and_then(|s| s.status?.conditions)
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c.type_ == "Available" && c.status == "True")
                    });
            let leader = crate::util::wait::lease_holder(&leases, "virt-controller").await;
            if available && leader.is_some() {
                break;
            }
            if t0.elapsed() > limit {
                let (component, log) = if available {
                    ("virt-controller", self.virt_controller.log.clone())
                } else {
                    ("virt-api", self.virt_api.log.clone())
                };
                return Err(BedError::Timeout {
                    component: component.into(),
                    log,
                    what: format!(
                        "KubeVirt v{v}: virt-api listening on port {virt_api_port} ({listening}), \
                         APIService v1.subresources.kubevirt.io Available ({available}) and Lease \
                         {NAMESPACE}/virt-controller held ({leader:?}) within {limit:?}"
                    ),
                });
            }
            let pause = if listening { 200 } else { 50 };
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        tracing::info!(
            "KubeVirt v{v} ({:?}) serving {:.1}s after its start",
            self.line.gates,
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    }

    pub fn pids(&self) -> Vec<u32> {
        vec![self.virt_api.pid(), self.virt_controller.pid()]
    }
}

/// `install-manifests --namespace kubevirt` of one line: its output and the objects in it.
struct Manifests {
    yaml: Vec<u8>,
    docs: Vec<Value>,
}

/// What virt-operator would install for the line: `install-manifests --namespace kubevirt`, run
/// and parsed (about a second: some 60 000 lines of YAML) once per line in a test process; its
/// output is written to the bed's `kubevirt-install.yaml`.
fn install_manifests(line: &KubevirtLine, dir: &Path) -> Result<Arc<Manifests>, BedError> {
    static PARSED: Mutex<Vec<(&'static str, Arc<Manifests>)>> = Mutex::new(Vec::new());
    let manifests = {
        let mut parsed = PARSED.lock().unwrap_or_else(|p| p.into_inner());
        match parsed.iter().find(|(v, _)| *v == line.version) {
            Some((_, m)) => m.clone(),
            None => {
                let m = Arc::new(run_install_manifests(line)?);
                parsed.push((line.version, m.clone()));
                m
            }
        }
    };
    let _ = std::fs::write(dir.join("kubevirt-install.yaml"), &manifests.yaml);
    Ok(manifests)
}

fn run_install_manifests(line: &KubevirtLine) -> Result<Manifests, BedError> {
    let bin = line.binary("install-manifests")?;
    let out = Command::new(&bin)
        .args(["--namespace", NAMESPACE])
        .output()
        .map_err(|e| BedError::Setup(format!("running {}: {e}", bin.display())))?;
    if !out.status.success() {
        return Err(BedError::Setup(format!(
            "{} failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let docs: Vec<Value> = serde_saphyr::from_multiple(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| BedError::Setup(format!("parsing install-manifests' output: {e}")))?;
    Ok(Manifests {
        yaml: out.stdout,
        docs: docs.into_iter().filter(|d| !d.is_null()).collect(),
    })
}

/// The manifests with the bed's changes: virt-api's CA as the `caBundle` of every webhook and
/// APIService (virt-operator injects it) and, since the Service `virt-api` is an ExternalName to
/// localhost, virt-api's real port in each reference to it; virt-operator's own webhook left out
/// (no virt-operator runs).
pub fn for_the_bed(docs: Vec<Value>, ca_pem: &str, port: u16) -> Vec<Value> {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    docs.into_iter()
        .filter(|d| {
            !(d["kind"] == "ValidatingWebhookConfiguration"
                && d["metadata"]["name"] == "virt-operator-validator")
        })
        .map(|mut d| {
            match d["kind"].as_str() {
                Some("ValidatingWebhookConfiguration" | "MutatingWebhookConfiguration") => {
                    for w in d["webhooks"].as_array_mut().into_iter().flatten() {
                        w["clientConfig"]["caBundle"] = json!(ca);
                        w["clientConfig"]["service"]["port"] = json!(port);
                    }
                }
                Some("APIService") => {
                    d["spec"]["caBundle"] = json!(ca);
                    d["spec"]["service"]["port"] = json!(port);
                }
                _ => {}
            }
            d
        })
        .collect()
}

/// Applies the manifests (CRDs first and Established, so no webhook sees a type not yet
/// served), the ExternalName Service, `kubevirt-ca` and the KubeVirt CR with its status; returns
/// the APIServices, to register once virt-api listens.
async fn install(
    client: &kube::Client,
    manifests: &[Value],
    ca_pem: &str,
    port: u16,
    line: &KubevirtLine,
) -> Result<Vec<Value>, BedError> {
    let docs = for_the_bed(manifests.to_vec(), ca_pem, port);
    let (apiservices, docs): (Vec<Value>, Vec<Value>) =
        docs.into_iter().partition(|d| d["kind"] == "APIService");
    let (crds, rest): (Vec<Value>, Vec<Value>) = docs
        .into_iter()
        .partition(|d| d["kind"] == "CustomResourceDefinition");
    let names: Vec<String> = futures::stream::iter(crds)
        .map(|crd| apply_value(client, crd, NAMESPACE))
        .buffer_unordered(8)
        .map_ok(|applied| applied.metadata.name.unwrap_or_default())
        .try_collect()
        .await?;
    wait_established(client, names).await?;
    // Independent objects (RBAC, ServiceAccounts, webhook configurations, the admission
    // policy): applied side by side.
    futures::stream::iter(rest)
        .map(|doc| apply_value(client, doc, NAMESPACE))
        .buffer_unordered(8)
        .try_collect::<Vec<_>>()
        .await?;
    let yaml = format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: virt-api, namespace: {NAMESPACE}}}
spec: {{type: ExternalName, externalName: localhost, ports: [{{name: https, port: {port}, protocol: TCP}}]}}
"#
    );
    apply_yaml(client, &yaml, NAMESPACE).await?;
    // The CA virt-api trusts for virt-handler's clients (`--ca-configmap-name`).
    apply_value(
        client,
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "kubevirt-ca", "namespace": NAMESPACE},
               "data": {"ca-bundle": ca_pem}}),
        NAMESPACE,
    )
    .await?;
    apply_value(
        client,
        json!({"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
               "metadata": {"name": "kubevirt", "namespace": NAMESPACE},
               "spec": {"configuration": {"developerConfiguration": {"featureGates": line.gates}}}}),
        NAMESPACE,
    )
    .await?;
    // The cluster config reads a CR only once `status.phase` is set, and takes the default
    // architecture from its status (`pkg/virt-config/configuration.go`
    // `GetConfigFromKubeVirtCR`, `setConfigFromKubeVirt`): without it virt-controller's VMI
    // create is refused (`unsupported architecture: `).
    let gvk = GroupVersionKind::gvk("kubevirt.io", "v1", "KubeVirt");
    let kubevirts: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NAMESPACE, &ApiResource::from_gvk(&gvk));
    let v = format!("v{}", line.version);
    kubevirts
        .patch_status(
            "kubevirt",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Deployed", "defaultArchitecture": "amd64",
                                            "observedKubeVirtVersion": v, "targetKubeVirtVersion": v}})),
        )
        .await?;
    Ok(apiservices)
}

/// A day's token of ServiceAccount `kubevirt/<sa>` (the SAs and their RBAC come from the
/// manifests).
async fn token(client: &kube::Client, sa: &str) -> Result<String, BedError> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(24 * 3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let issued: TokenRequest = api
        .create_subresource("token", sa, &PostParams::default(), &request)
        .await?;
    issued
        .status
        .map(|s| s.token)
        .ok_or_else(|| BedError::Api(format!("no token issued for {NAMESPACE}/{sa}")))
}

fn token_kubeconfig(server: &str, pki: &Pki, token: &str) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": {
            "server": server, "certificate-authority-data": b64(&pki.ca.cert_pem)}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": "sa",
                                                     "namespace": NAMESPACE}}],
        "current-context": "testbed",
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bed_points_webhooks_and_apiservices_at_virt_api_and_drops_the_operator() {
        let docs = vec![
            json!({"kind": "ValidatingWebhookConfiguration", "metadata": {"name": "virt-operator-validator"},
                   "webhooks": [{"clientConfig": {"service": {"name": "virt-operator"}}}]}),
            json!({"kind": "MutatingWebhookConfiguration", "metadata": {"name": "virt-api-mutator"},
                   "webhooks": [{"clientConfig": {"service": {"name": "virt-api", "port": 443}}}]}),
            json!({"kind": "APIService", "metadata": {"name": "v1.subresources.kubevirt.io"},
                   "spec": {"service": {"name": "virt-api", "port": 443}}}),
            json!({"kind": "ClusterRole", "metadata": {"name": "kubevirt.io:view"}}),
        ];
        let out = for_the_bed(docs, "PEM", 21000);
        assert_eq!(out.len(), 3, "virt-operator-validator left out");
        let ca = base64::engine::general_purpose::STANDARD.encode("PEM");
        assert_eq!(out[0]["webhooks"][0]["clientConfig"]["caBundle"], ca);
        assert_eq!(
            out[0]["webhooks"][0]["clientConfig"]["service"]["port"],
            21000
        );
        assert_eq!(out[1]["spec"]["caBundle"], ca);
        assert_eq!(out[1]["spec"]["service"]["port"], 21000);
        assert_eq!(
            out[2],
            json!({"kind": "ClusterRole", "metadata": {"name": "kubevirt.io:view"}})
        );
    }
}
