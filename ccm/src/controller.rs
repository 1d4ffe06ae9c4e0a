//! The harness every controller of the provider uses, node-side and service alike:
//! - [`Backoff`]: the per-object exponential requeue after a failed reconcile;
//! - [`publish_event`]: the one way an Event is written (one [`recorder`], notes cut to the
//!   Events API's limit), with [`digest_action`] for controllers whose notes change;
//! - [`measured`]: a reconcile counted and timed in the reconcile metrics;
//! - [`Triggers::resync`]: the periodic resync, a thousand objects a second;
//! - [`Triggers`]: what woke each reconcile, counted by trigger.
//!
//! A new controller is a module with a `run(Arc<Context>, Shutdown)` that builds a kube-runtime
//! `Controller` on these, like `node::init` or `service`.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use harvester_common::telemetry::Metrics;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio_stream::wrappers::IntervalStream;

use crate::context::FIELD_MANAGER;
use crate::event_recorder::EventRecorder;

/// The Events API refuses a note longer than this (bytes).
const NOTE_LIMIT: usize = 1000;

/// Per-object count of consecutive failures, and the delay they earn: `first`, doubling per
/// failure, at most `max`.
pub struct Backoff<K> {
    first: Duration,
    max: Duration,
    failures: Mutex<HashMap<K, u32>>,
}

impl<K: Hash + Eq> Backoff<K> {
    pub fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            first,
            max,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Counts a failure of `key` and returns the delay before its retry.
    pub fn failed(&self, key: K) -> Duration {
        // Nothing panics while holding the lock; a poisoned map is still a valid count.
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let n = failures.entry(key).or_insert(0);
        *n = n.saturating_add(1);
        backoff_delay(self.first, self.max, *n)
    }

    /// Forgets the failures of `key` after a success.
    pub fn succeeded(&self, key: &K) {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

/// The delay after `failures` consecutive failures: `first`, doubling, capped at `max`.
pub fn backoff_delay(first: Duration, max: Duration, failures: u32) -> Duration {
    let exp = failures.saturating_sub(1).min(16);
    first.saturating_mul(1u32 << exp).min(max)
}

/// The provider's one Event recorder (reporting controller [`FIELD_MANAGER`], instance `POD_NAME`).
pub fn recorder(guest: kube::Client) -> EventRecorder {
    EventRecorder::new(guest, FIELD_MANAGER, std::env::var("POD_NAME").ok())
}

/// Publishes an Event on `object` beside the caller ([`EventRecorder::record`]: queued, written
/// in order by one task; a failure to write it is only logged).
pub fn publish_event(
    recorder: &EventRecorder,
    object: ObjectReference,
    type_: EventType,
    reason: &str,
    action: String,
    mut note: String,
) {
    if note.len() > NOTE_LIMIT {
        let mut cut = NOTE_LIMIT;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    let event = Event {
        type_,
        reason: reason.to_string(),
        note: Some(note),
        action,
        secondary: None,
    };
    recorder.record(event, object);
}

/// An Event action that changes with the note: the recorder folds Events with the same action
/// and reason into one series that keeps the first note; a digest of the note in the action keeps
/// a changed message visible, as client-go's aggregation by message does.
pub fn digest_action(reason: &str, note: &str) -> String {
    format!("{reason}/{:08x}", crc32fast::hash(note.as_bytes()))
}

/// Runs one reconcile of `controller`, counted and timed in the reconcile metrics; a failure is
/// counted under `kind` of its error.
pub async fn measured<T, E>(
    metrics: &Metrics,
    controller: &'static str,
    sync: impl Future<Output = Result<T, E>>,
    kind: impl Fn(&E) -> &'static str,
) -> Result<T, E> {
    let timer = metrics.reconcile_started(controller);
    let result = sync.await;
    drop(timer);
    if let Err(e) = &result {
        metrics.reconcile_failed(controller, kind(e));
    }
    result
}

/// A tick every `every`, the first one `every` from now (the start reconciles everything anyway).
fn ticks(every: Duration) -> impl Stream<Item = ()> + Send {
    let start = tokio::time::Instant::now() + every;
    IntervalStream::new(tokio::time::interval_at(start, every)).map(|_| ())
}

/// The trigger of the periodic resync ([`Triggers::resync`]).
pub const RESYNC: &str = "resync";
/// The trigger of the pass over every object at start ([`Triggers::at_start`]).
pub const START: &str = "start";

/// The time between two objects of a resync pass: a thousand a second, so a pass over 5 000
/// Services takes 5 s and kube's scheduler holds about as many as are reconciled meanwhile.
pub const RESYNC_GAP: Duration = Duration::from_millis(1);

/// The trigger of a reconcile nothing noted: the controller's own requeue (`Action::requeue`, or
/// the retry after a failure).
pub const REQUEUE: &str = "requeue";

/// What woke each object's reconcile, counted when it runs
/// (`harvester_reconcile_triggers_total{controller, trigger}`), so that a wake-up that concerns
/// nobody shows as a number, and how long the reconcile waited for its turn
/// (`harvester_reconcile_queue_seconds{controller}`, client-go's `workqueue_queue_duration_seconds`):
/// a latency that is all waiting says the controller is behind, not slow. As kube's scheduler
/// keeps the first reason of a pending request, the first trigger noted since the object's last
/// reconcile began is the one counted, and the wait is timed from it.
pub struct Triggers<K>
where
    K: Resource + 'static,
    K::DynamicType: Eq + Hash,
{
    controller: &'static str,
    metrics: Metrics,
    store: Store<K>,
    pending: Mutex<HashMap<ObjectRef<K>, Noted>>,
}

/// The first trigger of an object's pending reconcile: what, when, and for which object under
/// that name (a trigger for an object deleted before its turn never runs; its successor under
/// the same name starts afresh).
struct Noted {
    trigger: &'static str,
    since: Instant,
    uid: Option<String>,
}

impl<K> Triggers<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone + Default,
{
    pub fn new(controller: &'static str, metrics: Metrics, store: Store<K>) -> Self {
        Triggers {
            controller,
            metrics,
            store,
            pending: Mutex::new(HashMap::new()),
        }
    }

    /// Notes that `trigger` asks for a reconcile of each of `refs`, and hands them on. An object
    /// not in the cache is skipped: the controller runs no reconcile for it.
    pub fn note(
        &self,
        trigger: &'static str,
        refs: impl IntoIterator<Item = ObjectRef<K>>,
    ) -> Vec<ObjectRef<K>> {
        let found: Vec<(ObjectRef<K>, Option<String>)> = refs
            .into_iter()
            .filter_map(|r| {
                let uid = self.store.get(&r)?.meta().uid.clone();
                Some((r, uid))
            })
            .collect();
        let since = Instant::now();
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for (r, uid) in &found {
            let noted = Noted {
                trigger,
                since,
                uid: uid.clone(),
            };
            match pending.entry(r.clone()) {
                Entry::Occupied(mut e) if e.get().uid != noted.uid => {
                    e.insert(noted);
                }
                Entry::Occupied(_) => {}
                Entry::Vacant(e) => {
                    e.insert(noted);
                }
            }
        }
        found.into_iter().map(|(r, _)| r).collect()
    }

    /// The periodic resync: every `period` (the first pass `period` from now), each object cached
    /// when the pass starts, noted as `resync` one at a time, [`RESYNC_GAP`] apart. Handed out
    /// all at once, a pass of 5 000 Services put 5 000 requests at once in kube's scheduler and in
    /// the pending map here, whose hash tables kept that size after (VmHWM 66.3 MiB at 5 000
    /// Services + 1 000 Nodes; 54.7 with no pass during the bench; docs/ccm.md, "Memory").
    pub fn resync(
        self: &std::sync::Arc<Self>,
        period: Duration,
    ) -> impl Stream<Item = ObjectRef<K>> + Send + 'static
    where
        K: Send + Sync,
        K::DynamicType: Send + Sync,
    {
        let me = self.clone();
        ticks(period).flat_map(move |()| {
            let me = me.clone();
            futures::stream::iter(me.cached())
                .zip(IntervalStream::new(tokio::time::interval(RESYNC_GAP)))
                .flat_map(move |(r, _)| futures::stream::iter(me.note(RESYNC, [r])))
        })
    }

    /// Every cached object.
    fn cached(&self) -> Vec<ObjectRef<K>> {
        self.store
            .state()
            .iter()
            .map(|o| ObjectRef::from_obj(o.as_ref()))
            .collect()
    }

    /// Every cached object once, when the controller first polls it, noted as `start`.
    pub fn at_start(
        self: &std::sync::Arc<Self>,
    ) -> impl Stream<Item = ObjectRef<K>> + Send + 'static
    where
        K: Send + Sync,
        K::DynamicType: Send + Sync,
    {
        let me = self.clone();
        futures::stream::once(async {})
            .flat_map(move |()| futures::stream::iter(me.note(START, me.cached())))
    }

    /// Counts the reconcile of `obj` that is starting, under what woke it.
    pub fn woke(&self, obj: &K) {
        let key = ObjectRef::from_obj(obj);
        let noted = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        let (trigger, queued) = match noted {
            Some(n) => (n.trigger, Some(n.since.elapsed())),
            None => (REQUEUE, None),
        };
        self.metrics
            .reconcile_woken(self.controller, trigger, queued);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, uid: &str) -> k8s_openapi::api::core::v1::Node {
        let mut n = k8s_openapi::api::core::v1::Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.uid = Some(uid.into());
        n
    }

    #[test]
    fn a_reconcile_counts_its_first_trigger_and_its_wait_and_a_recreated_object_starts_afresh() {
        use kube::runtime::watcher::Event as WatchEvent;
        let metrics = Metrics::new();
        let (store, mut writer) = kube::runtime::reflector::store();
        let triggers = Triggers::new("node-test", metrics.clone(), store);
        let first = node("w1", "uid-1");
        writer.apply_watcher_event(&WatchEvent::Apply(first.clone()));
        let noted = triggers.note("vm", [ObjectRef::from_obj(&first)]);
        assert_eq!(noted.len(), 1);
        triggers.note("node", [ObjectRef::from_obj(&first)]);
        triggers.woke(&first);
        // Not in the cache: nothing to reconcile, nothing noted.
        assert!(triggers.note("vm", [ObjectRef::new("w2")]).is_empty());
        // Noted for uid-1, which is deleted before its turn; uid-2 takes the name.
        triggers.note("vm", [ObjectRef::from_obj(&first)]);
        writer.apply_watcher_event(&WatchEvent::Delete(first));
        let second = node("w1", "uid-2");
        writer.apply_watcher_event(&WatchEvent::Apply(second.clone()));
        triggers.note("node", [ObjectRef::from_obj(&second)]);
        triggers.woke(&second);
        triggers.woke(&second);
        let text = metrics.encode();
        for (trigger, n) in [("vm", 1), ("node", 1), ("requeue", 1)] {
            let line = format!(
                "harvester_reconcile_triggers_total{{controller=\"node-test\",trigger=\"{trigger}\"}} {n}"
            );
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(
            text.contains("harvester_reconcile_queue_seconds_count{controller=\"node-test\"} 2"),
            "the two noted reconciles are timed, the requeue is not: {text}"
        );
    }

    #[tokio::test]
    async fn resync_hands_out_each_cached_object_once_per_period_one_at_a_time() {
        use kube::runtime::watcher::Event as WatchEvent;
        let (store, mut writer) = kube::runtime::reflector::store();
        for (name, uid) in [("w1", "uid-1"), ("w2", "uid-2"), ("w3", "uid-3")] {
            writer.apply_watcher_event(&WatchEvent::Apply(node(name, uid)));
        }
        let triggers = std::sync::Arc::new(Triggers::new("resync-test", Metrics::new(), store));
        let period = Duration::from_millis(300);
        let start = tokio::time::Instant::now();
        let mut pass = Box::pin(triggers.resync(period));
        let mut seen = Vec::new();
        for _ in 0..6 {
            let r = pass.next().await.expect("the resync never ends");
            seen.push((r.name, start.elapsed()));
        }
        let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
        for pass in names.chunks(3) {
            let mut pass = pass.to_vec();
            pass.sort();
            assert_eq!(
                pass,
                ["w1", "w2", "w3"],
                "each object once a pass: {names:?}"
            );
        }
        // Timers never fire early: the first pass starts a period from now, its objects
        // RESYNC_GAP apart, and the second pass starts a period after the first.
        assert!(seen[0].1 >= period, "{seen:?}");
        assert!(seen[2].1 >= period + 2 * RESYNC_GAP, "{seen:?}");
        assert!(seen[3].1 >= 2 * period, "{seen:?}");
    }

    #[test]
    fn backoff_doubles_up_to_five_minutes() {
        let node = |n| backoff_delay(Duration::from_secs(1), Duration::from_secs(300), n);
        let got: Vec<u64> = [1, 2, 3, 4, 9, 10, 1000]
            .iter()
            .map(|n| node(*n).as_secs())
            .collect();
        assert_eq!(got, vec![1, 2, 4, 8, 256, 300, 300]);
    }
}
