//! The node-side controllers and what they share: their context, the wiring of a
//! `Controller<Node>` on the shared inventory, and the error edge (Warning Event with a stable
//! reason, per-Node backoff).
//!
//! - [`init`]: initialises tainted guest Nodes from their VMs and keeps their addresses true;
//! - [`lifecycle`]: deletes Nodes whose VM is gone, taints Nodes whose VM is stopped;
//! - [`topology`]: moves region/zone labels with a live-migrated VM;
//! - [`inventory`]: the shared watches and the VM/VMI lookup of a Node;
//! - [`patch`]: the Node writes; [`addresses`]: upstream's address rules.

pub mod addresses;
pub mod init;
pub mod inventory;
pub mod lifecycle;
pub mod patch;
pub mod topology;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::Resource;
use kube::ResourceExt;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use crate::config::{CLOUD_NODE_CONTROLLER, CLOUD_NODE_LIFECYCLE_CONTROLLER};
use crate::context::{Context, Shutdown};
use crate::controller::{self as harness, Backoff, Triggers};
use crate::error::{Error, one_line};
use crate::node::inventory::Inventory;
use crate::node::patch::node_key;
use crate::written::WriteLog;

/// First and longest retry delay after a failed reconcile (doubling in between).
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Retry delay after a write conflict (the cache catches up within milliseconds).
const CONFLICT_RETRY: Duration = Duration::from_millis(200);

/// Context of the node-side controllers (node, lifecycle, topology).
pub struct NodeCtx {
    pub ctx: Arc<Context>,
    pub inventory: Arc<Inventory>,
    /// Cleared once Harvester refuses to show host Nodes (RBAC); then topology comes from VMI
    /// annotations only.
    pub host_reads: AtomicBool,
    failures: Backoff<(&'static str, String)>,
    /// The Node writes of the three controllers that the Node cache has not shown yet.
    pub written: WriteLog,
    /// What woke each reconcile, per controller.
    triggers: std::collections::HashMap<&'static str, Arc<Triggers<Node>>>,
}

impl NodeCtx {
    pub fn new(ctx: Arc<Context>, inventory: Arc<Inventory>) -> Self {
        let triggers = [init::NAME, lifecycle::NAME, topology::NAME]
            .into_iter()
            .map(|name| {
                let t = Triggers::new(name, ctx.telemetry.metrics.clone(), inventory.nodes.clone());
                (name, Arc::new(t))
            })
            .collect();
        NodeCtx {
            ctx,
            inventory,
            host_reads: AtomicBool::new(true),
            failures: Backoff::new(BACKOFF_FIRST, BACKOFF_MAX),
            written: WriteLog::default(),
            triggers,
        }
    }

    /// What woke the reconciles of `controller` (one of the three node-side names).
    pub fn triggers(&self, controller: &'static str) -> Arc<Triggers<Node>> {
        self.triggers.get(controller).cloned().unwrap_or_else(|| {
            Arc::new(Triggers::new(
                controller,
                self.ctx.telemetry.metrics.clone(),
                self.inventory.nodes.clone(),
            ))
        })
    }

    /// The node-side context, and the future that runs its shared watches until `shutdown`
    /// (it returns at once when no node-side controller is enabled).
    pub fn start(
        ctx: &Arc<Context>,
        shutdown: Shutdown,
    ) -> (Arc<NodeCtx>, impl Future<Output = ()> + Send + 'static) {
        let (inventory, watches) = Inventory::start(ctx);
        let enabled = node_side_enabled(ctx);
        let run = async move {
            if enabled {
                tokio::select! {
                    _ = watches => {},
                    _ = shutdown => {},
                }
            }
        };
        (Arc::new(NodeCtx::new(ctx.clone(), inventory)), run)
    }

    /// Runs one reconcile of `node` by `controller`: counted and timed in the metrics, a Warning
    /// Event on the Node for a failure, backoff bookkeeping. Not while the cache still shows a
    /// version one of our writes was based on: a plan from it would repeat that write (under a
    /// burst the watch lags the writes), and the watch event of the write wakes the controller
    /// again.
    pub async fn reconcile(
        &self,
        controller: &'static str,
        action: &str,
        node: &Node,
        sync: impl Future<Output = Result<Action, Error>>,
    ) -> Result<Action, Error> {
        if let Some(t) = self.triggers.get(controller) {
            t.woke(node);
        }
        let key = node_key(&node.name_any());
        if self
            .written
            .behind(&key, node.resource_version().as_deref())
        {
            tracing::debug!(controller, node = %node.name_any(), "the cache is behind our write; its watch event wakes this again");
            return Ok(Action::await_change());
        }
        let metrics = &self.ctx.telemetry.metrics;
        let result = harness::measured(metrics, controller, sync, Error::reason).await;
        match &result {
            Ok(_) => self.failures.succeeded(&(controller, node.name_any())),
            Err(e) if e.is_warning() => {
                let text = one_line(e);
                tracing::warn!(controller, node = %node.name_any(), reason = e.reason(), "{text}");
                self.event(node, EventType::Warning, e.reason(), action, text);
            }
            Err(e) => tracing::debug!(controller, node = %node.name_any(), "{e}"),
        }
        result
    }

    /// Publishes an Event on the Node; a failure to publish is only logged.
    pub fn event(&self, node: &Node, type_: EventType, reason: &str, action: &str, note: String) {
        harness::publish_event(
            &self.ctx.recorder,
            node.object_ref(&()),
            type_,
            reason,
            action.to_string(),
            note,
        );
    }

    /// The requeue delay after `err`: doubling per consecutive failure of this Node in this
    /// controller, from 1 s to 5 min; conflicts retry at once.
    pub fn backoff(&self, controller: &'static str, node: &Node, err: &Error) -> Action {
        if !err.is_warning() {
            return Action::requeue(CONFLICT_RETRY);
        }
        Action::requeue(self.failures.failed((controller, node.name_any())))
    }

    /// Waits for the caches; false if shutdown came first.
    pub async fn wait_ready(&self, shutdown: &Shutdown) -> bool {
        tokio::select! {
            _ = self.inventory.ready() => true,
            _ = shutdown.clone() => false,
        }
    }
}

/// Whether a node-side controller runs (they share the Node, VM and VMI watches).
pub fn node_side_enabled(ctx: &Context) -> bool {
    [CLOUD_NODE_CONTROLLER, CLOUD_NODE_LIFECYCLE_CONTROLLER]
        .iter()
        .any(|c| ctx.config.controllers.enabled(c))
}

/// A node-side controller's start: `None` when `--controllers` disables it (logged) or shutdown
/// comes before the caches have listed; otherwise its [`node_controller`].
pub async fn start_node_controller(
    nctx: &NodeCtx,
    name: &'static str,
    enabled: bool,
    shutdown: Shutdown,
) -> Option<Controller<Node>> {
    if !enabled {
        tracing::info!(controller = name, "disabled");
        return None;
    }
    if !nctx.wait_ready(&shutdown).await {
        return None;
    }
    Some(node_controller(nctx, name, shutdown))
}

/// A `Controller<Node>` on the shared Node cache: every Node once at start, on every Node
/// change, and on every resync tick, each trigger noted in `name`'s [`Triggers`]; stops on
/// `shutdown`. Callers add their `.watches_shared_stream`.
pub fn node_controller(nctx: &NodeCtx, name: &'static str, shutdown: Shutdown) -> Controller<Node> {
    let inv = &nctx.inventory;
    let node = &nctx.ctx.config.node;
    let triggers = nctx.triggers(name);
    let own = triggers.clone();
    let changed = inv.node_events().inspect(move |n| {
        own.note("node", [ObjectRef::from_obj(n.as_ref())]);
    });
    Controller::for_shared_stream(changed, inv.nodes.clone())
        .with_config(controller::Config::default().concurrency(node.concurrency))
        .reconcile_on(triggers.at_start())
        .reconcile_on(triggers.resync(node.resync))
        .graceful_shutdown_on(shutdown)
}

/// Runs a node-side controller (from [`node_controller`] with its triggers) to its end:
/// `reconcile` per Node, [`NodeCtx::backoff`] after a failure, results logged by [`drain`].
pub async fn run_node_controller<R, Fut>(
    nctx: Arc<NodeCtx>,
    name: &'static str,
    controller: Controller<Node>,
    reconcile: R,
) where
    R: FnMut(Arc<Node>, Arc<NodeCtx>) -> Fut,
    Fut: Future<Output = Result<Action, Error>> + Send + 'static,
{
    let results = controller.run(
        reconcile,
        move |node, err, nctx: Arc<NodeCtx>| nctx.backoff(name, &node, err),
        nctx.clone(),
    );
    drain(name, results).await;
}

/// Drives a controller's result stream to its end (reconcile errors were already reported).
async fn drain<S>(controller: &'static str, results: S)
where
    S: Stream<Item = Result<(ObjectRef<Node>, Action), controller::Error<Error, watcher::Error>>>,
{
    tracing::info!(controller, "started");
    results
        .for_each(|r| async move {
            match r {
                Ok((obj, _)) => tracing::trace!(controller, node = %obj.name, "reconciled"),
                Err(controller::Error::ObjectNotFound(obj)) => {
                    tracing::trace!(controller, node = %obj.name, "Node is gone")
                }
                Err(controller::Error::ReconcilerFailed(_, _)) => {}
                Err(e) => tracing::warn!(controller, error = %e, "controller error"),
            }
        })
        .await;
    tracing::info!(controller, "stopped");
}
