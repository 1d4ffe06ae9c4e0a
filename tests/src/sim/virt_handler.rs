//! The node side of a Harvester host under KubeVirt's own virt-api and virt-controller
//! ([`crate::bed::kubevirt`]): only what needs a hypervisor or a kubelet is played here.
//!
//! - The scheduler and kubelet of the VM namespace's KubeVirt Pods: a launcher Pod is bound to
//!   the Node its nodeSelector names among those labelled `kubevirt.io/schedulable=true` (the
//!   label virt-handler's heartbeat keeps on its Node, kubevirt/kubevirt v1.7.0
//!   `pkg/virt-handler/heartbeat/heartbeat.go`), an attachment Pod (`hp-volume-*`, owned by its
//!   launcher Pod) to its launcher Pod's Node; both are then written Running and Ready, and a
//!   Pod being deleted is removed as its kubelet would once the containers stopped.
//! - virt-handler's VMI sync (kubevirt/kubevirt v1.6.1, v1.7.0, v1.8.0 `pkg/virt-handler/vm.go`):
//!   a `Scheduled` VMI becomes `Running` with `selinuxContext: none` (`updateSELinuxContext` on a
//!   host without SELinux) and the interfaces the guest reports; a hot-plugged volume that
//!   virt-controller marked `AttachedToNode` is mounted into the launcher Pod (`MountedToPod`)
//!   after the bed's `hotplug_delay` (the time a real mount and attach take), then attached to
//!   the domain: a QEMU guest behind the VMI gets the claim's loop device over QMP
//!   (`device_add scsi-hd` with the disk's serial), any other VMI a link to it in the guest
//!   node's by-id directory, and the volume is `Ready` with its
//!   `target` (`updateHotplugVolumeStatus`); a volume gone from the spec is taken out of the
//!   guest and marked `UnMountedFromPod` (`canUpdateToUnmounted`), upon which virt-controller
//!   deletes the attachment Pod and the volume's status. Each volume virt-controller takes into
//!   or out of a VMI's spec is recorded as the stand-in records them (`HotplugCtx::plugs`,
//!   `unplugs`).
//! - A VMI being deleted (its VM stopped): the domain shut down, `Succeeded`
//!   (`calculateVmPhaseForStatusReason`), its hot-plugged disks gone from the guest.
//! - A host that lost power ([`NodePlay::lose_host`]): its kubelet and virt-handler do nothing.
//!
//! Every VMI write is a PUT as `kubevirt-handler` of the VMI read as admin: the handler's
//! ClusterRole has no `get` on VMIs (`pkg/virt-operator/resource/generate/rbac/handler.go`), the
//! VMI CRD no status subresource, and virt-api's VMI mutator puts back any status written by an
//! identity that is not KubeVirt's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher::Event;
use serde_json::{Value, json};

use harvester_common::harvester::kubevirt::VOLUME_READY;

use super::storage::Storage;
use super::virt_api::{
    BY_ID_PREFIX, HotplugCtx, VMI_ADD, VMI_REMOVE, link_disk, plug_into_vm, unplug_from_vm,
};
use crate::real::vm::Vm;

/// virt-handler's phase of a volume it unmounted from the launcher Pod (`HotplugVolumeUnMounted`).
const UNMOUNTED: &str = "UnMountedFromPod";

/// What the guest of a VMI reports once it runs (virt-handler fills it from the domain and the
/// guest agent).
#[derive(Clone, Debug, Default)]
pub struct GuestReport {
    /// `status.interfaces`.
    pub interfaces: Value,
    /// Conditions to add (`AgentConnected` when the guest agent answers).
    pub conditions: Vec<Value>,
}

pub struct NodePlay {
    admin: kube::Client,
    handler: kube::Client,
    namespace: String,
    storage: Arc<Storage>,
    hotplug: Arc<HotplugCtx>,
    guests: Mutex<HashMap<String, GuestReport>>,
    /// `vmi/volume` -> how its disk reached the guest.
    plugged: Mutex<HashMap<String, Plugged>>,
    /// VMI UID -> the hot-pluggable volumes last seen in its spec.
    in_spec: Mutex<HashMap<String, HashSet<String>>>,
    /// `vmi/volume` of the attaches under way (each waits the bed's hot-plug delay).
    attaching: Mutex<HashSet<String>>,
    /// Hosts that lost power: their kubelet and virt-handler do nothing any more.
    lost_hosts: Mutex<HashSet<String>>,
    /// VMIs whose guest does not boot yet: they stay `Scheduled` ([`NodePlay::hold_boot`]).
    held: Mutex<HashSet<String>>,
}

/// How a hot-plugged disk reached its guest, to take it out again.
enum Plugged {
    /// A by-id link in the guest node's directory (no QEMU guest behind the VMI).
    Link(PathBuf),
    /// Plugged into the QEMU guest behind the VMI over QMP (`Sim::create_vm_backed`).
    Guest { vm: Arc<Vm>, claim: String },
}

/// One step of virt-handler's sync of a VMI, planned from the VMI alone ([`plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `Scheduled` -> `Running`.
    Run,
    /// Hot-plug volume `volume` (claim `claim`, disk serial `serial`) into the guest.
    Attach {
        volume: String,
        claim: String,
        serial: String,
    },
    /// Take volume `volume`, gone from the spec, out of the guest.
    Detach { volume: String },
    /// The VMI is being deleted (its VM stopped): shut the domain down.
    ShutDown,
}

/// What virt-handler does next for `vmi`.
pub fn plan(vmi: &Value) -> Vec<Step> {
    let phase = vmi["status"]["phase"].as_str().unwrap_or("");
    if !vmi["metadata"]["deletionTimestamp"].is_null() {
        return match phase {
            "Scheduled" | "Running" => vec![Step::ShutDown],
            _ => Vec::new(),
        };
    }
    let mut steps = Vec::new();
    if phase == "Scheduled" {
        steps.push(Step::Run);
    }
    let volumes = vmi["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let disks = vmi["spec"]["domain"]["devices"]["disks"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for status in vmi["status"]["volumeStatus"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if status.get("hotplugVolume").is_none() {
            continue;
        }
        let Some(name) = status["name"].as_str() else {
            continue;
        };
        let phase = status["phase"].as_str().unwrap_or("");
        match volumes.iter().find(|v| v["name"] == name) {
            Some(volume) if phase == "AttachedToNode" => {
                let claim = volume["persistentVolumeClaim"]["claimName"]
                    .as_str()
                    .or(volume["dataVolume"]["name"].as_str());
                let serial = disks
                    .iter()
                    .find(|d| d["name"] == name)
                    .and_then(|d| d["serial"].as_str())
                    .unwrap_or(name);
                if let Some(claim) = claim {
                    steps.push(Step::Attach {
                        volume: name.into(),
                        claim: claim.into(),
                        serial: serial.into(),
                    });
                }
            }
            None if matches!(phase, "Ready" | "MountedToPod" | "AttachedToNode") => {
                steps.push(Step::Detach {
                    volume: name.into(),
                })
            }
            _ => {}
        }
    }
    steps
}

/// Every object of `api`, as listed and then as it changes (a watch; its errors logged, the
/// watch retried with backoff).
fn applied<K>(api: Api<K>) -> impl futures::Stream<Item = K> + Send
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    super::watch(api).filter_map(|event| async move {
        match event {
            Ok(Event::Apply(object) | Event::InitApply(object)) => Some(object),
            Ok(_) => None,
            Err(e) => {
                tracing::debug!("node play: watch: {e}");
                None
            }
        }
    })
}

/// The host names a Pod's preferred node affinity names (`kubernetes.io/hostname In [...]`).
fn preferred_hosts(pod: &Pod) -> Vec<String> {
    let terms = pod
        .spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref()?.node_affinity.as_ref())
        .and_then(|a| {
            a.preferred_during_scheduling_ignored_during_execution
                .clone()
        })
        .unwrap_or_default();
    terms
        .into_iter()
        .flat_map(|t| t.preference.match_expressions.unwrap_or_default())
        .filter(|e| e.key == "kubernetes.io/hostname" && e.operator == "In")
        .flat_map(|e| e.values.unwrap_or_default())
        .collect()
}

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "kubevirt.io",
        "v1",
        "VirtualMachineInstance",
    ))
}

/// `sda` is the boot disk; a hot-plugged disk takes the next letter no volume has.
fn next_target(vmi: &Value) -> String {
    let used: Vec<&str> = vmi["status"]["volumeStatus"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["target"].as_str())
        .collect();
    (b'b'..=b'z')
        .map(|c| format!("sd{}", c as char))
        .find(|t| !used.contains(&t.as_str()))
        .unwrap_or_else(|| "sdz".into())
}

fn volume_status<'a>(vmi: &'a mut Value, name: &str) -> Option<&'a mut Value> {
    vmi["status"]["volumeStatus"]
        .as_array_mut()?
        .iter_mut()
        .find(|s| s["name"] == name)
}

impl NodePlay {
    pub fn new(
        admin: kube::Client,
        handler: kube::Client,
        namespace: String,
        storage: Arc<Storage>,
        hotplug: Arc<HotplugCtx>,
    ) -> Arc<NodePlay> {
        Arc::new(NodePlay {
            admin,
            handler,
            namespace,
            storage,
            hotplug,
            guests: Default::default(),
            plugged: Default::default(),
            in_spec: Default::default(),
            attaching: Default::default(),
            lost_hosts: Default::default(),
            held: Default::default(),
        })
    }

    /// What the guest of VMI `name` will report once it runs.
    pub fn expect_guest(&self, name: &str, report: GuestReport) {
        self.guests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.into(), report);
    }

    /// Runs both plays until aborted.
    pub async fn run(self: Arc<NodePlay>) {
        tokio::join!(self.clone().run_pods(), self.run_vmis());
    }

    async fn run_pods(self: Arc<NodePlay>) {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), &self.namespace);
        let mut events = std::pin::pin!(applied(pods.clone()));
        while let Some(pod) = events.next().await {
            if let Err(e) = self.kubelet(&pods, &pod).await {
                let name = pod.metadata.name.as_deref().unwrap_or("");
                tracing::warn!("node play: pod {name}: {e}");
            }
        }
    }

    /// The scheduler and kubelet for one of KubeVirt's Pods.
    async fn kubelet(&self, pods: &Api<Pod>, pod: &Pod) -> Result<(), kube::Error> {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let role = labels.get("kubevirt.io").map(String::as_str);
        if !matches!(role, Some("virt-launcher" | "hotplug-disk")) {
            return Ok(());
        }
        let name = pod.metadata.name.clone().unwrap_or_default();
        let spec = pod.spec.clone().unwrap_or_default();
        if spec.node_name.as_ref().is_some_and(|n| self.is_lost(n)) {
            return Ok(());
        }
        if pod.metadata.deletion_timestamp.is_some() {
            // The containers stopped: the kubelet confirms the deletion.
            let now = DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            };
            return match pods.delete(&name, &now).await {
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                other => other.map(|_| ()),
            };
        }
        let Some(node) = spec.node_name.clone() else {
            let Some(node) = self
                .schedule(pods, pod, role == Some("hotplug-disk"))
                .await?
            else {
                return Ok(());
            };
            let binding = json!({"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": self.namespace},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}});
            return match pods
                .create_subresource::<Value, Value>(
                    "binding",
                    &name,
                    &PostParams::default(),
                    &binding,
                )
                .await
            {
                // Bound already (this watch event was older than the binding).
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                other => other.map(|_| ()),
            };
        };
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if phase == Some("Running") {
            return Ok(());
        }
        let now = jiff::Timestamp::now().to_string();
        let containers: Vec<Value> = spec
            .containers
            .iter()
            .map(|c| {
                json!({"name": c.name, "image": c.image, "imageID": "", "ready": true,
                            "restartCount": 0, "started": true,
                            "state": {"running": {"startedAt": now}}})
            })
            .collect();
        let mut conditions: Vec<Value> =
            ["PodScheduled", "Initialized", "ContainersReady", "Ready"]
                .iter()
                .map(|t| json!({"type": t, "status": "True", "lastTransitionTime": now}))
                .collect();
        for gate in spec.readiness_gates.iter().flatten() {
            conditions.push(
                json!({"type": gate.condition_type, "status": "True", "lastTransitionTime": now}),
            );
        }
        static NEXT_IP: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(2);
        let n = NEXT_IP.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ip = format!("10.244.{}.{}", (n / 250) % 250, n % 250 + 2);
        pods.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                "hostIP": "127.0.0.1", "startTime": now, "conditions": conditions,
                "containerStatuses": containers}}),
            ),
        )
        .await?;
        tracing::info!("node play: pod {name} running on {node}");
        Ok(())
    }

    /// The Node for an unbound Pod: an attachment Pod goes where its launcher Pod runs, a
    /// launcher Pod to a Node carrying every label of its nodeSelector, the one its preferred
    /// node affinity names if it is such a Node.
    async fn schedule(
        &self,
        pods: &Api<Pod>,
        pod: &Pod,
        attachment: bool,
    ) -> Result<Option<String>, kube::Error> {
        if attachment {
            let owner = pod
                .metadata
                .owner_references
                .iter()
                .flatten()
                .find(|o| o.kind == "Pod");
            let Some(owner) = owner else {
                return Ok(None);
            };
            let launcher = pods.get_opt(&owner.name).await?;
            return Ok(launcher.and_then(|p| p.spec?.node_name));
        }
        let selector: BTreeMap<String, String> = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_selector.clone())
            .unwrap_or_default();
        let nodes = Api::<Node>::all(self.admin.clone())
            .list(&ListParams::default())
            .await?;
        let fits: Vec<String> = nodes
            .items
            .into_iter()
            .filter(|n| {
                let labels = n.metadata.labels.clone().unwrap_or_default();
                selector.iter().all(|(k, v)| labels.get(k) == Some(v))
            })
            .filter_map(|n| n.metadata.name)
            .collect();
        let preferred = preferred_hosts(pod);
        let node = fits
            .iter()
            .find(|n| preferred.contains(n))
            .or(fits.first())
            .cloned();
        if node.is_none() {
            tracing::warn!(
                "node play: no Node for pod {} with nodeSelector {selector:?}",
                pod.metadata.name.as_deref().unwrap_or("")
            );
        }
        Ok(node)
    }

    async fn run_vmis(self: Arc<NodePlay>) {
        let vmis: Api<DynamicObject> =
            Api::namespaced_with(self.admin.clone(), &self.namespace, &vmi_resource());
        let mut events = std::pin::pin!(applied(vmis));
        while let Some(vmi) = events.next().await {
            let name = vmi.metadata.name.clone().unwrap_or_default();
            let Ok(value) = serde_json::to_value(&vmi) else {
                continue;
            };
            self.record_spec_changes(&name, &value);
            if value["status"]["nodeName"]
                .as_str()
                .is_some_and(|n| self.is_lost(n))
            {
                continue;
            }
            for step in plan(&value) {
                if step == Step::Run && self.is_held(&name) {
                    continue;
                }
                let Step::Attach { volume, .. } = &step else {
                    self.sync_logged(&name, &step).await;
                    continue;
                };
                // In the background: an attach takes the bed's hot-plug delay (the window a
                // test's kill lands in), while other VMIs and detaches go on.
                let key = format!("{name}/{volume}");
                if !self.lock_attaching().insert(key.clone()) {
                    continue;
                }
                let play = self.clone();
                let name = name.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(play.hotplug.delay).await;
                    play.sync_logged(&name, &step).await;
                    play.lock_attaching().remove(&key);
                });
            }
        }
    }

    /// Records each hot-pluggable volume virt-controller took into or out of VMI `name`'s spec,
    /// as the stand-in records them (`HotplugCtx::plugs`, `unplugs`).
    fn record_spec_changes(&self, name: &str, vmi: &Value) {
        let Some(uid) = vmi["metadata"]["uid"].as_str() else {
            return;
        };
        let now: HashSet<String> = vmi["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|v| v["persistentVolumeClaim"]["hotpluggable"] == true)
            .filter_map(|v| v["name"].as_str().map(String::from))
            .collect();
        let mut seen = self.in_spec.lock().unwrap_or_else(|p| p.into_inner());
        let before = seen.entry(uid.to_string()).or_default();
        for v in now.difference(before) {
            self.hotplug.record(VMI_ADD, &self.namespace, name, v);
        }
        for v in before.difference(&now) {
            self.hotplug.record(VMI_REMOVE, &self.namespace, name, v);
        }
        *before = now;
    }

    /// Host `host` loses power: from now on its kubelet confirms no Pod's deletion and writes no
    /// status, and its virt-handler writes nothing (KubeVirt's and Harvester's controllers are
    /// left to notice).
    pub fn lose_host(&self, host: &str) {
        self.lost_hosts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(host.to_string());
    }

    /// The guest of VMI `name` does not boot until [`NodePlay::release_boot`]: its VMI stays
    /// `Scheduled`, as while a VM starts.
    pub fn hold_boot(&self, name: &str) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string());
    }

    /// The guest of VMI `name` boots now (if its VMI is `Scheduled`).
    pub async fn release_boot(&self, name: &str) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        self.sync_logged(name, &Step::Run).await;
    }

    fn is_held(&self, name: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(name)
    }

    fn is_lost(&self, host: &str) -> bool {
        self.lost_hosts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(host)
    }

    fn lock_attaching(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.attaching.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn sync_logged(&self, name: &str, step: &Step) {
        if let Err(e) = self.sync(name, step).await {
            tracing::warn!("node play: VMI {name} {step:?}: {e}");
        }
    }

    /// One step, made on the VMI as it is now (read as admin, written as kubevirt-handler).
    async fn sync(&self, name: &str, step: &Step) -> Result<(), String> {
        match step {
            Step::Run => {
                let report = self
                    .guests
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(name)
                    .cloned()
                    .unwrap_or_default();
                self.update(name, |vmi| {
                    if vmi["status"]["phase"] != "Scheduled" {
                        return false;
                    }
                    let node = vmi["metadata"]["labels"]["kubevirt.io/nodeName"].clone();
                    let status = &mut vmi["status"];
                    status["phase"] = json!("Running");
                    status["selinuxContext"] = json!("none");
                    if !report.interfaces.is_null() {
                        status["interfaces"] = report.interfaces.clone();
                    }
                    if status["nodeName"].is_null() {
                        status["nodeName"] = node;
                    }
                    let mut conditions = status["conditions"]
                        .as_array_mut()
                        .map(std::mem::take)
                        .unwrap_or_default();
                    conditions.extend(report.conditions.iter().cloned());
                    status["conditions"] = json!(conditions);
                    true
                })
                .await
                .map(|_| ())
            }
            Step::Attach {
                volume,
                claim,
                serial,
            } => {
                let backing = self
                    .storage
                    .get(&self.namespace, claim)
                    .ok_or_else(|| format!("claim {claim} has no backing volume"))?;
                // The attachment Pod's volume mounted into the launcher Pod.
                let mounted = format!("Volume {volume} has been mounted in virt-launcher pod");
                let to = ["MountedToPod", "VolumeMountedToPod", &mounted];
                if !self
                    .move_volume(name, volume, &["AttachedToNode"], to)
                    .await?
                {
                    return Ok(());
                }
                // Attached to the domain: the guest sees the disk.
                let plugged = match self.hotplug.vm(name) {
                    Some(vm) => {
                        let ns = &self.namespace;
                        plug_into_vm(
                            &self.hotplug,
                            &vm,
                            ns,
                            claim,
                            volume,
                            serial,
                            &backing.device,
                        )
                        .await?;
                        Plugged::Guest {
                            vm,
                            claim: claim.clone(),
                        }
                    }
                    None => {
                        let dir = self.hotplug.by_id_dir(name);
                        link_disk(&dir, serial, &backing.device).map_err(|e| e.to_string())?;
                        Plugged::Link(dir.join(format!("{BY_ID_PREFIX}{serial}")))
                    }
                };
                self.plugged
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(format!("{name}/{volume}"), plugged);
                let ready = format!("Successfully attach hotplugged volume {volume} to VM");
                let to = [VOLUME_READY, "VolumeReady", &ready];
                self.move_volume(name, volume, &["MountedToPod"], to)
                    .await
                    .map(|_| ())
            }
            Step::ShutDown => self.shut_down(name).await,
            Step::Detach { volume } => {
                let plugged = self
                    .plugged
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&format!("{name}/{volume}"));
                if let Some(plugged) = plugged {
                    self.unplug(volume, plugged).await?;
                }
                let unmounted =
                    format!("Volume {volume} has been unmounted from virt-launcher pod");
                let to = [UNMOUNTED, "VolumeUnMountedFromPod", &unmounted];
                let from = [VOLUME_READY, "MountedToPod", "AttachedToNode"];
                self.move_volume(name, volume, &from, to).await.map(|_| ())
            }
        }
    }

    /// The domain of VMI `name` (being deleted) shut down: a domain shut off for reason
    /// `Shutdown` is `Succeeded` (kubevirt/kubevirt v1.7.0 `pkg/virt-handler/vm.go`
    /// `calculateVmPhaseForStatusReason`), the by-id links of its hot-plugged disks removed.
    /// virt-controller deletes the Pods of a VMI being deleted, then takes its finalizer off
    /// once it is final (`pkg/virt-controller/watch/vmi/lifecycle.go` `sync`, `updateStatus`).
    async fn shut_down(&self, name: &str) -> Result<(), String> {
        let prefix = format!("{name}/");
        let plugged: Vec<(String, Plugged)> = {
            let mut plugged = self.plugged.lock().unwrap_or_else(|p| p.into_inner());
            let keys: Vec<String> = plugged
                .keys()
                .filter(|k| k.starts_with(&prefix))
                .cloned()
                .collect();
            keys.into_iter()
                .filter_map(|k| plugged.remove_entry(&k))
                .collect()
        };
        for (key, disk) in plugged {
            self.unplug(&key[prefix.len()..], disk).await?;
        }
        self.update(name, |vmi| {
            if !matches!(
                vmi["status"]["phase"].as_str(),
                Some("Scheduled" | "Running")
            ) {
                return false;
            }
            vmi["status"]["phase"] = json!("Succeeded");
            true
        })
        .await
        .map(|_| ())
    }

    /// Takes the disk of `volume` out of its guest: the by-id link removed, or a QMP unplug.
    async fn unplug(&self, volume: &str, plugged: Plugged) -> Result<(), String> {
        match plugged {
            Plugged::Link(link) => {
                let _ = std::fs::remove_file(link);
                Ok(())
            }
            Plugged::Guest { vm, claim } => {
                unplug_from_vm(&self.hotplug, &vm, &self.namespace, &claim, volume).await
            }
        }
    }

    /// Moves volume `volume`'s status from a phase of `from` to `to` (phase, reason, message),
    /// with the next free target when it becomes Ready; nothing when the VMI has moved on
    /// meanwhile: the phase is another, or the volume left the spec (attach) or came back into
    /// it (unplug). Whether it moved.
    async fn move_volume(
        &self,
        name: &str,
        volume: &str,
        from: &[&str],
        to: [&str; 3],
    ) -> Result<bool, String> {
        self.update(name, |vmi| {
            let in_spec = vmi["spec"]["volumes"]
                .as_array()
                .is_some_and(|v| v.iter().any(|v| v["name"] == volume));
            let target = next_target(vmi);
            let Some(s) = volume_status(vmi, volume) else {
                return false;
            };
            if in_spec == (to[0] == UNMOUNTED) || !from.contains(&s["phase"].as_str().unwrap_or(""))
            {
                return false;
            }
            s["phase"] = json!(to[0]);
            s["reason"] = json!(to[1]);
            s["message"] = json!(to[2]);
            if to[0] == VOLUME_READY {
                s["target"] = json!(target);
            }
            true
        })
        .await
    }

    /// GET as admin, `change` (false: nothing to do), PUT as kubevirt-handler; again on a
    /// conflict. Whether it wrote.
    async fn update(
        &self,
        name: &str,
        mut change: impl FnMut(&mut Value) -> bool,
    ) -> Result<bool, String> {
        let read: Api<DynamicObject> =
            Api::namespaced_with(self.admin.clone(), &self.namespace, &vmi_resource());
        let write: Api<DynamicObject> =
            Api::namespaced_with(self.handler.clone(), &self.namespace, &vmi_resource());
        for attempt in 0..50u64 {
            let Some(vmi) = read.get_opt(name).await.map_err(|e| e.to_string())? else {
                return Ok(false);
            };
            let mut value = serde_json::to_value(&vmi).map_err(|e| e.to_string())?;
            if !change(&mut value) {
                return Ok(false);
            }
            let object: DynamicObject = serde_json::from_value(value).map_err(|e| e.to_string())?;
            match write.replace(name, &PostParams::default(), &object).await {
                Ok(_) => return Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    tokio::time::sleep(Duration::from_millis(20 * attempt.min(10))).await;
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!("VMI {name}: 50 conflicts in a row"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(phase: &str, volumes: Value, disks: Value, status: Value) -> Value {
        json!({"spec": {"volumes": volumes, "domain": {"devices": {"disks": disks}}},
               "status": {"phase": phase, "volumeStatus": status}})
    }

    #[test]
    fn virt_handler_runs_a_scheduled_vmi_and_attaches_what_virt_controller_attached() {
        let v = vmi(
            "Scheduled",
            json!([{"name": "root", "containerDisk": {}},
                   {"name": "pvc-a", "persistentVolumeClaim": {"claimName": "pvc-a", "hotpluggable": true}},
                   {"name": "pvc-b", "persistentVolumeClaim": {"claimName": "pvc-b", "hotpluggable": true}}]),
            json!([{"name": "pvc-a", "serial": "sa"}, {"name": "pvc-b"}]),
            json!([{"name": "root", "target": "sda", "phase": "Ready"},
                   {"name": "pvc-a", "phase": "AttachedToNode", "hotplugVolume": {}},
                   {"name": "pvc-b", "phase": "Bound", "hotplugVolume": {}},
                   {"name": "gone", "phase": "Ready", "target": "sdb", "hotplugVolume": {}},
                   {"name": "done", "phase": "UnMountedFromPod", "hotplugVolume": {}}]),
        );
        assert_eq!(
            plan(&v),
            [
                Step::Run,
                Step::Attach {
                    volume: "pvc-a".into(),
                    claim: "pvc-a".into(),
                    serial: "sa".into()
                },
                Step::Detach {
                    volume: "gone".into()
                },
            ]
        );
        assert_eq!(next_target(&v), "sdc", "sda and sdb are taken");
        let running = vmi("Running", json!([]), json!([]), json!([]));
        assert!(plan(&running).is_empty());
    }

    #[test]
    fn virt_handler_shuts_down_a_vmi_being_deleted_and_nothing_else() {
        let mut v = vmi(
            "Running",
            json!([]),
            json!([]),
            json!([{"name": "gone", "phase": "Ready", "hotplugVolume": {}}]),
        );
        v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        assert_eq!(plan(&v), [Step::ShutDown]);
        v["status"]["phase"] = json!("Succeeded");
        assert!(plan(&v).is_empty(), "a final VMI is virt-controller's");
    }
}
