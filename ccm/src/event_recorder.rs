//! The provider's Event recorder: an `events.k8s.io/v1` Event per occurrence, and a repeat of the
//! same Event (same object, type, reason and action) within six minutes folded into the first
//! one's `series` count, as client-go's events recorder does.
//!
//! kube's `Recorder` folds the same way but keeps the whole Event of every series it has seen
//! for six minutes, with no bound: with 1 000 Services its table (about 2 KiB an entry, twice
//! that while it grows) was the provider's largest allocation, 4.4 of a 15.3 MiB heap peak
//! (heaptrack). A series here keeps only what its next patch needs (the Event's namespace,
//! name and count), and at most 4 096 of them, the size of client-go's event cache; the
//! oldest go first.
//!
//! Events are written beside the reconciles, not in their way, as client-go's broadcaster does:
//! [`EventRecorder::record`] queues the Event and returns; one task writes the queue in order (so
//! a repeat always finds its series), and drops an Event when [`QUEUE_LIMIT`] are waiting. Written
//! in the reconcile, the Event was a third sequential round trip of each Node's initialisation and
//! held its worker slot while the next Nodes waited in line.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use tokio::sync::mpsc;

/// How long a repeat still joins its series (kube's and client-go's six minutes).
const SERIES_TTL: SignedDuration = SignedDuration::from_mins(6);
/// Series remembered at most (client-go's `maxLruCacheEntries`).
const SERIES_LIMIT: usize = 4096;
/// Events waiting to be written at most; one more is dropped with a log line (client-go's
/// `maxQueuedEvents`).
pub const QUEUE_LIMIT: usize = 1000;

/// Records Events as one reporting controller (and instance); cheap to clone, clones share their
/// queue and series.
#[derive(Clone)]
pub struct EventRecorder {
    writer: Writer,
    /// The queue's sending end, made with its writing task by the first Event (a runtime is
    /// only sure to exist then); the task ends when the last clone is dropped.
    queue: Arc<OnceLock<mpsc::Sender<Queued>>>,
}

/// An Event waiting to be written.
type Queued = (Event, ObjectReference);

/// Writes Events and folds repeats into their series.
#[derive(Clone)]
struct Writer {
    client: kube::Client,
    controller: String,
    instance: String,
    series: Arc<Mutex<HashMap<String, Series>>>,
}

/// The Event a series is counted on.
#[derive(Clone, Debug, PartialEq)]
struct Series {
    namespace: String,
    name: String,
    count: i32,
    last: Timestamp,
}

/// What to write for one occurrence.
#[derive(Debug, PartialEq)]
enum Write {
    Create,
    /// Count the occurrence on this existing Event.
    Repeat(Series),
}

impl EventRecorder {
    /// `instance` is the reporting instance (the Pod's name); the controller's name without one.
    pub fn new(client: kube::Client, controller: &str, instance: Option<String>) -> Self {
        EventRecorder {
            writer: Writer {
                client,
                controller: controller.to_string(),
                instance: instance.unwrap_or_else(|| controller.to_string()),
                series: Arc::default(),
            },
            queue: Arc::default(),
        }
    }

    /// Queues `event` about `regarding` and returns; it is written in order after the Events
    /// queued before it (a failure is logged there). Dropped, with a log line, when the queue is
    /// full. Needs a Tokio runtime.
    pub fn record(&self, event: Event, regarding: ObjectReference) {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(QUEUE_LIMIT);
            tokio::spawn(self.writer.clone().write_queue(rx));
            tx
        });
        let (why, (event, regarding)) = match queue.try_send((event, regarding)) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Full(q)) => ("the queue is full", q),
            // Only when the runtime that ran the writing task has shut down.
            Err(mpsc::error::TrySendError::Closed(q)) => ("its writer has stopped", q),
        };
        let object = regarding.name.as_deref().unwrap_or_default();
        tracing::warn!(object, reason = event.reason, "dropped an Event: {why}");
    }
}

impl Writer {
    /// Writes the queued Events one after another until every sender is gone.
    async fn write_queue(self, mut rx: mpsc::Receiver<Queued>) {
        while let Some((event, regarding)) = rx.recv().await {
            if let Err(e) = self.publish(&event, &regarding).await {
                let name = regarding.name.as_deref().unwrap_or_default();
                tracing::warn!(object = name, reason = event.reason, error = %e, "could not publish an Event");
            }
        }
    }

    /// Writes `event` about `regarding`: a new Event, or one more in its series.
    async fn publish(&self, event: &Event, regarding: &ObjectReference) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = series_key(event, regarding);
        let write = {
            let mut series = self.lock();
            series.retain(|_, s| s.last + SERIES_TTL > now);
            plan(series.get(&key), now)
        };
        let written = match write {
            Write::Repeat(s) => match self.count(&s).await {
                // The Event is gone (expired or deleted): the occurrence starts a new series.
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    self.create(event, regarding, now).await
                }
                other => other.map(|()| s),
            },
            Write::Create => self.create(event, regarding, now).await,
        }?;
        remember(&mut self.lock(), key, written);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Series>> {
        self.series.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates the first Event of a series.
    async fn create(
        &self,
        event: &Event,
        regarding: &ObjectReference,
        now: Timestamp,
    ) -> Result<Series, kube::Error> {
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let object = regarding.name.as_deref().unwrap_or(&self.controller);
        let name = format!("{object}.{:x}", now.as_nanosecond());
        let k8s_event = K8sEvent {
            metadata: ObjectMeta {
                namespace: Some(namespace.to_string()),
                name: Some(name.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some(type_name(event.type_).to_string()),
            reason: Some(event.reason.clone()),
            action: Some(event.action.clone()),
            note: event.note.clone(),
            regarding: Some(regarding.clone()),
            related: event.secondary.clone(),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..K8sEvent::default()
        };
        Api::<K8sEvent>::namespaced(self.client.clone(), namespace)
            .create(&PostParams::default(), &k8s_event)
            .await?;
        Ok(Series {
            namespace: namespace.to_string(),
            name,
            count: 1,
            last: now,
        })
    }

    /// Counts one more occurrence on the series' Event (`s` holds the new count and time).
    async fn count(&self, s: &Series) -> Result<(), kube::Error> {
        let series = serde_json::json!({
            "series": {"count": s.count, "lastObservedTime": MicroTime(s.last)}
        });
        Api::<K8sEvent>::namespaced(self.client.clone(), &s.namespace)
            .patch(&s.name, &PatchParams::default(), &Patch::Merge(&series))
            .await
            .map(drop)
    }
}

/// What identifies a series: the object (by UID too: a recreated object starts anew), the
/// Event's type, reason and action, and the related object.
fn series_key(event: &Event, regarding: &ObjectReference) -> String {
    let object = |r: &ObjectReference| {
        format!(
            "{}/{}/{}/{}/{}",
            r.api_version.as_deref().unwrap_or_default(),
            r.kind.as_deref().unwrap_or_default(),
            r.namespace.as_deref().unwrap_or_default(),
            r.name.as_deref().unwrap_or_default(),
            r.uid.as_deref().unwrap_or_default()
        )
    };
    format!(
        "{}|{}|{}|{}|{}",
        object(regarding),
        type_name(event.type_),
        event.reason,
        event.action,
        event.secondary.as_ref().map(object).unwrap_or_default()
    )
}

/// A repeat within the TTL of a series still remembered is counted on its Event; anything else
/// creates one.
fn plan(series: Option<&Series>, now: Timestamp) -> Write {
    match series {
        Some(s) if s.last + SERIES_TTL > now => Write::Repeat(Series {
            count: s.count + 1,
            last: now,
            ..s.clone()
        }),
        _ => Write::Create,
    }
}

/// Keeps `written` as its key's series, forgetting the least recently seen beyond the limit.
fn remember(series: &mut HashMap<String, Series>, key: String, written: Series) {
    series.insert(key, written);
    if series.len() > SERIES_LIMIT {
        let oldest = series
            .iter()
            .min_by_key(|(_, s)| s.last)
            .map(|(k, _)| k.clone());
        if let Some(oldest) = oldest {
            series.remove(&oldest);
        }
    }
}

fn type_name(type_: EventType) -> &'static str {
    match type_ {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, count: i32, last: Timestamp) -> Series {
        Series {
            namespace: "default".into(),
            name: name.into(),
            count,
            last,
        }
    }

    #[test]
    fn a_repeat_within_the_ttl_counts_on_the_first_event_and_a_late_one_starts_anew() {
        let t0 = Timestamp::from_second(1_000_000).unwrap();
        assert_eq!(plan(None, t0), Write::Create);
        let first = series("svc.1", 1, t0);
        let soon = t0 + SignedDuration::from_mins(5);
        assert_eq!(
            plan(Some(&first), soon),
            Write::Repeat(series("svc.1", 2, soon))
        );
        let late = t0 + SERIES_TTL;
        assert_eq!(plan(Some(&first), late), Write::Create);
    }

    #[test]
    fn at_most_the_limit_of_series_is_kept_and_the_oldest_goes_first() {
        let t0 = Timestamp::from_second(1_000_000).unwrap();
        let mut kept = HashMap::new();
        for i in 0..=SERIES_LIMIT as i64 {
            let at = t0 + SignedDuration::from_secs(i);
            remember(&mut kept, format!("k{i}"), series(&format!("e{i}"), 1, at));
        }
        assert_eq!(kept.len(), SERIES_LIMIT);
        assert!(!kept.contains_key("k0"), "the oldest series is forgotten");
        assert!(kept.contains_key(&format!("k{SERIES_LIMIT}")));
    }

    #[test]
    fn the_key_tells_objects_reasons_actions_and_a_recreated_object_apart() {
        let svc = |uid: &str| ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some("default".into()),
            name: Some("web".into()),
            uid: Some(uid.into()),
            ..ObjectReference::default()
        };
        let event = |reason: &str, action: &str| Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some("note".into()),
            action: action.into(),
            secondary: None,
        };
        let base = series_key(&event("Ensured", "A"), &svc("u1"));
        assert_eq!(base, series_key(&event("Ensured", "A"), &svc("u1")));
        assert_ne!(base, series_key(&event("Ensured", "A"), &svc("u2")));
        assert_ne!(base, series_key(&event("Other", "A"), &svc("u1")));
        assert_ne!(base, series_key(&event("Ensured", "B"), &svc("u1")));
    }
}
