//! The Kubernetes toolbox every controller module uses: get-or-create (the idempotence of the
//! Create RPCs), bounded waits on a watch, delete-if-exists. Generic over the resource; no
//! CSI or Harvester rule lives here.

use std::future::Future;
use std::time::Duration;

use harvester_common::api_error::{is_conflict, is_not_found};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::wait::{Condition, await_condition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::ControllerError;

/// Watches `name` until `cond` holds, for at most `limit`; `what` names the wait in the error.
pub async fn wait_for<K>(
    api: Api<K>,
    name: &str,
    what: String,
    limit: Duration,
    cond: impl Condition<K>,
) -> Result<Option<K>, ControllerError>
where
    K: kube::Resource + Clone + std::fmt::Debug + Send + DeserializeOwned + 'static,
{
    match tokio::time::timeout(limit, await_condition(api, name, cond)).await {
        Ok(Ok(obj)) => Ok(obj),
        Ok(Err(e)) => Err(ControllerError::Precondition(format!(
            "watching {what}: {e}"
        ))),
        Err(_) => Err(ControllerError::Timeout { what, after: limit }),
    }
}

/// What [`get_or_create`] does with an object it finds still being deleted.
pub enum Deleting {
    /// Judge it like any other (`matches`).
    Judge,
    /// Wait (watch, `limit` at most) until it is gone, then create anew; `what` names the wait.
    WaitGone { what: String, limit: Duration },
}

/// The object `name` of `api`, which must pass `matches`, else `new` created (and logged); one
/// created concurrently by another call is judged like an existing one. The Create RPCs retry
/// with the same name, so this is what makes them idempotent. Returns the object and, when it
/// was found rather than created by this call, what `matches` said of it.
pub async fn get_or_create<K, R>(
    api: &Api<K>,
    name: &str,
    deleting: Deleting,
    matches: impl Fn(&K) -> Result<R, ControllerError>,
    new: impl Future<Output = Result<K, ControllerError>>,
) -> Result<(K, Option<R>), ControllerError>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + Send
        + Serialize
        + DeserializeOwned
        + 'static,
{
    let kind = K::kind(&());
    let get = || async {
        api.get_opt(name)
            .await
            .map_err(ControllerError::api(format!("getting {kind} {name}")))
    };
    let mut found = get().await?;
    if let (Some(obj), Deleting::WaitGone { what, limit }) = (&found, deleting)
        && obj.meta().deletion_timestamp.is_some()
    {
        // One of that name is still being deleted: wait until it is gone, then create.
        wait_for(api.clone(), name, what, limit, |o: Option<&K>| o.is_none()).await?;
        found = None;
    }
    if let Some(existing) = found {
        let judged = matches(&existing)?;
        return Ok((existing, Some(judged)));
    }
    match api.create(&PostParams::default(), &new.await?).await {
        Ok(created) => {
            tracing::info!(%kind, name, "created on Harvester");
            Ok((created, None))
        }
        Err(e) if is_conflict(&e) => {
            let existing = get().await?.ok_or_else(|| {
                ControllerError::Precondition(format!(
                    "{kind} {name} was created and deleted concurrently"
                ))
            })?;
            let judged = matches(&existing)?;
            Ok((existing, Some(judged)))
        }
        Err(e) => Err(ControllerError::api(format!("creating {kind} {name}"))(e)),
    }
}

/// Deletes `name` of `api`; `Ok(false)` when it was not there (already deleted). `what`
/// names the object in the error.
pub async fn delete_if_exists<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
) -> Result<bool, ControllerError>
where
    K: kube::Resource + Clone + std::fmt::Debug + DeserializeOwned,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(true),
        Err(e) if is_not_found(&e) => Ok(false),
        Err(e) => Err(ControllerError::api(format!("deleting {what}"))(e)),
    }
}
