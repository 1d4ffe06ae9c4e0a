//! Which cached objects are older than our own last write to them, and which watch events are
//! only the echo of our writes.
//!
//! A reconcile plans from the watch-fed caches. Right after we wrote an object, the cache can
//! still hold the version our write was based on (the watch has not delivered ours yet); a plan
//! made from it would repeat the write (a no-op at best, a 409 conflict on an `update`). The log
//! remembers, per object, the resourceVersions our writes were based on: while the cache still
//! shows one of them, it is behind, and the watch event carrying our write wakes the reconcile
//! again. That event is otherwise only our echo: the reconcile that wrote already went on with
//! what it wrote, so the echo wakes nobody ([`WriteLog::classify`]) unless a reconcile found the
//! cache behind and waits for it. A write that stored nothing (the API server answered with the
//! very version it was based on: a mutating webhook reverted every change, or the patch changed
//! nothing) brings no watch event, so it leaves nothing behind. Pure bookkeeping: no client, no
//! clock.

use std::collections::HashMap;
use std::sync::Mutex;

/// One object's writes of ours that the cache has not shown yet.
struct Entry {
    /// The versions our writes were planned from: while the cache shows one of them, it is behind.
    based_on: Vec<String>,
    /// The version the API server stored with our last write (its watch event is our echo).
    stored: Option<String>,
    /// A reconcile found the cache behind and waits for the echo to wake it.
    waited: bool,
}

/// What a watch event is to the reconciles ([`WriteLog::classify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Echo {
    Ours,
    Awaited,
    Other,
}

#[derive(Default)]
pub struct WriteLog {
    entries: Mutex<HashMap<String, Entry>>,
    /// Writes sent and not yet recorded, per key: the watch may deliver a write's echo before the
    /// writer has seen the answer, so an event of such a key waits ([`WriteLog::settled`]).
    in_flight: Mutex<HashMap<String, usize>>,
    recorded: tokio::sync::Notify,
}

/// A write of ours in flight ([`WriteLog::sending`]); dropped once its answer is recorded.
pub struct Sending<'a> {
    log: &'a WriteLog,
    key: String,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.log.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = in_flight.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                in_flight.remove(&self.key);
            }
        }
        drop(in_flight);
        self.log.recorded.notify_waiters();
    }
}

impl WriteLog {
    /// Records a successful write to `key` planned from the cached version `based_on`, which the
    /// API server answered with version `stored`. When `stored` is `based_on` the write stored
    /// nothing and no watch event follows: the cache is not behind, and an earlier entry goes.
    /// A write planned from the version our previous write stored (one reconcile writing twice)
    /// extends that entry.
    pub fn wrote(&self, key: &str, based_on: Option<&str>, stored: Option<&str>) {
        let Some(based_on) = based_on else { return };
        let mut log = self.lock();
        if stored == Some(based_on) {
            log.remove(key);
            return;
        }
        let stored = stored.map(str::to_string);
        match log.get_mut(key) {
            Some(e) if e.stored.as_deref() == Some(based_on) => {
                e.based_on.push(based_on.to_string());
                e.stored = stored;
            }
            _ => {
                log.insert(
                    key.to_string(),
                    Entry {
                        based_on: vec![based_on.to_string()],
                        stored,
                        waited: false,
                    },
                );
            }
        }
    }

    /// Whether the cached version `rv` of `key` is one our writes were planned from (the cache has
    /// not caught up with them); the watch event of our last write must then wake the caller. A
    /// newer version clears the entry.
    pub fn behind(&self, key: &str, rv: Option<&str>) -> bool {
        let mut log = self.lock();
        match (log.get_mut(key), rv) {
            (Some(e), Some(rv)) if e.based_on.iter().any(|b| b == rv) => {
                e.waited = true;
                true
            }
            (Some(_), _) => {
                log.remove(key);
                false
            }
            (None, _) => false,
        }
    }

    /// What a watch event showing `key` at version `rv` is to the reconciles: only the echo of
    /// our own writes, which the reconcile that made them already planned with ([`Echo::Ours`]:
    /// it need not wake one); or an event a reconcile waits for ([`Echo::Awaited`]: it found the
    /// cache behind, or its write met a newer version); or anything else. The echo of our last
    /// write ends the entry.
    pub fn classify(&self, key: &str, rv: Option<&str>) -> Echo {
        let mut log = self.lock();
        let Some(e) = log.get(key) else {
            return Echo::Other;
        };
        match rv {
            Some(rv) if e.stored.as_deref() == Some(rv) => {
                let waited = e.waited;
                log.remove(key);
                if waited { Echo::Awaited } else { Echo::Ours }
            }
            // A version our later write was planned from: the echo of that write follows.
            Some(rv) if e.based_on.iter().skip(1).any(|b| b == rv) => Echo::Ours,
            _ if e.waited => {
                if e.stored.is_none() {
                    log.remove(key);
                }
                Echo::Awaited
            }
            _ => Echo::Other,
        }
    }

    /// Records that a reconcile waits for the next watch event of `key` (its write met a newer
    /// version than the cache's: the event carrying that version must wake it).
    pub fn await_next(&self, key: &str) {
        self.lock()
            .entry(key.to_string())
            .or_insert_with(|| Entry {
                based_on: Vec::new(),
                stored: None,
                waited: true,
            })
            .waited = true;
    }

    /// Marks a write to `key` as sent; hold the guard until its answer is recorded with
    /// [`WriteLog::wrote`].
    pub fn sending(&self, key: &str) -> Sending<'_> {
        *self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.to_string())
            .or_insert(0) += 1;
        Sending {
            log: self,
            key: key.to_string(),
        }
    }

    /// Waits until no write to `key` is in flight, so that [`WriteLog::classify`] knows of every
    /// write whose echo may be the event at hand.
    pub async fn settled(&self, key: &str) {
        loop {
            // Registered before the check: a guard dropped in between still wakes it.
            let recorded = self.recorded.notified();
            let busy = self
                .in_flight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(key);
            if !busy {
                return;
            }
            recorded.await;
        }
    }

    /// Forgets every key `keep` refuses (objects that are gone), so the log stays bounded.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|k, _| keep(k));
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_is_behind_only_while_it_shows_the_version_the_write_was_based_on() {
        let log = WriteLog::default();
        assert!(!log.behind("svc/a", Some("10")), "no write, never behind");
        log.wrote("svc/a", Some("10"), Some("11"));
        assert!(log.behind("svc/a", Some("10")));
        assert!(log.behind("svc/a", Some("10")), "still the old version");
        assert!(!log.behind("svc/b", Some("10")), "other objects unaffected");
        assert!(
            !log.behind("svc/a", Some("11")),
            "the watch delivered a newer one"
        );
        assert_eq!(log.len(), 0, "the entry goes once the cache moved on");
        assert!(
            !log.behind("svc/a", Some("10")),
            "and is not consulted again"
        );
    }

    #[test]
    fn a_write_without_a_version_is_not_recorded_and_retain_forgets_gone_objects() {
        let log = WriteLog::default();
        log.wrote("svc/a", None, Some("1"));
        assert_eq!(log.len(), 0);
        log.wrote("svc/a", Some("1"), Some("3"));
        log.wrote("svc/b", Some("2"), Some("4"));
        log.retain(|k| k == "svc/b");
        assert_eq!(log.len(), 1);
        assert!(log.behind("svc/b", Some("2")));
        assert!(
            !log.behind("svc/b", None),
            "an object without a version is not ours"
        );
    }

    #[test]
    fn our_own_echo_wakes_nobody_unless_a_reconcile_waits_for_it() {
        let log = WriteLog::default();
        log.wrote("svc/a", Some("10"), Some("11"));
        assert_eq!(
            log.classify("svc/a", Some("12")),
            Echo::Other,
            "someone else's change"
        );
        log.wrote("svc/a", Some("12"), Some("13"));
        assert_eq!(
            log.classify("svc/a", Some("13")),
            Echo::Ours,
            "our echo, nobody waits"
        );
        assert_eq!(log.len(), 0, "the echo ends the entry");
        assert_eq!(
            log.classify("svc/a", Some("13")),
            Echo::Other,
            "and is ours once"
        );

        log.wrote("svc/b", Some("20"), Some("21"));
        assert!(
            log.behind("svc/b", Some("20")),
            "a reconcile found the cache behind"
        );
        assert_eq!(
            log.classify("svc/b", Some("21")),
            Echo::Awaited,
            "the waiting reconcile is woken by the echo"
        );

        // One reconcile writing twice (the finalizer, then the status): both echoes are ours.
        log.wrote("svc/c", Some("30"), Some("31"));
        log.wrote("svc/c", Some("31"), Some("32"));
        assert!(
            log.behind("svc/c", Some("31")),
            "behind until the last write shows"
        );
        assert_eq!(
            log.classify("svc/c", Some("31")),
            Echo::Ours,
            "the second echo follows"
        );
        assert_eq!(log.classify("svc/c", Some("32")), Echo::Awaited);
        assert!(!log.behind("svc/c", Some("32")));

        // A write in flight holds the events of its key until it is recorded.
        let sending = log.sending("svc/e");
        let settled = log.settled("svc/e");
        futures::pin_mut!(settled);
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(settled.as_mut().poll(&mut cx).is_pending(), "in flight");
        drop(sending);
        assert!(settled.as_mut().poll(&mut cx).is_ready(), "recorded");

        // An update that met a newer version (409): the next event, whatever it is, wakes it.
        log.await_next("lb/d");
        assert_eq!(log.classify("lb/d", Some("40")), Echo::Awaited);
        assert_eq!(log.classify("lb/d", Some("41")), Echo::Other);
    }

    #[test]
    fn a_write_that_stored_nothing_leaves_the_cache_current() {
        // An update whose every change Harvester's webhook reverted: the API server answers with
        // the version the update was based on, and no watch event ever follows.
        let log = WriteLog::default();
        log.wrote("lb/a", Some("7"), Some("7"));
        assert!(!log.behind("lb/a", Some("7")), "nothing stored: not behind");
        assert_eq!(log.len(), 0);
        // It also clears an entry left by an earlier write whose event has since come and gone.
        log.wrote("lb/a", Some("7"), Some("8"));
        log.wrote("lb/a", Some("8"), Some("8"));
        assert!(!log.behind("lb/a", Some("8")));
        // A response without a version: as before, recorded (the watch brings the change).
        log.wrote("lb/b", Some("3"), None);
        assert!(log.behind("lb/b", Some("3")));
    }
}
