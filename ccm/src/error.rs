//! The crate's error type. Start-up variants end the process with one line; reconcile variants
//! become a Warning Event on the Node (stable reason, see [`Error::reason`]) and a requeue.

use std::path::PathBuf;

use harvester_common::api_error::Describe;

use crate::config::ConfigError;
use crate::config::addresses::AddressError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- start-up
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    CloudConfig(#[from] harvester_common::cloud_config::CloudConfigError),
    #[error("guest cluster kubeconfig {}: {reason}", path.as_ref().map_or("(in-cluster or $KUBECONFIG)".into(), |p| p.display().to_string()))]
    GuestConfig {
        path: Option<PathBuf>,
        reason: String,
    },

    #[error("the cloud provider task ended abnormally: {0}")]
    Task(String),

    // --- reconcile
    #[error(
        "no VirtualMachine for this Node in Harvester namespace {namespace}: looked for VM {node}, a VM with the Node's providerID, and a VMI whose guest hostname is {node}"
    )]
    VmNotFound { namespace: String, node: String },
    #[error(
        "VirtualMachine {namespace}/{vm} is not running (it has no VirtualMachineInstance), so it has no addresses or host yet"
    )]
    VmNotRunning { namespace: String, vm: String },
    #[error("VirtualMachine {namespace}/{vm} has no metadata.uid, so no providerID can be made")]
    VmWithoutUid { namespace: String, vm: String },
    #[error("addresses of VM {namespace}/{vm}: {source}")]
    Addresses {
        namespace: String,
        vm: String,
        #[source]
        source: AddressError,
    },
    #[error("Harvester API: {what}: {}", Describe(source))]
    Harvester {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("guest API: {what}: {}", Describe(source))]
    Guest {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The Node changed since it was read (optimistic concurrency); retried at once, no Event.
    #[error("Node {node} changed while it was being updated; retrying")]
    Conflict { node: String },
}

impl Error {
    /// Stable Event reason of a reconcile error.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Config(_) | Error::CloudConfig(_) | Error::GuestConfig { .. } => "BadConfig",
            Error::Task(_) => "TaskFailed",
            Error::VmNotFound { .. } => "VirtualMachineNotFound",
            Error::VmNotRunning { .. } => "VirtualMachineNotRunning",
            Error::VmWithoutUid { .. } => "VirtualMachineWithoutUID",
            Error::Addresses { source, .. } => source.reason(),
            Error::Harvester { .. } => "HarvesterAPIError",
            Error::Guest { .. } => "NodeUpdateFailed",
            Error::Conflict { .. } => "Conflict",
        }
    }

    /// Whether the error deserves a Warning Event (a conflict is routine).
    pub fn is_warning(&self) -> bool {
        !matches!(self, Error::Conflict { .. })
    }

    pub(crate) fn harvester(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Harvester { what, source }
    }

    pub(crate) fn guest(node: &str, what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        let node = node.to_string();
        move |source| match source {
            kube::Error::Api(ref s) if s.code == 409 => Error::Conflict { node },
            source => Error::Guest { what, source },
        }
    }
}

/// One line for an error and its causes (kube API errors without their struct dump).
pub use harvester_common::api_error::one_line;

/// A provider task that panicked or was cancelled ([`crate::Running`]).
impl From<tokio::task::JoinError> for Error {
    fn from(e: tokio::task::JoinError) -> Self {
        Error::Task(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_not_warnings() {
        let status = kube::core::Status::failure("conflict", "Conflict").with_code(409);
        let err = Error::guest("w1", "patch")(kube::Error::Api(Box::new(status)));
        assert!(matches!(err, Error::Conflict { .. }), "{err:?}");
        assert!(!err.is_warning());
    }
}
