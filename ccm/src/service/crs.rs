//! The service controller's LoadBalancer CR I/O in Harvester: make or update a primary's CR,
//! mirror its address, delete the CRs a Service no longer needs, and the garbage collector that
//! deletes CRs whose Service is gone. Reads come from the CR cache except where cleanup must not
//! miss a CR the cache has not seen yet.

use std::future::Future;
use std::sync::Arc;

use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::reflector::ObjectRef;

use super::MANAGER;
use super::annotations::{Ipam, ServiceKey, ServiceLbSpec};
use super::context::{Error, ServiceCtx, cr_key};
use super::plan::{
    self, LABEL_CLUSTER, LABEL_SERVICE_NAME, LABEL_SERVICE_NAMESPACE, ServiceProblem,
};

/// The version recorded for a CR we created that the cache has not shown yet.
const NOT_SEEN: &str = "";

/// The Service a CR was made for, from its labels.
pub(super) fn service_of_cr(lb: &LoadBalancer) -> Option<ObjectRef<Service>> {
    let ns = lb.labels().get(LABEL_SERVICE_NAMESPACE)?;
    let name = lb.labels().get(LABEL_SERVICE_NAME)?;
    Some(ObjectRef::new(name).within(ns))
}

/// What [`ensure_cr`] found or did.
pub(super) struct Ensured {
    /// The CR as it stands; `None` when the watch will wake the reconcile again (just created or
    /// updated, not shown by the cache yet, or shutting down).
    pub(super) lb: Option<LoadBalancer>,
    /// The changes of the Service the CR refuses, to report.
    pub(super) problems: Vec<ServiceProblem>,
    /// This call created the CR.
    pub(super) created: bool,
}

impl Ensured {
    fn found(lb: Option<LoadBalancer>, problems: Vec<ServiceProblem>) -> Self {
        Ensured {
            lb,
            problems,
            created: false,
        }
    }
}

/// Makes or updates the CR `desired` of the primary `key`.
pub(super) async fn ensure_cr(
    ctx: &ServiceCtx,
    key: &ServiceKey,
    desired: &LoadBalancer,
) -> Result<Ensured, Error> {
    let name = desired.name_any();
    // A CR of an earlier Service with this name (another UID) must not leak.
    delete_stale_crs(ctx, key, &name).await?;
    // The CR watch has listed (the readiness gate waits for it too): its cache answers whether
    // the CR exists, no GET.
    if !ctx.caches_listed().await {
        // Shutting down.
        return Ok(Ensured::found(None, Vec::new()));
    }
    let cached = ctx
        .crs
        .get(&ObjectRef::new(&name).within(ctx.namespace()))
        .map(|lb| lb.as_ref().clone());
    let cached_rv = cached
        .as_ref()
        .map_or(Some(NOT_SEEN.to_string()), |lb| lb.resource_version());
    if ctx.written.behind(&cr_key(&name), cached_rv.as_deref()) {
        // We created or updated it and the watch has not shown that yet; it wakes us when it does.
        return Ok(Ensured::found(None, Vec::new()));
    }
    let Some(existing) = cached else {
        let _sending = ctx.written.sending(&cr_key(&name));
        return match ctx.lbs().create(&PostParams::default(), desired).await {
            Ok(made) => {
                ctx.written.wrote(
                    &cr_key(&name),
                    Some(NOT_SEEN),
                    made.resource_version().as_deref(),
                );
                // The CR watch wakes us when Harvester allocates or reports.
                Ok(Ensured {
                    lb: None,
                    problems: Vec::new(),
                    created: true,
                })
            }
            // There but not in our cache (no cluster label: not made by us): read it once.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let lb = ctx.lbs().get(&name).await.map_err(Error::Harvester)?;
                Ok(Ensured::found(Some(lb), Vec::new()))
            }
            Err(e) => Err(Error::Harvester(e)),
        };
    };
    let drift = plan::cr_drift(&existing, desired);
    let problems = plan::drift_problems(&drift);
    if drift.metadata.is_empty() {
        return Ok(Ensured::found(Some(existing), problems));
    }
    let updated = update_cr(ctx, existing, |cr| {
        plan::apply_metadata(cr, &drift.metadata)
    })
    .await?;
    Ok(Ensured::found(updated, problems))
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
    let _sending = ctx.written.sending(&cr_key(&name));
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
            ctx.written.await_next(&cr_key(&name));
            Ok(None)
        }
        Err(e) => Err(Error::Harvester(e)),
    }
}

/// `status.address` of the CR = the address the Service shows (upstream's mirror).
pub(super) async fn mirror_address(
    ctx: &ServiceCtx,
    cr: LoadBalancer,
    addr: &str,
) -> Result<(), Error> {
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

/// Deletes CR `name`; one already gone is no error.
pub(super) async fn delete_cr(ctx: &ServiceCtx, name: &str) -> Result<bool, Error> {
    match ctx.lbs().delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(Error::Harvester(e)),
    }
}

/// Deletes every cached CR of `key` (a Service that takes its address from the guest pools now).
pub(super) async fn delete_cached_crs_of(ctx: &ServiceCtx, key: &ServiceKey) -> Result<(), Error> {
    delete_stale_crs(ctx, key, "").await
}

/// Deletes the cached CRs of `key` other than `keep` (those of an earlier UID of the Service).
async fn delete_stale_crs(ctx: &ServiceCtx, key: &ServiceKey, keep: &str) -> Result<(), Error> {
    let stale: Vec<String> = ctx
        .crs_of
        .of(&ctx.crs, ctx.namespace(), key)
        .into_iter()
        .filter(|name| name != keep)
        .collect();
    for name in stale {
        if delete_cr(ctx, &name).await? {
            tracing::info!(service = %key, "deleted LoadBalancer {name} of an earlier Service")
        }
    }
    Ok(())
}

/// Deletes every CR of this cluster that belongs to `key` (asks the API server: cleanup must not
/// miss a CR the cache has not seen yet); returns the names deleted.
pub(super) async fn delete_crs_of(
    ctx: &ServiceCtx,
    key: &ServiceKey,
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
        if delete_cr(ctx, &name).await? {
            deleted.push(name);
        }
    }
    Ok(deleted)
}

/// Deletes CRs of this cluster whose Service is gone, is no LoadBalancer, shares another one's
/// address, or has another UID now; at start and on every resync, from the CR cache.
pub(super) async fn garbage_collector(ctx: Arc<ServiceCtx>, shutdown: impl Future<Output = ()>) {
    let work = async {
        if !ctx.caches_listed().await {
            return;
        }
        loop {
            if let Err(e) = collect_garbage(&ctx).await {
                tracing::warn!("LoadBalancer garbage collection: {e}");
            }
            tokio::time::sleep(ctx.resync()).await;
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
            .get(&ObjectRef::new(name).within(ctx.namespace()))
            .is_some(),
        _ => false,
    });
    ctx.ledger.retain(|key| {
        ctx.services
            .get(&ObjectRef::new(&key.name).within(&key.namespace))
            .is_some()
    });
    // The CR cache holds every CR of this cluster (its watch selects them by the cluster label):
    // no list of thousands of CRs per resync. One it has not shown yet is looked at next time.
    for cr in ctx.crs.state() {
        let Some(owner) = service_of_cr(&cr) else {
            continue;
        };
        let keep = ctx.services.get(&owner).is_some_and(|svc| {
            plan::wants_load_balancer(&svc, &ctx.settings)
                && ServiceLbSpec::with_default_ipam(&svc, ctx.settings.default_ipam)
                    .is_ok_and(|s| s.primary.is_none() && s.ipam != Ipam::Guest)
                && plan::cr_name(&svc, &ctx.settings) == cr.name_any()
        });
        if keep {
            continue;
        }
        tracing::info!(
            "deleting orphaned LoadBalancer {}/{}",
            ctx.namespace(),
            cr.name_any()
        );
        delete_cr(ctx, &cr.name_any()).await?;
    }
    Ok(())
}
