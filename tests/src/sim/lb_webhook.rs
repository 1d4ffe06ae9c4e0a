//! Harvester's LoadBalancer mutating webhook, as a real admission webhook of the bed's Harvester
//! kube-apiserver: served by the bed's [`WebhookServer`](super::webhook) at [`PATH`], registered
//! by a MutatingWebhookConfiguration with `clientConfig.url`, called by the API server on every
//! CREATE and UPDATE of `loadbalancers.loadbalancer.harvesterhci.io`, answering with a JSONPatch.
//!
//! The mutations are those of harvester/load-balancer-harvester
//! `pkg/webhook/loadbalancer/mutator.go`, in two rule sets ([`Rules`]):
//! - [`Rules::Legacy`]: tags v1.7.0 to v1.8.2 (v1.8.2 = dd5899ef; the mutator did not change
//!   between v1.7.3 and v1.8.2 but for an import);
//! - [`Rules::V1_9`]: tag v1.9.0-rc4 (32015ecc), unchanged at the branch head e861dc94.
//!
//! The registration follows the vendored harvester/webhook v0.1.5
//! (`pkg/server/server.go` `mutatingWebhookConfiguration`, `buildRules`): path
//! `/v1/webhook/mutation`, `failurePolicy: Ignore`, `sideEffects: None`, admission review
//! versions v1 and v1beta1, one rule for the mutator's resource (group, version `v1beta1`,
//! `loadbalancers`, Namespaced, CREATE and UPDATE). A refusal is upstream's `admission.go`:
//! `allowed: false` with an InternalError status (code 500) carrying the mutator's error.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

use super::cache::Cache;
use super::webhook::{Refusal, Registration, Rule, Verdict, WebhookServer, handler};
use crate::bed::certs::Pki;
use crate::{BedError, util::wait};

/// Where upstream's webhook server serves its mutators (harvester/webhook `server.go`).
pub const PATH: &str = "/v1/webhook/mutation";
/// The MutatingWebhookConfiguration's name: the webhook server's name (load-balancer-harvester
/// `cmd/webhook/main.go`).
pub const CONFIG_NAME: &str = "harvester-load-balancer-webhook";
/// The one webhook in it: `mutator.<namespace>.<name>` (harvester/webhook `server.go`).
pub const WEBHOOK_NAME: &str = "mutator.harvester-system.harvester-load-balancer-webhook";

pub const ANN_NAMESPACE: &str = "loadbalancer.harvesterhci.io/namespace";
pub const ANN_PROJECT: &str = "loadbalancer.harvesterhci.io/project";
pub const ANN_NETWORK: &str = "loadbalancer.harvesterhci.io/network";
pub const ANN_CLUSTER: &str = "loadbalancer.harvesterhci.io/cluster";
/// `utils.AnnotationKeyGuestClusterManagementNetworkOnLB` (v1.9 `pkg/utils/const.go`).
pub const ANN_MANAGEMENT_NETWORK: &str = "cloudprovider.harvesterhci.io/managementNetwork";
/// rancher's `project.ProjectIDAnn`, read from the LoadBalancer's Namespace.
pub const ANN_PROJECT_ID: &str = "field.cattle.io/projectId";
/// `utils.LabelKeyGuestClusterNameOnVM` (v1.9).
pub const LABEL_GUEST_CLUSTER: &str = "guestcluster.harvesterhci.io/name";
/// `utils.LabelKeyHarvesterCreator` = `utils.GuestClusterHarvesterNodeDriver`.
pub const LABEL_CREATOR: &str = "harvesterhci.io/creator";
pub const NODE_DRIVER: &str = "docker-machine-driver-harvester";

/// Which upstream release's mutator the bed plays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rules {
    /// v1.7.0-v1.8.2: every non-`vm` LB (an empty workloadType too) gets namespace, project and a
    /// network that is always re-derived from the node-driver VMIs (a value already on the LB is
    /// overwritten).
    Legacy,
    /// v1.9.0-rc4: `vm` and empty workloadType get the namespace only; `cluster` gets namespace,
    /// project and the network: the existing value, else the management network annotation, else
    /// VMIs labelled with the guest cluster's name, else the legacy node-driver match, else "".
    #[default]
    V1_9,
}

impl Rules {
    /// `TESTBED_LB_WEBHOOK=v1.8|v1.9` (default v1.9).
    pub fn from_env() -> Rules {
        match std::env::var("TESTBED_LB_WEBHOOK").as_deref() {
            Err(_) | Ok("") | Ok("v1.9") => Rules::V1_9,
            Ok("v1.8") | Ok("v1.7") => Rules::Legacy,
            Ok(other) => panic!("TESTBED_LB_WEBHOOK={other:?}: expected \"v1.8\" or \"v1.9\""),
        }
    }
}

/// One VMI as the mutator sees it: its name and, in order, the `networkName` of each network
/// with a `multus` source (`""` when the source names none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vmi {
    pub name: String,
    pub multus: Vec<String>,
}

impl Vmi {
    fn from_object(obj: &DynamicObject) -> Vmi {
        let multus = obj
            .data
            .pointer("/spec/networks")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|n| n.get("multus").filter(|m| m.is_object()))
            .map(|m| {
                m.get("networkName")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        Vmi {
            name: obj.metadata.name.clone().unwrap_or_default(),
            multus,
        }
    }
}

/// What the mutator reads besides the object (upstream: its Namespace and VMI caches). `Err` is
/// the lookup's own error text.
#[derive(Clone, Debug)]
pub struct Facts {
    /// The Namespace's annotations.
    pub namespace: Result<BTreeMap<String, String>, String>,
    /// VMIs of the LB's namespace labelled `guestcluster.harvesterhci.io/name=<cluster>`.
    pub by_cluster_name: Result<Vec<Vmi>, String>,
    /// VMIs of the LB's namespace labelled `harvesterhci.io/creator=docker-machine-driver-harvester`.
    pub by_creator: Result<Vec<Vmi>, String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
    Other,
}

impl Operation {
    fn parse(s: &str) -> Operation {
        match s {
            "CREATE" => Operation::Create,
            "UPDATE" => Operation::Update,
            _ => Operation::Other,
        }
    }
}

fn annotations(lb: &Value) -> Option<BTreeMap<String, String>> {
    let map = lb.pointer("/metadata/annotations")?.as_object()?;
    Some(
        map.iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
            .collect(),
    )
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// The JSONPatch the mutator answers for `op` of `lb` (a LoadBalancer as the API server sends
/// it); empty: no patch. `Err`: the request is refused with that message.
pub fn mutate(
    rules: Rules,
    op: Operation,
    lb: &Value,
    facts: &Facts,
) -> Result<Vec<Value>, String> {
    match op {
        Operation::Create => {}
        // mutator.go `Update`: an LB being deleted is left alone.
        Operation::Update => {
            if lb
                .pointer("/metadata/deletionTimestamp")
                .is_some_and(|t| !t.is_null())
            {
                return Ok(Vec::new());
            }
        }
        // DefaultMutator: nothing for other operations.
        Operation::Other => return Ok(Vec::new()),
    }
    // mutator.go `Create`/`Update`: the annotations patch, then the health-check patch.
    let mut patch = annotations_patch(rules, lb, facts)?;
    patch.extend(health_check_patch(lb)?);
    Ok(patch)
}

/// mutator.go `getAnnotationsPatch`: v1.9 sends `vm` and an empty workloadType to the VM branch;
/// v1.7-v1.8 only `vm`.
fn annotations_patch(rules: Rules, lb: &Value, facts: &Facts) -> Result<Vec<Value>, String> {
    let workload = str_at(lb, "/spec/workloadType");
    let vm_branch = match rules {
        Rules::V1_9 => workload == "vm" || workload.is_empty(),
        Rules::Legacy => workload == "vm",
    };
    if vm_branch {
        return Ok(vm_patch(lb));
    }
    // v1.9 `getAnnotationsPatchCluster`: only `cluster` is mutated.
    if rules == Rules::V1_9 && workload != "cluster" {
        return Ok(Vec::new());
    }
    let namespace = str_at(lb, "/metadata/namespace");
    let project = find_project(namespace, facts)?;
    let network = match rules {
        Rules::V1_9 => find_network_v1_9(lb, facts)?,
        Rules::Legacy => {
            // v1.8.2 `getAnnotationsPatchCluster`: the network is looked up only for `cluster`
            // LBs with a cluster annotation, and replaces any value already there.
            let cluster = annotations(lb)
                .and_then(|a| a.get(ANN_CLUSTER).cloned())
                .unwrap_or_default();
            if workload == "cluster" && !cluster.is_empty() {
                let vmis = facts
                    .by_creator
                    .as_ref()
                    .map_err(|e| format!("list vmis failed, error: {e}"))?;
                legacy_network(vmis, &cluster, Rules::Legacy).unwrap_or_default()
            } else {
                String::new()
            }
        }
    };
    let mut ann = annotations(lb).unwrap_or_default();
    ann.insert(ANN_NAMESPACE.into(), namespace.into());
    ann.insert(ANN_PROJECT.into(), project);
    ann.insert(ANN_NETWORK.into(), network);
    Ok(vec![replace_annotations(ann)])
}

/// `getAnnotationsPatchVM`: the namespace annotation only, unless it is already right.
fn vm_patch(lb: &Value) -> Vec<Value> {
    let namespace = str_at(lb, "/metadata/namespace");
    let mut ann = annotations(lb).unwrap_or_default();
    if ann.get(ANN_NAMESPACE).map(String::as_str) == Some(namespace) {
        return Vec::new();
    }
    ann.insert(ANN_NAMESPACE.into(), namespace.into());
    vec![replace_annotations(ann)]
}

/// Upstream replaces the whole map (`PatchOpReplace` on `/metadata/annotations`), also on an
/// object without annotations (the API server's json-patch v4 then adds the key).
fn replace_annotations(ann: BTreeMap<String, String>) -> Value {
    json!({"op": "replace", "path": "/metadata/annotations", "value": ann})
}

/// `findProject`: the Namespace's `field.cattle.io/projectId` with its first `:` turned into
/// `/` (`strings.Replace(..., ":", "/", 1)`), or "" without one.
fn find_project(namespace: &str, facts: &Facts) -> Result<String, String> {
    let ann = facts
        .namespace
        .as_ref()
        .map_err(|e| format!("get namespace {namespace} failed, error: {e}"))?;
    Ok(ann
        .get(ANN_PROJECT_ID)
        .map(|p| p.replacen(':', "/", 1))
        .unwrap_or_default())
}

/// v1.9.0-rc4 `findNetwork`, in its order.
fn find_network_v1_9(lb: &Value, facts: &Facts) -> Result<String, String> {
    let ann = annotations(lb).unwrap_or_default();
    let get = |k: &str| ann.get(k).cloned().unwrap_or_default();
    // 1. the network the cloud provider sent, kept.
    let net = get(ANN_NETWORK);
    if !net.is_empty() {
        return Ok(net);
    }
    // 2. the guest cluster's management network.
    let net = get(ANN_MANAGEMENT_NETWORK);
    if !net.is_empty() {
        return Ok(net);
    }
    // Without the cluster annotation no discovery: "" (admitted, not refused).
    let cluster = get(ANN_CLUSTER);
    if cluster.is_empty() {
        return Ok(String::new());
    }
    // 3. the first Multus network (non-empty name) of the VMIs labelled with the cluster name.
    let named = facts
        .by_cluster_name
        .as_ref()
        .map_err(|e| format!("list vmis with guest cluster name {cluster} selector failed: {e}"))?;
    if let Some(n) = named.iter().find_map(|v| first_multus(v, Rules::V1_9)) {
        return Ok(n);
    }
    // 4. legacy: node-driver VMIs whose name starts with the cluster name.
    let created = facts
        .by_creator
        .as_ref()
        .map_err(|e| format!("list vmis with creator selector failed: {e}"))?;
    Ok(legacy_network(created, &cluster, Rules::V1_9).unwrap_or_default())
}

/// The first VMI whose name starts with `cluster` that has a Multus network: its first one.
fn legacy_network(vmis: &[Vmi], cluster: &str, rules: Rules) -> Option<String> {
    vmis.iter()
        .filter(|v| v.name.starts_with(cluster))
        .find_map(|v| first_multus(v, rules))
}

/// v1.8.2 takes the first Multus source even with an empty `networkName` (returning ""); v1.9
/// (`getFirstMultusNetworkNameFromVMI`) skips those.
fn first_multus(vmi: &Vmi, rules: Rules) -> Option<String> {
    match rules {
        Rules::Legacy => vmi.multus.first().cloned(),
        Rules::V1_9 => vmi.multus.iter().find(|n| !n.is_empty()).cloned(),
    }
}

/// `getHealthyCheckPatch`: a health check with a port gets 0 thresholds/periods raised to
/// upstream's defaults (success 2, failure 2, period 1, timeout 1), the whole `HealthCheck`
/// struct replaced (its fields are `omitempty` uints, so unknown fields are dropped).
fn health_check_patch(lb: &Value) -> Result<Vec<Value>, String> {
    let Some(hc) = lb.pointer("/spec/healthCheck").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let field = |k: &str| -> Result<u64, String> {
        match hc.get(k) {
            None | Some(Value::Null) => Ok(0),
            Some(v) => v.as_u64().ok_or_else(|| {
                format!("cannot decode spec.healthCheck.{k} {v} as an unsigned integer")
            }),
        }
    };
    let port = field("port")?;
    if port == 0 {
        return Ok(Vec::new());
    }
    let mut out = serde_json::Map::new();
    out.insert("port".into(), port.into());
    let mut patched = false;
    for (k, default) in [
        ("successThreshold", 2u64),
        ("failureThreshold", 2),
        ("periodSeconds", 1),
        ("timeoutSeconds", 1),
    ] {
        let mut v = field(k)?;
        if v == 0 {
            v = default;
            patched = true;
        }
        out.insert(k.into(), v.into());
    }
    Ok(if patched {
        vec![json!({"op": "replace", "path": "/spec/healthCheck", "value": out})]
    } else {
        Vec::new()
    })
}

/// What the mutator's answer is on the wire: a JSONPatch, or upstream's `admission.go` refusal
/// of a plain error (500 InternalError carrying the mutator's message).
pub fn verdict(answer: Result<Vec<Value>, String>) -> Verdict {
    match answer {
        Ok(patch) => Verdict::Patch(patch),
        Err(message) => Verdict::Refuse(Refusal::internal(message)),
    }
}

/// Harvester's LB mutator, served by the bed's [`WebhookServer`] at [`PATH`].
pub struct LbWebhook {
    pub rules: Rules,
    /// Admission requests answered (any outcome), for tests that want to see it was called.
    pub calls: Arc<std::sync::atomic::AtomicUsize>,
    /// UPDATEs whose client tried to change a key the webhook owns (namespace, project, network
    /// differing from the stored object's before mutation): `(fieldManager, LoadBalancer name)`.
    pub owned_key_writes: Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

impl LbWebhook {
    /// [`LbWebhook::owned_key_writes`] of field manager `manager`.
    pub fn owned_key_writes_by(&self, manager: &str) -> Vec<String> {
        self.owned_key_writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(m, _)| m == manager)
            .map(|(_, name)| name.clone())
            .collect()
    }
}

/// Whether an UPDATE from `old` to `new` (as the client sent it) changes a key the webhook owns.
pub fn changes_owned_key(old: &Value, new: &Value) -> bool {
    let (old, new) = (
        annotations(old).unwrap_or_default(),
        annotations(new).unwrap_or_default(),
    );
    [ANN_NAMESPACE, ANN_PROJECT, ANN_NETWORK]
        .iter()
        .any(|k| old.get(*k) != new.get(*k))
}

struct Ctx {
    /// Upstream's namespaceCache and vmiCache.
    namespaces: Cache,
    vmis: Cache,
    rules: Rules,
    calls: Arc<std::sync::atomic::AtomicUsize>,
    owned_key_writes: Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

/// The MutatingWebhookConfiguration upstream's webhook server registers for the mutator.
pub fn registration() -> Registration {
    Registration::mutating(
        CONFIG_NAME,
        WEBHOOK_NAME,
        PATH,
        vec![Rule::new(
            &["CREATE", "UPDATE"],
            "loadbalancer.harvesterhci.io",
            "v1beta1",
            "loadbalancers",
            "Namespaced",
        )],
    )
}

impl LbWebhook {
    /// Routes the mutator at [`PATH`] of `server`; `client` is the Harvester admin client it
    /// watches Namespaces and VMIs with (on the current runtime, as long as the route lives).
    pub fn install(server: &WebhookServer, client: kube::Client, rules: Rules) -> LbWebhook {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let owned_key_writes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let ctx = Arc::new(Ctx {
            namespaces: Cache::start(client.clone(), &ApiResource::erase::<Namespace>(&())),
            vmis: Cache::start(client, &vmi_resource()),
            rules,
            calls: calls.clone(),
            owned_key_writes: owned_key_writes.clone(),
        });
        server.route(
            PATH,
            handler(move |request| {
                let ctx = ctx.clone();
                async move { handle(request, &ctx).await }
            }),
        );
        LbWebhook {
            rules,
            calls,
            owned_key_writes,
        }
    }

    /// Registers the webhook with the API server (`clientConfig.url`, `caBundle` = the webhook's
    /// CA) and waits until the API server calls it: a dry-run create comes back mutated.
    pub async fn register(
        &self,
        server: &WebhookServer,
        client: &kube::Client,
        pki: &Pki,
        namespace: &str,
    ) -> Result<(), BedError> {
        server.register(client, pki, &registration()).await?;
        wait_called(client, namespace).await
    }
}

/// Waits until a dry-run create of a `vm` LoadBalancer in `namespace` comes back with the
/// namespace annotation: the API server has the configuration and reaches the webhook.
pub async fn wait_called(client: &kube::Client, namespace: &str) -> Result<(), BedError> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &loadbalancer_resource());
    let probe: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": "testbed-webhook-probe", "annotations": {"testbed": "probe"}},
        "spec": {"workloadType": "vm", "ipam": "pool",
                 "listeners": [{"name": "probe", "port": 80, "protocol": "TCP", "backendPort": 80}]}
    }))
    .map_err(|e| BedError::Setup(format!("LB webhook probe: {e}")))?;
    let params = PostParams {
        dry_run: true,
        ..Default::default()
    };
    wait::until(
        "the Harvester API server calls the LoadBalancer webhook",
        Duration::from_secs(30),
        || {
            let (api, probe, params) = (api.clone(), probe.clone(), params.clone());
            async move {
                let made = api
                    .create(&params, &probe)
                    .await
                    .map_err(|e| e.to_string())?;
                let ns = made.metadata.annotations.unwrap_or_default();
                Ok(if ns.contains_key(ANN_NAMESPACE) {
                    Ok(())
                } else {
                    Err(ns)
                })
            }
        },
    )
    .await
    .map_err(BedError::Setup)
}

pub fn loadbalancer_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("loadbalancer.harvesterhci.io", "v1beta1", "LoadBalancer"),
        "loadbalancers",
    )
}

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

async fn handle(request: Value, ctx: &Ctx) -> Verdict {
    ctx.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let op = Operation::parse(str_at(&request, "/operation"));
    let lb = request.get("object").cloned().unwrap_or(Value::Null);
    if op == Operation::Update
        && let Some(old) = request.get("oldObject")
        && changes_owned_key(old, &lb)
    {
        ctx.owned_key_writes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((
                str_at(&request, "/options/fieldManager").to_string(),
                str_at(&lb, "/metadata/name").to_string(),
            ));
    }
    let facts = facts(ctx, &lb).await;
    verdict(mutate(ctx.rules, op, &lb, &facts))
}

/// Reads what the mutator may need from its caches: the LB's Namespace and its guest-cluster
/// VMIs.
async fn facts(ctx: &Ctx, lb: &Value) -> Facts {
    let namespace = str_at(lb, "/metadata/namespace").to_string();
    let cluster = annotations(lb)
        .and_then(|a| a.get(ANN_CLUSTER).cloned())
        .unwrap_or_default();
    let ns = ctx
        .namespaces
        .get(&namespace)
        .await
        .map(|n| n.metadata.annotations.unwrap_or_default())
        // The lister's NotFound, as the API server words it.
        .ok_or_else(|| format!("namespaces \"{namespace}\" not found"));
    let by_cluster_name = if cluster.is_empty() {
        Vec::new()
    } else {
        vmis_labelled(&ctx.vmis, &namespace, LABEL_GUEST_CLUSTER, &cluster).await
    };
    let by_creator = vmis_labelled(&ctx.vmis, &namespace, LABEL_CREATOR, NODE_DRIVER).await;
    // A lister reading its cache does not fail.
    Facts {
        namespace: ns,
        by_cluster_name: Ok(by_cluster_name),
        by_creator: Ok(by_creator),
    }
}

/// The VMIs of `namespace` labelled `label=value` (upstream's `vmiCache.List`).
async fn vmis_labelled(vmis: &Cache, namespace: &str, label: &str, value: &str) -> Vec<Vmi> {
    vmis.list(namespace, &[(label, value)])
        .await
        .iter()
        .map(|o| Vmi::from_object(o))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lb(workload: Option<&str>, ann: Option<Value>) -> Value {
        let mut v = json!({"metadata": {"name": "lb1", "namespace": "guest-vms"}, "spec": {}});
        if let Some(w) = workload {
            v["spec"]["workloadType"] = w.into();
        }
        if let Some(a) = ann {
            v["metadata"]["annotations"] = a;
        }
        v
    }

    fn facts(project: Option<&str>) -> Facts {
        let mut ns = BTreeMap::new();
        if let Some(p) = project {
            ns.insert(ANN_PROJECT_ID.to_string(), p.to_string());
        }
        Facts {
            namespace: Ok(ns),
            by_cluster_name: Ok(vec![]),
            by_creator: Ok(vec![]),
        }
    }

    fn vmi(name: &str, multus: &[&str]) -> Vmi {
        Vmi {
            name: name.into(),
            multus: multus.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The annotations the patch sets, or None for no annotation patch.
    fn set(patch: &[Value]) -> Option<BTreeMap<String, String>> {
        patch
            .iter()
            .find(|p| p["path"] == "/metadata/annotations")
            .map(|p| serde_json::from_value(p["value"].clone()).unwrap())
    }

    fn run(rules: Rules, lb: &Value, f: &Facts) -> Option<BTreeMap<String, String>> {
        set(&mutate(rules, Operation::Create, lb, f).unwrap())
    }

    #[test]
    fn cluster_lb_gets_namespace_and_project_whatever_the_client_sent() {
        let input = lb(
            Some("cluster"),
            Some(
                json!({ANN_CLUSTER: "rke2", ANN_PROJECT: "mine", ANN_NAMESPACE: "other", "x": "y"}),
            ),
        );
        for rules in [Rules::Legacy, Rules::V1_9] {
            let got = run(rules, &input, &facts(Some("c-1:p-2:z"))).unwrap();
            assert_eq!(got[ANN_NAMESPACE], "guest-vms", "{rules:?}");
            assert_eq!(got[ANN_PROJECT], "c-1/p-2:z", "first ':' only, {rules:?}");
            assert_eq!(got["x"], "y", "other annotations kept");
            assert_eq!(got[ANN_CLUSTER], "rke2");
            let none = run(rules, &input, &facts(None)).unwrap();
            assert_eq!(none[ANN_PROJECT], "", "no projectId: empty");
        }
    }

    #[test]
    fn v1_9_network_order() {
        let f = Facts {
            by_cluster_name: Ok(vec![vmi("a", &["", "default/named"])]),
            by_creator: Ok(vec![
                vmi("zz-1", &["default/other"]),
                vmi("rke2-1", &["default/legacy"]),
            ]),
            ..facts(None)
        };
        let net = |ann: Value, f: &Facts| {
            run(Rules::V1_9, &lb(Some("cluster"), Some(ann)), f).unwrap()[ANN_NETWORK].clone()
        };
        assert_eq!(
            net(
                json!({ANN_NETWORK: "default/kept", ANN_MANAGEMENT_NETWORK: "default/mgmt", ANN_CLUSTER: "rke2"}),
                &f
            ),
            "default/kept"
        );
        assert_eq!(
            net(
                json!({ANN_MANAGEMENT_NETWORK: "default/mgmt", ANN_CLUSTER: "rke2"}),
                &f
            ),
            "default/mgmt"
        );
        assert_eq!(
            net(json!({ANN_CLUSTER: "rke2"}), &f),
            "default/named",
            "empty networkName skipped"
        );
        let legacy_only = Facts {
            by_cluster_name: Ok(vec![]),
            ..f.clone()
        };
        assert_eq!(
            net(json!({ANN_CLUSTER: "rke2"}), &legacy_only),
            "default/legacy",
            "name prefix"
        );
        assert_eq!(
            net(json!({"x": "y"}), &f),
            "",
            "no cluster annotation: no discovery"
        );
        assert_eq!(net(json!({ANN_CLUSTER: "none"}), &legacy_only), "");
    }

    #[test]
    fn legacy_network_is_always_rederived() {
        let f = Facts {
            by_creator: Ok(vec![vmi("rke2-1", &["", "default/second"])]),
            ..facts(None)
        };
        let got = run(
            Rules::Legacy,
            &lb(
                Some("cluster"),
                Some(json!({ANN_NETWORK: "default/sent", ANN_CLUSTER: "rke2"})),
            ),
            &f,
        )
        .unwrap();
        assert_eq!(
            got[ANN_NETWORK], "",
            "the first Multus source, even unnamed, replaces the sent value"
        );
        let no_vmis = run(
            Rules::Legacy,
            &lb(
                Some("cluster"),
                Some(json!({ANN_NETWORK: "default/sent", ANN_CLUSTER: "rke2"})),
            ),
            &facts(None),
        )
        .unwrap();
        assert_eq!(no_vmis[ANN_NETWORK], "");
    }

    #[test]
    fn workload_types_per_release() {
        let f = facts(Some("c:p"));
        // vm: namespace only, and nothing once it is right.
        for rules in [Rules::Legacy, Rules::V1_9] {
            let got = run(rules, &lb(Some("vm"), None), &f).unwrap();
            assert_eq!(
                got,
                BTreeMap::from([(ANN_NAMESPACE.to_string(), "guest-vms".to_string())])
            );
            assert_eq!(
                run(
                    rules,
                    &lb(Some("vm"), Some(json!({ANN_NAMESPACE: "guest-vms"}))),
                    &f
                ),
                None
            );
        }
        // empty workloadType: v1.9 treats it as vm, v1.8 as cluster.
        assert!(
            !run(Rules::V1_9, &lb(None, None), &f)
                .unwrap()
                .contains_key(ANN_PROJECT)
        );
        assert_eq!(
            run(Rules::Legacy, &lb(None, None), &f).unwrap()[ANN_PROJECT],
            "c/p"
        );
        // another type: v1.9 leaves it alone.
        assert_eq!(
            run(Rules::V1_9, &lb(Some("other"), Some(json!({}))), &f),
            None
        );
    }

    #[test]
    fn lookups_that_fail_refuse_with_upstream_text() {
        let f = Facts {
            namespace: Err("namespaces \"guest-vms\" not found".into()),
            ..facts(None)
        };
        let e = mutate(
            Rules::V1_9,
            Operation::Create,
            &lb(Some("cluster"), Some(json!({}))),
            &f,
        )
        .unwrap_err();
        assert_eq!(
            e,
            "get namespace guest-vms failed, error: namespaces \"guest-vms\" not found"
        );
        // vm LBs read no Namespace in v1.9.
        assert!(mutate(Rules::V1_9, Operation::Create, &lb(Some("vm"), None), &f).is_ok());
    }

    #[test]
    fn update_of_a_deleting_lb_and_other_operations_pass_unchanged() {
        let mut l = lb(Some("cluster"), Some(json!({})));
        l["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        assert!(
            mutate(Rules::V1_9, Operation::Update, &l, &facts(None))
                .unwrap()
                .is_empty()
        );
        assert!(
            !mutate(Rules::V1_9, Operation::Create, &l, &facts(None))
                .unwrap()
                .is_empty()
        );
        assert!(
            mutate(
                Rules::V1_9,
                Operation::Other,
                &lb(Some("vm"), None),
                &facts(None)
            )
            .unwrap()
            .is_empty()
        );
    }

    #[test]
    fn health_check_zeros_get_defaults_only_with_a_port() {
        let mut l = lb(Some("vm"), Some(json!({ANN_NAMESPACE: "guest-vms"})));
        l["spec"]["healthCheck"] = json!({"port": 8080, "failureThreshold": 5, "extra": 1});
        let p = mutate(Rules::V1_9, Operation::Create, &l, &facts(None)).unwrap();
        assert_eq!(
            p,
            vec![
                json!({"op": "replace", "path": "/spec/healthCheck", "value":
            {"port": 8080, "successThreshold": 2, "failureThreshold": 5, "periodSeconds": 1, "timeoutSeconds": 1}})
            ]
        );
        l["spec"]["healthCheck"] = json!({"successThreshold": 0});
        assert!(
            mutate(Rules::V1_9, Operation::Create, &l, &facts(None))
                .unwrap()
                .is_empty()
        );
        l["spec"]["healthCheck"] = json!({"port": -1});
        assert!(mutate(Rules::V1_9, Operation::Create, &l, &facts(None)).is_err());
    }

    #[test]
    fn malformed_objects_never_panic() {
        let f = facts(Some("c:p"));
        for rules in [Rules::Legacy, Rules::V1_9] {
            for op in [Operation::Create, Operation::Update] {
                for bad in [
                    json!(null),
                    json!(42),
                    json!({"metadata": "x", "spec": []}),
                    json!({"metadata": {"annotations": {"a": 1, ANN_CLUSTER: null}}, "spec": {"workloadType": 7}}),
                    json!({"spec": {"workloadType": "cluster", "healthCheck": "x"}}),
                    json!({"spec": {"workloadType": "vm", "healthCheck": {"port": 1, "periodSeconds": "x"}}}),
                ] {
                    let _ = mutate(rules, op, &bad, &f);
                    let _ = changes_owned_key(&bad, &json!({}));
                }
            }
        }
    }

    #[test]
    fn a_refusal_is_upstreams_internal_error() {
        assert_eq!(
            verdict(Err("boom".into())),
            Verdict::Refuse(Refusal::internal("boom"))
        );
        assert_eq!(verdict(Ok(vec![])), Verdict::Patch(vec![]));
    }
}
