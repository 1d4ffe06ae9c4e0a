//! Shared by the deployment suites (`deploy_charts.rs`, `deploy_rbac*.rs`): helm (built by
//! tests/scripts/tools.sh), the charts and value sets in deploy/, rendered documents, and
//! server-side apply of them.

use std::path::{Path, PathBuf};
use std::process::Command;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};
use serde_json::{Value, json};

pub const CCM_CHART: &str = "harvester-cloud-provider";
pub const CSI_CHART: &str = "harvester-csi-driver";
/// Where the Rancher node driver and the docs install both charts.
pub const RELEASE_NAMESPACE: &str = "kube-system";

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

pub fn chart_dir(chart: &str) -> PathBuf {
    repo().join("deploy/charts").join(chart)
}

/// helm, or a panic that says how to build it.
pub fn helm() -> PathBuf {
    crate::util::tools::tool("helm")
        .unwrap_or_else(|e| panic!("this test needs helm: {e} (`make test` builds it)"))
}

/// `ci/default-values.yaml`: values.yaml's defaults plus the one value every install sets, our
/// image (the charts have no default for it and refuse to render without it).
pub fn default_values(chart: &str) -> PathBuf {
    chart_dir(chart).join("ci/default-values.yaml")
}

/// A chart's value sets: every `ci/*-values.yaml` (`default-values.yaml` first: values.yaml's
/// defaults and the image).
pub fn value_sets(chart: &str) -> Vec<(String, Option<PathBuf>)> {
    let mut sets = Vec::new();
    let dir = chart_dir(chart).join("ci");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.to_string_lossy().ends_with("-values.yaml"))
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "{} holds no *-values.yaml",
        dir.display()
    );
    for f in files {
        let name = f
            .file_name()
            .expect("file name")
            .to_string_lossy()
            .to_string();
        sets.push((name, Some(f)));
    }
    sets
}

/// Runs helm with `args`; Ok(stdout) or Err(stderr).
pub fn run_helm(args: &[&str]) -> Result<String, String> {
    let out = Command::new(helm())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running helm: {e}"));
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// `helm template` of `chart` as release `chart` in kube-system, with [`default_values`] (the
/// image), then a values file and `--set` pairs; Err(helm's message) when rendering fails.
pub fn try_template(chart: &str, values: Option<&Path>, set: &[&str]) -> Result<String, String> {
    try_template_with(chart, values, "--set", set)
}

/// [`try_template`] with each of `pairs` given after `flag` (`--set`, `--set-json`, ...).
pub fn try_template_with(
    chart: &str,
    values: Option<&Path>,
    flag: &str,
    pairs: &[&str],
) -> Result<String, String> {
    let dir = chart_dir(chart);
    let dir = dir.to_string_lossy();
    let defaults = default_values(chart).to_string_lossy().to_string();
    let mut args = vec![
        "template",
        chart,
        &dir,
        "--namespace",
        RELEASE_NAMESPACE,
        "--values",
        &defaults,
    ];
    let values = values.map(|v| v.to_string_lossy().to_string());
    if let Some(v) = &values {
        args.extend(["--values", v]);
    }
    for p in pairs {
        args.extend([flag, p]);
    }
    run_helm(&args)
}

/// The documents `helm template` renders (see [`try_template`]); panics when it fails.
pub fn template(chart: &str, values: Option<&Path>, set: &[&str]) -> Vec<Value> {
    let text = try_template(chart, values, set)
        .unwrap_or_else(|e| panic!("helm template {chart} {values:?} {set:?} failed:\n{e}"));
    parse(&text)
}

/// The non-empty documents of a multi-document YAML text.
pub fn parse(yaml: &str) -> Vec<Value> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(yaml).unwrap_or_else(|e| panic!("parsing YAML: {e}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

/// The document of `kind` named `name`.
pub fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} among {:?}", kinds(docs)))
}

/// `Kind/name` of every document, for messages.
pub fn kinds(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap_or("?"),
                d["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

/// The container `name` of a workload document.
pub fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name} in {}", workload["metadata"]["name"]))
}

/// A container's args as strings.
pub fn args(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().expect("string arg").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The deploy/harvester-rbac manifests with the bindings' variables filled in.
pub fn harvester_rbac(namespace: &str, service_account: &str) -> Vec<Value> {
    harvester_rbac_files(
        &["cloud-provider.yaml", "csi-driver.yaml", "bindings.yaml"],
        namespace,
        service_account,
    )
}

/// The CSI node plugin's own read-only roles and their binding to `service_account`.
pub fn csi_node_rbac(namespace: &str, service_account: &str) -> Vec<Value> {
    harvester_rbac_files(
        &["csi-node.yaml", "csi-node-binding.yaml"],
        namespace,
        service_account,
    )
}

fn harvester_rbac_files(files: &[&str], namespace: &str, service_account: &str) -> Vec<Value> {
    let dir = repo().join("deploy/harvester-rbac");
    let mut docs = Vec::new();
    for file in files {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
            .replace("${NAMESPACE}", namespace)
            .replace("${SERVICE_ACCOUNT}", service_account);
        docs.extend(parse(&text));
    }
    docs
}

/// Whether a binding (or any document) refers to ClusterRole `role`.
pub fn refers_to(doc: &Value, role: &str) -> bool {
    doc["roleRef"]["name"] == role
}

/// Server-side apply of `doc` (force, field manager `testbed`); `dry_run` sends dryRun=All,
/// so the API server validates and admits the object without storing it.
pub async fn apply(
    client: &kube::Client,
    doc: &Value,
    default_ns: &str,
    dry_run: bool,
) -> Result<DynamicObject, String> {
    let what = format!(
        "{} {}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    );
    let obj: DynamicObject =
        serde_json::from_value(doc.clone()).map_err(|e| format!("{what}: not an object: {e}"))?;
    let types = obj
        .types
        .as_ref()
        .ok_or_else(|| format!("{what}: no apiVersion/kind"))?;
    let gvk = GroupVersionKind::try_from(types).map_err(|e| format!("{what}: {e}"))?;
    let (resource, caps) = pinned_kind(client, &gvk)
        .await
        .map_err(|e| format!("{what}: discovering {gvk:?}: {e}"))?;
    let name = obj
        .metadata
        .name
        .clone()
        .ok_or_else(|| format!("{what}: no name"))?;
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Cluster => Api::all_with(client.clone(), &resource),
        Scope::Namespaced => Api::namespaced_with(
            client.clone(),
            obj.metadata.namespace.as_deref().unwrap_or(default_ns),
            &resource,
        ),
    };
    let mut params = PatchParams::apply(crate::bed::apply::FIELD_MANAGER).force();
    if dry_run {
        params = params.dry_run();
    }
    api.patch(&name, &params, &Patch::Apply(doc))
        .await
        .map_err(|e| format!("{what}: {e}"))
}

/// Applies every document for real; panics naming the first one refused.
pub async fn apply_all(client: &kube::Client, docs: &[Value], default_ns: &str) {
    for doc in docs {
        if let Err(e) = apply(client, doc, default_ns, false).await {
            panic!("applying {e}");
        }
    }
}

// ---- running a program with exactly the RBAC of the charts and deploy/harvester-rbac ----

/// The guest cluster's name in the RBAC proofs (also the Harvester ServiceAccount's name, as
/// the node driver names it after the cluster).
pub const CLUSTER: &str = "guest-1";
/// The chart's ServiceAccount (kube-system/harvester-cloud-provider).
pub const CCM_SA: &str = "harvester-cloud-provider";
/// ClusterRole name prefixes of deploy/harvester-rbac.
pub const HARVESTER_CCM_ROLES: &str = "harvester-guest-cloud-provider";
pub const HARVESTER_CSI_ROLES: &str = "harvester-guest-csi-driver";

/// The cloud provider chart as the RBAC proofs install it (default values, a cluster name).
pub fn ccm_chart() -> Vec<Value> {
    template(CCM_CHART, None, &[&format!("clusterName={CLUSTER}")])
}

/// deploy/harvester-rbac for one program: the ServiceAccount, the ClusterRoles whose names start
/// with `roles`, and the bindings to them.
pub fn harvester_rbac_of(namespace: &str, roles: &str) -> Vec<Value> {
    let docs: Vec<Value> = harvester_rbac(namespace, CLUSTER)
        .into_iter()
        .filter(|d| {
            d["kind"] == "ServiceAccount"
                || (d["kind"] == "ClusterRole"
                    && d["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.starts_with(roles)))
                || d["roleRef"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(roles))
        })
        .collect();
    assert!(
        docs.iter().any(|d| d["kind"] == "ClusterRole")
            && docs.iter().any(|d| d["kind"] == "RoleBinding"),
        "deploy/harvester-rbac has no roles {roles}*: {:?}",
        kinds(&docs)
    );
    docs
}

/// Takes `verb` on `group`/`resource` away from role `kind`/`name` (other resources of the same
/// rule keep it). Panics when the role did not grant it, so a test cannot revoke nothing.
pub fn revoke(docs: &mut [Value], kind: &str, name: &str, group: &str, resource: &str, verb: &str) {
    let role = docs
        .iter_mut()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"));
    let rules = role["rules"].as_array_mut().expect("rules");
    let mut kept = Vec::new();
    let mut found = false;
    for mut rule in rules.drain(..) {
        let has = |key: &str, v: &str| {
            rule[key]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == v))
        };
        if has("apiGroups", group) && has("resources", resource) && has("verbs", verb) {
            found = true;
            let mut rest = rule.clone();
            rest["resources"] = json!([resource]);
            rest["verbs"] = json!(
                rule["verbs"]
                    .as_array()
                    .expect("verbs")
                    .iter()
                    .filter(|v| *v != verb)
                    .cloned()
                    .collect::<Vec<_>>()
            );
            let others: Vec<Value> = rule["resources"]
                .as_array()
                .expect("resources")
                .iter()
                .filter(|r| *r != resource)
                .cloned()
                .collect();
            if !others.is_empty() {
                rule["resources"] = json!(others);
                kept.push(rule);
            }
            if rest["verbs"].as_array().is_some_and(|v| !v.is_empty()) {
                kept.push(rest);
            }
        } else {
            kept.push(rule);
        }
    }
    *rules = kept;
    assert!(
        found,
        "{kind} {name} does not grant {verb} on {group}/{resource}"
    );
}

/// The API server's built-in ClusterRole for delegated authn/authz (TokenReview,
/// SubjectAccessReview), which the cloud provider chart binds.
const AUTH_DELEGATOR: &str = "system:auth-delegator";

/// Waits until every binding in `docs` of ServiceAccount `namespace/name` is in force for
/// `client` (that account's client): the first rule of each bound role is allowed.
pub async fn wait_bindings(client: &kube::Client, docs: &[Value], namespace: &str, name: &str) {
    for binding in docs
        .iter()
        .filter(|d| d["kind"] == "RoleBinding" || d["kind"] == "ClusterRoleBinding")
    {
        let ours = binding["subjects"].as_array().is_some_and(|s| {
            s.iter().any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == name && s["namespace"] == namespace
            })
        });
        if !ours {
            continue;
        }
        let role_name = binding["roleRef"]["name"].as_str().expect("roleRef.name");
        if role_name == AUTH_DELEGATOR {
            // Built in (bootstrap RBAC policy), not in the chart: its first rule.
            let access = crate::bed::rbac::Access {
                verb: "create",
                group: "authentication.k8s.io",
                resource: "tokenreviews",
                ..Default::default()
            };
            crate::bed::rbac::wait_allowed(client, &access)
                .await
                .unwrap_or_else(|e| panic!("binding {role_name}: {e}"));
            continue;
        }
        let role = find(
            docs,
            binding["roleRef"]["kind"].as_str().expect("roleRef.kind"),
            role_name,
        );
        // A role emptied by `revoke` grants nothing to wait for.
        let Some(rule) = role["rules"].as_array().and_then(|r| r.first()) else {
            continue;
        };
        let resource = rule["resources"][0].as_str().expect("resource");
        let (resource, subresource) = match resource.split_once('/') {
            Some((r, s)) => (r, Some(s)),
            None => (resource, None),
        };
        let access = crate::bed::rbac::Access {
            verb: rule["verbs"][0].as_str().expect("verb"),
            group: rule["apiGroups"][0].as_str().expect("group"),
            resource,
            subresource,
            namespace: (binding["kind"] == "RoleBinding").then(|| {
                binding["metadata"]["namespace"]
                    .as_str()
                    .expect("namespace")
            }),
            name: rule["resourceNames"][0].as_str(),
        };
        crate::bed::rbac::wait_allowed(client, &access)
            .await
            .unwrap_or_else(|e| panic!("binding {role_name}: {e}"));
    }
}

/// The identities a program runs with: a guest kubeconfig and a cloud-config, each holding a
/// ServiceAccount token, and clients of both accounts.
pub struct Accounts {
    pub guest_kubeconfig: PathBuf,
    pub cloud_config: PathBuf,
    pub guest: Option<kube::Client>,
    pub harvester: kube::Client,
}

/// Applies `guest_docs` (a rendered chart; skipped when empty) to the guest and `harvester_docs`
/// (deploy/harvester-rbac) to Harvester for real, mints tokens for the chart's ServiceAccount
/// `guest_sa` (in kube-system) and for the Harvester ServiceAccount [`CLUSTER`] in the VM
/// namespace, writes them as kubeconfigs, and waits until every binding is in force.
pub async fn accounts(
    bed: &crate::TestBed,
    guest_docs: &[Value],
    guest_sa: Option<&str>,
    harvester_docs: &[Value],
) -> Accounts {
    apply_all(&bed.guest.client, guest_docs, RELEASE_NAMESPACE).await;
    apply_all(&bed.harvester.client, harvester_docs, &bed.vm_namespace).await;
    let dir = bed.dir.path();
    let guest_kubeconfig = dir.join("guest-sa.kubeconfig");
    let guest = match guest_sa {
        Some(sa) => {
            let access = crate::bed::rbac::account_kubeconfig(
                &bed.guest.client,
                &bed.guest.url,
                &bed.pki,
                (RELEASE_NAMESPACE, sa),
                "default",
                &guest_kubeconfig,
            )
            .await
            .unwrap_or_else(|e| panic!("guest ServiceAccount {sa}: {e}"));
            wait_bindings(&access.client, guest_docs, RELEASE_NAMESPACE, sa).await;
            Some(access.client)
        }
        None => None,
    };
    let cloud_config = dir.join("cloud-config-sa");
    let harvester = crate::bed::rbac::account_kubeconfig(
        &bed.harvester.client,
        &bed.harvester.url,
        &bed.pki,
        (&bed.vm_namespace, CLUSTER),
        &bed.vm_namespace,
        &cloud_config,
    )
    .await
    .unwrap_or_else(|e| panic!("Harvester ServiceAccount {CLUSTER}: {e}"));
    wait_bindings(
        &harvester.client,
        harvester_docs,
        &bed.vm_namespace,
        CLUSTER,
    )
    .await;
    Accounts {
        guest_kubeconfig,
        cloud_config,
        guest,
        harvester: harvester.client,
    }
}

/// The cloud provider's command line as the chart's Deployment gives it, with the cloud-config
/// and guest kubeconfig of `accounts` in place of the in-cluster ones.
pub fn ccm_args(chart: &[Value], accounts: &Accounts) -> Vec<String> {
    let c = container(
        find(chart, "Deployment", "harvester-cloud-provider"),
        "harvester-cloud-provider",
    );
    let mut argv: Vec<String> = c["command"]
        .as_array()
        .expect("command")
        .iter()
        .map(|v| v.as_str().expect("command word").to_string())
        .collect();
    for a in args(c) {
        if a.starts_with("--cloud-config=") {
            argv.push(format!(
                "--cloud-config={}",
                accounts.cloud_config.display()
            ));
        } else {
            argv.push(a);
        }
    }
    argv.push(format!(
        "--kubeconfig={}",
        accounts.guest_kubeconfig.display()
    ));
    argv
}

/// Forbidden answers so far on both API servers (see `crate::bed::rbac::refusals`).
pub async fn refusals(bed: &crate::TestBed) -> (u64, u64) {
    let guest = crate::bed::rbac::refusals(&bed.guest.client)
        .await
        .unwrap_or_else(|e| panic!("guest metrics: {e}"));
    let harvester = crate::bed::rbac::refusals(&bed.harvester.client)
        .await
        .unwrap_or_else(|e| panic!("Harvester metrics: {e}"));
    (guest, harvester)
}

// ---- helm against the test bed's guest API server ----

/// A test bed for the deployment suites; fails the test when it cannot start.
pub async fn bed() -> crate::TestBed {
    crate::TestBed::started().await
}

/// The guest cluster of RKE2 has the snapshot CRDs (rke2-snapshot-controller-crd); install the
/// bed's copy so the VolumeSnapshotClass can be validated.
pub async fn install_snapshot_crds(client: &kube::Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let path = repo().join("tests/crds/snapshot.yaml");
    let text = std::fs::read_to_string(&path).expect("tests/crds/snapshot.yaml");
    let mut names = Vec::new();
    for doc in parse(&text) {
        names.push(doc["metadata"]["name"].as_str().expect("name").to_string());
        apply(client, &doc, "default", false)
            .await
            .unwrap_or_else(|e| panic!("installing snapshot CRDs: {e}"));
    }
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in names {
        crate::util::wait::until(
            &format!("CRD {name} established"),
            std::time::Duration::from_secs(30),
            || {
                let crds = crds.clone();
                let name = name.clone();
                async move {
                    let crd = crds.get(&name).await.map_err(|e| e.to_string())?;
                    let ok = crd
                        .status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True");
                    Ok(if ok { Ok(()) } else { Err(name) })
                }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// helm with the bed's guest admin kubeconfig (see [`crate::util::helm::Helm`]).
pub struct BedHelm(crate::util::helm::Helm);

impl BedHelm {
    pub fn new(bed: &crate::TestBed) -> Self {
        let home = bed.dir.path().join("helm");
        std::fs::create_dir_all(&home).unwrap_or_else(|e| panic!("{}: {e}", home.display()));
        BedHelm(crate::util::helm::Helm {
            kubeconfig: bed.guest.kubeconfig.clone(),
            home,
        })
    }

    /// Runs helm with `args`; Ok(stdout) or Err(the command and helm's output).
    pub fn run(&self, args: &[&str]) -> Result<String, String> {
        self.0.run(args)
    }

    /// Like [`BedHelm::run`], panicking with helm's output on failure.
    pub fn ok(&self, args: &[&str]) -> String {
        self.run(args).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The fixture chart standing in for upstream's `chart` (tests/fixtures/upstream-<chart>).
pub fn fixture_dir(chart: &str) -> PathBuf {
    repo()
        .join("tests/fixtures")
        .join(format!("upstream-{chart}"))
}
