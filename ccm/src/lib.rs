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
//! Every controller gets the one [`Context`] ([`context`]: clients, flags, Event recorder,
//! telemetry) and stands on one harness ([`controller`]: backoff, Event publishing through
//! [`event_recorder`], reconcile metrics, resync ticks). Each reconcile fetches from caches,
//! computes a pure plan and applies it; errors become Warning Events with a stable reason and a
//! per-object backoff. The node-side controllers share one watch per resource
//! ([`node::inventory`]) and write with at most two patches ([`node::patch`]). Around the
//! controllers, for `main`: [`leader`] (upstream's Lease election) and [`secure`] (`/healthz`,
//! `/readyz`, `/metrics` over HTTPS with delegated authentication). Both sides keep their writes
//! that the caches have not shown yet in a [`written::WriteLog`], so no reconcile repeats a write
//! from a lagging cache. This module only wires; it defines no shared type.

pub mod config;
pub mod context;
pub mod controller;
pub mod error;
pub mod event_recorder;
pub mod leader;
pub mod network;
pub mod node;
pub mod secure;
pub mod service;
pub mod written;

use harvester_common::running::OnDrop;
use std::future::Future;
use std::sync::Arc;

use futures::FutureExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::EventType;

pub use config::Config;
pub use context::{
    Context, FIELD_MANAGER, READY_CLIENTS, READY_HARVESTER, READY_NODE_CACHES,
    READY_SERVICE_CACHES, Shutdown, Telemetry, guest_client,
};
pub use error::Error;

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
    run_on(Context::new(config, telemetry).await?, shutdown).await;
    Ok(())
}

/// [`run`] on a context made by the caller ([`Context::loaded`]: the binary's own clients).
pub async fn run_on(ctx: Context, shutdown: impl Future<Output = ()> + Send + 'static) {
    let ctx = Arc::new(ctx);
    if let Some(w) = ctx.config.cluster_name_warning() {
        tracing::warn!("{w}");
    }
    tracing::info!(
        cloud_config = %ctx.config.cloud_config.display(),
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
        service::run(ctx.clone(), shutdown.clone()),
        node_caches,
    );
    tracing::info!("stopped");
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
    let recorder = controller::recorder(guest);
    move |warning: &str| {
        let Some(pod) = pod.clone() else {
            return;
        };
        controller::publish_event(
            &recorder,
            pod,
            EventType::Warning,
            "CloudConfigTokenExpiring",
            "CheckCredentials".into(),
            warning.to_string(),
        );
    }
}

/// The provider running on the current Tokio runtime; dropping it aborts every controller.
pub type Running = harvester_common::running::Running<Error>;

/// Starts [`run`] as a task; [`Running::stop`] shuts it down.
pub fn spawn(config: Config) -> Running {
    Running::spawn(|stopped| run(config, stopped), OnDrop::Abort)
}
