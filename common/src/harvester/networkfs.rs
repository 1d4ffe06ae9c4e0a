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
/// `publish_context` keys of an RWX volume: ControllerPublishVolume passes what NodeStageVolume
/// mounts, so the node plugin needs no Harvester credential to look it up.
pub const CONTEXT_NFS_EXPORT: &str = "nfsExport";
pub const CONTEXT_NFS_OPTIONS: &str = "nfsMountOptions";

/// What an RWX volume is mounted from: `<endpoint>:/<pv>` and the CR's mount options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NfsSource {
    pub export: String,
    pub options: String,
}

impl NfsSource {
    /// The export of PV `pv` served at `endpoint`; an IPv6 endpoint is written in brackets in an
    /// NFS source (`[fd00::1]:/pvc-...`).
    pub fn new(endpoint: &str, pv: &str, options: &str) -> NfsSource {
        let host = if endpoint.contains(':') && !endpoint.starts_with('[') {
            format!("[{endpoint}]")
        } else {
            endpoint.to_string()
        };
        NfsSource {
            export: format!("{host}:/{pv}"),
            options: options.to_string(),
        }
    }

    /// The `publish_context` entries that carry it.
    pub fn to_context(&self) -> [(String, String); 2] {
        [
            (CONTEXT_NFS_EXPORT.to_string(), self.export.clone()),
            (CONTEXT_NFS_OPTIONS.to_string(), self.options.clone()),
        ]
    }

    /// The source a `publish_context` carries: `Ok(None)` when it has neither key (a volume
    /// published by a driver that does not pass it, such as upstream's); a key alone, an export
    /// that is not `host:/path` or a value with white space or a comma in the export is an
    /// error naming the key.
    pub fn from_context(
        context: &std::collections::HashMap<String, String>,
    ) -> Result<Option<NfsSource>, String> {
        let (export, options) = (
            context.get(CONTEXT_NFS_EXPORT),
            context.get(CONTEXT_NFS_OPTIONS),
        );
        let (export, options) = match (export, options) {
            (None, None) => return Ok(None),
            (Some(e), Some(o)) => (e, o),
            (Some(_), None) => {
                return Err(format!(
                    "publish_context has {CONTEXT_NFS_EXPORT} without {CONTEXT_NFS_OPTIONS}"
                ));
            }
            (None, Some(_)) => {
                return Err(format!(
                    "publish_context has {CONTEXT_NFS_OPTIONS} without {CONTEXT_NFS_EXPORT}"
                ));
            }
        };
        let well_formed = export
            .split_once(":/")
            .is_some_and(|(host, _)| !host.is_empty())
            && !export.contains(|c: char| c.is_whitespace() || c == ',');
        if !well_formed {
            return Err(format!(
                "publish_context {CONTEXT_NFS_EXPORT} {export:?} is not an NFS export host:/path"
            ));
        }
        if options.trim().is_empty() || options.contains(char::is_whitespace) {
            return Err(format!(
                "publish_context {CONTEXT_NFS_OPTIONS} {options:?} is not a list of mount options"
            ));
        }
        Ok(Some(NfsSource {
            export: export.clone(),
            options: options.clone(),
        }))
    }
}

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

    /// What to mount when the endpoint serves (the CR's name is the PV's), else why not.
    pub fn source(&self) -> Result<NfsSource, String> {
        let name = self.metadata.name.as_deref().unwrap_or_default();
        self.ready_endpoint()
            .map(|(endpoint, opts)| NfsSource::new(endpoint, name, opts))
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

    #[test]
    fn a_source_travels_in_the_publish_context_and_is_checked_there() {
        let v4 = NfsSource::new("10.0.0.1", "pvc-1", "vers=4.2,noresvport");
        assert_eq!(v4.export, "10.0.0.1:/pvc-1");
        let v6 = NfsSource::new("fd00::7", "pvc-1", "vers=4");
        assert_eq!(v6.export, "[fd00::7]:/pvc-1");
        let ctx: std::collections::HashMap<_, _> = v6.to_context().into_iter().collect();
        assert_eq!(NfsSource::from_context(&ctx), Ok(Some(v6)));
        assert_eq!(NfsSource::from_context(&Default::default()), Ok(None));
        let one = |k: &str, v: &str| [(k.to_string(), v.to_string())].into_iter().collect();
        let err = NfsSource::from_context(&one(CONTEXT_NFS_EXPORT, "h:/p")).unwrap_err();
        assert!(err.contains(CONTEXT_NFS_OPTIONS), "{err}");
        for bad in ["pvc-1", ":/pvc-1", "h:/p,vers=3", "h:/p x"] {
            let ctx = [
                (CONTEXT_NFS_EXPORT.to_string(), bad.to_string()),
                (CONTEXT_NFS_OPTIONS.to_string(), "vers=4".to_string()),
            ]
            .into_iter()
            .collect();
            let err = NfsSource::from_context(&ctx).unwrap_err();
            assert!(
                err.contains(CONTEXT_NFS_EXPORT) && err.contains(bad),
                "{err}"
            );
        }
        let ctx = [
            (CONTEXT_NFS_EXPORT.to_string(), "h:/p".to_string()),
            (CONTEXT_NFS_OPTIONS.to_string(), "vers=4 -o x".to_string()),
        ]
        .into_iter()
        .collect();
        assert!(
            NfsSource::from_context(&ctx)
                .unwrap_err()
                .contains(CONTEXT_NFS_OPTIONS)
        );
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
