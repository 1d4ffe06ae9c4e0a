//! ControllerPublishVolume / ControllerUnpublishVolume: KubeVirt `addvolume` / `removevolume`
//! through the Harvester API server (virt-api behind the aggregation layer), then a bounded
//! watch until the VMI says the disk is Ready (or gone).

use std::collections::HashMap;
use std::time::Duration;

use csi_proto::csi::v1::*;
use harvester_common::harvester::hotplug::{self, AddVolumeOptions, HotplugError};
use harvester_common::harvester::kubevirt::{UPDATE_VOLUMES_MIGRATION, VOLUME_READY};
use harvester_common::harvester::{
    RemoveVolumeOptions, Rest, VirtualMachine, VirtualMachineInstance,
};

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

use super::ControllerService;
use crate::error::ControllerError;
use crate::naming;
use crate::request::{self, required};

/// How often a hot-plug request is sent when other requests to the same VM keep winning the race.
const HOTPLUG_ATTEMPTS: u32 = 20;

/// How long KubeVirt may take to act on an accepted hot-plug request before a VM whose volume
/// updates go by migration is said to be one it will not hot-plug into.
const KUBEVIRT_ACTS_WITHIN: Duration = Duration::from_secs(15);

/// Publish context key carrying the disk serial to the node plugin.
pub const CONTEXT_SERIAL: &str = "serial";
/// Publish context key carrying the VMI's target (`sdb`), for information.
pub const CONTEXT_TARGET: &str = "target";

/// Whether VM `vm` has volume `volume` in its spec, and with which disk serial.
pub fn vm_volume(vm: &VirtualMachine, volume: &str) -> Option<Option<String>> {
    let spec = &vm.spec.template.spec;
    spec.volumes.iter().find(|v| v.name == volume)?;
    Some(
        spec.domain
            .devices
            .disks
            .iter()
            .find(|d| d.name == volume)
            .and_then(|d| d.serial.clone()),
    )
}

/// Whether VM `vm` mounts PVC `claim` (under any volume name).
pub fn vm_uses_claim(vm: &VirtualMachine, claim: &str) -> bool {
    vm.spec.template.spec.volumes.iter().any(|v| {
        v.persistent_volume_claim
            .as_ref()
            .is_some_and(|p| p.claim_name == claim)
    })
}

/// Whether VMI `vmi` still has volume `volume` in its spec or status.
pub fn vmi_has_volume(vmi: &VirtualMachineInstance, volume: &str) -> bool {
    vmi.spec.volumes.iter().any(|v| v.name == volume) || vmi.volume_status(volume).is_some()
}

/// Whether VMI `vmi` mounts PVC `claim`.
pub fn vmi_uses_claim(vmi: &VirtualMachineInstance, claim: &str) -> bool {
    vmi.spec.volumes.iter().any(|v| {
        v.persistent_volume_claim
            .as_ref()
            .is_some_and(|p| p.claim_name == claim)
    })
}

/// The VM, other than `node`, that already holds a single-node volume, if any (`node` empty:
/// any VM). The VMIs named in `fenced` are ignored: stopped VMs whose guest Node is out of
/// service (see [`fenced`]), whose disks no guest can use any more.
pub fn attached_elsewhere(
    claim: &str,
    node: &str,
    vms: &[VirtualMachine],
    vmis: &[VirtualMachineInstance],
    fenced: &[String],
) -> Option<String> {
    let name = |m: &kube::api::ObjectMeta| m.name.clone().unwrap_or_default();
    vms.iter()
        .filter(|vm| name(&vm.metadata) != node && vm_uses_claim(vm, claim))
        .map(|vm| name(&vm.metadata))
        .chain(
            vmis.iter()
                .filter(|vmi| {
                    let n = name(&vmi.metadata);
                    n != node && !fenced.contains(&n) && vmi_uses_claim(vmi, claim)
                })
                .map(|vmi| name(&vmi.metadata)),
        )
        .next()
}

/// The taint an administrator puts on a guest Node that is shut down for good (Kubernetes'
/// non-graceful node shutdown): its pods are force-deleted and its volumes force-detached.
pub const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// Whether guest Node `node` carries [`OUT_OF_SERVICE_TAINT`] (any value and effect).
pub fn out_of_service(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_TAINT))
}

/// Whether a VMI has stopped for good (phase Failed or Succeeded): KubeVirt never hot-unplugs
/// from it, so its spec and volumeStatus keep every disk it had.
pub fn vmi_stopped(vmi: &VirtualMachineInstance) -> bool {
    matches!(
        vmi.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded")
    )
}

/// Whether the disks of a VMI may be taken although it still lists them: it has stopped and
/// the administrator declared its guest Node out of service. A stopped VMI alone is not enough:
/// KubeVirt also marks the VMIs of an unreachable host Failed while QEMU may still run there.
pub fn fenced(vmi: &VirtualMachineInstance, node_out_of_service: bool) -> bool {
    node_out_of_service && vmi_stopped(vmi)
}

/// The guest Node of VM `vm`: the Node named like the VM, else the one whose providerID is
/// `harvester://<VM UID>` (guest hostname differs from the VM name).
pub fn guest_node_of<'a>(vm: &str, vm_uid: Option<&str>, nodes: &'a [Node]) -> Option<&'a Node> {
    nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(vm))
        .or_else(|| {
            let uid = vm_uid?;
            let want = format!("harvester://{uid}");
            nodes.iter().find(|n| {
                n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(want.as_str())
            })
        })
}

/// `(hot-plugged volumes, limit)` of VM `vm` when it cannot take another volume. The limit is
/// `configured` (`--max-volumes-per-node`, as NodeGetInfo reports it), else KubeVirt's 256
/// volumes per VMI minus the VM's own (not hot-plugged) volumes.
pub fn attach_limit_reached(vm: &VirtualMachine, configured: Option<u32>) -> Option<(i64, i64)> {
    let volumes = &vm.spec.template.spec.volumes;
    let hotplugged = volumes
        .iter()
        .filter(|v| {
            v.persistent_volume_claim
                .as_ref()
                .and_then(|p| p.hotpluggable)
                == Some(true)
        })
        .count() as i64;
    let fixed = volumes.len() as i64 - hotplugged;
    let limit = configured.map_or(crate::node::KUBEVIRT_MAX_VOLUMES - fixed, i64::from);
    (hotplugged >= limit).then_some((hotplugged, limit))
}

/// What an answer of virt-api's `addvolume`/`removevolume` means for the volume asked about.
#[derive(Debug, PartialEq, Eq)]
pub enum VirtApiAnswer {
    /// Accepted, or the change is already made or already requested: wait for the VMI.
    Done,
    /// Another request changed the VM's volumes meanwhile, or a remove of this volume is still
    /// being processed: ask again.
    Race,
    /// virt-api refuses this volume for good (the message says why).
    Refused(String),
    /// Not a hot-plug answer (API server, RBAC, network): the caller's error.
    Failed,
}

/// Reads virt-api's answer to `verb` (`addvolume` or `removevolume`). From KubeVirt v1.6.0 to
/// v1.8.3, `pkg/virt-api/rest/volumes.go`: every volume conflict is a 409 (`errors.NewConflict`)
/// with the texts matched here; the VM patch virt-api sends `test`s the lists it read (the spec's
/// volumes and disks, or with `HotplugVolumes` the VM's `status.volumeRequests`), and a lost race
/// comes back as the API server's 422 (Invalid), relayed as it is. Releases before v1.6 answered
/// 400 for the same conflicts; those texts are read the same way.
pub fn virt_api_answer(verb: &str, e: &HotplugError) -> VirtApiAnswer {
    let HotplugError::Request {
        source: kube::Error::Api(s),
        ..
    } = e
    else {
        return VirtApiAnswer::Failed;
    };
    let m = s.message.as_str();
    match (verb, s.code) {
        // A failed JSON patch `test` is the API server's bare 422; an admission webhook's refusal
        // (KubeVirt's VM admitter) is a 422 too, but says what it refused.
        (_, 422) if m.contains(PATCH_TEST_FAILED) => VirtApiAnswer::Race,
        (_, 422) => VirtApiAnswer::Refused(m.to_string()),
        ("addvolume", 400 | 409) if m.contains("because volume with that name already exists") => {
            VirtApiAnswer::Done
        }
        ("addvolume", 409) if m.contains("add volume request for volume") => {
            if m.contains("remove volume request") {
                // "unable to add volume since a remove volume request ... is still being processed"
                VirtApiAnswer::Race
            } else {
                // "add volume request for volume [X] already exists": ours, still being applied.
                VirtApiAnswer::Done
            }
        }
        ("addvolume", 409) if m.contains("remove volume request") => VirtApiAnswer::Race,
        ("addvolume", 409) if m.contains("because it already exists") => VirtApiAnswer::Refused(
            format!("the claim is already a volume of the VM under another name: {m}"),
        ),
        ("removevolume", 400 | 409) if m.contains("because it does not exist") => {
            VirtApiAnswer::Done
        }
        ("removevolume", 404) => VirtApiAnswer::Done,
        ("removevolume", 409) if m.contains("still being processed") => VirtApiAnswer::Done,
        ("removevolume", 409) if m.contains("not hotpluggable") => {
            VirtApiAnswer::Refused(m.to_string())
        }
        // Any other conflict is the VM changing under the request.
        (_, 409) => VirtApiAnswer::Race,
        _ => VirtApiAnswer::Failed,
    }
}

/// kube-apiserver's whole message for a JSON patch whose `test` failed.
const PATCH_TEST_FAILED: &str = "the server rejected our request due to an error in our request";

/// How long to back off before attempt `attempt` (1-based) of a request that lost a race: grows
/// with the attempt, spread by `seed` so that concurrent requests for one VM stop colliding.
fn race_backoff(attempt: u32, seed: &str) -> Duration {
    use std::hash::BuildHasher;
    let spread = std::collections::hash_map::RandomState::new().hash_one((seed, attempt));
    let step = 25 * u64::from(attempt.min(8));
    Duration::from_millis(step + spread % (step * 2))
}

fn describe_volume(vmi: Option<&VirtualMachineInstance>, volume: &str) -> String {
    match vmi.and_then(|v| v.volume_status(volume)) {
        None => "no volumeStatus yet".into(),
        Some(s) => format!(
            "phase {:?}, reason {:?}, message {:?}",
            s.phase.as_deref().unwrap_or(""),
            s.reason.as_deref().unwrap_or(""),
            s.message.as_deref().unwrap_or("")
        ),
    }
}

impl ControllerService {
    pub(super) async fn publish(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> Result<ControllerPublishVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        let node = required("node_id", &req.node_id)?;
        if request::capability("volume_capability", req.volume_capability.as_ref())?.is_rwx() {
            return self.publish_rwx(id, node).await;
        }
        // Which Harvester (and so which KubeVirt gates) serves us must be known, as upstream's
        // driver requires; the request itself is the same on every release.
        self.hotplug.current()?;
        let ns = self.ns().to_string();
        self.existing(id).await?;
        let vm = self.vm_or_not_found(node).await?;
        let _guard = self.begin(id)?;

        // The hot-plug pod needs a bound claim; Harvester binds it shortly after creation.
        self.wait_bound(id).await?;

        let (vms, vmis) = self.vms_and_vmis().await?;
        let fenced = self.fenced_vmis(id, node, &vms, &vmis).await?;
        if let Some(other) = attached_elsewhere(id, node, &vms, &vmis, &fenced) {
            return Err(ControllerError::AttachedElsewhere {
                volume: id.to_string(),
                node: node.to_string(),
                other,
            });
        }
        if !vmis
            .iter()
            .any(|v| v.metadata.name.as_deref() == Some(node))
        {
            return Err(ControllerError::Precondition(format!(
                "VM {ns}/{node} is not running (no VirtualMachineInstance); a disk can only be hot-plugged into a running VM"
            )));
        }

        let serial = match vm_volume(&vm, id) {
            // Already in the VM spec (a retry, or attached by the upstream driver): keep its serial.
            Some(existing) => existing,
            None => {
                if let Some((used, limit)) = attach_limit_reached(&vm, self.max_volumes_per_node) {
                    return Err(ControllerError::TooManyVolumes {
                        node: node.to_string(),
                        used,
                        limit,
                    });
                }
                let serial = naming::disk_serial(id);
                self.add_to_vm(node, id, &serial).await?;
                Some(serial)
            }
        };

        if vm.update_volumes_strategy() == Some(UPDATE_VOLUMES_MIGRATION) {
            self.wait_hotplug_started(node, id).await?;
        }
        let ready = |v: Option<&VirtualMachineInstance>| {
            v.and_then(|v| v.volume_status(id))
                .is_some_and(|s| s.phase.as_deref() == Some(VOLUME_READY))
        };
        let waited = self
            .wait_for(
                self.vmis(),
                node,
                format!("volume {id} to become {VOLUME_READY} on VMI {ns}/{node}"),
                self.timeouts.attach,
                ready,
            )
            .await;
        let vmi = match waited {
            Ok(vmi) => vmi,
            Err(ControllerError::Timeout { what, after }) => {
                let last = self.vmis().get_opt(node).await.ok().flatten();
                return Err(ControllerError::Timeout {
                    what: format!("{what} (last seen: {})", describe_volume(last.as_ref(), id)),
                    after,
                });
            }
            Err(e) => return Err(e),
        };
        let mut publish_context = HashMap::new();
        if let Some(serial) = serial {
            publish_context.insert(CONTEXT_SERIAL.to_string(), serial);
        }
        if let Some(s) = vmi.as_ref().and_then(|v| v.volume_status(id)) {
            publish_context.insert(CONTEXT_TARGET.to_string(), s.target.clone());
        }
        Ok(ControllerPublishVolumeResponse { publish_context })
    }

    pub(super) async fn unpublish(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> Result<ControllerUnpublishVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        if let Some(pv) = self.rwx_of(id).await? {
            let _guard = self.begin(id)?;
            self.unpublish_rwx(id, &pv, &req.node_id).await?;
            return Ok(ControllerUnpublishVolumeResponse {});
        }
        let _guard = self.begin(id)?;
        let nodes: Vec<String> = if req.node_id.is_empty() {
            // No node: unpublish from every VM that has it.
            let (vms, vmis) = self.vms_and_vmis().await?;
            let mut names: Vec<String> = vms
                .iter()
                .filter(|vm| vm_volume(vm, id).is_some())
                .filter_map(|vm| vm.metadata.name.clone())
                .chain(
                    vmis.iter()
                        .filter(|v| vmi_has_volume(v, id))
                        .filter_map(|v| v.metadata.name.clone()),
                )
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec![req.node_id.clone()]
        };
        for node in nodes {
            self.detach(id, &node).await?;
        }
        Ok(ControllerUnpublishVolumeResponse {})
    }

    /// Hot-plugs PVC `id` into VM `node` as disk `id` with `serial` through virt-api's VM
    /// `addvolume`, which KubeVirt v1.6+ serves under either hot-plug gate (with
    /// `HotplugVolumes` as a VM status request virt-controller applies; with only
    /// `DeclarativeHotplugVolumes` as a VM spec patch the declarative controller applies), so one
    /// request works on every Harvester release and gate combination.
    async fn add_to_vm(&self, node: &str, id: &str, serial: &str) -> Result<(), ControllerError> {
        let body = AddVolumeOptions::scsi_pvc(id, id, serial);
        let client = &self.harvester.client;
        self.hotplug_request("addvolume", node, id, || {
            hotplug::add_volume(client, self.ns(), node, &body)
        })
        .await
    }

    /// Hot-unplugs volume `id` from VM `node` through virt-api's VM `removevolume`.
    async fn remove_from_vm(&self, node: &str, id: &str) -> Result<(), ControllerError> {
        let body = RemoveVolumeOptions {
            name: id.to_string(),
            rest: Rest::new(),
        };
        let client = &self.harvester.client;
        self.hotplug_request("removevolume", node, id, || {
            hotplug::remove_volume(client, self.ns(), node, &body)
        })
        .await
    }

    /// Sends one hot-plug request, read by [`virt_api_answer`]: a race with another request to
    /// the same VM (several volumes published to one VM at once) is asked again with a growing,
    /// spread backoff, [`HOTPLUG_ATTEMPTS`] times at most.
    async fn hotplug_request<F, Fut>(
        &self,
        verb: &'static str,
        node: &str,
        id: &str,
        send: F,
    ) -> Result<(), ControllerError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<(), HotplugError>>,
    {
        for attempt in 1..=HOTPLUG_ATTEMPTS {
            let err = match send().await {
                Ok(()) => {
                    tracing::info!(volume = id, node, attempt, "{verb} accepted");
                    return Ok(());
                }
                Err(e) => e,
            };
            match virt_api_answer(verb, &err) {
                VirtApiAnswer::Done => {
                    tracing::info!(
                        volume = id,
                        node,
                        "{verb}: already done or requested: {err}"
                    );
                    return Ok(());
                }
                VirtApiAnswer::Race => {
                    tracing::debug!(volume = id, node, attempt, "{verb} lost a race: {err}");
                    tokio::time::sleep(race_backoff(attempt, id)).await;
                }
                VirtApiAnswer::Refused(why) => {
                    return Err(ControllerError::Precondition(format!(
                        "KubeVirt refused {verb} of volume {id} on VM {}/{node}: {why}",
                        self.ns()
                    )));
                }
                VirtApiAnswer::Failed => return Err(err.into()),
            }
        }
        Err(ControllerError::Contended {
            volume: id.to_string(),
            vm: format!("{}/{node}", self.ns()),
            attempts: HOTPLUG_ATTEMPTS,
        })
    }

    /// The VMIs other than `node` holding claim `id` that are [`fenced`]: stopped, on a guest Node
    /// out of service. Asks the guest API only when such a stopped VMI exists.
    pub(super) async fn fenced_vmis(
        &self,
        id: &str,
        node: &str,
        vms: &[VirtualMachine],
        vmis: &[VirtualMachineInstance],
    ) -> Result<Vec<String>, ControllerError> {
        let mut out = Vec::new();
        for vmi in vmis {
            let name = vmi.metadata.name.clone().unwrap_or_default();
            if name == node || !vmi_uses_claim(vmi, id) || !vmi_stopped(vmi) {
                continue;
            }
            let uid = vms
                .iter()
                .find(|vm| vm.metadata.name.as_deref() == Some(name.as_str()))
                .and_then(|vm| vm.metadata.uid.clone());
            if fenced(vmi, self.node_out_of_service(&name, uid.as_deref()).await?) {
                out.push(name);
            }
        }
        Ok(out)
    }

    /// Whether the guest Node of VM `vm` is tainted [`OUT_OF_SERVICE_TAINT`]. Without a guest
    /// client (none configured, none in-cluster) no Node is: nothing is ever force-detached.
    async fn node_out_of_service(
        &self,
        vm: &str,
        vm_uid: Option<&str>,
    ) -> Result<bool, ControllerError> {
        let Some(guest) = &self.guest else {
            return Ok(false);
        };
        let nodes: Api<Node> = Api::all(guest.clone());
        let found = match nodes.get_opt(vm).await {
            Ok(Some(n)) => Some(n),
            Ok(None) => {
                let all = nodes
                    .list(&Default::default())
                    .await
                    .map_err(ControllerError::guest_api("listing Nodes"))?;
                guest_node_of(vm, vm_uid, &all.items).cloned()
            }
            Err(e) => return Err(ControllerError::guest_api(format!("getting Node {vm}"))(e)),
        };
        Ok(found.as_ref().is_some_and(out_of_service))
    }

    /// Every VM and VMI of the namespace.
    pub(super) async fn vms_and_vmis(
        &self,
    ) -> Result<(Vec<VirtualMachine>, Vec<VirtualMachineInstance>), ControllerError> {
        let ns = self.ns();
        let list = |e: &'static str| ControllerError::api(format!("listing {e} in {ns}"));
        let vms = self
            .vms()
            .list(&Default::default())
            .await
            .map_err(list("VMs"))?;
        let vmis = self
            .vmis()
            .list(&Default::default())
            .await
            .map_err(list("VMIs"))?;
        Ok((vms.items, vmis.items))
    }

    /// For a VM whose `spec.updateVolumesStrategy` is `Migration`: waits, [`KUBEVIRT_ACTS_WITHIN`]
    /// at most, until KubeVirt has taken volume `id` into the VMI. With only the
    /// `DeclarativeHotplugVolumes` gate (Harvester v1.8+) it never does for such a VM
    /// (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/storage/hotplug/hotplug.go`
    /// `HandleDeclarativeVolumes` returns early); with `HotplugVolumes` on it does at once.
    async fn wait_hotplug_started(&self, node: &str, id: &str) -> Result<(), ControllerError> {
        let ns = self.ns();
        let limit = KUBEVIRT_ACTS_WITHIN.min(self.timeouts.attach);
        let listed =
            move |v: Option<&VirtualMachineInstance>| v.is_some_and(|v| vmi_has_volume(v, id));
        let what = format!("volume {id} to appear in VMI {ns}/{node}");
        match self.wait_for(self.vmis(), node, what, limit, listed).await {
            Err(ControllerError::Timeout { after, .. }) => {
                Err(ControllerError::Precondition(format!(
                    "VM {ns}/{node} has spec.updateVolumesStrategy {UPDATE_VOLUMES_MIGRATION} and KubeVirt \
                 did not hot-plug volume {id} into its VMI within {after:?}: under the \
                 DeclarativeHotplugVolumes feature gate alone (Harvester v1.8 and later) KubeVirt \
                 hot-plugs no volume into such a VM; set the VM's updateVolumesStrategy to \
                 Replacement, or enable the HotplugVolumes feature gate"
                )))
            }
            other => other.map(|_| ()),
        }
    }

    /// Removes volume `id` from VM `node` and waits until neither VM nor VMI has it. A VM or
    /// volume that does not exist is already unpublished.
    async fn detach(&self, id: &str, node: &str) -> Result<(), ControllerError> {
        let ns = self.ns().to_string();
        let vm = self
            .vms()
            .get_opt(node)
            .await
            .map_err(ControllerError::api(format!("getting VM {node}")))?;
        let vmi = self
            .vmis()
            .get_opt(node)
            .await
            .map_err(ControllerError::api(format!("getting VMI {node}")))?;
        // A stopped VMI keeps its disks: KubeVirt never unplugs from it. Only the administrator's
        // out-of-service taint on its guest Node says that no guest uses them any more.
        let stale_vmi = match &vmi {
            Some(v) if vmi_has_volume(v, id) && vmi_stopped(v) => {
                let uid = vm.as_ref().and_then(|vm| vm.metadata.uid.as_deref());
                if !fenced(v, self.node_out_of_service(node, uid).await?) {
                    return Err(ControllerError::Precondition(format!(
                        "VM {ns}/{node} is stopped, but its VMI still holds volume {id} and KubeVirt \
                         cannot unplug a disk from a stopped VMI; if the guest is shut down for \
                         good, taint its Node {OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute"
                    )));
                }
                tracing::info!(
                    volume = id,
                    node,
                    "VM is stopped and its guest Node is out of service: the stopped VMI's disk is released"
                );
                true
            }
            _ => false,
        };
        if let Some(vm) = &vm {
            let hotplugged = vm.spec.template.spec.volumes.iter().any(|v| {
                v.name == id
                    && v.persistent_volume_claim
                        .as_ref()
                        .and_then(|p| p.hotpluggable)
                        == Some(true)
            });
            if vm_volume(vm, id).is_some() && !hotplugged {
                return Err(ControllerError::Precondition(format!(
                    "volume {id} is a static (not hot-plugged) disk of VM {ns}/{node}; refusing to remove it"
                )));
            }
            if hotplugged {
                self.remove_from_vm(node, id).await?;
            }
        }
        if !stale_vmi {
            self.wait_for(
                self.vmis(),
                node,
                format!("volume {id} to leave VMI {ns}/{node}"),
                self.timeouts.detach,
                move |v: Option<&VirtualMachineInstance>| v.is_none_or(|v| !vmi_has_volume(v, id)),
            )
            .await?;
        }
        if vm.is_some() {
            self.wait_for(
                self.vms(),
                node,
                format!("volume {id} to leave VM {ns}/{node}"),
                self.timeouts.detach,
                move |v: Option<&VirtualMachine>| v.is_none_or(|v| vm_volume(v, id).is_none()),
            )
            .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vm(name: &str, volumes: &[(&str, &str, Option<&str>)]) -> VirtualMachine {
        let vols: Vec<_> = volumes
            .iter()
            .map(|(n, c, _)| json!({"name": n, "persistentVolumeClaim": {"claimName": c, "hotpluggable": true}}))
            .collect();
        let disks: Vec<_> = volumes
            .iter()
            .map(|(n, _, s)| json!({"name": n, "serial": s, "disk": {"bus": "scsi"}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name},
            "spec": {"template": {"spec": {"volumes": vols, "domain": {"devices": {"disks": disks}}}}}
        }))
        .expect("vm literal")
    }

    fn vmi(name: &str, claims: &[&str]) -> VirtualMachineInstance {
        let vols: Vec<_> = claims
            .iter()
            .map(|c| json!({"name": c, "persistentVolumeClaim": {"claimName": c}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name}, "spec": {"volumes": vols}
        }))
        .expect("vmi literal")
    }

    #[test]
    fn a_single_node_volume_held_by_another_vm_is_found() {
        let vms = [vm("w1", &[("v1", "v1", Some("s1"))]), vm("w2", &[])];
        assert_eq!(
            attached_elsewhere("v1", "w2", &vms, &[], &[]),
            Some("w1".into())
        );
        assert_eq!(
            attached_elsewhere("v1", "w1", &vms, &[], &[]),
            None,
            "same node is fine"
        );
        assert_eq!(
            attached_elsewhere("v1", "", &vms, &[], &[]),
            Some("w1".into()),
            "no node: any VM (DeleteVolume)"
        );
        assert_eq!(attached_elsewhere("v2", "w2", &vms, &[], &[]), None);
        // A VMI still holding it (VM spec already cleaned up) counts too...
        assert_eq!(
            attached_elsewhere("v9", "w2", &vms, &[vmi("w3", &["v9"])], &[]),
            Some("w3".into())
        );
        // ...unless it is fenced (stopped, guest Node out of service).
        assert_eq!(
            attached_elsewhere("v9", "w2", &vms, &[vmi("w3", &["v9"])], &["w3".into()]),
            None
        );
    }

    fn node(name: &str, provider_id: Option<&str>, taints: &[&str]) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"providerID": provider_id,
                     "taints": taints.iter().map(|k| json!({"key": k, "value": "nodeshutdown", "effect": "NoExecute"})).collect::<Vec<_>>()}
        }))
        .expect("node literal")
    }

    #[test]
    fn only_a_stopped_vmi_on_an_out_of_service_node_is_fenced() {
        let with_phase = |phase: &str| {
            let mut v = vmi("w1", &["v1"]);
            v.status = Some(serde_json::from_value(json!({"phase": phase})).unwrap());
            v
        };
        // (VMI phase, Node tainted out-of-service) -> fenced
        for (phase, tainted, want) in [
            ("Failed", true, true),
            ("Succeeded", true, true),
            ("Failed", false, false),
            ("Running", true, false),
            ("Scheduled", true, false),
        ] {
            assert_eq!(
                fenced(&with_phase(phase), tainted),
                want,
                "{phase} {tainted}"
            );
        }
        assert!(out_of_service(&node("w1", None, &[OUT_OF_SERVICE_TAINT])));
        assert!(!out_of_service(&node(
            "w1",
            None,
            &["node.kubernetes.io/unreachable"]
        )));
    }

    #[test]
    fn the_guest_node_is_found_by_name_then_provider_id() {
        let nodes = [
            node("host-a", Some("harvester://uid-a"), &[]),
            node("w2", Some("harvester://uid-2"), &[]),
        ];
        let name = |n: Option<&Node>| n.and_then(|n| n.metadata.name.clone());
        assert_eq!(
            name(guest_node_of("w2", Some("uid-x"), &nodes)),
            Some("w2".into())
        );
        assert_eq!(
            name(guest_node_of("vm-a", Some("uid-a"), &nodes)),
            Some("host-a".into())
        );
        assert_eq!(name(guest_node_of("vm-b", Some("uid-b"), &nodes)), None);
        assert_eq!(name(guest_node_of("vm-a", None, &nodes)), None);
    }

    #[test]
    fn the_attach_limit_counts_hot_plugged_volumes() {
        let w = vm("w1", &[("v1", "v1", Some("a")), ("v2", "v2", Some("b"))]);
        assert_eq!(attach_limit_reached(&w, Some(2)), Some((2, 2)));
        assert_eq!(attach_limit_reached(&w, Some(3)), None);
        assert_eq!(attach_limit_reached(&w, None), None, "KubeVirt's 256");
    }

    fn virt_api(code: u16, text: &str) -> HotplugError {
        HotplugError::Request {
            verb: "addvolume",
            namespace: "ns".into(),
            vm: "w1".into(),
            volume: "v1".into(),
            source: kube::Error::Api(
                kube::core::Status::failure(
                    &format!(
                        "Operation cannot be fulfilled on virtualmachine.kubevirt.io \"w1\": {text}"
                    ),
                    "Conflict",
                )
                .with_code(code)
                .boxed(),
            ),
        }
    }

    #[test]
    fn virt_api_answers_are_read_by_what_they_mean() {
        use VirtApiAnswer::*;
        // kubevirt/kubevirt v1.6.0-v1.8.3 pkg/virt-api/rest/volumes.go: (verb, code, text) -> meaning
        let rows: [(&str, u16, &str, VirtApiAnswer); 14] = [
            (
                "addvolume",
                409,
                "Unable to add volume [v1] because volume with that name already exists",
                Done,
            ),
            (
                "addvolume",
                409,
                "add volume request for volume [v1] already exists",
                Done,
            ),
            (
                "addvolume",
                409,
                "unable to add volume since a remove volume request for volume [v1] already exists and is still being processed",
                Race,
            ),
            (
                "addvolume",
                409,
                "Unable to add volume source [v1] because it already exists",
                Refused(String::new()),
            ),
            (
                "removevolume",
                409,
                "Unable to remove volume [v1] because it does not exist",
                Done,
            ),
            (
                "removevolume",
                409,
                "a remove volume request for volume [v1] already exists and is still being processed",
                Done,
            ),
            (
                "removevolume",
                409,
                "Unable to remove volume [v1] because it is not hotpluggable",
                Refused(String::new()),
            ),
            // A lost race on the VM's lists: the API server's 422, relayed.
            (
                "addvolume",
                422,
                "the server rejected our request due to an error in our request",
                Race,
            ),
            (
                "removevolume",
                422,
                "the server rejected our request due to an error in our request",
                Race,
            ),
            // KubeVirt's admission webhooks refusing the VM (declarative) or VM status
            // (HotplugVolumes) patch virt-api sent, as the bed plays them: their message
            // (pkg/storage/admitters/disks.go, storagehotplug.go, v1.7.0).
            (
                "addvolume",
                422,
                "admission webhook \"virtualmachine-validator.kubevirt.io\" denied the request: spec.template.spec.domain.devices.disks[1] must be made up of the following characters [A-Za-z0-9_.+-], if specified",
                Refused(String::new()),
            ),
            (
                "addvolume",
                422,
                "admission webhook \"kubevirt-crd-status-validator.kubevirt.io\" denied the request: AddVolume request for disk [v1] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted.",
                Refused(String::new()),
            ),
            // KubeVirt before v1.6 answered 400 for the same conflicts.
            (
                "addvolume",
                400,
                "Unable to add volume [v1] because volume with that name already exists",
                Done,
            ),
            (
                "removevolume",
                404,
                "virtualmachine.kubevirt.io \"w1\" not found",
                Done,
            ),
            ("addvolume", 500, "unable to patch vm status: boom", Failed),
        ];
        for (verb, code, text, want) in rows {
            let got = virt_api_answer(verb, &virt_api(code, text));
            match (&got, &want) {
                (Refused(why), Refused(_)) => assert!(why.contains(text), "{why}"),
                _ => assert_eq!(got, want, "{verb} {code} {text}"),
            }
        }
        assert_eq!(
            virt_api_answer("addvolume", &HotplugError::Build("x".into())),
            Failed
        );
    }

    #[test]
    fn race_backoff_grows_and_stays_bounded() {
        for attempt in 1..=30 {
            let d = race_backoff(attempt, "v1");
            let step = 25 * u64::from(attempt.min(8));
            assert!(d >= Duration::from_millis(step), "{attempt}: {d:?}");
            assert!(d < Duration::from_millis(step * 3), "{attempt}: {d:?}");
        }
    }

    #[test]
    fn vm_volume_reports_the_existing_serial() {
        let w = vm("w1", &[("v1", "v1", Some("abc")), ("v2", "v2", None)]);
        assert_eq!(vm_volume(&w, "v1"), Some(Some("abc".into())));
        assert_eq!(vm_volume(&w, "v2"), Some(None));
        assert_eq!(vm_volume(&w, "v3"), None);
    }
}
