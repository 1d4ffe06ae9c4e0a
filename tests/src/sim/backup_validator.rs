//! Harvester's validating webhook for remote backups, on the bed's [`WebhookServer`]:
//! harvester/harvester `pkg/webhook/resources/volumeremotebackup/validator.go`, v1.8.2 (both
//! validators live in that one file; there is no `.../volumeremoterestore/` package; v1.7.x has no
//! remote backups at all).
//!
//! - VolumeRemoteBackup CREATE: `spec.source` required (422 Invalid); the source PVC must exist in
//!   the backup's namespace, else 500 InternalError `failed to get PVC <ns>/<source>: <error>`.
//!   UPDATE: `spec.type` and `spec.source` cannot change (422).
//! - VolumeRemoteRestore CREATE: `spec.from` required (422); the backup (`<ns>/<name>`, no
//!   namespace = the restore's) must exist, else 500 `failed to get PVCBackup <ns>/<name>: <error>`;
//!   it must have `status.success`, else 422 `PVCBackup <ns>/<name> is not ready`; no backup may
//!   have the restore's name in the restore's namespace, else 422 `a RemoteBackup with name <name>
//!   already exists in namespace <ns>`. UPDATE: `spec.type` and `spec.from` cannot change (422).
//!
//! Codes and reasons: harvester/harvester `pkg/webhook/error/error.go`. Registration:
//! `pkg/webhook/server/server.go` and `pkg/webhook/types.go`, v1.8.2: ValidatingWebhookConfiguration
//! `harvester-validator`, webhook `validator.harvesterhci.io`, `failurePolicy: Fail`, path
//! `/v1/webhook/validation` of the `harvester-webhook` Service — here under the prefix
//! `/harvester-webhook` (the load balancer's webhook has that path on this server). Only the two
//! resources above are registered: Harvester's other validators are not played.
//!
//! The not-found texts are those of the wrangler caches upstream reads (a lister's
//! `apierrors.NewNotFound(<group resource>, name)`): `persistentvolumeclaim "<name>" not found`,
//! `volumeremotebackup.harvesterhci.io "<name>" not found`.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, DynamicObject};
use serde_json::Value;

use super::backup::backup_resource;
use super::webhook::{Refusal, Registration, Rule, Verdict, WebhookServer};
use crate::BedError;
use crate::bed::certs::Pki;

pub const PATH: &str = "/harvester-webhook/v1/webhook/validation";
pub const CONFIG_NAME: &str = "harvester-validator";
pub const WEBHOOK_NAME: &str = "validator.harvesterhci.io";

fn s<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// What a lookup found: `Ok(Some)` the object, `Ok(None)` not found, `Err` another error text.
pub type Found = Result<Option<Value>, String>;

/// The cache's error text for a lookup that found nothing.
fn not_found(resource: &str, name: &str) -> String {
    format!("{resource} \"{name}\" not found")
}

/// VolumeRemoteBackup CREATE; `pvc`: the source PVC in the backup's namespace.
pub fn backup_create(vrb: &Value, pvc: Found) -> Result<(), Refusal> {
    let source = s(vrb, "/spec/source");
    if source.is_empty() {
        return Err(Refusal::invalid("spec.source is required"));
    }
    let ns = s(vrb, "/metadata/namespace");
    let err = match pvc {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => not_found("persistentvolumeclaim", source),
        Err(e) => e,
    };
    Err(Refusal::internal(format!(
        "failed to get PVC {ns}/{source}: {err}"
    )))
}

/// VolumeRemoteRestore CREATE; `from`: the backup named by `spec.from`; `same_name`: a backup
/// named like the restore in the restore's namespace.
pub fn restore_create(vrr: &Value, from: Found, same_name: Found) -> Result<(), Refusal> {
    let (ns, name) = from_ref(vrr).ok_or_else(|| Refusal::invalid("spec.from is required"))?;
    let vrb = match from {
        Ok(Some(v)) => v,
        Ok(None) => {
            return Err(Refusal::internal(format!(
                "failed to get PVCBackup {ns}/{name}: {}",
                not_found("volumeremotebackup.harvesterhci.io", &name)
            )));
        }
        Err(e) => {
            return Err(Refusal::internal(format!(
                "failed to get PVCBackup {ns}/{name}: {e}"
            )));
        }
    };
    if vrb.pointer("/status/success").and_then(Value::as_bool) != Some(true) {
        return Err(Refusal::invalid(format!(
            "PVCBackup {ns}/{name} is not ready"
        )));
    }
    if let Ok(Some(_)) = same_name {
        return Err(Refusal::invalid(format!(
            "a RemoteBackup with name {} already exists in namespace {}",
            s(vrr, "/metadata/name"),
            s(vrr, "/metadata/namespace")
        )));
    }
    Ok(())
}

/// `spec.from` as upstream's `ref.Parse`: `<ns>/<name>`, or `<name>` in the restore's namespace.
/// None when empty.
pub fn from_ref(vrr: &Value) -> Option<(String, String)> {
    let from = s(vrr, "/spec/from");
    if from.is_empty() {
        return None;
    }
    let own = s(vrr, "/metadata/namespace");
    Some(match from.split_once('/') {
        Some((ns, name)) if !ns.is_empty() => (ns.to_string(), name.to_string()),
        Some((_, name)) => (own.to_string(), name.to_string()),
        None => (own.to_string(), from.to_string()),
    })
}

/// UPDATE of either kind: `spec.type` and `spec.<field>` cannot change.
pub fn update(old: &Value, new: &Value, field: &str) -> Result<(), Refusal> {
    if s(old, "/spec/type") != s(new, "/spec/type") {
        return Err(Refusal::invalid("spec.type cannot be changed"));
    }
    let p = format!("/spec/{field}");
    if s(old, &p) != s(new, &p) {
        return Err(Refusal::invalid(format!("spec.{field} cannot be changed")));
    }
    Ok(())
}

pub fn registration() -> Registration {
    let rule = |resource: &str| {
        Rule::new(
            &["CREATE", "UPDATE"],
            "harvesterhci.io",
            "v1beta1",
            resource,
            "Namespaced",
        )
    };
    Registration::validating(
        CONFIG_NAME,
        WEBHOOK_NAME,
        PATH,
        vec![rule("volumeremotebackups"), rule("volumeremoterestores")],
    )
}

async fn get<K>(api: Api<K>, name: &str) -> Result<Option<Value>, String>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + serde::Serialize,
{
    match api.get_opt(name).await {
        Ok(o) => Ok(o.and_then(|o| serde_json::to_value(o).ok())),
        Err(e) => Err(e.to_string()),
    }
}

async fn admit(client: kube::Client, request: Value) -> Verdict {
    let obj = request.get("object").cloned().unwrap_or(Value::Null);
    let old = request.get("oldObject").cloned().unwrap_or(Value::Null);
    let ns = s(&obj, "/metadata/namespace").to_string();
    let vrbs =
        |ns: &str| Api::<DynamicObject>::namespaced_with(client.clone(), ns, &backup_resource());
    let answer = match (s(&request, "/resource/resource"), s(&request, "/operation")) {
        ("volumeremotebackups", "CREATE") => {
            let source = s(&obj, "/spec/source");
            let pvc = if source.is_empty() {
                Ok(None)
            } else {
                get(
                    Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns),
                    source,
                )
                .await
            };
            backup_create(&obj, pvc)
        }
        ("volumeremotebackups", "UPDATE") => update(&old, &obj, "source"),
        ("volumeremoterestores", "CREATE") => {
            let (from, same) = match from_ref(&obj) {
                Some((from_ns, from_name)) => (
                    get(vrbs(&from_ns), &from_name).await,
                    get(vrbs(&ns), s(&obj, "/metadata/name")).await,
                ),
                None => (Ok(None), Ok(None)),
            };
            restore_create(&obj, from, same)
        }
        ("volumeremoterestores", "UPDATE") => update(&old, &obj, "from"),
        _ => Ok(()),
    };
    match answer {
        Ok(()) => Verdict::Allow,
        Err(r) => Verdict::Refuse(r),
    }
}

/// Routes the validator at [`PATH`] of `server` and registers it; `client` is the Harvester
/// admin client it reads PVCs and backups with.
pub async fn install(
    server: &WebhookServer,
    client: kube::Client,
    pki: &Pki,
) -> Result<(), BedError> {
    server
        .install(&client, pki, &registration(), PATH, admit)
        .await
}

/// Waits until the API server calls the validator: a dry-run create of a VolumeRemoteBackup of a
/// PVC that does not exist in `namespace` is refused with its message.
pub async fn wait_called(client: &kube::Client, namespace: &str) -> Result<(), BedError> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &backup_resource());
    let probe: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "harvesterhci.io/v1beta1", "kind": "VolumeRemoteBackup",
        "metadata": {"name": "testbed-validator-probe"},
        "spec": {"source": "testbed-no-such-pvc", "type": "lh"}
    }))
    .map_err(|e| BedError::Setup(format!("backup validator probe: {e}")))?;
    super::webhook::wait_refused(
        api,
        probe,
        WEBHOOK_NAME,
        "the Harvester API server calls Harvester's remote-backup validator",
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vrb(source: &str) -> Value {
        json!({"metadata": {"name": "b1", "namespace": "ns"}, "spec": {"source": source, "type": "lh"}})
    }

    fn vrr(name: &str, from: &str) -> Value {
        json!({"metadata": {"name": name, "namespace": "ns"}, "spec": {"from": from, "type": "lh"}})
    }

    #[test]
    fn a_backup_needs_its_source_pvc() {
        assert!(backup_create(&vrb("pvc-a"), Ok(Some(json!({})))).is_ok());
        assert_eq!(
            backup_create(&vrb("pvc-a"), Ok(None)).unwrap_err(),
            Refusal::internal(
                "failed to get PVC ns/pvc-a: persistentvolumeclaim \"pvc-a\" not found"
            )
        );
        assert_eq!(
            backup_create(&vrb(""), Ok(None)).unwrap_err(),
            Refusal::invalid("spec.source is required")
        );
    }

    #[test]
    fn a_restore_needs_a_successful_backup_and_a_name_no_backup_has() {
        let done = json!({"status": {"success": true}});
        assert!(restore_create(&vrr("r1", "ns/b1"), Ok(Some(done.clone())), Ok(None)).is_ok());
        assert_eq!(
            restore_create(&vrr("r1", "b1"), Ok(Some(json!({"status": {}}))), Ok(None))
                .unwrap_err(),
            Refusal::invalid("PVCBackup ns/b1 is not ready")
        );
        assert_eq!(
            restore_create(
                &vrr("b1", "other/b1"),
                Ok(Some(done.clone())),
                Ok(Some(json!({})))
            )
            .unwrap_err(),
            Refusal::invalid("a RemoteBackup with name b1 already exists in namespace ns")
        );
        let missing = restore_create(&vrr("r1", "x/b9"), Ok(None), Ok(None)).unwrap_err();
        assert_eq!(missing.code, 500);
        assert_eq!(
            missing.message,
            "failed to get PVCBackup x/b9: volumeremotebackup.harvesterhci.io \"b9\" not found"
        );
        assert_eq!(
            restore_create(&vrr("r1", ""), Ok(None), Ok(None)).unwrap_err(),
            Refusal::invalid("spec.from is required")
        );
    }

    #[test]
    fn type_source_and_from_are_immutable() {
        assert!(update(&vrb("a"), &vrb("a"), "source").is_ok());
        assert_eq!(
            update(&vrb("a"), &vrb("b"), "source").unwrap_err().message,
            "spec.source cannot be changed"
        );
        let mut t = vrr("r", "b");
        t["spec"]["type"] = "other".into();
        assert_eq!(
            update(&vrr("r", "b"), &t, "from").unwrap_err().message,
            "spec.type cannot be changed"
        );
    }

    #[test]
    fn malformed_objects_never_panic() {
        for bad in [
            json!(null),
            json!(3),
            json!({"spec": []}),
            json!({"spec": {"from": 5, "source": {}}}),
        ] {
            let _ = backup_create(&bad, Ok(None));
            let _ = restore_create(&bad, Ok(Some(bad.clone())), Err("x".into()));
            let _ = update(&bad, &json!({}), "from");
            let _ = from_ref(&bad);
        }
    }
}
