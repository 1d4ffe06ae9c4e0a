//! Guest VMs as KubeVirt would run them: a VM with status, a running VMI on a Harvester host with
//! interface IPs and the host's topology copied onto it as annotations (as Harvester does).

use std::collections::BTreeMap;

use harvester_common::harvester::kubevirt::{
    Interface, MultusNetwork, Network, VirtualMachineSpec, VirtualMachineStatus, VmiSpec, VmiStatus,
};
use harvester_common::harvester::{
    Rest, TOPOLOGY_REGION, TOPOLOGY_ZONE, VirtualMachine, VirtualMachineInstance,
};
use k8s_openapi::api::core::v1::{Node, NodeSpec, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use std::sync::Arc;

use super::Sim;
use super::virt_api::update_vmi;
use crate::BedError;
use crate::real::vm::{GUEST_MAC, Vm};

/// Label Harvester's VMI controller requires before it copies host topology (node driver VMs).
pub const CREATOR_LABEL: (&str, &str) =
    ("harvesterhci.io/creator", "docker-machine-driver-harvester");
pub const UNINITIALIZED_TAINT: &str = "node.cloudprovider.kubernetes.io/uninitialized";

/// A guest VM to create: `GuestVm::new("worker-1").on_host("h1").ip("10.0.0.11")`.
#[derive(Clone, Debug)]
pub struct GuestVm {
    pub name: String,
    pub host: String,
    /// Multus network name (`namespace/nad`) of the VM's NIC.
    pub network: String,
    pub ips: Vec<String>,
    /// The host name its qemu-guest-agent reports (KubeVirt's `guestosinfo`); `Some` also
    /// marks the VMI `AgentConnected`, as virt-handler does once the agent answers.
    pub agent_hostname: Option<String>,
}

impl GuestVm {
    pub fn new(name: &str) -> GuestVm {
        GuestVm {
            name: name.into(),
            host: "harvester-1".into(),
            network: "default/mgmt-vlan".into(),
            ips: Vec::new(),
            agent_hostname: None,
        }
    }
    /// A guest whose qemu-guest-agent is connected and reports `hostname` (sim-only VMs; a
    /// VM backed by a real guest asks its agent).
    pub fn guest_agent(mut self, hostname: &str) -> Self {
        self.agent_hostname = Some(hostname.into());
        self
    }
    pub fn on_host(mut self, host: &str) -> Self {
        self.host = host.into();
        self
    }
    pub fn network(mut self, network: &str) -> Self {
        self.network = network.into();
        self
    }
    pub fn ip(mut self, ip: &str) -> Self {
        self.ips.push(ip.into());
        self
    }
}

/// The VMI conditions virt-handler sets once the guest agent answers.
fn agent_connected() -> serde_json::Value {
    json!([{"type": "AgentConnected", "status": "True",
            "lastProbeTime": null, "lastTransitionTime": null}])
}

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(str::to_string),
        ..Default::default()
    }
}

impl Sim {
    fn vms(&self) -> Api<VirtualMachine> {
        Api::namespaced(self.harvester.clone(), &self.vm_namespace)
    }
    fn vmis(&self) -> Api<VirtualMachineInstance> {
        Api::namespaced(self.harvester.clone(), &self.vm_namespace)
    }

    /// A Harvester host Node with topology labels.
    pub async fn create_host(
        &self,
        name: &str,
        region: Option<&str>,
        zone: Option<&str>,
    ) -> Result<Node, BedError> {
        let mut labels = BTreeMap::from([("kubernetes.io/hostname".to_string(), name.to_string())]);
        if let Some(r) = region {
            labels.insert(TOPOLOGY_REGION.into(), r.into());
        }
        if let Some(z) = zone {
            labels.insert(TOPOLOGY_ZONE.into(), z.into());
        }
        if self.node_play.is_some() {
            // What virt-handler labels its Node with and a launcher Pod's nodeSelector asks for
            // (`pkg/virt-controller/services/nodeselectorrenderer.go`): schedulable for VMIs
            // (kubevirt/kubevirt v1.7.0 `pkg/virt-handler/heartbeat/heartbeat.go`) and the
            // machine type the VM mutator gives a VM, `q35`
            // (`pkg/virt-handler/node-labeller/node_labeller.go` `prepareLabels`), and the
            // kubelet's architecture label (`NewNodeSelectorRenderer`).
            labels.insert("kubevirt.io/schedulable".into(), "true".into());
            labels.insert("kubernetes.io/arch".into(), "amd64".into());
            labels.insert("machine-type.node.kubevirt.io/q35".into(), "true".into());
        }
        let node = Node {
            metadata: ObjectMeta {
                labels: Some(labels),
                ..meta(name, None)
            },
            ..Default::default()
        };
        Ok(Api::<Node>::all(self.harvester.clone())
            .create(&PostParams::default(), &node)
            .await?)
    }

    /// The topology annotations Harvester copies from host `host` onto a VMI.
    async fn host_topology(&self, host: &str) -> Result<BTreeMap<String, String>, BedError> {
        let node = Api::<Node>::all(self.harvester.clone()).get(host).await?;
        let labels = node.metadata.labels.unwrap_or_default();
        Ok([TOPOLOGY_REGION, TOPOLOGY_ZONE, "kubernetes.io/hostname"]
            .into_iter()
            .filter_map(|k| labels.get(k).map(|v| (k.to_string(), v.clone())))
            .collect())
    }

    /// A running VM and its VMI on `vm.host`.
    pub async fn create_vm(
        &self,
        vm: &GuestVm,
    ) -> Result<(VirtualMachine, VirtualMachineInstance), BedError> {
        let connected = vm.agent_hostname.as_ref().map(|hostname| {
            self.hotplug
                .set_agent_hostname(&self.vm_namespace, &vm.name, hostname);
            agent_connected()
        });
        if let Some(play) = &self.node_play {
            return self
                .create_kubevirt_vm(play, vm, listed_interface(vm), connected)
                .await;
        }
        self.create_vm_with(vm, vec![listed_interface(vm)], connected)
            .await
    }

    /// Under KubeVirt's own virt-api and virt-controller: only the VM (runStrategy
    /// `RerunOnFailure`, as Rancher's Harvester node driver makes it: harvester/
    /// docker-machine-driver-harvester `harvester/create.go`), through virt-api's webhooks; virt-controller makes the VMI and its launcher Pod, the node
    /// play ([`super::virt_handler`]) runs them. Returns once the VMI is Running, with the host's
    /// topology copied onto it as Harvester's VMI controller does. The guest's NIC is bridged
    /// to the VM's Multus network, as a Harvester VM network is; its NetworkAttachmentDefinition
    /// is made first, since virt-controller reads it to render the launcher Pod
    /// (kubevirt/kubevirt v1.6.1 `pkg/network/multus/nad.go` `NetworkToResource`).
    async fn create_kubevirt_vm(
        &self,
        play: &super::virt_handler::NodePlay,
        vm: &GuestVm,
        interface: Interface,
        conditions: Option<serde_json::Value>,
    ) -> Result<(VirtualMachine, VirtualMachineInstance), BedError> {
        self.ensure_network(&vm.network).await?;
        play.expect_guest(
            &vm.name,
            super::virt_handler::GuestReport {
                interfaces: json!([interface]),
                conditions: conditions
                    .and_then(|c| c.as_array().cloned())
                    .unwrap_or_default(),
            },
        );
        let labels = json!({CREATOR_LABEL.0: CREATOR_LABEL.1});
        let object: VirtualMachine = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": vm.name, "namespace": self.vm_namespace, "labels": labels},
            "spec": {"runStrategy": "RerunOnFailure", "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 100, "preference": {"matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": [vm.host]}]}}]}},
                    "domain": {
                        "devices": {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}],
                                    "interfaces": [{"name": interface.name, "bridge": {},
                                                    "macAddress": interface.mac}]},
                        "resources": {"requests": {"memory": "64Mi"}}},
                    "networks": [{"name": interface.name, "multus": {"networkName": vm.network}}],
                    "volumes": [{"name": "rootdisk", "containerDisk":
                                 {"image": "quay.io/kubevirt/cirros-container-disk-demo"}}]}}}
        }))
        .map_err(|e| BedError::Setup(format!("VM {}: {e}", vm.name)))?;
        self.vms().create(&PostParams::default(), &object).await?;
        let vmi = self.kubevirt_vmi_running(&vm.name, None).await?;
        Ok((self.vms().get(&vm.name).await?, vmi))
    }

    /// The NetworkAttachmentDefinition `network` (`namespace/name`) in the shape Harvester gives a
    /// VM network on its management cluster network (a `bridge` CNI config on `mgmt-br`).
    async fn ensure_network(&self, network: &str) -> Result<(), BedError> {
        let (ns, name) = network.split_once('/').unwrap_or(("default", network));
        let config = json!({"cniVersion": "0.3.1", "name": name, "type": "bridge",
                            "bridge": "mgmt-br", "promiscMode": true, "vlan": 0, "ipam": {}});
        crate::bed::apply::apply_value(
            &self.harvester,
            json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
                   "metadata": {"name": name, "namespace": ns},
                   "spec": {"config": config.to_string()}}),
            ns,
        )
        .await
        .map(|_| ())
    }

    /// Waits until virt-controller's VMI `name` (another than the one with UID `not_uid`) is
    /// Running (the node play runs it), then copies its host's topology onto it.
    async fn kubevirt_vmi_running(
        &self,
        name: &str,
        not_uid: Option<String>,
    ) -> Result<VirtualMachineInstance, BedError> {
        let running = self.kubevirt_vmi(name, not_uid, true).await?;
        let host = running
            .status
            .and_then(|s| s.node_name)
            .ok_or_else(|| BedError::Api(format!("running VMI {name} has no node")))?;
        // Harvester's VMI controller (harvester/harvester v1.7.0
        // `pkg/controller/master/virtualmachine/vmi_controller.go` `ReconcileFromHostLabels`).
        let annotations = self.host_topology(&host).await?;
        Ok(self
            .vmis()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": annotations}})),
            )
            .await?)
    }

    /// Waits until VMI `name` exists as another than the one with UID `not_uid` and, with
    /// `running`, runs.
    async fn kubevirt_vmi(
        &self,
        name: &str,
        not_uid: Option<String>,
        running: bool,
    ) -> Result<VirtualMachineInstance, BedError> {
        let what = if running { "Running" } else { "made" };
        let made = self
            .wait_vmi(name, what, |vmi| {
                vmi.is_some_and(|v| {
                    v.metadata.uid != not_uid && (!running || phase(v) == Some("Running"))
                })
            })
            .await?;
        made.ok_or_else(|| BedError::Api(format!("VMI {name} gone")))
    }

    /// Waits (60 s at most) until `done` holds for VMI `name` as read (`None`: absent); returns
    /// it as last read.
    async fn wait_vmi(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(Option<&VirtualMachineInstance>) -> bool,
    ) -> Result<Option<VirtualMachineInstance>, BedError> {
        let vmis = self.vmis();
        let done = &done;
        crate::util::wait::until(
            &format!("VMI {}/{name} {what}", self.vm_namespace),
            std::time::Duration::from_secs(60),
            || {
                let vmis = vmis.clone();
                async move {
                    let vmi = vmis.get_opt(name).await.map_err(|e| e.to_string())?;
                    Ok(if done(vmi.as_ref()) {
                        Ok(vmi)
                    } else {
                        Err(vmi.as_ref().and_then(phase).map(String::from))
                    })
                }
            },
        )
        .await
        .map_err(BedError::Setup)
    }

    /// Merge-patches VM `name` (an administrator's spec edit).
    pub async fn patch_vm(
        &self,
        name: &str,
        patch: serde_json::Value,
    ) -> Result<VirtualMachine, BedError> {
        Ok(self
            .vms()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await?)
    }

    /// Under KubeVirt's own controllers: sets the VM's runStrategy, as an administrator's spec
    /// edit does (`Halted`: virt-controller stops the VMI; `RerunOnFailure`: starts one;
    /// kubevirt/kubevirt v1.7.0 `pkg/virt-controller/watch/vm/vm.go`).
    async fn set_run_strategy(&self, name: &str, strategy: &str) -> Result<(), BedError> {
        self.patch_vm(name, json!({"spec": {"runStrategy": strategy}}))
            .await
            .map(|_| ())
    }

    /// Under KubeVirt's own controllers: Harvester host `host` loses power. Its kubelet and
    /// virt-handler stop (the node play); Harvester's node-down controller force-deletes its
    /// launcher Pods and sets its virt-handler heartbeat six minutes back (harvester/harvester
    /// `pkg/controller/master/node/node_down_controller.go` `OnNodeChanged`, `resetHeartbeat`;
    /// its VolumeAttachment cleanup concerns Longhorn, which the bed does not run). KubeVirt's
    /// node controller then marks each VMI left without a Pod there `Failed` (kubevirt/kubevirt
    /// v1.7.0 `pkg/virt-controller/watch/node/node.go`); virt-controller deletes a
    /// `RerunOnFailure` VM's failed VMI (its finalizer waits only for the launcher Pod, which is
    /// gone) and starts a new one from the VM spec, hot-plugged volumes included, on a host
    /// that is still schedulable (`pkg/virt-controller/watch/vm/vm.go`,
    /// `pkg/virt-controller/watch/vmi/lifecycle.go` `allPodsDeleted`).
    pub async fn lose_host(&self, host: &str) -> Result<(), BedError> {
        self.kubevirt_play("a host's power loss")?.lose_host(host);
        let pods: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(self.harvester.clone(), &self.vm_namespace);
        let launchers = pods
            .list(
                &kube::api::ListParams::default()
                    .labels("kubevirt.io=virt-launcher")
                    .fields(&format!("spec.nodeName={host}")),
            )
            .await?;
        let force = DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        for pod in launchers.items {
            let name = pod.metadata.name.unwrap_or_default();
            match pods.delete(&name, &force).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        let stale = jiff::Timestamp::now() - jiff::SignedDuration::from_mins(6);
        let heartbeat = stale.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
        Api::<Node>::all(self.harvester.clone())
            .patch(
                host,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"kubevirt.io/heartbeat": heartbeat}}}),
                ),
            )
            .await?;
        Ok(())
    }

    /// Under KubeVirt's own controllers: waits until VMI `name` is gone (virt-controller
    /// deletes it for a stopped VM) and the VM's `status.runStrategy` is `Halted`. Only then
    /// does a later runStrategy edit start the VM: virt-controller starts a `RerunOnFailure` VM
    /// that has no VMI only when coming from another strategy, as its status says
    /// (kubevirt/kubevirt v1.6.1 `pkg/virt-controller/watch/vm/vm.go` `syncRunStrategy`).
    async fn kubevirt_vm_halted(&self, name: &str) -> Result<(), BedError> {
        self.wait_vmi(name, "gone", |vmi| vmi.is_none()).await?;
        let vms = self.vms();
        crate::util::wait::until(
            &format!("VM {}/{name} status.runStrategy Halted", self.vm_namespace),
            std::time::Duration::from_secs(60),
            || {
                let vms = vms.clone();
                async move {
                    let vm = vms.get(name).await.map_err(|e| e.to_string())?;
                    let strategy = vm
                        .status
                        .and_then(|s| s.rest.get("runStrategy").cloned())
                        .unwrap_or_default();
                    Ok(if strategy == "Halted" {
                        Ok(())
                    } else {
                        Err(strategy)
                    })
                }
            },
        )
        .await
        .map_err(BedError::Setup)
    }

    async fn create_vm_with(
        &self,
        vm: &GuestVm,
        interfaces: Vec<Interface>,
        conditions: Option<serde_json::Value>,
    ) -> Result<(VirtualMachine, VirtualMachineInstance), BedError> {
        let labels = BTreeMap::from([(CREATOR_LABEL.0.to_string(), CREATOR_LABEL.1.to_string())]);
        let networks = vec![Network {
            name: "nic-1".into(),
            multus: Some(MultusNetwork {
                network_name: vm.network.clone(),
                rest: Rest::new(),
            }),
            rest: Rest::new(),
        }];
        let mut object = VirtualMachine::new(
            &vm.name,
            VirtualMachineSpec {
                running: Some(true),
                template: harvester_common::harvester::kubevirt::VmTemplate {
                    metadata: Some(json!({"labels": labels})),
                    spec: VmiSpec {
                        networks: networks.clone(),
                        ..Default::default()
                    },
                },
                ..Default::default()
            },
        );
        object.metadata.namespace = Some(self.vm_namespace.clone());
        object.metadata.labels = Some(labels.clone());
        let created = self.vms().create(&PostParams::default(), &object).await?;
        let created = self
            .set_vm_status(&vm.name, true, "Running")
            .await
            .or(Ok::<_, BedError>(created))?;
        let vmi = self.start_vmi(vm, networks, interfaces, conditions).await?;
        Ok((created, vmi))
    }

    /// A running VM whose guest is the real VM `backend` (QEMU): hot-plugs go into it over QMP,
    /// and the VMI's `status.interfaces` come from its qemu-guest-agent as KubeVirt fills them
    /// (`guest-network-get-interfaces`, matched to the NIC by MAC; condition `AgentConnected`).
    /// Without an agent the interface has its MAC but no address. `vm.ips` is ignored.
    pub async fn create_vm_backed(
        &self,
        vm: &GuestVm,
        backend: Arc<Vm>,
    ) -> Result<(VirtualMachine, VirtualMachineInstance), BedError> {
        self.hotplug.back_with_vm(&vm.name, backend.clone());
        let agent = match backend.agent_interfaces().await {
            Ok(reply) => Some(reply),
            Err(e) => {
                tracing::info!(vm = %vm.name, "no guest agent: {e}");
                None
            }
        };
        let interface = vmi_interface("nic-1", GUEST_MAC, agent.as_ref());
        let connected = agent.is_some().then(agent_connected);
        if let Some(play) = &self.node_play {
            return self
                .create_kubevirt_vm(play, vm, interface, connected)
                .await;
        }
        self.create_vm_with(vm, vec![interface], connected).await
    }

    async fn set_vm_status(
        &self,
        name: &str,
        ready: bool,
        printable: &str,
    ) -> Result<VirtualMachine, BedError> {
        let status = VirtualMachineStatus {
            ready,
            created: Some(ready),
            printable_status: Some(printable.into()),
            rest: Rest::new(),
        };
        Ok(self
            .vms()
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await?)
    }

    async fn start_vmi(
        &self,
        vm: &GuestVm,
        networks: Vec<Network>,
        interfaces: Vec<Interface>,
        conditions: Option<serde_json::Value>,
    ) -> Result<VirtualMachineInstance, BedError> {
        let labels = BTreeMap::from([
            (CREATOR_LABEL.0.to_string(), CREATOR_LABEL.1.to_string()),
            ("kubevirt.io/nodeName".to_string(), vm.host.clone()),
        ]);
        let mut vmi = VirtualMachineInstance::new(
            &vm.name,
            VmiSpec {
                networks,
                ..Default::default()
            },
        );
        vmi.metadata.namespace = Some(self.vm_namespace.clone());
        vmi.metadata.labels = Some(labels.clone());
        let mut rest = Rest::new();
        if let Some(c) = conditions {
            rest.insert("conditions".into(), c);
        }
        vmi.status = Some(VmiStatus {
            phase: Some("Running".into()),
            node_name: Some(vm.host.clone()),
            interfaces,
            rest,
            ..Default::default()
        });
        let created = self.vmis().create(&PostParams::default(), &vmi).await?;
        // Harvester's VMI controller copies the host's zone, region and hostname labels onto the
        // VMI after KubeVirt created it, and only for node-driver VMs (harvester/harvester v1.7.0
        // `pkg/controller/master/virtualmachine/vmi_controller.go` `ReconcileFromHostLabels`).
        if labels.get(CREATOR_LABEL.0).map(String::as_str) != Some(CREATOR_LABEL.1) {
            return Ok(created);
        }
        let mut annotations = self.host_topology(&vm.host).await?;
        annotations.retain(|k, _| k != "kubernetes.io/hostname" || !vm.host.is_empty());
        let updated = update_vmi(&self.vmis(), &vm.name, |vmi| {
            vmi.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .extend(annotations.clone());
        })
        .await?;
        Ok(updated.unwrap_or(created))
    }

    /// A guest Node as kubelet registers it with `--cloud-provider=external`: tainted uninitialized.
    pub async fn create_guest_node(&self, name: &str) -> Result<Node, BedError> {
        let node = Node {
            metadata: meta(name, None),
            spec: Some(NodeSpec {
                taints: Some(vec![Taint {
                    key: UNINITIALIZED_TAINT.into(),
                    value: Some("true".into()),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        Ok(Api::<Node>::all(self.guest.clone())
            .create(&PostParams::default(), &node)
            .await?)
    }

    /// Stops the VM: `running: false`, not ready, VMI gone. Under KubeVirt's own controllers:
    /// runStrategy `Halted`; virt-controller deletes the VMI, the node play shuts it down.
    pub async fn stop_vm(&self, name: &str) -> Result<(), BedError> {
        if self.node_play.is_some() {
            self.set_run_strategy(name, "Halted").await?;
            return self.kubevirt_vm_halted(name).await;
        }
        self.vms()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"running": false}})),
            )
            .await?;
        self.set_vm_status(name, false, "Stopped").await?;
        self.delete_vmi(name).await
    }

    /// Powers the VM off for good the way a lost guest or host looks: the VM is not ready and
    /// `Stopped`, while its VMI stays, phase `Failed`, still listing every disk it had (KubeVirt
    /// unplugs nothing from a stopped VMI; non-graceful node shutdown). Under KubeVirt's own
    /// controllers the VM's host loses power ([`Sim::lose_host`]) and the call returns once
    /// KubeVirt has restarted the VM: its failed VMI is gone and a new one is made (it runs on
    /// another host unless the VM is pinned to the lost one).
    pub async fn power_off_vm(&self, name: &str) -> Result<(), BedError> {
        if self.node_play.is_some() {
            let vmi = self.vmis().get(name).await?;
            let host = vmi
                .status
                .and_then(|s| s.node_name)
                .ok_or_else(|| BedError::Api(format!("VMI {name} has no node")))?;
            self.lose_host(&host).await?;
            return self
                .kubevirt_vmi(name, vmi.metadata.uid, false)
                .await
                .map(|_| ());
        }
        self.set_vm_status(name, false, "Stopped").await?;
        let failed = update_vmi(&self.vmis(), name, |vmi| {
            vmi.status.get_or_insert_with(Default::default).phase = Some("Failed".into());
        })
        .await?;
        failed
            .map(|_| ())
            .ok_or_else(|| BedError::Api(format!("VMI {name} not found to power off")))
    }

    /// Starts a stopped VM again on `host`.
    pub async fn start_vm(&self, vm: &GuestVm) -> Result<VirtualMachineInstance, BedError> {
        if self.node_play.is_some() {
            self.set_run_strategy(&vm.name, "RerunOnFailure").await?;
            return self.kubevirt_vmi_running(&vm.name, None).await;
        }
        let current = self.vms().get(&vm.name).await?;
        self.vms()
            .patch(
                &vm.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"running": true}})),
            )
            .await?;
        self.set_vm_status(&vm.name, true, "Running").await?;
        self.start_vmi(
            vm,
            current.spec.template.spec.networks,
            vec![listed_interface(vm)],
            None,
        )
        .await
    }

    /// Under KubeVirt's own controllers: stops VM `name` and starts it again with its guest held
    /// before boot, so that its new VMI stays `Scheduled` (the VM is starting) until
    /// [`Sim::boot_vm`]. Returns that VMI.
    pub async fn restart_vm_held(&self, name: &str) -> Result<VirtualMachineInstance, BedError> {
        let play = self.kubevirt_play("restart_vm_held")?;
        self.stop_vm(name).await?;
        play.hold_boot(name);
        self.set_run_strategy(name, "RerunOnFailure").await?;
        self.wait_vmi(name, "Scheduled", |vmi| {
            vmi.is_some_and(|v| phase(v) == Some("Scheduled"))
        })
        .await?
        .ok_or_else(|| BedError::Api(format!("VMI {name} gone")))
    }

    /// Boots the guest [`Sim::restart_vm_held`] held; returns once its VMI runs.
    pub async fn boot_vm(&self, name: &str) -> Result<VirtualMachineInstance, BedError> {
        self.kubevirt_play("boot_vm")?.release_boot(name).await;
        self.kubevirt_vmi_running(name, None).await
    }

    /// Under KubeVirt's own controllers: volumes `volumes` leave VMI `name` while its VM spec
    /// keeps them (harvester/harvester #10588), through virt-api's VMI `removevolume` (KubeVirt's
    /// path of a VMI-only unplug; the node play then takes each disk out of the guest).
    pub async fn drop_from_vmi(&self, name: &str, volumes: &[&str]) -> Result<(), BedError> {
        self.kubevirt_play("drop_from_vmi")?;
        for volume in volumes {
            let url = format!(
                "/apis/subresources.kubevirt.io/v1/namespaces/{}/virtualmachineinstances/{name}/removevolume",
                self.vm_namespace
            );
            let body = serde_json::to_vec(&json!({"name": volume}))
                .map_err(|e| BedError::Api(e.to_string()))?;
            let request = http::Request::put(url)
                .header("content-type", "application/json")
                .body(body)
                .map_err(|e| BedError::Api(e.to_string()))?;
            self.harvester.request_text(request).await?;
        }
        self.wait_vmi(name, "without the dropped volumes", |vmi| {
            vmi.is_some_and(|v| {
                volumes.iter().all(|n| {
                    !v.spec.volumes.iter().any(|x| x.name == *n) && v.volume_status(n).is_none()
                })
            })
        })
        .await
        .map(|_| ())
    }

    /// The node play, or an error naming `what` needs KubeVirt's own controllers.
    fn kubevirt_play(&self, what: &str) -> Result<&super::virt_handler::NodePlay, BedError> {
        self.node_play.as_deref().ok_or_else(|| {
            BedError::Setup(format!(
                "{what} needs KubeVirt's own virt-api and virt-controller (BedOptions::kubevirt)"
            ))
        })
    }

    /// Deletes the VMI and the VM. Under KubeVirt's own controllers only the VM: virt-controller
    /// stops its VMI.
    pub async fn delete_vm(&self, name: &str) -> Result<(), BedError> {
        if self.node_play.is_none() {
            self.delete_vmi(name).await?;
        }
        match self.vms().delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn delete_vmi(&self, name: &str) -> Result<(), BedError> {
        match self.vmis().delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Live migration: the VMI moves to `to_host`, and Harvester re-copies that host's topology.
    pub async fn migrate_vm(
        &self,
        name: &str,
        to_host: &str,
    ) -> Result<VirtualMachineInstance, BedError> {
        if self.node_play.is_some() {
            return Err(BedError::Setup(
                "live migration is not played under KubeVirt's own controllers".into(),
            ));
        }
        let topology = self.host_topology(to_host).await?;
        let moved = update_vmi(&self.vmis(), name, |vmi| {
            let ann = vmi
                .metadata
                .annotations
                .get_or_insert_with(Default::default);
            for k in [TOPOLOGY_REGION, TOPOLOGY_ZONE, "kubernetes.io/hostname"] {
                match topology.get(k) {
                    Some(v) => ann.insert(k.to_string(), v.clone()),
                    None => ann.remove(k),
                };
            }
            vmi.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert("kubevirt.io/nodeName".into(), to_host.into());
            let status = vmi.status.get_or_insert_with(Default::default);
            let from = status.node_name.replace(to_host.to_string());
            status.rest.insert(
                "migrationState".into(),
                json!({"sourceNode": from, "targetNode": to_host, "completed": true}),
            );
        })
        .await?;
        moved.ok_or_else(|| BedError::Api(format!("VMI {name} not found for migration")))
    }
}

/// The VMI's `status.phase`.
fn phase(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.status.as_ref()?.phase.as_deref()
}

/// The interface of a VM without a real guest: the addresses the test listed (`GuestVm::ip`).
fn listed_interface(vm: &GuestVm) -> Interface {
    Interface {
        name: "nic-1".into(),
        ip_address: vm.ips.first().cloned(),
        ip_addresses: vm.ips.clone(),
        mac: Some("52:54:00:00:00:01".into()),
        rest: Rest::new(),
    }
}

/// The VMI interface `name` with `mac`, filled from qemu-guest-agent's
/// `guest-network-get-interfaces` reply (`None`: no agent) as KubeVirt does: the guest interface
/// with the same MAC gives `interfaceName` and the addresses (`ipAddress` is the first). The
/// stand-in leaves out IPv6 link-local addresses (fe80::/10), which no Node should carry.
pub fn vmi_interface(name: &str, mac: &str, agent: Option<&serde_json::Value>) -> Interface {
    let guest = agent.and_then(|a| a.as_array()).and_then(|ifaces| {
        ifaces.iter().find(|i| {
            i["hardware-address"]
                .as_str()
                .is_some_and(|m| m.eq_ignore_ascii_case(mac))
        })
    });
    let ips: Vec<String> = guest
        .and_then(|g| g["ip-addresses"].as_array())
        .map(|a| {
            a.iter()
                .filter_map(|ip| ip["ip-address"].as_str())
                .filter(|ip| {
                    !ip.parse::<std::net::Ipv6Addr>()
                        .is_ok_and(|v6| v6.segments()[0] & 0xffc0 == 0xfe80)
                })
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let mut rest = Rest::new();
    rest.insert(
        "infoSource".into(),
        json!(if guest.is_some() {
            "domain, guest-agent"
        } else {
            "domain"
        }),
    );
    if let Some(n) = guest.and_then(|g| g["name"].as_str()) {
        rest.insert("interfaceName".into(), json!(n));
    }
    Interface {
        name: name.into(),
        ip_address: ips.first().cloned(),
        ip_addresses: ips,
        mac: Some(mac.into()),
        rest,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_addresses_fill_the_interface_with_the_same_mac() {
        // The shape of qemu-guest-agent 7.2's reply, as the bed's guest answered it.
        let agent = json!([
            {"name": "lo", "hardware-address": "00:00:00:00:00:00",
             "ip-addresses": [{"ip-address-type": "ipv4", "ip-address": "127.0.0.1", "prefix": 8}]},
            {"name": "eth0", "hardware-address": "52:54:00:12:34:56",
             "ip-addresses": [
                {"ip-address-type": "ipv4", "ip-address": "10.0.2.15", "prefix": 24},
                {"ip-address-type": "ipv6", "ip-address": "fec0::5054:ff:fe12:3456", "prefix": 64},
                {"ip-address-type": "ipv6", "ip-address": "fe80::5054:ff:fe12:3456", "prefix": 64}]}
        ]);
        let i = vmi_interface("nic-1", "52:54:00:12:34:56", Some(&agent));
        assert_eq!(i.ip_address.as_deref(), Some("10.0.2.15"));
        assert_eq!(i.ip_addresses, ["10.0.2.15", "fec0::5054:ff:fe12:3456"]);
        assert_eq!(i.rest["interfaceName"], "eth0");
        assert_eq!(i.rest["infoSource"], "domain, guest-agent");
        let none = vmi_interface("nic-1", "52:54:00:12:34:56", None);
        assert_eq!(none.ip_address, None);
        assert!(none.ip_addresses.is_empty());
        assert_eq!(none.mac.as_deref(), Some("52:54:00:12:34:56"));
        let other = vmi_interface("nic-1", "52:54:00:00:00:09", Some(&agent));
        assert!(other.ip_addresses.is_empty(), "no guest NIC with that MAC");
    }
}
