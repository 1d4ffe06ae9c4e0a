//! What wakes a Service reconcile, decided per watch event without looking at every Service:
//! - [`Secondaries`]: which Services share a primary's address, an index fed by the Service
//!   events (a primary's change wakes its secondaries, not a sweep over every Service);
//! - [`CrsOf`]: which LoadBalancer CRs carry a Service's labels, fed by the CR events;
//! - [`CrChanges`]: whether a CR event changed anything the reconcile reads (labels,
//!   annotations, spec, status, deletion); Harvester's own finalizer on a new CR does not.
//!
//! The `woken_by_*` functions apply these per watch (and count each wake-up by trigger).
//!
//! The indexes are hints checked against the cache at each lookup: an entry whose object is gone
//! or changed is dropped then, so they hold no more than the caches do.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use harvester_common::harvester::LoadBalancer;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};

use super::annotations::{ANN_NETWORK, ServiceKey, ServiceLbSpec};
use super::context::{ServiceCtx, cr_key, svc_key};
use super::plan::{LABEL_SERVICE_NAME, LABEL_SERVICE_NAMESPACE};
use super::{crs, guest};
use crate::written::Echo;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The primary a Service names in its `primary-service` annotation, if it parses.
fn primary_of(svc: &Service) -> Option<ServiceKey> {
    ServiceLbSpec::from_service(svc).ok()?.primary
}

/// primary -> the Services seen naming it.
#[derive(Default)]
pub struct Secondaries {
    by_primary: Mutex<HashMap<ServiceKey, HashSet<ObjectRef<Service>>>>,
}

impl Secondaries {
    /// Notes a Service from a watch event.
    pub fn saw(&self, svc: &Service) {
        if let Some(p) = primary_of(svc) {
            lock(&self.by_primary)
                .entry(p)
                .or_default()
                .insert(ObjectRef::from_obj(svc));
        }
    }

    /// The cached Services that name `primary` now (entries that no longer do are dropped).
    pub fn of(&self, store: &Store<Service>, primary: &ServiceKey) -> Vec<Arc<Service>> {
        let mut index = lock(&self.by_primary);
        let Some(refs) = index.get_mut(primary) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        refs.retain(|r| match store.get(r) {
            Some(svc) if primary_of(&svc).as_ref() == Some(primary) => {
                found.push(svc);
                true
            }
            _ => false,
        });
        if refs.is_empty() {
            index.remove(primary);
        }
        found
    }
}

/// Service -> the names of the CRs seen with its labels.
#[derive(Default)]
pub struct CrsOf {
    by_service: Mutex<HashMap<ServiceKey, HashSet<String>>>,
}

/// The Service a CR's labels name.
fn owner(lb: &LoadBalancer) -> Option<ServiceKey> {
    let l = lb.labels();
    Some(ServiceKey {
        namespace: l.get(LABEL_SERVICE_NAMESPACE)?.clone(),
        name: l.get(LABEL_SERVICE_NAME)?.clone(),
    })
}

impl CrsOf {
    /// Notes a CR from a watch event.
    pub fn saw(&self, lb: &LoadBalancer) {
        if let Some(key) = owner(lb) {
            lock(&self.by_service)
                .entry(key)
                .or_default()
                .insert(lb.name_any());
        }
    }

    /// The cached CRs (in `namespace`) labelled for `key` now.
    pub fn of(
        &self,
        store: &Store<LoadBalancer>,
        namespace: &str,
        key: &ServiceKey,
    ) -> Vec<String> {
        let mut index = lock(&self.by_service);
        let Some(names) = index.get_mut(key) else {
            return Vec::new();
        };
        names.retain(|n| {
            store
                .get(&ObjectRef::new(n).within(namespace))
                .is_some_and(|lb| owner(&lb).as_ref() == Some(key))
        });
        let found: Vec<String> = names.iter().cloned().collect();
        if found.is_empty() {
            index.remove(key);
        }
        found
    }
}

/// CR name -> a digest of what the service reconcile reads from it.
#[derive(Default)]
pub struct CrChanges {
    seen: Mutex<HashMap<String, u64>>,
}

/// A digest of the parts of a CR the service reconcile reads: not its finalizers, managed fields
/// or resourceVersion.
fn digest(lb: &LoadBalancer) -> u64 {
    let read = serde_json::json!([
        lb.metadata.uid,
        lb.metadata.labels,
        lb.metadata.annotations,
        lb.metadata.deletion_timestamp,
        lb.spec,
        lb.status,
    ]);
    let mut h = DefaultHasher::new();
    read.to_string().hash(&mut h);
    h.finish()
}

impl CrChanges {
    /// Whether this event of `lb` changed what the reconcile reads since the last one (`cached`:
    /// whether the cache still holds it; a deleted CR always counts).
    pub fn changed(&self, lb: &LoadBalancer, cached: bool) -> bool {
        let mut seen = lock(&self.seen);
        if !cached {
            seen.remove(&lb.name_any());
            return true;
        }
        let d = digest(lb);
        seen.insert(lb.name_any(), d) != Some(d)
    }
}

/// The Services a change of the NAD mapping wakes: those that name a network.
pub(super) fn woken_by_nad_mapping(ctx: &ServiceCtx) -> Vec<ObjectRef<Service>> {
    ctx.triggers
        .note("nad mapping", services_with_network(&ctx.services))
}

/// The Services a change of the guest pools wakes: those that take their address there.
pub(super) fn woken_by_guest_pools(ctx: &ServiceCtx) -> Vec<ObjectRef<Service>> {
    let guests = guest::guest_services(&ctx.services, ctx.settings.default_ipam);
    ctx.triggers.note("guest pools", guests)
}

/// Whether a Service event wakes its reconcile: not the echo of our own write, which the
/// reconcile that made it already planned with.
pub(super) fn woken_by_service(ctx: &ServiceCtx, svc: &Service) -> bool {
    let echo = ctx
        .written
        .classify(&svc_key(svc), svc.resource_version().as_deref());
    if echo == Echo::Ours {
        return false;
    }
    !ctx.triggers
        .note("service", [ObjectRef::from_obj(svc)])
        .is_empty()
}

/// The Service a CR event wakes: none for the echo of our own write or a change of nothing the
/// reconcile reads (Harvester's finalizer), unless a reconcile waits for this CR's next event.
pub(super) fn woken_by_cr(ctx: &ServiceCtx, lb: &LoadBalancer) -> Vec<ObjectRef<Service>> {
    let name = lb.name_any();
    let cached = ctx
        .crs
        .get(&ObjectRef::new(&name).within(ctx.namespace()))
        .is_some();
    let changed = ctx.cr_changes.changed(lb, cached);
    let wake = match ctx
        .written
        .classify(&cr_key(&name), lb.resource_version().as_deref())
    {
        Echo::Ours => false,
        Echo::Awaited => true,
        Echo::Other => changed,
    };
    tracing::trace!(cr = %name, rv = ?lb.resource_version(), cached, changed, wake, "CR event");
    if !wake {
        return Vec::new();
    }
    ctx.triggers.note("loadbalancer", crs::service_of_cr(lb))
}

/// The other side of a shared address: the primary a secondary names, and the secondaries of
/// a primary (from the index, not a sweep over every Service).
pub(super) fn related_services(ctx: &ServiceCtx, svc: &Service) -> Vec<ObjectRef<Service>> {
    let key = ServiceKey::of(svc);
    let mut refs: Vec<ObjectRef<Service>> = Vec::new();
    if let Ok(ServiceLbSpec {
        primary: Some(p), ..
    }) = ServiceLbSpec::from_service(svc)
    {
        refs.push(ObjectRef::new(&p.name).within(&p.namespace));
    }
    refs.extend(
        ctx.secondaries
            .of(&ctx.services, &key)
            .iter()
            .map(|s| ObjectRef::from_obj(s.as_ref())),
    );
    ctx.triggers.note("related service", refs)
}

fn services_with_network(store: &Store<Service>) -> Vec<ObjectRef<Service>> {
    store
        .state()
        .iter()
        .filter(|s| s.annotations().contains_key(ANN_NETWORK))
        .map(|s| ObjectRef::from_obj(s.as_ref()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(name: &str, primary: Option<&str>) -> Service {
        let mut ann = serde_json::Map::new();
        if let Some(p) = primary {
            ann.insert(
                "cloudprovider.harvesterhci.io/primary-service".into(),
                json!(p),
            );
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "annotations": ann},
            "spec": {"type": "LoadBalancer"}
        }))
        .expect("test service")
    }

    fn lb(name: &str, service: &str, finalizers: &[&str], ip: Option<&str>) -> LoadBalancer {
        serde_json::from_value(json!({
            "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
            "metadata": {"name": name, "namespace": "vms", "finalizers": finalizers,
                         "labels": {LABEL_SERVICE_NAMESPACE: "default", LABEL_SERVICE_NAME: service}},
            "spec": {"ipam": "pool"},
            "status": ip.map(|ip| json!({"allocatedAddress": {"ip": ip}}))
        }))
        .expect("test lb")
    }

    #[test]
    fn secondaries_come_from_the_index_and_follow_the_cache() {
        let (store, mut writer) = kube::runtime::reflector::store::<Service>();
        let index = Secondaries::default();
        let primary = ServiceKey {
            namespace: "default".into(),
            name: "web".into(),
        };
        for s in [
            svc("web", None),
            svc("a", Some("web")),
            svc("b", Some("web")),
        ] {
            index.saw(&s);
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(s));
        }
        let names = |v: Vec<Arc<Service>>| {
            let mut n: Vec<String> = v.iter().map(|s| s.name_any()).collect();
            n.sort();
            n
        };
        assert_eq!(names(index.of(&store, &primary)), ["a", "b"]);
        // b moves to another primary: the cache says so, the index follows.
        let moved = svc("b", Some("other"));
        index.saw(&moved);
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(moved));
        assert_eq!(names(index.of(&store, &primary)), ["a"]);
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Delete(svc(
            "a",
            Some("web"),
        )));
        assert!(index.of(&store, &primary).is_empty(), "a is gone");
    }

    #[test]
    fn a_cr_event_counts_only_when_what_the_reconcile_reads_changed() {
        let changes = CrChanges::default();
        assert!(changes.changed(&lb("lb-1", "web", &[], None), true), "new");
        assert!(
            !changes.changed(&lb("lb-1", "web", &["wrangler"], None), true),
            "Harvester's finalizer"
        );
        assert!(
            changes.changed(&lb("lb-1", "web", &["wrangler"], Some("10.0.0.1")), true),
            "allocated"
        );
        assert!(
            changes.changed(&lb("lb-1", "web", &[], Some("10.0.0.1")), false),
            "deleted"
        );
    }

    #[test]
    fn crs_of_a_service_come_from_the_index() {
        let (store, mut writer) = kube::runtime::reflector::store::<LoadBalancer>();
        let index = CrsOf::default();
        let key = ServiceKey {
            namespace: "default".into(),
            name: "web".into(),
        };
        for l in [
            lb("lb-old", "web", &[], None),
            lb("lb-new", "web", &[], None),
        ] {
            index.saw(&l);
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(l));
        }
        let mut found = index.of(&store, "vms", &key);
        found.sort();
        assert_eq!(found, ["lb-new", "lb-old"]);
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Delete(lb(
            "lb-old",
            "web",
            &[],
            None,
        )));
        assert_eq!(index.of(&store, "vms", &key), ["lb-new"]);
    }
}
