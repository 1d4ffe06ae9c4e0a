//! Fetch inputs, apply the plan, publish events. The rules live in `plan` and `annotations`.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;

use harvester_common::telemetry::Metrics;

use harvester_common::api_error::Describe;

use super::annotations::{BadAnnotation, Ipam, ServiceKey, ServiceLbSpec};
use super::dhcp::{DhcpMode, KUBE_VIP_HWADDR, KUBE_VIP_REQUESTED_IP, Leases};
use super::plan::{
    self, LABEL_CLUSTER, LABEL_SERVICE_NAME, LABEL_SERVICE_NAMESPACE, LbSettings, ServiceChange,
};
use super::written::WriteLog;
use super::{FINALIZER, MANAGER, NAD_MAPPING_KEY, NAD_MAPPING_NAME, NAD_MAPPING_NAMESPACE};

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
}

/// Everything a reconcile needs.
pub struct ServiceCtx {
    pub guest: kube::Client,
    pub harvester: kube::Client,
    /// Harvester namespace of the LoadBalancer CRs (the cloud-config's namespace).
    pub namespace: String,
    pub settings: LbSettings,
    pub resync: Duration,
    recorder: Recorder,
    services: Store<Service>,
    /// The LoadBalancer CRs of this cluster, from the watch that also wakes the Services: the
    /// hot path reads them here instead of asking the API server.
    crs: Store<LoadBalancer>,
    failures: Mutex<HashMap<ObjectRef<Service>, u32>>,
    /// Leases of `ipam: dhcp` Services in `--dhcp-mode=ccm`.
    leases: Option<Leases>,
    metrics: Option<Metrics>,
    /// Our last writes to Services and CRs, to tell a cache that has not caught up with them.
    written: WriteLog,
    /// True once both watch caches hold a full list. Reconciles wait on this, not on
    /// `Store::wait_until_ready`: that future keeps one waker only (kube-runtime 5.0's
    /// `DelayedInit` polls a `futures` oneshot), so of many reconciles waiting at once all but
    /// the last would never wake.
    caches_ready: tokio::sync::watch::Receiver<bool>,
}

/// Key of a Service in [`ServiceCtx::written`].
fn svc_key(svc: &Service) -> String {
    format!(
        "svc/{}/{}",
        svc.namespace().unwrap_or_default(),
        svc.name_any()
    )
}

/// Key of a LoadBalancer CR in [`ServiceCtx::written`].
fn cr_key(name: &str) -> String {
    format!("lb/{name}")
}

/// The version recorded for a CR we created that the cache has not shown yet.
const NOT_SEEN: &str = "";

impl ServiceCtx {
    /// Waits until the Service and CR watches have listed; false when the provider shuts down
    /// first.
    async fn caches_listed(&self) -> bool {
        self.caches_ready
            .clone()
            .wait_for(|ready| *ready)
            .await
            .is_ok()
    }

    fn lbs(&self) -> Api<LoadBalancer> {
        Api::namespaced(self.harvester.clone(), &self.namespace)
    }
    fn services_in(&self, ns: &str) -> Api<Service> {
        Api::namespaced(self.guest.clone(), ns)
    }

    async fn event(&self, svc: &Service, type_: EventType, reason: &str, note: String) {
        // kube's Recorder folds events with the same action and reason into one series that keeps
        // the first note; a digest of the note in the action keeps a changed message visible, as
        // client-go's aggregation by message does.
        let ev = Event {
            type_,
            reason: reason.into(),
            action: format!("{reason}/{:08x}", crc32fast::hash(note.as_bytes())),
            note: Some(note),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &svc.object_ref(&())).await {
            tracing::warn!(service = %ServiceKey::of(svc), "publishing event {reason}: {e}");
        }
    }
    async fn warn(&self, svc: &Service, reason: &str, note: String) {
        tracing::warn!(service = %ServiceKey::of(svc), reason, "{note}");
        self.event(svc, EventType::Warning, reason, note).await;
    }
    async fn normal(&self, svc: &Service, reason: &str, note: String) {
        tracing::info!(service = %ServiceKey::of(svc), reason, "{note}");
        self.event(svc, EventType::Normal, reason, note).await;
    }

    /// Services in the cache whose primary-service annotation names `primary`.
    fn secondaries_of(&self, primary: &ServiceKey) -> Vec<Arc<Service>> {
        self.services
            .state()
            .into_iter()
            .filter(|s| {
                s.meta().deletion_timestamp.is_none()
                    && plan::wants_load_balancer(s, &self.settings)
                    && ServiceLbSpec::from_service(s)
                        .ok()
                        .and_then(|sp| sp.primary)
                        .as_ref()
                        == Some(primary)
            })
            .collect()
    }
}

/// Runs the controller and the CR garbage collector until `shutdown` resolves.
pub async fn run(
    guest: kube::Client,
    harvester: kube::Client,
    namespace: String,
    settings: LbSettings,
    resync: Duration,
    telemetry: Option<crate::Telemetry>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let metrics = telemetry.as_ref().map(|t| t.metrics.clone());
    let readiness = telemetry.map(|t| t.readiness);
    if let Some(r) = &readiness {
        r.set(
            crate::READY_SERVICE_CACHES,
            Err("waiting for the Service and LoadBalancer watches to list".into()),
        );
    }
    let services: Api<Service> = Api::all(guest.clone());
    // A DHCP lease lost or re-acquired outside a reconcile wakes its Service through this channel.
    let (wake, woken) = tokio::sync::mpsc::unbounded_channel();
    let leases = (settings.dhcp_mode == DhcpMode::Ccm)
        .then(|| Leases::new(Default::default(), wake, metrics.clone()));
    let concurrency = settings.concurrency.unwrap_or(0); // 0: kube-runtime's "unbounded"
    let controller = Controller::new(services.clone(), watcher::Config::default())
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency));
    let store = controller.store();
    let reporter = Reporter {
        controller: MANAGER.into(),
        instance: std::env::var("POD_NAME").ok(),
    };
    let (crs, cr_writer) = kube::runtime::reflector::store::<LoadBalancer>();
    let (caches_listed, caches_ready) = tokio::sync::watch::channel(false);
    let ctx = Arc::new(ServiceCtx {
        crs,
        recorder: Recorder::new(guest.clone(), reporter),
        guest,
        harvester,
        namespace,
        settings,
        resync,
        services: store.clone(),
        failures: Mutex::new(HashMap::new()),
        leases,
        metrics,
        written: WriteLog::default(),
        caches_ready,
    });
    let lb_watch = watcher::Config::default()
        .labels(&format!("{LABEL_CLUSTER}={}", ctx.settings.cluster_name));
    let cr_events = kube::runtime::reflector(cr_writer, watcher::watcher(ctx.lbs(), lb_watch))
        .default_backoff()
        .touched_objects();
    let related = store.clone();
    let shutdown = futures::future::FutureExt::shared(Box::pin(shutdown));
    let gc = garbage_collector(ctx.clone(), shutdown.clone());
    // Polled in the controller's own task (the join below), which every watch event wakes.
    let synced = {
        let (services, crs, shutdown) = (store.clone(), ctx.crs.clone(), shutdown.clone());
        async move {
            tokio::select! {
                _ = futures::future::join(services.wait_until_ready(), crs.wait_until_ready()) => {
                    caches_listed.send_replace(true);
                    if let Some(r) = readiness {
                        r.set(crate::READY_SERVICE_CACHES, Ok(()));
                    }
                }
                _ = shutdown => {}
            }
        }
    };
    let ctrl = controller
        // A CR's status changed: reconcile its Service (no polling while an address is pending).
        .watches_stream(cr_events, |lb| service_of_cr(&lb))
        // A primary or secondary changed: reconcile the other side of the shared address.
        .watches(services, watcher::Config::default(), move |svc| {
            related_services(&related, &svc)
        })
        .reconcile_all_on(ticks(ctx.resync))
        .reconcile_on(tokio_stream::wrappers::UnboundedReceiverStream::new(woken))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {});
    futures::join!(ctrl, gc, synced);
}

fn ticks(every: Duration) -> impl futures::Stream<Item = ()> + Send {
    futures::stream::unfold((), move |()| async move {
        tokio::time::sleep(every).await;
        Some(((), ()))
    })
}

fn service_of_cr(lb: &LoadBalancer) -> Option<ObjectRef<Service>> {
    let ns = lb.labels().get(LABEL_SERVICE_NAMESPACE)?;
    let name = lb.labels().get(LABEL_SERVICE_NAME)?;
    Some(ObjectRef::new(name).within(ns))
}

fn related_services(store: &Store<Service>, svc: &Service) -> Vec<ObjectRef<Service>> {
    let key = ServiceKey::of(svc);
    let mut refs: Vec<ObjectRef<Service>> = Vec::new();
    if let Ok(ServiceLbSpec {
        primary: Some(p), ..
    }) = ServiceLbSpec::from_service(svc)
    {
        refs.push(ObjectRef::new(&p.name).within(&p.namespace));
    }
    for s in store.state() {
        if let Ok(ServiceLbSpec {
            primary: Some(p), ..
        }) = ServiceLbSpec::from_service(&s)
            && p == key
        {
            refs.push(ObjectRef::from_obj(s.as_ref()));
        }
    }
    refs
}

fn error_policy(svc: Arc<Service>, err: &Error, ctx: Arc<ServiceCtx>) -> Action {
    let key = ObjectRef::from_obj(svc.as_ref());
    let mut failures = ctx.failures.lock().unwrap_or_else(|p| p.into_inner());
    let n = failures.entry(key).or_insert(0);
    *n = n.saturating_add(1);
    // 0.5 s, 1 s, 2 s, ... capped at 5 minutes.
    let delay = Duration::from_millis(500u64.saturating_mul(1 << (*n - 1).min(10)))
        .min(Duration::from_secs(300));
    tracing::debug!(service = %ServiceKey::of(&svc), "retrying in {delay:?}: {err}");
    Action::requeue(delay)
}

async fn reconcile(svc: Arc<Service>, ctx: Arc<ServiceCtx>) -> Result<Action, Error> {
    let _timer = ctx.metrics.as_ref().map(|m| m.reconcile_started("service"));
    let result = reconcile_service(&svc, &ctx).await;
    if let (Err(e), Some(m)) = (&result, &ctx.metrics) {
        m.reconcile_failed("service", e.kind());
    }
    match &result {
        Ok(_) => {
            ctx.failures
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&ObjectRef::from_obj(svc.as_ref()));
        }
        Err(e) => {
            ctx.warn(&svc, "SyncLoadBalancerFailed", e.to_string())
                .await
        }
    }
    result
}

async fn reconcile_service(svc: &Service, ctx: &ServiceCtx) -> Result<Action, Error> {
    if ctx
        .written
        .behind(&svc_key(svc), svc.resource_version().as_deref())
    {
        // The cache still shows the version our last write was planned from: the watch event
        // carrying that write wakes us again; planning now would repeat it.
        return Ok(Action::await_change());
    }
    let has_finalizer = svc.finalizers().iter().any(|f| f == FINALIZER);
    let deleting = svc.meta().deletion_timestamp.is_some();
    if deleting || !plan::wants_load_balancer(svc, &ctx.settings) {
        if has_finalizer {
            return cleanup(svc, ctx, deleting).await;
        }
        return Ok(Action::await_change());
    }
    let spec = match ServiceLbSpec::from_service(svc) {
        Ok(spec) => spec,
        Err(bad) => {
            // Nothing is created from bad input; a change of the Service wakes us again.
            report_bad_input(svc, ctx, &bad).await;
            return Ok(Action::await_change());
        }
    };
    if !has_finalizer {
        add_finalizer(svc, ctx).await?;
        // The patch produces a new version of the Service, which wakes us again.
        return Ok(Action::await_change());
    }
    match &spec.primary {
        Some(primary) => reconcile_secondary(svc, &spec, primary, ctx).await,
        None => reconcile_primary(svc, &spec, ctx).await,
    }
}

async fn report_bad_input(svc: &Service, ctx: &ServiceCtx, bad: &BadAnnotation) {
    ctx.warn(svc, "SyncLoadBalancerFailed", format!("invalid {bad}"))
        .await;
}

async fn add_finalizer(svc: &Service, ctx: &ServiceCtx) -> Result<(), Error> {
    let ops = if svc.finalizers().is_empty() {
        json!([{"op": "test", "path": "/metadata/resourceVersion", "value": svc.resource_version()},
               {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}])
    } else {
        json!([{"op": "test", "path": "/metadata/resourceVersion", "value": svc.resource_version()},
               {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}])
    };
    patch_json(svc, ctx, ops).await
}

async fn remove_finalizer(svc: &Service, ctx: &ServiceCtx) -> Result<(), Error> {
    let Some(i) = svc.finalizers().iter().position(|f| f == FINALIZER) else {
        return Ok(());
    };
    let ops = json!([{"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": FINALIZER},
                     {"op": "remove", "path": format!("/metadata/finalizers/{i}")}]);
    patch_json(svc, ctx, ops).await
}

async fn patch_json(svc: &Service, ctx: &ServiceCtx, ops: serde_json::Value) -> Result<(), Error> {
    let patch: json_patch::Patch =
        serde_json::from_value(ops).map_err(|e| Error::Guest(kube::Error::SerdeError(e)))?;
    let stored = ctx
        .services_in(&svc.namespace().unwrap_or_default())
        .patch(&svc.name_any(), &patch_params(), &Patch::<()>::Json(patch))
        .await
        .map_err(Error::Guest)?;
    ctx.written.wrote(
        &svc_key(svc),
        svc.resource_version().as_deref(),
        stored.resource_version().as_deref(),
    );
    Ok(())
}

/// Every write of ours carries the same field manager.
fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    }
}

/// Applies a planned change to the guest Service in one request: a JSON merge patch of exactly
/// the annotations, labels and ingress we own. With an ingress change it goes to the `status`
/// subresource, which keeps metadata changes (the API server's Service status strategy resets
/// only `spec`), so the address and kube-vip's annotations land together.
async fn apply_change(
    svc: &Service,
    ctx: &ServiceCtx,
    change: &ServiceChange,
) -> Result<(), Error> {
    let Some(body) = plan::change_patch(change) else {
        return Ok(());
    };
    let api = ctx.services_in(&svc.namespace().unwrap_or_default());
    let name = svc.name_any();
    let stored = if change.ingress.is_some() {
        api.patch_status(&name, &patch_params(), &Patch::Merge(&body))
            .await
            .map_err(Error::Guest)?
    } else {
        api.patch(&name, &patch_params(), &Patch::Merge(&body))
            .await
            .map_err(Error::Guest)?
    };
    ctx.written.wrote(
        &svc_key(svc),
        svc.resource_version().as_deref(),
        stored.resource_version().as_deref(),
    );
    Ok(())
}

/// Writes a changed CR with `update` (a compare-and-swap on its resourceVersion): Harvester's own
/// cloud-provider role (`harvesterhci.io:cloudprovider`) grants `update`, not `patch`, on
/// LoadBalancers, and the CRD has no status subresource, so status goes the same way.
///
/// `cr` is the cached copy. A conflict means Harvester wrote after it: no read and retry here,
/// the watch delivers that write and wakes the reconcile, which plans again from it (`None`).
async fn update_cr(
    ctx: &ServiceCtx,
    mut cr: LoadBalancer,
    change: impl Fn(&mut LoadBalancer),
) -> Result<Option<LoadBalancer>, Error> {
    let params = PostParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    };
    let name = cr.name_any();
    let based_on = cr.resource_version();
    change(&mut cr);
    cr.metadata.managed_fields = None;
    match ctx.lbs().replace(&name, &params, &cr).await {
        Ok(lb) => {
            // Harvester's webhook may have reverted every change: then the answer carries the
            // version the update was based on and nothing is behind.
            ctx.written.wrote(
                &cr_key(&name),
                based_on.as_deref(),
                lb.resource_version().as_deref(),
            );
            Ok(Some(lb))
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {
            tracing::debug!(
                "LoadBalancer {name} changed since the cache saw it; waiting for the watch"
            );
            Ok(None)
        }
        Err(e) => Err(Error::Harvester(e)),
    }
}

/// `status.address` of the CR = the address the Service shows (upstream's mirror).
async fn mirror_address(ctx: &ServiceCtx, cr: LoadBalancer, addr: &str) -> Result<(), Error> {
    if cr.status.as_ref().and_then(|s| s.address.as_deref()) == Some(addr)
        || ctx
            .written
            .behind(&cr_key(&cr.name_any()), cr.resource_version().as_deref())
    {
        return Ok(());
    }
    update_cr(ctx, cr, |cr| {
        cr.status.get_or_insert_with(Default::default).address = Some(addr.to_string());
    })
    .await
    .map(|_| ())
}

/// Deletes the cached CRs of `key` other than `keep` (those of an earlier UID of the Service).
async fn delete_stale_crs(ctx: &ServiceCtx, key: &ServiceKey, keep: &str) -> Result<(), Error> {
    let stale: Vec<String> = ctx
        .crs
        .state()
        .iter()
        .filter(|cr| {
            let l = cr.labels();
            cr.name_any() != keep
                && l.get(LABEL_SERVICE_NAMESPACE) == Some(&key.namespace)
                && l.get(LABEL_SERVICE_NAME) == Some(&key.name)
        })
        .map(|cr| cr.name_any())
        .collect();
    for name in stale {
        match ctx.lbs().delete(&name, &DeleteParams::default()).await {
            Ok(_) => {
                tracing::info!(service = %key, "deleted LoadBalancer {name} of an earlier Service")
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(Error::Harvester(e)),
        }
    }
    Ok(())
}

/// Deletes every CR of this cluster that belongs to `key`, except `keep` (asks the API server:
/// cleanup must not miss a CR the cache has not seen yet).
async fn delete_crs_of(
    ctx: &ServiceCtx,
    key: &ServiceKey,
    keep: Option<&str>,
) -> Result<Vec<String>, Error> {
    let selector = format!(
        "{LABEL_CLUSTER}={},{LABEL_SERVICE_NAMESPACE}={},{LABEL_SERVICE_NAME}={}",
        ctx.settings.cluster_name, key.namespace, key.name
    );
    let crs = ctx
        .lbs()
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(Error::Harvester)?;
    let mut deleted = Vec::new();
    for cr in crs.items {
        let name = cr.name_any();
        if Some(name.as_str()) == keep {
            continue;
        }
        match ctx.lbs().delete(&name, &DeleteParams::default()).await {
            Ok(_) => deleted.push(name),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(Error::Harvester(e)),
        }
    }
    Ok(deleted)
}

async fn cleanup(svc: &Service, ctx: &ServiceCtx, deleting: bool) -> Result<Action, Error> {
    let key = ServiceKey::of(svc);
    let users: Vec<String> = ctx
        .secondaries_of(&key)
        .iter()
        .map(|s| ServiceKey::of(s).to_string())
        .collect();
    if !users.is_empty() {
        ctx.warn(
            svc,
            "DeletingLoadBalancerFailed",
            format!(
                "the address is still shared by {}; remove their {} annotation first",
                users.join(", "),
                super::annotations::ANN_PRIMARY_SERVICE
            ),
        )
        .await;
        // Woken again when a secondary changes or goes.
        return Ok(Action::await_change());
    }
    ctx.normal(svc, "DeletingLoadBalancer", "Deleting load balancer".into())
        .await;
    if let Some(leases) = &ctx.leases {
        leases.release(&key).await;
    }
    let deleted = delete_crs_of(ctx, &key, None).await?;
    if !deleted.is_empty() {
        tracing::info!(service = %key, "deleted LoadBalancer CRs {deleted:?}");
    }
    if !deleting {
        apply_change(svc, ctx, &plan::released_change(svc)).await?;
    }
    remove_finalizer(svc, ctx).await?;
    ctx.normal(svc, "DeletedLoadBalancer", "Deleted load balancer".into())
        .await;
    Ok(Action::await_change())
}

/// kube-vip's interface for `network`, from the NAD mapping ConfigMap when it exists.
async fn interface_for(ctx: &ServiceCtx, network: Option<&str>) -> Result<Option<String>, Error> {
    let Some(network) = network else {
        return Ok(None);
    };
    let cms: Api<ConfigMap> = Api::namespaced(ctx.guest.clone(), NAD_MAPPING_NAMESPACE);
    let Some(cm) = cms.get_opt(NAD_MAPPING_NAME).await.map_err(Error::Guest)? else {
        return Ok(None);
    };
    let raw = cm
        .data
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

async fn reconcile_primary(
    svc: &Service,
    spec: &ServiceLbSpec,
    ctx: &ServiceCtx,
) -> Result<Action, Error> {
    let key = ServiceKey::of(svc);
    let desired = plan::desired_lb(svc, spec, &ctx.settings, &ctx.namespace);
    let name = desired.name_any();
    // A CR of an earlier Service with this name (another UID) must not leak.
    delete_stale_crs(ctx, &key, &name).await?;
    // The CR watch has listed (the readiness gate waits for it too): its cache answers whether
    // the CR exists, no GET.
    if !ctx.caches_listed().await {
        // Shutting down.
        return Ok(Action::await_change());
    }
    let cached = ctx
        .crs
        .get(&ObjectRef::new(&name).within(&ctx.namespace))
        .map(|lb| lb.as_ref().clone());
    let cached_rv = cached
        .as_ref()
        .map_or(Some(NOT_SEEN.to_string()), |lb| lb.resource_version());
    if ctx.written.behind(&cr_key(&name), cached_rv.as_deref()) {
        // We created or updated it and the watch has not shown that yet; it wakes us when it does.
        return Ok(Action::await_change());
    }
    let lb = match cached {
        None => match ctx.lbs().create(&PostParams::default(), &desired).await {
            Ok(made) => {
                ctx.written.wrote(
                    &cr_key(&name),
                    Some(NOT_SEEN),
                    made.resource_version().as_deref(),
                );
                // The CR watch wakes us when Harvester allocates or reports.
                return Ok(Action::await_change());
            }
            // There but not in our cache (no cluster label: not made by us): read it once.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                ctx.lbs().get(&name).await.map_err(Error::Harvester)?
            }
            Err(e) => return Err(Error::Harvester(e)),
        },
        Some(existing) => {
            let drift = plan::cr_drift(&existing, &desired);
            if let Some((old, new)) = &drift.network_changed {
                ctx.warn(svc, "NetworkChangeRejected", format!(
                    "{} is immutable: the load balancer keeps network {:?}, not {:?}; recreate the Service to change it",
                    super::annotations::ANN_NETWORK, old.as_deref().unwrap_or(""), new.as_deref().unwrap_or("")))
                .await;
            }
            if let Some((old, new)) = &drift.ipam_changed {
                ctx.warn(svc, "IpamChangeRejected", format!(
                    "{} cannot change from {:?} to {:?} on an existing load balancer; recreate the Service",
                    super::annotations::ANN_IPAM, old.as_deref().unwrap_or(""), new.as_deref().unwrap_or("")))
                .await;
            }
            if drift.metadata.is_empty() {
                existing
            } else {
                match update_cr(ctx, existing, |cr| {
                    plan::apply_metadata(cr, &drift.metadata)
                })
                .await?
                {
                    Some(lb) => lb,
                    None => return Ok(Action::await_change()),
                }
            }
        }
    };
    if spec.ipam == Ipam::Dhcp
        && let Some(leases) = &ctx.leases
    {
        return reconcile_dhcp(svc, spec, &lb, leases, ctx).await;
    }
    let Some(ip) = lb.allocated_ip().map(str::to_string) else {
        // Harvester said why it has no address (no matching pool, pool exhausted): tell the user.
        // No condition yet just means Harvester has not got to it; that is no warning.
        if let Some(reason) = lb
            .ready_condition()
            .filter(|c| c.status != "True")
            .and_then(|c| c.message.clone())
        {
            ctx.warn(
                svc,
                "SyncLoadBalancerFailed",
                format!(
                    "ip is not allocated, mode: {}, message: {reason}",
                    spec.ipam.as_str()
                ),
            )
            .await;
        }
        // The CR watch wakes us when Harvester allocates or reports.
        return Ok(Action::await_change());
    };
    let is_dhcp_sentinel = spec.ipam == Ipam::Dhcp;
    let iface = interface_for(ctx, spec.network.as_deref()).await?;
    let mut change = plan::primary_change(svc, &ip, iface.as_deref());
    if is_dhcp_sentinel {
        // kube-vip leases the address and writes the ingress itself.
        change.ingress = None;
    }
    let ingress = plan::ingress_ips(svc);
    let wrote = !change.is_empty();
    if wrote {
        if let Some(requested) = spec.requested_ip
            && requested.to_string() != ip
            && !is_dhcp_sentinel
        {
            ctx.warn(svc, "LoadBalancerIPNotHonoured", format!(
                "spec.loadBalancerIP {requested} cannot be requested from Harvester IP pools; the allocated address is {ip}"))
            .await;
        }
        if let Some(user) = svc.annotations().get(super::annotations::KUBE_VIP_IPS)
            && ingress.is_empty()
            && user != &ip
        {
            ctx.warn(
                svc,
                "LoadBalancerIPNotHonoured",
                format!(
                    "{} was {user}, replaced by the address Harvester allocated: {ip}",
                    super::annotations::KUBE_VIP_IPS
                ),
            )
            .await;
        }
        apply_change(svc, ctx, &change).await?;
        observe_first_address(svc, ctx, &change);
        ctx.normal(
            svc,
            "EnsuredLoadBalancer",
            format!("Ensured load balancer with address {ip}"),
        )
        .await;
    }
    // Mirror what the Service shows to the CR, as upstream does (the leased IP in DHCP mode).
    // Right after writing the Service, the watch event of that write wakes us again and the
    // mirror follows from what the Service then shows: by then Harvester's writes that came with
    // the allocation have reached the cache, and the CR update does not run into them (409).
    let shown = if is_dhcp_sentinel {
        ingress.first().cloned()
    } else {
        Some(ip.clone())
    };
    if let Some(addr) = shown.filter(|_| !wrote) {
        mirror_address(ctx, lb, &addr).await?;
    }
    Ok(Action::requeue(ctx.resync))
}

/// Time from the Service's creation to its first address, for `service_address_seconds`.
fn observe_first_address(svc: &Service, ctx: &ServiceCtx, change: &ServiceChange) {
    let (Some(m), Some(created)) = (&ctx.metrics, svc.meta().creation_timestamp.as_ref()) else {
        return;
    };
    if change.ingress.as_ref().is_some_and(|i| !i.is_empty()) && plan::ingress_ips(svc).is_empty() {
        let secs = jiff::Timestamp::now()
            .duration_since(created.0)
            .as_secs_f64();
        m.service_address_seconds.observe(secs.max(0.0));
    }
}

/// `ipam: dhcp` in `--dhcp-mode=ccm`: lease for the Service's MAC, write the address like a pool one.
async fn reconcile_dhcp(
    svc: &Service,
    spec: &ServiceLbSpec,
    lb: &LoadBalancer,
    leases: &Leases,
    ctx: &ServiceCtx,
) -> Result<Action, Error> {
    let key = ServiceKey::of(svc);
    let mac = match super::dhcp::mac_of(svc) {
        Ok(mac) => mac,
        Err(bad) => {
            ctx.warn(svc, "SyncLoadBalancerFailed", format!("invalid {bad}"))
                .await;
            return Ok(Action::await_change());
        }
    };
    let mapped = interface_for(ctx, spec.network.as_deref()).await?;
    let iface = match super::dhcp::lease_interface(
        spec.network.as_deref(),
        mapped,
        ctx.settings.dhcp_interface.as_deref(),
        harvester_dhcp::route::read_default_route,
    ) {
        Ok(i) => i,
        Err(tried) => {
            ctx.warn(svc, "SyncLoadBalancerFailed", tried).await;
            // A default route can still come (a node whose network is not up yet).
            return Ok(Action::requeue(ctx.resync));
        }
    };
    let lease = match leases.current(&key, mac) {
        Some(l) => l,
        None => leases
            .acquire(&key, &iface.name, mac, super::dhcp::requested_of(svc))
            .await
            .map_err(|e| Error::Dhcp(e.to_string()))?,
    };
    let ip = lease.ip.to_string();
    let mut change = plan::primary_change(svc, &ip, None);
    let mac_text = harvester_dhcp::format_mac(&mac);
    for (k, v) in [
        (KUBE_VIP_HWADDR, mac_text.as_str()),
        (KUBE_VIP_REQUESTED_IP, ip.as_str()),
    ] {
        if svc.annotations().get(k).map(String::as_str) != Some(v) {
            change.annotations.insert(k.into(), Some(v.into()));
        }
    }
    if !change.is_empty() {
        apply_change(svc, ctx, &change).await?;
        observe_first_address(svc, ctx, &change);
        // A lease kept from before may be on another interface than the one chosen now.
        let on = if lease.iface == iface.name {
            format!("{} ({})", lease.iface, iface.chosen_by)
        } else {
            lease.iface.clone()
        };
        ctx.normal(
            svc,
            "EnsuredLoadBalancer",
            format!("Ensured load balancer with DHCP address {ip} (MAC {mac_text} on {on})"),
        )
        .await;
    }
    mirror_address(ctx, lb.clone(), &ip).await?;
    Ok(Action::requeue(ctx.resync))
}

async fn reconcile_secondary(
    svc: &Service,
    spec: &ServiceLbSpec,
    primary_key: &ServiceKey,
    ctx: &ServiceCtx,
) -> Result<Action, Error> {
    let ann = super::annotations::ANN_PRIMARY_SERVICE;
    let primary = ctx
        .services_in(&primary_key.namespace)
        .get_opt(&primary_key.name)
        .await
        .map_err(Error::Guest)?;
    let primary = match primary {
        Some(p)
            if plan::wants_load_balancer(&p, &ctx.settings)
                && p.meta().deletion_timestamp.is_none() =>
        {
            p
        }
        _ => {
            ctx.warn(
                svc,
                "SyncLoadBalancerFailed",
                format!("{ann}={primary_key}: no such LoadBalancer Service"),
            )
            .await;
            return Ok(Action::await_change());
        }
    };
    let primary_spec = match ServiceLbSpec::from_service(&primary) {
        Ok(s) if s.primary.is_none() => s,
        Ok(_) => {
            ctx.warn(
                svc,
                "SyncLoadBalancerFailed",
                format!("{ann}={primary_key}: that Service shares another one's address itself"),
            )
            .await;
            return Ok(Action::await_change());
        }
        Err(bad) => {
            ctx.warn(
                svc,
                "SyncLoadBalancerFailed",
                format!("{ann}={primary_key}: the primary has invalid {bad}"),
            )
            .await;
            return Ok(Action::await_change());
        }
    };
    let mut conflicts = plan::overlapping_ports(&spec.ports, &primary_spec.ports);
    for other in ctx.secondaries_of(primary_key) {
        if ServiceKey::of(&other) == ServiceKey::of(svc) {
            continue;
        }
        if let Ok(o) = ServiceLbSpec::from_service(&other) {
            conflicts.extend(plan::overlapping_ports(&spec.ports, &o.ports));
        }
    }
    if !conflicts.is_empty() {
        let ports: Vec<String> = conflicts
            .iter()
            .map(|p| format!("{}/{}", p.port, p.protocol))
            .collect();
        ctx.warn(
            svc,
            "PortConflict",
            format!(
                "{ann}={primary_key}: ports {} are already used on the shared address",
                ports.join(", ")
            ),
        )
        .await;
        return Ok(Action::await_change());
    }
    if let (Some(mine), Some(theirs)) = (&spec.network, &primary_spec.network)
        && mine != theirs
    {
        ctx.warn(
            svc,
            "SyncLoadBalancerFailed",
            format!("{ann}={primary_key}: network {mine} differs from the primary's {theirs}"),
        )
        .await;
        return Ok(Action::await_change());
    }
    // A CR made while this Service was a primary is not needed any more.
    delete_crs_of(ctx, &ServiceKey::of(svc), None).await?;
    let Some(ip) = plan::ingress_ip(&primary) else {
        ctx.warn(
            svc,
            "SyncLoadBalancerFailed",
            format!("{ann}={primary_key}: the primary has no address yet"),
        )
        .await;
        return Ok(Action::await_change());
    };
    let change = plan::secondary_change(svc, primary_key, &ip);
    if !change.is_empty() {
        apply_change(svc, ctx, &change).await?;
        ctx.normal(
            svc,
            "EnsuredLoadBalancer",
            format!("Sharing address {ip} of {primary_key}"),
        )
        .await;
    }
    Ok(Action::requeue(ctx.resync))
}

/// Deletes CRs of this cluster whose Service is gone, is no LoadBalancer, shares another one's
/// address, or has another UID now; at start and on every resync.
async fn garbage_collector(ctx: Arc<ServiceCtx>, shutdown: impl Future<Output = ()>) {
    let work = async {
        if !ctx.caches_listed().await {
            return;
        }
        loop {
            if let Err(e) = collect_garbage(&ctx).await {
                tracing::warn!("LoadBalancer garbage collection: {e}");
            }
            tokio::time::sleep(ctx.resync).await;
        }
    };
    tokio::select! {
        () = work => {},
        () = shutdown => {},
    }
}

async fn collect_garbage(ctx: &ServiceCtx) -> Result<(), Error> {
    // Entries of objects that are gone would never be consulted again.
    ctx.written.retain(|key| match key.split_once('/') {
        Some(("svc", rest)) => rest
            .split_once('/')
            .is_some_and(|(ns, name)| ctx.services.get(&ObjectRef::new(name).within(ns)).is_some()),
        Some(("lb", name)) => ctx
            .crs
            .get(&ObjectRef::new(name).within(&ctx.namespace))
            .is_some(),
        _ => false,
    });
    let selector = format!("{LABEL_CLUSTER}={}", ctx.settings.cluster_name);
    let crs = ctx
        .lbs()
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(Error::Harvester)?;
    for cr in crs.items {
        let Some(owner) = service_of_cr(&cr) else {
            continue;
        };
        let keep = ctx.services.get(&owner).is_some_and(|svc| {
            plan::wants_load_balancer(&svc, &ctx.settings)
                && ServiceLbSpec::from_service(&svc).is_ok_and(|s| s.primary.is_none())
                && plan::cr_name(&svc, &ctx.settings) == cr.name_any()
        });
        if keep {
            continue;
        }
        tracing::info!(
            "deleting orphaned LoadBalancer {}/{}",
            ctx.namespace,
            cr.name_any()
        );
        match ctx
            .lbs()
            .delete(&cr.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(Error::Harvester(e)),
        }
    }
    Ok(())
}
