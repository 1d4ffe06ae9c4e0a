//! Switching in place from the upstream charts, as a user does it: a release of a fixture chart
//! that stands in for upstream's (tests/fixtures/upstream-*: upstream's keys, defaults, object
//! names and immutable selectors) is installed with the real helm on the test bed's guest
//! kube-apiserver, then `helm upgrade --reuse-values` moves it to deploy/charts. Also: every key
//! our charts add renders the same when absent (what --reuse-values gives the templates), the
//! values schema, and a Secret as the cloud-config source.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use kube::api::Api;
use serde_json::{Value, json};
use testbed::suites::deploy::*;

/// What RKE2 sets on every chart it bundles, through helm-controller's `--set-string`
/// (rancher/rke2 pkg/bootstrap/bootstrap.go, setChartValues, read at 71633512).
const RKE2_SET_STRING: &[&str] = &[
    "global.clusterCIDR=10.42.0.0/16",
    "global.clusterCIDRv4=10.42.0.0/16",
    "global.clusterCIDRv6=",
    "global.clusterDNS=10.43.0.10",
    "global.clusterDomain=cluster.local",
    "global.rke2DataDir=/var/lib/rancher/rke2",
    "global.serviceCIDR=10.43.0.0/16",
    "global.systemDefaultIngressClass=ingress-nginx",
    "global.prime.enabled=false",
    "global.systemDefaultRegistry=",
    "global.cattle.systemDefaultRegistry=",
];

/// The values Rancher's node driver gives the cloud provider chart (its managed HelmChartConfig
/// kube-system/harvester-cloud-provider; docs/install.md, "RKE2 made by Rancher"), plus an
/// upstream-documented flag in extraArgs (the cluster's spec.rkeConfig.chartValues).
const RANCHER_CCM_VALUES: &str = "\
cloudConfigPath: /var/lib/rancher/rke2/etc/config-files/cloud-provider-config
global:
  cattle:
    clusterId: c-m-abcd1234
    clusterName: rke2-prod
extraArgs:
  - --disable-annotation-alpha-provided-ip-addr=true
";

/// Our images, set on the upgrade as docs/install.md tells users.
const CCM_IMAGE: &[&str] = &[
    "image.repository=registry.example.com/harvester-cloud-provider",
    "image.tag=0.1.0",
];
const CSI_IMAGE: &[&str] = &[
    "image.harvester.csiDriver.repository=registry.example.com/harvester-csi-driver",
    "image.harvester.csiDriver.tag=0.1.0",
];

/// One way a user's upstream release was installed.
struct Case<'a> {
    what: &'a str,
    /// A values file (YAML text), as `-f`.
    values: Option<&'a str>,
    set_string: &'a [&'a str],
}

/// `--values <file> --set-string ...` of a case; the file is written into `dir`.
fn case_args(case: &Case, dir: &Path) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(text) = case.values {
        // helm splits --values at commas: a name of letters and dashes only.
        let name: String = case
            .what
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let file = dir.join(format!("{name}.yaml"));
        std::fs::write(&file, text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        args.extend(["--values".to_string(), file.to_string_lossy().to_string()]);
    }
    for s in case.set_string {
        args.extend(["--set-string".to_string(), s.to_string()]);
    }
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Installs the fixture chart standing in for upstream's `chart` as release `chart` in
/// kube-system with `case`'s values, then upgrades it to ours with `flag` (--reuse-values or
/// --reset-then-reuse-values) and `--set` pairs. Returns the live workloads before and after.
async fn switch(
    helm: &BedHelm,
    client: &kube::Client,
    chart: &str,
    case: &Case<'_>,
    dir: &Path,
    flag: &str,
    set: &[&str],
) -> (BTreeMap<String, Value>, BTreeMap<String, Value>) {
    let fixture = fixture_dir(chart).to_string_lossy().to_string();
    let mut install = vec![
        "install".to_string(),
        chart.into(),
        fixture,
        "--namespace".into(),
        RELEASE_NAMESPACE.into(),
    ];
    install.extend(case_args(case, dir));
    helm.ok(&strs(&install));
    let before = workloads(client).await;

    let ours = chart_dir(chart).to_string_lossy().to_string();
    let mut upgrade = vec![
        "upgrade",
        chart,
        &ours,
        "--namespace",
        RELEASE_NAMESPACE,
        flag,
    ];
    for s in set {
        upgrade.extend(["--set", s]);
    }
    if let Err(e) = helm.run(&upgrade) {
        panic!(
            "{} ({flag}): the upgrade from the upstream release fails:\n{e}",
            case.what
        );
    }
    (before, workloads(client).await)
}

fn uninstall(helm: &BedHelm, chart: &str) {
    helm.ok(&[
        "uninstall",
        chart,
        "--namespace",
        RELEASE_NAMESPACE,
        "--wait",
    ]);
}

/// The live Deployments and DaemonSets of kube-system, as JSON, by `Kind/name`.
async fn workloads(client: &kube::Client) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    for d in deployments
        .list(&Default::default())
        .await
        .expect("list Deployments")
    {
        let name = d.metadata.name.clone().expect("name");
        out.insert(
            format!("Deployment/{name}"),
            serde_json::to_value(d).expect("json"),
        );
    }
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    for d in daemonsets
        .list(&Default::default())
        .await
        .expect("list DaemonSets")
    {
        let name = d.metadata.name.clone().expect("name");
        out.insert(
            format!("DaemonSet/{name}"),
            serde_json::to_value(d).expect("json"),
        );
    }
    out
}

fn live_volume<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == name))
        .unwrap_or_else(|| panic!("no volume {name} in {}", workload["metadata"]["name"]))
}

/// Where a cloud-config volume reads from: ("secret", name) or ("hostPath", directory or file
/// without a trailing slash).
fn source(volume: &Value) -> (String, String) {
    if let Some(name) = volume["secret"]["secretName"].as_str() {
        ("secret".into(), name.into())
    } else if let Some(path) = volume["hostPath"]["path"].as_str() {
        ("hostPath".into(), path.trim_end_matches('/').into())
    } else {
        panic!("cloud-config volume without a source: {volume}")
    }
}

/// The `--cluster-name=...` args of a container (upstream renders at most one).
fn cluster_name_args(container: &Value) -> Vec<String> {
    args(container)
        .into_iter()
        .filter(|a| a.starts_with("--cluster-name="))
        .collect()
}

/// Asserts what a switch must keep: the same workloads (none lost, none added under another
/// name), each with its selector; the cloud-config source of `volumes` (workload, container,
/// volume); and the chart label of ours on each.
fn assert_kept(
    what: &str,
    before: &BTreeMap<String, Value>,
    after: &BTreeMap<String, Value>,
    chart_label: &str,
) {
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>(),
        "{what}: the upgrade keeps the workloads' names"
    );
    for (key, old) in before {
        let new = &after[key];
        assert_eq!(
            old["spec"]["selector"], new["spec"]["selector"],
            "{what}: {key} keeps its immutable selector"
        );
        assert_eq!(
            new["metadata"]["labels"]["helm.sh/chart"], chart_label,
            "{what}: {key} is now rendered by our chart"
        );
    }
}

#[tokio::test]
async fn cloud_provider_release_of_the_upstream_chart_upgrades_with_reuse_values() {
    let bed = bed().await;
    let helm = BedHelm::new(&bed);
    let dir = bed.dir.path().to_path_buf();
    let client = &bed.guest.client;
    let deployment = "Deployment/harvester-cloud-provider";
    let kube_vip = "DaemonSet/kube-vip";

    let cases = [
        Case {
            what: "upstream defaults",
            values: None,
            set_string: &[],
        },
        Case {
            what: "node driver (Rancher's values, RKE2's globals)",
            values: Some(RANCHER_CCM_VALUES),
            set_string: RKE2_SET_STRING,
        },
        Case {
            what: "cloud-config Secret with the default cloudConfigPath",
            values: Some("cloudConfig:\n  secretName: harvester-cloud-config\n"),
            set_string: &[],
        },
    ];
    for case in &cases {
        for flag in ["--reuse-values", "--reset-then-reuse-values"] {
            let what = format!("{} ({flag})", case.what);
            let (before, after) =
                switch(&helm, client, CCM_CHART, case, &dir, flag, CCM_IMAGE).await;
            assert!(
                before.contains_key(deployment) && before.contains_key(kube_vip),
                "{what}: the fixture installs upstream's workloads: {:?}",
                before.keys()
            );
            assert_kept(&what, &before, &after, "harvester-cloud-provider-0.1.0");

            let old = container(&before[deployment], "harvester-cloud-provider");
            let new = container(&after[deployment], "harvester-cloud-provider");
            assert_eq!(
                source(live_volume(&before[deployment], "cloud-config")),
                source(live_volume(&after[deployment], "cloud-config")),
                "{what}: the cloud-config comes from where it came from"
            );
            assert_eq!(
                cluster_name_args(old),
                cluster_name_args(new),
                "{what}: the same --cluster-name (it names every LoadBalancer CR)"
            );
            assert_eq!(
                new["image"],
                "registry.example.com/harvester-cloud-provider:0.1.0"
            );
            let new_args = args(new);
            let old_args = args(old);
            // Upstream's args come through in upstream's order (extraArgs last, so they win).
            let upstream_order: Vec<&String> =
                new_args.iter().filter(|a| old_args.contains(a)).collect();
            assert_eq!(
                upstream_order,
                old_args.iter().collect::<Vec<_>>(),
                "{what}: {new_args:?}"
            );
            // Keys the upstream values lack take our defaults.
            for arg in [
                "--bind-address=0.0.0.0",
                "--secure-port=10258",
                "--leader-elect-resource-namespace=kube-system",
                "--leader-elect-resource-name=cloud-controller-manager",
            ] {
                assert!(
                    new_args.iter().any(|a| a == arg),
                    "{what}: {arg} in {new_args:?}"
                );
            }
            assert_eq!(
                new["securityContext"]["capabilities"]["drop"],
                json!(["ALL"]),
                "{what}"
            );
            let vip = container(&after[kube_vip], "kube-vip");
            assert_eq!(
                vip["securityContext"]["capabilities"],
                json!({"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]}),
                "{what}"
            );
            assert!(
                after[kube_vip]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
                    ["requiredDuringSchedulingIgnoredDuringExecution"]
                    .is_object(),
                "{what}: kube-vip stays on the control-plane nodes"
            );
            match case.what {
                w if w.starts_with("node driver") => {
                    assert_eq!(cluster_name_args(new), ["--cluster-name=rke2-prod"]);
                    assert_eq!(
                        new_args.last().map(String::as_str),
                        Some("--disable-annotation-alpha-provided-ip-addr=true")
                    );
                }
                w if w.starts_with("cloud-config Secret") => {
                    assert_eq!(
                        live_volume(&after[deployment], "cloud-config")["secret"],
                        json!({"secretName": "harvester-cloud-config", "defaultMode": 420,
                               "items": [{"key": "cloud-config", "path": "cloud-config"}]}),
                        "{what}"
                    );
                    let mount = new["volumeMounts"]
                        .as_array()
                        .and_then(|m| m.iter().find(|m| m["name"] == "cloud-config"))
                        .expect("cloud-config mount");
                    // The Secret's directory: a rotated Secret reaches the pod.
                    assert_eq!(mount["mountPath"], "/etc/kubernetes", "{what}");
                    assert_eq!(mount.get("subPath"), None, "{what}");
                }
                _ => assert!(cluster_name_args(new).is_empty(), "{what}"),
            }
            uninstall(&helm, CCM_CHART);
        }
    }
}

#[tokio::test]
async fn csi_release_of_the_upstream_chart_upgrades_with_reuse_values() {
    let bed = bed().await;
    install_snapshot_crds(&bed.guest.client).await;
    let helm = BedHelm::new(&bed);
    let dir = bed.dir.path().to_path_buf();
    let client = &bed.guest.client;
    let controllers = "Deployment/harvester-csi-driver-controllers";
    let node = "DaemonSet/harvester-csi-driver";
    let csidrivers: Api<CSIDriver> = Api::all(client.clone());
    let classes: Api<StorageClass> = Api::all(client.clone());

    let cases = [
        Case {
            what: "upstream defaults with RKE2's globals",
            values: None,
            set_string: RKE2_SET_STRING,
        },
        Case {
            what: "cloud-config Secret and a host StorageClass",
            values: Some(
                "cloudConfig:\n  secretName: harvester-cloud-config\nhostStorageClass: longhorn-ssd\n",
            ),
            set_string: &[],
        },
    ];
    for case in &cases {
        let what = case.what;
        // Upstream's CSIDriver, read between the two steps: installed by the first install.
        let (before, after) = switch(
            &helm,
            client,
            CSI_CHART,
            case,
            &dir,
            "--reuse-values",
            CSI_IMAGE,
        )
        .await;
        assert_kept(what, &before, &after, "harvester-csi-driver-0.1.0");

        // The controllers read the cloud-config from where upstream's node plugin did; our node
        // plugin holds none (docs/security.md).
        assert_eq!(
            source(live_volume(&before[node], "cloud-config")),
            source(live_volume(&after[controllers], "cloud-config")),
            "{what}: the controllers read the cloud-config from where upstream's node plugin did"
        );
        let node_volumes = after[node]["spec"]["template"]["spec"]["volumes"].to_string();
        assert!(
            !node_volumes.contains("cloud-config"),
            "{what}: the node plugin mounts a cloud-config: {node_volumes}"
        );
        let controller_args = args(container(&after[controllers], "harvester-csi-driver"));
        assert!(
            controller_args
                .iter()
                .any(|x| x == "--kubeconfig=/var/lib/harvester/cloud-provider-config"),
            "{what}: {controller_args:?}"
        );
        let driver = container(&after[node], "harvester-csi-driver");
        assert_eq!(
            driver["image"],
            "registry.example.com/harvester-csi-driver:0.1.0"
        );
        let a = args(driver);
        assert!(a.iter().any(|x| x == "--kubeconfig="), "{what}: {a:?}");
        if case.values.is_some() {
            assert!(
                a.iter().any(|x| x == "--host-storage-class=longhorn-ssd"),
                "{what}: {a:?}"
            );
        }
        // The kubelet's plugin registration path stays upstream's.
        assert!(
            args(container(&after[node], "node-driver-registrar")).contains(
                &"--kubelet-registration-path=/var/lib/kubelet/harvester-plugins/driver.harvesterhci.io/csi.sock"
                    .to_string()
            ),
            "{what}"
        );
        // Sidecars: the release's (upstream's) images; ours where upstream has none.
        let ctrl = &after[controllers];
        assert_eq!(
            container(ctrl, "csi-provisioner")["image"],
            "rancher/mirrored-longhornio-csi-provisioner:v5.3.0-20260428"
        );
        assert_eq!(
            container(ctrl, "liveness-probe")["image"],
            "rancher/mirrored-sig-storage-livenessprobe:v2.15.0"
        );
        assert!(
            ctrl["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
                ["requiredDuringSchedulingIgnoredDuringExecution"]
                .is_object(),
            "{what}: the controllers stay on control-plane nodes, as upstream"
        );
        let spec = csidrivers
            .get("driver.harvesterhci.io")
            .await
            .expect("our CSIDriver")
            .spec;
        // Upstream's (the facts file; the fixture renders the same): fields kubelet and the
        // attach/detach controller act on for existing volumes.
        assert_eq!(
            (
                spec.attach_required,
                spec.pod_info_on_mount,
                spec.fs_group_policy.as_deref(),
                spec.volume_lifecycle_modes.clone()
            ),
            (
                Some(true),
                Some(true),
                Some("ReadWriteOnceWithFSType"),
                Some(vec!["Persistent".to_string()])
            ),
            "{what}: the CSIDriver's fields stay"
        );
        let sc = classes.get("harvester").await.unwrap_or_else(|e| {
            panic!("{what}: the StorageClass harvester survives the upgrade: {e}")
        });
        assert_eq!(sc.provisioner, "driver.harvesterhci.io");
        assert_eq!(sc.volume_binding_mode.as_deref(), Some("Immediate"));
        let snapshot_classes = helm.ok(&[
            "get",
            "manifest",
            CSI_CHART,
            "--namespace",
            RELEASE_NAMESPACE,
        ]);
        assert!(
            parse(&snapshot_classes)
                .iter()
                .any(|d| d["kind"] == "VolumeSnapshotClass"
                    && d["metadata"]["name"] == "harvester-snapshot"),
            "{what}: the VolumeSnapshotClass stays in the release"
        );
        uninstall(&helm, CSI_CHART);
    }
}

#[tokio::test]
async fn cloud_config_secret_is_mounted_with_the_default_cloud_config_path() {
    let bed = bed().await;
    let helm = BedHelm::new(&bed);
    let ours = chart_dir(CCM_CHART).to_string_lossy().to_string();
    helm.ok(&[
        "install",
        CCM_CHART,
        &ours,
        "--namespace",
        RELEASE_NAMESPACE,
        "--set",
        "cloudConfig.secretName=harvester-cloud-config",
        "--set",
        "cloudConfig.secretKey=kubeconfig",
        // Our image: the chart has no default for it.
        "--set",
        CCM_IMAGE[0],
    ]);
    let live = workloads(&bed.guest.client).await;
    let deployment = &live["Deployment/harvester-cloud-provider"];
    assert_eq!(
        live_volume(deployment, "cloud-config")["secret"],
        json!({"secretName": "harvester-cloud-config", "defaultMode": 420,
               "items": [{"key": "kubeconfig", "path": "cloud-config"}]}),
        "the Secret, not cloudConfigPath's host file (upstream's precedence)"
    );
    let c = container(deployment, "harvester-cloud-provider");
    let mount = c["volumeMounts"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["name"] == "cloud-config"))
        .expect("cloud-config mount");
    assert_eq!(mount["mountPath"], "/etc/kubernetes");
    assert_eq!(
        mount.get("subPath"),
        None,
        "no subPath: the kubelet updates the file"
    );
    assert!(args(c).contains(&"--cloud-config=/etc/kubernetes/cloud-config".to_string()));
}

/// The `storageclass.kubernetes.io/is-default-class` annotation of a live StorageClass.
async fn default_mark(classes: &Api<StorageClass>, name: &str) -> Option<String> {
    classes
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("StorageClass {name}: {e}"))
        .metadata
        .annotations
        .and_then(|a| {
            a.get("storageclass.kubernetes.io/is-default-class")
                .cloned()
        })
}

#[tokio::test]
async fn on_k3s_harvester_becomes_the_default_class_once_local_path_is_unmarked() {
    let bed = bed().await;
    let helm = BedHelm::new(&bed);
    let client = &bed.guest.client;
    let classes: Api<StorageClass> = Api::all(client.clone());
    // K3s' local-path class as its manifest creates it (k3s-io/k3s manifests/local-storage.yaml).
    let local_path = json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": "local-path",
                     "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
        "provisioner": "rancher.io/local-path",
        "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Delete"});
    apply(client, &local_path, "default", false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // docs/install.md, "K3s": without the CRDs, no VolumeSnapshotClass.
    let ours = chart_dir(CSI_CHART).to_string_lossy().to_string();
    let install = |verb: &str| {
        let mut a = vec![verb, CSI_CHART, &ours, "--namespace", RELEASE_NAMESPACE];
        if verb == "install" {
            a.extend(["--set", "volumeSnapshotClass.create=false"]);
            for s in CSI_IMAGE {
                a.extend(["--set", s]);
            }
        } else {
            a.push("--reuse-values");
        }
        helm.ok(&a);
    };
    install("install");
    assert_eq!(
        default_mark(&classes, "harvester").await.as_deref(),
        Some("false"),
        "storageClass.default=true leaves harvester non-default while local-path is the default \
         (upstream's behaviour, which the K3s section states)"
    );

    // The documented step: unmark local-path, then upgrade the release with its values.
    let unmark = json!({"metadata": {"annotations":
        {"storageclass.kubernetes.io/is-default-class": "false"}}});
    classes
        .patch(
            "local-path",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&unmark),
        )
        .await
        .unwrap_or_else(|e| panic!("unmarking local-path: {e}"));
    install("upgrade");
    assert_eq!(
        default_mark(&classes, "harvester").await.as_deref(),
        Some("true"),
        "harvester is the default once local-path is not"
    );
    assert_eq!(
        default_mark(&classes, "local-path").await.as_deref(),
        Some("false")
    );
    uninstall(&helm, CSI_CHART);
}

// ---- no test bed: helm template only ----

/// The keys of `ours` that `upstream` lacks, as a values tree with null leaves (which remove
/// those keys from a chart's defaults when given as a values file).
fn missing_keys(ours: &Value, upstream: &Value) -> Value {
    let mut out = serde_json::Map::new();
    if let (Some(ours), Some(upstream)) = (ours.as_object(), upstream.as_object()) {
        for (key, value) in ours {
            match upstream.get(key) {
                None => {
                    out.insert(key.clone(), Value::Null);
                }
                Some(theirs) if value.is_object() && theirs.is_object() => {
                    let nested = missing_keys(value, theirs);
                    if nested.as_object().is_some_and(|m| !m.is_empty()) {
                        out.insert(key.clone(), nested);
                    }
                }
                Some(_) => {}
            }
        }
    }
    Value::Object(out)
}

fn read_values(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Deep merge of `over` into `base` (maps merge, anything else replaces), as Helm coalesces a
/// parent chart's values over its sub-chart's.
fn coalesce(base: &mut Value, over: &Value) {
    match (base.as_object_mut(), over.as_object()) {
        (Some(b), Some(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(existing) => coalesce(existing, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        _ => *base = over.clone(),
    }
}

/// The values an upstream release holds: the fixture's values.yaml with its sub-charts' values
/// under their names (what Helm coalesces).
fn upstream_values(chart: &str) -> Value {
    let dir = fixture_dir(chart);
    let mut values = read_values(&dir.join("values.yaml"));
    let subcharts = dir.join("charts");
    if let Ok(entries) = std::fs::read_dir(&subcharts) {
        for entry in entries {
            let sub: PathBuf = entry.expect("entry").path();
            let name = sub.file_name().expect("name").to_string_lossy().to_string();
            let mut merged = read_values(&sub.join("values.yaml"));
            if let Some(parent) = values.get(&name) {
                coalesce(&mut merged, parent);
            }
            values[&name] = merged;
        }
    }
    values
}

#[test]
fn keys_upstream_lacks_render_as_their_values_yaml_defaults() {
    let dir = tempfile::tempdir().expect("tempdir");
    for chart in [CCM_CHART, CSI_CHART] {
        let ours = read_values(&chart_dir(chart).join("values.yaml"));
        let nulls = missing_keys(&ours, &upstream_values(chart));
        let count = nulls.as_object().map(|m| m.len()).unwrap_or(0);
        assert!(
            count >= 3,
            "{chart}: our values.yaml adds keys upstream lacks (found {nulls})"
        );
        // A value set to null removes the chart's default: the templates see the key absent,
        // as under `helm upgrade --reuse-values` from an upstream release.
        let file = dir.path().join(format!("{chart}-nulls.json"));
        std::fs::write(&file, nulls.to_string()).expect("write");
        let with_defaults = template(chart, None, &[]);
        let without = template(chart, Some(&file), &[]);
        assert_eq!(
            without.len(),
            with_defaults.len(),
            "{chart}: the same objects without {nulls}: {:?} vs {:?}",
            kinds(&without),
            kinds(&with_defaults)
        );
        for (a, b) in with_defaults.iter().zip(&without) {
            assert_eq!(
                a,
                b,
                "{chart}: {} renders differently without {nulls}",
                kinds(std::slice::from_ref(a))[0]
            );
        }
    }
}

#[test]
fn upstream_and_node_driver_values_pass_the_values_schema() {
    for chart in [CCM_CHART, CSI_CHART] {
        let values = fixture_dir(chart).join("values.yaml");
        let mut set: Vec<String> = Vec::new();
        let dir = chart_dir(chart).to_string_lossy().to_string();
        let values_s = values.to_string_lossy().to_string();
        let mut args = vec![
            "template",
            chart,
            &dir,
            "--namespace",
            RELEASE_NAMESPACE,
            "--values",
            &values_s,
        ];
        for s in RKE2_SET_STRING {
            set.push(s.to_string());
        }
        for s in &set {
            args.extend(["--set-string", s]);
        }
        run_helm(&args).unwrap_or_else(|e| panic!("{chart} with upstream's values: {e}"));
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let rancher = tmp.path().join("rancher.yaml");
    std::fs::write(&rancher, RANCHER_CCM_VALUES).expect("write");
    let docs = template(CCM_CHART, Some(&rancher), &[]);
    let c = container(
        find(&docs, "Deployment", "harvester-cloud-provider"),
        "harvester-cloud-provider",
    );
    assert!(args(c).contains(&"--cluster-name=rke2-prod".to_string()));
}

#[test]
fn a_value_of_the_wrong_type_fails_naming_the_key() {
    // (chart, --set-json pair, what the message must name)
    let cases = [
        (CCM_CHART, "replicasCount=\"three\"", "replicasCount"),
        (CCM_CHART, "extraArgs=\"--v=5\"", "extraArgs"),
        (
            CCM_CHART,
            "cloudConfig=\"/etc/cloud-config\"",
            "cloudConfig",
        ),
        (CCM_CHART, "kube-vip={\"enabled\":\"no\"}", "enabled"),
        (CCM_CHART, "kube-vip={\"env\":{\"vip_arp\":[1]}}", "vip_arp"),
        (
            CCM_CHART,
            "image={\"pullPolicy\":\"Sometimes\"}",
            "pullPolicy",
        ),
        (CSI_CHART, "maxVolumesPerNode=\"many\"", "maxVolumesPerNode"),
        (
            CSI_CHART,
            "kubeletRootDir=\"var/lib/kubelet\"",
            "kubeletRootDir",
        ),
        (CSI_CHART, "storageClass={\"default\":\"yes\"}", "default"),
        (CSI_CHART, "tolerations={}", "tolerations"),
    ];
    for (chart, pair, key) in cases {
        let dir = chart_dir(chart).to_string_lossy().to_string();
        let err = run_helm(&[
            "template",
            chart,
            &dir,
            "--namespace",
            RELEASE_NAMESPACE,
            "--set-json",
            pair,
        ])
        .expect_err(&format!("{chart} --set-json {pair} must not render"));
        assert!(
            err.contains(key) && err.contains("schema"),
            "{chart} --set-json {pair}: the message names {key}:\n{err}"
        );
    }
}
