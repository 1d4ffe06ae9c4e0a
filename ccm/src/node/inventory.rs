//! What the node-side controllers look at: caches of the guest Nodes and of the Harvester VMs and
//! VMIs (one watch per resource, shared by every controller), and which VM runs which Node.
//!
//! A Node's VM is found, in this order:
//! 1. the VM whose UID is in the Node's providerID (`harvester://<uid>`), once initialised;
//! 2. the VM named like the Node;
//! 3. the VM whose VMI has the Node's name as guest hostname: `spec.hostname`, or the hostname
//!    qemu-guest-agent reports (`guestosinfo` subresource; upstream's fallback, #4947).
//!
//! A VM missing from the cache is looked up live before anything calls it absent.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use harvester_common::harvester::{
    TOPOLOGY_REGION, TOPOLOGY_ZONE, VirtualMachine, VirtualMachineInstance, lenient,
};
use k8s_openapi::api::core::v1::{Node, NodeStatus};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

use crate::context::Context;
use crate::error::Error;

pub use harvester_common::harvester::kubevirt::{PROVIDER_ID_PREFIX, provider_id};
/// Label the node driver puts on guest VMs/VMIs: the guest cluster's name.
pub const GUEST_CLUSTER_LABEL: &str = "guestcluster.harvesterhci.io/name";

/// The VM UID in a Node's providerID, if it is ours.
pub fn provider_uid(node: &Node) -> Option<&str> {
    node.spec
        .as_ref()?
        .provider_id
        .as_deref()
        .and_then(harvester_common::harvester::kubevirt::provider_uid)
}

/// Whether the Node's providerID is empty or ours (a Node of another provider is left alone).
pub fn is_ours(node: &Node) -> bool {
    match node.spec.as_ref().and_then(|s| s.provider_id.as_deref()) {
        None | Some("") => true,
        Some(p) => p.starts_with(PROVIDER_ID_PREFIX),
    }
}

/// A Node's VM, as found.
#[derive(Debug, Clone)]
pub enum Lookup {
    Found {
        vm: Arc<VirtualMachine>,
        /// None when the VM is not running.
        vmi: Option<Arc<VirtualMachineInstance>>,
    },
    /// Confirmed with a live GET (404), not only missing from the cache.
    Absent,
}

/// Fans the objects a watch touched out to every subscribed controller.
struct Fanout<K> {
    subscribers: Mutex<Vec<mpsc::UnboundedSender<Arc<K>>>>,
}

impl<K: Clone + Send + Sync + 'static> Fanout<K> {
    fn new() -> Self {
        Fanout {
            subscribers: Mutex::new(Vec::new()),
        }
    }

    /// Every object published from now on, shared (no copy per subscriber).
    fn subscribe(&self) -> impl Stream<Item = Arc<K>> + Send + 'static {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut subs) = self.subscribers.lock() {
            subs.push(tx);
        }
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
    }

    fn publish(&self, obj: K) {
        let obj = Arc::new(obj);
        if let Ok(mut subs) = self.subscribers.lock() {
            subs.retain(|tx| tx.send(obj.clone()).is_ok());
        }
    }
}

pub struct Inventory {
    pub nodes: Store<Node>,
    pub vms: Store<VirtualMachine>,
    pub vmis: Store<VirtualMachineInstance>,
    namespace: String,
    cluster_name: String,
    harvester: kube::Client,
    node_events: Fanout<Node>,
    vm_events: Fanout<VirtualMachine>,
    vmi_events: Fanout<VirtualMachineInstance>,
    /// VMI UID -> the hostname qemu-guest-agent reported.
    agent_hostnames: Mutex<HashMap<String, String>>,
}

impl Inventory {
    /// The inventory, and the future that runs its three watches (run it until shutdown).
    pub fn start(ctx: &Context) -> (Arc<Inventory>, impl Future<Output = ()> + Send + 'static) {
        let (nodes, node_writer) = reflector::store();
        let (vms, vm_writer) = reflector::store();
        let (vmis, vmi_writer) = reflector::store();
        let inventory = Arc::new(Inventory {
            nodes,
            vms,
            vmis,
            namespace: ctx.namespace().to_string(),
            cluster_name: ctx.config.cluster_name.clone(),
            harvester: ctx.harvester.clone(),
            node_events: Fanout::new(),
            vm_events: Fanout::new(),
            vmi_events: Fanout::new(),
            agent_hostnames: Mutex::new(HashMap::new()),
        });
        let node_api: Api<Node> = Api::all(ctx.guest.clone());
        let harvester = ctx.harvester.clone();
        let ns = ctx.namespace().to_string();
        let inv = inventory.clone();
        let run = async move {
            tokio::join!(
                watch(
                    "guest Nodes",
                    watcher(node_api, watcher::Config::default()),
                    node_writer,
                    strip_node,
                    |n| inv.node_events.publish(n)
                ),
                watch(
                    "Harvester VMs",
                    lenient_watcher::<VirtualMachine>(&harvester, &ns),
                    vm_writer,
                    strip_vm,
                    |v| inv.vm_events.publish(v)
                ),
                watch(
                    "Harvester VMIs",
                    lenient_watcher::<VirtualMachineInstance>(&harvester, &ns),
                    vmi_writer,
                    strip_vmi,
                    |v| inv.vmi_events.publish(v)
                ),
            );
        };
        (inventory, run)
    }

    /// Waits until the three caches hold a full list.
    pub async fn ready(&self) {
        let _ = tokio::join!(
            self.nodes.wait_until_ready(),
            self.vms.wait_until_ready(),
            self.vmis.wait_until_ready()
        );
    }

    /// Every Node the watch touches from now on (added, changed or deleted).
    pub fn node_events(&self) -> impl Stream<Item = Arc<Node>> + Send + 'static {
        self.node_events.subscribe()
    }
    pub fn vm_events(&self) -> impl Stream<Item = Arc<VirtualMachine>> + Send + 'static {
        self.vm_events.subscribe()
    }
    pub fn vmi_events(&self) -> impl Stream<Item = Arc<VirtualMachineInstance>> + Send + 'static {
        self.vmi_events.subscribe()
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn vm_ref(&self, name: &str) -> ObjectRef<VirtualMachine> {
        ObjectRef::new(name).within(&self.namespace)
    }
    fn vmi_ref(&self, name: &str) -> ObjectRef<VirtualMachineInstance> {
        ObjectRef::new(name).within(&self.namespace)
    }

    /// The guest hostnames a VMI is known by (besides its name).
    fn hostnames_of(&self, vmi: &VirtualMachineInstance) -> Vec<String> {
        let mut names: Vec<String> = vmi
            .spec
            .rest
            .get("hostname")
            .and_then(|h| h.as_str())
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .into_iter()
            .collect();
        if let (Some(uid), Ok(cache)) = (vmi.uid(), self.agent_hostnames.lock())
            && let Some(h) = cache.get(&uid)
        {
            names.push(h.clone());
        }
        names
    }

    /// The Nodes a VM event concerns.
    pub fn nodes_for_vm(&self, vm: &VirtualMachine) -> Vec<ObjectRef<Node>> {
        let mut names = vec![vm.name_any()];
        if let Some(uid) = vm.uid() {
            names.extend(self.nodes_of_uid(&uid));
        }
        if let Some(vmi) = self.vmis.get(&self.vmi_ref(&vm.name_any())) {
            names.extend(self.hostnames_of(&vmi));
        }
        refs(names)
    }

    /// The Nodes a VMI event concerns (addressed by the guest node's name, not only the VMI's).
    pub fn nodes_for_vmi(&self, vmi: &VirtualMachineInstance) -> Vec<ObjectRef<Node>> {
        let mut names = vec![vmi.name_any()];
        names.extend(self.hostnames_of(vmi));
        if let Some(uid) = self
            .vms
            .get(&self.vm_ref(&vmi.name_any()))
            .and_then(|vm| vm.uid())
        {
            names.extend(self.nodes_of_uid(&uid));
        }
        refs(names)
    }

    /// Names of the cached Nodes whose providerID names VM UID `uid`.
    fn nodes_of_uid(&self, uid: &str) -> Vec<String> {
        self.nodes
            .state()
            .iter()
            .filter(|n| provider_uid(n) == Some(uid))
            .map(|n| n.name_any())
            .collect()
    }

    /// The VM name for a Node from the caches alone (rules 1-3 without asking the guest agent).
    pub fn cached_vm_name(&self, node: &Node) -> Option<String> {
        let node_name = node.name_any();
        if let Some(uid) = provider_uid(node)
            && let Some(vm) = self.vms.find(|vm| vm.uid().as_deref() == Some(uid))
        {
            return Some(vm.name_any());
        }
        if self.vms.get(&self.vm_ref(&node_name)).is_some() {
            return Some(node_name);
        }
        self.vmis
            .find(|vmi| self.hostnames_of(vmi).contains(&node_name))
            .map(|vmi| vmi.name_any())
    }

    /// Finds the Node's VM and VMI; `Absent` only after the API server said 404.
    pub async fn lookup(&self, node: &Node) -> Result<Lookup, Error> {
        let node_name = node.name_any();
        let name = match self.cached_vm_name(node) {
            Some(name) => name,
            // Never initialised (no providerID): the guest agent may know it by hostname.
            None if provider_uid(node).is_none() => self
                .vm_name_from_guest_agent(&node_name)
                .await
                .unwrap_or_else(|| node_name.clone()),
            None => node_name.clone(),
        };
        let vms: Api<VirtualMachine> = Api::namespaced(self.harvester.clone(), &self.namespace);
        let vm = match self.vms.get(&self.vm_ref(&name)) {
            Some(vm) => vm,
            None => match vms.get_opt(&name).await.map_err(Error::harvester(format!(
                "getting VirtualMachine {}/{name}",
                self.namespace
            )))? {
                Some(vm) => Arc::new(vm),
                None => return Ok(Lookup::Absent),
            },
        };
        let vmi = match self.vmis.get(&self.vmi_ref(&name)) {
            Some(vmi) => Some(vmi),
            None => {
                Api::<VirtualMachineInstance>::namespaced(self.harvester.clone(), &self.namespace)
                    .get_opt(&name)
                    .await
                    .map_err(Error::harvester(format!(
                        "getting VirtualMachineInstance {}/{name}",
                        self.namespace
                    )))?
                    .map(Arc::new)
            }
        };
        Ok(Lookup::Found { vm, vmi })
    }

    /// Asks qemu-guest-agent (KubeVirt `guestosinfo`) of the running VMIs that could run `node`:
    /// those of this guest cluster (when the label says), with the agent connected, whose name is
    /// no guest Node's. Answers are cached per VMI.
    async fn vm_name_from_guest_agent(&self, node: &str) -> Option<String> {
        let candidates = self.vmis.state().into_iter().filter(|vmi| {
            let cluster_ok = match vmi.labels().get(GUEST_CLUSTER_LABEL) {
                Some(c) => c == &self.cluster_name,
                None => true,
            };
            let known = vmi.uid().is_some_and(|uid| {
                self.agent_hostnames
                    .lock()
                    .is_ok_and(|c| c.contains_key(&uid))
            });
            cluster_ok
                && !known
                && agent_connected(vmi)
                && self.nodes.get(&ObjectRef::new(&vmi.name_any())).is_none()
        });
        for vmi in candidates.collect::<Vec<_>>() {
            let name = vmi.name_any();
            let url = format!(
                "/apis/subresources.kubevirt.io/v1/namespaces/{}/virtualmachineinstances/{name}/guestosinfo",
                self.namespace
            );
            let Ok(req) = http::Request::get(url).body(Vec::new()) else {
                continue;
            };
            match self.harvester.request::<serde_json::Value>(req).await {
                Ok(info) => {
                    if let (Some(h), Some(uid)) = (guest_hostname(&info), vmi.uid())
                        && let Ok(mut cache) = self.agent_hostnames.lock()
                    {
                        cache.insert(uid, h.to_string());
                    }
                }
                Err(e) => tracing::debug!(vmi = %name, error = %e, "guestosinfo unavailable"),
            }
        }
        self.vmis
            .find(|vmi| self.hostnames_of(vmi).iter().any(|h| h == node))
            .map(|vmi| vmi.name_any())
    }
}

/// The `hostname` of a `guestosinfo` answer (short form: a guest FQDN matches by its first label).
pub fn guest_hostname(info: &serde_json::Value) -> Option<&str> {
    info.get("hostname")
        .and_then(|h| h.as_str())
        .map(|h| h.split('.').next().unwrap_or(h))
        .filter(|h| !h.is_empty())
}

/// Whether KubeVirt reports the VMI's qemu-guest-agent connected.
pub fn agent_connected(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.rest.get("conditions"))
        .and_then(|c| c.as_array())
        .is_some_and(|conds| {
            conds.iter().any(|c| {
                c.get("type").and_then(|t| t.as_str()) == Some("AgentConnected")
                    && c.get("status").and_then(|s| s.as_str()) == Some("True")
            })
        })
}

fn refs(mut names: Vec<String>) -> Vec<ObjectRef<Node>> {
    names.sort();
    names.dedup();
    names.iter().map(|n| ObjectRef::new(n)).collect()
}

/// A watch of the Harvester objects of kind `K` in `namespace` that one malformed object cannot
/// stop: objects arrive untyped and are decoded leniently ([`lenient::decode`]: a field that does
/// not fit our types is dropped with a warning naming the object), so a list that holds such an
/// object still fills the cache with every other one.
fn lenient_watcher<K>(
    client: &kube::Client,
    namespace: &str,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + DeserializeOwned + Send + 'static,
{
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiResource::erase::<K>(&()));
    watcher(api, watcher::Config::default()).filter_map(|item| {
        futures::future::ready(match item {
            Ok(event) => typed(event).map(Ok),
            Err(e) => Some(Err(e)),
        })
    })
}

/// The event with its objects decoded as `K`; `None` when one cannot be (logged, skipped).
fn typed<K>(event: watcher::Event<DynamicObject>) -> Option<watcher::Event<K>>
where
    K: Resource<DynamicType = ()> + DeserializeOwned,
{
    let kind = K::kind(&());
    let decode = |obj| lenient::decode::<K>(&kind, obj).ok();
    Some(match event {
        watcher::Event::Apply(obj) => watcher::Event::Apply(decode(obj)?),
        watcher::Event::Delete(obj) => watcher::Event::Delete(decode(obj)?),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(obj) => watcher::Event::InitApply(decode(obj)?),
        watcher::Event::InitDone => watcher::Event::InitDone,
    })
}

/// What the node-side controllers never read, dropped before an object is cached: managed
/// fields everywhere, a Node's status but its addresses and conditions (images, capacity, node
/// info), a VM's spec (its template: domain, disks, cloud-init
/// user data) and annotations, and of a VMI its domain, volumes and volume status. What is read
/// is kept: a Node's taints, labels, annotations, addresses and conditions; a VM's UID and
/// `status.ready`; a VMI's networks, hostname, interfaces, host, conditions, migration state,
/// labels and topology annotations. Nothing of these caches is ever written back.
fn strip_node(node: &mut Node) {
    node.managed_fields_mut().clear();
    if let Some(status) = node.status.take() {
        node.status = Some(NodeStatus {
            addresses: status.addresses,
            conditions: status.conditions,
            ..Default::default()
        });
    }
}

fn strip_vm(vm: &mut VirtualMachine) {
    vm.managed_fields_mut().clear();
    vm.metadata.annotations = None;
    vm.spec = Default::default();
    if let Some(status) = vm.status.as_mut() {
        status.rest.clear();
    }
}

/// VMI spec fields besides `networks` that the inventory reads.
const VMI_SPEC_READ: [&str; 1] = ["hostname"];
/// VMI status fields in `rest` that the node-side controllers read.
const VMI_STATUS_READ: [&str; 2] = ["conditions", "migrationState"];

fn strip_vmi(vmi: &mut VirtualMachineInstance) {
    vmi.managed_fields_mut().clear();
    vmi.annotations_mut()
        .retain(|k, _| k == TOPOLOGY_REGION || k == TOPOLOGY_ZONE);
    vmi.spec.domain = Default::default();
    vmi.spec.volumes.clear();
    vmi.spec
        .rest
        .retain(|k, _| VMI_SPEC_READ.contains(&k.as_str()));
    if let Some(status) = vmi.status.as_mut() {
        status.volume_status.clear();
        status
            .rest
            .retain(|k, _| VMI_STATUS_READ.contains(&k.as_str()));
    }
}

/// Runs one watch into its cache (each object through `strip` first) and hands every touched
/// object to `publish`; never ends.
async fn watch<K>(
    what: &'static str,
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    writer: reflector::store::Writer<K>,
    strip: fn(&mut K),
    publish: impl Fn(K),
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    let stream = events
        .default_backoff()
        .modify(strip)
        .reflect(writer)
        .touched_objects();
    let mut stream = std::pin::pin!(stream);
    while let Some(item) = stream.next().await {
        match item {
            Ok(obj) => publish(obj),
            Err(e) => {
                tracing::warn!(watch = what, error = %e, "watch failed; retrying with backoff")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(provider_id: Option<&str>) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "w1"},
            "spec": {"providerID": provider_id}
        }))
        .expect("test node")
    }

    #[test]
    fn a_cached_node_keeps_what_the_controllers_read() {
        let mut n: Node = serde_json::from_value(json!({
            "metadata": {"name": "w1", "labels": {"a": "b"}, "managedFields": [{"manager": "kubelet"}]},
            "spec": {"providerID": "harvester://u", "taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {
                "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}],
                "conditions": [{"type": "Ready", "status": "True"}],
                "capacity": {"cpu": "2"}, "nodeInfo": {"kubeletVersion": "v1.34.4", "architecture": "amd64",
                "bootID": "", "containerRuntimeVersion": "", "kernelVersion": "", "kubeProxyVersion": "",
                "machineID": "", "operatingSystem": "linux", "osImage": "", "systemUUID": ""},
                "images": [{"names": ["pause"]}]
            }
        }))
        .expect("test node");
        let spec = n.spec.clone();
        strip_node(&mut n);
        let status = n.status.as_ref().expect("status kept");
        assert_eq!(status.addresses.as_ref().map(Vec::len), Some(1));
        assert_eq!(status.conditions.as_ref().map(Vec::len), Some(1));
        assert!(status.capacity.is_none() && status.node_info.is_none() && status.images.is_none());
        assert_eq!(n.spec, spec);
        assert_eq!(n.labels().get("a").map(String::as_str), Some("b"));
        assert!(n.managed_fields().is_empty());
    }

    #[test]
    fn provider_ids() {
        assert_eq!(provider_id("abc"), "harvester://abc");
        assert_eq!(provider_uid(&node(Some("harvester://abc"))), Some("abc"));
        assert_eq!(provider_uid(&node(Some("aws:///i-1"))), None);
        assert!(is_ours(&node(None)));
        assert!(is_ours(&node(Some(""))));
        assert!(is_ours(&node(Some("harvester://abc"))));
        assert!(!is_ours(&node(Some("aws:///i-1"))));
    }

    #[test]
    fn guest_agent_answers() {
        assert_eq!(
            guest_hostname(&json!({"hostname": "node-a.example.org"})),
            Some("node-a")
        );
        assert_eq!(guest_hostname(&json!({"hostname": ""})), None);
        assert_eq!(guest_hostname(&json!({})), None);
        let vmi = |status: &str| -> VirtualMachineInstance {
            serde_json::from_value(json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": "w1"}, "spec": {},
                "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "AgentConnected", "status": status}]}
            }))
            .expect("test vmi")
        };
        assert!(agent_connected(&vmi("True")));
        assert!(!agent_connected(&vmi("False")));
    }
}
