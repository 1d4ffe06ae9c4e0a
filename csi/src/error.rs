//! One error enum per CSI service, each mapped once to a `tonic::Status` with the code the CSI
//! spec names.

use std::path::PathBuf;
use std::time::Duration;

use tonic::{Code, Status};

/// A request field that is missing or malformed.
#[derive(Debug, thiserror::Error)]
pub enum ArgError {
    #[error("{field} is required")]
    Missing { field: &'static str },
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("{field}: {reason}")]
    OutOfRange { field: &'static str, reason: String },
}

impl ArgError {
    fn code(&self) -> Code {
        match self {
            ArgError::OutOfRange { .. } => Code::OutOfRange,
            _ => Code::InvalidArgument,
        }
    }
}

impl From<ArgError> for Status {
    fn from(e: ArgError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

/// The code for a failed Harvester API call: conflicts are retried by the caller (`ABORTED`),
/// a request the cloud-config's identity may not make is `PERMISSION_DENIED` (RBAC, fixed by
/// the operator, not by retrying), an unreachable or overloaded server is `UNAVAILABLE`,
/// anything else `INTERNAL` — but a write an admission webhook of Harvester refused with a 4xx
/// (kube-apiserver's `admission webhook "<name>" denied the request: <message>`, e.g. a restore
/// named like an existing backup) is Harvester's rule about its current state, not our bug:
/// `FAILED_PRECONDITION`, with the webhook's message.
fn kube_code(e: &kube::Error) -> Code {
    match e {
        kube::Error::Api(s) if s.code == 409 => Code::Aborted,
        kube::Error::Api(s) if s.code == 403 => Code::PermissionDenied,
        kube::Error::Api(s) if s.code == 429 || s.code >= 500 => Code::Unavailable,
        kube::Error::Api(s) if webhook_denied(&s.message) => Code::FailedPrecondition,
        kube::Error::Api(_) => Code::Internal,
        kube::Error::HyperError(_) | kube::Error::Service(_) => Code::Unavailable,
        _ => Code::Internal,
    }
}

/// kube-apiserver's text for a request an admission webhook refused
/// (`k8s.io/apiserver/pkg/admission/plugin/webhook/errors`, `ToStatusErr`).
fn webhook_denied(message: &str) -> bool {
    message.starts_with("admission webhook \"") && message.contains("\" denied the request")
}

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error(transparent)]
    Arg(#[from] ArgError),
    #[error("volume {volume}: no PersistentVolumeClaim {namespace}/{volume} on Harvester")]
    VolumeNotFound { namespace: String, volume: String },
    #[error("snapshot {snapshot}: no VolumeSnapshot {namespace}/{snapshot} on Harvester")]
    SnapshotNotFound { namespace: String, snapshot: String },
    #[error(
        "snapshot backup:{namespace}/{name}: no VolumeRemoteBackup {namespace}/{name} on Harvester"
    )]
    BackupNotFound { namespace: String, name: String },
    #[error("{0}")]
    NotReady(String),
    #[error("starting_token {0:?} is not a token this driver gave out")]
    BadToken(String),
    #[error("node {node}: no VirtualMachine {namespace}/{node} on Harvester")]
    NodeNotFound { namespace: String, node: String },
    #[error("volume name {name:?}: Harvester PVC {pvc} already exists with {reason}")]
    AlreadyExists {
        name: String,
        pvc: String,
        reason: String,
    },
    #[error(
        "volume {volume} is attached to VM {other}; a single-node volume cannot also be published to {node}"
    )]
    AttachedElsewhere {
        volume: String,
        node: String,
        other: String,
    },
    #[error("node {node} has {used} hot-plugged volumes, its limit ({limit}); unpublish one first")]
    TooManyVolumes { node: String, used: i64, limit: i64 },
    #[error(
        "volume {volume} is still published to node {node} (VM {namespace}/{node} has it); \
         unpublish it (ControllerUnpublishVolume) before deleting it"
    )]
    StillPublished {
        volume: String,
        namespace: String,
        node: String,
    },
    #[error(
        "{kind} {namespace}/{name} does not belong to guest cluster {cluster:?}: {found}; a \
         Harvester admin hands it over by labelling it \
         guestcluster.harvesterhci.io/name={cluster} (docs/install.md)"
    )]
    NotOwned {
        kind: &'static str,
        namespace: String,
        name: String,
        cluster: String,
        found: String,
    },
    #[error(
        "backup {backup} is in Harvester namespace {namespace:?}, not this cluster's {own:?}: \
         {action} another namespace's backups needs the chart value \
         allowCrossNamespaceBackups=true (--allow-cross-namespace-backups) and the \
         harvester-guest-csi-driver-backups binding (docs/install.md)"
    )]
    CrossNamespaceBackup {
        backup: String,
        namespace: String,
        own: String,
        action: &'static str,
    },
    #[error("{0}")]
    Precondition(String),
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("Harvester API: {action}: {}", harvester_common::api_error::Describe(.source.as_ref()))]
    Api {
        action: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("guest API: {action}: {}", harvester_common::api_error::Describe(.source.as_ref()))]
    GuestApi {
        action: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("{0}")]
    Hotplug(Box<harvester_common::harvester::HotplugError>),
    #[error("operation on volume {0} is already in progress")]
    Busy(String),
    #[error(
        "volume {volume}: other hot-plug requests to VM {vm} won the race in each of {attempts} attempts; try again"
    )]
    Contended {
        volume: String,
        vm: String,
        attempts: u32,
    },
}

impl ControllerError {
    /// A closure turning a `kube::Error` into [`ControllerError::Api`] for `action`.
    pub fn api(action: impl Into<String>) -> impl FnOnce(kube::Error) -> ControllerError {
        let action = action.into();
        move |source| ControllerError::Api {
            action,
            source: Box::new(source),
        }
    }
}

impl ControllerError {
    /// A closure turning a guest-cluster `kube::Error` into [`ControllerError::GuestApi`].
    pub fn guest_api(action: impl Into<String>) -> impl FnOnce(kube::Error) -> ControllerError {
        let action = action.into();
        move |source| ControllerError::GuestApi {
            action,
            source: Box::new(source),
        }
    }
}

impl From<harvester_common::harvester::HotplugError> for ControllerError {
    fn from(e: harvester_common::harvester::HotplugError) -> Self {
        ControllerError::Hotplug(Box::new(e))
    }
}

impl From<ControllerError> for Status {
    fn from(e: ControllerError) -> Status {
        let code = match &e {
            ControllerError::Arg(a) => a.code(),
            ControllerError::VolumeNotFound { .. }
            | ControllerError::NodeNotFound { .. }
            | ControllerError::SnapshotNotFound { .. }
            | ControllerError::BackupNotFound { .. } => Code::NotFound,
            ControllerError::NotReady(_) => Code::Unavailable,
            ControllerError::BadToken(_) => Code::Aborted,
            ControllerError::AlreadyExists { .. } => Code::AlreadyExists,
            ControllerError::AttachedElsewhere { .. }
            | ControllerError::StillPublished { .. }
            | ControllerError::Precondition(_) => Code::FailedPrecondition,
            ControllerError::TooManyVolumes { .. } => Code::ResourceExhausted,
            ControllerError::NotOwned { .. } | ControllerError::CrossNamespaceBackup { .. } => {
                Code::PermissionDenied
            }
            ControllerError::Timeout { .. } => Code::DeadlineExceeded,
            ControllerError::Api { source, .. } | ControllerError::GuestApi { source, .. } => {
                kube_code(source)
            }
            ControllerError::Hotplug(h) => match h.as_ref() {
                harvester_common::harvester::HotplugError::Request { source, .. } => {
                    kube_code(source)
                }
                _ => Code::Internal,
            },
            ControllerError::Busy(_) | ControllerError::Contended { .. } => Code::Aborted,
        };
        Status::new(code, e.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Arg(#[from] ArgError),
    #[error(
        "volume {volume}: no disk with serial {serial} appeared in {dir} or /sys/block within {waited:?}; \
         is the volume published to this node (ControllerPublishVolume)?"
    )]
    DeviceNotFound {
        volume: String,
        serial: String,
        dir: PathBuf,
        waited: Duration,
    },
    #[error("{path}: not found")]
    PathNotFound { path: PathBuf },
    #[error("volume {volume} is not staged: nothing is mounted at {path}")]
    NotStaged { volume: String, path: PathBuf },
    #[error("{path} already has {found} mounted, not {wanted}")]
    OtherMount {
        path: PathBuf,
        found: String,
        wanted: String,
    },
    #[error("refusing to format {device}: {reason}")]
    WillNotFormat { device: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Unsupported { path: PathBuf, reason: String },
    #[error("{command} failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("operation on volume {0} is already in progress")]
    Busy(String),
    #[error("volume {volume}: another operation on {path} is in progress")]
    PathBusy { path: PathBuf, volume: String },
    #[error(
        "{device} is {size} bytes, too small for {fs}: it needs at least {min} bytes \
         ({min_mib} MiB); the volume must be created at least that large"
    )]
    TooSmall {
        device: PathBuf,
        size: u64,
        fs: &'static str,
        min: u64,
        min_mib: u64,
    },
    #[error("volume {volume}: no PersistentVolumeClaim {namespace}/{volume} on Harvester")]
    VolumeNotFound { namespace: String, volume: String },
    #[error("volume {volume}: {reason}")]
    NotBound { volume: String, reason: String },
    #[error(
        "volume {volume}: NetworkFilesystem {namespace}/{name} cannot be mounted yet: {reason}"
    )]
    NfsNotReady {
        volume: String,
        namespace: String,
        name: String,
        reason: String,
    },
    #[error(
        "volume {volume}: publish_context carries no nfsExport (it was attached by a driver that \
         does not pass it, such as upstream's) and this node plugin has no Harvester credential \
         to look the export up: detach and attach the volume again (drain the node), or give \
         the node plugin a read-only cloud-config (chart value nodeCloudConfig.secretName)"
    )]
    NoNfsSource { volume: String },
    #[error("volume {volume}: mounting NFS export {export} at {path} failed: {reason}")]
    NfsMount {
        volume: String,
        export: String,
        path: PathBuf,
        reason: String,
    },
    #[error(
        "volume {}: NFS server {} did not answer {} of {} ({}) within {:?}{}",
        .0.volume, .0.server, .0.what, .0.path.display(), .0.export, .0.waited, .0.done
    )]
    NfsServerDown(Box<NfsServerDown>),
    #[error("Harvester API: {action}: {}", harvester_common::api_error::Describe(.source.as_ref()))]
    Api {
        action: String,
        #[source]
        source: Box<kube::Error>,
    },
}

/// An NFS server that did not answer a node operation within its deadline.
#[derive(Debug)]
pub struct NfsServerDown {
    pub volume: String,
    pub server: String,
    pub export: String,
    pub path: PathBuf,
    /// What it did not answer: `statvfs`, `the unmount`.
    pub what: &'static str,
    pub waited: Duration,
    /// What was done about it (a forced lazy unmount), with its leading `; `.
    pub done: &'static str,
}

impl NodeError {
    pub fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| NodeError::Io {
            action,
            path,
            source,
        }
    }
}

impl NodeError {
    /// A closure turning a `kube::Error` into [`NodeError::Api`] for `action`.
    pub fn api(action: impl Into<String>) -> impl FnOnce(kube::Error) -> NodeError {
        let action = action.into();
        move |source| NodeError::Api {
            action,
            source: Box::new(source),
        }
    }
}

impl From<NodeError> for Status {
    fn from(e: NodeError) -> Status {
        let code = match &e {
            NodeError::Arg(a) => a.code(),
            NodeError::DeviceNotFound { .. } | NodeError::PathNotFound { .. } => Code::NotFound,
            NodeError::NotStaged { .. }
            | NodeError::WillNotFormat { .. }
            | NodeError::Unsupported { .. }
            | NodeError::TooSmall { .. } => Code::FailedPrecondition,
            NodeError::OtherMount { .. } => Code::AlreadyExists,
            NodeError::Command { .. } | NodeError::Io { .. } => Code::Internal,
            NodeError::Busy(_) | NodeError::PathBusy { .. } => Code::Aborted,
            NodeError::VolumeNotFound { .. } => Code::NotFound,
            NodeError::NotBound { .. } | NodeError::NoNfsSource { .. } => Code::FailedPrecondition,
            // The NFS server is not serving (yet): the CO retries.
            NodeError::NfsNotReady { .. }
            | NodeError::NfsMount { .. }
            | NodeError::NfsServerDown(_) => Code::Unavailable,
            NodeError::Api { source, .. } => kube_code(source),
        };
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_csi_spec() {
        let s = Status::from(ControllerError::Arg(ArgError::Missing { field: "name" }));
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "name is required");
        let s = Status::from(ControllerError::NodeNotFound {
            namespace: "ns".into(),
            node: "n".into(),
        });
        assert_eq!(s.code(), Code::NotFound);
        let s = Status::from(ControllerError::AttachedElsewhere {
            volume: "v".into(),
            node: "a".into(),
            other: "b".into(),
        });
        assert_eq!(s.code(), Code::FailedPrecondition);
        let s = Status::from(NodeError::OtherMount {
            path: "/p".into(),
            found: "x".into(),
            wanted: "y".into(),
        });
        assert_eq!(s.code(), Code::AlreadyExists);
        let s = Status::from(NodeError::Arg(ArgError::OutOfRange {
            field: "capacity_range",
            reason: "r".into(),
        }));
        assert_eq!(s.code(), Code::OutOfRange);
    }

    fn api_error(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("from the API server", reason)
                .with_code(code)
                .boxed(),
        )
    }

    fn hotplug(source: kube::Error) -> ControllerError {
        ControllerError::from(harvester_common::harvester::HotplugError::Request {
            verb: "addvolume",
            namespace: "guest-vms".into(),
            vm: "worker-1".into(),
            volume: "pvc-1".into(),
            source,
        })
    }

    #[test]
    fn harvester_api_failures_map_by_status() {
        for (code, reason, want) in [
            // RBAC refuses the cloud-config's identity: the operator must grant it.
            (403, "Forbidden", Code::PermissionDenied),
            (409, "Conflict", Code::Aborted),
            (429, "TooManyRequests", Code::Unavailable),
            (503, "ServiceUnavailable", Code::Unavailable),
            (400, "BadRequest", Code::Internal),
            (422, "Invalid", Code::Internal),
        ] {
            let s = Status::from(hotplug(api_error(code, reason)));
            assert_eq!(s.code(), want, "hot-plug answered {code} {reason}: {s:?}");
            assert!(s.message().contains("addvolume"), "{}", s.message());
            let s = Status::from(ControllerError::api("creating PVC guest-vms/pvc-1")(
                api_error(code, reason),
            ));
            assert_eq!(s.code(), want, "API answered {code} {reason}: {s:?}");
        }
    }

    #[test]
    fn a_write_a_harvester_webhook_refused_is_a_failed_precondition_with_its_message() {
        let denied = |code: u16, reason: &str| {
            kube::Error::Api(
                kube::core::Status::failure(
                    "admission webhook \"validator.harvesterhci.io\" denied the request: a RemoteBackup with name v1 already exists in namespace ns",
                    reason,
                )
                .with_code(code)
                .boxed(),
            )
        };
        let s = Status::from(ControllerError::api("creating VolumeRemoteRestore v1")(
            denied(422, "Invalid"),
        ));
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
        assert!(
            s.message()
                .contains("a RemoteBackup with name v1 already exists in namespace ns"),
            "{}",
            s.message()
        );
        // A webhook's 500 (its lookup failed) may pass on a retry, as any 5xx.
        let s = Status::from(ControllerError::api("creating VolumeRemoteBackup b")(
            denied(500, "InternalError"),
        ));
        assert_eq!(s.code(), Code::Unavailable, "{s:?}");
    }
}
