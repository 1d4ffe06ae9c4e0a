//! `harvesterhci.io/v1beta1` NetworkFilesystem, the CR of harvester/networkfs-manager through which
//! Harvester serves a Longhorn RWX volume over NFS: the CSI driver creates it (`desiredState:
//! Disabled`), enables it on publish, and the node mounts `status.endpoint:/<name>` with
//! `status.mountOpts`. Field names as upstream (`pkg/apis/harvesterhci.io/v1beta1/types.go`,
//! including the `perferredNodes` spelling); unknown fields are kept.

use kube::CustomResource;
use serde::{Deserialize, Serialize};

use super::Rest;

/// The namespace upstream keeps every NetworkFilesystem in.
pub const NAMESPACE: &str = "harvester-system";
/// `spec.provisioner` of a Longhorn RWX volume (upstream's `LHName`).
pub const PROVISIONER_LONGHORN: &str = "Longhorn";
/// `spec.desiredState` / `status.state` values.
pub const STATE_ENABLED: &str = "Enabled";
pub const STATE_ENABLING: &str = "Enabling";
pub const STATE_DISABLED: &str = "Disabled";
pub const STATE_DISABLING: &str = "Disabling";
/// `status.status` of an endpoint that serves.
pub const ENDPOINT_READY: &str = "Ready";
/// Mount options when `status.mountOpts` is empty (upstream's node server).
pub const DEFAULT_MOUNT_OPTS: &str = "vers=4";

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "harvesterhci.io",
    version = "v1beta1",
    kind = "NetworkFilesystem",
    namespaced,
    status = "NetworkFilesystemStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct NetworkFilesystemSpec {
    #[serde(rename = "networkFSName")]
    pub network_fs_name: String,
    pub desired_state: String,
    #[serde(
        rename = "perferredNodes",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub preferred_nodes: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioner: Option<String>,
    #[serde(flatten)]
    pub rest: Rest,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkFilesystemStatus {
    #[serde(default)]
    pub endpoint: String,
    #[serde(default)]
    pub state: String,
    #[serde(default)]
    pub status: String,
    #[serde(default, rename = "type")]
    pub type_: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_opts: Option<String>,
    #[serde(flatten)]
    pub rest: Rest,
}

impl NetworkFilesystem {
    /// The endpoint to mount when it serves (`status.status: Ready` and an endpoint), else why not.
    pub fn ready_endpoint(&self) -> Result<(&str, &str), String> {
        let Some(s) = self.status.as_ref() else {
            return Err("it has no status yet".into());
        };
        if s.status != ENDPOINT_READY {
            return Err(format!(
                "status.status is {:?} (state {:?}), not {ENDPOINT_READY:?}",
                s.status, s.state
            ));
        }
        if s.endpoint.trim().is_empty() {
            return Err("status.endpoint is empty".into());
        }
        let opts = s
            .mount_opts
            .as_deref()
            .map(str::trim)
            .filter(|o| !o.is_empty())
            .unwrap_or(DEFAULT_MOUNT_OPTS);
        Ok((s.endpoint.trim(), opts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_field_names_round_trip() {
        let v = serde_json::json!({
            "apiVersion": "harvesterhci.io/v1beta1", "kind": "NetworkFilesystem",
            "metadata": {"name": "pvc-1", "namespace": NAMESPACE},
            "spec": {"networkFSName": "pvc-1", "desiredState": "Enabled", "perferredNodes": "n1",
                     "provisioner": "Longhorn", "future": 1},
            "status": {"endpoint": "10.52.0.7", "state": "Enabled", "status": "Ready",
                       "type": "NFS", "mountOpts": "vers=4.2,noresvport", "conditions": []}
        });
        let n: NetworkFilesystem = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(n.spec.network_fs_name, "pvc-1");
        assert_eq!(n.spec.preferred_nodes.as_deref(), Some("n1"));
        assert_eq!(n.ready_endpoint(), Ok(("10.52.0.7", "vers=4.2,noresvport")));
        let back = serde_json::to_value(&n).unwrap();
        assert_eq!(back["spec"], v["spec"]);
        assert_eq!(back["status"], v["status"]);
    }

    #[test]
    fn only_a_ready_endpoint_is_mounted_and_empty_options_mean_vers_4() {
        let mut n = NetworkFilesystem::new(
            "pvc-1",
            NetworkFilesystemSpec {
                network_fs_name: "pvc-1".into(),
                desired_state: STATE_ENABLED.into(),
                ..Default::default()
            },
        );
        assert!(n.ready_endpoint().is_err());
        n.status = Some(NetworkFilesystemStatus {
            endpoint: "10.0.0.1".into(),
            state: STATE_ENABLING.into(),
            status: "NotReady".into(),
            ..Default::default()
        });
        assert!(n.ready_endpoint().unwrap_err().contains("NotReady"));
        n.status.as_mut().unwrap().status = ENDPOINT_READY.into();
        assert_eq!(n.ready_endpoint(), Ok(("10.0.0.1", "vers=4")));
        n.status.as_mut().unwrap().mount_opts = Some(" ".into());
        assert_eq!(n.ready_endpoint(), Ok(("10.0.0.1", "vers=4")));
    }
}
