//! `harvester-cloud-provider`: the cloud controller manager of Kubernetes guest clusters on
//! Harvester HCI.
//!
//! [`run`] starts every controller as its own future and joins them:
//! - [`node`]: the node-side controllers ([`node::init`] initialises tainted guest Nodes from
//!   their VMs and keeps their addresses true; [`node::lifecycle`] deletes Nodes whose VM is gone
//!   and taints Nodes whose VM is stopped; [`node::topology`] moves region/zone labels with a
//!   live-migrated VM);
//! - [`service`]: LoadBalancer Services with addresses from Harvester IP pools.
//!
//! The node-side controllers share one watch per resource ([`node::inventory`]). Each reconcile
//! computes a pure `plan` and writes it with at most two patches ([`node::patch`]); errors become
//! Warning Events on the Node and a per-Node backoff ([`node`]).

pub mod config;
pub mod error;
pub mod network;
pub mod node;
pub mod service;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use harvester_common::cloud_config::Harvester;
use harvester_common::telemetry::{Metrics, Readiness};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

pub use config::Config;
pub use error::Error;

/// Field manager of every write, and the Events' reporting controller.
pub const FIELD_MANAGER: &str = "harvester-cloud-provider";

/// Resolves when the process should stop; every controller holds a clone.
pub type Shutdown = Shared<BoxFuture<'static, ()>>;

/// What every controller shares.
pub struct Context {
    /// The guest cluster.
    pub guest: kube::Client,
    /// The Harvester cluster, and the namespace of the guest VMs (from the cloud-config).
    pub harvester: Harvester,
    pub config: Config,
    /// Publishes Events into the guest cluster.
    pub recorder: Recorder,
    pub telemetry: Telemetry,
}

/// Metrics and readiness of the process, shared with `main`'s HTTP endpoints.
#[derive(Clone, Default)]
pub struct Telemetry {
    pub metrics: Metrics,
    pub readiness: Readiness,
}

/// Readiness checks of the cloud provider: both clients built; Harvester answers with the
/// cloud-config's credentials (kept by the binary's `Harvester::watch_credentials`, leader or
/// not); the controllers' caches listed (registered on the leader when they start).
pub const READY_CLIENTS: &str = "clients";
pub const READY_HARVESTER: &str = "harvester";
/// Registered by the controllers when they start (on the leader): their watch caches listed.
pub const READY_NODE_CACHES: &str = "node-caches";
pub const READY_SERVICE_CACHES: &str = "service-caches";

impl Telemetry {
    pub fn new() -> Telemetry {
        Telemetry {
            metrics: Metrics::new(),
            readiness: Readiness::with_checks(&[READY_CLIENTS, READY_HARVESTER]),
        }
    }
}

impl Context {
    /// Loads the cloud-config and the guest kubeconfig; fails with the file and the problem.
    pub async fn new(config: Config, telemetry: Telemetry) -> Result<Context, Error> {
        let harvester =
            Harvester::load_with_metrics(&config.cloud_config, Some(&telemetry.metrics)).await?;
        let guest = guest_client(
            config.kubeconfig.as_deref(),
            config.master.as_ref(),
            Some(&telemetry.metrics),
        )
        .await?;
        telemetry.readiness.set(READY_CLIENTS, Ok(()));
        let recorder = Recorder::new(
            guest.clone(),
            Reporter {
                controller: FIELD_MANAGER.to_string(),
                instance: std::env::var("POD_NAME").ok(),
            },
        );
        Ok(Context {
            guest,
            harvester,
            config,
            recorder,
            telemetry,
        })
    }

    /// The Harvester namespace holding the guest VMs.
    pub fn namespace(&self) -> &str {
        &self.harvester.namespace
    }
}

/// The guest cluster's client: `path`, or in-cluster config (then `KUBECONFIG`, `~/.kube/config`).
pub async fn guest_client(
    path: Option<&Path>,
    master: Option<&http::Uri>,
    metrics: Option<&Metrics>,
) -> Result<kube::Client, Error> {
    let fail = |reason: String| Error::GuestConfig {
        path: path.map(Path::to_path_buf),
        reason,
    };
    let mut config = match path {
        Some(p) => {
            let kubeconfig = Kubeconfig::read_from(p).map_err(|e| fail(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|e| fail(e.to_string()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| fail(e.to_string()))?,
    };
    if let Some(master) = master {
        config.cluster_url = master.clone();
    }
    harvester_common::telemetry::kube_client(config, metrics).map_err(|e| fail(e.to_string()))
}

/// Runs every enabled controller until `shutdown` resolves. Fails only at start (cloud-config,
/// guest kubeconfig); afterwards errors are retried, reported as Events and never end the run.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    run_with(config, Telemetry::new(), shutdown).await
}

/// [`run`], reporting into `telemetry` (the process's `/metrics` and `/readyz`).
pub async fn run_with(
    config: Config,
    telemetry: Telemetry,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let ctx = Arc::new(Context::new(config, telemetry).await?);
    if let Some(w) = ctx.config.cluster_name_warning() {
        tracing::warn!("{w}");
    }
    tracing::info!(
        cloud_config = %ctx.harvester.path.display(),
        namespace = %ctx.namespace(),
        cluster = %ctx.config.cluster_name,
        config = ?ctx.config,
        "starting"
    );
    let shutdown: Shutdown = shutdown.boxed().shared();

    let (nodes, watches) = node::NodeCtx::start(&ctx, shutdown.clone());
    let node_caches = report_node_caches(&ctx, &nodes, shutdown.clone());
    // One future per controller; each returns at once when `--controllers` disables it.
    tokio::join!(
        watches,
        node::init::run(nodes.clone(), shutdown.clone()),
        node::lifecycle::run(nodes.clone(), shutdown.clone()),
        node::topology::run(nodes.clone(), shutdown.clone()),
        run_service_controller(&ctx, shutdown.clone()),
        node_caches,
    );
    tracing::info!("stopped");
    Ok(())
}

/// The `node-caches` readiness check: false until the Node, VM and VMI caches have listed
/// (absent when no node-side controller runs).
async fn report_node_caches(ctx: &Context, nodes: &node::NodeCtx, shutdown: Shutdown) {
    if !node::node_side_enabled(ctx) {
        return;
    }
    let readiness = &ctx.telemetry.readiness;
    readiness.set(
        READY_NODE_CACHES,
        Err(
            "waiting for the Node, VirtualMachine and VirtualMachineInstance watches to list"
                .into(),
        ),
    );
    if nodes.wait_ready(&shutdown).await {
        readiness.set(READY_NODE_CACHES, Ok(()));
    }
}

/// Makes a cloud-config expiry warning a Warning Event `CloudConfigTokenExpiring` on the
/// provider's own Pod (`POD_NAME` and `POD_NAMESPACE`, from the downward API), where `kubectl
/// describe pod` shows it; without them only the log line remains.
pub fn token_expiry_event(guest: kube::Client) -> impl Fn(&str) + Send + Sync + 'static {
    let pod = match (std::env::var("POD_NAME"), std::env::var("POD_NAMESPACE")) {
        (Ok(name), Ok(namespace)) if !name.is_empty() && !namespace.is_empty() => {
            Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(name),
                namespace: Some(namespace),
                ..Default::default()
            })
        }
        _ => None,
    };
    let recorder = Recorder::new(
        guest,
        Reporter {
            controller: FIELD_MANAGER.to_string(),
            instance: pod.as_ref().and_then(|p| p.name.clone()),
        },
    );
    move |warning: &str| {
        let Some(pod) = pod.clone() else {
            return;
        };
        let (recorder, note) = (recorder.clone(), warning.to_string());
        tokio::spawn(async move {
            let event = Event {
                type_: EventType::Warning,
                reason: "CloudConfigTokenExpiring".into(),
                note: Some(note),
                action: "CheckCredentials".into(),
                secondary: None,
            };
            if let Err(e) = recorder.publish(&event, &pod).await {
                tracing::warn!(error = %e, "could not publish the token expiry Event on the Pod");
            }
        });
    }
}

async fn run_service_controller(ctx: &Context, shutdown: Shutdown) {
    if !ctx
        .config
        .controllers
        .enabled(config::SERVICE_LB_CONTROLLER)
    {
        return;
    }
    let settings = service::plan::LbSettings {
        cluster_name: ctx.config.cluster_name.clone(),
        management_network: ctx
            .config
            .management_network
            .as_ref()
            .map(ToString::to_string),
        load_balancer_class: ctx.config.service.load_balancer_class.clone(),
        dhcp_mode: ctx.config.service.dhcp_mode.clone(),
        dhcp_interface: ctx.config.service.dhcp_interface.clone(),
        concurrency: ctx.config.service.concurrency,
    };
    service::run(
        ctx.guest.clone(),
        ctx.harvester.client.clone(),
        ctx.namespace().to_string(),
        settings,
        ctx.config.node.resync,
        Some(ctx.telemetry.clone()),
        shutdown,
    )
    .await;
}

/// A cloud provider running on the current Tokio runtime (tests, the demo, embedding).
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), Error>>,
}

/// Starts [`run`] as a task; [`Running::stop`] shuts it down.
pub fn spawn(config: Config) -> Running {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(config, async move {
        let _ = stopped.await;
    }));
    Running {
        stop: Some(stop),
        task,
    }
}

impl Running {
    /// Whether the task has ended (a start-up failure ends it at once).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Asks every controller to stop and waits for them.
    pub async fn stop(mut self) -> Result<(), Error> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result,
            Err(e) => Err(Error::Task(e.to_string())),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}
