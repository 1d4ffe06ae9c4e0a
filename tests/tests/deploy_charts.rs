//! The Helm charts in deploy/charts: helm lint and template for every value set, what the
//! rendered objects hold (the upstream-compatible shape and our flags), and a real API server
//! accepting every rendered object (server-side apply, dryRun=All).

use std::collections::BTreeSet;

use serde_json::{Value, json};
use testbed::suites::deploy::*;

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn mount<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["volumeMounts"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["name"] == name))
        .unwrap_or_else(|| panic!("no volumeMount {name} in container {}", container["name"]))
}

fn volume<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == name))
        .unwrap_or_else(|| panic!("no volume {name} in {}", workload["metadata"]["name"]))
}

/// The rules of a (Cluster)Role as (group, resource, verb) triples.
fn grants(role: &Value) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in role["rules"].as_array().expect("rules") {
        for g in strs(&rule["apiGroups"]) {
            for r in strs(&rule["resources"]) {
                for v in strs(&rule["verbs"]) {
                    out.insert((g.clone(), r.clone(), v));
                }
            }
        }
    }
    out
}

fn grant(group: &str, resource: &str, verb: &str) -> (String, String, String) {
    (group.into(), resource.into(), verb.into())
}

#[test]
fn both_charts_pass_helm_lint_strict_with_every_value_set() {
    for chart in [CCM_CHART, CSI_CHART] {
        for (set, values) in value_sets(chart) {
            let dir = chart_dir(chart);
            let mut args = vec![
                "lint".to_string(),
                "--strict".into(),
                dir.to_string_lossy().into(),
            ];
            if let Some(v) = values {
                args.extend(["--values".into(), v.to_string_lossy().into()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            if let Err(e) = run_helm(&args) {
                panic!("helm lint {chart} with {set}:\n{e}");
            }
        }
    }
}

#[test]
fn cloud_provider_chart_renders_the_upstream_shape_with_our_needs() {
    let docs = template(CCM_CHART, None, &[]);
    let deploy = find(&docs, "Deployment", "harvester-cloud-provider");
    assert_eq!(deploy["metadata"]["namespace"], RELEASE_NAMESPACE);
    assert_eq!(deploy["spec"]["replicas"], 1, "one replica by default");
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["serviceAccountName"], "harvester-cloud-provider");
    assert!(
        pod["tolerations"]
            .as_array()
            .expect("tolerations")
            .contains(&json!({
            "key": "node.cloudprovider.kubernetes.io/uninitialized", "operator": "Equal",
            "value": "true", "effect": "NoSchedule"})),
        "the cloud provider must run on Nodes it has not initialised: {}",
        pod["tolerations"]
    );
    let c = container(deploy, "harvester-cloud-provider");
    assert_eq!(strs(&c["command"]), ["harvester-cloud-provider"]);
    assert_eq!(
        args(c),
        [
            "--cloud-config=/etc/kubernetes/cloud-config",
            "--leader-elect-resource-namespace=kube-system",
            "--leader-elect-resource-name=cloud-controller-manager",
            "--bind-address=0.0.0.0",
            "--secure-port=10258",
        ],
        "no cluster name given: the flag's default applies"
    );
    // Upstream's HTTPS endpoints; the probes' paths are open without a token.
    assert_eq!(
        c["livenessProbe"]["httpGet"],
        json!({"scheme": "HTTPS", "path": "/healthz", "port": "https"})
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({"scheme": "HTTPS", "path": "/readyz", "port": "https"})
    );
    assert_eq!(
        c["ports"],
        json!([{"name": "https", "containerPort": 10258}])
    );
    let off = template(CCM_CHART, None, &["securePort=0"]);
    let c_off = container(
        find(&off, "Deployment", "harvester-cloud-provider"),
        "harvester-cloud-provider",
    );
    assert!(args(c_off).contains(&"--secure-port=0".to_string()));
    assert_eq!(
        c_off["readinessProbe"],
        Value::Null,
        "no endpoint, no probe"
    );
    let caps = strs(&c["securityContext"]["capabilities"]["add"]);
    assert_eq!(
        caps,
        ["NET_RAW", "NET_BIND_SERVICE"],
        "what DHCP mode needs and nothing else"
    );
    assert_eq!(strs(&c["securityContext"]["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(
        mount(c, "cloud-config")["mountPath"],
        "/etc/kubernetes/cloud-config"
    );
    assert_eq!(
        volume(deploy, "cloud-config")["hostPath"],
        json!({"path": "/var/lib/rancher/rke2/etc/config-files/cloud-provider-config", "type": "File"})
    );

    // kube-vip as upstream ships it, on by default.
    let kv = find(&docs, "DaemonSet", "kube-vip");
    let kvc = container(kv, "kube-vip");
    assert_eq!(args(kvc), ["manager"]);
    let env: Vec<(String, String)> = kvc["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().expect("name").into(),
                e["value"].as_str().expect("value").into(),
            )
        })
        .collect();
    for (k, v) in [
        ("svc_enable", "true"),
        ("cp_enable", "false"),
        ("vip_arp", "true"),
    ] {
        assert!(
            env.contains(&(k.into(), v.into())),
            "kube-vip env {k}={v}: {env:?}"
        );
    }
    assert_eq!(kv["spec"]["template"]["spec"]["hostNetwork"], true);
    // Upstream's placement and capabilities: rancher/rke2-charts
    // charts/harvester-cloud-provider/harvester-cloud-provider/0.2.1600/values.yaml (commit
    // 256663cc) `kube-vip.affinity`; the kube-vip sub-chart's values.yaml of 0.2.1500 (commit
    // 25c8c2fb) `securityContext` and `updateStrategy`.
    assert_eq!(
        kv["spec"]["template"]["spec"]["affinity"],
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "node-role.kubernetes.io/controlplane", "operator": "Exists"}]},
                {"matchExpressions": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}]}}})
    );
    assert!(kv["spec"]["template"]["spec"]["nodeSelector"].is_null());
    assert_eq!(
        kvc["securityContext"],
        json!({"capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]}})
    );
    assert_eq!(
        kv["spec"]["updateStrategy"],
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}})
    );
    assert_eq!(
        kv["spec"]["selector"]["matchLabels"],
        json!({"app.kubernetes.io/name": "kube-vip", "app.kubernetes.io/instance": "harvester-cloud-provider"})
    );
    // kube-vip's RBAC: nodes patch (it labels Nodes), as its chart; no Secret at all in ARP
    // mode, where kube-vip reads none (its chart grants get/list on every Secret of the
    // namespace, the cloud-config's among them).
    let kv_role = grants(find(&docs, "ClusterRole", "kube-vip"));
    assert!(
        kv_role.contains(&grant("", "nodes", "patch")),
        "{kv_role:?}"
    );
    assert!(
        !kv_role.iter().any(|(_, r, _)| r == "secrets"),
        "{kv_role:?}"
    );
    for kind in ["Role", "RoleBinding"] {
        assert!(
            !docs
                .iter()
                .any(|d| d["kind"] == kind && d["metadata"]["name"] == "kube-vip"),
            "kube-vip gets no {kind} for Secrets in ARP mode"
        );
    }
    // In WireGuard mode the one Secret it reads, by name.
    let wg = template(CCM_CHART, None, &["kube-vip.env.vip_wireguard=true"]);
    let secrets = find(&wg, "Role", "kube-vip");
    assert_eq!(secrets["metadata"]["namespace"], RELEASE_NAMESPACE);
    assert_eq!(grants(secrets), [grant("", "secrets", "get")].into());
    assert_eq!(secrets["rules"][0]["resourceNames"], json!(["wireguard"]));
    assert_eq!(
        find(&wg, "RoleBinding", "kube-vip")["roleRef"]["name"],
        "kube-vip"
    );

    // Guest RBAC: the Events API, not core events; nothing the code does not call.
    let role = grants(find(&docs, "ClusterRole", "harvester-cloud-provider"));
    assert!(role.contains(&grant("events.k8s.io", "events", "create")));
    assert!(role.contains(&grant("events.k8s.io", "events", "patch")));
    assert!(!role.iter().any(|(g, r, _)| g.is_empty() && r == "events"));
    assert!(!role.iter().any(|(_, _, v)| v == "*" || v == "update"));
    // TokenReview and SubjectAccessReview of the HTTPS endpoints: the standard role.
    let delegator = find(
        &docs,
        "ClusterRoleBinding",
        "harvester-cloud-provider-auth-delegator",
    );
    assert_eq!(
        delegator["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
               "name": "system:auth-delegator"})
    );
    assert_eq!(
        delegator["subjects"],
        json!([{"kind": "ServiceAccount", "name": "harvester-cloud-provider",
                "namespace": RELEASE_NAMESPACE}])
    );
    let nad = find(&docs, "Role", "harvester-cloud-provider-nad-mapping");
    assert_eq!(nad["metadata"]["namespace"], "kube-system");
    assert_eq!(
        nad["rules"],
        json!([{"apiGroups": [""], "resources": ["configmaps"],
                "resourceNames": ["harvester-nad-mapping", "kubevip"],
                "verbs": ["get", "list", "watch"]}])
    );
}

#[test]
fn cloud_provider_chart_takes_every_cloud_config_source_and_the_cluster_name() {
    let sets = value_sets(CCM_CHART);
    let file = |name: &str| {
        sets.iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, f)| f.clone())
            .unwrap_or_else(|| panic!("ci/{name}"))
    };

    // A Secret, a cluster name, extra flags, no kube-vip.
    let docs = template(CCM_CHART, Some(&file("secret-values.yaml")), &[]);
    let deploy = find(&docs, "Deployment", "harvester-cloud-provider");
    let c = container(deploy, "harvester-cloud-provider");
    assert_eq!(
        args(c),
        [
            "--cloud-config=/etc/kubernetes/cloud-config",
            "--leader-elect-resource-namespace=kube-system",
            "--leader-elect-resource-name=cloud-controller-manager",
            "--bind-address=0.0.0.0",
            "--secure-port=10258",
            "--tls-cert-file=/etc/harvester-cloud-provider/serving-cert/tls.crt",
            "--tls-private-key-file=/etc/harvester-cloud-provider/serving-cert/tls.key",
            "--cluster-name=rke2-prod",
            "--management-network=default/vlan-100",
            "--node-ip-cidr=10.52.0.0/16",
            "--controllers=*,-service-lb-controller",
        ]
    );
    assert_eq!(mount(c, "cloud-config")["mountPath"], "/etc/kubernetes");
    assert_eq!(
        volume(deploy, "cloud-config")["secret"],
        json!({"secretName": "harvester-cloud-config",
               "items": [{"key": "kubeconfig", "path": "cloud-config"}]})
    );
    assert!(
        !docs.iter().any(|d| d["metadata"]["name"] == "kube-vip"),
        "kube-vip.enabled=false renders no kube-vip object: {:?}",
        kinds(&docs)
    );

    // Rancher's globals: registry prefix and cluster name; the fallback host path.
    let docs = template(CCM_CHART, Some(&file("rancher-values.yaml")), &[]);
    let deploy = find(&docs, "Deployment", "harvester-cloud-provider");
    let c = container(deploy, "harvester-cloud-provider");
    assert_eq!(
        c["image"],
        "registry.example.com/team/harvester-cloud-provider:0.1.0"
    );
    assert!(args(c).contains(&"--cluster-name=c-m-abcd1234".to_string()));
    assert_eq!(
        volume(deploy, "cloud-config")["hostPath"]["path"],
        "/etc/kubernetes/cloud-config"
    );
    assert!(
        container(find(&docs, "DaemonSet", "kube-vip"), "kube-vip")["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("registry.example.com/"))
    );

    // No source at all: helm refuses with a message naming the three values.
    let err = try_template(
        CCM_CHART,
        None,
        &["cloudConfigPath=", "cloudConfig.hostPath="],
    )
    .expect_err("no cloud-config source must not render");
    assert!(
        err.contains("cloudConfig.secretName, cloudConfigPath or cloudConfig.hostPath"),
        "{err}"
    );
}

/// Every container of `workload` that mounts the volume `cloud-config`, with that mount.
fn cloud_config_mounts(workload: &Value) -> Vec<(&Value, &Value)> {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .filter_map(|c| {
            c["volumeMounts"]
                .as_array()?
                .iter()
                .find(|m| m["name"] == "cloud-config")
                .map(|m| (c, m))
        })
        .collect()
}

/// The CSI node plugin never gets the controller's cloud-config (from a Secret or the host): no
/// Harvester credential at all unless a read-only one of its own is named, mounted as a
/// directory like the others.
#[test]
fn csi_node_plugin_gets_no_cloud_config_but_its_own() {
    let driver_args = |docs: &[Value]| {
        args(container(
            find(docs, "DaemonSet", "harvester-csi-driver"),
            "harvester-csi-driver",
        ))
    };
    for set in [
        &[][..],
        &["cloudConfig.secretName=harvester-cloud-config"][..],
        &["cloudConfig.hostPath=/etc/kubernetes/cloud-config"][..],
    ] {
        let docs = template(CSI_CHART, None, set);
        let ds = find(&docs, "DaemonSet", "harvester-csi-driver");
        let volumes = ds["spec"]["template"]["spec"]["volumes"].to_string();
        assert!(
            !volumes.contains("cloud-config") && !volumes.contains("config-files"),
            "{set:?}: the node plugin mounts a cloud-config: {volumes}"
        );
        let a = driver_args(&docs);
        assert!(a.contains(&"--kubeconfig=".to_string()), "{set:?}: {a:?}");
        assert!(
            !a.iter().any(|f| f.starts_with("--kubeconfig=/")),
            "{set:?}: {a:?}"
        );
    }
    let docs = template(CSI_CHART, None, &["nodeCloudConfig.secretName=csi-node-ro"]);
    let ds = find(&docs, "DaemonSet", "harvester-csi-driver");
    assert_eq!(
        volume(ds, "node-cloud-config")["secret"],
        json!({"secretName": "csi-node-ro",
               "items": [{"key": "cloud-provider-config", "path": "cloud-provider-config"}]})
    );
    let c = container(ds, "harvester-csi-driver");
    let m = mount(c, "node-cloud-config");
    assert!(m.get("subPath").is_none(), "{m}");
    assert_eq!(m["readOnly"], true);
    let file = format!(
        "--kubeconfig={}/cloud-provider-config",
        m["mountPath"].as_str().expect("mountPath")
    );
    assert!(
        driver_args(&docs).contains(&file),
        "{:?}",
        driver_args(&docs)
    );
}

#[test]
fn cloud_config_secret_is_mounted_as_a_directory_so_a_rotation_reaches_the_pods() {
    // (chart, workloads, the flag naming the file): the Secret source of each chart.
    let cases = [
        (
            CCM_CHART,
            vec![("Deployment", "harvester-cloud-provider")],
            "--cloud-config=",
        ),
        (
            CSI_CHART,
            vec![("Deployment", "harvester-csi-driver-controllers")],
            "--kubeconfig=",
        ),
    ];
    for (chart, workloads, flag) in cases {
        let docs = template(
            chart,
            None,
            &[
                "cloudConfig.secretName=harvester-cloud-config",
                "cloudConfig.secretKey=kubeconfig",
            ],
        );
        for (kind, name) in workloads {
            let workload = find(&docs, kind, name);
            let secret = &volume(workload, "cloud-config")["secret"];
            assert_eq!(secret["secretName"], "harvester-cloud-config", "{name}");
            let file = secret["items"][0]["path"].as_str().expect("items[0].path");
            let mounts = cloud_config_mounts(workload);
            assert!(
                !mounts.is_empty(),
                "{name}: no container mounts the cloud-config"
            );
            for (c, m) in mounts {
                // The kubelet never updates a subPath mount: a rotated Secret would not reach
                // the file the program re-reads.
                assert!(
                    m.get("subPath").is_none() && m.get("subPathExpr").is_none(),
                    "{name}/{}: the cloud-config Secret is mounted with a subPath: {m}",
                    c["name"]
                );
                let dir = m["mountPath"].as_str().expect("mountPath");
                let names_file = format!("{flag}{}/{file}", dir.trim_end_matches('/'));
                if args(c).iter().any(|a| a.starts_with(flag)) {
                    assert!(
                        args(c).contains(&names_file),
                        "{name}/{}: {flag} names the file in the mounted directory ({names_file}): {:?}",
                        c["name"],
                        args(c)
                    );
                }
            }
        }
    }
    // The cloud provider's file keeps upstream's path (--cloud-config's default too), so an
    // extraArgs `--cloud-config=/etc/kubernetes/cloud-config` still names it; a later one wins.
    let docs = template(
        CCM_CHART,
        None,
        &[
            "cloudConfig.secretName=harvester-cloud-config",
            "extraArgs[0]=--cloud-config=/etc/kubernetes/cloud-config",
        ],
    );
    let a = args(container(
        find(&docs, "Deployment", "harvester-cloud-provider"),
        "harvester-cloud-provider",
    ));
    assert_eq!(
        a.first().map(String::as_str),
        Some("--cloud-config=/etc/kubernetes/cloud-config")
    );
    assert_eq!(
        a.last().map(String::as_str),
        Some("--cloud-config=/etc/kubernetes/cloud-config")
    );

    // A host file stays a file mount at the same path, as before.
    let docs = template(CCM_CHART, None, &[]);
    let deploy = find(&docs, "Deployment", "harvester-cloud-provider");
    let c = container(deploy, "harvester-cloud-provider");
    assert_eq!(
        mount(c, "cloud-config")["mountPath"],
        "/etc/kubernetes/cloud-config"
    );
    assert_eq!(volume(deploy, "cloud-config")["hostPath"]["type"], "File");
}

#[test]
fn cloud_provider_serves_the_certificate_of_the_secret_secure_serving_names() {
    let tls_args = |c: &Value| -> Vec<String> {
        args(c)
            .into_iter()
            .filter(|a| a.starts_with("--tls-"))
            .collect()
    };
    // Default: no Secret, no files: the provider makes a self-signed certificate.
    let docs = template(CCM_CHART, None, &[]);
    let deploy = find(&docs, "Deployment", "harvester-cloud-provider");
    let c = container(deploy, "harvester-cloud-provider");
    assert!(tls_args(c).is_empty(), "{:?}", args(c));
    assert!(
        !deploy["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .any(|v| v["name"] == "serving-cert")
    );

    let docs = template(
        CCM_CHART,
        None,
        &["secureServing.certSecretName=harvester-cloud-provider-serving"],
    );
    let deploy = find(&docs, "Deployment", "harvester-cloud-provider");
    assert_eq!(
        volume(deploy, "serving-cert"),
        &json!({"name": "serving-cert",
                "secret": {"secretName": "harvester-cloud-provider-serving"}})
    );
    let c = container(deploy, "harvester-cloud-provider");
    let m = mount(c, "serving-cert");
    assert_eq!(m["readOnly"], true);
    assert!(m.get("subPath").is_none(), "the Secret's directory: {m}");
    let dir = m["mountPath"].as_str().expect("mountPath");
    assert_eq!(
        tls_args(c),
        [
            format!("--tls-cert-file={dir}/tls.crt"),
            format!("--tls-private-key-file={dir}/tls.key"),
        ],
        "the keys of a kubernetes.io/tls Secret"
    );
    let mut argv = strs(&c["command"]);
    argv.extend(args(c));
    harvester_cloud_provider::Config::from_args(&argv)
        .unwrap_or_else(|e| panic!("the binary refuses {argv:?}: {e}"));

    // Files in extraArgs come later and win, as before this value existed.
    let docs = template(
        CCM_CHART,
        None,
        &[
            "secureServing.certSecretName=harvester-cloud-provider-serving",
            "extraArgs={--tls-cert-file=/etc/mine/crt,--tls-private-key-file=/etc/mine/key}",
        ],
    );
    let c = container(
        find(&docs, "Deployment", "harvester-cloud-provider"),
        "harvester-cloud-provider",
    );
    assert_eq!(
        tls_args(c)[2..],
        [
            "--tls-cert-file=/etc/mine/crt".to_string(),
            "--tls-private-key-file=/etc/mine/key".to_string()
        ]
    );
}

#[test]
fn cloud_provider_chart_args_are_flags_the_binary_accepts() {
    for (set, values) in value_sets(CCM_CHART) {
        let docs = template(CCM_CHART, values.as_deref(), &[]);
        let c = container(
            find(&docs, "Deployment", "harvester-cloud-provider"),
            "harvester-cloud-provider",
        );
        let mut argv = strs(&c["command"]);
        argv.extend(args(c));
        if let Err(e) = harvester_cloud_provider::Config::from_args(&argv) {
            panic!("value set {set}: the chart passes {argv:?}, which the binary refuses: {e}");
        }
    }
}

#[test]
fn csi_chart_renders_controller_with_driver_node_plugin_csidriver_and_classes() {
    let docs = template(CSI_CHART, None, &[]);

    let ctrl = find(&docs, "Deployment", "harvester-csi-driver-controllers");
    let names: Vec<String> = ctrl["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .map(|c| c["name"].as_str().expect("name").to_string())
        .collect();
    assert_eq!(
        names,
        [
            "csi-provisioner",
            "csi-attacher",
            "csi-resizer",
            "csi-snapshotter",
            "liveness-probe",
            "harvester-csi-driver"
        ]
    );
    assert_eq!(ctrl["spec"]["replicas"], 3, "upstream's default");
    // Sidecar images no older than upstream's: harvester/charts charts/harvester-csi-driver
    // values.yaml at master 48a577b7
    // (https://github.com/harvester/charts/blob/48a577b7/charts/harvester-csi-driver/values.yaml).
    for (name, image) in [
        (
            "csi-provisioner",
            "rancher/mirrored-longhornio-csi-provisioner:v5.3.0-20260428",
        ),
        (
            "csi-attacher",
            "rancher/mirrored-longhornio-csi-attacher:v4.11.0-20260428",
        ),
        (
            "csi-resizer",
            "rancher/mirrored-longhornio-csi-resizer:v2.1.0-20260428",
        ),
        (
            "csi-snapshotter",
            "rancher/mirrored-longhornio-csi-snapshotter:v8.5.0-20260428",
        ),
    ] {
        assert_eq!(container(ctrl, name)["image"], image);
    }
    // The controllers only on control-plane nodes (required), as upstream's deployment.yaml
    // (harvester/charts charts/harvester-csi-driver/templates/deployment.yaml, 05a56a9e).
    assert_eq!(
        ctrl["spec"]["template"]["spec"]["affinity"]["nodeAffinity"],
        json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "node-role.kubernetes.io/controlplane", "operator": "Exists"}]},
            {"matchExpressions": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}]}})
    );
    let driver = container(ctrl, "harvester-csi-driver");
    assert!(args(driver).contains(&"--mode=controller".to_string()));
    assert_eq!(
        volume(ctrl, "socket-dir")["emptyDir"],
        json!({}),
        "the controller's socket is private to its pod"
    );
    for sidecar in [
        "csi-provisioner",
        "csi-attacher",
        "csi-resizer",
        "csi-snapshotter",
    ] {
        assert!(
            args(container(ctrl, sidecar)).contains(&"--leader-election".to_string()),
            "{sidecar} elects a leader (upstream's snapshotter does not)"
        );
    }

    let node = find(&docs, "DaemonSet", "harvester-csi-driver");
    let pod = &node["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    // RWX volumes' NFS mounts live in the mounting process's network namespace: the host's.
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(
        pod["hostPID"],
        serde_json::Value::Null,
        "no hostPID (upstream's nsenter needs it)"
    );
    // On the host network the livenessprobe's port is a port of the node: a value, 9808 by
    // default, and the same in the sidecar's flag and the plugin's probe port.
    let health_port = |docs: &[Value]| {
        let node = find(docs, "DaemonSet", "harvester-csi-driver");
        let flag = args(container(node, "liveness-probe"))
            .into_iter()
            .find_map(|a| a.strip_prefix("--http-endpoint=:").map(str::to_string))
            .expect("--http-endpoint");
        let port = container(node, "harvester-csi-driver")["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .find(|p| p["name"] == "healthz")
            .expect("healthz port")["containerPort"]
            .clone();
        (flag, port)
    };
    assert_eq!(health_port(&docs), ("9808".to_string(), json!(9808)));
    let moved = template(CSI_CHART, None, &["nodeHealthPort=29808"]);
    assert_eq!(health_port(&moved), ("29808".to_string(), json!(29808)));
    let names: Vec<&str> = pod["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .map(|c| c["name"].as_str().expect("name"))
        .collect();
    assert_eq!(
        names,
        [
            "node-driver-registrar",
            "liveness-probe",
            "harvester-csi-driver"
        ]
    );
    assert_eq!(
        container(node, "node-driver-registrar")["image"],
        "rancher/mirrored-longhornio-csi-node-driver-registrar:v2.16.0-20260428"
    );
    let driver = container(node, "harvester-csi-driver");
    assert_eq!(driver["securityContext"]["privileged"], true);
    let a = args(driver);
    assert!(a.contains(&"--mode=node".to_string()), "{a:?}");
    // On the host network the unauthenticated endpoints listen on loopback only, where the
    // kubelet (on the node) still probes them.
    assert!(
        a.contains(&"--metrics-address=127.0.0.1:9810".to_string()),
        "{a:?}"
    );
    assert_eq!(
        driver["readinessProbe"]["httpGet"],
        json!({"host": "127.0.0.1", "path": "/readyz", "port": "metrics"})
    );
    let ctrl_driver = container(
        find(&docs, "Deployment", "harvester-csi-driver-controllers"),
        "harvester-csi-driver",
    );
    assert!(args(ctrl_driver).contains(&"--metrics-address=:9810".to_string()));
    assert_eq!(
        ctrl_driver["readinessProbe"]["httpGet"]["host"],
        Value::Null
    );
    assert!(a.contains(&"--nodeid=$(NODE_ID)".to_string()), "{a:?}");
    // No Harvester credential in the node plugin (csi_node_plugin_gets_no_cloud_config_but_its_own).
    assert!(a.contains(&"--kubeconfig=".to_string()), "{a:?}");
    let kubelet = mount(driver, "kubelet-dir");
    assert_eq!(kubelet["mountPath"], "/var/lib/kubelet");
    assert_eq!(kubelet["mountPropagation"], "Bidirectional");
    assert_eq!(mount(driver, "host-dev")["mountPath"], "/dev");
    assert_eq!(volume(node, "host-dev")["hostPath"]["path"], "/dev");
    let ctrl = find(&docs, "Deployment", "harvester-csi-driver-controllers");
    assert_eq!(
        volume(ctrl, "cloud-config")["hostPath"],
        json!({"path": "/var/lib/rancher/rke2/etc/config-files", "type": "Directory"})
    );
    assert!(
        args(container(ctrl, "harvester-csi-driver"))
            .contains(&"--kubeconfig=/var/lib/harvester/cloud-provider-config".to_string())
    );
    assert!(
        args(container(node, "node-driver-registrar")).contains(
            &"--kubelet-registration-path=/var/lib/kubelet/harvester-plugins/driver.harvesterhci.io/csi.sock"
                .to_string()
        ),
        "the upstream chart's registration path, so a switch in place keeps the kubelet's plugin"
    );

    let csidriver = find(&docs, "CSIDriver", "driver.harvesterhci.io");
    assert_eq!(
        csidriver["spec"],
        json!({"attachRequired": true, "podInfoOnMount": true,
               "fsGroupPolicy": "ReadWriteOnceWithFSType", "volumeLifecycleModes": ["Persistent"]})
    );
    let sc = find(&docs, "StorageClass", "harvester");
    assert_eq!(sc["provisioner"], "driver.harvesterhci.io");
    assert_eq!(
        sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"],
        "true"
    );
    assert_eq!(sc["allowVolumeExpansion"], true);
    let vsc = find(&docs, "VolumeSnapshotClass", "harvester-snapshot");
    assert_eq!(vsc["driver"], "driver.harvesterhci.io");

    // Node pods have no RBAC: only the controller's account is bound.
    let bound: Vec<String> = docs
        .iter()
        .filter(|d| d["kind"] == "ClusterRoleBinding" || d["kind"] == "RoleBinding")
        .flat_map(|d| {
            d["subjects"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(|s| s["name"].as_str().unwrap_or("").to_string())
        })
        .collect();
    assert!(
        bound.iter().all(|s| s == "harvester-csi-driver"),
        "{bound:?}"
    );
}

#[test]
fn csi_chart_takes_secret_host_class_kubelet_dir_and_storage_class_parameters() {
    let sets = value_sets(CSI_CHART);
    let file = |name: &str| {
        sets.iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, f)| f.clone())
            .unwrap_or_else(|| panic!("ci/{name}"))
    };
    let docs = template(CSI_CHART, Some(&file("secret-values.yaml")), &[]);
    let node = find(&docs, "DaemonSet", "harvester-csi-driver");
    let a = args(container(node, "harvester-csi-driver"));
    assert!(a.contains(&"--host-storage-class=longhorn-ssd".to_string()));
    assert!(a.contains(&"--max-volumes-per-node=16".to_string()));
    assert_eq!(
        mount(container(node, "harvester-csi-driver"), "kubelet-dir")["mountPath"],
        "/var/lib/kubelet-custom"
    );
    // Staging and target paths are confined to it.
    assert!(
        a.contains(&"--kubelet-dir=/var/lib/kubelet-custom".to_string()),
        "{a:?}"
    );
    let ctrl = find(&docs, "Deployment", "harvester-csi-driver-controllers");
    assert_eq!(
        volume(ctrl, "cloud-config")["secret"],
        json!({"secretName": "harvester-cloud-config",
               "items": [{"key": "kubeconfig", "path": "cloud-provider-config"}]})
    );
    assert!(
        args(container(ctrl, "harvester-csi-driver"))
            .contains(&"--host-storage-class=longhorn-ssd".to_string())
    );
    assert!(!docs.iter().any(|d| d["kind"] == "VolumeSnapshotClass"));

    let docs = template(CSI_CHART, Some(&file("rancher-values.yaml")), &[]);
    let sc = find(&docs, "StorageClass", "harvester-xfs");
    assert_eq!(
        sc["parameters"],
        json!({"hostStorageClass": "longhorn-ssd", "csi.storage.k8s.io/fstype": "xfs"})
    );
    assert_eq!(
        sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"],
        "false"
    );
    // A path naming the file itself mounts its directory.
    let ctrl = find(&docs, "Deployment", "harvester-csi-driver-controllers");
    assert_eq!(
        volume(ctrl, "cloud-config")["hostPath"]["path"],
        "/var/lib/rancher/rke2/etc/config-files"
    );
    let node = find(&docs, "DaemonSet", "harvester-csi-driver");
    assert_eq!(
        node["spec"]["template"]["spec"]["imagePullSecrets"],
        json!([{"name": "regcred"}, {"name": "mine"}, {"name": "other"}])
    );
}

/// Whether a container runs without capabilities, privilege escalation or a writable root.
fn locked_down(c: &Value) -> bool {
    let sc = &c["securityContext"];
    sc["readOnlyRootFilesystem"] == true
        && sc["allowPrivilegeEscalation"] == false
        && strs(&sc["capabilities"]["drop"]) == ["ALL"]
}

#[test]
fn pods_get_the_runtime_seccomp_filter_and_containers_lose_what_they_do_not_need() {
    let runtime_default = json!({"seccompProfile": {"type": "RuntimeDefault"}});
    let pod_sc = |w: &Value| w["spec"]["template"]["spec"]["securityContext"].clone();
    let containers = |w: &Value| {
        w["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers")
            .clone()
    };
    for (set, values) in value_sets(CCM_CHART) {
        let docs = template(CCM_CHART, values.as_deref(), &[]);
        let deploy = find(&docs, "Deployment", "harvester-cloud-provider");
        assert_eq!(pod_sc(deploy), runtime_default, "{set}");
        let c = container(deploy, "harvester-cloud-provider");
        assert!(locked_down(c), "{set}: {}", c["securityContext"]);
        if let Some(kv) = docs
            .iter()
            .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "kube-vip")
        {
            assert_eq!(pod_sc(kv), runtime_default, "{set}: kube-vip");
            // Upstream's container securityContext (it announces addresses: NET_ADMIN, NET_RAW).
            assert_eq!(
                strs(&container(kv, "kube-vip")["securityContext"]["capabilities"]["drop"]),
                ["ALL"]
            );
        }
    }
    for (set, values) in value_sets(CSI_CHART) {
        let docs = template(CSI_CHART, values.as_deref(), &[]);
        let ctrl = find(&docs, "Deployment", "harvester-csi-driver-controllers");
        assert_eq!(pod_sc(ctrl), runtime_default, "{set}");
        for c in containers(ctrl) {
            assert!(
                locked_down(&c),
                "{set}: {}: {}",
                c["name"],
                c["securityContext"]
            );
        }
        // The node plugin mounts and formats: privileged, where a filter means nothing; its
        // sidecars only use the socket and registration directories.
        let node = find(&docs, "DaemonSet", "harvester-csi-driver");
        assert_eq!(pod_sc(node), Value::Null, "{set}");
        for c in containers(node) {
            if c["name"] == "harvester-csi-driver" {
                assert_eq!(c["securityContext"], json!({"privileged": true}), "{set}");
            } else {
                assert!(
                    locked_down(&c),
                    "{set}: {}: {}",
                    c["name"],
                    c["securityContext"]
                );
            }
        }
    }

    // A podSecurityContext the user gives is used as it is.
    let mine = json!({"runAsNonRoot": false, "fsGroup": 0});
    let set = format!("podSecurityContext={mine}");
    let docs = template_json(CCM_CHART, &[&set, &format!("kube-vip.{set}")]);
    assert_eq!(
        pod_sc(find(&docs, "Deployment", "harvester-cloud-provider")),
        mine
    );
    assert_eq!(pod_sc(find(&docs, "DaemonSet", "kube-vip")), mine);
    let docs = template_json(CSI_CHART, &[&set]);
    assert_eq!(
        pod_sc(find(
            &docs,
            "Deployment",
            "harvester-csi-driver-controllers"
        )),
        mine
    );
}

/// `helm template` of `chart` (its default-values.yaml) with `--set-json` pairs.
fn template_json(chart: &str, pairs: &[&str]) -> Vec<Value> {
    let text = try_template_with(chart, None, "--set-json", pairs)
        .unwrap_or_else(|e| panic!("{chart} --set-json {pairs:?}: {e}"));
    parse(&text)
}

#[test]
fn csi_chart_passes_extra_args_last_to_the_driver_of_each_mode() {
    let plain = template(CSI_CHART, None, &[]);
    let docs = template(
        CSI_CHART,
        None,
        &[
            "extraArgs.controller={--log-format=json,--metrics-address=:9811}",
            "extraArgs.node={--device-timeout-seconds=60,--debug}",
        ],
    );
    for (kind, name, extra) in [
        (
            "Deployment",
            "harvester-csi-driver-controllers",
            vec!["--log-format=json", "--metrics-address=:9811"],
        ),
        (
            "DaemonSet",
            "harvester-csi-driver",
            vec!["--device-timeout-seconds=60", "--debug"],
        ),
    ] {
        let before = args(container(find(&plain, kind, name), "harvester-csi-driver"));
        let after = args(container(find(&docs, kind, name), "harvester-csi-driver"));
        // The chart's flags unchanged, the user's after them (a repeated flag keeps the last:
        // theirs, as --metrics-address here).
        let mut expected = before.clone();
        expected.extend(extra.iter().map(|s| s.to_string()));
        assert_eq!(after, expected, "{name}");
        // Only the driver's container: the sidecars would refuse the driver's flags.
        for c in find(&docs, kind, name)["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers")
            .iter()
            .filter(|c| c["name"] != "harvester-csi-driver")
        {
            let a = args(c);
            assert!(
                !extra.iter().any(|x| a.contains(&x.to_string())),
                "{name}/{}: {a:?}",
                c["name"]
            );
        }
    }
    // The schema takes lists of strings only.
    let err = try_template(CSI_CHART, None, &["extraArgs.node=--debug"])
        .expect_err("extraArgs.node must be a list");
    assert!(err.contains("extraArgs") && err.contains("schema"), "{err}");
}

/// The long flags `struct Cli` of csi/src/main.rs defines (the binary's CLI is private to it).
fn csi_flags() -> BTreeSet<String> {
    let path = repo().join("csi/src/main.rs");
    let src = std::fs::read_to_string(&path).expect("csi/src/main.rs");
    let body = src
        .split("struct Cli {")
        .nth(1)
        .and_then(|s| s.split("\n}").next())
        .expect("struct Cli in csi/src/main.rs");
    body.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && !l.starts_with('#'))
        .filter_map(|l| l.split_once(':').map(|(f, _)| f.trim()))
        .filter(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .map(|f| f.replace('_', "-"))
        .collect()
}

#[test]
fn csi_chart_passes_only_flags_the_driver_defines() {
    let defined = csi_flags();
    for f in [
        "endpoint",
        "nodeid",
        "kubeconfig",
        "mode",
        "host-storage-class",
    ] {
        assert!(
            defined.contains(f),
            "reading csi/src/main.rs found {defined:?}"
        );
    }
    for (set, values) in value_sets(CSI_CHART) {
        let docs = template(CSI_CHART, values.as_deref(), &[]);
        for workload in [
            find(&docs, "DaemonSet", "harvester-csi-driver"),
            find(&docs, "Deployment", "harvester-csi-driver-controllers"),
        ] {
            for arg in args(container(workload, "harvester-csi-driver")) {
                let flag = arg
                    .trim_start_matches("--")
                    .split('=')
                    .next()
                    .unwrap_or_default()
                    .to_string();
                assert!(
                    defined.contains(&flag),
                    "value set {set}: the chart passes {arg}, which csi/src/main.rs does not define ({defined:?})"
                );
            }
        }
    }
}

#[tokio::test]
async fn every_rendered_object_is_accepted_by_the_api_servers() {
    let bed = bed().await;
    install_snapshot_crds(&bed.guest.client).await;
    let mut refused = Vec::new();
    let mut accepted = 0;
    for chart in [CCM_CHART, CSI_CHART] {
        for (set, values) in value_sets(chart) {
            let docs = template(chart, values.as_deref(), &[]);
            assert!(!docs.is_empty(), "{chart} {set} renders nothing");
            for doc in &docs {
                match apply(&bed.guest.client, doc, RELEASE_NAMESPACE, true).await {
                    Ok(_) => accepted += 1,
                    Err(e) => refused.push(format!("{chart} ({set}): {e}")),
                }
            }
        }
    }
    let mut rbac = harvester_rbac(&bed.vm_namespace, "rke2-prod");
    rbac.extend(csi_node_rbac(&bed.vm_namespace, "rke2-prod-csi-node"));
    for doc in rbac {
        match apply(&bed.harvester.client, &doc, &bed.vm_namespace, true).await {
            Ok(_) => accepted += 1,
            Err(e) => refused.push(format!("deploy/harvester-rbac: {e}")),
        }
    }
    assert!(
        refused.is_empty(),
        "the API servers refused:\n{}",
        refused.join("\n")
    );
    eprintln!("{accepted} objects accepted (server-side apply, dryRun=All)");
}

#[test]
fn kube_vip_takes_the_sub_chart_keys_users_set() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let values = tmp.path().join("kube-vip.yaml");
    std::fs::write(
        &values,
        r#"
kube-vip:
  config: {address: 192.168.10.5}
  env: {cp_enable: "true", vip_interface: enp1s0}
  envFrom: [{secretRef: {name: bgp}}]
  envValueFrom: {bgp_routerid: {fieldRef: {fieldPath: status.podIP}}}
  hostAliases: [{ip: 127.0.0.1, hostnames: [kubernetes]}]
  volumes: [{name: kubeconfig, hostPath: {path: /etc/rancher/k3s/k3s.yaml, type: File}}]
  volumeMounts: [{name: kubeconfig, mountPath: /etc/kubernetes/admin.conf}]
  podSecurityContext: {runAsUser: 0}
  updateStrategy: {rollingUpdate: {maxUnavailable: 2}}
  nameOverride: vip
  namespaceOverride: kube-vip
  serviceAccount: {annotations: {a: b}}
  podMonitor: {enabled: true, labels: {release: prom}}
  priorityClassName: system-node-critical
"#,
    )
    .expect("write");
    let docs = template(CCM_CHART, Some(&values), &[]);
    let ds = find(&docs, "DaemonSet", "vip");
    assert_eq!(ds["metadata"]["namespace"], "kube-vip");
    assert_eq!(
        ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        "vip"
    );
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "vip");
    assert_eq!(pod["securityContext"], json!({"runAsUser": 0}));
    assert_eq!(pod["hostAliases"][0]["ip"], "127.0.0.1");
    assert_eq!(pod["volumes"][0]["name"], "kubeconfig");
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert_eq!(
        ds["spec"]["updateStrategy"],
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2}})
    );
    let c = container(ds, "kube-vip");
    assert_eq!(
        c["volumeMounts"][0]["mountPath"],
        "/etc/kubernetes/admin.conf"
    );
    assert_eq!(c["envFrom"], json!([{"secretRef": {"name": "bgp"}}]));
    let env = c["env"].as_array().expect("env");
    assert_eq!(
        env[0],
        json!({"name": "vip_address", "value": "192.168.10.5"})
    );
    assert!(env.contains(&json!({"name": "bgp_routerid",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})));
    assert!(env.contains(&json!({"name": "vip_interface", "value": "enp1s0"})));
    assert_eq!(
        c["ports"],
        json!([{"name": "monitoring", "containerPort": 2112, "protocol": "TCP"}])
    );
    let pm = find(&docs, "PodMonitor", "vip");
    assert_eq!(pm["metadata"]["labels"]["release"], "prom");
    assert_eq!(
        find(&docs, "ServiceAccount", "vip")["metadata"]["annotations"],
        json!({"a": "b"})
    );
    assert_eq!(
        find(&docs, "ServiceAccount", "vip")["metadata"]["namespace"],
        "kube-vip"
    );
    assert_eq!(
        find(&docs, "ClusterRoleBinding", "vip")["subjects"][0]["namespace"],
        "kube-vip"
    );

    // cp_enable without an address: refused naming the key.
    let err = try_template(CCM_CHART, None, &["kube-vip.env.cp_enable=true"])
        .expect_err("cp_enable without config.address must not render");
    assert!(err.contains("kube-vip.config.address"), "{err}");
}
