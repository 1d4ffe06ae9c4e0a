//! Prototype (issue 15): a real kubelet 1.34.4 + containerd registers a Node in the bed's guest
//! cluster, tainted `uninitialized` because of `--cloud-provider=external`. Needs root and
//! `make node-tools`; built only with `--features real-node` (not part of `make test` yet):
//! `cargo test -p testbed --features real-node --test real_node`.

use k8s_openapi::api::core::v1::Node;
use testbed::node::{KUBELET_SYSCTLS, RealNode, SysctlSnapshot, TAINT_UNINITIALIZED};
use testbed::{BedOptions, TestBed};

#[tokio::test]
async fn kubelet_registers_node_tainted_uninitialized_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root (containerd, kubelet, cgroups); run it as root"
    );
    let before = SysctlSnapshot::save(std::path::Path::new("/proc/sys"), KUBELET_SYSCTLS)
        .expect("reading the sysctls");
    let bed = TestBed::start(BedOptions::default())
        .await
        .unwrap_or_else(|e| panic!("the test bed must start for this test: {e}"));
    let node = RealNode::start(
        bed.dir.path(),
        "worker-1",
        &bed.guest.kubeconfig,
        &bed.pki.ca.cert,
        &bed.guest.client,
    )
    .await
    .unwrap_or_else(|e| panic!("the real node must start: {e}"));
    let n = kube::Api::<Node>::all(bed.guest.client.clone())
        .get("worker-1")
        .await
        .expect("the Node");
    let taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
    assert!(
        taints
            .iter()
            .any(|t| t.key == TAINT_UNINITIALIZED && t.effect == "NoSchedule"),
        "Node worker-1 lacks the {TAINT_UNINITIALIZED} taint: {taints:?}"
    );
    drop(node);
    let after = SysctlSnapshot::save(std::path::Path::new("/proc/sys"), KUBELET_SYSCTLS)
        .expect("reading the sysctls");
    assert_eq!(before, after, "the kernel tunables were not restored");
    assert!(
        testbed::mounts::mounts_under(bed.dir.path()).is_empty(),
        "mounts left under the bed"
    );
    assert!(
        testbed::node::kubepods_cgroups(std::path::Path::new("/sys/fs/cgroup")).is_empty(),
        "kubepods cgroups left behind"
    );
}
