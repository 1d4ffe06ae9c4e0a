//! When objects reach a state, as a watch sees it: the bench's and the load tests' clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

/// Key -> (first time seen done, the value `done` gave then).
pub type Seen = Arc<Mutex<HashMap<String, (Instant, String)>>>;

/// Watches `api` and records the first time `done` returns `(key, value)` for each key.
pub fn observe<K>(
    api: Api<K>,
    done: impl Fn(&K) -> Option<(String, String)> + Send + 'static,
) -> (Seen, tokio::task::JoinHandle<()>)
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let seen: Seen = Arc::default();
    let out = seen.clone();
    let task = tokio::spawn(async move {
        let mut events = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = events.next().await {
            if let Ok(Event::Apply(obj) | Event::InitApply(obj)) = ev
                && let Some((key, value)) = done(&obj)
            {
                let mut seen = out.lock().unwrap_or_else(|p| p.into_inner());
                seen.entry(key).or_insert((Instant::now(), value));
            }
        }
    });
    (seen, task)
}

/// A copy of what was seen so far.
pub fn seen_now(seen: &Seen) -> HashMap<String, (Instant, String)> {
    seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
