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
/// `status.status` while an online expansion runs: the export keeps serving (networkfs-manager
/// b9addbdce76c2317c828ec7ac84c472b6f7a96b4 `pkg/controller/networkfilesystem/controller.go`
/// `checkAndProcessExpand` sets it on an Enabled CR whose PVC is growing, and `Ready` again when
/// done; the status enum of `pkg/apis/harvesterhci.io/v1beta1/types.go` has it).
pub const ENDPOINT_EXPANDING: &str = "Expanding";
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
    /// `status.state` ("" before networkfs-manager initialised it).
    pub fn state(&self) -> &str {
        self.status.as_ref().map_or("", |s| s.state.as_str())
    }

    /// The endpoint to mount when it serves, else why not. It serves when the state is `Enabled`
    /// (or `Enabling` with a Ready endpoint, which later networkfs-manager versions write while
    /// an endpoint moves) and `status.status` is `Ready` or `Expanding` (an online expansion of a
    /// working export). A `Disabling` CR keeps `status: Ready` and its endpoint until the share
    /// manager has stopped (networkfs-manager v0.1.1, 8d20f3e6679f0a0b484e16fbb8d05e086e183e09,
    /// `disableNetworkFS` changes only `status.state`), so the status alone is not enough.
    pub fn ready_endpoint(&self) -> Result<(&str, &str), String> {
        let Some(s) = self.status.as_ref() else {
            return Err("it has no status yet".into());
        };
        if s.state != STATE_ENABLED && s.state != STATE_ENABLING {
            return Err(format!(
                "status.state is {:?} (status {:?}), not {STATE_ENABLED:?}",
                s.state, s.status
            ));
        }
        if s.status != ENDPOINT_READY && s.status != ENDPOINT_EXPANDING {
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
        let mut n = enabled();
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

    /// The CR of `pvc-1`, asked to be Enabled, with no status yet.
    fn enabled() -> NetworkFilesystem {
        NetworkFilesystem::new(
            "pvc-1",
            NetworkFilesystemSpec {
                network_fs_name: "pvc-1".into(),
                desired_state: STATE_ENABLED.into(),
                ..Default::default()
            },
        )
    }

    fn with_status(state: &str, status: &str, endpoint: &str) -> NetworkFilesystem {
        let mut n = enabled();
        n.status = Some(NetworkFilesystemStatus {
            endpoint: endpoint.into(),
            state: state.into(),
            status: status.into(),
            ..Default::default()
        });
        n
    }

    #[test]
    fn an_expanding_export_serves_and_a_disabling_one_does_not() {
        // checkAndProcessExpand: an Enabled CR whose PVC grows is `status: Expanding`; the share
        // manager keeps serving it.
        let n = with_status(STATE_ENABLED, ENDPOINT_EXPANDING, "10.0.0.1");
        assert_eq!(n.ready_endpoint(), Ok(("10.0.0.1", "vers=4")));
        // disableNetworkFS writes only `state: Disabling`: status and endpoint are the old ones
        // while the share manager stops.
        for state in [STATE_DISABLING, STATE_DISABLED, "", "Unknown"] {
            let n = with_status(state, ENDPOINT_READY, "10.0.0.1");
            let e = n.ready_endpoint().unwrap_err();
            assert!(e.contains(&format!("{state:?}")), "{state}: {e}");
        }
        assert_eq!(
            with_status(STATE_DISABLING, ENDPOINT_READY, "10.0.0.1").state(),
            STATE_DISABLING
        );
        assert!(
            with_status(STATE_ENABLED, "Reconciling", "10.0.0.1")
                .ready_endpoint()
                .is_err()
        );
    }
}
