//! What Harvester's LoadBalancer webhooks read besides the object under admission comes from
//! informer caches (harvester/load-balancer-harvester v1.8.2 and v1.9.0-rc4
//! `pkg/webhook/loadbalancer/mutator.go`: `namespaceCache.Get`, `vmiCache.List`; `validator.go`:
//! `vmCache.List`), not from the API server per request. A stand-in that listed per admission
//! made the bed's Harvester API server serialise every VMI of the namespace on each LoadBalancer
//! write (at 1 000 VMs: about one core, and the CR creates of the bench's 5 000-Service level
//! queued behind it).
//! [`Cache`] is that informer: one watch into a store, read with a namespace and an equality label
//! selector as the listers do; the watch stops when the last handle goes.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};

/// A watch cache of one kind of object (all namespaces).
#[derive(Clone)]
pub struct Cache {
    store: Store<DynamicObject>,
    _watch: Arc<AbortOnDrop>,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Cache {
    /// Starts the watch of `resource` on the current runtime.
    pub fn start(client: kube::Client, resource: &ApiResource) -> Cache {
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        let api: Api<DynamicObject> = Api::all_with(client, resource);
        let watch = tokio::spawn(super::watch(api).reflect(writer).for_each(|_| async {}));
        Cache {
            store,
            _watch: Arc::new(AbortOnDrop(watch)),
        }
    }

    /// The objects of `namespace` whose labels hold every `key=value` of `selector` (as a lister
    /// with `labels.SelectorFromSet`), once the first list is in.
    ///
    /// Shared, as a lister's pointers: a webhook called for every write must not copy whole
    /// objects per call.
    pub async fn list(
        &self,
        namespace: &str,
        selector: &[(&str, &str)],
    ) -> Vec<Arc<DynamicObject>> {
        let _ = self.store.wait_until_ready().await;
        self.store.state_filter(|o| {
            o.metadata.namespace.as_deref() == Some(namespace)
                && selected(o.metadata.labels.as_ref(), selector)
        })
    }

    /// The cluster-scoped object `name`, once the first list is in.
    pub async fn get(&self, name: &str) -> Option<DynamicObject> {
        let _ = self.store.wait_until_ready().await;
        self.store
            .find(|o| o.metadata.name.as_deref() == Some(name))
            .map(|o| o.as_ref().clone())
    }
}

fn selected(labels: Option<&BTreeMap<String, String>>, selector: &[(&str, &str)]) -> bool {
    selector
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(*k)).map(String::as_str) == Some(*v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_of_the_selector_must_match() {
        let labels: BTreeMap<String, String> = [("a", "1"), ("b", "2")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert!(selected(Some(&labels), &[]));
        assert!(selected(Some(&labels), &[("a", "1")]));
        assert!(selected(Some(&labels), &[("a", "1"), ("b", "2")]));
        assert!(!selected(Some(&labels), &[("a", "1"), ("b", "3")]));
        assert!(!selected(Some(&labels), &[("c", "1")]));
        assert!(!selected(None, &[("a", "1")]));
        assert!(selected(None, &[]));
    }
}
