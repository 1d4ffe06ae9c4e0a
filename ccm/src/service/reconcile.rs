//! The service controller's orchestration: wiring on the shared harness ([`run`]), then per
//! Service fetch (caches, the NAD mapping) -> plan (`plan`: the change and the
//! [`ServiceProblem`]s) -> apply (`service_io` for the Service, `crs` for the CR) -> report.
//! No rule is decided here.

use std::sync::Arc;

use futures::StreamExt;
use harvester_common::harvester::LoadBalancer;
use harvester_common::telemetry::Readiness;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceSpec};
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};

use super::annotations::{Ipam, ServiceKey, ServiceLbSpec};
use super::context::{Error, ServiceCtx, cr_key, interface_for, svc_key};
use super::crs::{self, Ensured, delete_crs_of, ensure_cr, mirror_address};
use super::dhcp::{DhcpMode, KUBE_VIP_HWADDR, KUBE_VIP_REQUESTED_IP, Leases};
use super::plan::{
    self, DELETED, DELETING, ENSURED, LABEL_CLUSTER, LbSettings, ServiceChange, ServiceProblem,
};
use super::service_io::{add_finalizer, apply_change, remove_finalizer};
use super::wake::{
    related_services, woken_by_cr, woken_by_guest_pools, woken_by_nad_mapping, woken_by_service,
};
use super::{FINALIZER, NAD_MAPPING_NAME, NAD_MAPPING_NAMESPACE, guest};
use crate::config::SERVICE_LB_CONTROLLER;
use crate::context::{Context, READY_SERVICE_CACHES, Shutdown};
use crate::controller::{Backoff, Triggers, measured};
use crate::written::WriteLog;

/// First and longest retry delay after a failed reconcile of a Service (doubling in between).
const BACKOFF_FIRST: std::time::Duration = std::time::Duration::from_millis(500);
const BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(300);
/// Services reconciled at once when `--concurrent-service-syncs` is not given (upstream: 1).
/// Their requests share a few HTTP/2 connections per API server (`harvester_common::api_client`);
/// each reconcile in flight still holds its Service, CR and answers: with 64, 1 000 Services +
/// 200 Nodes peak at 22 MiB. (Over HTTP/1.1 each request in flight held a TLS connection of its
/// own: unbounded, 1 000 Services created within seconds left about 950 open, VmHWM 84 MiB.)
const DEFAULT_SERVICE_SYNCS: u16 = 64;
/// Service events the watch may be ahead of its slowest subscriber (then it waits).
const SERVICE_EVENT_BUFFER: usize = 1024;

/// Runs the controller and the CR garbage collector until `shutdown` resolves (at once when
/// `--controllers` disables it).
pub async fn run(ctx: Arc<Context>, shutdown: Shutdown) {
    if !ctx.config.controllers.enabled(SERVICE_LB_CONTROLLER) {
        return;
    }
    let readiness = ctx.telemetry.readiness.clone();
    readiness.set(
        READY_SERVICE_CACHES,
        Err("waiting for the Service, LoadBalancer and NAD mapping watches to list".into()),
    );
    let settings = LbSettings::from_config(&ctx.config);
    // One Service watch: its cache, the controller's trigger and the related-Service trigger
    // (a secondary reads its primary from the cache, which is never behind the trigger).
    let (store, writer) = reflector::store_shared::<Service>(SERVICE_EVENT_BUFFER);
    let (Some(own), Some(others)) = (writer.subscribe(), writer.subscribe()) else {
        // store_shared always makes a subscribable writer.
        return;
    };
    let concurrency = settings.concurrency.unwrap_or(DEFAULT_SERVICE_SYNCS);
    let (
        sctx,
        Writers {
            crs: cr_writer,
            nad: nad_writer,
            caches_listed,
            woken,
            pool_events,
            pools_synced,
        },
    ) = service_ctx(ctx, settings, store.clone(), &shutdown);
    let indexed = sctx.clone();
    let service_watch = watcher::watcher(
        Api::<Service>::all(sctx.ctx.guest.clone()),
        Default::default(),
    )
    .default_backoff()
    .modify(move |svc| {
        strip_service(svc);
        indexed.secondaries.saw(svc);
    })
    .reflect_shared(writer)
    .for_each(|_| async {});
    let cr_events = cr_events(&sctx, cr_writer);
    let nad_events = configmap_watch(
        nad_writer,
        &sctx.ctx.guest,
        NAD_MAPPING_NAMESPACE,
        NAD_MAPPING_NAME,
    );
    let gc = crs::garbage_collector(sctx.clone(), shutdown.clone());
    let watch_shutdown = shutdown.clone();
    // Polled in the controller's own task (the join below), which every watch event wakes.
    let synced = caches_synced(
        (store.clone(), sctx.crs.clone(), sctx.nad.clone()),
        caches_listed,
        readiness,
        shutdown.clone(),
    );
    let (own_ctx, cr_ctx, related_ctx, nad_ctx, pools_ctx) = (
        sctx.clone(),
        sctx.clone(),
        sctx.clone(),
        sctx.clone(),
        sctx.clone(),
    );
    let triggers = sctx.triggers.clone();
    let dhcp_triggers = sctx.triggers.clone();
    let own = own_events(own_ctx, own);
    let ctrl = Controller::for_shared_stream(own, store.clone())
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
        // A CR's status changed: reconcile its Service (no polling while an address is pending).
        .watches_stream(cr_events, move |lb| woken_by_cr(&cr_ctx, &lb))
        // A primary or secondary changed: reconcile the other side of the shared address.
        .watches_shared_stream(others, move |svc| related_services(&related_ctx, &svc))
        // The NAD mapping changed: reconcile the Services that name a network.
        .watches_stream(nad_events, move |_| woken_by_nad_mapping(&nad_ctx))
        // The guest pools changed: reconcile the Services that take their address there.
        .watches_stream(pool_events, move |_| woken_by_guest_pools(&pools_ctx))
        .reconcile_on(triggers.resync(sctx.resync()))
        .reconcile_on(
            tokio_stream::wrappers::UnboundedReceiverStream::new(woken)
                .flat_map(move |r| futures::stream::iter(dhcp_triggers.note("dhcp lease", [r]))),
        )
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, sctx)
        .for_each(|_| async {});
    let service_watch = async move {
        tokio::select! {
            () = service_watch => {},
            _ = watch_shutdown => {},
        }
    };
    futures::join!(ctrl, gc, synced, service_watch, pools_synced);
}

/// The other ends of what [`service_ctx`] made: the CR and NAD mapping caches' writers, the
/// "caches listed" flag, the wake-ups from outside the watches (DHCP leases, guest-pool addresses
/// freed), and the guest pools' watch events and its "listed" task.
struct Writers {
    crs: reflector::store::Writer<LoadBalancer>,
    nad: reflector::store::Writer<ConfigMap>,
    caches_listed: tokio::sync::watch::Sender<bool>,
    woken: tokio::sync::mpsc::UnboundedReceiver<ObjectRef<Service>>,
    pool_events: futures::stream::BoxStream<'static, Result<ConfigMap, watcher::Error>>,
    pools_synced: futures::future::BoxFuture<'static, ()>,
}

/// The Service events that wake their own reconcile: not the echo of our own write (told once
/// the write's answer is recorded: the echo may come first, and then waits for it).
fn own_events(
    ctx: Arc<ServiceCtx>,
    own: impl futures::Stream<Item = Arc<Service>> + Send + 'static,
) -> impl futures::Stream<Item = Arc<Service>> + Send + 'static {
    own.map(move |svc| {
        let ctx = ctx.clone();
        async move {
            ctx.written.settled(&svc_key(&svc)).await;
            woken_by_service(&ctx, &svc).then_some(svc)
        }
    })
    // Each event waits for its own key only: one write's slow answer holds no other Service's
    // event (a trigger only names the object, so their order does not matter).
    .buffer_unordered(EVENTS_SETTLING)
    .filter_map(futures::future::ready)
}

/// Events that may wait at once for the answer of a write to their object.
const EVENTS_SETTLING: usize = 1024;

/// The watch of this cluster's CRs into their cache (managed fields dropped, indexed by
/// Service), each event held while a write of ours to that CR is in flight.
fn cr_events(
    sctx: &Arc<ServiceCtx>,
    writer: reflector::store::Writer<LoadBalancer>,
) -> impl futures::Stream<Item = Result<LoadBalancer, watcher::Error>> + Send + 'static {
    let lb_watch = watcher::Config::default()
        .labels(&format!("{LABEL_CLUSTER}={}", sctx.settings.cluster_name));
    let (indexed, settle) = (sctx.clone(), sctx.clone());
    cached_watch(writer, sctx.lbs(), lb_watch, move |lb| {
        lb.managed_fields_mut().clear();
        indexed.crs_of.saw(lb);
    })
    .map(move |event| {
        let ctx = settle.clone();
        async move {
            if let Ok(lb) = &event {
                ctx.written.settled(&cr_key(&lb.name_any())).await;
            }
            event
        }
    })
    // As for Services: one CR's wait holds no other CR's event. Two events of one CR taken out
    // of order can only wake its Service once more, never once less (the digest of what the
    // reconcile reads differs from the last one seen).
    .buffer_unordered(EVENTS_SETTLING)
}

/// The reconciles' context on the Service cache `store`, with empty CR and NAD mapping caches.
fn service_ctx(
    ctx: Arc<Context>,
    settings: LbSettings,
    store: Store<Service>,
    shutdown: &Shutdown,
) -> (Arc<ServiceCtx>, Writers) {
    // A DHCP lease lost or re-acquired outside a reconcile wakes its Service through this channel.
    let (wake, woken) = tokio::sync::mpsc::unbounded_channel();
    let leases = (settings.dhcp_mode == DhcpMode::Ccm).then(|| {
        Leases::new(
            Default::default(),
            wake.clone(),
            Some(ctx.telemetry.metrics.clone()),
        )
    });
    let (crs, cr_writer) = kube::runtime::reflector::store::<LoadBalancer>();
    // The one NAD mapping ConfigMap, watched by name (the chart's Role names it for get, list and
    // watch; upstream's chart grants configmaps cluster-wide).
    let (nad, nad_writer) = kube::runtime::reflector::store::<ConfigMap>();
    let pools = guest::pool_watch(&ctx.guest, shutdown.clone());
    let (caches_listed, caches_ready) = tokio::sync::watch::channel(false);
    let metrics = ctx.telemetry.metrics.clone();
    let sctx = Arc::new(ServiceCtx {
        ctx,
        settings,
        crs,
        services: store.clone(),
        nad,
        backoff: Backoff::new(BACKOFF_FIRST, BACKOFF_MAX),
        leases,
        written: WriteLog::default(),
        caches_ready,
        secondaries: Default::default(),
        crs_of: Default::default(),
        cr_changes: Default::default(),
        triggers: Arc::new(Triggers::new("service", metrics, store)),
        guest_pools: pools.store,
        pools_ready: pools.ready,
        ledger: Default::default(),
        wake,
    });
    let writers = Writers {
        crs: cr_writer,
        nad: nad_writer,
        caches_listed,
        woken,
        pool_events: pools.events,
        pools_synced: pools.synced,
    };
    (sctx, writers)
}

/// What the service controller never reads, dropped before a Service is cached: the managed
/// fields, kubectl's copy of the whole object, and every spec field but the five it reads (a
/// Pod selector alone is a 544-byte map node per Service: 2.7 MiB at 5 000). Our writes are
/// patches of the fields we own, so nothing dropped here is ever written back.
fn strip_service(svc: &mut Service) {
    svc.managed_fields_mut().clear();
    svc.annotations_mut().remove(LAST_APPLIED);
    if let Some(spec) = svc.spec.take() {
        svc.spec = Some(ServiceSpec {
            type_: spec.type_,
            load_balancer_class: spec.load_balancer_class,
            load_balancer_ip: spec.load_balancer_ip,
            ports: spec.ports,
            ip_families: spec.ip_families,
            ..Default::default()
        });
    }
}

/// kubectl's `apply` copy of the object.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// A watch of ConfigMap `namespace/name` alone (the chart's Role names each for get, list and
/// watch), keeping `writer`'s cache without the managed fields.
pub(super) fn configmap_watch(
    writer: reflector::store::Writer<ConfigMap>,
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> impl futures::Stream<Item = Result<ConfigMap, watcher::Error>> + use<> {
    let by_name = watcher::Config::default().fields(&format!("metadata.name={name}"));
    cached_watch(
        writer,
        Api::namespaced(client.clone(), namespace),
        by_name,
        |cm| cm.managed_fields_mut().clear(),
    )
}

/// A watch of `api` that keeps `writer`'s cache (each object through `modify` first) and yields
/// the objects it touched.
fn cached_watch<K>(
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    config: watcher::Config,
    modify: impl FnMut(&mut K) + Send + 'static,
) -> impl futures::Stream<Item = Result<K, watcher::Error>>
where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
    K: Send + Sync + 'static,
{
    kube::runtime::reflector(writer, watcher::watcher(api, config).modify(modify))
        .default_backoff()
        .touched_objects()
}

/// Marks the service caches listed (for the reconciles and `/readyz`) once all three hold a full
/// list, unless shutdown comes first.
async fn caches_synced(
    (services, crs, nad): (Store<Service>, Store<LoadBalancer>, Store<ConfigMap>),
    listed: tokio::sync::watch::Sender<bool>,
    readiness: Readiness,
    shutdown: Shutdown,
) {
    let all = futures::future::join3(
        services.wait_until_ready(),
        crs.wait_until_ready(),
        nad.wait_until_ready(),
    );
    tokio::select! {
        _ = all => {
            listed.send_replace(true);
            readiness.set(READY_SERVICE_CACHES, Ok(()));
        }
        _ = shutdown => {}
    }
}

fn error_policy(svc: Arc<Service>, err: &Error, ctx: Arc<ServiceCtx>) -> Action {
    let delay = ctx.backoff.failed(ObjectRef::from_obj(svc.as_ref()));
    tracing::debug!(service = %ServiceKey::of(&svc), "retrying in {delay:?}: {err}");
    Action::requeue(delay)
}

async fn reconcile(svc: Arc<Service>, ctx: Arc<ServiceCtx>) -> Result<Action, Error> {
    ctx.triggers.woke(&svc);
    let metrics = &ctx.ctx.telemetry.metrics;
    let result = measured(
        metrics,
        "service",
        reconcile_service(&svc, &ctx),
        Error::kind,
    )
    .await;
    match &result {
        Ok(_) => ctx.backoff.succeeded(&ObjectRef::from_obj(svc.as_ref())),
        Err(e) => ctx.warn(&svc, e.reason(), e.to_string()),
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
    let spec = match ServiceLbSpec::with_default_ipam(svc, ctx.settings.default_ipam) {
        Ok(spec) => spec,
        Err(bad) => {
            // Nothing is created from bad input; a change of the Service wakes us again.
            ctx.report(svc, &ServiceProblem::BadAnnotation(bad));
            return Ok(Action::await_change());
        }
    };
    if spec.ipam != Ipam::Guest {
        // A guest-pool address it had is not kept for it any more.
        guest::released(ctx, &ServiceKey::of(svc), false);
    }
    if spec.primary.is_none() && spec.ipam != Ipam::Guest {
        // A primary writes its finalizer beside its CR.
        return reconcile_primary(svc, &spec, has_finalizer, ctx).await;
    }
    // The reconcile goes on with the Service as the finalizer patch stored it; that patch's
    // watch event is only our echo and wakes nobody.
    let stored;
    let svc = if has_finalizer {
        svc
    } else {
        stored = add_finalizer(svc, ctx).await?;
        &stored
    };
    match &spec.primary {
        Some(primary) => reconcile_secondary(svc, &spec, primary, ctx).await,
        None => guest::reconcile_guest(svc, &spec, ctx).await,
    }
}

/// A primary: its finalizer and CR made (at once) or its CR updated, then its address (from
/// Harvester's pool, or leased here for `ipam: dhcp` in `--dhcp-mode=ccm`) written to the
/// Service and mirrored to the CR.
async fn reconcile_primary(
    svc: &Service,
    spec: &ServiceLbSpec,
    has_finalizer: bool,
    ctx: &ServiceCtx,
) -> Result<Action, Error> {
    let key = ServiceKey::of(svc);
    let desired = plan::desired_lb(svc, spec, &ctx.settings, ctx.namespace());
    let stored;
    let (svc, Ensured { lb, problems, .. }) = if has_finalizer {
        (svc, ensure_cr(ctx, &key, &desired).await?)
    } else {
        let (with_finalizer, ensured) = finalizer_and_cr(svc, &key, &desired, ctx).await?;
        stored = with_finalizer;
        (&stored, ensured)
    };
    for problem in &problems {
        ctx.report(svc, problem);
    }
    let Some(lb) = lb else {
        return Ok(Action::await_change());
    };
    if spec.ipam == Ipam::Dhcp
        && let Some(leases) = &ctx.leases
    {
        return reconcile_dhcp(svc, spec, &lb, leases, ctx).await;
    }
    let Some(ip) = lb.allocated_ip().map(str::to_string) else {
        if let Some(problem) = plan::not_allocated(&lb, &spec.ipam) {
            ctx.report(svc, &problem);
        }
        // The CR watch wakes us when Harvester allocates or reports.
        return Ok(Action::await_change());
    };
    let is_dhcp_sentinel = spec.ipam == Ipam::Dhcp;
    let iface = interface_for(ctx, spec.network.as_deref())?;
    let mut change = plan::primary_change(svc, &ip, iface.as_deref());
    if is_dhcp_sentinel {
        // kube-vip leases the address and writes the ingress itself.
        change.ingress = None;
        if let Some((key, wanted)) = plan::kube_vip_dhcp_request(svc, spec) {
            change.annotations.insert(key, Some(wanted));
        }
    }
    let ingress = plan::ingress_ips(svc);
    let wrote = !change.is_empty();
    if wrote {
        for problem in plan::unhonoured_requests(svc, spec, &ip, is_dhcp_sentinel) {
            ctx.report(svc, &problem);
        }
        apply_change(svc, ctx, &change).await?;
        observe_first_address(svc, ctx, &change);
        let note = format!("Ensured load balancer with address {ip}");
        ctx.normal(svc, ENSURED, note);
    }
    // Mirror what the Service shows to the CR, as upstream does (the leased IP in DHCP mode),
    // right after the Service's write: the CR in the cache is the version whose allocation woke
    // us. Should Harvester have written it again since (409), the event of that write wakes us
    // (`WriteLog::await_next`) and the mirror follows from it.
    let shown = if is_dhcp_sentinel {
        ingress.first().cloned()
    } else {
        Some(ip.clone())
    };
    if let Some(addr) = shown {
        mirror_address(ctx, lb, &addr).await?;
    }
    Ok(Action::await_change())
}

/// The finalizer and the CR of a primary that has neither, written at once. Upstream writes the
/// finalizer, then the load balancer: two round trips in a row before Harvester can allocate.
/// Should the finalizer fail (the Service changed or is gone), a CR this call made is deleted
/// again before the error is returned: no CR outlives the reconcile without the finalizer that
/// makes its Service's deletion clean it up (a crash in between leaves it to the garbage
/// collector, which runs at start). Returns the Service as the finalizer patch stored it.
async fn finalizer_and_cr(
    svc: &Service,
    key: &ServiceKey,
    desired: &LoadBalancer,
    ctx: &ServiceCtx,
) -> Result<(Service, Ensured), Error> {
    let (finalized, ensured) =
        futures::join!(add_finalizer(svc, ctx), ensure_cr(ctx, key, desired));
    match finalized {
        Ok(stored) => Ok((stored, ensured?)),
        Err(e) => {
            if let Ok(Ensured { created: true, .. }) = ensured {
                let name = desired.name_any();
                match crs::delete_cr(ctx, &name).await {
                    Ok(_) => {
                        tracing::debug!(service = %key, "deleted LoadBalancer {name} again: {e}")
                    }
                    Err(d) => {
                        tracing::warn!(service = %key, "LoadBalancer {name} is left to the garbage collector: {d}")
                    }
                }
            }
            Err(e)
        }
    }
}

/// Time from the Service's creation to its first address, for `service_address_seconds`.
pub(super) fn observe_first_address(svc: &Service, ctx: &ServiceCtx, change: &ServiceChange) {
    let Some(created) = svc.meta().creation_timestamp.as_ref() else {
        return;
    };
    if change.ingress.as_ref().is_some_and(|i| !i.is_empty()) && plan::ingress_ips(svc).is_empty() {
        let secs = jiff::Timestamp::now()
            .duration_since(created.0)
            .as_secs_f64();
        let metrics = &ctx.ctx.telemetry.metrics;
        metrics.service_address_seconds.observe(secs.max(0.0));
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
            ctx.report(svc, &ServiceProblem::BadMac(bad));
            return Ok(Action::await_change());
        }
    };
    let mapped = interface_for(ctx, spec.network.as_deref())?;
    let iface = match super::dhcp::lease_interface(
        spec.network.as_deref(),
        mapped,
        ctx.settings.dhcp_interface.as_deref(),
        harvester_dhcp::route::read_default_route,
    ) {
        Ok(i) => i,
        Err(tried) => {
            ctx.report(svc, &ServiceProblem::NoLeaseInterface(tried));
            // A default route can still come (a node whose network is not up yet).
            return Ok(Action::requeue(ctx.resync()));
        }
    };
    let wanted = spec.requested();
    let wanted_v4 = match wanted {
        Some(std::net::IpAddr::V4(v4)) => Some(v4),
        _ => None,
    };
    let held = super::dhcp::requested_of(svc);
    let lease = match leases.current(&key, mac) {
        Some(l) => l,
        None => leases
            .acquire(&key, &iface.name, mac, held, wanted_v4)
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
        if let Some(requested) = wanted.filter(|w| change.ingress.is_some() && *w != lease.ip) {
            let problem = ServiceProblem::DhcpRequestNotHonoured {
                requested,
                ip: ip.clone(),
            };
            ctx.report(svc, &problem);
        }
        apply_change(svc, ctx, &change).await?;
        observe_first_address(svc, ctx, &change);
        // A lease kept from before may be on another interface than the one chosen now.
        let on = if lease.iface == iface.name {
            format!("{} ({})", lease.iface, iface.chosen_by)
        } else {
            lease.iface.clone()
        };
        let note = format!("Ensured load balancer with DHCP address {ip} (MAC {mac_text} on {on})");
        ctx.normal(svc, ENSURED, note);
    }
    mirror_address(ctx, lb.clone(), &ip).await?;
    Ok(Action::await_change())
}

/// A secondary: its primary (from the cache) checked, then the primary's address written.
async fn reconcile_secondary(
    svc: &Service,
    spec: &ServiceLbSpec,
    primary_key: &ServiceKey,
    ctx: &ServiceCtx,
) -> Result<Action, Error> {
    let cached = ctx
        .services
        .get(&ObjectRef::new(&primary_key.name).within(&primary_key.namespace));
    let me = ServiceKey::of(svc);
    let others: Vec<ServiceLbSpec> = ctx
        .secondaries_of(primary_key)
        .iter()
        .filter(|other| ServiceKey::of(other) != me)
        .filter_map(|other| ServiceLbSpec::from_service(other).ok())
        .collect();
    let checked =
        plan::check_secondary(spec, primary_key, cached.as_deref(), &others, &ctx.settings);
    let primary = match checked {
        Ok((primary, _)) => primary,
        Err(problem) => {
            ctx.report(svc, &problem);
            return Ok(Action::await_change());
        }
    };
    // A CR made while this Service was a primary is not needed any more.
    delete_crs_of(ctx, &me).await?;
    let ip = match plan::shared_address(primary_key, primary) {
        Ok(ip) => ip,
        Err(problem) => {
            ctx.report(svc, &problem);
            return Ok(Action::await_change());
        }
    };
    let change = plan::secondary_change(svc, primary_key, &ip);
    if !change.is_empty() {
        apply_change(svc, ctx, &change).await?;
        let note = format!("Sharing address {ip} of {primary_key}");
        ctx.normal(svc, ENSURED, note);
    }
    Ok(Action::await_change())
}

/// A Service that no longer has a load balancer (deleted, or no LoadBalancer any more): its CRs
/// and lease released, what we wrote on it removed, then the finalizer; not while secondaries
/// still share its address.
async fn cleanup(svc: &Service, ctx: &ServiceCtx, deleting: bool) -> Result<Action, Error> {
    let key = ServiceKey::of(svc);
    let users: Vec<String> = ctx
        .secondaries_of(&key)
        .iter()
        .map(|s| ServiceKey::of(s).to_string())
        .collect();
    if !users.is_empty() {
        ctx.report(svc, &ServiceProblem::StillShared { users });
        // Woken again when a secondary changes or goes.
        return Ok(Action::await_change());
    }
    ctx.normal(svc, DELETING, "Deleting load balancer".into());
    if let Some(leases) = &ctx.leases {
        leases.release(&key).await;
    }
    let deleted = delete_crs_of(ctx, &key).await?;
    if !deleted.is_empty() {
        tracing::info!(service = %key, "deleted LoadBalancer CRs {deleted:?}");
    }
    if !deleting {
        apply_change(svc, ctx, &plan::released_change(svc)).await?;
    }
    remove_finalizer(svc, ctx).await?;
    // Its address is free now: Services waiting for a guest-pool address may take it.
    guest::released(ctx, &key, true);
    ctx.normal(svc, DELETED, "Deleted load balancer".into());
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_cached_service_keeps_what_the_controller_reads() {
        let mut svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "web", "labels": {"a": "b"},
                         "annotations": {LAST_APPLIED: "{}", "cloudprovider.harvesterhci.io/ipam": "dhcp"}},
            "spec": {"type": "LoadBalancer", "loadBalancerClass": "c", "loadBalancerIP": "10.0.0.9",
                     "ipFamilies": ["IPv4"], "ports": [{"port": 80, "protocol": "UDP"}],
                     "selector": {"app": "web"}, "clusterIP": "10.43.0.10", "sessionAffinity": "None"},
            "status": {"loadBalancer": {"ingress": [{"ip": "10.0.0.9"}]}}
        }))
        .expect("test service");
        let status = svc.status.clone();
        strip_service(&mut svc);
        let spec = svc.spec.as_ref().expect("spec kept");
        assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
        assert_eq!(spec.load_balancer_class.as_deref(), Some("c"));
        assert_eq!(spec.load_balancer_ip.as_deref(), Some("10.0.0.9"));
        assert_eq!(spec.ip_families, Some(vec!["IPv4".to_string()]));
        assert_eq!(
            spec.ports.as_ref().map(|p| p[0].protocol.as_deref()),
            Some(Some("UDP"))
        );
        assert!(
            spec.selector.is_none() && spec.cluster_ip.is_none() && spec.session_affinity.is_none()
        );
        assert_eq!(svc.status, status);
        assert_eq!(svc.labels().get("a").map(String::as_str), Some("b"));
        assert_eq!(svc.annotations().len(), 1, "only kubectl's copy dropped");
    }
}
