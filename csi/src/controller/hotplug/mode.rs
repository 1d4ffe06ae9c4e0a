//! Which way volumes are hot-plugged, from Harvester's `server-version` setting: read at start and
//! followed on change (an upgrade to Harvester v1.8 switches to declarative hot-plug without a
//! restart). Until the setting has been read, publish and unpublish answer UNAVAILABLE and the
//! `hotplug` readiness check fails with the reason: never a silent default.
//!
//! Every authenticated Harvester user may `get` and `watch` this one setting (harvester/harvester
//! `pkg/data/rbac.go`, ClusterRole `harvester-authenticated`), but not `list` it: so this is a GET
//! followed by a watch from its resourceVersion, not a list-watch.

use std::time::Duration;

use futures::StreamExt;
use harvester_common::harvester::settings::{HotplugMode, SERVER_VERSION, Setting};
use harvester_common::telemetry::Readiness;
use kube::api::{Api, WatchEvent, WatchParams};
use tokio::sync::watch;

use crate::error::ControllerError;

/// The readiness check reporting whether the hot-plug mode is known.
pub const READY_HOTPLUG: &str = "hotplug";

/// Retry period after a failed GET of the setting.
const RETRY: Duration = Duration::from_secs(5);

/// The latest known hot-plug mode, or why it is not known.
#[derive(Clone)]
pub struct HotplugModes {
    rx: watch::Receiver<Result<HotplugMode, String>>,
}

impl HotplugModes {
    /// Follows setting `server-version` through `client` until the returned task is aborted.
    pub fn follow(
        client: kube::Client,
        readiness: Readiness,
    ) -> (HotplugModes, tokio::task::JoinHandle<()>) {
        let not_yet = "Harvester setting server-version not read yet".to_string();
        readiness.set(READY_HOTPLUG, Err(not_yet.clone()));
        let (tx, rx) = watch::channel(Err(not_yet));
        let task = tokio::spawn(follow(Api::all(client), tx, readiness));
        (HotplugModes { rx }, task)
    }

    /// Waits (at most `limit`) for the follower's first answer, success or not, so a driver
    /// does not serve its first calls while the setting is still being read.
    pub async fn first_read(&mut self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.rx.changed()).await;
    }

    /// The current mode; UNAVAILABLE (with the reason) while it is unknown.
    pub fn current(&self) -> Result<HotplugMode, ControllerError> {
        self.rx.borrow().clone().map_err(|reason| {
            ControllerError::NotReady(format!(
                "the hot-plug mode is unknown ({reason}); volumes cannot be attached or detached until it is"
            ))
        })
    }
}

fn publish(
    tx: &watch::Sender<Result<HotplugMode, String>>,
    readiness: &Readiness,
    state: Result<(&Setting, HotplugMode), String>,
) {
    match state {
        Ok((setting, mode)) => {
            let changed = tx.borrow().as_ref().ok() != Some(&mode);
            if changed {
                tracing::info!(
                    server_version = setting.effective_value(),
                    %mode,
                    "hot-plug mode from Harvester setting {SERVER_VERSION}"
                );
            }
            readiness.set(READY_HOTPLUG, Ok(()));
            let _previous = tx.send_replace(Ok(mode));
        }
        Err(reason) => {
            tracing::warn!("hot-plug mode unknown: {reason}");
            readiness.set(READY_HOTPLUG, Err(reason.clone()));
            let _previous = tx.send_replace(Err(reason));
        }
    }
}

fn mode_of(setting: &Setting) -> HotplugMode {
    HotplugMode::for_server_version(setting.effective_value())
}

async fn follow(
    api: Api<Setting>,
    tx: watch::Sender<Result<HotplugMode, String>>,
    readiness: Readiness,
) {
    loop {
        let setting = match api.get_opt(SERVER_VERSION).await {
            Ok(Some(s)) => s,
            Ok(None) => {
                publish(
                    &tx,
                    &readiness,
                    Err(format!(
                        "Harvester setting {SERVER_VERSION} (settings.harvesterhci.io) does not exist"
                    )),
                );
                tokio::time::sleep(RETRY).await;
                continue;
            }
            Err(e) => {
                let reason = format!(
                    "reading Harvester setting {SERVER_VERSION}: {}",
                    harvester_common::api_error::Describe(&e)
                );
                // Harvester answered no (forbidden, ...): the mode is unknown. Harvester out of
                // reach: a mode read before still holds (reachability is the `harvester`
                // check's to report; hot-plug then fails on its own with that error).
                if matches!(e, kube::Error::Api(_)) || tx.borrow().is_err() {
                    publish(&tx, &readiness, Err(reason));
                } else {
                    tracing::debug!("{reason}; keeping the last hot-plug mode");
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        publish(&tx, &readiness, Ok((&setting, mode_of(&setting))));
        let rv = setting
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        let params = WatchParams::default()
            .fields(&format!("metadata.name={SERVER_VERSION}"))
            .timeout(290);
        let stream = match api.watch(&params, &rv).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("watching setting {SERVER_VERSION}: {e}; reading it again");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(s) | WatchEvent::Modified(s)) => {
                    publish(&tx, &readiness, Ok((&s, mode_of(&s))))
                }
                Ok(WatchEvent::Deleted(_)) => publish(
                    &tx,
                    &readiness,
                    Err(format!("Harvester setting {SERVER_VERSION} was deleted")),
                ),
                Ok(WatchEvent::Bookmark(_)) => {}
                // Expired resourceVersion (410) or another watch error: read it again.
                Ok(WatchEvent::Error(e)) => {
                    tracing::debug!("watch of setting {SERVER_VERSION}: {}", e.message);
                    break;
                }
                Err(e) => {
                    tracing::debug!("watch of setting {SERVER_VERSION}: {e}");
                    break;
                }
            }
        }
    }
}
