//! The cloud provider's service controller running in the test's process against a bed, for the
//! LoadBalancer suites: started with a guest cluster name, stopped through its shutdown signal.

use std::time::Duration;

use harvester_cloud_provider::service::{self, plan::LbSettings};
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
            bed.guest.client.clone(),
            bed.harvester.client.clone(),
            bed.vm_namespace.clone(),
            LbSettings {
                cluster_name: cluster.into(),
                ..Default::default()
            },
            Duration::from_secs(60),
            None,
            async move {
                let _ = rx.await;
            },
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
