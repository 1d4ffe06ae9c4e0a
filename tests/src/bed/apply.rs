//! Server-side apply of multi-document YAML, the way `kubectl apply --server-side` does it.

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};

use crate::BedError;

pub const FIELD_MANAGER: &str = "testbed";

/// Applies every document of `yaml`; namespaced objects without a namespace go to `default_ns`.
pub async fn apply_yaml(
    client: &kube::Client,
    yaml: &str,
    default_ns: &str,
) -> Result<Vec<DynamicObject>, BedError> {
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml)
        .map_err(|e| BedError::Setup(format!("parsing YAML to apply: {e}")))?;
    let mut applied = Vec::new();
    for doc in docs.into_iter().filter(|d| !d.is_null()) {
        applied.push(apply_value(client, doc, default_ns).await?);
    }
    Ok(applied)
}

/// Applies one object given as JSON.
pub async fn apply_value(
    client: &kube::Client,
    doc: serde_json::Value,
    default_ns: &str,
) -> Result<DynamicObject, BedError> {
    let obj: DynamicObject = serde_json::from_value(doc.clone())
        .map_err(|e| BedError::Setup(format!("not a Kubernetes object: {e}: {doc}")))?;
    let types = obj
        .types
        .as_ref()
        .ok_or_else(|| BedError::Setup(format!("object without apiVersion/kind: {doc}")))?;
    let gvk = GroupVersionKind::try_from(types)
        .map_err(|e| BedError::Setup(format!("bad apiVersion {}: {e}", types.api_version)))?;
    let (resource, caps) = pinned_kind(client, &gvk)
        .await
        .map_err(|e| BedError::Api(format!("discovering {gvk:?}: {e}")))?;
    let name = obj
        .metadata
        .name
        .clone()
        .ok_or_else(|| BedError::Setup(format!("object without a name: {doc}")))?;
    let api: Api<DynamicObject> = match caps.scope {
        Scope::Cluster => Api::all_with(client.clone(), &resource),
        Scope::Namespaced => {
            let ns = obj.metadata.namespace.as_deref().unwrap_or(default_ns);
            Api::namespaced_with(client.clone(), ns, &resource)
        }
    };
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&doc),
    )
    .await
    .map_err(|e| BedError::Api(format!("applying {} {name}: {e}", gvk.kind)))
}
