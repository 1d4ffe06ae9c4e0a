//! Tests of the test bed itself, against the real etcd, kube-apiservers and aggregation layer.

use std::time::Duration;

use harvester_common::harvester::hotplug::{self, AddVolumeOptions, RemoveVolumeOptions};
use harvester_common::harvester::kubevirt::VOLUME_READY;
use harvester_common::harvester::{IPPool, LoadBalancer, VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use testbed::sim::GuestVm;
use testbed::{TestBed, util::wait};

fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).expect("test object literal")
}

#[tokio::test]
async fn bed_stops_every_process_and_removes_its_dir() {
    let bed = TestBed::started().await;
    let pids = bed.pids();
    let dir = bed.dir.path().to_path_buf();
    // With TESTBED_LB_UPSTREAM, Harvester's LB controller and webhook too.
    let upstream = if bed.lb_upstream.is_some() { 2 } else { 0 };
    assert_eq!(
        pids.len(),
        3 + upstream,
        "etcd, two kube-apiservers and {upstream} of Harvester's LB"
    );
    for pid in &pids {
        assert!(
            std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "{pid} runs while the bed is up"
        );
    }
    drop(bed);
    for pid in &pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} outlived the bed"
        );
    }
    assert!(
        !dir.exists(),
        "bed directory {} was left behind",
        dir.display()
    );
}

#[tokio::test]
async fn crds_are_served_by_the_harvester_api_server() {
    let bed = TestBed::started().await;
    let c = &bed.harvester.client;
    let ns = &bed.vm_namespace;
    let lp = ListParams::default();
    Api::<VirtualMachine>::namespaced(c.clone(), ns)
        .list(&lp)
        .await
        .expect("VMs served");
    Api::<VirtualMachineInstance>::namespaced(c.clone(), ns)
        .list(&lp)
        .await
        .expect("VMIs served");
    Api::<LoadBalancer>::namespaced(c.clone(), ns)
        .list(&lp)
        .await
        .expect("LoadBalancers served");
    Api::<IPPool>::all(c.clone())
        .list(&lp)
        .await
        .expect("IPPools served");
    for plural in [
        "volumesnapshots",
        "volumesnapshotcontents",
        "volumesnapshotclasses",
    ] {
        let req = http::Request::get(format!("/apis/snapshot.storage.k8s.io/v1/{plural}"))
            .body(vec![])
            .unwrap();
        c.request_text(req)
            .await
            .unwrap_or_else(|e| panic!("{plural} served: {e}"));
    }
    // The VM CRD has a status subresource: a plain update must not change status.
    bed.sim
        .create_host("h1", Some("r1"), Some("z1"))
        .await
        .expect("host");
    let (mut vm, _) = bed
        .sim
        .create_vm(&GuestVm::new("w1").on_host("h1"))
        .await
        .expect("vm");
    assert_eq!(vm.status.as_ref().map(|s| s.ready), Some(true));
    let vms = Api::<VirtualMachine>::namespaced(c.clone(), ns);
    // Harvester's real LB controller (TESTBED_LB_UPSTREAM) adds its finalizer to every VM: a
    // write that may race this one, which then reads the VM again.
    let after = loop {
        vm.status.as_mut().expect("status").ready = false;
        match vms.replace("w1", &PostParams::default(), &vm).await {
            Err(kube::Error::Api(s)) if s.code == 409 => vm = vms.get("w1").await.expect("get"),
            other => break other.expect("update"),
        }
    };
    assert_eq!(
        after.status.map(|s| s.ready),
        Some(true),
        "status is a subresource"
    );
}

#[tokio::test]
async fn vm_helpers_stop_start_migrate_and_delete() {
    let bed = TestBed::started().await;
    let sim = &bed.sim;
    sim.create_host("h1", Some("r1"), Some("z1"))
        .await
        .expect("h1");
    sim.create_host("h2", Some("r1"), Some("z2"))
        .await
        .expect("h2");
    let spec = GuestVm::new("w1").on_host("h1").ip("10.0.0.5");
    let (_, vmi) = sim.create_vm(&spec).await.expect("vm");
    let ann = vmi.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        ann.get("topology.kubernetes.io/zone").map(String::as_str),
        Some("z1")
    );
    let moved = sim.migrate_vm("w1", "h2").await.expect("migrate");
    assert_eq!(
        moved.status.as_ref().and_then(|s| s.node_name.as_deref()),
        Some("h2")
    );
    let ann = moved.metadata.annotations.unwrap_or_default();
    assert_eq!(
        ann.get("topology.kubernetes.io/zone").map(String::as_str),
        Some("z2")
    );

    sim.stop_vm("w1").await.expect("stop");
    let vms = Api::<VirtualMachine>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let vmis =
        Api::<VirtualMachineInstance>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let vm = vms.get("w1").await.expect("vm after stop");
    assert_eq!(vm.status.map(|s| s.ready), Some(false));
    assert!(
        vmis.get_opt("w1").await.expect("get vmi").is_none(),
        "a stopped VM has no VMI"
    );
    sim.start_vm(&spec).await.expect("start");
    assert!(vmis.get_opt("w1").await.expect("get vmi").is_some());
    sim.delete_vm("w1").await.expect("delete");
    assert!(vms.get_opt("w1").await.expect("get vm").is_none());
}

/// A Harvester PVC the way the CSI driver creates it: block mode, RWX.
fn pvc(name: &str, size: &str) -> PersistentVolumeClaim {
    obj(json!({
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteMany"], "volumeMode": "Block",
                 "resources": {"requests": {"storage": size}}}
    }))
}

#[tokio::test]
async fn addvolume_through_the_aggregator_makes_a_ready_disk_on_a_loop_device_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root for loop devices; run it as root (make test does)"
    );
    let bed = TestBed::started().await;
    let c = bed.harvester.client.clone();
    let ns = bed.vm_namespace.clone();
    bed.sim.create_host("h1", None, None).await.expect("host");
    bed.sim
        .create_vm(&GuestVm::new("w1").on_host("h1"))
        .await
        .expect("vm");
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(c.clone(), &ns);
    pvcs.create(&PostParams::default(), &pvc("pvc-1", "64Mi"))
        .await
        .expect("pvc");
    wait::until("PVC bound", Duration::from_secs(20), || {
        let pvcs = pvcs.clone();
        async move {
            let p = pvcs.get("pvc-1").await.map_err(|e| e.to_string())?;
            let phase = p.status.and_then(|s| s.phase);
            Ok(if phase.as_deref() == Some("Bound") {
                Ok(())
            } else {
                Err(phase)
            })
        }
    })
    .await
    .unwrap();

    // Through kube-apiserver -> APIService -> ExternalName Service -> the stand-in.
    hotplug::add_volume(
        &c,
        &ns,
        "w1",
        &AddVolumeOptions::scsi_pvc("pvc-1", "pvc-1", "serial-pvc-1"),
    )
    .await
    .expect("addvolume");
    let vmis = Api::<VirtualMachineInstance>::namespaced(c.clone(), &ns);
    let status = wait::until("volumeStatus Ready", Duration::from_secs(20), || {
        let vmis = vmis.clone();
        async move {
            let vmi = vmis.get("w1").await.map_err(|e| e.to_string())?;
            let s = vmi.volume_status("pvc-1").cloned();
            Ok(match s {
                Some(s) if s.phase.as_deref() == Some(VOLUME_READY) => Ok(s),
                other => Err(other),
            })
        }
    })
    .await
    .unwrap();
    assert!(
        status.target.starts_with("sd"),
        "target {:?}",
        status.target
    );
    let link = bed
        .sim
        .by_id_dir("w1")
        .join("scsi-0QEMU_QEMU_HARDDISK_serial-pvc-1");
    let device = std::fs::read_link(&link).expect("by-id link");
    assert!(
        device.to_string_lossy().starts_with("/dev/loop"),
        "link points at {}",
        device.display()
    );
    let size = std::fs::read_to_string(format!(
        "/sys/class/block/{}/size",
        device.file_name().unwrap().to_string_lossy()
    ))
    .expect("sysfs size");
    assert_eq!(size.trim().parse::<u64>().unwrap() * 512, 64 << 20);

    let vm = Api::<VirtualMachine>::namespaced(c.clone(), &ns)
        .get("w1")
        .await
        .unwrap();
    let disk = vm
        .spec
        .template
        .spec
        .domain
        .devices
        .disks
        .iter()
        .find(|d| d.name == "pvc-1")
        .expect("disk in VM spec");
    assert_eq!(disk.serial.as_deref(), Some("serial-pvc-1"));

    // Adding it twice is refused like virt-api does.
    let again = hotplug::add_volume(
        &c,
        &ns,
        "w1",
        &AddVolumeOptions::scsi_pvc("pvc-1", "pvc-1", "serial-pvc-1"),
    )
    .await;
    let again = again
        .expect_err("second addvolume of the same name must fail")
        .to_string();
    assert!(
        again.contains("409")
            && again.contains(
                "Unable to add volume [pvc-1] because volume with that name already exists"
            ),
        "virt-api's conflict: {again}"
    );

    hotplug::remove_volume(
        &c,
        &ns,
        "w1",
        &RemoveVolumeOptions {
            name: "pvc-1".into(),
            rest: Default::default(),
        },
    )
    .await
    .expect("removevolume");
    // virt-controller applies the request later: the disk leaves the guest, then the VMI status.
    wait::until(
        "the disk to leave the guest and the VMI",
        Duration::from_secs(20),
        || {
            let (vmis, link) = (vmis.clone(), link.clone());
            async move {
                let vmi = vmis.get("w1").await.map_err(|e| e.to_string())?;
                let status = vmi.volume_status("pvc-1").cloned();
                let linked = std::fs::symlink_metadata(&link).is_ok();
                Ok(if status.is_none() && !linked {
                    Ok(())
                } else {
                    Err((status, linked))
                })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Deleting the PVC frees the loop device.
    pvcs.delete("pvc-1", &DeleteParams::default())
        .await
        .expect("delete pvc");
    let dev = device.clone();
    wait::until("loop device detached", Duration::from_secs(20), || {
        let dev = dev.clone();
        async move {
            let out = std::process::Command::new("losetup")
                .arg("-a")
                .output()
                .map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let prefix = format!("{}:", dev.display());
            Ok(if text.lines().any(|l| l.starts_with(&prefix)) {
                Err(text)
            } else {
                Ok(())
            })
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn addvolume_is_authorized_by_the_real_api_server() {
    let bed = TestBed::started().await;
    bed.sim.create_host("h1", None, None).await.expect("host");
    bed.sim
        .create_vm(&GuestVm::new("w1").on_host("h1"))
        .await
        .expect("vm");
    let cert = bed
        .pki
        .client_cert(bed.dir.path(), "nobody", &[])
        .expect("client cert");
    let text = testbed::bed::cluster::kubeconfig_text(
        &bed.harvester.url,
        &bed.pki,
        &cert,
        "nobody",
        &bed.vm_namespace,
    );
    let nobody = testbed::bed::cluster::client_from_kubeconfig(&text)
        .await
        .expect("client");
    let err = hotplug::add_volume(
        &nobody,
        &bed.vm_namespace,
        "w1",
        &AddVolumeOptions::scsi_pvc("v", "v", "s"),
    )
    .await
    .expect_err("a user without RBAC must be refused");
    match err {
        hotplug::HotplugError::Request {
            source: kube::Error::Api(s),
            ..
        } => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("expected 403 Forbidden, got {other}"),
    }
}

fn pool(name: &str, range: serde_json::Value, scope: serde_json::Value) -> IPPool {
    obj(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "IPPool",
        "metadata": {"name": name},
        "spec": {"ranges": [range], "selector": {"scope": scope}}
    }))
}

fn global_scope() -> serde_json::Value {
    json!([{"project": "*", "namespace": "*", "guestCluster": "*"}])
}

fn lb(name: &str, ipam: &str) -> LoadBalancer {
    obj(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": name, "annotations": {"loadbalancer.harvesterhci.io/cluster": "rke2"}},
        "spec": {"workloadType": "cluster", "ipam": ipam}
    }))
}

async fn wait_lb<F>(api: &Api<LoadBalancer>, name: &str, what: &str, pred: F) -> LoadBalancer
where
    F: Fn(&LoadBalancer) -> bool,
{
    wait_lb_within(api, name, what, Duration::from_secs(20), pred).await
}

async fn wait_lb_within<F>(
    api: &Api<LoadBalancer>,
    name: &str,
    what: &str,
    limit: Duration,
    pred: F,
) -> LoadBalancer
where
    F: Fn(&LoadBalancer) -> bool,
{
    wait::until(what, limit, || {
        let api = api.clone();
        let got = async move { api.get(name).await.map_err(|e| e.to_string()) };
        async {
            let lb = got.await?;
            Ok(if pred(&lb) { Ok(lb) } else { Err(lb.status) })
        }
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn lb_gets_an_address_from_an_ippool_and_releases_it_on_delete() {
    let bed = TestBed::started().await;
    let c = bed.harvester.client.clone();
    let pools = Api::<IPPool>::all(c.clone());
    pools
        .create(&PostParams::default(), &pool("p1", json!({"subnet": "192.168.100.0/24", "rangeStart": "192.168.100.10", "rangeEnd": "192.168.100.20"}), global_scope()))
        .await
        .expect("pool");
    let lbs = Api::<LoadBalancer>::namespaced(c.clone(), &bed.vm_namespace);
    lbs.create(&PostParams::default(), &lb("lb-1", "pool"))
        .await
        .expect("lb");
    let got = wait_lb(&lbs, "lb-1", "an allocated address", |lb| {
        lb.allocated_ip().is_some()
    })
    .await;
    let addr = got
        .status
        .as_ref()
        .and_then(|s| s.allocated_address.clone())
        .unwrap();
    assert_eq!(addr.ip, "192.168.100.10");
    assert_eq!(addr.ip_pool.as_deref(), Some("p1"));
    assert_eq!(
        got.ready_condition().map(|c| c.status.as_str()),
        Some("True")
    );
    let p = pools.get("p1").await.unwrap().status.unwrap();
    assert_eq!(
        p.allocated.get("192.168.100.10").map(String::as_str),
        Some(&*format!("{}/lb-1", bed.vm_namespace))
    );
    assert_eq!((p.total, p.available), (11, 10));

    lbs.delete("lb-1", &DeleteParams::default())
        .await
        .expect("delete");
    wait::until(
        "LB gone (finalizer removed)",
        Duration::from_secs(20),
        || {
            let lbs = lbs.clone();
            async move {
                Ok(
                    match lbs.get_opt("lb-1").await.map_err(|e| e.to_string())? {
                        None => Ok(()),
                        Some(lb) => Err(lb.metadata.finalizers),
                    },
                )
            }
        },
    )
    .await
    .unwrap();
    let p = pools.get("p1").await.unwrap().status.unwrap();
    assert!(p.allocated.is_empty(), "released: {p:?}");
    assert_eq!(
        p.allocated_history
            .get("192.168.100.10")
            .map(String::as_str),
        Some(&*format!("{}/lb-1", bed.vm_namespace))
    );
}

#[tokio::test]
async fn pool_exhaustion_and_missing_pools_are_conditions_that_converge() {
    let bed = TestBed::started().await;
    let c = bed.harvester.client.clone();
    let lbs = Api::<LoadBalancer>::namespaced(c.clone(), &bed.vm_namespace);
    lbs.create(&PostParams::default(), &lb("lb-a", "pool"))
        .await
        .expect("lb-a");
    let waiting = wait_lb(&lbs, "lb-a", "Ready=False without pools", |lb| {
        lb.ready_condition().is_some_and(|c| c.status == "False")
    })
    .await;
    let msg = waiting
        .ready_condition()
        .and_then(|c| c.message.clone())
        .unwrap_or_default();
    assert!(msg.contains("no matched IPPool"), "message: {msg}");

    // A one-address pool appears: lb-a converges by itself (woken by the IPPool watch).
    let pools = Api::<IPPool>::all(c.clone());
    pools
        .create(
            &PostParams::default(),
            &pool("tiny", json!({"subnet": "10.9.0.7/32"}), global_scope()),
        )
        .await
        .expect("pool");
    let a = wait_lb(&lbs, "lb-a", "lb-a allocated", |lb| {
        lb.allocated_ip().is_some()
    })
    .await;
    assert_eq!(a.allocated_ip(), Some("10.9.0.7"));

    lbs.create(&PostParams::default(), &lb("lb-b", "pool"))
        .await
        .expect("lb-b");
    let b = wait_lb(&lbs, "lb-b", "lb-b exhausted", |lb| {
        lb.ready_condition().is_some_and(|c| {
            c.message
                .as_deref()
                .unwrap_or("")
                .contains("no IP addresses available")
        })
    })
    .await;
    assert_eq!(b.allocated_ip(), None);
    assert_eq!(
        b.ready_condition().map(|c| c.status.as_str()),
        Some("False")
    );
    // load-balancer-harvester v1.8.2 controller.go `requestIP` wraps the allocator's error.
    let msg = b.ready_condition().and_then(|c| c.message.clone());
    assert!(
        msg.as_deref().unwrap_or("").starts_with(
            "fail to get ip from pool tiny, error: no IP addresses available in range set"
        ),
        "{msg:?}"
    );

    // An explicit pool that does not exist has no allocator (same function).
    let mut named = lb("lb-c", "pool");
    named.spec.ip_pool = Some("nope".into());
    lbs.create(&PostParams::default(), &named)
        .await
        .expect("lb-c");
    let c = wait_lb(&lbs, "lb-c", "lb-c refused", |lb| {
        lb.ready_condition().is_some_and(|c| c.status == "False")
    })
    .await;
    assert_eq!(
        c.ready_condition().and_then(|c| c.message.as_deref()),
        Some("fail to get allocator nope")
    );
}

#[tokio::test]
async fn dhcp_lb_records_the_sentinel_address() {
    let bed = TestBed::started().await;
    let lbs = Api::<LoadBalancer>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    lbs.create(&PostParams::default(), &lb("lb-d", "dhcp"))
        .await
        .expect("lb");
    let got = wait_lb(&lbs, "lb-d", "0.0.0.0 recorded", |lb| {
        lb.allocated_ip() == Some("0.0.0.0")
    })
    .await;
    assert_eq!(
        got.ready_condition().map(|c| c.status.as_str()),
        Some("True")
    );
}

#[test]
fn a_missing_tool_is_named_with_the_script_that_builds_it() {
    let dir = tempfile::tempdir().unwrap();
    let err = testbed::util::tools::tool_in(dir.path(), "kube-apiserver")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("kube-apiserver") && err.contains("tools.sh"),
        "{err}"
    );
}

/// `restart_harvester`: a new process on the same address, the objects kept (etcd), the
/// aggregated virt-api reachable again, and the stand-in's LB controller back at work.
#[tokio::test]
async fn harvester_api_server_restarts_on_the_same_address_and_the_stand_in_recovers() {
    let mut bed = TestBed::started().await;
    let c = bed.harvester.client.clone();
    bed.sim
        .create_host("harvester-1", None, None)
        .await
        .expect("host");
    bed.sim
        .create_vm(&GuestVm::new("worker-1").ip("10.0.0.11"))
        .await
        .expect("vm");
    let (url, pid) = (bed.harvester.url.clone(), bed.harvester.proc.pid());

    bed.restart_harvester()
        .await
        .unwrap_or_else(|e| panic!("restart: {e}"));
    assert_eq!(bed.harvester.url, url, "same address");
    assert_ne!(bed.harvester.proc.pid(), pid, "a new process");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the old process is gone"
    );
    Api::<VirtualMachineInstance>::namespaced(c.clone(), &bed.vm_namespace)
        .get("worker-1")
        .await
        .expect("the VMI survives the restart");
    let req = http::Request::get("/apis/subresources.kubevirt.io/v1")
        .body(Vec::new())
        .unwrap();
    let resources = c
        .request_text(req)
        .await
        .expect("virt-api reachable through the restarted aggregator");
    assert!(
        resources.contains("virtualmachines/addvolume"),
        "the stand-in answers: {resources}"
    );

    // The stand-in's watches came back: a new LoadBalancer gets an address.
    Api::<IPPool>::all(c.clone())
        .create(
            &PostParams::default(),
            &pool("p1", json!({"subnet": "192.168.101.0/24"}), global_scope()),
        )
        .await
        .expect("pool");
    let lbs = Api::<LoadBalancer>::namespaced(c, &bed.vm_namespace);
    lbs.create(&PostParams::default(), &lb("lb-1", "pool"))
        .await
        .expect("lb");
    // The stand-in's watchers retried through the restart with kube's default back-off (as
    // client-go's reflector: 800 ms doubling to at most 30 s), so the next attempt of each may
    // come up to 30 s after the server is back.
    wait_lb_within(
        &lbs,
        "lb-1",
        "an address after the restart",
        Duration::from_secs(75),
        |lb| lb.allocated_ip().is_some(),
    )
    .await;
}

/// The LB CRDs are harvester/charts' (harvester-load-balancer-1.8.2): LoadBalancer serves
/// v1alpha1 and v1beta1, a listener needs `backendPort` and `port` and defaults `protocol` to
/// TCP, an IPPool status needs `total`, `available` and `lastAllocated` — and what the stand-in
/// writes into an IPPool status (`IPPoolStatus`) has them.
#[tokio::test]
async fn lb_crds_are_upstreams_and_ippool_status_writes_carry_the_required_fields() {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let bed = TestBed::started().await;
    let c = bed.harvester.client.clone();
    let ar = |version: &str| {
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("loadbalancer.harvesterhci.io", version, "LoadBalancer"),
            "loadbalancers",
        )
    };
    let beta: Api<DynamicObject> =
        Api::namespaced_with(c.clone(), &bed.vm_namespace, &ar("v1beta1"));
    let vm_lb = |name: &str, listener: serde_json::Value| -> DynamicObject {
        obj(json!({
            "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
            "metadata": {"name": name},
            "spec": {"workloadType": "vm", "ipam": "dhcp", "listeners": [listener]}
        }))
    };
    let err = beta
        .create(
            &PostParams::default(),
            &vm_lb(
                "no-backend",
                json!({"name": "a", "port": 80, "protocol": "TCP"}),
            ),
        )
        .await
        .expect_err("a listener without backendPort is invalid");
    assert!(
        err.to_string().contains("backendPort: Required value"),
        "{err}"
    );
    let made = beta
        .create(
            &PostParams::default(),
            &vm_lb(
                "tcp-default",
                json!({"name": "a", "port": 80, "backendPort": 8080}),
            ),
        )
        .await
        .expect("a listener without protocol is admitted");
    assert_eq!(
        made.data["spec"]["listeners"][0]["protocol"], "TCP",
        "default TCP"
    );
    let alpha: Api<DynamicObject> =
        Api::namespaced_with(c.clone(), &bed.vm_namespace, &ar("v1alpha1"));
    assert!(alpha.get("tcp-default").await.is_ok(), "v1alpha1 is served");

    let pools: Api<IPPool> = Api::all(c.clone());
    let made = pools
        .create(
            &PostParams::default(),
            &pool(
                "p-required",
                json!({"subnet": "10.72.0.0/30"}),
                global_scope(),
            ),
        )
        .await
        .expect("pool");
    let mut without: serde_json::Value = serde_json::to_value(&made).unwrap();
    without["status"] = json!({"total": 2, "available": 2});
    let raw: Api<DynamicObject> = Api::all_with(
        c.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("loadbalancer.harvesterhci.io", "v1beta1", "IPPool"),
            "ippools",
        ),
    );
    let err = raw
        .replace("p-required", &PostParams::default(), &obj(without))
        .await
        .expect_err("a status without lastAllocated is invalid");
    assert!(
        err.to_string().contains("lastAllocated: Required value"),
        "{err}"
    );
    let mut with = made.clone();
    with.status = Some(Default::default());
    let stored = pools
        .replace("p-required", &PostParams::default(), &with)
        .await
        .expect("IPPoolStatus::default() carries every required field");
    assert_eq!(stored.status.unwrap().last_allocated, None);
}
