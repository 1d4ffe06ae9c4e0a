//! Which cached objects are older than our own last write to them.
//!
//! A reconcile plans from the watch-fed caches. Right after we wrote an object, the cache can
//! still hold the version our write was based on (the watch has not delivered ours yet); a plan
//! made from it would repeat the write (a no-op at best, a 409 conflict on an `update`). The log
//! remembers, per object, the resourceVersion a write of ours was based on: while the cache still
//! shows exactly that version, it is behind, and the watch event carrying our write (or a later
//! one) wakes the reconcile again. A write that stored nothing (the API server answered with the
//! very version it was based on: a mutating webhook reverted every change, or the patch changed
//! nothing) brings no watch event, so it leaves nothing behind. Pure bookkeeping: no client, no
//! clock.

use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default)]
pub struct WriteLog {
    /// object key -> resourceVersion the last write of ours was planned from.
    based_on: Mutex<HashMap<String, String>>,
}

impl WriteLog {
    /// Records a successful write to `key` planned from the cached version `based_on`, which the
    /// API server answered with version `stored`. When `stored` is `based_on` the write stored
    /// nothing and no watch event follows: the cache is not behind, and an earlier entry goes.
    pub fn wrote(&self, key: &str, based_on: Option<&str>, stored: Option<&str>) {
        let Some(based_on) = based_on else { return };
        let mut log = self.lock();
        if stored == Some(based_on) {
            log.remove(key);
        } else {
            log.insert(key.to_string(), based_on.to_string());
        }
    }

    /// Whether the cached version `rv` of `key` is the one our last write was planned from (the
    /// cache has not caught up with that write). A newer version clears the entry.
    pub fn behind(&self, key: &str, rv: Option<&str>) -> bool {
        let mut log = self.lock();
        match (log.get(key), rv) {
            (Some(based_on), Some(rv)) if based_on == rv => true,
            (Some(_), _) => {
                log.remove(key);
                false
            }
            (None, _) => false,
        }
    }

    /// Forgets every key `keep` refuses (objects that are gone), so the log stays bounded.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|k, _| keep(k));
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.based_on.lock().unwrap_or_else(|p| p.into_inner())
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
