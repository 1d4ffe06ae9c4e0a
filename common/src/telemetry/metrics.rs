//! The Prometheus metrics both programs export (OpenMetrics text on `/metrics`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TriggerLabels {
    pub controller: String,
    pub trigger: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub controller: String,
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub verb: String,
    pub resource: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub method: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LeaseLabels {
    pub event: String,
}

type Hist<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency() -> Histogram {
    // 1 ms .. ~33 s
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// All metrics of one process. Cheap to clone; clones share the counters.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Arc<Registry>,
    pub reconciles: Family<ControllerLabels, Counter>,
    pub reconcile_triggers: Family<TriggerLabels, Counter>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: Hist<ControllerLabels>,
    pub reconcile_queue: Hist<ControllerLabels>,
    pub api_requests: Family<ApiLabels, Counter>,
    pub csi_rpcs: Family<RpcLabels, Counter>,
    pub csi_rpc_duration: Hist<MethodLabels>,
    pub service_address_seconds: Histogram,
    pub dhcp_leases: Family<LeaseLabels, Counter>,
    pub token_expiry_seconds: Gauge<f64, AtomicU64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("harvester");
        let reconciles = Family::<ControllerLabels, Counter>::default();
        r.register("reconciles", "Reconciles by controller", reconciles.clone());
        let reconcile_triggers = Family::<TriggerLabels, Counter>::default();
        r.register(
            "reconcile_triggers",
            "Reconciles by controller and what woke them",
            reconcile_triggers.clone(),
        );
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        r.register(
            "reconcile_errors",
            "Failed reconciles by controller and error",
            reconcile_errors.clone(),
        );
        let reconcile_duration: Hist<ControllerLabels> = Family::new_with_constructor(latency);
        r.register(
            "reconcile_duration_seconds",
            "Reconcile duration by controller",
            reconcile_duration.clone(),
        );
        let reconcile_queue: Hist<ControllerLabels> = Family::new_with_constructor(latency);
        r.register(
            "reconcile_queue_seconds",
            "Time from what woke a reconcile (a watch event, a sweep) to its start, by controller",
            reconcile_queue.clone(),
        );
        let api_requests = Family::<ApiLabels, Counter>::default();
        r.register(
            "kube_api_requests",
            "Kubernetes API requests by verb, resource and HTTP code",
            api_requests.clone(),
        );
        let csi_rpcs = Family::<RpcLabels, Counter>::default();
        r.register(
            "csi_rpcs",
            "CSI RPCs by method and gRPC code",
            csi_rpcs.clone(),
        );
        let csi_rpc_duration: Hist<MethodLabels> = Family::new_with_constructor(latency);
        r.register(
            "csi_rpc_duration_seconds",
            "CSI RPC duration by method",
            csi_rpc_duration.clone(),
        );
        let service_address_seconds = latency();
        r.register(
            "service_address_seconds",
            "Time from LoadBalancer Service creation to its address",
            service_address_seconds.clone(),
        );
        let dhcp_leases = Family::<LeaseLabels, Counter>::default();
        r.register(
            "dhcp_leases",
            "DHCP lease events (acquired, renewed, failed, released)",
            dhcp_leases.clone(),
        );
        let token_expiry_seconds = Gauge::<f64, AtomicU64>::default();
        r.register(
            "cloud_config_token_expiry_seconds",
            "Seconds until the cloud-config token expires (absent: no expiry)",
            token_expiry_seconds.clone(),
        );
        Metrics {
            registry: Arc::new(r),
            reconciles,
            reconcile_triggers,
            reconcile_errors,
            reconcile_duration,
            reconcile_queue,
            api_requests,
            csi_rpcs,
            csi_rpc_duration,
            service_address_seconds,
            dhcp_leases,
            token_expiry_seconds,
        }
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("encoding metrics: {e}");
        }
        out
    }

    /// Counts one reconcile of `controller`; observe the returned timer when it ends.
    pub fn reconcile_started(&self, controller: &str) -> ReconcileTimer {
        let labels = ControllerLabels {
            controller: controller.to_string(),
        };
        self.reconciles.get_or_create(&labels).inc();
        ReconcileTimer {
            metrics: self.clone(),
            labels,
            start: Instant::now(),
        }
    }

    /// Counts one reconcile of `controller` woken by `trigger`, which it waited for `queued`
    /// (unknown for a requeue: the controller's own retry is not noted when scheduled).
    pub fn reconcile_woken(&self, controller: &str, trigger: &str, queued: Option<Duration>) {
        self.reconcile_triggers
            .get_or_create(&TriggerLabels {
                controller: controller.to_string(),
                trigger: trigger.to_string(),
            })
            .inc();
        if let Some(queued) = queued {
            self.reconcile_queue
                .get_or_create(&ControllerLabels {
                    controller: controller.to_string(),
                })
                .observe(queued.as_secs_f64());
        }
    }

    pub fn reconcile_failed(&self, controller: &str, error: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels {
                controller: controller.to_string(),
                error: error.to_string(),
            })
            .inc();
    }

    /// Total Kubernetes API requests counted so far (all verbs, resources and codes).
    pub fn api_request_total(&self) -> u64 {
        let text = self.encode();
        text.lines()
            .filter(|l| l.starts_with("harvester_kube_api_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }
}

/// Records the reconcile duration when dropped.
pub struct ReconcileTimer {
    metrics: Metrics,
    labels: ControllerLabels,
    start: Instant,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.metrics
            .reconcile_duration
            .get_or_create(&self.labels)
            .observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_counters_and_histograms() {
        let m = Metrics::new();
        drop(m.reconcile_started("node"));
        m.reconcile_woken("node", "node", Some(Duration::from_millis(3)));
        m.reconcile_woken("node", "requeue", None);
        m.reconcile_failed("node", "vm_not_found");
        m.api_requests
            .get_or_create(&ApiLabels {
                verb: "get".into(),
                resource: "services".into(),
                code: "200".into(),
            })
            .inc_by(3);
        let text = m.encode();
        assert!(
            text.contains(r#"harvester_reconciles_total{controller="node"} 1"#),
            "{text}"
        );
        assert!(text.contains(
            r#"harvester_reconcile_errors_total{controller="node",error="vm_not_found"} 1"#
        ));
        assert!(text.contains("harvester_reconcile_duration_seconds_count{controller=\"node\"} 1"));
        assert!(
            text.contains("harvester_reconcile_queue_seconds_count{controller=\"node\"} 1"),
            "only the noted trigger's wait is observed: {text}"
        );
        assert!(text.contains(
            r#"harvester_reconcile_triggers_total{controller="node",trigger="requeue"} 1"#
        ));
        assert_eq!(m.api_request_total(), 3);
    }
}
