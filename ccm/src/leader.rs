//! Leader election with a `coordination.k8s.io/v1` Lease, in the manner of client-go's
//! leaderelection: a candidate takes a Lease that nobody renewed for `lease_duration` (measured on
//! its own clock from when it last saw the record change, so clock skew does not matter), the
//! leader renews every `retry_period`, and stops its work as soon as it has not renewed for
//! `renew_deadline` (< `lease_duration`), i.e. before anyone else may take over.
//!
//! Not `kube-lease-manager`: it judges expiry by the holder's `renewTime` on the local wall clock,
//! writes with patches instead of a resourceVersion compare-and-swap, and releases by clearing the
//! fields; upstream's Go replicas share this Lease and follow client-go's rules, kept here.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub lease_name: String,
    /// This replica's identity (pod name).
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl LeaderConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period.
    pub fn new(namespace: &str, lease_name: &str, identity: &str) -> LeaderConfig {
        LeaderConfig {
            namespace: namespace.into(),
            lease_name: lease_name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("lost the lease {namespace}/{name}: not renewed for {deadline:?}")]
    Lost {
        namespace: String,
        name: String,
        deadline: Duration,
    },
}

/// What a candidate knows of the Lease: the last record it saw and when (its own clock).
struct Observed {
    resource_version: Option<String>,
    at: Instant,
}

/// Runs `work` only while this process holds the lease. `work` gets a receiver that turns `true`
/// when it must stop. Returns `Ok` after `shutdown` (the lease is released), or `Err(Lost)` when
/// leadership was lost: the caller should exit, as client-go-based components do.
pub async fn run_as_leader<W, Fut>(
    client: kube::Client,
    cfg: LeaderConfig,
    shutdown: impl Future<Output = ()>,
    work: W,
) -> Result<(), LeaderError>
where
    W: FnOnce(watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()>,
{
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    tokio::pin!(shutdown);
    let mut observed: Option<Observed> = None;
    // Candidate: try until we hold the lease.
    loop {
        if try_acquire_or_renew(&api, &cfg, &mut observed).await {
            break;
        }
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            () = tokio::time::sleep(cfg.retry_period) => {}
        }
    }
    tracing::info!(lease = %cfg.lease_name, identity = %cfg.identity, "became leader");
    let (stop_tx, stop_rx) = watch::channel(false);
    let work = work(stop_rx);
    tokio::pin!(work);
    let mut last_renew = Instant::now();
    let mut ticker = tokio::time::interval(cfg.retry_period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let outcome = loop {
        tokio::select! {
            () = &mut work => break Ok(()),
            () = &mut shutdown => break Ok(()),
            _ = ticker.tick() => {
                if try_acquire_or_renew(&api, &cfg, &mut observed).await {
                    last_renew = Instant::now();
                } else if last_renew.elapsed() >= cfg.renew_deadline {
                    break Err(LeaderError::Lost {
                        namespace: cfg.namespace.clone(),
                        name: cfg.lease_name.clone(),
                        deadline: cfg.renew_deadline,
                    });
                }
            }
        }
    };
    // Stop the work before anything else: on loss, another replica may start after
    // lease_duration - renew_deadline from now.
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(cfg.renew_deadline / 2, &mut work).await;
    if outcome.is_ok() {
        release(&api, &cfg).await;
    } else {
        tracing::error!(lease = %cfg.lease_name, "leadership lost; stopping");
    }
    outcome
}

fn now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

/// One election round: take a free or expired lease, or renew our own. `true` when we hold it.
async fn try_acquire_or_renew(
    api: &Api<Lease>,
    cfg: &LeaderConfig,
    observed: &mut Option<Observed>,
) -> bool {
    let duration_secs = i32::try_from(cfg.lease_duration.as_secs()).unwrap_or(i32::MAX);
    let current = match api.get_opt(&cfg.lease_name).await {
        Ok(l) => l,
        Err(e) => {
            tracing::debug!("reading lease {}: {e}", cfg.lease_name);
            return false;
        }
    };
    let Some(mut lease) = current else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.lease_name.clone()),
                namespace: Some(cfg.namespace.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(duration_secs),
                acquire_time: Some(now()),
                renew_time: Some(now()),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return api.create(&PostParams::default(), &lease).await.is_ok();
    };
    let rv = lease.metadata.resource_version.clone();
    if observed.as_ref().map(|o| &o.resource_version) != Some(&rv) {
        *observed = Some(Observed {
            resource_version: rv,
            at: Instant::now(),
        });
    }
    let spec = lease.spec.get_or_insert_with(Default::default);
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let ours = holder == cfg.identity;
    let held_for = spec
        .lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(cfg.lease_duration, Duration::from_secs);
    let expired = observed
        .as_ref()
        .is_some_and(|o| o.at.elapsed() >= held_for);
    if !ours && !holder.is_empty() && !expired {
        return false;
    }
    if !ours {
        spec.acquire_time = Some(now());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        spec.holder_identity = Some(cfg.identity.clone());
    }
    spec.renew_time = Some(now());
    spec.lease_duration_seconds = Some(duration_secs);
    // The resourceVersion makes this a compare-and-swap: two candidates cannot both win.
    match api
        .replace(&cfg.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(updated) => {
            *observed = Some(Observed {
                resource_version: updated.metadata.resource_version,
                at: Instant::now(),
            });
            true
        }
        Err(e) => {
            tracing::debug!("updating lease {}: {e}", cfg.lease_name);
            false
        }
    }
}

/// Gives the lease up so a successor need not wait for it to expire.
async fn release(api: &Api<Lease>, cfg: &LeaderConfig) {
    let Ok(Some(mut lease)) = api.get_opt(&cfg.lease_name).await else {
        return;
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return;
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(now());
    if let Err(e) = api
        .replace(&cfg.lease_name, &PostParams::default(), &lease)
        .await
    {
        tracing::warn!("releasing lease {}: {e}", cfg.lease_name);
    }
}
