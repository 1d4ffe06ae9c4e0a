//! ControllerPublishVolume / ControllerUnpublishVolume of a hot-plugged volume: KubeVirt
//! `addvolume` / `removevolume` through the Harvester API server (virt-api behind the
//! aggregation layer), then a bounded watch until the VMI says the disk is Ready (or gone).
//! Who else holds the volume is read by [`Hotplug::holders`]: the watch cache names who may
//! ([`crate::controller::vm_cache`]), each is read fresh by name; no request lists the
//! namespace. The waits for KubeVirt watch that same cache, so an RPC returns only once the
//! cache has seen its effect.

use std::collections::HashMap;
use std::time::Duration;

use csi_proto::csi::v1::*;
use harvester_common::harvester::hotplug::{self, AddVolumeOptions, HotplugError};
use harvester_common::harvester::kubevirt::{
    CONTEXT_SERIAL, UPDATE_VOLUMES_MIGRATION, VOLUME_READY,
};
use harvester_common::harvester::{
    RemoveVolumeOptions, Rest, VirtualMachine, VirtualMachineInstance,
};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

use super::Hotplug;
use super::rules::{
    VirtApiAnswer, attach_limit_reached, attached_elsewhere, describe_volume, guest_node_of,
    out_of_service, patch_lost_race, race_backoff, virt_api_answer,
};
use super::unplug::{self, SpecEdit, Step};
use crate::error::ControllerError;
use crate::naming;

/// How often a hot-plug request is sent when other requests to the same VM keep winning the race.
const HOTPLUG_ATTEMPTS: u32 = 20;

/// How long KubeVirt may take to act on an accepted hot-plug request before a VM whose volume
/// updates go by migration is said to be one it will not hot-plug into.
const KUBEVIRT_ACTS_WITHIN: Duration = Duration::from_secs(15);

/// Publish context key carrying the VMI's target (`sdb`), for information.
pub const CONTEXT_TARGET: &str = "target";

impl Hotplug<'_> {
    /// Hot-plugs volume `id` into VM `node` and waits until the VMI reports the disk Ready.
    pub async fn publish(
        &self,
        id: &str,
        node: &str,
    ) -> Result<ControllerPublishVolumeResponse, ControllerError> {
        // Which Harvester (and so which KubeVirt gates) serves us must be known, as upstream's
        // driver requires; the request itself is the same on every release.
        self.modes.current()?;
        let ns = self.ns().to_string();
        self.existing(id).await?;
        let vm = self.vm_or_not_found(node).await?;
        let _guard = self.begin(id)?;

        // The hot-plug pod needs a bound claim; Harvester binds it shortly after creation.
        self.wait_bound(id).await?;

        let (vms, vmis) = self.holders(id).await?;
        let fenced = self.fenced_vmis(id, node, &vms, &vmis).await?;
        if let Some(other) = attached_elsewhere(id, node, &vms, &vmis, &fenced) {
            return Err(ControllerError::AttachedElsewhere {
                volume: id.to_string(),
                node: node.to_string(),
                other,
            });
        }
        let running = self
            .vmis()
            .get_opt(node)
            .await
            .map_err(ControllerError::api(format!("getting VMI {node}")))?;
        let Some(running) = running else {
            return Err(ControllerError::Precondition(format!(
                "VM {ns}/{node} is not running (no VirtualMachineInstance); a disk can only be hot-plugged into a running VM"
            )));
        };

        let serial = match vm.volume(id) {
            // In the VM spec but gone from the VMI (harvester#10588): brought back.
            // (A VM that updates volumes by migration is left to `wait_hotplug_started` below.)
            Some(existing)
                if !running.has_volume(id)
                    && vm.update_volumes_strategy() != Some(UPDATE_VOLUMES_MIGRATION) =>
            {
                let serial = existing.unwrap_or_else(|| naming::disk_serial(id));
                self.rejoin(node, id, &serial).await?;
                Some(serial)
            }
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
            .vm_cache
            .wait_vmi(
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

    /// Hot-unplugs volume `id` from VM `node_id` (empty: from every VM that has it). The
    /// caller holds the volume's in-flight guard.
    pub async fn unpublish(&self, id: &str, node_id: &str) -> Result<(), ControllerError> {
        let nodes: Vec<String> = if node_id.is_empty() {
            // No node: unpublish from every VM that may have it (`detach` reads each fresh).
            let (vms, vmis) = self.vm_cache.may_hold(id).await?;
            let mut names: Vec<String> = vms.into_iter().chain(vmis).collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec![node_id.to_string()]
        };
        for node in nodes {
            self.detach(id, &node).await?;
        }
        Ok(())
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

    /// The VMIs other than `node` holding claim `id` that are fenced
    /// ([`VirtualMachineInstance::fenced`]): not running, on a guest Node out of service. Asks
    /// the guest API only when such a VMI exists.
    pub async fn fenced_vmis(
        &self,
        id: &str,
        node: &str,
        vms: &[VirtualMachine],
        vmis: &[VirtualMachineInstance],
    ) -> Result<Vec<String>, ControllerError> {
        let mut out = Vec::new();
        for vmi in vmis {
            let name = vmi.metadata.name.clone().unwrap_or_default();
            if name == node || !vmi.uses_claim(id) || vmi.running() {
                continue;
            }
            // The VM's UID finds a guest Node named otherwise; a VMI whose VM no longer names
            // the claim carries it in its controller reference (KubeVirt's VM controller sets it).
            let uid = vms
                .iter()
                .find(|vm| vm.metadata.name.as_deref() == Some(name.as_str()))
                .and_then(|vm| vm.metadata.uid.clone())
                .or_else(|| owner_vm_uid(vmi));
            if vmi.fenced(self.node_out_of_service(&name, uid.as_deref()).await?) {
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

    /// The VMs and VMIs holding claim `id`, read fresh by name: the watch cache names who may
    /// (a stale name is read and dropped here), so no request lists the namespace.
    pub async fn holders(
        &self,
        id: &str,
    ) -> Result<(Vec<VirtualMachine>, Vec<VirtualMachineInstance>), ControllerError> {
        let (vm_names, vmi_names) = self.vm_cache.may_hold(id).await?;
        let mut vms = Vec::new();
        for name in vm_names {
            let vm = self.vms().get_opt(&name).await;
            vms.extend(vm.map_err(ControllerError::api(format!("getting VM {name}")))?);
        }
        let mut vmis = Vec::new();
        for name in vmi_names {
            let vmi = self.vmis().get_opt(&name).await;
            vmis.extend(vmi.map_err(ControllerError::api(format!("getting VMI {name}")))?);
        }
        Ok((vms, vmis))
    }

    /// For a VM whose `spec.updateVolumesStrategy` is `Migration`: waits, [`KUBEVIRT_ACTS_WITHIN`]
    /// at most, until KubeVirt has taken volume `id` into the VMI. With only the
    /// `DeclarativeHotplugVolumes` gate (Harvester v1.8+) it never does for such a VM
    /// (kubevirt/kubevirt v1.6.0-v1.8.3 `pkg/storage/hotplug/hotplug.go`
    /// `HandleDeclarativeVolumes` returns early); with `HotplugVolumes` on it does at once.
    async fn wait_hotplug_started(&self, node: &str, id: &str) -> Result<(), ControllerError> {
        let ns = self.ns();
        let limit = KUBEVIRT_ACTS_WITHIN.min(self.timeouts.attach);
        let listed = move |v: Option<&VirtualMachineInstance>| v.is_some_and(|v| v.has_volume(id));
        let what = format!("volume {id} to appear in VMI {ns}/{node}");
        match self.vm_cache.wait_vmi(node, what, limit, listed).await {
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

    /// For a VM whose `spec.updateVolumesStrategy` is `Migration`: waits, [`KUBEVIRT_ACTS_WITHIN`]
    /// at most, until KubeVirt has begun to unplug volume `id` (the VMI's spec no longer lists
    /// it). With only the `DeclarativeHotplugVolumes` gate it never does for such a VM (the same
    /// early return as for a hot-plug; Harvester v1.8 sets `Migration` on every VM it
    /// storage-migrates), so unpublish says so instead of waiting out its bound on every retry.
    async fn wait_unplug_started(&self, node: &str, id: &str) -> Result<(), ControllerError> {
        let ns = self.ns();
        let limit = KUBEVIRT_ACTS_WITHIN.min(self.timeouts.detach);
        let unlisted = move |v: Option<&VirtualMachineInstance>| {
            v.is_none_or(|v| !v.spec.volumes.iter().any(|vol| vol.name == id))
        };
        let what = format!("volume {id} to leave VMI {ns}/{node}'s spec");
        match self.vm_cache.wait_vmi(node, what, limit, unlisted).await {
            Err(ControllerError::Timeout { after, .. }) => {
                Err(ControllerError::Precondition(format!(
                    "VM {ns}/{node} has spec.updateVolumesStrategy {UPDATE_VOLUMES_MIGRATION} and KubeVirt \
                 did not begin to unplug volume {id} from its VMI within {after:?}: under the \
                 DeclarativeHotplugVolumes feature gate alone (Harvester v1.8 and later) KubeVirt \
                 unplugs no volume from such a VM, so the disk stays attached; set the VM's \
                 updateVolumesStrategy to Replacement (cancel its storage migration), or enable \
                 the HotplugVolumes feature gate"
                )))
            }
            other => other.map(|_| ()),
        }
    }

    /// Volume `id` is in VM `node`'s spec but not in its VMI: the disk left behind the driver's
    /// back (harvester#10588, #9761). KubeVirt gets [`KUBEVIRT_ACTS_WITHIN`] to take it in (its
    /// declarative controller does); otherwise it is removed from the VM and added again, as the
    /// `HotplugVolumes` path needs: there virt-controller applies requests only (kubevirt/kubevirt
    /// v1.6.0 `pkg/virt-controller/watch/vm/vm.go` `handleVolumeRequests`).
    async fn rejoin(&self, node: &str, id: &str, serial: &str) -> Result<(), ControllerError> {
        let ns = self.ns();
        let limit = KUBEVIRT_ACTS_WITHIN.min(self.timeouts.attach);
        let listed = move |v: Option<&VirtualMachineInstance>| v.is_some_and(|v| v.has_volume(id));
        let what = format!("volume {id} to come back into VMI {ns}/{node}");
        match self.vm_cache.wait_vmi(node, what, limit, listed).await {
            Ok(_) => return Ok(()),
            Err(ControllerError::Timeout { .. }) => {}
            Err(e) => return Err(e),
        }
        tracing::warn!(
            volume = id,
            node,
            "in the VM spec but not in its VMI: removing it from the VM and hot-plugging it again"
        );
        self.remove_from_vm(node, id).await?;
        self.wait_left_vm(node, id).await?;
        self.add_to_vm(node, id, serial).await
    }

    /// Waits (the cache, [`crate::Timeouts::detach`] at most) until VM `node` no longer has
    /// volume `id` in its spec.
    async fn wait_left_vm(&self, node: &str, id: &str) -> Result<(), ControllerError> {
        let what = format!("volume {id} to leave VM {}/{node}", self.ns());
        let gone = move |v: Option<&VirtualMachine>| v.is_none_or(|v| v.volume(id).is_none());
        self.vm_cache
            .wait_vm(node, what, self.timeouts.detach, gone)
            .await
            .map(|_| ())
    }

    /// Takes volume `id` out of VM `node` and waits until neither the VM (spec, pending add) nor a
    /// VMI that may run again holds it: the [`unplug::plan`]'s steps, each planned on a fresh read
    /// and followed by a wait (on the cache) for the VM or VMI to change, within
    /// [`crate::Timeouts::detach`]. A VM or volume that does not exist is already unpublished.
    async fn detach(&self, id: &str, node: &str) -> Result<(), ControllerError> {
        let ns = self.ns().to_string();
        let started = tokio::time::Instant::now();
        let mut out_of_service = None;
        let mut owner_checked = false;
        loop {
            // Read before the fresh reads, so that any change after them ends the wait below.
            let seen = self.vm_cache.versions(node).await?;
            let vm = self
                .vms()
                .get_opt(node)
                .await
                .map_err(ControllerError::api(format!("getting VM {node}")))?;
            if let Some(vm) = vm.as_ref().filter(|_| !owner_checked) {
                self.owner.check_vm(&ns, &vm.metadata)?;
                owner_checked = true;
            }
            let vmi = self
                .vmis()
                .get_opt(node)
                .await
                .map_err(ControllerError::api(format!("getting VMI {node}")))?;
            let fenced = match &vmi {
                Some(v) if !v.running() && v.has_volume(id) => {
                    let uid = vm.as_ref().and_then(|vm| vm.metadata.uid.as_deref());
                    let tainted = match out_of_service {
                        Some(t) => t,
                        None => *out_of_service.insert(self.node_out_of_service(node, uid).await?),
                    };
                    v.fenced(tainted)
                }
                _ => false,
            };
            let step = unplug::plan(&ns, node, id, vm.as_ref(), vmi.as_ref(), fenced);
            let waiting_for = match step {
                Step::Done => {
                    if fenced {
                        tracing::info!(
                            volume = id,
                            node,
                            "the VMI does not run and its guest Node is out of service: its disk is released"
                        );
                    }
                    return Ok(());
                }
                Step::Refuse(why) => return Err(ControllerError::Precondition(why)),
                Step::RemoveVolume => {
                    self.remove_from_vm(node, id).await?;
                    let live = vmi
                        .as_ref()
                        .is_some_and(|v| v.has_volume(id) && !v.stopped());
                    let migrating = vm.as_ref().and_then(|v| v.update_volumes_strategy())
                        == Some(UPDATE_VOLUMES_MIGRATION);
                    if live && migrating {
                        self.wait_unplug_started(node, id).await?;
                    }
                    format!(
                        "KubeVirt to act on the removevolume of volume {id} from VM {ns}/{node}"
                    )
                }
                Step::Edit(edit) => {
                    self.edit_stopped_vm(node, id, &edit).await?;
                    format!("the edit of VM {ns}/{node}'s volumes to be seen")
                }
                Step::Wait(what) => what,
            };
            let left = self.timeouts.detach.saturating_sub(started.elapsed());
            self.vm_cache
                .wait_change(node, seen, waiting_for, left)
                .await
                .map_err(|e| match e {
                    ControllerError::Timeout { what, .. } => ControllerError::Timeout {
                        what,
                        after: self.timeouts.detach,
                    },
                    other => other,
                })?;
        }
    }

    /// The VM spec edit virt-controller does not make while VM `node`'s VMI has stopped (see
    /// [`unplug`]): a JSON patch that tests the volume and disk lists as read, so a VM changed
    /// meanwhile is planned again, not overwritten. Needs `patch` on `virtualmachines`.
    async fn edit_stopped_vm(
        &self,
        node: &str,
        id: &str,
        edit: &SpecEdit,
    ) -> Result<(), ControllerError> {
        let ns = self.ns();
        let client = &self.harvester.client;
        let spec = hotplug::vm_template_spec(client, ns, node)
            .await
            .map_err(ControllerError::api(format!("getting VM {node}")))?;
        let Some(spec) = spec else {
            return Ok(());
        };
        let patch = match edit {
            SpecEdit::Remove => hotplug::declarative_remove_patch(&spec, id),
            SpecEdit::Apply(opts) => {
                let claim = opts.claim_name().unwrap_or(&opts.name);
                let serial = opts.disk.serial.as_deref().unwrap_or(&opts.name);
                hotplug::declarative_add_patch(&spec, &opts.name, claim, serial)
            }
        };
        let Some(patch) = patch else {
            return Ok(());
        };
        match hotplug::patch_vm(client, ns, node, &patch).await {
            Ok(_) => {
                tracing::info!(
                    volume = id,
                    node,
                    ?edit,
                    "VMI stopped: edited the VM's volumes"
                );
                Ok(())
            }
            Err(e) if patch_lost_race(&e) => {
                tracing::debug!(volume = id, node, "VM changed under the edit: {e}");
                Ok(())
            }
            Err(e) => Err(ControllerError::api(format!(
                "editing VM {ns}/{node}'s volumes, which KubeVirt does not do while its VMI has stopped (the driver's Harvester account needs patch on virtualmachines)"
            ))(e)),
        }
    }
}

/// The UID of the VM that owns `vmi` (its controller reference, which KubeVirt's VM controller
/// sets on the VMI it creates: kubevirt/kubevirt v1.6.0 `pkg/virt-controller/watch/vm/vm.go`,
/// `setupVMIFromVM`).
fn owner_vm_uid(vmi: &VirtualMachineInstance) -> Option<String> {
    vmi.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.kind == "VirtualMachine")
        .map(|o| o.uid.clone())
}
