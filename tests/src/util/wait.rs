//! Waiting for a condition with a bound; on timeout the error shows what was seen last.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// The least time a probe is given, even when the wait's deadline is nearer.
const PROBE_AT_LEAST: Duration = Duration::from_secs(1);

/// Polls `probe` every 100 ms until it returns `Ok(Ok(v))`, for at most `limit`.
/// `probe` returns `Ok(Err(seen))` to keep waiting; the last `Err` or seen value is reported on
/// timeout. A probe that does not return (a request no one answers) is cut at the deadline too,
/// so the wait fails instead of hanging its test.
pub async fn until<T, S, F, Fut>(what: &str, limit: Duration, mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Result<T, S>, String>>,
    S: Debug,
{
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let last = match tokio::time::timeout(left.max(PROBE_AT_LEAST), probe()).await {
            Ok(Ok(Ok(v))) => return Ok(v),
            Ok(Ok(Err(seen))) => format!("{seen:?}"),
            Ok(Err(e)) => format!("error: {e}"),
            Err(_) => format!(
                "the probe did not return within {:?}",
                left.max(PROBE_AT_LEAST)
            ),
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "timed out after {limit:?} waiting for {what}; last seen: {last}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs `work` for at most `limit`; past it, panics naming `what`. Dropping `work` then runs the
/// drops of what it holds (test beds, guests), so a test that would hang fails and cleans up.
pub async fn within<T>(what: &str, limit: Duration, work: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, work).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

/// The holder of Lease `name` in `api`'s namespace; `None` while it is absent or free.
pub async fn lease_holder(
    api: &kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    name: &str,
) -> Option<String> {
    api.get_opt(name)
        .await
        .ok()
        .flatten()?
        .spec?
        .holder_identity
}

/// Waits until `identity` holds Lease `name`, for at most `limit`.
pub async fn lease_held_by(
    api: &kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    name: &str,
    identity: &str,
    limit: Duration,
) -> Result<(), String> {
    until(&format!("{identity} holds Lease {name}"), limit, || async {
        let h = lease_holder(api, name).await;
        Ok(if h.as_deref() == Some(identity) {
            Ok(())
        } else {
            Err(h)
        })
    })
    .await
}

/// Waits (30 s) until guest Node `name` has a providerID, i.e. a cloud provider initialised it;
/// on timeout the error shows the Node's annotations and spec as last seen.
pub async fn node_initialised(
    guest: &kube::Client,
    name: &str,
) -> Result<k8s_openapi::api::core::v1::Node, String> {
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(guest.clone());
    until(
        &format!("Node {name} initialised"),
        Duration::from_secs(30),
        || {
            let nodes = nodes.clone();
            async move {
                let n = nodes.get(name).await.map_err(|e| e.to_string())?;
                Ok(
                    if n.spec
                        .as_ref()
                        .and_then(|s| s.provider_id.as_ref())
                        .is_some()
                    {
                        Ok(n)
                    } else {
                        Err((n.metadata.annotations, n.spec))
                    },
                )
            }
        },
    )
    .await
}
