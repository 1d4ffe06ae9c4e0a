//! RWX filesystem volumes through Longhorn's share manager, end to end on real kernels: the
//! stand-in plays networkfs-manager with a real NFS server (nfs-ganesha on the host's loopback,
//! `testbed::real::nfs`), and the NFS mounts run in two QEMU guests (the host kernel has no NFS
//! client), each running our node plugin (binary through 9p, reached over a forwarded port); the
//! controller runs on the host. One story over two guests (a boot is the expensive part), and the
//! bad-input checks, which need no guest.

use testbed::suites::csi as common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Driver, Vol, assert_root};
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::identity_client::IdentityClient;
use csi_proto::csi::v1::node_client::NodeClient;
use csi_proto::csi::v1::volume_capability::access_mode::Mode as ProtoMode;
use csi_proto::csi::v1::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use csi_proto::csi::v1::*;
use harvester_common::harvester::NetworkFilesystem;
use harvester_common::harvester::networkfs as networkfs_api;
use harvester_csi_driver::Mode;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use kube::Api;
use serde_json::json;
use testbed::real::vm::{GUEST_SHARE, HOST_FROM_GUEST, Vm, VmOptions};
use testbed::sim::GuestVm;
use testbed::sim::networkfs::{self, NetworkFs};
use testbed::{TestBed, util::wait};
use tonic::transport::Channel;

/// The node plugin's port in each guest.
const CSI_PORT: u16 = 10000;
const GUEST_WORK: &str = "/var/lib/guest-csi";
const MIB: u64 = 1 << 20;
/// The guests' node plugins' NFS bounds (`--nfs-mount-timeout-seconds`,
/// `--nfs-server-timeout-seconds`), below the driver's defaults (30 s and 10 s) so that the checks
/// that wait them out with the server down take less; still several times what a mount, statvfs
/// or unmount of a served export takes in a guest here (0.1-2 s).
const NFS_MOUNT_BOUND: Duration = Duration::from_secs(10);
const NFS_SERVER_BOUND: Duration = Duration::from_secs(5);
/// A Longhorn RWX host StorageClass (Harvester docs: a Longhorn class without live migration).
const RWX_CLASS: &str = "longhorn-rwx";

/// Wire facts from upstream, as data. harvester/harvester-csi-driver
/// 97b6c358d78468211be26b871f88de6bcaafd7e3 `pkg/csi/controller_server.go`:
/// `HarvesterNS = "harvester-system"`, `longhornProvisioner = "driver.longhorn.io"`, and
/// `createNetworkFilesystem` (`{networkFSName: <pv>, desiredState: Disabled, provisioner: LHName}`
/// named `<pvc.spec.volumeName>`); `buildHostPVCFromScratch` + `getVolumeMode`: ReadWriteMany,
/// Filesystem for MULTI_NODE_MULTI_WRITER. `pkg/csi/node_server.go` `nodeStageRWXVolume`:
/// `mountOpts := "vers=4"` unless `status.mountOpts`; source `<status.endpoint>:/<pv>`.
mod upstream {
    pub const NFS_NAMESPACE: &str = "harvester-system";
    pub const LONGHORN_PROVISIONER: &str = "driver.longhorn.io";
    pub const NFS_PROVISIONER: &str = "Longhorn";
    pub const DESIRED_DISABLED: &str = "Disabled";
    pub const DESIRED_ENABLED: &str = "Enabled";
    pub const ENDPOINT_READY: &str = "Ready";
    pub const HOST_ACCESS_MODE: &str = "ReadWriteMany";
    pub const HOST_VOLUME_MODE: &str = "Filesystem";
}

/// The most one test of this file may take (the longest takes about 3 minutes on a loaded
/// 2-core machine): past it the test fails and cleans up instead of holding its lane.
const TEST_LIMIT: Duration = Duration::from_secs(600);

fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "[csi_rwx] {line}");
}

fn rwx_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode {
            mode: ProtoMode::MultiNodeMultiWriter as i32,
        }),
    }
}

fn rwx_request(name: &str, params: &[(&str, &str)]) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: (64 * MIB) as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![rwx_cap()],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

/// CreateVolume of an RWX volume `name` on the Longhorn RWX class; its ID.
async fn create_rwx(ctrl: &Driver, name: &str) -> String {
    ControllerClient::new(ctrl.channel.clone())
        .create_volume(rwx_request(name, &[("hostStorageClass", RWX_CLASS)]))
        .await
        .expect("CreateVolume RWX")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id
}

async fn create_class(bed: &TestBed, name: &str, provisioner: &str, params: serde_json::Value) {
    let sc: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": name}, "provisioner": provisioner,
        "allowVolumeExpansion": true, "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate", "parameters": params
    }))
    .expect("StorageClass");
    Api::<StorageClass>::all(bed.sim.harvester.clone())
        .create(&Default::default(), &sc)
        .await
        .expect("creating a StorageClass on Harvester");
}

/// The node plugin running in a guest.
struct GuestPlugin {
    channel: Channel,
}

impl AsRef<Channel> for GuestPlugin {
    fn as_ref(&self) -> &Channel {
        &self.channel
    }
}

/// Puts the driver binary and the cloud-config (naming the Harvester API server as the guest
/// reaches it) into the guest's 9p share.
fn share_plugin(bed: &TestBed, vm: &Vm) {
    std::fs::copy(
        testbed::util::process::built_binary("harvester-csi-driver"),
        vm.share.join("harvester-csi-driver"),
    )
    .expect("copying the driver into the share");
    let cloud_config = std::fs::read_to_string(&bed.cloud_config)
        .expect("cloud-config")
        .replace("https://127.0.0.1:", &format!("https://{HOST_FROM_GUEST}:"));
    std::fs::write(vm.share.join("cloud-config"), cloud_config).expect("guest cloud-config");
}

/// The node plugin's Harvester credential: none, as our chart runs it, or the cloud-config, as
/// upstream's chart does.
#[derive(Clone, Copy, Debug)]
enum Credential {
    None,
    CloudConfig,
}

/// The node plugin's command line in the guest (binary and cloud-config in the share).
fn plugin_command(vm: &Vm, credential: Credential) -> String {
    let kubeconfig = match credential {
        Credential::None => String::new(),
        Credential::CloudConfig => format!("{GUEST_SHARE}/cloud-config"),
    };
    format!(
        "{GUEST_SHARE}/harvester-csi-driver --mode=node --nodeid={} \
         --endpoint=tcp://0.0.0.0:{CSI_PORT} --kubeconfig={kubeconfig} \
         --nfs-mount-timeout-seconds={} --nfs-server-timeout-seconds={}",
        vm.name,
        NFS_MOUNT_BOUND.as_secs(),
        NFS_SERVER_BOUND.as_secs()
    )
}

/// Starts `harvester-csi-driver --mode node --nodeid=<vm>` in the guest and waits until it
/// answers Probe.
async fn start_plugin(bed: &TestBed, vm: &Vm, credential: Credential) -> GuestPlugin {
    share_plugin(bed, vm);
    vm.run(&format!(
        "setsid {} >{GUEST_SHARE}/node-plugin.log 2>&1 </dev/null &",
        plugin_command(vm, credential)
    ))
    .await
    .expect("starting the node plugin in the guest");
    connect_plugin(vm, "node-plugin.log").await
}

/// Waits until the node plugin behind the guest's forwarded [`CSI_PORT`] answers Probe (`log`:
/// its log in the share, shown while it does not).
async fn connect_plugin(vm: &Vm, log: &str) -> GuestPlugin {
    let port = vm.host_port(CSI_PORT).expect("forwarded CSI port");
    let log = vm.share.join(log);
    let channel = wait::until(
        &format!("the node plugin in {} to answer Probe", vm.name),
        Duration::from_secs(120),
        || {
            let log = log.clone();
            async move {
                Ok(common::probe_guest_plugin(port).await.map_err(|e| {
                    format!(
                        "{e}; log: {}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    )
                }))
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    GuestPlugin { channel }
}

fn guest_vol(id: &str, node: &str) -> Vol {
    let dir = Path::new(GUEST_WORK).join(id);
    Vol {
        id: id.to_string(),
        ctx: HashMap::new(),
        staging: dir.join(format!("staging-{node}")),
        target: dir.join(format!("target-{node}")),
    }
}

/// The documented hand-over of a volume upstream's driver made: a Harvester admin labels its
/// host PVC for this guest cluster (the driver's default cluster name here).
async fn label_for_this_cluster(bed: &TestBed, id: &str) {
    let patch = json!({"metadata": {"labels": {
        harvester_csi_driver::controller::owner::LABEL_GUEST_CLUSTER:
            harvester_csi_driver::DEFAULT_CLUSTER_NAME
    }}});
    Api::<PersistentVolumeClaim>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .patch(
            id,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .expect("labelling the host PVC for this cluster");
}

/// ControllerPublishVolume: how long it took, and the publish context NodeStage gets.
async fn controller_publish(
    c: &Driver,
    id: &str,
    node: &str,
) -> Result<(Duration, HashMap<String, String>), tonic::Status> {
    let t0 = Instant::now();
    ControllerClient::new(c.channel.clone())
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: id.into(),
            node_id: node.into(),
            volume_capability: Some(rwx_cap()),
            ..Default::default()
        })
        .await
        .map(|r| (t0.elapsed(), r.into_inner().publish_context))
}

async fn controller_unpublish(c: &Driver, id: &str, node: &str) {
    ControllerClient::new(c.channel.clone())
        .controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: id.into(),
            node_id: node.into(),
            ..Default::default()
        })
        .await
        .expect("ControllerUnpublishVolume");
}

async fn network_fs(bed: &TestBed, pv: &str) -> Option<NetworkFilesystem> {
    Api::<NetworkFilesystem>::namespaced(bed.sim.harvester.clone(), upstream::NFS_NAMESPACE)
        .get_opt(pv)
        .await
        .expect("reading the NetworkFilesystem")
}

async fn host_pvc(bed: &TestBed, id: &str) -> Option<PersistentVolumeClaim> {
    Api::<PersistentVolumeClaim>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .get_opt(id)
        .await
        .expect("reading the host PVC")
}

/// Waits until the host PVC has a `spec.volumeName` (the PV, which names its NetworkFilesystem).
async fn pv_of(bed: &TestBed, id: &str) -> String {
    wait::until(
        &format!("host PVC {id} bound to a PV"),
        Duration::from_secs(60),
        || async move {
            let pvc = host_pvc(bed, id).await;
            let pv = pvc
                .as_ref()
                .and_then(|p| p.spec.as_ref())
                .and_then(|s| s.volume_name.clone());
            Ok(pv.filter(|v| !v.is_empty()).ok_or("no spec.volumeName"))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The NFS mount at `path` in the guest: "<source> <fstype>" from /proc/mounts, if any.
async fn guest_nfs_mount(vm: &Vm, path: &Path) -> Option<String> {
    let out = vm
        .run(&format!(
            "awk '$2 == \"{}\" {{print $1, $3}}' /proc/mounts",
            path.display()
        ))
        .await
        .expect("reading /proc/mounts in the guest");
    let line = out.trim();
    (!line.is_empty()).then(|| line.to_string())
}

async fn stage(n: &GuestPlugin, v: &Vol) -> Result<(), tonic::Status> {
    common::stage(n, v, &rwx_cap()).await
}

async fn unstage(n: &GuestPlugin, v: &Vol) {
    common::unpublish_and_unstage(n, v).await;
}

/// Guest-cluster objects as a real cluster has them for a shared claim: the PV of our driver,
/// the claim, a Pod on `node` using it, and the node's VolumeAttachment.
async fn guest_user(bed: &TestBed, id: &str, node: &str) {
    let g = bed.guest.client.clone();
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": id},
        "spec": {"capacity": {"storage": "64Mi"}, "accessModes": ["ReadWriteMany"],
                 "persistentVolumeReclaimPolicy": "Delete",
                 "csi": {"driver": "driver.harvesterhci.io", "volumeHandle": id},
                 "claimRef": {"namespace": "default", "name": "shared"}}
    }))
    .unwrap();
    Api::<PersistentVolume>::all(g.clone())
        .create(&Default::default(), &pv)
        .await
        .expect("guest PV");
    // No kube-controller-manager on this guest API server: its ServiceAccount controller would
    // make the namespace's `default` account, which Pod admission looks up.
    let sa: k8s_openapi::api::core::v1::ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "default", "namespace": "default"}}))
            .unwrap();
    match Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(g.clone(), "default")
        .create(&Default::default(), &sa)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("guest ServiceAccount: {e}"),
    }
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("user-{node}"), "namespace": "default"},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}],
                 "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "shared"}}]}
    }))
    .unwrap();
    Api::<Pod>::namespaced(g.clone(), "default")
        .create(&Default::default(), &pod)
        .await
        .expect("guest Pod");
    for n in ["rwx-a", "rwx-b"] {
        let va: VolumeAttachment = serde_json::from_value(json!({
            "metadata": {"name": format!("va-{n}")},
            "spec": {"attacher": "driver.harvesterhci.io", "nodeName": n,
                     "source": {"persistentVolumeName": id}}
        }))
        .unwrap();
        Api::<VolumeAttachment>::all(g.clone())
            .create(&Default::default(), &va)
            .await
            .expect("guest VolumeAttachment");
    }
}

async fn delete_guest<K>(api: Api<K>, name: &str)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    // Grace period 0: no kubelet here to finish a Pod's termination.
    api.delete(name, &kube::api::DeleteParams::default().grace_period(0))
        .await
        .unwrap_or_else(|e| panic!("deleting {name}: {e}"));
}

async fn boot(bed: &TestBed, name: &str) -> Arc<Vm> {
    let vm = match Vm::start(
        bed.dir.path(),
        VmOptions::new(name)
            .without_udev()
            .without_agent()
            .forward(CSI_PORT),
    )
    .await
    {
        Ok(vm) => Arc::new(vm),
        Err(e) => panic!("the guest VM must boot for this test: {e}"),
    };
    say(&format!(
        "guest {name} booted in {:.1}s",
        vm.booted_in.as_secs_f64()
    ));
    bed.sim
        .create_vm_backed(&GuestVm::new(name).on_host("harvester-1"), vm.clone())
        .await
        .expect("VM and VMI backed by the guest");
    vm
}

/// A bed with the Longhorn RWX class, one host, the NFS server, the guest `name` booted (a VM
/// on the host) and the controller; the node plugin is the test's to start.
async fn one_guest(name: &str) -> (TestBed, Arc<NetworkFs>, Arc<Vm>, Driver) {
    let bed = common::bed().await;
    let bed = bed.with_default_storage_class().await;
    create_class(&bed, RWX_CLASS, upstream::LONGHORN_PROVISIONER, json!({})).await;
    bed.sim
        .create_host("harvester-1", None, None)
        .await
        .expect("host");
    let fs = bed
        .sim
        .start_networkfs(HOST_FROM_GUEST)
        .unwrap_or_else(|e| panic!("the NFS server must start for this test: {e}"));
    let vm = boot(&bed, name).await;
    let ctrl = Driver::start(&bed, |c| c.mode = Mode::Controller).await;
    (bed, fs, vm, ctrl)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rwx_volume_shared_by_two_guests_root() {
    wait::within(
        "rwx_volume_shared_by_two_guests_root",
        TEST_LIMIT,
        rwx_volume_shared_by_two_guests_root_steps(),
    )
    .await
}

async fn rwx_volume_shared_by_two_guests_root_steps() {
    assert_root();
    let t0 = Instant::now();
    let bed = common::bed().await;
    let bed = bed.with_default_storage_class().await;
    create_class(
        &bed,
        RWX_CLASS,
        upstream::LONGHORN_PROVISIONER,
        json!({"numberOfReplicas": "1", "migratable": "false"}),
    )
    .await;
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    let fs = bed
        .sim
        .start_networkfs(HOST_FROM_GUEST)
        .unwrap_or_else(|e| panic!("the NFS server must start for this test: {e}"));
    say(&format!("nfs-ganesha serving on 127.0.0.1:{}", fs.nfs.port));
    let (a, b) = tokio::join!(boot(&bed, "rwx-a"), boot(&bed, "rwx-b"));
    let ctrl = Driver::start(&bed, |c| c.mode = Mode::Controller).await;
    // a's node plugin holds no Harvester credential (our chart), b's the cloud-config
    // (upstream's chart).
    let (na, nb) = tokio::join!(
        start_plugin(&bed, &a, Credential::None),
        start_plugin(&bed, &b, Credential::CloudConfig)
    );
    say("both node plugins answer Probe");

    // CreateVolume: a Filesystem RWX host PVC on the Longhorn class, and upstream's CR.
    let created = ControllerClient::new(ctrl.channel.clone())
        .create_volume(rwx_request(
            "shared-vol",
            &[("hostStorageClass", RWX_CLASS)],
        ))
        .await
        .expect("CreateVolume RWX")
        .into_inner()
        .volume
        .expect("volume");
    let id = created.volume_id.clone();
    say(&format!("CreateVolume RWX: {id}"));
    let pvc = host_pvc(&bed, &id).await.expect("host PVC");
    let spec = pvc.spec.clone().unwrap_or_default();
    assert_eq!(
        spec.access_modes,
        Some(vec![upstream::HOST_ACCESS_MODE.into()])
    );
    assert_eq!(
        spec.volume_mode.as_deref(),
        Some(upstream::HOST_VOLUME_MODE)
    );
    assert_eq!(spec.storage_class_name.as_deref(), Some(RWX_CLASS));
    let pv = pv_of(&bed, &id).await;
    let cr = network_fs(&bed, &pv)
        .await
        .expect("NetworkFilesystem created by CreateVolume");
    let cr_spec = serde_json::to_value(&cr.spec).unwrap();
    assert_eq!(
        cr_spec,
        json!({"networkFSName": pv, "desiredState": upstream::DESIRED_DISABLED,
               "provisioner": upstream::NFS_PROVISIONER})
    );

    let v = ControllerClient::new(ctrl.channel.clone())
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: id.clone(),
            volume_capabilities: vec![rwx_cap()],
            ..Default::default()
        })
        .await
        .expect("ValidateVolumeCapabilities")
        .into_inner();
    assert!(
        v.confirmed.is_some(),
        "RWX confirmed for an RWX volume: {v:?}"
    );

    // Published to both guests: the CR is enabled and Ready, nothing is hot-plugged.
    let mut contexts = HashMap::new();
    for node in ["rwx-a", "rwx-b"] {
        let (took, context) = controller_publish(&ctrl, &id, node)
            .await
            .unwrap_or_else(|e| panic!("ControllerPublishVolume to {node}: {e:?}"));
        say(&format!(
            "ControllerPublishVolume RWX to {node} in {:.2}s: {context:?}",
            took.as_secs_f64()
        ));
        contexts.insert(node, context);
    }
    let cr = network_fs(&bed, &pv).await.expect("CR");
    assert_eq!(cr.spec.desired_state, upstream::DESIRED_ENABLED);
    let status = cr.status.clone().expect("status");
    assert_eq!(status.status, upstream::ENDPOINT_READY);
    assert_eq!(status.endpoint, HOST_FROM_GUEST);
    assert!(
        fs.nfs.exports().contains(&pv),
        "exported: {:?}",
        fs.nfs.exports()
    );
    assert!(
        !a.is_plugged(&testbed::real::vm::device_id(&id))
            && !b.is_plugged(&testbed::real::vm::device_id(&id)),
        "an RWX volume is never hot-plugged"
    );

    // Staged and published in both guests; a write on one is read on the other.
    let (mut va, mut vb) = (guest_vol(&id, "rwx-a"), guest_vol(&id, "rwx-b"));
    let export = format!("{HOST_FROM_GUEST}:/{pv}");
    // The export travels in the publish context: a node plugin needs no Harvester lookup.
    for node in ["rwx-a", "rwx-b"] {
        assert_eq!(
            contexts[node].get(networkfs_api::CONTEXT_NFS_EXPORT),
            Some(&export),
            "{node}: {:?}",
            contexts[node]
        );
    }
    va.ctx = contexts["rwx-a"].clone();
    vb.ctx = contexts["rwx-b"].clone();
    for (vm, n, v) in [(&a, &na, &va), (&b, &nb, &vb)] {
        let t = Instant::now();
        stage(n, v)
            .await
            .unwrap_or_else(|e| panic!("NodeStageVolume in {}: {e:?}", vm.name));
        // Idempotent: the same mount again is success.
        stage(n, v)
            .await
            .unwrap_or_else(|e| panic!("NodeStageVolume again: {e:?}"));
        common::publish(n, v, &rwx_cap())
            .await
            .unwrap_or_else(|e| panic!("NodePublishVolume in {}: {e:?}", vm.name));
        let m = guest_nfs_mount(vm, &v.staging)
            .await
            .expect("an NFS mount at staging");
        assert!(m.starts_with(&format!("{export} nfs")), "{}: {m}", vm.name);
        say(&format!(
            "{}: staged and published in {:.2}s: {m}",
            vm.name,
            t.elapsed().as_secs_f64()
        ));
    }
    a.run(&format!(
        "echo written-on-a > {}/from-a && sync",
        va.target.display()
    ))
    .await
    .expect("writing in guest a");
    let seen = b
        .run(&format!("cat {}/from-a", vb.target.display()))
        .await
        .expect("reading in guest b");
    assert_eq!(seen.trim(), "written-on-a", "b reads what a wrote");
    b.run(&format!(
        "echo written-on-b > {}/from-b && sync",
        vb.target.display()
    ))
    .await
    .expect("writing in guest b");
    assert_eq!(
        a.run(&format!("cat {}/from-b", va.target.display()))
            .await
            .expect("reading in a")
            .trim(),
        "written-on-b"
    );
    assert_eq!(
        std::fs::read_to_string(fs.host_mount(&pv).join("from-a")).expect("on the server"),
        "written-on-a\n",
        "the data is on the exported volume"
    );

    // Unpublished from a while b's Pod and attachment hold it: the export stays, b works on.
    guest_user(&bed, &id, "rwx-b").await;
    unstage(&na, &va).await;
    assert_eq!(guest_nfs_mount(&a, &va.staging).await, None, "a unmounted");
    delete_guest(
        Api::<VolumeAttachment>::all(bed.guest.client.clone()),
        "va-rwx-a",
    )
    .await;
    controller_unpublish(&ctrl, &id, "rwx-a").await;
    let cr = network_fs(&bed, &pv).await.expect("CR");
    assert_eq!(
        cr.spec.desired_state,
        upstream::DESIRED_ENABLED,
        "b still uses it"
    );
    b.run(&format!(
        "echo still-writing > {0}/after-a && sync && cat {0}/from-a",
        vb.target.display()
    ))
    .await
    .expect("b still reads and writes after a left");
    // The last user goes: unpublish from b disables the export.
    unstage(&nb, &vb).await;
    delete_guest(
        Api::<Pod>::namespaced(bed.guest.client.clone(), "default"),
        "user-rwx-b",
    )
    .await;
    delete_guest(
        Api::<VolumeAttachment>::all(bed.guest.client.clone()),
        "va-rwx-b",
    )
    .await;
    controller_unpublish(&ctrl, &id, "rwx-b").await;
    let cr = network_fs(&bed, &pv).await.expect("CR");
    assert_eq!(
        cr.spec.desired_state,
        upstream::DESIRED_DISABLED,
        "nobody uses it"
    );
    wait::until("the export to be removed", Duration::from_secs(30), || {
        let fs = fs.clone();
        let pv = pv.clone();
        async move {
            let e = fs.nfs.exports();
            Ok(if e.contains(&pv) { Err(e) } else { Ok(()) })
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    delete_guest(Api::<PersistentVolume>::all(bed.guest.client.clone()), &id).await;

    // A volume made the way upstream makes it (host PVC + NetworkFilesystem, not by our
    // driver) is published and staged by ours, and keeps what was written to it.
    let up_id = "pvc-made-by-upstream";
    let up_pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": up_id},
        "spec": {"accessModes": [upstream::HOST_ACCESS_MODE], "volumeMode": upstream::HOST_VOLUME_MODE,
                 "storageClassName": RWX_CLASS, "resources": {"requests": {"storage": "64Mi"}}}
    }))
    .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .create(&Default::default(), &up_pvc)
        .await
        .expect("upstream-style host PVC");
    let up_pv = pv_of(&bed, up_id).await;
    let up_cr: NetworkFilesystem = serde_json::from_value(json!({
        "apiVersion": "harvesterhci.io/v1beta1", "kind": "NetworkFilesystem",
        "metadata": {"name": up_pv, "namespace": upstream::NFS_NAMESPACE},
        "spec": {"networkFSName": up_pv, "desiredState": upstream::DESIRED_DISABLED,
                 "provisioner": upstream::NFS_PROVISIONER}
    }))
    .unwrap();
    Api::<NetworkFilesystem>::namespaced(bed.sim.harvester.clone(), upstream::NFS_NAMESPACE)
        .create(&Default::default(), &up_cr)
        .await
        .expect("upstream-style NetworkFilesystem");
    // Not this cluster's until a Harvester admin labels it so (docs/install.md): refused, and
    // the NetworkFilesystem stays as it was.
    let refused = controller_publish(&ctrl, up_id, "rwx-a")
        .await
        .expect_err("an unlabelled host PVC is no volume of this cluster");
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().contains(up_id)
            && refused
                .message()
                .contains("guestcluster.harvesterhci.io/name"),
        "{refused:?}"
    );
    let cr =
        Api::<NetworkFilesystem>::namespaced(bed.sim.harvester.clone(), upstream::NFS_NAMESPACE)
            .get(&up_pv)
            .await
            .expect("the upstream-made NetworkFilesystem");
    assert_eq!(cr.spec.desired_state, upstream::DESIRED_DISABLED);
    label_for_this_cluster(&bed, up_id).await;
    let (_, context) = controller_publish(&ctrl, up_id, "rwx-a")
        .await
        .expect("ControllerPublishVolume of the upstream-made volume");
    std::fs::write(fs.host_mount(&up_pv).join("made-upstream"), "kept\n")
        .expect("server-side write");
    // As if upstream's controller had attached it: no export in the publish context. a's node
    // plugin has no credential to look it up: refused naming the way out, nothing mounted.
    let mut vu = guest_vol(up_id, "rwx-a");
    let refused = stage(&na, &vu)
        .await
        .expect_err("no export and no credential");
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert!(
        refused
            .message()
            .contains(networkfs_api::CONTEXT_NFS_EXPORT)
            && refused.message().contains("nodeCloudConfig"),
        "{refused:?}"
    );
    assert_eq!(guest_nfs_mount(&a, &vu.staging).await, None);
    vu.ctx = context;
    stage(&na, &vu)
        .await
        .expect("NodeStageVolume of the upstream-made volume");
    assert_eq!(
        a.run(&format!("cat {}/made-upstream", vu.staging.display()))
            .await
            .expect("reading it in a")
            .trim(),
        "kept"
    );
    NodeClient::new(na.channel.clone())
        .node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: up_id.into(),
            staging_target_path: vu.staging.display().to_string(),
        })
        .await
        .expect("NodeUnstageVolume");

    // The NFS server stopped: NodeStage is UNAVAILABLE within its bound, with no mount and no
    // mount helper left in the guest. b's node plugin has the cloud-config (upstream's chart):
    // with no export in the publish context it looks the export up on Harvester.
    fs.nfs.stop();
    let bound = NFS_MOUNT_BOUND;
    let vdown = guest_vol(up_id, "rwx-b");
    let t = Instant::now();
    let err = stage(&nb, &vdown)
        .await
        .expect_err("the NFS server is down");
    let took = t.elapsed();
    say(&format!(
        "NodeStageVolume with the NFS server stopped: {:?} after {:.1}s (bound {bound:?}): {}",
        err.code(),
        took.as_secs_f64(),
        err.message()
    ));
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(err.message().contains(&up_pv), "{}", err.message());
    assert!(took < bound + Duration::from_secs(15), "bounded: {took:?}");
    assert_eq!(
        guest_nfs_mount(&b, &vdown.staging).await,
        None,
        "no mount left behind"
    );
    let helpers = b
        .run("ps -o pid,args | grep '[m]ount.nfs' || true")
        .await
        .expect("ps in the guest");
    assert!(helpers.trim().is_empty(), "no mount helper left: {helpers}");
    // Back up: the same stage works.
    fs.nfs.start_again().expect("restarting the NFS server");
    stage(&nb, &vdown)
        .await
        .expect("NodeStageVolume once the server is back");
    assert!(guest_nfs_mount(&b, &vdown.staging).await.is_some());
    NodeClient::new(nb.channel.clone())
        .node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: up_id.into(),
            staging_target_path: vdown.staging.display().to_string(),
        })
        .await
        .expect("NodeUnstageVolume");

    // Expansion is not offered for RWX volumes (upstream refuses it too).
    let err = ControllerClient::new(ctrl.channel.clone())
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: (128 * MIB) as i64,
                limit_bytes: 0,
            }),
            volume_capability: Some(rwx_cap()),
            ..Default::default()
        })
        .await
        .expect_err("expanding an RWX volume");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("RWX"), "{}", err.message());

    // DeleteVolume: the NetworkFilesystem goes first, then the PVC.
    for (vol, pv) in [(id.as_str(), pv.as_str()), (up_id, up_pv.as_str())] {
        ControllerClient::new(ctrl.channel.clone())
            .delete_volume(DeleteVolumeRequest {
                volume_id: vol.into(),
                ..Default::default()
            })
            .await
            .expect("DeleteVolume");
        assert!(
            network_fs(&bed, pv).await.is_none(),
            "{pv}: NetworkFilesystem deleted"
        );
        let bed = &bed;
        wait::until(
            "the host PVC to go",
            Duration::from_secs(30),
            || async move {
                Ok(if host_pvc(bed, vol).await.is_none() {
                    Ok(())
                } else {
                    Err("still there")
                })
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    ctrl.stop().await;
    a.stop().await;
    b.stop().await;
    say(&format!(
        "rwx_volume_shared_by_two_guests_root took {:.0}s",
        t0.elapsed().as_secs_f64()
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rwx_bad_input_is_invalid_argument() {
    wait::within(
        "rwx_bad_input_is_invalid_argument",
        TEST_LIMIT,
        rwx_bad_input_is_invalid_argument_steps(),
    )
    .await
}

async fn rwx_bad_input_is_invalid_argument_steps() {
    let bed = common::bed().await;
    let bed = bed.with_default_storage_class().await;
    create_class(&bed, "nfs-other", "nfs.csi.k8s.io", json!({})).await;
    create_class(&bed, RWX_CLASS, upstream::LONGHORN_PROVISIONER, json!({})).await;
    let ctrl = Driver::start(&bed, |c| c.mode = Mode::Controller).await;
    let mut c = ControllerClient::new(ctrl.channel.clone());
    let block_rwx = VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode {
            mode: ProtoMode::MultiNodeMultiWriter as i32,
        }),
    };
    let mut block = rwx_request("rwx-block", &[("hostStorageClass", RWX_CLASS)]);
    block.volume_capabilities = vec![block_rwx];
    let mut from_snapshot = rwx_request("rwx-snap", &[("hostStorageClass", RWX_CLASS)]);
    from_snapshot.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: "snap-1".into(),
            },
        )),
    });
    let cases: Vec<(&str, CreateVolumeRequest, Vec<&str>)> = vec![
        (
            "RWX block",
            block,
            vec!["volume_capabilities", "MULTI_NODE_MULTI_WRITER", "block"],
        ),
        (
            "RWX on a class that is not Longhorn",
            rwx_request("rwx-other", &[("hostStorageClass", "nfs-other")]),
            vec![
                "parameters",
                "hostStorageClass",
                "\"nfs-other\"",
                "nfs.csi.k8s.io",
            ],
        ),
        (
            "RWX on a StorageClass Harvester does not have",
            rwx_request(
                "rwx-missing-class",
                &[("hostStorageClass", "no-such-class")],
            ),
            vec!["parameters", "hostStorageClass", "\"no-such-class\""],
        ),
        (
            "RWX with hostVolumeMode block",
            rwx_request(
                "rwx-hostblock",
                &[("hostStorageClass", RWX_CLASS), ("hostVolumeMode", "block")],
            ),
            vec!["parameters", "hostVolumeMode", "\"block\""],
        ),
        (
            "RWX from a snapshot",
            from_snapshot,
            vec!["volume_content_source"],
        ),
    ];
    for (what, req, needles) in cases {
        let err = c.create_volume(req).await.expect_err(what);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err:?}");
        for n in needles {
            assert!(
                err.message().contains(n),
                "{what}: {n:?} in {}",
                err.message()
            );
        }
        say(&format!("{what}: {}", err.message()));
    }
    let pvcs =
        Api::<PersistentVolumeClaim>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
            .list(&Default::default())
            .await
            .expect("listing host PVCs");
    assert!(
        pvcs.items.is_empty(),
        "no host PVC for refused requests: {:?}",
        pvcs.items
    );
    let crs = Api::<NetworkFilesystem>::all(bed.sim.harvester.clone())
        .list(&Default::default())
        .await
        .expect("listing NetworkFilesystems");
    assert!(crs.items.is_empty());
    // Publishing a single-node (block) volume MULTI_NODE_MULTI_WRITER is refused too.
    let single = c
        .create_volume(common::create_request(
            "rwo",
            64 * MIB,
            &common::block_cap(),
        ))
        .await
        .expect("CreateVolume RWO")
        .into_inner()
        .volume
        .expect("volume");
    bed.sim
        .create_host("harvester-1", None, None)
        .await
        .expect("host");
    bed.sim
        .create_vm(&GuestVm::new(common::NODE).on_host("harvester-1"))
        .await
        .expect("VM");
    let err = controller_publish(&ctrl, &single.volume_id, common::NODE)
        .await
        .expect_err("an RWO volume published RWX");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("MULTI_NODE_MULTI_WRITER"),
        "{}",
        err.message()
    );
    let v = c
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: single.volume_id.clone(),
            volume_capabilities: vec![rwx_cap()],
            ..Default::default()
        })
        .await
        .expect("ValidateVolumeCapabilities")
        .into_inner();
    assert!(
        v.confirmed.is_none() && v.message.contains("MULTI_NODE_MULTI_WRITER"),
        "an RWO volume is not confirmed for RWX: {v:?}"
    );
    // A Harvester without networkfs-manager (before 1.4: no NetworkFilesystem CRD): RWX is not
    // served, as upstream decides by listing NetworkFilesystems, and nothing is created.
    Api::<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>::all(
        bed.sim.harvester.clone(),
    )
    .delete("networkfilesystems.harvesterhci.io", &Default::default())
    .await
    .expect("deleting the NetworkFilesystem CRD");
    wait::until(
        "the NetworkFilesystem API to be gone",
        Duration::from_secs(60),
        || async {
            Ok(
                match Api::<NetworkFilesystem>::all(bed.sim.harvester.clone())
                    .list(&Default::default())
                    .await
                {
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                    other => Err(format!("{:?}", other.map(|l| l.items.len()))),
                },
            )
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // A controller started against that Harvester (upstream decides at start; ours on first use).
    ctrl.stop().await;
    let ctrl = Driver::start(&bed, |c| c.mode = Mode::Controller).await;
    let err = ControllerClient::new(ctrl.channel.clone())
        .create_volume(rwx_request("rwx-old", &[("hostStorageClass", RWX_CLASS)]))
        .await
        .expect_err("RWX without NetworkFilesystems");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("MULTI_NODE_MULTI_WRITER")
            && err.message().contains("NetworkFilesystems"),
        "{}",
        err.message()
    );
    say(&format!("without networkfs-manager: {}", err.message()));
    assert!(
        host_pvc(&bed, "rwx-old").await.is_none(),
        "no host PVC when RWX is not served"
    );
    ctrl.stop().await;
}

/// What the CR's watch showed: (desiredState, status.state, status.status), one per event.
type History = Arc<std::sync::Mutex<Vec<(String, String, String)>>>;

/// Records every version of NetworkFilesystem `pv` the API server sends (the CR's history).
fn record_history(bed: &TestBed, pv: &str) -> (History, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    use kube::runtime::watcher::{self, Event};
    let history: History = Default::default();
    let api =
        Api::<NetworkFilesystem>::namespaced(bed.sim.harvester.clone(), upstream::NFS_NAMESPACE);
    let seen = history.clone();
    let config = watcher::Config::default().fields(&format!("metadata.name={pv}"));
    let task = tokio::spawn(async move {
        let mut events = watcher::watcher(api, config).boxed();
        while let Some(ev) = events.next().await {
            if let Ok(Event::Apply(n) | Event::InitApply(n)) = ev {
                let s = n.status.clone().unwrap_or_default();
                seen.lock()
                    .unwrap()
                    .push((n.spec.desired_state.clone(), s.state, s.status));
            }
        }
    });
    (history, task)
}

/// Waits until NetworkFilesystem `pv` has `status.state` `state`.
async fn wait_state(bed: &TestBed, pv: &str, state: &str, limit: Duration) {
    wait::until(
        &format!("NetworkFilesystem {pv} {state}"),
        limit,
        || async move {
            let n = network_fs(bed, pv).await;
            let now = n.as_ref().map(|n| n.state().to_string());
            Ok(if now.as_deref() == Some(state) {
                Ok(())
            } else {
                Err(now)
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// A bed with the host RWX class `class` (Longhorn parameters `params`), two VMs of the
/// stand-in (`rwx-a`, `rwx-b`, no guest kernel) and networkfs-manager's part running.
async fn two_stand_in_vms(class: &str, params: serde_json::Value) -> (TestBed, Arc<NetworkFs>) {
    let bed = common::bed().await;
    let bed = bed.with_default_storage_class().await;
    create_class(&bed, class, upstream::LONGHORN_PROVISIONER, params).await;
    bed.sim
        .create_host("harvester-1", None, None)
        .await
        .expect("host");
    for node in ["rwx-a", "rwx-b"] {
        bed.sim
            .create_vm(&GuestVm::new(node).on_host("harvester-1"))
            .await
            .expect("VM");
    }
    let fs = bed
        .sim
        .start_networkfs(HOST_FROM_GUEST)
        .unwrap_or_else(|e| panic!("the NFS server must start for this test: {e}"));
    (bed, fs)
}

/// Contract (networkfs-manager v0.1.1 `enableNetworkFS` / `OnShareManagerChange`): the last
/// node's unpublish leaves the CR `Disabling` until the share manager stops, and an Enabled
/// written meanwhile is refused for good. A publish on another node right after waits for
/// `Disabled` and only then writes Enabled; past its bound it is UNAVAILABLE naming the state
/// and writes nothing; the attacher's retry then succeeds. No guest kernel needed: the
/// controller runs on the host, the nodes are VMs of the stand-in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_rwx_republish_waits_for_disabled_root() {
    wait::within(
        "contract_rwx_republish_waits_for_disabled_root",
        TEST_LIMIT,
        contract_rwx_republish_waits_for_disabled_root_steps(),
    )
    .await
}

async fn contract_rwx_republish_waits_for_disabled_root_steps() {
    assert_root();
    let t0 = Instant::now();
    let (bed, fs) = two_stand_in_vms(RWX_CLASS, json!({})).await;
    let bound = Duration::from_secs(5);
    let ctrl = Driver::start(&bed, |c| {
        c.mode = Mode::Controller;
        c.timeouts.nfs_disabled = bound;
    })
    .await;
    let id = create_rwx(&ctrl, "moving").await;
    let pv = pv_of(&bed, &id).await;
    let (history, watch) = record_history(&bed, &pv);

    controller_publish(&ctrl, &id, "rwx-a")
        .await
        .expect("ControllerPublishVolume to rwx-a");
    let cr = network_fs(&bed, &pv).await.expect("CR");
    let status = cr.status.clone().expect("status");
    assert_eq!(
        (status.state.as_str(), status.status.as_str()),
        ("Enabled", upstream::ENDPOINT_READY)
    );
    assert_eq!(status.mount_opts, None, "upstream's mountOpts: empty");

    // The Pod moves: the last node lets go, another takes it at once. The share manager takes
    // 3 s to stop.
    let delay = Duration::from_secs(3);
    fs.set_disable_delay(delay);
    controller_unpublish(&ctrl, &id, "rwx-a").await;
    wait_state(&bed, &pv, "Disabling", Duration::from_secs(10)).await;
    let t = Instant::now();
    let took = controller_publish(&ctrl, &id, "rwx-b").await;
    say(&format!(
        "ControllerPublishVolume to rwx-b during Disabling (share manager stopping {delay:?}): \
         {took:?} after {:.2}s",
        t.elapsed().as_secs_f64()
    ));
    let enabled_while_disabling = |h: &History| -> Vec<(String, String, String)> {
        h.lock()
            .unwrap()
            .iter()
            .filter(|(desired, state, _)| desired == "Enabled" && state == "Disabling")
            .cloned()
            .collect()
    };
    let bad = enabled_while_disabling(&history);
    assert!(
        bad.is_empty(),
        "ControllerPublish wrote desiredState Enabled while the NetworkFilesystem was Disabling \
         (networkfs-manager refuses that for good): {bad:?}; history {:?}; networkfs-manager \
         said {:?}",
        history.lock().unwrap(),
        fs.errors(&pv)
    );
    took.expect("ControllerPublishVolume to rwx-b once Disabled");
    assert!(
        t.elapsed() >= delay - Duration::from_millis(500),
        "it waited for the share manager: {:?}",
        t.elapsed()
    );
    let cr = network_fs(&bed, &pv).await.expect("CR");
    assert_eq!(cr.spec.desired_state, upstream::DESIRED_ENABLED);
    assert!(cr.ready_endpoint().is_ok(), "serving: {:?}", cr.status);
    let states: Vec<String> = history
        .lock()
        .unwrap()
        .iter()
        .map(|h| h.1.clone())
        .collect();
    let disabled_after_disabling = states
        .iter()
        .skip_while(|s| *s != "Disabling")
        .any(|s| s == "Disabled");
    assert!(
        disabled_after_disabling,
        "Disabling, then Disabled, then enabled: {states:?}"
    );
    assert!(
        fs.errors(&pv).is_empty(),
        "networkfs-manager never refused: {:?}",
        fs.errors(&pv)
    );

    // A share manager slower than the bound: UNAVAILABLE naming the state, nothing written; the
    // attacher's retry gets it once Disabled.
    fs.set_disable_delay(bound + Duration::from_secs(3));
    controller_unpublish(&ctrl, &id, "rwx-b").await;
    wait_state(&bed, &pv, "Disabling", Duration::from_secs(10)).await;
    let t = Instant::now();
    let err = controller_publish(&ctrl, &id, "rwx-a")
        .await
        .expect_err("the share manager is still stopping past the bound");
    say(&format!(
        "past the bound ({bound:?}): {:?} after {:.2}s: {}",
        err.code(),
        t.elapsed().as_secs_f64(),
        err.message()
    ));
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("\"Disabling\"") && err.message().contains(&pv),
        "{}",
        err.message()
    );
    assert!(t.elapsed() < bound + Duration::from_secs(3), "bounded");
    let cr = network_fs(&bed, &pv).await.expect("CR");
    assert_eq!(
        cr.spec.desired_state,
        upstream::DESIRED_DISABLED,
        "left alone"
    );
    controller_publish(&ctrl, &id, "rwx-a")
        .await
        .expect("the retry, once Disabled");
    let bad = enabled_while_disabling(&history);
    assert!(bad.is_empty(), "Enabled written while Disabling: {bad:?}");
    assert!(fs.errors(&pv).is_empty(), "{:?}", fs.errors(&pv));
    watch.abort();
    ctrl.stop().await;
    say(&format!(
        "contract_rwx_republish_waits_for_disabled_root took {:.0}s",
        t0.elapsed().as_secs_f64()
    ));
}

/// Contract (the kernel's hard NFS mounts): with the NFS server dead, statvfs and umount of the
/// mount wait in the kernel until it comes back. The node plugin (one thread in the guest) must
/// answer NodeGetVolumeStats, NodeUnpublish and NodeUnstage within `Timeouts::nfs_server`, with
/// UNAVAILABLE naming the server, and keep answering other RPCs meanwhile. One QEMU guest: the
/// host kernel has no NFS client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_nfs_server_down_never_blocks_the_node_plugin_root() {
    wait::within(
        "contract_nfs_server_down_never_blocks_the_node_plugin_root",
        TEST_LIMIT,
        contract_nfs_server_down_never_blocks_the_node_plugin_root_steps(),
    )
    .await
}

async fn contract_nfs_server_down_never_blocks_the_node_plugin_root_steps() {
    assert_root();
    let t0 = Instant::now();
    let (bed, fs, vm, ctrl) = one_guest("rwx-d").await;
    let node = start_plugin(&bed, &vm, Credential::None).await;
    let id = create_rwx(&ctrl, "served").await;
    let (_, context) = controller_publish(&ctrl, &id, "rwx-d")
        .await
        .expect("ControllerPublishVolume");
    let mut v = guest_vol(&id, "rwx-d");
    v.ctx = context;
    stage(&node, &v).await.expect("NodeStageVolume");
    common::publish(&node, &v, &rwx_cap())
        .await
        .expect("NodePublishVolume");
    let stats = |path: &Path| NodeGetVolumeStatsRequest {
        volume_id: id.clone(),
        volume_path: path.display().to_string(),
        staging_target_path: v.staging.display().to_string(),
    };
    let mut n = NodeClient::new(node.channel.clone());
    let usage = n
        .node_get_volume_stats(stats(&v.target))
        .await
        .expect("NodeGetVolumeStats while the server serves")
        .into_inner();
    assert!(
        usage.usage.iter().any(|u| u.total > 0),
        "usage of the export: {usage:?}"
    );

    // The server dies (the share manager Pod killed): the hard mount's RPCs wait for it.
    fs.nfs.stop();
    let deadline = NFS_SERVER_BOUND;
    let slack = Duration::from_secs(5);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Other RPCs meanwhile: each must be answered within 3 s.
    let prober = {
        let channel = node.channel.clone();
        let done = done.clone();
        tokio::spawn(async move {
            let mut answered = 0;
            let mut missed = Vec::new();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let t = Instant::now();
                let info = tokio::time::timeout(
                    Duration::from_secs(3),
                    NodeClient::new(channel.clone()).node_get_info(NodeGetInfoRequest {}),
                )
                .await;
                match info {
                    Ok(Ok(_)) => answered += 1,
                    other => missed.push(format!(
                        "NodeGetInfo after {:.1}s: {:?}",
                        t.elapsed().as_secs_f64(),
                        other.map(|r| r.map(|_| ()))
                    )),
                }
                let probe = tokio::time::timeout(
                    Duration::from_secs(3),
                    IdentityClient::new(channel.clone()).probe(ProbeRequest {}),
                )
                .await;
                if !matches!(probe, Ok(Ok(_))) {
                    missed.push(format!("Probe: {:?}", probe.map(|r| r.map(|_| ()))));
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            (answered, missed)
        })
    };
    // Each call bounded here too: the old plugin never returned.
    let call = |what: &'static str,
                t: Instant,
                r: Result<Result<(), tonic::Status>, tokio::time::error::Elapsed>| {
        let took = t.elapsed();
        say(&format!(
            "{what} with the NFS server dead: after {:.1}s (deadline {deadline:?}): {r:?}",
            took.as_secs_f64()
        ));
        match r {
            Err(_) => panic!(
                "{what} did not return within {:?} with the NFS server dead: the node plugin is blocked",
                deadline + slack * 4
            ),
            Ok(r) => (r, took),
        }
    };
    let limit = deadline + slack * 4;
    let t = Instant::now();
    let r = tokio::time::timeout(limit, n.node_get_volume_stats(stats(&v.target)))
        .await
        .map(|r| r.map(|_| ()));
    let (r, took) = call("NodeGetVolumeStats", t, r);
    let err = r.expect_err("statvfs cannot be answered with the server dead");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message()
            .contains(&format!("NFS server {HOST_FROM_GUEST}")),
        "{}",
        err.message()
    );
    assert!(took < deadline + slack, "within the deadline: {took:?}");
    // Asked again while the first statvfs still waits in the kernel: answered at once.
    let t = Instant::now();
    let r = tokio::time::timeout(limit, n.node_get_volume_stats(stats(&v.target)))
        .await
        .map(|r| r.map(|_| ()));
    let (r, took) = call("NodeGetVolumeStats again", t, r);
    let err = r.expect_err("still dead");
    assert!(err.message().contains(HOST_FROM_GUEST), "{}", err.message());
    assert!(took < Duration::from_secs(3), "answered at once: {took:?}");
    // A kubelet restart re-sends NodeStage and NodePublish of what is staged and published:
    // answered from mountinfo at once, without touching the dead mount.
    let t = Instant::now();
    let r = tokio::time::timeout(limit, stage(&node, &v)).await;
    let (r, took) = call("NodeStageVolume again", t, r);
    r.expect("NodeStageVolume of a staged RWX volume is done");
    assert!(took < Duration::from_secs(3), "answered at once: {took:?}");
    let t = Instant::now();
    let r = tokio::time::timeout(limit, common::publish(&node, &v, &rwx_cap())).await;
    let (r, took) = call("NodePublishVolume again", t, r);
    r.expect("NodePublishVolume of a published RWX volume is done");
    assert!(took < Duration::from_secs(3), "answered at once: {took:?}");
    // NodeUnpublish (the bind) and NodeUnstage (the NFS mount itself): bounded, and either done
    // or UNAVAILABLE naming the server; nothing left mounted either way.
    for (what, path) in [
        ("NodeUnpublishVolume", &v.target),
        ("NodeUnstageVolume", &v.staging),
    ] {
        let t = Instant::now();
        let r = if what == "NodeUnpublishVolume" {
            tokio::time::timeout(
                limit,
                n.node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: id.clone(),
                    target_path: path.display().to_string(),
                }),
            )
            .await
            .map(|r| r.map(|_| ()))
        } else {
            tokio::time::timeout(
                limit,
                n.node_unstage_volume(NodeUnstageVolumeRequest {
                    volume_id: id.clone(),
                    staging_target_path: path.display().to_string(),
                }),
            )
            .await
            .map(|r| r.map(|_| ()))
        };
        let (r, took) = call(what, t, r);
        assert!(
            took < deadline + slack,
            "{what} within the deadline: {took:?}"
        );
        if let Err(e) = &r {
            assert_eq!(e.code(), tonic::Code::Unavailable, "{what}: {e:?}");
            assert!(
                e.message()
                    .contains(&format!("NFS server {HOST_FROM_GUEST}")),
                "{what}: {}",
                e.message()
            );
        }
        if what == "NodeUnstageVolume" {
            let e = r.expect_err("the NFS mount's unmount waits for the dead server");
            assert!(e.message().contains("forced and lazily"), "{}", e.message());
        }
        assert_eq!(
            guest_nfs_mount(&vm, path).await,
            None,
            "{what}: nothing left mounted at {}",
            path.display()
        );
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let (answered, missed) = prober.await.expect("prober");
    say(&format!(
        "other RPCs meanwhile: {answered} NodeGetInfo answered, missed {missed:?}"
    ));
    assert!(missed.is_empty(), "other RPCs went unanswered: {missed:?}");
    assert!(answered >= 3, "other RPCs answered meanwhile: {answered}");
    // The CO's retry: nothing mounted, success.
    n.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: v.staging.display().to_string(),
    })
    .await
    .expect("NodeUnstageVolume retried");
    ctrl.stop().await;
    vm.stop().await;
    say(&format!(
        "contract_nfs_server_down_never_blocks_the_node_plugin_root took {:.0}s",
        t0.elapsed().as_secs_f64()
    ));
}

/// The size of the share manager's filesystem of `pv`, in bytes.
fn filesystem_size(fs: &NetworkFs, pv: &str) -> u64 {
    networkfs::filesystem_size(&fs.host_mount(pv)).unwrap_or_else(|e| panic!("{e}"))
}

/// Contract (networkfs-manager b9addbdce76c2317c828ec7ac84c472b6f7a96b4 `OnPVCChange`,
/// `checkAndProcessExpand`): an RWX volume's host PVC grown on Harvester (its UI; the driver
/// refuses RWX expansion) makes the Enabled NetworkFilesystem `Expanding` until the claim's
/// capacity follows, then `Ready` again, with the share manager's filesystem grown online. All
/// along the volume is served: a ControllerPublish to another node answers at once instead of
/// waiting for `Ready`. No guest kernel needed: the controller runs on the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_rwx_online_expansion_keeps_the_volume_served_root() {
    wait::within(
        "contract_rwx_online_expansion_keeps_the_volume_served_root",
        TEST_LIMIT,
        contract_rwx_online_expansion_keeps_the_volume_served_root_steps(),
    )
    .await
}

async fn contract_rwx_online_expansion_keeps_the_volume_served_root_steps() {
    assert_root();
    const XFS_CLASS: &str = "longhorn-rwx-xfs";
    // xfs: online ext4 growth needs CAP_SYS_RESOURCE, which this host lacks (docs/testbed.md).
    let (bed, fs) = two_stand_in_vms(XFS_CLASS, json!({"fsType": "xfs"})).await;
    let ctrl = Driver::start(&bed, |c| c.mode = Mode::Controller).await;
    // xfs needs 300 MiB at least.
    let mut request = rwx_request("growing", &[("hostStorageClass", XFS_CLASS)]);
    request.capacity_range = Some(CapacityRange {
        required_bytes: (320 * MIB) as i64,
        limit_bytes: 0,
    });
    let id = ControllerClient::new(ctrl.channel.clone())
        .create_volume(request)
        .await
        .expect("CreateVolume RWX")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id;
    let pv = pv_of(&bed, &id).await;
    let (history, watch) = record_history(&bed, &pv);
    controller_publish(&ctrl, &id, "rwx-a")
        .await
        .expect("ControllerPublishVolume to rwx-a");
    let before = filesystem_size(&fs, &pv);

    // An administrator grows the host PVC; the expander takes 3 s.
    let expander = Duration::from_secs(3);
    fs.set_expand_delay(expander);
    Api::<PersistentVolumeClaim>::namespaced(bed.sim.harvester.clone(), &bed.vm_namespace)
        .patch(
            &id,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"spec": {"resources": {"requests": {"storage": "640Mi"}}}}),
            ),
        )
        .await
        .expect("growing the host PVC");
    wait::until(
        &format!("NetworkFilesystem {pv} Expanding"),
        Duration::from_secs(10),
        || async {
            let s = network_fs(&bed, &pv).await.and_then(|n| n.status);
            let now = s.map(|s| (s.state, s.status));
            Ok(match &now {
                Some((state, status)) if state == "Enabled" && status == "Expanding" => Ok(()),
                _ => Err(now),
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let (took, _) = controller_publish(&ctrl, &id, "rwx-b")
        .await
        .expect("ControllerPublishVolume to rwx-b while Expanding");
    let during = network_fs(&bed, &pv).await.and_then(|n| n.status);
    say(&format!(
        "ControllerPublishVolume to rwx-b while Expanding: {took:?}; the CR then: {:?}",
        during.as_ref().map(|s| (&s.state, &s.status))
    ));
    assert_eq!(
        during.as_ref().map(|s| s.status.as_str()),
        Some("Expanding"),
        "the publish answered while the volume was still expanding"
    );
    assert!(took < Duration::from_secs(2), "answered at once: {took:?}");

    wait::until(
        &format!("NetworkFilesystem {pv} Ready at 640Mi"),
        Duration::from_secs(30),
        || async {
            let status = network_fs(&bed, &pv)
                .await
                .and_then(|n| n.status)
                .map(|s| s.status);
            let capacity = host_pvc(&bed, &id)
                .await
                .and_then(|p| p.status)
                .and_then(|s| s.capacity)
                .and_then(|c| c.get("storage").map(|q| q.0.clone()));
            let now = (status, capacity, fs.errors(&pv));
            Ok(match &now {
                (Some(s), Some(c), _) if s == "Ready" && c == "640Mi" => Ok(()),
                _ => Err(now),
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let after = filesystem_size(&fs, &pv);
    say(&format!("share manager's xfs: {before} -> {after} bytes"));
    assert!(
        after >= before + 300 * MIB,
        "the filesystem grew online: {before} -> {after}"
    );
    let statuses: Vec<String> = history
        .lock()
        .unwrap()
        .iter()
        .filter(|h| h.1 == "Enabled")
        .map(|h| h.2.clone())
        .collect();
    let mut order = statuses.iter().map(String::as_str).collect::<Vec<_>>();
    order.dedup();
    assert_eq!(order, ["Ready", "Expanding", "Ready"], "{statuses:?}");
    assert!(fs.errors(&pv).is_empty(), "{:?}", fs.errors(&pv));
    watch.abort();
    ctrl.stop().await;
}

/// The network namespace of the node plugin "Pod" in the guest, bound here as `ip netns add`
/// would (so that it can be entered and deleted by name).
const POD_NETNS: &str = "/run/pod-net";
/// The PID (= process group) of the "Pod"'s first process.
const POD_PID: &str = "/run/pod.pid";

/// The guest side of [`start_plugin_as_pod`]: a Pod under upstream's chart, as the guest allows.
/// hostPID: the guest's PID 1 is visible (no PID namespace); no host network: a new network
/// namespace whose only network is the Pod's, here `lo` with the guest's address of the host
/// (10.0.2.2) on it and a relay per port (the Harvester API server's, the NFS server's) to the
/// same port on the real 10.0.2.2 (busybox `nc` in the Pod, `nsenter` to the guest's network per
/// connection), standing in for the CNI's veth: what goes through the Pod's network dies with the
/// Pod. Started with `setsid`: the Pod is one process group.
const POD_SCRIPT: &str = r#"set -e
echo $$ > /run/pod.pid
ip link set lo up
ip addr add 10.0.2.2/32 dev lo
mount --bind /proc/$$/ns/net /run/pod-net
for port in $RELAY_PORTS; do
  nc -ll -p "$port" -e nsenter --net=/proc/1/ns/net nc 10.0.2.2 "$port" &
done
exec "$@"
"#;

/// Starts the node plugin in the guest the way a Pod under upstream's chart runs it (see
/// [`POD_SCRIPT`]), `relay` the host ports its network reaches, and waits until it answers Probe
/// through the guest's relay of [`CSI_PORT`] into the Pod's network namespace.
async fn start_plugin_as_pod(vm: &Vm, relay: &[u16], log: &str) -> GuestPlugin {
    std::fs::write(vm.share.join("pod.sh"), POD_SCRIPT).expect("pod.sh");
    let ports: Vec<String> = relay.iter().map(u16::to_string).collect();
    vm.run(&format!(
        "touch {POD_NETNS} && RELAY_PORTS='{}' setsid unshare -n sh {GUEST_SHARE}/pod.sh {} \
         >{GUEST_SHARE}/{log} 2>&1 </dev/null &",
        ports.join(" "),
        plugin_command(vm, Credential::CloudConfig)
    ))
    .await
    .expect("starting the node plugin Pod in the guest");
    connect_plugin(vm, log).await
}

/// The Pod replaced: every process of it killed (its process group), its network torn down as
/// the CNI's DEL does, and its network namespace deleted (`ip netns del`: the name unbound).
async fn kill_pod(vm: &Vm) {
    vm.run(&format!(
        "kill -9 -$(cat {POD_PID}) && sleep 1 && nsenter --net={POD_NETNS} ip link set lo down \
         && umount {POD_NETNS} && rm {POD_PID}"
    ))
    .await
    .expect("killing the node plugin Pod and deleting its network namespace");
}

/// The NFS client's volumes in the guest's own network namespace (`/proc/net/nfsfs/volumes` is
/// per network namespace), without the header line.
async fn nfs_volumes_in_guest_netns(vm: &Vm) -> Vec<String> {
    vm.run("cat /proc/1/net/nfsfs/volumes")
        .await
        .expect("reading the guest's NFS volumes")
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect()
}

/// The Harvester API server's port from the bed's cloud-config (`https://127.0.0.1:<port>`).
fn api_port(bed: &TestBed) -> u16 {
    let config = std::fs::read_to_string(&bed.cloud_config).expect("cloud-config");
    let rest = config
        .split_once("https://127.0.0.1:")
        .map(|(_, r)| r)
        .expect("the API server in the cloud-config");
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().expect("the API server's port")
}

/// Issue 24: under upstream's chart (hostPID, the node plugin Pod's own network namespace) an
/// RWX mount must not depend on the Pod's network: it is made in the host's network namespace,
/// and reads and writes go on after the Pod is killed and its network namespace deleted; a new
/// Pod unpublishes and unstages it. Without hostPID and host network, the plugin warns at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rwx_mount_outlives_the_node_plugin_pod_root() {
    wait::within(
        "rwx_mount_outlives_the_node_plugin_pod_root",
        TEST_LIMIT,
        rwx_mount_outlives_the_node_plugin_pod_root_steps(),
    )
    .await
}

async fn rwx_mount_outlives_the_node_plugin_pod_root_steps() {
    assert_root();
    let t0 = Instant::now();
    let (bed, fs, vm, ctrl) = one_guest("rwx-p").await;
    share_plugin(&bed, &vm);
    // The kubelet's side: the CSI port relayed into whichever Pod network namespace is current.
    vm.run(&format!(
        "setsid nc -ll -p {CSI_PORT} -e nsenter --net={POD_NETNS} nc 127.0.0.1 {CSI_PORT} \
         </dev/null >/dev/null 2>&1 &"
    ))
    .await
    .expect("the CSI port's relay");
    let relay = [api_port(&bed), fs.nfs.port];
    let pod = start_plugin_as_pod(&vm, &relay, "pod-1.log").await;
    let id = create_rwx(&ctrl, "outlives").await;
    let pv = pv_of(&bed, &id).await;
    let (_, context) = controller_publish(&ctrl, &id, "rwx-p")
        .await
        .expect("ControllerPublishVolume");
    let mut v = guest_vol(&id, "rwx-p");
    v.ctx = context;
    stage(&pod, &v)
        .await
        .unwrap_or_else(|e| panic!("NodeStageVolume from the Pod's network namespace: {e:?}"));
    common::publish(&pod, &v, &rwx_cap())
        .await
        .expect("NodePublishVolume");
    let volumes = nfs_volumes_in_guest_netns(&vm).await;
    say(&format!(
        "NFS volumes in the guest's network namespace: {volumes:?}"
    ));
    // A writer in the guest's own namespaces.
    vm.run(&format!(
        "echo before > {}/before && sync",
        v.target.display()
    ))
    .await
    .expect("writing before the Pod is replaced");

    // The Pod replaced: killed, its network namespace deleted.
    kill_pod(&vm).await;
    let t = Instant::now();
    let after = vm
        .shell_within(
            &format!(
                "timeout -s KILL 30 sh -c 'echo after > {0}/after && sync && cat {0}/before {0}/after'",
                v.target.display()
            ),
            Duration::from_secs(60),
        )
        .await
        .expect("the guest shell");
    say(&format!(
        "read and write after the Pod was replaced: exit {} in {:.1}s: {}",
        after.code,
        t.elapsed().as_secs_f64(),
        after.output.trim()
    ));
    assert_eq!(
        (after.code, after.output.trim()),
        (0, "before\nafter"),
        "the mount reads and writes after the node plugin Pod and its network namespace are gone"
    );
    assert_eq!(
        std::fs::read_to_string(fs.host_mount(&pv).join("after")).expect("on the server"),
        "after\n"
    );
    assert!(
        !volumes.is_empty(),
        "the NFS mount was made in the host's network namespace, not the Pod's"
    );
    let log1 = std::fs::read_to_string(vm.share.join("pod-1.log")).unwrap_or_default();
    assert!(
        log1.contains("/proc/1/ns/net") && !log1.contains("hostPID: true"),
        "the plugin chose the host's network namespace, with no warning: {log1}"
    );

    // A new Pod (again its own network namespace) unpublishes and unstages.
    let pod = start_plugin_as_pod(&vm, &relay, "pod-2.log").await;
    common::unpublish_and_unstage(&pod, &v).await;
    assert_eq!(guest_nfs_mount(&vm, &v.target).await, None, "unpublished");
    assert_eq!(guest_nfs_mount(&vm, &v.staging).await, None, "unstaged");
    assert!(
        nfs_volumes_in_guest_netns(&vm).await.is_empty(),
        "no NFS client left"
    );
    kill_pod(&vm).await;

    // Neither hostPID nor host network (own PID, UTS and network namespaces; /proc/1 is the
    // plugin itself): today's mounts from its own namespace, and one warning at start.
    let nowhere = vm
        .run(&format!(
            "setsid sh -c 'echo $$ > /run/nowhere.pid; exec unshare -n -u -p -f --mount-proc {}' \
             >{GUEST_SHARE}/nowhere.log 2>&1 </dev/null & \
             i=0; while ! grep -q hostPID {GUEST_SHARE}/nowhere.log && [ $i -lt 60 ]; do \
             sleep 0.5; i=$((i+1)); done; \
             kill -9 -$(cat /run/nowhere.pid); cat {GUEST_SHARE}/nowhere.log",
            plugin_command(&vm, Credential::None)
        ))
        .await
        .expect("the node plugin without hostPID and host network");
    let warnings: Vec<&str> = nowhere
        .lines()
        .filter(|l| l.contains("hostPID: true"))
        .collect();
    assert_eq!(
        warnings.len(),
        1,
        "one warning saying what to set: {nowhere}"
    );
    assert!(
        warnings[0].contains("hostNetwork: true") && warnings[0].contains("WARN"),
        "{}",
        warnings[0]
    );
    ctrl.stop().await;
    vm.stop().await;
    say(&format!(
        "rwx_mount_outlives_the_node_plugin_pod_root took {:.0}s",
        t0.elapsed().as_secs_f64()
    ));
}
