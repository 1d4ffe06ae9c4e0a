//! The Harvester LB controller's part for `workloadType: cluster` LoadBalancers: IP allocation
//! from IPPools (with [`super::ipam`]), `0.0.0.0` for DHCP, the Ready condition, and the
//! release of the address when the LoadBalancer goes. Woken by LoadBalancer and IPPool watches:
//! a LoadBalancer waiting for a pool converges as soon as one matches.
//!
//! Like upstream, pools are read from a watch cache and written with `Update` (load-balancer-harvester
//! v1.8 `pkg/ipam/store/store.go`: `iPPoolCache.Get`, `iPPoolClient.Update`; `pkg/ipam/selector.go`:
//! `IPPoolCache.List`), never listed from the API server per allocation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ipam::{self, PoolState, PoolView, Range, Requirement};
use futures::StreamExt;
use harvester_common::harvester::loadbalancer::{
    ANN_CLUSTER, ANN_NAMESPACE, ANN_NETWORK, ANN_PROJECT, AllocatedAddress, Condition,
    DHCP_SENTINEL, GLOBAL_POOL_LABEL, IPPoolStatus, LB_CONTROLLER_FINALIZER,
};
use harvester_common::harvester::{IPPool, LoadBalancer};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Config as CtrlConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum LbSimError {
    #[error("{0}")]
    Kube(#[from] kube::Error),
    #[error("IPPool {pool} changed under us; retrying")]
    Conflict { pool: String },
    #[error("the cached LoadBalancer {lb} is older than the API server's; retrying")]
    Stale { lb: String },
}

/// A LoadBalancer with this annotation is left alone by the stand-in (fault tests plant
/// undecodable CRs that Harvester's own controller could not process either).
pub const UNMANAGED: &str = "testbed.harvesterhci.io/unmanaged";

struct Ctx {
    client: kube::Client,
    pools: Pools,
}

/// The IPPools as the controller sees them: its watch cache, overlaid with what its own writes
/// returned until the cache has caught up with them (upstream's cache lags its writes too, and a
/// write from the stale copy then fails with a conflict and is retried; the overlay spares the
/// stand-in those round trips without changing what it writes).
struct Pools {
    cache: Store<IPPool>,
    written: Mutex<HashMap<String, Arc<IPPool>>>,
}

impl Pools {
    fn all(&self) -> Vec<Arc<IPPool>> {
        let written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        self.cache
            .state()
            .into_iter()
            .map(|cached| match written.get(&cached.name_any()) {
                Some(w) if newer(w, &cached) => w.clone(),
                _ => cached,
            })
            .collect()
    }

    fn get(&self, name: &str) -> Option<Arc<IPPool>> {
        self.all().into_iter().find(|p| p.name_any() == name)
    }

    fn wrote(&self, pool: IPPool) {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        written.insert(pool.name_any(), Arc::new(pool));
    }
}

/// Whether `a` is a later version of the object than `b`. kube-apiserver's resourceVersions
/// are etcd revisions (decimal): a stand-in on that server may compare them.
fn newer(a: &IPPool, b: &IPPool) -> bool {
    let rv = |p: &IPPool| {
        p.resource_version()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    a.uid() == b.uid() && rv(a) > rv(b)
}

/// Runs the controller until the task is aborted.
pub async fn run(client: kube::Client) {
    let lbs: Api<LoadBalancer> = Api::all(client.clone());
    let (cache, writer) = reflector::store();
    let pool_events = watcher::watcher(Api::<IPPool>::all(client.clone()), Default::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    let controller = Controller::new(lbs, watcher::Config::default())
        .with_config(CtrlConfig::default().concurrency(1));
    let store = controller.store();
    let pools = Pools {
        cache,
        written: Mutex::default(),
    };
    controller
        // A pool change wakes the LoadBalancers that found no address (Ready False); one not
        // tried yet is queued already, so the stand-in's own allocation writes wake nobody.
        .watches_stream(pool_events, move |_pool: IPPool| {
            store
                .state()
                .iter()
                .filter(|lb| lb.allocated_ip().is_none() && waiting(lb))
                .map(|lb| ObjectRef::from_obj(lb.as_ref()))
                .collect::<Vec<_>>()
        })
        .run(reconcile, error_policy, Arc::new(Ctx { client, pools }))
        .for_each(|_| async {})
        .await;
}

fn error_policy(_lb: Arc<LoadBalancer>, err: &LbSimError, _ctx: Arc<Ctx>) -> Action {
    tracing::debug!("sim lb: {err}");
    Action::requeue(Duration::from_millis(200))
}

fn applicant(lb: &LoadBalancer) -> String {
    format!("{}/{}", lb.namespace().unwrap_or_default(), lb.name_any())
}

async fn reconcile(lb: Arc<LoadBalancer>, ctx: Arc<Ctx>) -> Result<Action, LbSimError> {
    if lb.annotations().contains_key(UNMANAGED) {
        return Ok(Action::await_change());
    }
    // Upstream's controllers start once their caches have synced.
    let _ = ctx.pools.cache.wait_until_ready().await;
    let ns = lb.namespace().unwrap_or_default();
    let api: Api<LoadBalancer> = Api::namespaced(ctx.client.clone(), &ns);
    let has_finalizer = lb.finalizers().iter().any(|f| f == LB_CONTROLLER_FINALIZER);
    if lb.meta().deletion_timestamp.is_some() {
        if has_finalizer {
            // load-balancer-harvester v1.8.2 `pkg/controller/loadbalancer/controller.go`
            // `OnRemove`: an address is released only for `ipam: pool`, to the pool recorded in
            // `status.allocatedAddress.ipPool`.
            let pool = lb
                .status
                .as_ref()
                .and_then(|s| s.allocated_address.as_ref())
                .and_then(|a| a.ip_pool.clone())
                .filter(|p| !p.is_empty());
            if let (Some("pool"), Some(pool)) = (lb.spec.ipam.as_deref(), pool) {
                release_from(&ctx, &pool, &applicant(&lb)).await?;
            }
            let rest: Vec<String> = lb
                .finalizers()
                .iter()
                .filter(|f| *f != LB_CONTROLLER_FINALIZER)
                .cloned()
                .collect();
            patch(
                &api,
                &lb,
                json!({"metadata": {"finalizers": rest,
                "resourceVersion": lb.resource_version()}}),
            )
            .await?;
        }
        return Ok(Action::await_change());
    }
    if !has_finalizer {
        let mut f = lb.finalizers().to_vec();
        f.push(LB_CONTROLLER_FINALIZER.into());
        patch(
            &api,
            &lb,
            json!({"metadata": {"finalizers": f,
            "resourceVersion": lb.resource_version()}}),
        )
        .await?;
        // The patch wakes us again with the new object.
        return Ok(Action::await_change());
    }
    if lb.is_dhcp() {
        if lb.allocated_ip() != Some(DHCP_SENTINEL) || !is_ready(&lb) {
            let addr = AllocatedAddress {
                ip: DHCP_SENTINEL.into(),
                ..Default::default()
            };
            set_status(&api, &lb, Some(addr), ready(true, None)).await?;
        }
        return Ok(Action::await_change());
    }
    if lb.allocated_ip().is_some() {
        if !is_ready(&lb) {
            set_status(&api, &lb, None, ready(true, None)).await?;
        }
        return Ok(Action::await_change());
    }
    match allocate(&ctx, &lb).await? {
        Ok(addr) => set_status(&api, &lb, Some(addr), ready(true, None)).await?,
        // Woken again by the IPPool watch when pools change.
        Err(message) => set_status(&api, &lb, None, ready(false, Some(message))).await?,
    }
    Ok(Action::await_change())
}

/// Whether `lb` was told it has no address (no pool, pool exhausted, a duplicate released).
fn waiting(lb: &LoadBalancer) -> bool {
    lb.ready_condition().is_some_and(|c| c.status != "True")
}

fn is_ready(lb: &LoadBalancer) -> bool {
    lb.ready_condition().is_some_and(|c| c.status == "True")
}

fn ready(ok: bool, message: Option<String>) -> Condition {
    let now = jiff::Timestamp::now().to_string();
    Condition {
        type_: "Ready".into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: None,
        message,
        last_update_time: Some(now.clone()),
        last_transition_time: Some(now),
    }
}

async fn patch(
    api: &Api<LoadBalancer>,
    lb: &LoadBalancer,
    body: serde_json::Value,
) -> Result<(), LbSimError> {
    api.patch(&lb.name_any(), &PatchParams::default(), &Patch::Merge(body))
        .await?;
    Ok(())
}

/// The CRD has no status subresource: status is merged into the object itself.
async fn set_status(
    api: &Api<LoadBalancer>,
    lb: &LoadBalancer,
    addr: Option<AllocatedAddress>,
    condition: Condition,
) -> Result<(), LbSimError> {
    let current = lb.ready_condition();
    if addr.is_none()
        && current.is_some_and(|c| c.status == condition.status && c.message == condition.message)
    {
        return Ok(());
    }
    let mut status = json!({"conditions": [condition]});
    if let Some(addr) = addr {
        status["allocatedAddress"] = json!(addr);
    }
    patch(api, lb, json!({"status": status})).await
}

fn requirement(lb: &LoadBalancer) -> Requirement {
    let ann = lb.annotations();
    let get = |k: &str| ann.get(k).cloned().unwrap_or_default();
    // v1.8.2 controller.go `selectIPPool`: an empty namespace annotation means the LB's own.
    let namespace = ann
        .get(ANN_NAMESPACE)
        .filter(|n| !n.is_empty())
        .cloned()
        .unwrap_or_else(|| lb.namespace().unwrap_or_default());
    Requirement {
        network: get(ANN_NETWORK),
        project: get(ANN_PROJECT),
        namespace,
        cluster: get(ANN_CLUSTER),
    }
}

fn view(pool: &IPPool) -> PoolView {
    PoolView {
        name: pool.name_any(),
        selector: pool.spec.selector.clone(),
        global: pool.labels().get(GLOBAL_POOL_LABEL).map(String::as_str) == Some("true"),
    }
}

fn ranges(pool: &IPPool) -> Result<Vec<Range>, String> {
    pool.spec
        .ranges
        .iter()
        .map(|r| {
            Range::parse(
                &r.subnet,
                r.range_start.as_deref(),
                r.range_end.as_deref(),
                r.gateway.as_deref(),
            )
            .map_err(|e| format!("IPPool {}: {e}", pool.name_any()))
        })
        .collect()
}

fn state(pool: &IPPool) -> PoolState {
    let Some(status) = &pool.status else {
        return PoolState::default();
    };
    serde_json::from_value(json!({
        "allocated": &status.allocated,
        "allocatedHistory": &status.allocated_history,
        "lastAllocated": &status.last_allocated,
    }))
    .unwrap_or_default()
}

/// Writes `state` into the pool's status with the pool's resourceVersion (optimistic lock).
async fn store_state(
    ctx: &Ctx,
    pool: &IPPool,
    ranges: &[Range],
    state: &PoolState,
) -> Result<(), LbSimError> {
    let mut pool = pool.clone();
    let status = pool.status.get_or_insert_with(IPPoolStatus::default);
    status.allocated = state
        .allocated
        .iter()
        .map(|(ip, id)| (ip.to_string(), id.clone()))
        .collect();
    status.allocated_history = state
        .history
        .iter()
        .map(|(ip, id)| (ip.to_string(), id.clone()))
        .collect();
    status.last_allocated = state.last_allocated.map(|ip| ip.to_string());
    status.total = i64::try_from(ipam::total(ranges)).unwrap_or(i64::MAX);
    status.available = i64::try_from(ipam::available(ranges, state)).unwrap_or(i64::MAX);
    let name = pool.name_any();
    match Api::<IPPool>::all(ctx.client.clone())
        .replace(&name, &PostParams::default(), &pool)
        .await
    {
        Ok(stored) => {
            ctx.pools.wrote(stored);
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Err(LbSimError::Conflict { pool: name }),
        Err(e) => Err(e.into()),
    }
}

/// What upstream's allocator says to an applicant that already holds an address of the pool.
pub const DUPLICATE_ALLOCATION: &str = "duplicate allocation is not allowed";

/// `Ok(Err(message))` is a condition to report (no pool, exhausted), not a failure to retry.
async fn allocate(
    ctx: &Ctx,
    lb: &LoadBalancer,
) -> Result<Result<AllocatedAddress, String>, LbSimError> {
    let pools = ctx.pools.all();
    let views: Vec<PoolView> = pools.iter().map(|p| view(p)).collect();
    let cluster = lb.spec.workload_type.as_deref() == Some("cluster");
    let wanted = lb.spec.ip_pool.clone().filter(|p| !p.is_empty());
    // v1.8.2 controller.go `requestIP`: a pool without an allocator (missing, or its ranges
    // unusable so the IPPool controller made none) is `fail to get allocator <pool>`; the
    // allocator's own error is wrapped as `fail to get ip from pool <pool>, error: ...`.
    let chosen = match &wanted {
        Some(name) => views
            .iter()
            .find(|v| &v.name == name)
            .ok_or_else(|| format!("fail to get allocator {name}")),
        None => ipam::select_pool(&views, &requirement(lb), cluster).map_err(|e| e.to_string()),
    };
    let chosen = match chosen {
        Ok(v) => v.name.clone(),
        Err(m) => return Ok(Err(m)),
    };
    let Some(pool) = pools.iter().find(|p| p.name_any() == chosen) else {
        return Ok(Err(format!("fail to get allocator {chosen}")));
    };
    let ranges = match ranges(pool) {
        Ok(r) if !r.is_empty() => r,
        Ok(_) => return Ok(Err(format!("fail to get allocator {chosen}"))),
        Err(m) => {
            tracing::debug!("sim lb: {m}");
            return Ok(Err(format!("fail to get allocator {chosen}")));
        }
    };
    let mut st = state(pool);
    let id = applicant(lb);
    // Upstream's allocator (host-local's) refuses an applicant that already holds an address of
    // the pool, as one does whose status write was lost after the pool's: the controller releases
    // it and returns the error, which its status write records (load-balancer-harvester v1.8.2
    // `pkg/controller/loadbalancer/controller.go` `ensureAllocatedAddressPool`,
    // `tryReleaseDuplicatedIPToPool`, `handleError`; `pkg/utils/const.go`
    // `DuplicateAllocationKeyWord`). That write changes the object (the CRD has no status
    // subresource), which wakes the controller again at once, and the address, now in the
    // history, comes back.
    if st.allocated.values().any(|holder| holder == &id) {
        // Only a status really lost is a duplicate: a cache that has not seen our own status
        // write yet (woken by the pool's watch) is not.
        let fresh = Api::<LoadBalancer>::namespaced(
            ctx.client.clone(),
            &lb.namespace().unwrap_or_default(),
        )
        .get_opt(&lb.name_any())
        .await?;
        if fresh.as_ref().is_some_and(|f| f.allocated_ip().is_some()) {
            return Err(LbSimError::Stale { lb: id });
        }
        ipam::release(&mut st, &id);
        store_state(ctx, pool, &ranges, &st).await?;
        return Ok(Err(format!(
            "fail to get ip from pool {chosen}, error: {DUPLICATE_ALLOCATION}"
        )));
    }
    match ipam::allocate(&ranges, &mut st, &id) {
        Ok(a) => {
            store_state(ctx, pool, &ranges, &st).await?;
            Ok(Ok(AllocatedAddress {
                ip_pool: Some(chosen),
                ip: a.ip.to_string(),
                mask: Some(a.mask),
                gateway: a.gateway.map(|g| g.to_string()),
            }))
        }
        Err(e) => Ok(Err(format!(
            "fail to get ip from pool {chosen}, error: {e}"
        ))),
    }
}

/// Releases `id`'s address in pool `name` (kept in its history); a pool that is gone has
/// nothing to release.
async fn release_from(ctx: &Ctx, name: &str, id: &str) -> Result<(), LbSimError> {
    let Some(pool) = ctx.pools.get(name) else {
        return Ok(());
    };
    let mut st = state(&pool);
    if ipam::release(&mut st, id).is_some() {
        let ranges = ranges(&pool).unwrap_or_default();
        store_state(ctx, &pool, &ranges, &st).await?;
    }
    Ok(())
}
