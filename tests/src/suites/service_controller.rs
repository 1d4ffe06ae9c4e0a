//! The cloud provider's service controller running in the test's process against a bed, for the
//! LoadBalancer suites: started with a guest cluster name, stopped through its shutdown signal.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use harvester_cloud_provider::{Config, Context, Telemetry, service};
use tokio::sync::oneshot;

use crate::TestBed;

/// The service controller of guest cluster `cluster` on `bed`, until [`ServiceController::stop`].
pub struct ServiceController {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl ServiceController {
    /// Starts it with the provider's defaults (60 s DHCP renewal margin, no DHCP client).
    pub fn start(bed: &TestBed, cluster: &str) -> ServiceController {
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(service::run(
            service_context(bed, cluster, "60s"),
            async move {
                let _ = rx.await;
            }
            .boxed()
            .shared(),
        ));
        ServiceController {
            stop: Some(tx),
            task,
        }
    }

    /// Signals shutdown and waits, 20 s at most, for the controller to return.
    pub async fn stop(mut self) {
        drop(self.stop.take());
        tokio::time::timeout(Duration::from_secs(20), &mut self.task)
            .await
            .expect("the controller stops within 20 s of its shutdown signal")
            .expect("controller task");
    }
}

/// The provider's context for a service controller of guest cluster `cluster` on `bed`, with the
/// provider's defaults and a resync every `resync` (a Go duration): the bed's clients, no file.
pub fn service_context(bed: &TestBed, cluster: &str, resync: &str) -> Arc<Context> {
    let config = Config::from_args([
        "harvester-cloud-provider",
        "--cluster-name",
        cluster,
        "--node-status-update-frequency",
        resync,
    ])
    .expect("service controller flags");
    Arc::new(Context::from_clients(
        bed.guest.client.clone(),
        bed.harvester.client.clone(),
        bed.vm_namespace.clone(),
        config,
        Telemetry::new(),
    ))
}
