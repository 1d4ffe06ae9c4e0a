//! The one watch of the Harvester namespace's VMs and VMIs (a kube reflector [`Store`] each,
//! started with the controller), so that no volume operation lists the namespace: publish,
//! unpublish and delete ask it who *may* hold a claim, then read those few by name.
//!
//! Staleness, and why the decisions stay safe:
//! - A holder the cache still shows but that let the claim go is read fresh by name before any
//!   decision ([`crate::controller::hotplug`]), so a stale entry never refuses a volume.
//! - The driver's own changes are waited for *on this cache* (the VMI Ready after `addvolume`,
//!   the volume gone after `removevolume`), so an operation returns only once the cache has seen
//!   its effect; the next operation on the volume (serialised by the in-flight guard) sees it.
//! - A change made by someone else (a claim added to a VM by hand) is seen after the watch's
//!   latency; a namespace list had the same window (list, then `addvolume`, is not atomic). The
//!   host PVC keeps Kubernetes' `kubernetes.io/pvc-protection` finalizer while KubeVirt's hot-plug
//!   pod uses it, so even a DeleteVolume in that window cannot take the disk from a running VM.
//!
//! What is stored is stripped of what is never read (managedFields, annotations, the VMI's
//! domain, the VM's status but for its pending hot-plug requests) to keep the cache small at
//! hundreds of VMs.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use harvester_common::harvester::kubevirt::{VOLUME_REQUESTS, VirtualMachineStatus};
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};

use crate::error::ControllerError;

/// How long an RPC waits for the first full list of VMs and VMIs before answering UNAVAILABLE.
const FIRST_SYNC: Duration = Duration::from_secs(30);

/// The watched VMs and VMIs of one namespace; dropping it stops both watches.
pub struct VmCache {
    namespace: String,
    vms: Store<VirtualMachine>,
    vmis: Store<VirtualMachineInstance>,
    /// Bumped on every event of either watch: what the waits below sleep on.
    changed: tokio::sync::watch::Receiver<u64>,
    tasks: Vec<tokio::task::AbortHandle>,
}

impl Drop for VmCache {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl VmCache {
    /// Starts both watches (on the current Tokio runtime).
    pub fn start(client: &kube::Client, namespace: &str) -> VmCache {
        let (tx, changed) = tokio::sync::watch::channel(0u64);
        let tx = Arc::new(tx);
        let (vms, vm_writer) = reflector::store();
        let (vmis, vmi_writer) = reflector::store();
        let vm_api: Api<VirtualMachine> = Api::namespaced(client.clone(), namespace);
        let vmi_api: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), namespace);
        let tasks = vec![
            tokio::spawn(follow("VMs", vm_api, strip_vm, vm_writer, tx.clone())).abort_handle(),
            tokio::spawn(follow("VMIs", vmi_api, strip_vmi, vmi_writer, tx)).abort_handle(),
        ];
        VmCache {
            namespace: namespace.to_string(),
            vms,
            vmis,
            changed,
            tasks,
        }
    }

    /// Waits (bounded) for the first full list of both; UNAVAILABLE when it does not come.
    async fn synced(&self) -> Result<(), ControllerError> {
        let both = async {
            let _ = tokio::join!(self.vms.wait_until_ready(), self.vmis.wait_until_ready());
        };
        tokio::time::timeout(FIRST_SYNC, both).await.map_err(|_| {
            ControllerError::NotReady(format!(
                "the watch of VMs and VMIs in {} has not listed them within {FIRST_SYNC:?}",
                self.namespace
            ))
        })
    }

    /// Names of the VMs whose spec, and of the VMIs whose spec or status, name claim or volume
    /// `id`: who may hold it, to be read fresh before a decision.
    pub async fn may_hold(&self, id: &str) -> Result<(Vec<String>, Vec<String>), ControllerError> {
        self.synced().await?;
        let mut vms: Vec<String> = self
            .vms
            .state_filter(|vm| vm.uses_claim(id) || vm.volume(id).is_some())
            .iter()
            .map(|vm| vm.name_any())
            .collect();
        let mut vmis: Vec<String> = self
            .vmis
            .state_filter(|v| v.uses_claim(id) || v.has_volume(id))
            .iter()
            .map(|v| v.name_any())
            .collect();
        vms.sort();
        vmis.sort();
        Ok((vms, vmis))
    }

    /// Every cached VM and VMI (ListVolumes, ControllerGetVolume: no decision rests on them).
    pub async fn all(
        &self,
    ) -> Result<(Vec<Arc<VirtualMachine>>, Vec<Arc<VirtualMachineInstance>>), ControllerError> {
        self.synced().await?;
        Ok((self.vms.state(), self.vmis.state()))
    }

    /// Waits, `limit` at most, until `cond` holds of VMI `name` as cached (`None`: no such
    /// VMI); the VMI as last seen. `what` names the wait in the timeout error.
    pub async fn wait_vmi(
        &self,
        name: &str,
        what: String,
        limit: Duration,
        cond: impl Fn(Option<&VirtualMachineInstance>) -> bool,
    ) -> Result<Option<Arc<VirtualMachineInstance>>, ControllerError> {
        let key = ObjectRef::new(name).within(&self.namespace);
        self.wait(|| self.vmis.get(&key), what, limit, cond).await
    }

    /// As [`Self::wait_vmi`], for VM `name`.
    pub async fn wait_vm(
        &self,
        name: &str,
        what: String,
        limit: Duration,
        cond: impl Fn(Option<&VirtualMachine>) -> bool,
    ) -> Result<Option<Arc<VirtualMachine>>, ControllerError> {
        let key = ObjectRef::new(name).within(&self.namespace);
        self.wait(|| self.vms.get(&key), what, limit, cond).await
    }

    /// The resourceVersions of VM and VMI `name` as cached (`None`: not cached): what
    /// [`Self::wait_change`] compares with.
    pub async fn versions(&self, name: &str) -> Result<Versions, ControllerError> {
        self.synced().await?;
        Ok(self.versions_now(name))
    }

    /// Waits, `limit` at most, until VM or VMI `name` as cached differs from `seen`.
    pub async fn wait_change(
        &self,
        name: &str,
        seen: Versions,
        what: String,
        limit: Duration,
    ) -> Result<(), ControllerError> {
        let read = || Some(Arc::new(self.versions_now(name)));
        self.wait(read, what, limit, |now| now != Some(&seen))
            .await
            .map(|_| ())
    }

    fn versions_now(&self, name: &str) -> Versions {
        let vm = self.vms.get(&ObjectRef::new(name).within(&self.namespace));
        let vmi = self.vmis.get(&ObjectRef::new(name).within(&self.namespace));
        Versions::of(vm.as_deref(), vmi.as_deref())
    }

    async fn wait<K>(
        &self,
        read: impl Fn() -> Option<Arc<K>>,
        what: String,
        limit: Duration,
        cond: impl Fn(Option<&K>) -> bool,
    ) -> Result<Option<Arc<K>>, ControllerError> {
        let deadline = tokio::time::Instant::now() + limit;
        self.synced().await?;
        let mut changed = self.changed.clone();
        loop {
            // Marked seen before the read, so an event after the read wakes the next wait.
            changed.borrow_and_update();
            let now = read();
            if cond(now.as_deref()) {
                return Ok(now);
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    return Err(ControllerError::NotReady(format!(
                        "the watch of VMs and VMIs in {} stopped",
                        self.namespace
                    )));
                }
                Err(_) => return Err(ControllerError::Timeout { what, after: limit }),
            }
        }
    }
}

/// The resourceVersions of a VM and its VMI (`None`: absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versions(Option<String>, Option<String>);

impl Versions {
    fn of(vm: Option<&VirtualMachine>, vmi: Option<&VirtualMachineInstance>) -> Versions {
        Versions(
            vm.and_then(|v| v.metadata.resource_version.clone()),
            vmi.and_then(|v| v.metadata.resource_version.clone()),
        )
    }
}

/// Runs one watch into `writer` until aborted, retrying with kube's default backoff, bumping
/// `tx` after every event.
fn follow<K>(
    what: &'static str,
    api: Api<K>,
    strip: fn(&mut K),
    writer: reflector::store::Writer<K>,
    tx: Arc<tokio::sync::watch::Sender<u64>>,
) -> impl Future<Output = ()> + Send + 'static
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + Send
        + Sync
        + serde::de::DeserializeOwned
        + 'static,
{
    watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(strip)
        .reflect(writer)
        .for_each(move |event| {
            if let Err(e) = &event {
                tracing::warn!("watch of Harvester {what}: {e}");
            }
            tx.send_modify(|n| *n = n.wrapping_add(1));
            std::future::ready(())
        })
}

/// Keeps of a VM what the hot-plug rules read: name, UID, volumes, disks and pending hot-plug
/// requests (`status.volumeRequests`).
fn strip_vm(vm: &mut VirtualMachine) {
    vm.metadata.managed_fields = None;
    vm.metadata.annotations = None;
    vm.status = vm.status.take().map(|s| {
        let mut kept = VirtualMachineStatus::default();
        if let Some(r) = s.rest.get(VOLUME_REQUESTS) {
            kept.rest.insert(VOLUME_REQUESTS.into(), r.clone());
        }
        kept
    });
    let spec = &mut vm.spec.template.spec;
    spec.networks.clear();
    spec.rest.clear();
    spec.domain.rest.clear();
    spec.domain.devices.rest.clear();
}

/// Keeps of a VMI what the hot-plug rules read: name, volumes, phase and volume statuses.
fn strip_vmi(vmi: &mut VirtualMachineInstance) {
    vmi.metadata.managed_fields = None;
    vmi.metadata.annotations = None;
    vmi.spec.domain = Default::default();
    vmi.spec.networks.clear();
    vmi.spec.rest.clear();
    if let Some(s) = vmi.status.as_mut() {
        s.interfaces.clear();
        s.rest.clear();
    }
}
