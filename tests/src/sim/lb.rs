//! The Harvester LB controller's part for `workloadType: cluster` LoadBalancers: IP allocation
//! from IPPools (with [`super::ipam`]), `0.0.0.0` for DHCP, the Ready condition, and the
//! release of the address when the LoadBalancer goes. Woken by the LoadBalancer watch only, as
//! upstream's controller (no IPPool handler enqueues LoadBalancers): one that no pool matches is
//! tried again after 1 s, one its pool cannot serve (exhausted, no allocator) after the
//! workqueue's growing backoff ([`retry_after`]).
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
use kube::runtime::reflector::{self, Store};
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
    /// Failures in a row of each LoadBalancer (`namespace/name`) whose pool could not serve
    /// it: the rate limiter's count, forgotten on success.
    failures: Mutex<HashMap<String, u32>>,
}

impl Ctx {
    /// The rate limiter's next delay for `id`, counting this failure.
    fn failed(&self, id: &str) -> Duration {
        let mut all = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let n = all.entry(id.to_string()).or_default();
        let delay = retry_after(*n);
        *n += 1;
        delay
    }

    fn forget(&self, id: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
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
    // The pools' cache, filled by its own watch; a pool event wakes no LoadBalancer.
    let pool_cache = watcher::watcher(Api::<IPPool>::all(client.clone()), Default::default())
        .default_backoff()
        .reflect(writer)
        .for_each(|_| async {});
    let controller = Controller::new(lbs, watcher::Config::default())
        .with_config(CtrlConfig::default().concurrency(1));
    let pools = Pools {
        cache,
        written: Mutex::default(),
    };
    let ctx = Arc::new(Ctx {
        client,
        pools,
        failures: Mutex::default(),
    });
    let controller = controller
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {});
    tokio::join!(pool_cache, controller);
}

fn error_policy(_lb: Arc<LoadBalancer>, err: &LbSimError, _ctx: Arc<Ctx>) -> Action {
    tracing::debug!("sim lb: {err}");
    Action::requeue(Duration::from_millis(200))
}

/// When a LoadBalancer whose pool could not serve it is tried again after its `failures`-th
/// failure in a row: lasso's default rate limiter for wrangler controllers, the larger of
/// `ItemFastSlowRateLimiter(1 ms, 2 min, 30)` and `ItemExponentialFailureRateLimiter(5 ms, 30 s)`
/// (rancher/lasso `pkg/controller/controller.go`, vendored in load-balancer-harvester v1.8.2):
/// 5 ms doubling up to 30 s, and 2 minutes from the 31st failure on.
pub fn retry_after(failures: u32) -> Duration {
    let fast_slow = if failures < 30 {
        Duration::from_millis(1)
    } else {
        Duration::from_secs(120)
    };
    let exponential = Duration::from_millis(5)
        .saturating_mul(2u32.saturating_pow(failures.min(31)))
        .min(Duration::from_secs(30));
    fast_slow.max(exponential)
}

/// Why a LoadBalancer has no address yet, as upstream's `handleError` tells the cases apart
/// (load-balancer-harvester v1.8.2 `pkg/controller/loadbalancer/controller.go`).
enum Waiting {
    /// `errNoMatchedIPPool`: `EnqueueAfter` 1 s, the error not returned (the rate limiter
    /// forgets the LoadBalancer).
    NoPool(String),
    /// Any other error (`fail to get allocator`, `fail to get ip from pool`): returned to the
    /// framework, which retries through its rate limiter.
    Failed(String),
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
        ctx.forget(&applicant(&lb));
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
    let id = applicant(&lb);
    match allocate(&ctx, &lb).await? {
        Ok(addr) => {
            ctx.forget(&id);
            set_status(&api, &lb, Some(addr), ready(true, None)).await?;
            Ok(Action::await_change())
        }
        Err(Waiting::NoPool(message)) => {
            ctx.forget(&id);
            set_status(&api, &lb, None, ready(false, Some(message))).await?;
            Ok(Action::requeue(Duration::from_secs(1)))
        }
        Err(Waiting::Failed(message)) => {
            set_status(&api, &lb, None, ready(false, Some(message))).await?;
            Ok(Action::requeue(ctx.failed(&id)))
        }
    }
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

/// `Ok(Err(waiting))` is a condition to report (no pool, exhausted), not a failure of the
/// stand-in.
async fn allocate(
    ctx: &Ctx,
    lb: &LoadBalancer,
) -> Result<Result<AllocatedAddress, Waiting>, LbSimError> {
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
            .ok_or_else(|| Waiting::Failed(format!("fail to get allocator {name}"))),
        None => ipam::select_pool(&views, &requirement(lb), cluster)
            .map_err(|e| Waiting::NoPool(e.to_string())),
    };
    let chosen = match chosen {
        Ok(v) => v.name.clone(),
        Err(w) => return Ok(Err(w)),
    };
    let no_allocator = || {
        Ok(Err(Waiting::Failed(format!(
            "fail to get allocator {chosen}"
        ))))
    };
    let Some(pool) = pools.iter().find(|p| p.name_any() == chosen) else {
        return no_allocator();
    };
    let ranges = match ranges(pool) {
        Ok(r) if !r.is_empty() => r,
        Ok(_) => return no_allocator(),
        Err(m) => {
            tracing::debug!("sim lb: {m}");
            return no_allocator();
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
        return Ok(Err(Waiting::Failed(format!(
            "fail to get ip from pool {chosen}, error: {DUPLICATE_ALLOCATION}"
        ))));
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
        Err(e) => Ok(Err(Waiting::Failed(format!(
            "fail to get ip from pool {chosen}, error: {e}"
        )))),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_follow_lassos_rate_limiter() {
        let ms = |n| retry_after(n).as_millis();
        assert_eq!((ms(0), ms(1), ms(2), ms(10)), (5, 10, 20, 5120));
        assert_eq!(ms(12), 20_480);
        assert_eq!((ms(13), ms(29)), (30_000, 30_000));
        assert_eq!((ms(30), ms(1000)), (120_000, 120_000));
    }
}
