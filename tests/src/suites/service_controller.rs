//! The cloud provider's service controller running in the test's process against a bed, for the
//! LoadBalancer suites: started with a guest cluster name (and more flags), stopped through its
//! shutdown signal; and the waits those suites share (a Service's address, an Event on it).

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use harvester_cloud_provider::service::plan::ingress_ip;
use harvester_cloud_provider::{Config, Context, Telemetry, service};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use tokio::sync::oneshot;

use crate::TestBed;
use crate::util::wait;

/// The service controller of guest cluster `cluster` on `bed`, until [`ServiceController::stop`].
pub struct ServiceController {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl ServiceController {
    /// Starts it with the provider's defaults (60 s DHCP renewal margin, no DHCP client).
    pub fn start(bed: &TestBed, cluster: &str) -> ServiceController {
        ServiceController::start_with(bed, cluster, &[])
    }

    /// Starts it with the provider's defaults and `extra` flags.
    pub fn start_with(bed: &TestBed, cluster: &str, extra: &[&str]) -> ServiceController {
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(service::run(
            context_with(bed, cluster, "60s", extra),
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
    context_with(bed, cluster, resync, &[])
}

fn context_with(bed: &TestBed, cluster: &str, resync: &str, extra: &[&str]) -> Arc<Context> {
    let mut args = vec![
        "harvester-cloud-provider",
        "--cluster-name",
        cluster,
        "--node-status-update-frequency",
        resync,
    ];
    args.extend_from_slice(extra);
    let config = Config::from_args(args).expect("service controller flags");
    Arc::new(Context::from_clients(
        bed.guest.client.clone(),
        bed.harvester.client.clone(),
        bed.vm_namespace.clone(),
        config,
        Telemetry::new(),
    ))
}

/// Waits up to `limit` until Service `name` shows an ingress address; returns it with the Service.
pub async fn wait_ingress(api: &Api<Service>, name: &str, limit: Duration) -> (String, Service) {
    wait::until(&format!("Service {name} gets an address"), limit, || {
        let api = api.clone();
        async move {
            let svc = api.get(name).await.map_err(|e| e.to_string())?;
            Ok(match ingress_ip(&svc) {
                Some(ip) => Ok((ip, svc)),
                None => Err(svc.metadata.annotations),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits up to `limit` for an Event with `reason` on Service `namespace/name` whose note contains
/// `text`; returns the note.
pub async fn wait_event(
    bed: &TestBed,
    (namespace, name): (&str, &str),
    reason: &str,
    text: &str,
    limit: Duration,
) -> String {
    let api: Api<Event> = Api::namespaced(bed.guest.client.clone(), namespace);
    let what = format!("event {reason} on {namespace}/{name} mentioning {text:?}");
    wait::until(&what, limit, || {
        let api = api.clone();
        async move {
            let events = api
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let seen: Vec<(String, String)> = events
                .items
                .iter()
                .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
                .map(|e| {
                    let reason = e.reason.clone().unwrap_or_default();
                    (reason, e.note.clone().unwrap_or_default())
                })
                .collect();
            Ok(
                match seen.iter().find(|(r, n)| r == reason && n.contains(text)) {
                    Some((_, note)) => Ok(note.clone()),
                    None => Err(seen),
                },
            )
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits up to `limit` until Service `name` is gone (its finalizers, if any, removed).
pub async fn wait_gone(api: &Api<Service>, name: &str, limit: Duration) {
    wait::until(&format!("Service {name} gone"), limit, || {
        let api = api.clone();
        async move {
            Ok(match api.get_opt(name).await.map_err(|e| e.to_string())? {
                None => Ok(()),
                Some(s) => Err(s.metadata.finalizers),
            })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}
