//! `ipam: guest`: a primary's address from the guest cluster's own pools (ConfigMap
//! `kube-system/kubevip`, [`super::guest_pool`]), with no LoadBalancer CR in Harvester. Thin I/O:
//! the pools and the used addresses come from the watch caches, the choice from
//! [`Ledger::decide`](super::guest_pool::alloc::Ledger::decide), the write is the pool path's
//! (kube-vip's annotations and the ingress in one patch).

use std::collections::BTreeMap;
use std::net::IpAddr;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;

use super::annotations::{Ipam, ServiceKey, ServiceLbSpec};
use super::context::{Error, ServiceCtx, interface_for};
use super::guest_pool::alloc::{Family, Request};
use super::guest_pool::{POOL_CONFIGMAP_NAME, POOL_CONFIGMAP_NAMESPACE, PoolConfig};
use super::plan::{self, ENSURED, ServiceProblem};
use super::service_io::apply_change;
use crate::context::Shutdown;

/// The guest pools' ConfigMap watched by name (as the NAD mapping): its cache, the flag set once
/// it has listed, the events that wake the guest-pool Services, and the task that sets the flag.
/// Apart from the other caches: without the chart's RBAC for it, only `ipam: guest` waits.
pub(super) struct PoolWatch {
    pub store: Store<ConfigMap>,
    pub ready: tokio::sync::watch::Receiver<bool>,
    pub events: BoxStream<'static, Result<ConfigMap, watcher::Error>>,
    pub synced: BoxFuture<'static, ()>,
}

pub(super) fn pool_watch(client: &kube::Client, shutdown: Shutdown) -> PoolWatch {
    let (store, writer) = reflector::store::<ConfigMap>();
    let (listed, ready) = tokio::sync::watch::channel(false);
    let events = super::reconcile::configmap_watch(
        writer,
        client,
        POOL_CONFIGMAP_NAMESPACE,
        POOL_CONFIGMAP_NAME,
    );
    PoolWatch {
        synced: pools_synced(store.clone(), listed, shutdown).boxed(),
        store,
        ready,
        events: events.boxed(),
    }
}

/// Marks the guest pools' cache listed once it is, unless shutdown comes first (one waiter on
/// `wait_until_ready`: the reconciles wait on the flag, see `ServiceCtx::caches_ready`).
async fn pools_synced(
    pools: Store<ConfigMap>,
    listed: tokio::sync::watch::Sender<bool>,
    shutdown: Shutdown,
) {
    tokio::select! {
        _ = pools.wait_until_ready() => {
            listed.send_replace(true);
        }
        _ = shutdown => {}
    }
}

/// The pools as the ConfigMap's cache shows them (none without the ConfigMap).
fn pool_config(pools: &Store<ConfigMap>) -> PoolConfig {
    let key = ObjectRef::new(POOL_CONFIGMAP_NAME).within(POOL_CONFIGMAP_NAMESPACE);
    let data = pools.get(&key).and_then(|cm| cm.data.clone());
    PoolConfig::parse(&data.unwrap_or_default())
}

/// Every address the cached Services show in their ingress, with the Service showing it.
fn held_addresses(services: &Store<Service>) -> BTreeMap<IpAddr, ServiceKey> {
    let mut held = BTreeMap::new();
    for svc in services.state() {
        for ip in plan::ingress_ips(&svc) {
            if let Ok(ip) = ip.parse::<IpAddr>() {
                held.entry(ip).or_insert_with(|| ServiceKey::of(&svc));
            }
        }
    }
    held
}

fn family(svc: &Service) -> Option<Family> {
    let first = svc.spec.as_ref()?.ip_families.as_ref()?.first()?.clone();
    match first.as_str() {
        "IPv6" => Some(Family::V6),
        "IPv4" => Some(Family::V4),
        _ => None,
    }
}

/// A guest-pool primary: its address chosen (kept, requested, or the first free one) and written.
pub(super) async fn reconcile_guest(
    svc: &Service,
    spec: &ServiceLbSpec,
    ctx: &ServiceCtx,
) -> Result<Action, Error> {
    let key = ServiceKey::of(svc);
    let pools_listed = ctx
        .pools_ready
        .clone()
        .wait_for(|ready| *ready)
        .await
        .is_ok();
    if !pools_listed || !ctx.caches_listed().await {
        // Shutting down.
        return Ok(Action::await_change());
    }
    // A CR made while this Service took its address from Harvester is not needed any more.
    super::crs::delete_cached_crs_of(ctx, &key).await?;
    let config = pool_config(&ctx.guest_pools);
    let pool = match config.pool_for(&key.namespace) {
        Ok(pool) => pool,
        Err(problem) => {
            // A change of the ConfigMap wakes every guest-pool Service.
            ctx.report(svc, &ServiceProblem::GuestPool(problem));
            return Ok(Action::await_change());
        }
    };
    let current = plan::ingress_ip(svc).and_then(|ip| ip.parse::<IpAddr>().ok());
    let requested = spec.requested();
    let kept = current.filter(|c| pool.contains(*c));
    let ip = if kept.is_some() && requested.is_none_or(|r| Some(r) == kept) {
        // The Service shows its address, inside its pool: it is the record, nothing to decide.
        kept
    } else {
        let req = Request {
            current,
            reserved: None,
            requested,
            family: family(svc),
        };
        let held = held_addresses(&ctx.services);
        let decision = ctx.ledger.decide(&key, pool, config.descending, req, held);
        if let Some(problem) = decision.problem {
            // Woken when an address is freed or the ConfigMap changes.
            ctx.report(svc, &ServiceProblem::GuestPool(problem));
        }
        decision.ip
    };
    let Some(ip) = ip.map(|ip| ip.to_string()) else {
        return Ok(Action::await_change());
    };
    let iface = match interface_for(ctx, spec.network.as_deref())? {
        Some(mapped) => Some(mapped),
        None => config.interface_for(&key.namespace).map(str::to_string),
    };
    let change = plan::primary_change(svc, &ip, iface.as_deref());
    if !change.is_empty() {
        apply_change(svc, ctx, &change).await?;
        super::reconcile::observe_first_address(svc, ctx, &change);
        let note = format!(
            "Ensured load balancer with address {ip} from guest pool {}",
            pool.key
        );
        ctx.normal(svc, ENSURED, note);
    }
    Ok(Action::requeue(ctx.resync()))
}

/// `key` gave its address back (`freed`: cleanup done) or takes it elsewhere now: the Services
/// waiting for a guest-pool address are woken.
pub(super) fn released(ctx: &ServiceCtx, key: &ServiceKey, freed: bool) {
    let waiting = if freed {
        ctx.ledger.release(key)
    } else {
        ctx.ledger.forget(key)
    };
    for waiting in waiting {
        let _ = ctx
            .wake
            .send(ObjectRef::new(&waiting.name).within(&waiting.namespace));
    }
}

/// The LoadBalancer Services whose address comes from the guest pools (for the ConfigMap's
/// watch: a change of the pools may serve them now).
pub(super) fn guest_services(store: &Store<Service>, default: Ipam) -> Vec<ObjectRef<Service>> {
    store
        .state()
        .iter()
        .filter(|s| {
            ServiceLbSpec::with_default_ipam(s, default)
                .is_ok_and(|spec| spec.ipam == Ipam::Guest && spec.primary.is_none())
        })
        .map(|s| ObjectRef::from_obj(s.as_ref()))
        .collect()
}
