//! The service controller's writes to guest Services (the cleanup finalizer, the planned
//! address and annotations). Every write carries the provider's field manager and is recorded in
//! the write log.
//!
//! The finalizer stays two hand-written JSON patches rather than `kube::runtime::finalizer`:
//! that helper removes the finalizer as soon as cleanup returns `Ok`, and only cleans up on
//! deletion, while a primary here keeps its finalizer while secondaries still share its address
//! and releases it also when the Service stops being a LoadBalancer; and its add-patch carries
//! no resourceVersion we could record in the write log, so a reconcile from a cache that has not
//! seen the patch would send it again (a 422) instead of waiting for the watch.

use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use super::context::{Error, ServiceCtx, svc_key};
use super::plan::{self, ServiceChange};
use super::{FINALIZER, MANAGER};

/// Every write of ours carries the same field manager.
pub(super) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.into()),
        ..Default::default()
    }
}

/// Adds the cleanup finalizer to `svc`, as of the version the cache shows (a test of its
/// resourceVersion: a concurrent change fails the patch rather than being overwritten); returns
/// the Service as stored, which the reconcile goes on with (its watch event is only our echo).
pub(super) async fn add_finalizer(svc: &Service, ctx: &ServiceCtx) -> Result<Service, Error> {
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
    patch_json(svc, ctx, ops).await.map(|_| ())
}

async fn patch_json(
    svc: &Service,
    ctx: &ServiceCtx,
    ops: serde_json::Value,
) -> Result<Service, Error> {
    let patch: json_patch::Patch =
        serde_json::from_value(ops).map_err(|e| Error::Guest(kube::Error::SerdeError(e)))?;
    let _sending = ctx.written.sending(&svc_key(svc));
    let stored = ctx
        .services_in(&svc.namespace().unwrap_or_default())
        .patch(&svc.name_any(), &patch_params(), &Patch::<()>::Json(patch))
        .await
        .map_err(Error::Guest)?;
    wrote(ctx, svc, &stored);
    Ok(stored)
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
    let _sending = ctx.written.sending(&svc_key(svc));
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
