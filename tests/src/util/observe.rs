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

/// What a watch of the observer can hold.
pub trait Watched:
    kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static
{
}
impl<K> Watched for K where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Watches `api` and records the first time `done` returns `(key, value)` for each key.
pub fn observe<K: Watched>(
    api: Api<K>,
    done: impl Fn(&K) -> Option<(String, String)> + Send + 'static,
) -> (Seen, tokio::task::JoinHandle<()>) {
    let ([seen], task) = observe_each(api, move |obj: &K| [done(obj)]);
    (seen, task)
}

/// Like [`observe`] for `N` states of the same objects, from one watch (each extra watch of the
/// observer is load on the API server it measures): `done` says for each state whether the
/// object is in it.
pub fn observe_each<K, F, const N: usize>(
    api: Api<K>,
    done: F,
) -> ([Seen; N], tokio::task::JoinHandle<()>)
where
    K: Watched,
    F: Fn(&K) -> [Option<(String, String)>; N] + Send + 'static,
{
    let seen: [Seen; N] = std::array::from_fn(|_| Seen::default());
    let out = seen.clone();
    let task = tokio::spawn(async move {
        let mut events = watcher::watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed();
        while let Some(ev) = events.next().await {
            let Ok(Event::Apply(obj) | Event::InitApply(obj)) = ev else {
                continue;
            };
            let now = Instant::now();
            for (state, out) in done(&obj).into_iter().zip(&out) {
                if let Some((key, value)) = state {
                    let mut seen = out.lock().unwrap_or_else(|p| p.into_inner());
                    seen.entry(key).or_insert((now, value));
                }
            }
        }
    });
    (seen, task)
}

/// A copy of what was seen so far.
pub fn seen_now(seen: &Seen) -> HashMap<String, (Instant, String)> {
    seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
