//! Harvester's real load balancer in place of the stand-ins (`TESTBED_LB_UPSTREAM=<dir>`, built by
//! `make lb-upstream LB_SRC=...`): the controller `harvester-load-balancer` and the `webhook` of
//! harvester/load-balancer-harvester, run from `<dir>` against the bed's Harvester API server.
//!
//! The webhook registers its own configurations for Service `harvester-system/
//! harvester-load-balancer-webhook` port 443 (vendored harvester/webhook `pkg/server/server.go`)
//! with a certificate and CA it makes itself; the Service is an ExternalName to localhost, so the
//! webhook serves on port 443 of this machine (one such bed at a time).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kube::api::{Api, DynamicObject, PostParams};

use crate::BedError;
use crate::bed::apply::apply_yaml;
use crate::bed::crds::{NAD_CRD, install_crd_yaml};
use crate::sim::{lb_validator, lb_webhook};
use crate::util::process::{Proc, tail};

/// The variable naming the directory with the two binaries.
pub const ENV: &str = "TESTBED_LB_UPSTREAM";

const SERVICE: &str = "apiVersion: v1
kind: Service
metadata: {name: harvester-load-balancer-webhook, namespace: harvester-system}
spec: {type: ExternalName, externalName: localhost, ports: [{name: https, port: 443, protocol: TCP}]}
";

/// The webhook applies its configurations about 16 s after it starts; the rest is margin for a
/// loaded machine.
const READY_WITHIN: Duration = Duration::from_secs(120);

/// `TESTBED_LB_UPSTREAM`, when set and not empty.
pub fn from_env() -> Option<PathBuf> {
    std::env::var_os(ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Whether this test process runs against the real load balancer: a test of a stand-in-only
/// knob prints why it skips and returns.
pub fn skip(test: &str, why: &str) -> bool {
    if from_env().is_none() {
        return false;
    }
    eprintln!("SKIPPED {test} with {ENV} (Harvester's real LB controller and webhook): {why}");
    true
}

/// The two processes; dropping it stops them.
pub struct LbUpstream {
    pub controller: Proc,
    pub webhook: Proc,
}

impl LbUpstream {
    /// Installs what they need (the NAD CRD, the webhook's Service), starts both with `kubeconfig`
    /// (the Harvester admin's) and waits until the API server calls the real validator and
    /// mutator. A missing binary or a process that exits fails with its log.
    pub async fn start(
        bin_dir: &Path,
        root: &Path,
        client: &kube::Client,
        kubeconfig: &Path,
        namespace: &str,
    ) -> Result<LbUpstream, BedError> {
        for bin in ["harvester-load-balancer", "webhook"] {
            if !bin_dir.join(bin).is_file() {
                return Err(BedError::Setup(format!(
                    "{ENV}={}: no {bin} there; `make lb-upstream LB_SRC=<checkout>` builds it",
                    bin_dir.display()
                )));
            }
        }
        install_crd_yaml(client, NAD_CRD.0, NAD_CRD.1).await?;
        apply_yaml(client, SERVICE, "harvester-system").await?;

        let command = |bin: &str, args: &[&str]| {
            let mut cmd = Command::new(bin_dir.join(bin));
            cmd.args(args).env("KUBECONFIG", kubeconfig);
            cmd
        };
        let controller = Proc::spawn(
            "lb-upstream-controller",
            command("harvester-load-balancer", &[]),
            root,
        )?;
        port_443_free().await?;
        let webhook = Proc::spawn(
            "lb-upstream-webhook",
            command("webhook", &["--https-port", "443"]),
            root,
        )?;
        let mut up = LbUpstream {
            controller,
            webhook,
        };
        up.wait_called(client, namespace).await?;
        Ok(up)
    }

    pub fn pids(&self) -> [u32; 2] {
        [self.controller.pid(), self.webhook.pid()]
    }

    /// Until a dry-run create the validator refuses is refused by it and one the mutator annotates
    /// comes back annotated, both processes still running.
    async fn wait_called(
        &mut self,
        client: &kube::Client,
        namespace: &str,
    ) -> Result<(), BedError> {
        let api: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            namespace,
            &lb_webhook::loadbalancer_resource(),
        );
        let dry_run = PostParams {
            dry_run: true,
            ..Default::default()
        };
        let refused: DynamicObject =
            probe(serde_json::json!({"workloadType": "vm", "ipam": "pool"}))?;
        let mutated: DynamicObject =
            probe(serde_json::json!({"workloadType": "vm", "ipam": "pool",
            "listeners": [{"name": "probe", "port": 80, "protocol": "TCP", "backendPort": 80}]}))?;
        let deadline = Instant::now() + READY_WITHIN;
        let mut last = String::new();
        loop {
            self.controller.check_alive()?;
            self.webhook.check_alive()?;
            let validator = match api.create(&dry_run, &refused).await {
                Err(kube::Error::Api(s)) if s.message.contains(lb_validator::WEBHOOK_NAME) => true,
                other => {
                    last = format!("validator probe: {:?}", other.map(|_| "admitted"));
                    false
                }
            };
            let mutator = validator
                && match api.create(&dry_run, &mutated).await {
                    Ok(made) => {
                        let ann = made.metadata.annotations.unwrap_or_default();
                        last = format!("mutator probe came back with annotations {ann:?}");
                        ann.contains_key(lb_webhook::ANN_NAMESPACE)
                    }
                    Err(e) => {
                        last = format!("mutator probe: {e}");
                        false
                    }
                };
            if mutator {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(BedError::Timeout {
                    component: "Harvester's LB webhook".into(),
                    log: self.webhook.log.clone(),
                    what: format!(
                        "the API server calling it ({last}); controller log {}:\n{}",
                        self.controller.log.display(),
                        tail(&self.controller.log, 10)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Waits (bounded) until port 443 can be bound: the webhook exits when it cannot, and the
/// previous bed's webhook, or another bed of this mode, may still hold it.
async fn port_443_free() -> Result<(), BedError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match std::net::TcpListener::bind(("0.0.0.0", 443)) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => {
                return Err(BedError::Setup(format!(
                    "port 443 for Harvester's LB webhook: {e} (`ss -ltnp sport = :443` names who \
                     holds it; one bed with {ENV} at a time)"
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

fn probe(spec: serde_json::Value) -> Result<DynamicObject, BedError> {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": "testbed-upstream-probe"},
        "spec": spec
    }))
    .map_err(|e| BedError::Setup(format!("LB probe: {e}")))
}
