//! Harvester's LoadBalancer validating webhook, on the bed's [`WebhookServer`] at [`PATH`]:
//! harvester/load-balancer-harvester `pkg/webhook/loadbalancer/validator.go`, v1.8.2 (dd5899ef;
//! the same rules at the branch head e861dc94, where only the VM selector moved into a helper).
//! v1.8.1 (8211c382) has the same rules; v1.8.0 (f1bde8f2) refused every `cluster` LB whose
//! namespace has no VM with both labels, `kubernetes` included (not played); v1.7.3 had no check.
//!
//! - CREATE: listeners and health check (not for `cluster` LBs), then, for `cluster` LBs
//!   labelled `cloudprovider.harvesterhci.io/cluster` with a name other than "" and
//!   "kubernetes": refused while a VM of the LB's namespace labelled
//!   `harvesterhci.io/creator=docker-machine-driver-harvester` and
//!   `guestcluster.harvesterhci.io/name=<cluster>` carries
//!   `harvesterhci.io/removeAllPersistentVolumeClaims: "true"` (Rancher marks them when it
//!   deletes the guest cluster) — `checkGuestClusterIsOnRemove`.
//! - UPDATE (not of a deleting LB): listeners, health check, and no switch of `ipam` to or from
//!   `dhcp` nor of `workloadType` to or from `cluster`.
//!
//! Each refusal is a plain Go error, which harvester/webhook's `admission.go` answers as 500
//! InternalError with the error's text. Registration: harvester/webhook v0.1.5 `server.go`
//! `validatingWebhookConfiguration` (`validator.<namespace>.<name>`, `/v1/webhook/validation`,
//! `failurePolicy: Fail`). Upstream's IPPool validator on the same configuration is not played.

use serde_json::Value;

use super::cache::Cache;
use super::webhook::{Refusal, Registration, Rule, Verdict, WebhookServer, handler};
use crate::BedError;
use crate::bed::certs::Pki;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};

/// Where upstream's webhook server serves its validators (harvester/webhook `server.go`).
pub const PATH: &str = "/v1/webhook/validation";
/// The ValidatingWebhookConfiguration's name: the webhook server's name.
pub const CONFIG_NAME: &str = "harvester-load-balancer-webhook";
pub const WEBHOOK_NAME: &str = "validator.harvester-system.harvester-load-balancer-webhook";
/// `utils.LabelKeyGuestClusterNameOnLB`.
pub const LABEL_CLUSTER_ON_LB: &str = "cloudprovider.harvesterhci.io/cluster";
/// `utils.LabelKeyGuestClusterNameOnVM`.
pub const LABEL_CLUSTER_ON_VM: &str = "guestcluster.harvesterhci.io/name";
/// `utils.LabelKeyHarvesterCreator` = `utils.GuestClusterHarvesterNodeDriver`.
pub const LABEL_CREATOR: (&str, &str) =
    ("harvesterhci.io/creator", "docker-machine-driver-harvester");
/// `utils.AnnotationKeyGuestClusterOnRemove`.
pub const ANN_ON_REMOVE: &str = "harvesterhci.io/removeAllPersistentVolumeClaims";
/// `defaultGuestClusterName`: not checked.
const DEFAULT_GUEST_CLUSTER: &str = "kubernetes";
const MAX_PORT: i64 = 65535;

/// A VM as the check sees it.
#[derive(Clone, Debug, Default)]
pub struct Vm {
    pub namespace: String,
    pub name: String,
    pub on_remove: bool,
}

fn s<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn int(v: &Value, key: &str) -> i64 {
    v.get(key).and_then(Value::as_i64).unwrap_or(0)
}

fn ns_name(lb: &Value) -> String {
    format!(
        "{}/{}",
        s(lb, "/metadata/namespace"),
        s(lb, "/metadata/name")
    )
}

fn is_cluster(lb: &Value) -> bool {
    s(lb, "/spec/workloadType") == "cluster"
}

/// The guest cluster whose VMs to look at, if the check applies (`checkGuestClusterIsOnRemove`
/// before its List).
pub fn guest_cluster_to_check(lb: &Value) -> Option<String> {
    if !is_cluster(lb) {
        return None;
    }
    let gc = lb
        .pointer("/metadata/labels")
        .and_then(|l| l.get(LABEL_CLUSTER_ON_LB))
        .and_then(Value::as_str)?;
    (!gc.is_empty() && gc != DEFAULT_GUEST_CLUSTER).then(|| gc.to_string())
}

/// validator.go `Create`. `vms`: the node-driver VMs of the guest cluster
/// [`guest_cluster_to_check`] names (`Err`: the list's error text).
pub fn validate_create(lb: &Value, vms: Result<&[Vm], String>) -> Result<(), String> {
    let name = ns_name(lb);
    check_listeners(lb).map_err(|e| format!("create loadbalancer {name} failed: {e}"))?;
    check_health_check(lb)
        .map_err(|e| format!("create loadbalancer {name} failed with healthyCheck: {e}"))?;
    if let Some(gc) = guest_cluster_to_check(lb) {
        let namespace = s(lb, "/metadata/namespace");
        let vms = vms.map_err(|e| {
            format!(
                "create loadbalancer {name} failed with guest cluster check: list vm from {namespace} failed, error: {e}"
            )
        })?;
        if let Some(vm) = vms.iter().find(|vm| vm.on_remove) {
            return Err(format!(
                "create loadbalancer {name} failed with guest cluster check: the vm {}/{} shows guest cluster {gc} is being removed",
                vm.namespace, vm.name
            ));
        }
    }
    Ok(())
}

/// validator.go `Update`.
pub fn validate_update(old: &Value, lb: &Value) -> Result<(), String> {
    if lb
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null())
    {
        return Ok(());
    }
    let name = ns_name(lb);
    let failed = |e: String| format!("update loadbalancer {name} failed: {e}");
    check_listeners(lb).map_err(failed)?;
    check_health_check(lb)
        .map_err(|e| format!("update loadbalancer {name} failed with healthyCheck: {e}"))?;
    // checkIPAM: to or from dhcp.
    let (was, is) = (s(old, "/spec/ipam"), s(lb, "/spec/ipam"));
    if (was == "dhcp") != (is == "dhcp") {
        return Err(failed(format!("can't change the IPAM from {was} to {is}")));
    }
    // checkWorkloadType: to or from cluster.
    let (was, is) = (s(old, "/spec/workloadType"), s(lb, "/spec/workloadType"));
    if (was == "cluster") != (is == "cluster") {
        return Err(failed(format!(
            "can't change the WorkloadType from {was} to {is}"
        )));
    }
    Ok(())
}

fn listeners(lb: &Value) -> Vec<Value> {
    lb.pointer("/spec/listeners")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// `checkListeners`: `cluster` LBs may have none; others need one, with unique names, unique
/// protocol:port and protocol:backendPort, ports in 1..=65535.
fn check_listeners(lb: &Value) -> Result<(), String> {
    if is_cluster(lb) {
        return Ok(());
    }
    let ls = listeners(lb);
    if ls.is_empty() {
        return Err("the loadbalancer needs to have at least one listener".into());
    }
    let key = |l: &Value, field: &str| format!("{}:{}", s(l, "/protocol"), int(l, field));
    for (i, l) in ls.iter().enumerate() {
        let name = s(l, "/name");
        if ls[..i].iter().any(|o| s(o, "/name") == name) {
            return Err(format!("listener has duplicate name {name}"));
        }
        if let Some(o) = ls[..i].iter().find(|o| key(o, "port") == key(l, "port")) {
            return Err(format!(
                "listener {name} has duplicate port {} with listener {}",
                key(l, "port"),
                s(o, "/name")
            ));
        }
        if let Some(o) = ls[..i]
            .iter()
            .find(|o| key(o, "backendPort") == key(l, "backendPort"))
        {
            return Err(format!(
                "listener {name} has duplicate backend port {} with listener {}",
                key(l, "backendPort"),
                s(o, "/name")
            ));
        }
    }
    for l in &ls {
        let (port, backend) = (int(l, "port"), int(l, "backendPort"));
        if port > MAX_PORT {
            return Err(format!("listener port {port} must <= {MAX_PORT}"));
        } else if port < 1 {
            return Err(format!("listener port {port} must >= 1"));
        }
        if backend > MAX_PORT {
            return Err(format!(
                "listener backend port {backend} must <= {MAX_PORT}"
            ));
        } else if backend < 1 {
            return Err(format!("listener backend port {backend} must >= 1"));
        }
    }
    Ok(())
}

/// `checkHealthyCheck` (not for `cluster` LBs): a health check with a port must name a TCP
/// backend port and have every threshold and period above 0.
fn check_health_check(lb: &Value) -> Result<(), String> {
    if is_cluster(lb) {
        return Ok(());
    }
    let Some(hc) = lb.pointer("/spec/healthCheck").filter(|v| v.is_object()) else {
        return Ok(());
    };
    let port = int(hc, "port");
    if port == 0 {
        return Ok(());
    }
    let mut wrong_protocol = false;
    for l in listeners(lb) {
        if int(&l, "backendPort") != port {
            continue;
        }
        if s(&l, "/protocol") == "TCP" {
            for (field, name) in [
                ("successThreshold", "SuccessThreshold"),
                ("failureThreshold", "FailureThreshold"),
                ("periodSeconds", "PeriodSeconds"),
                ("timeoutSeconds", "TimeoutSeconds"),
            ] {
                if int(hc, field) == 0 {
                    return Err(format!("healthcheck {name} should > 0"));
                }
            }
            return Ok(());
        }
        wrong_protocol = true;
    }
    Err(if wrong_protocol {
        format!("healthcheck port {port} can only be a TCP backend port")
    } else {
        format!("healthcheck port {port} is not in listener backend port list")
    })
}

/// The ValidatingWebhookConfiguration upstream's webhook server registers for LoadBalancers.
pub fn registration() -> Registration {
    Registration::validating(
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

fn vm_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    )
}

/// Upstream's vmCache.List: the guest cluster's node-driver VMs in `namespace`.
async fn list_vms(vms: &Cache, namespace: &str, gc: &str) -> Vec<Vm> {
    let selector = [LABEL_CREATOR, (LABEL_CLUSTER_ON_VM, gc)];
    vms.list(namespace, &selector)
        .await
        .into_iter()
        .map(|vm| Vm {
            namespace: vm.metadata.namespace.clone().unwrap_or_default(),
            on_remove: vm
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANN_ON_REMOVE))
                .is_some_and(|v| v == "true"),
            name: vm.metadata.name.clone().unwrap_or_default(),
        })
        .collect()
}

/// One AdmissionReview `request` (DELETE and CONNECT are not registered; allowed).
async fn admit(vms: Cache, request: Value) -> Verdict {
    let lb = request.get("object").cloned().unwrap_or(Value::Null);
    let answer = match s(&request, "/operation") {
        "CREATE" => {
            let vms = match guest_cluster_to_check(&lb) {
                Some(gc) => list_vms(&vms, s(&lb, "/metadata/namespace"), &gc).await,
                None => Vec::new(),
            };
            validate_create(&lb, Ok(&vms))
        }
        "UPDATE" => validate_update(request.get("oldObject").unwrap_or(&Value::Null), &lb),
        _ => Ok(()),
    };
    match answer {
        Ok(()) => Verdict::Allow,
        Err(message) => Verdict::Refuse(Refusal::internal(message)),
    }
}

/// Routes the validator at [`PATH`] of `server` and registers it; `client` is the Harvester admin
/// client it watches VMs with (on the current runtime, as long as the route lives).
/// [`wait_called`] then waits until the API server calls it.
pub async fn install(
    server: &WebhookServer,
    client: kube::Client,
    pki: &Pki,
) -> Result<(), BedError> {
    let vms = Cache::start(client.clone(), &vm_resource());
    server.route(PATH, handler(move |request| admit(vms.clone(), request)));
    server.register(&client, pki, &registration()).await
}

/// Waits until the API server calls the validator: a dry-run create of a `vm` LoadBalancer
/// without listeners in `namespace` is refused with its message.
pub async fn wait_called(client: &kube::Client, namespace: &str) -> Result<(), BedError> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &super::lb_webhook::loadbalancer_resource(),
    );
    let probe: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "LoadBalancer",
        "metadata": {"name": "testbed-validator-probe"},
        "spec": {"workloadType": "vm", "ipam": "pool"}
    }))
    .map_err(|e| BedError::Setup(format!("LB validator probe: {e}")))?;
    super::webhook::wait_refused(
        api,
        probe,
        WEBHOOK_NAME,
        "the Harvester API server calls the LoadBalancer validator",
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lb(workload: &str, cluster: Option<&str>) -> Value {
        let mut v = json!({"metadata": {"name": "lb1", "namespace": "ns"},
                           "spec": {"workloadType": workload, "ipam": "pool"}});
        if let Some(c) = cluster {
            v["metadata"]["labels"] = json!({LABEL_CLUSTER_ON_LB: c});
        }
        v
    }

    fn vm(name: &str, on_remove: bool) -> Vm {
        Vm {
            namespace: "ns".into(),
            name: name.into(),
            on_remove,
        }
    }

    #[test]
    fn a_cluster_lb_is_refused_while_its_guest_cluster_is_being_removed() {
        let vms = [vm("rke2-a", false), vm("rke2-b", true)];
        assert_eq!(
            validate_create(&lb("cluster", Some("rke2")), Ok(&vms)).unwrap_err(),
            "create loadbalancer ns/lb1 failed with guest cluster check: the vm ns/rke2-b shows guest cluster rke2 is being removed"
        );
        // No VM marked, no VMs, no or a default cluster label, a vm LB: admitted.
        assert!(validate_create(&lb("cluster", Some("rke2")), Ok(&vms[..1])).is_ok());
        assert!(validate_create(&lb("cluster", Some("rke2")), Ok(&[])).is_ok());
        for gc in [None, Some(""), Some("kubernetes")] {
            assert_eq!(guest_cluster_to_check(&lb("cluster", gc)), None, "{gc:?}");
        }
        assert_eq!(guest_cluster_to_check(&lb("vm", Some("rke2"))), None);
        assert_eq!(
            validate_create(&lb("cluster", Some("rke2")), Err("boom".into())).unwrap_err(),
            "create loadbalancer ns/lb1 failed with guest cluster check: list vm from ns failed, error: boom"
        );
    }

    #[test]
    fn listeners_and_health_checks_of_vm_lbs() {
        let mut l = lb("vm", None);
        assert_eq!(
            validate_create(&l, Ok(&[])).unwrap_err(),
            "create loadbalancer ns/lb1 failed: the loadbalancer needs to have at least one listener"
        );
        l["spec"]["listeners"] = json!([
            {"name": "a", "port": 80, "protocol": "TCP", "backendPort": 8080},
            {"name": "b", "port": 80, "protocol": "TCP", "backendPort": 8081}]);
        assert_eq!(
            validate_create(&l, Ok(&[])).unwrap_err(),
            "create loadbalancer ns/lb1 failed: listener b has duplicate port TCP:80 with listener a"
        );
        l["spec"]["listeners"][1]["protocol"] = "UDP".into();
        assert!(validate_create(&l, Ok(&[])).is_ok());
        l["spec"]["listeners"][1]["port"] = 70000.into();
        assert!(
            validate_create(&l, Ok(&[]))
                .unwrap_err()
                .ends_with("listener port 70000 must <= 65535")
        );
        l["spec"]["listeners"][1]["port"] = 81.into();
        l["spec"]["healthCheck"] = json!({"port": 8081, "successThreshold": 1});
        assert!(validate_create(&l, Ok(&[])).unwrap_err().ends_with(
            "failed with healthyCheck: healthcheck port 8081 can only be a TCP backend port"
        ));
        l["spec"]["healthCheck"] = json!({"port": 8080, "successThreshold": 1});
        assert!(
            validate_create(&l, Ok(&[]))
                .unwrap_err()
                .ends_with("healthcheck FailureThreshold should > 0")
        );
        // A cluster LB needs no listeners.
        assert!(validate_create(&lb("cluster", None), Ok(&[])).is_ok());
    }

    #[test]
    fn updates_keep_ipam_and_workload_type() {
        let old = lb("cluster", Some("rke2"));
        let mut new = old.clone();
        assert!(validate_update(&old, &new).is_ok());
        new["spec"]["ipam"] = "dhcp".into();
        assert_eq!(
            validate_update(&old, &new).unwrap_err(),
            "update loadbalancer ns/lb1 failed: can't change the IPAM from pool to dhcp"
        );
        new["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z".into();
        assert!(validate_update(&old, &new).is_ok(), "a deleting LB passes");
        let mut new = old.clone();
        new["spec"]["workloadType"] = "vm".into();
        new["spec"]["listeners"] =
            json!([{"name": "a", "port": 80, "protocol": "TCP", "backendPort": 80}]);
        assert_eq!(
            validate_update(&old, &new).unwrap_err(),
            "update loadbalancer ns/lb1 failed: can't change the WorkloadType from cluster to vm"
        );
    }

    #[test]
    fn malformed_objects_never_panic() {
        for bad in [
            json!(null),
            json!(7),
            json!({"metadata": [], "spec": {"listeners": 3, "healthCheck": {"port": "x"}}}),
            json!({"spec": {"workloadType": "vm", "listeners": [1, null, {"port": "a"}], "healthCheck": {"port": 1}}}),
            json!({"metadata": {"labels": {LABEL_CLUSTER_ON_LB: 5}}, "spec": {"workloadType": "cluster"}}),
        ] {
            let _ = validate_create(&bad, Ok(&[]));
            let _ = validate_update(&bad, &bad);
            let _ = validate_update(&json!({}), &bad);
            let _ = guest_cluster_to_check(&bad);
        }
    }
}
