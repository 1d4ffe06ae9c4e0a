//! What every controller shares: the two clients, the validated flags, the one Event recorder
//! and the process's telemetry, plus the names of the readiness checks. Built once in
//! [`crate::run_with`] (or by [`Context::from_clients`] for embedding) and passed as
//! `Arc<Context>` to the node-side controllers and the service controller alike.

use std::path::Path;

use futures::future::{BoxFuture, Shared};
use harvester_common::cloud_config::Harvester;
use harvester_common::telemetry::{Metrics, Readiness};

use crate::config::Config;
use crate::error::Error;

/// Field manager of every write, and the Events' reporting controller.
pub const FIELD_MANAGER: &str = "harvester-cloud-provider";

/// Resolves when the process should stop; every controller holds a clone.
pub type Shutdown = Shared<BoxFuture<'static, ()>>;

/// Readiness checks of the cloud provider: both clients built; Harvester answers with the
/// cloud-config's credentials (kept by the binary's `Harvester::watch_credentials`, leader or
/// not); the controllers' caches listed (registered on the leader when they start).
pub const READY_CLIENTS: &str = "clients";
pub const READY_HARVESTER: &str = "harvester";
/// Registered by the controllers when they start (on the leader): their watch caches listed.
pub const READY_NODE_CACHES: &str = "node-caches";
pub const READY_SERVICE_CACHES: &str = "service-caches";

/// What every controller shares.
pub struct Context {
    /// The guest cluster.
    pub guest: kube::Client,
    /// The Harvester cluster (from the cloud-config).
    pub harvester: kube::Client,
    /// The Harvester namespace of the guest VMs and the LoadBalancer CRs (the cloud-config's).
    pub namespace: String,
    pub config: Config,
    /// Publishes Events into the guest cluster ([`crate::controller::publish_event`]).
    pub recorder: crate::event_recorder::EventRecorder,
    pub telemetry: Telemetry,
    /// The loaded cloud-config, kept for as long as the context: its client follows the file
    /// (new credentials) through a weak reference to it. `None` for [`Context::from_clients`].
    _cloud_config: Option<Harvester>,
}

/// Metrics and readiness of the process, shared with `main`'s HTTP endpoints.
#[derive(Clone, Default)]
pub struct Telemetry {
    pub metrics: Metrics,
    pub readiness: Readiness,
}

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
        Ok(Context::loaded(guest, harvester, config, telemetry))
    }

    /// A context on the clients `main` loaded for its own checks: one connection to each API
    /// server, and the Harvester requests of the controllers tell the credential check that
    /// Harvester answers (no probe of its own then).
    pub fn loaded(
        guest: kube::Client,
        harvester: Harvester,
        config: Config,
        telemetry: Telemetry,
    ) -> Context {
        let mut ctx = Context::from_clients(
            guest,
            harvester.client.clone(),
            harvester.namespace.clone(),
            config,
            telemetry,
        );
        ctx._cloud_config = Some(harvester);
        ctx
    }

    /// A context on clients the caller made (tests, embedding): no file is read.
    pub fn from_clients(
        guest: kube::Client,
        harvester: kube::Client,
        namespace: String,
        config: Config,
        telemetry: Telemetry,
    ) -> Context {
        Context {
            recorder: crate::controller::recorder(guest.clone()),
            guest,
            harvester,
            namespace,
            config,
            telemetry,
            _cloud_config: None,
        }
    }

    /// The Harvester namespace holding the guest VMs.
    pub fn namespace(&self) -> &str {
        &self.namespace
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
    let mut config = harvester_common::guest::config(path).await.map_err(fail)?;
    if let Some(master) = master {
        config.cluster_url = master.clone();
    }
    harvester_common::guest::client(config, metrics).map_err(fail)
}
