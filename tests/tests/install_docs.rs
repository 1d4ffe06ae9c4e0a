//! docs/install.md, run as written (issue 24): the blocks marked ```` ```sh install-test:<step> ````
//! are taken from the document (not copied here) and run with bash on the bed's real guest
//! cluster, started without the charts (`BedOptions::real_node_charts: false`), with the bed's
//! `kubectl` and `helm` first on `PATH` and the document's variables (`KUBECONFIG`, `REGISTRY`,
//! `VERSION`, ...) set to the bed's. Two routes on one cluster boot:
//!
//! 1. a new install: `secret`, `install-ccm`, `install-csi`, `check`, `upgrade`, `check-cleanup`,
//!    `uninstall`, `harvester-check`;
//!    The upgrade's `VERSION` is another tag of the same builds, so every Pod of both charts is
//!    replaced while the `hello` Pod keeps running on its volume and the Service its address;
//! 2. an upstream user: `secret`, the fixture charts standing in for upstream's
//!    (`tests/fixtures/upstream-*`, with the bed's images, as the Rancher route runs them)
//!    installed with helm by the test, `switch`, `check`, `check-cleanup`, `uninstall`,
//!    `harvester-check`.
//!
//! After each uninstall the test reads both clusters itself: nothing of either chart, no Service
//! finalizer, VolumeAttachment, PV or PVC on the guest; no LoadBalancer CR, hot-plugged volume or
//! driver PVC on Harvester, no disk on the stand-in. A block that fails fails the test with its
//! step name, its text and its output. Needs root and `make node-tools` (with kubectl).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use harvester_common::harvester::{LoadBalancer, VirtualMachine};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Service};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use testbed::bed::guest_cluster::{
    self, CCM_RELEASE, CSI_RELEASE, GuestCluster, HOST_BY_ID, NAMESPACE, WORKLOAD,
};
use testbed::real::images;
use testbed::{BedOptions, TestBed, util::wait};

const DOC: &str = "docs/install.md";
/// The info string of a runnable block: ```` ```sh install-test:<step> ````.
const MARK: &str = "```sh install-test:";
/// The cluster name the document's `CLUSTER_NAME` gets here.
const CLUSTER_NAME: &str = "docs-test";
/// The longest a block may run (its own waits are shorter).
const BLOCK_LIMIT: &str = "20m";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The runnable blocks of `doc` by step name. A step named twice, or a block not closed, is an
/// error naming it.
fn runnable_blocks(doc: &str) -> Result<BTreeMap<String, String>, String> {
    let mut blocks = BTreeMap::new();
    let mut lines = doc.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        let Some(step) = line.strip_prefix(MARK) else {
            continue;
        };
        let step = step.trim().to_string();
        let mut body = String::new();
        let mut closed = false;
        for (_, l) in lines.by_ref() {
            if l.trim_end() == "```" {
                closed = true;
                break;
            }
            body.push_str(l);
            body.push('\n');
        }
        if !closed {
            return Err(format!("block {step} (line {}) is not closed", n + 1));
        }
        if blocks.insert(step.clone(), body).is_some() {
            return Err(format!("step {step} is marked twice"));
        }
    }
    Ok(blocks)
}

/// `image: <name>` lines of rendered manifests or of a block (quotes removed).
fn image_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("image:"))
        .map(|i| i.trim().trim_matches('"').trim_matches('\'').to_string())
        .filter(|i| !i.is_empty())
        .collect()
}

/// `script` run by bash under `timeout limit` from the repository's root with `env`, on a
/// blocking thread; an error if bash could not be run or its thread failed.
async fn bash(
    limit: &'static str,
    script: String,
    env: Vec<(String, String)>,
) -> Result<std::process::Output, String> {
    tokio::task::spawn_blocking(move || {
        Command::new("timeout")
            .args([limit, "bash", "-c", &script])
            .current_dir(repo_root())
            .envs(env)
            .output()
    })
    .await
    .map_err(|e| format!("its thread: {e}"))?
    .map_err(|e| e.to_string())
}

/// The document's blocks and the environment they run in.
struct Doc {
    blocks: BTreeMap<String, String>,
    env: Vec<(String, String)>,
}

impl Doc {
    /// Runs step `step` with bash (`set -e -o pipefail`, stderr into stdout) from the
    /// repository's root; its output, or a panic naming the step with its text and output.
    async fn run(&self, step: &str) -> String {
        self.run_with(step, &[]).await
    }

    /// What a failed step leaves to read, with the document's kubectl and KUBECONFIG: every
    /// Pod, claim and VolumeAttachment, and the last Events (a Pod that never got Ready says why).
    async fn cluster_state(&self) -> String {
        const STATE: &str = "kubectl get pods,pvc -A -o wide; kubectl get volumeattachments; \
            kubectl get events -A --sort-by=.lastTimestamp | tail -n 40";
        match bash("60", format!("exec 2>&1\n{STATE}"), self.env.clone()).await {
            Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
            Err(e) => format!("(running kubectl: {e})"),
        }
    }

    /// [`Doc::run`] with some of the document's variables set otherwise.
    async fn run_with(&self, step: &str, vars: &[(&str, &str)]) -> String {
        let block = self
            .blocks
            .get(step)
            .unwrap_or_else(|| panic!("{DOC} has no block marked {MARK}{step}"))
            .clone();
        let mut env = self.env.clone();
        env.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let script = format!("exec 2>&1\nset -e -o pipefail\n{block}");
        let t0 = std::time::Instant::now();
        let out = bash(BLOCK_LIMIT, script, env)
            .await
            .unwrap_or_else(|e| panic!("running bash for step {step}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            let state = self.cluster_state().await;
            panic!(
                "{DOC} step `{step}` failed ({}):\n--- block ---\n{block}--- output ---\n{text}\
                 --- the guest cluster now ---\n{state}",
                out.status
            );
        }
        eprintln!(
            "[install_docs] step {step}: ok in {:.1}s",
            t0.elapsed().as_secs_f64()
        );
        text
    }
}

/// A directory holding only `kubectl` and `helm` of the bed, first on the blocks' `PATH` (the
/// machine may have other kubectls).
fn bed_tools(dir: &Path) -> PathBuf {
    let bin = dir.join("docs-bin");
    std::fs::create_dir_all(&bin).expect("docs-bin");
    let kubectl = testbed::real::node::node_tool("kubectl")
        .unwrap_or_else(|e| panic!("kubectl of the bed (tests/scripts/node-tools.sh): {e}"));
    let helm =
        testbed::util::tools::tool("helm").unwrap_or_else(|e| panic!("helm of the bed: {e}"));
    for (name, target) in [("kubectl", kubectl), ("helm", helm)] {
        std::os::unix::fs::symlink(target, bin.join(name)).expect("link a tool");
    }
    bin
}

/// `registry/name:tag` split into (`registry`, `tag`) for the image named `name`.
fn registry_and_tag(image: &str, name: &str) -> (String, String) {
    let (repo, tag) = image
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("image {image} has no tag"));
    let registry = repo
        .strip_suffix(&format!("/{name}"))
        .unwrap_or_else(|| panic!("image {image} is not <registry>/{name}:<tag>"));
    (registry.to_string(), tag.to_string())
}

async fn helm(real: &GuestCluster, args: Vec<String>) -> String {
    let h = real.helm();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        h.run(&args)
    })
    .await
    .expect("helm's thread")
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Tags the bed's builds of the CSI sidecars and the workload under the names the charts render
/// by default (upstream's `rancher/mirrored-*`) and the name the `check` block runs, so that the
/// kubelet finds them as images already on the node.
async fn tag_default_images(bed: &TestBed, doc: &Doc) {
    let real = bed.real();
    let mut names = image_lines(&doc.blocks["check"]);
    for chart in [
        format!("deploy/charts/{CSI_RELEASE}"),
        format!("tests/fixtures/upstream-{CSI_RELEASE}"),
    ] {
        let chart = repo_root().join(chart).to_string_lossy().into_owned();
        let rendered = helm(
            real,
            vec![
                "template".into(),
                CSI_RELEASE.into(),
                chart,
                "--set".into(),
                "image.harvester.csiDriver.repository=localhost/harvester-rs/csi".into(),
                "--set".into(),
                "image.harvester.csiDriver.tag=testbed".into(),
            ],
        )
        .await;
        names.extend(image_lines(&rendered));
    }
    let i = &real.images;
    let ours = [
        ("csi-node-driver-registrar", &i.registrar),
        ("livenessprobe", &i.livenessprobe),
        ("csi-provisioner", &i.provisioner),
        ("csi-attacher", &i.attacher),
        ("csi-resizer", &i.resizer),
        ("csi-snapshotter", &i.snapshotter),
    ];
    names.sort();
    names.dedup();
    for name in names {
        let from = if name.starts_with("busybox") {
            WORKLOAD.to_string()
        } else if let Some((_, img)) = ours.iter().find(|(key, _)| name.contains(key)) {
            img.name.clone()
        } else {
            continue;
        };
        images::tag(
            &real.node.dirs.containerd_socket,
            &from,
            &images::qualified(&name),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_docs_run_as_written_on_a_real_guest_cluster_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root (containerd, kubelet, loop devices, mounts); run it as root"
    );
    let text = std::fs::read_to_string(repo_root().join(DOC)).expect(DOC);
    let blocks = runnable_blocks(&text).unwrap_or_else(|e| panic!("{DOC}: {e}"));
    let t0 = std::time::Instant::now();
    let bed = TestBed::start(BedOptions {
        real_node: true,
        real_node_charts: false,
        ..BedOptions::hotplugging()
    })
    .await
    .unwrap_or_else(|e| panic!("the real guest cluster must start for this test: {e}"));
    eprintln!(
        "[install_docs] real guest cluster up (no charts) in {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    let real = bed.real();
    let dir = bed.dir.path().to_path_buf();

    let cloud_config = dir.join("docs-cloud-config");
    let config = guest_cluster::cloud_config(&bed.pki, &bed.harvester, &bed.vm_namespace)
        .expect("the cloud-config");
    std::fs::write(&cloud_config, config).expect("write the cloud-config");
    let (registry, version) =
        registry_and_tag(&real.images.cloud_provider.name, "harvester-cloud-provider");
    assert_eq!(
        real.images.csi_driver.name,
        format!("{registry}/harvester-csi-driver:{version}"),
        "both images of the bed in one registry with one tag, as the document pushes them"
    );
    let path = format!(
        "{}:{}",
        bed_tools(&dir).display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let kubelet_root = real.node.dirs.kubelet_root.display().to_string();
    let env: Vec<(String, String)> = [
        ("PATH", path),
        ("KUBECONFIG", real.kubeconfig.display().to_string()),
        (
            "HARVESTER_KUBECONFIG",
            bed.harvester.kubeconfig.display().to_string(),
        ),
        ("NAMESPACE", bed.vm_namespace.clone()),
        ("CLUSTER_NAME", CLUSTER_NAME.into()),
        ("SERVICE_ACCOUNT", CLUSTER_NAME.into()),
        ("CLOUD_CONFIG", cloud_config.display().to_string()),
        ("REGISTRY", registry.clone()),
        ("VERSION", version.clone()),
        ("KUBELET_ROOT_DIR", kubelet_root.clone()),
        (
            "HELM_CACHE_HOME",
            dir.join("helm/cache").display().to_string(),
        ),
        (
            "HELM_CONFIG_HOME",
            dir.join("helm/config").display().to_string(),
        ),
        (
            "HELM_DATA_HOME",
            dir.join("helm/data").display().to_string(),
        ),
        ("HOME", dir.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let doc = Doc { blocks, env };
    tag_default_images(&bed, &doc).await;
    // The IP pool of the prerequisites, on Harvester.
    bed.sim
        .create_pool("docs-pool", "192.168.177.0/29")
        .await
        .expect("create the IPPool");

    // 1. A new install from the repository, an upgrade, the uninstall.
    for step in ["secret", "install-ccm", "install-csi"] {
        doc.run(step).await;
    }
    let out = doc.run("check").await;
    assert!(
        out.contains("hello"),
        "check: the Pod read its file:\n{out}"
    );
    // A new version: the same builds under another tag, so every Pod of both charts is replaced
    // while the hello Pod keeps its volume and the Service its address.
    let next = format!("{version}-next");
    for program in ["harvester-cloud-provider", "harvester-csi-driver"] {
        images::tag(
            &real.node.dirs.containerd_socket,
            &format!("{registry}/{program}:{version}"),
            &format!("{registry}/{program}:{next}"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let before = hello_still_serves(&bed).await;
    doc.run_with("upgrade", &[("VERSION", &next)]).await;
    assert_eq!(
        hello_still_serves(&bed).await,
        before,
        "the upgrade replaced the hello Pod or changed the Service's address"
    );
    for (kind, name) in [
        ("deployment", CCM_RELEASE.to_string()),
        ("deployment", format!("{CSI_RELEASE}-controllers")),
        ("daemonset", CSI_RELEASE.to_string()),
    ] {
        let images = workload_images(&bed, kind, &name).await;
        assert!(
            images.iter().any(|i| i.ends_with(&format!(":{next}"))),
            "{kind} {name} does not run the upgraded tag {next}: {images:?}"
        );
    }
    for step in ["check-cleanup", "uninstall"] {
        doc.run(step).await;
    }
    let out = doc.run("harvester-check").await;
    nothing_left(&bed, &out).await;
    eprintln!(
        "[install_docs] new install, upgrade, uninstall: done at {:.1}s",
        t0.elapsed().as_secs_f64()
    );

    // 2. An upstream user's releases (the fixture charts, the bed's images), switched in place,
    // then used. The CSI fixture carries upstream's names, selectors, args and cloud-config
    // volume but not its whole Pod spec (no sidecars, no socket): its Pods do not serve, so the
    // volume is made after the switch.
    doc.run("secret").await;
    install_upstream_fixtures(real, &bed.guest.client, &registry, &version, &kubelet_root).await;
    doc.run("switch").await;
    let out = doc.run("check").await;
    assert!(
        out.contains("hello"),
        "check: the Pod read its file:\n{out}"
    );
    // A volume upstream's driver made carries no cluster label: take it off the check's volume,
    // and the documented hand-over labels it again (check-cleanup's delete needs it).
    let handles = unlabel_host_pvcs(&bed).await;
    doc.run("label-volumes").await;
    for pvc in &handles {
        assert_eq!(
            host_pvc_owner(&bed, pvc).await.as_deref(),
            Some(CLUSTER_NAME),
            "label-volumes labelled host PVC {pvc}"
        );
    }
    for step in ["check-cleanup", "uninstall"] {
        doc.run(step).await;
    }
    let out = doc.run("harvester-check").await;
    nothing_left(&bed, &out).await;
    eprintln!(
        "[install_docs] upstream releases switched and uninstalled: done at {:.1}s",
        t0.elapsed().as_secs_f64()
    );
}

/// Removes the guest-cluster label from the host PVC of every PV of the driver (as upstream's
/// driver leaves them); their names.
async fn unlabel_host_pvcs(bed: &TestBed) -> Vec<String> {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    let pvs = Api::<PersistentVolume>::all(bed.guest.client.clone())
        .list(&Default::default())
        .await
        .expect("guest PVs");
    let handles: Vec<String> = pvs
        .items
        .iter()
        .filter_map(|pv| pv.spec.as_ref()?.csi.as_ref())
        .filter(|csi| csi.driver == harvester_csi_driver::DRIVER_NAME)
        .map(|csi| csi.volume_handle.clone())
        .collect();
    assert!(
        !handles.is_empty(),
        "the check step left a volume of the driver"
    );
    let pvcs =
        Api::<PersistentVolumeClaim>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let patch = serde_json::json!({"metadata": {"labels": {
        harvester_csi_driver::controller::owner::LABEL_GUEST_CLUSTER: null
    }}});
    for pvc in &handles {
        pvcs.patch(
            pvc,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap_or_else(|e| panic!("unlabelling host PVC {pvc}: {e}"));
        assert_eq!(host_pvc_owner(bed, pvc).await, None);
    }
    handles
}

async fn host_pvc_owner(bed: &TestBed, pvc: &str) -> Option<String> {
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    Api::<PersistentVolumeClaim>::namespaced(bed.harvester.client.clone(), &bed.vm_namespace)
        .get(pvc)
        .await
        .unwrap_or_else(|e| panic!("host PVC {pvc}: {e}"))
        .metadata
        .labels
        .and_then(|l| {
            l.get(harvester_csi_driver::controller::owner::LABEL_GUEST_CLUSTER)
                .cloned()
        })
}

/// `helm install` of the upstream fixture charts as an upstream user has them, with the bed's
/// images for the two programs (the Go images are not here), then waits for the cloud provider.
async fn install_upstream_fixtures(
    real: &GuestCluster,
    client: &kube::Client,
    registry: &str,
    version: &str,
    kubelet_root: &str,
) {
    let fixture = |name: &str| {
        repo_root()
            .join(format!("tests/fixtures/upstream-{name}"))
            .to_string_lossy()
            .into_owned()
    };
    let install = |release: &str, sets: Vec<String>| {
        let mut args: Vec<String> = vec![
            "install".into(),
            release.into(),
            fixture(release),
            "--namespace".into(),
            NAMESPACE.into(),
        ];
        for s in sets {
            args.extend(["--set".to_string(), s]);
        }
        args
    };
    helm(
        real,
        install(
            CCM_RELEASE,
            vec![
                "cloudConfig.secretName=harvester-cloud-config".into(),
                format!("global.cattle.clusterName={CLUSTER_NAME}"),
                format!("image.repository={registry}/harvester-cloud-provider"),
                format!("image.tag={version}"),
            ],
        ),
    )
    .await;
    helm(
        real,
        install(
            CSI_RELEASE,
            vec![
                "cloudConfig.secretName=harvester-cloud-config".into(),
                format!("kubeletRootDir={kubelet_root}"),
                format!("image.harvester.csiDriver.repository={registry}/harvester-csi-driver"),
                format!("image.harvester.csiDriver.tag={version}"),
            ],
        ),
    )
    .await;
    let limit = Duration::from_secs(300);
    guest_cluster::wait_deployment(client, NAMESPACE, CCM_RELEASE, limit)
        .await
        .unwrap_or_else(|e| panic!("the upstream fixture's cloud provider: {e}"));
}

/// The container images of Deployment or DaemonSet `name` in the release namespace.
async fn workload_images(bed: &TestBed, kind: &str, name: &str) -> Vec<String> {
    use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
    let c = bed.guest.client.clone();
    let template = match kind {
        "deployment" => Api::<Deployment>::namespaced(c, NAMESPACE)
            .get(name)
            .await
            .map(|d| d.spec.map(|s| s.template)),
        _ => Api::<DaemonSet>::namespaced(c, NAMESPACE)
            .get(name)
            .await
            .map(|d| d.spec.map(|s| s.template)),
    }
    .unwrap_or_else(|e| panic!("{kind} {name}: {e}"));
    template
        .and_then(|t| t.spec)
        .map(|s| s.containers.into_iter().filter_map(|c| c.image).collect())
        .unwrap_or_default()
}

/// The `check` block's Pod is Ready and its Service has an address: (Pod uid, address).
async fn hello_still_serves(bed: &TestBed) -> (String, String) {
    let pod = Api::<Pod>::namespaced(bed.guest.client.clone(), "default")
        .get("hello")
        .await
        .expect("Pod hello");
    assert!(
        guest_cluster::pod_ready(&pod),
        "Pod hello is not Ready: {}",
        guest_cluster::pod_state(&pod)
    );
    let svc = Api::<Service>::namespaced(bed.guest.client.clone(), "default")
        .get("hello")
        .await
        .expect("Service hello");
    let ip = svc
        .status
        .and_then(|s| s.load_balancer)
        .and_then(|l| l.ingress)
        .and_then(|i| i.first().and_then(|i| i.ip.clone()))
        .unwrap_or_else(|| panic!("Service hello has no address"));
    (pod.uid().unwrap_or_default(), ip)
}

/// Nothing of the charts or of the `check` block is left on either cluster; `harvester_check`
/// is the output of the document's own Harvester check.
async fn nothing_left(bed: &TestBed, harvester_check: &str) {
    // Its LoadBalancer and PVC lists are both empty; its VM list shows no hot-plugged volume.
    assert_eq!(
        harvester_check.matches("No resources found").count(),
        2,
        "harvester-check lists LoadBalancers or PVCs of the cluster:\n{harvester_check}"
    );
    assert!(
        !harvester_check.contains("pvc-"),
        "harvester-check shows a hot-plugged volume:\n{harvester_check}"
    );
    let releases = helm(
        bed.real(),
        vec!["list".into(), "-n".into(), NAMESPACE.into(), "-q".into()],
    )
    .await;
    assert!(releases.trim().is_empty(), "releases left: {releases}");
    let guest = bed.guest.client.clone();
    let harvester = bed.harvester.client.clone();
    let ns = bed.vm_namespace.clone();
    let names = |items: Vec<String>| items.join(",");
    wait::until(
        "nothing left on either cluster",
        Duration::from_secs(60),
        || {
            let (guest, harvester, ns) = (guest.clone(), harvester.clone(), ns.clone());
            async move {
                let e = |e: kube::Error| e.to_string();
                let lp = ListParams::default();
                let mut left: BTreeMap<&str, String> = BTreeMap::new();
                let finalized: Vec<String> = Api::<Service>::all(guest.clone())
                    .list(&lp)
                    .await
                    .map_err(e)?
                    .items
                    .into_iter()
                    .filter(|s| !s.finalizers().is_empty())
                    .map(|s| s.name_any())
                    .collect();
                left.insert("guest Services with finalizers", names(finalized));
                let va = Api::<VolumeAttachment>::all(guest.clone())
                    .list(&lp)
                    .await
                    .map_err(e)?;
                left.insert(
                    "VolumeAttachments",
                    names(va.iter().map(|v| v.name_any()).collect()),
                );
                let pvs = Api::<PersistentVolume>::all(guest.clone())
                    .list(&lp)
                    .await
                    .map_err(e)?;
                left.insert("PVs", names(pvs.iter().map(|v| v.name_any()).collect()));
                let pvcs = Api::<PersistentVolumeClaim>::all(guest.clone())
                    .list(&lp)
                    .await
                    .map_err(e)?;
                left.insert(
                    "guest PVCs",
                    names(pvcs.iter().map(|v| v.name_any()).collect()),
                );
                let lbs = Api::<LoadBalancer>::namespaced(harvester.clone(), &ns)
                    .list(&lp)
                    .await
                    .map_err(e)?;
                left.insert(
                    "LoadBalancer CRs",
                    names(lbs.iter().map(|v| v.name_any()).collect()),
                );
                let hpvcs = Api::<PersistentVolumeClaim>::namespaced(harvester.clone(), &ns)
                    .list(&lp)
                    .await
                    .map_err(e)?;
                left.insert(
                    "Harvester PVCs",
                    names(hpvcs.iter().map(|v| v.name_any()).collect()),
                );
                let vms = Api::<VirtualMachine>::namespaced(harvester.clone(), &ns)
                    .list(&lp)
                    .await
                    .map_err(e)?;
                let hot: Vec<String> = vms
                    .iter()
                    .flat_map(|vm| {
                        let v = serde_json::to_value(vm).unwrap_or_default();
                        v.pointer("/spec/template/spec/volumes")
                            .and_then(|v| v.as_array())
                            .cloned()
                            .unwrap_or_default()
                            .into_iter()
                            .filter(|v| {
                                v.pointer("/persistentVolumeClaim/hotpluggable")
                                    == Some(&serde_json::Value::Bool(true))
                            })
                            .map(|v| v["name"].as_str().unwrap_or_default().to_string())
                            .collect::<Vec<_>>()
                    })
                    .collect();
                left.insert("hot-plugged volumes in VMs", names(hot));
                let links = guest_cluster::loop_links(Path::new(HOST_BY_ID));
                left.insert("by-id links", format!("{links:?}").replace("[]", ""));
                left.retain(|_, v| !v.is_empty());
                Ok(if left.is_empty() { Ok(()) } else { Err(left) })
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        bed.sim.storage.devices().is_empty(),
        "disks left on the stand-in: {:?}",
        bed.sim.storage.devices()
    );
}

#[test]
fn runnable_blocks_are_found_by_step() {
    let doc = "text\n```sh install-test:a\necho a\n```\n```sh\nnot me\n```\n```sh install-test:b\necho b\necho c\n```\n";
    let blocks = runnable_blocks(doc).unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks["a"], "echo a\n");
    assert_eq!(blocks["b"], "echo b\necho c\n");
    assert!(
        runnable_blocks("```sh install-test:a\n```\n```sh install-test:a\n```\n")
            .unwrap_err()
            .contains("marked twice")
    );
    assert!(
        runnable_blocks("```sh install-test:x\necho\n")
            .unwrap_err()
            .contains("not closed")
    );
}

/// Every step this test runs is in the document (a renamed or removed block fails here first,
/// without the bed).
#[test]
fn the_document_has_every_step() {
    let text = std::fs::read_to_string(repo_root().join(DOC)).expect(DOC);
    let blocks = runnable_blocks(&text).unwrap_or_else(|e| panic!("{DOC}: {e}"));
    for step in [
        "secret",
        "install-ccm",
        "install-csi",
        "check",
        "check-cleanup",
        "switch",
        "label-volumes",
        "upgrade",
        "uninstall",
        "harvester-check",
    ] {
        assert!(blocks.contains_key(step), "{DOC} has no block {MARK}{step}");
    }
    assert!(
        image_lines(&blocks["check"])
            .iter()
            .any(|i| i.starts_with("busybox")),
        "the check block's image is tagged from the bed's busybox"
    );
}
