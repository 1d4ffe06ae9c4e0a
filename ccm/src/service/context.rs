//! What a reconcile of a Service has at hand: the provider's [`Context`], the Service,
//! LoadBalancer and NAD mapping caches (and the interface a network maps to), the indexes over
//! them (`wake`), the DHCP leases, the log of our own writes, what woke each reconcile, and the
//! error type. The other service modules stand on this one; it imports none of them but `wake`
//! and `written`.

use std::collections::BTreeMap;
use std::sync::Arc;

use harvester_common::api_error::Describe;
use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::Api;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

use super::annotations::ServiceKey;
use super::dhcp::Leases;
use super::plan::{self, LbSettings, SYNC_FAILED, ServiceProblem};
use super::wake::{CrChanges, CrsOf, Secondaries};
use super::{NAD_MAPPING_KEY, NAD_MAPPING_NAME, NAD_MAPPING_NAMESPACE};
use crate::context::Context;
use crate::controller::{Backoff, Triggers, digest_action, publish_event};
use crate::written::WriteLog;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("guest API: {}", Describe(.0))]
    Guest(#[source] kube::Error),
    #[error("Harvester API: {}", Describe(.0))]
    Harvester(#[source] kube::Error),
    #[error("ConfigMap {NAD_MAPPING_NAMESPACE}/{NAD_MAPPING_NAME}: {0}")]
    NadMapping(String),
    #[error("DHCP: {0}")]
    Dhcp(String),
}

impl Error {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Guest(_) => "guest_api",
            Error::Harvester(_) => "harvester_api",
            Error::NadMapping(_) => "nad_mapping",
            Error::Dhcp(_) => "dhcp",
        }
    }

    /// Event reason of a failed reconcile.
    pub fn reason(&self) -> &'static str {
        SYNC_FAILED
    }
}

/// Everything a reconcile needs.
pub struct ServiceCtx {
    pub ctx: Arc<Context>,
    pub settings: LbSettings,
    pub(super) services: Store<Service>,
    /// The LoadBalancer CRs of this cluster, from the watch that also wakes the Services: the
    /// hot path reads them here instead of asking the API server.
    pub(super) crs: Store<LoadBalancer>,
    /// The NAD mapping ConfigMap (at most one object), from a watch that also wakes the Services
    /// naming a network.
    pub(super) nad: Store<ConfigMap>,
    pub(super) backoff: Backoff<ObjectRef<Service>>,
    /// Leases of `ipam: dhcp` Services in `--dhcp-mode=ccm`.
    pub(super) leases: Option<Leases>,
    /// Our last writes to Services and CRs, to tell a cache that has not caught up with them.
    pub(super) written: WriteLog,
    /// ConfigMap `kube-system/kubevip` (the guest pools; at most one object), from a watch that
    /// also wakes the `ipam: guest` Services.
    pub(super) guest_pools: Store<ConfigMap>,
    /// True once the guest pools' watch has listed (kept apart from `caches_ready`: only
    /// `ipam: guest` Services wait for it).
    pub(super) pools_ready: tokio::sync::watch::Receiver<bool>,
    /// Guest-pool addresses chosen and not yet shown by the cache, and the Services waiting.
    pub(super) ledger: super::guest_pool::alloc::Ledger,
    /// Wakes a Service's reconcile from outside the watches (a lease changed, an address freed).
    pub(super) wake: tokio::sync::mpsc::UnboundedSender<ObjectRef<Service>>,
    /// True once the watch caches hold a full list. Reconciles wait on this, not on
    /// `Store::wait_until_ready`: that future keeps one waker only (kube-runtime 5.0's
    /// `DelayedInit` polls a `futures` oneshot), so of many reconciles waiting at once all but
    /// the last would never wake.
    pub(super) caches_ready: tokio::sync::watch::Receiver<bool>,
    /// Who names which primary, fed by the Service watch before its cache.
    pub(super) secondaries: Secondaries,
    /// Which CRs carry which Service's labels, fed by the CR watch before its cache.
    pub(super) crs_of: CrsOf,
    /// Whether a CR event changed what the reconcile reads.
    pub(super) cr_changes: CrChanges,
    /// What woke each reconcile.
    pub(super) triggers: Arc<Triggers<Service>>,
}

/// kube-vip's interface for `network`, from the NAD mapping ConfigMap (its cache) when it exists.
pub(super) fn interface_for(
    ctx: &ServiceCtx,
    network: Option<&str>,
) -> Result<Option<String>, Error> {
    let Some(network) = network else {
        return Ok(None);
    };
    let key = ObjectRef::new(NAD_MAPPING_NAME).within(NAD_MAPPING_NAMESPACE);
    let Some(cm) = ctx.nad.get(&key) else {
        return Ok(None);
    };
    let raw = cm
        .data
        .as_ref()
        .and_then(|d| d.get(NAD_MAPPING_KEY).cloned())
        .unwrap_or_default();
    let mapping: BTreeMap<String, String> = if raw.trim().is_empty() {
        BTreeMap::new()
    } else {
        serde_json::from_str(&raw).map_err(|e| {
            Error::NadMapping(format!("key {NAD_MAPPING_KEY} is not a JSON object: {e}"))
        })?
    };
    mapping.get(network).cloned().map(Some).ok_or_else(|| {
        Error::NadMapping(format!("network {network} has no interface in the mapping"))
    })
}

/// Key of a Service in [`ServiceCtx::written`].
pub(super) fn svc_key(svc: &Service) -> String {
    format!(
        "svc/{}/{}",
        svc.namespace().unwrap_or_default(),
        svc.name_any()
    )
}

/// Key of a LoadBalancer CR in [`ServiceCtx::written`].
pub(super) fn cr_key(name: &str) -> String {
    format!("lb/{name}")
}

impl ServiceCtx {
    /// Waits until the Service and CR watches have listed; false when the provider shuts down
    /// first.
    pub(super) async fn caches_listed(&self) -> bool {
        self.caches_ready
            .clone()
            .wait_for(|ready| *ready)
            .await
            .is_ok()
    }

    /// Harvester namespace of the LoadBalancer CRs (the cloud-config's namespace).
    pub(super) fn namespace(&self) -> &str {
        self.ctx.namespace()
    }

    /// How often every Service and the CR garbage are looked at again.
    pub(super) fn resync(&self) -> std::time::Duration {
        self.ctx.config.node.resync
    }

    pub(super) fn lbs(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.ctx.harvester.clone(), self.namespace())
    }

    pub(super) fn services_in(&self, ns: &str) -> Api<Service> {
        Api::namespaced(self.ctx.guest.clone(), ns)
    }

    fn event(&self, svc: &Service, type_: EventType, reason: &str, note: String) {
        let action = digest_action(reason, &note);
        publish_event(
            &self.ctx.recorder,
            svc.object_ref(&()),
            type_,
            reason,
            action,
            note,
        );
    }

    /// A Warning Event for `problem` on `svc`.
    pub(super) fn report(&self, svc: &Service, problem: &ServiceProblem) {
        self.warn(svc, problem.reason(), problem.to_string());
    }

    pub(super) fn warn(&self, svc: &Service, reason: &str, note: String) {
        tracing::warn!(service = %ServiceKey::of(svc), reason, "{note}");
        self.event(svc, EventType::Warning, reason, note);
    }

    pub(super) fn normal(&self, svc: &Service, reason: &str, note: String) {
        tracing::info!(service = %ServiceKey::of(svc), reason, "{note}");
        self.event(svc, EventType::Normal, reason, note);
    }

    /// Services in the cache whose primary-service annotation names `primary` (from the index:
    /// no sweep over every Service).
    pub(super) fn secondaries_of(&self, primary: &ServiceKey) -> Vec<Arc<Service>> {
        self.secondaries
            .of(&self.services, primary)
            .into_iter()
            .filter(|s| {
                s.meta().deletion_timestamp.is_none()
                    && plan::wants_load_balancer(s, &self.settings)
            })
            .collect()
    }
}
