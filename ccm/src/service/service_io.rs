//! The service controller's writes to guest Services (the cleanup finalizer, the planned
//! address and annotations) and its one read of the NAD mapping ConfigMap. Every write carries
//! the provider's field manager and is recorded in the write log.
//!
//! The finalizer stays two hand-written JSON patches rather than `kube::runtime::finalizer`:
//! that helper removes the finalizer as soon as cleanup returns `Ok`, and only cleans up on
//! deletion, while a primary here keeps its finalizer while secondaries still share its address
//! and releases it also when the Service stops being a LoadBalancer; and its add-patch carries
//! no resourceVersion we could record in the write log, so a reconcile from a cache that has not
//! seen the patch would send it again (a 422) instead of waiting for the watch.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::context::{Error, ServiceCtx, svc_key};
use super::plan::{self, ServiceChange};
use super::{FINALIZER, MANAGER, NAD_MAPPING_KEY, NAD_MAPPING_NAME, NAD_MAPPING_NAMESPACE};

/// Every write of ours carries the same field manager.
pub(super) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    }
}

/// Adds the cleanup finalizer to `svc`, as of the version the cache shows (a test of its
/// resourceVersion: a concurrent change fails the patch rather than being overwritten).
pub(super) async fn add_finalizer(svc: &Service, ctx: &ServiceCtx) -> Result<(), Error> {
    let ops = if svc.finalizers().is_empty() {
        json!([{"op": "test", "path": "/metadata/resourceVersion", "value": svc.resource_version()},
               {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}])
    } else {
        json!([{"op": "test", "path": "/metadata/resourceVersion", "value": svc.resource_version()},
               {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}])
    };
    patch_json(svc, ctx, ops).await
}

/// Removes the cleanup finalizer from `svc` (a test that it is still where the cache saw it).
pub(super) async fn remove_finalizer(svc: &Service, ctx: &ServiceCtx) -> Result<(), Error> {
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
    wrote(ctx, svc, &stored);
    Ok(())
}

/// Records our write of `svc` (as the cache showed it) that the API server stored as `stored`.
fn wrote(ctx: &ServiceCtx, svc: &Service, stored: &Service) {
    ctx.written.wrote(
        &svc_key(svc),
        svc.resource_version().as_deref(),
        stored.resource_version().as_deref(),
    );
}

/// Applies a planned change to the guest Service in one request: a JSON merge patch of exactly
/// the annotations, labels and ingress we own. With an ingress change it goes to the `status`
/// subresource, which keeps metadata changes (the API server's Service status strategy resets
/// only `spec`), so the address and kube-vip's annotations land together.
pub(super) async fn apply_change(
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
    wrote(ctx, svc, &stored);
    Ok(())
}

/// kube-vip's interface for `network`, from the NAD mapping ConfigMap when it exists.
///
/// Read per call, not cached: the chart's Role grants only `get` on this one ConfigMap, and a
/// watch would need `list` and `watch` too.
pub(super) async fn interface_for(
    ctx: &ServiceCtx,
    network: Option<&str>,
) -> Result<Option<String>, Error> {
    let Some(network) = network else {
        return Ok(None);
    };
    let cms: Api<ConfigMap> = Api::namespaced(ctx.ctx.guest.clone(), NAD_MAPPING_NAMESPACE);
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
