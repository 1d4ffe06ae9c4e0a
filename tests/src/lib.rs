//! The test bed: real etcd and two real kube-apiservers ("guest" and "harvester"), the KubeVirt,
//! Harvester LoadBalancer and snapshot CRDs, KubeVirt's hot-plug subresources served through the
//! real API aggregation layer, and a stand-in ("sim") that plays KubeVirt, Longhorn and the
//! Harvester LB controller against the Harvester API server.
//!
//! ```no_run
//! # async fn demo() -> Result<(), testbed::BedError> {
//! let bed = testbed::TestBed::start(testbed::BedOptions::default()).await?;
//! bed.sim.create_host("h1", Some("r1"), Some("z1")).await?;
//! # Ok(()) }
//! ```

//!
//! # Layers
//!
//! Each folder is a layer; a module uses only the layers listed before its own (and the crate
//! root's [`BedError`]), so no two modules import each other:
//! - [`util`]: processes, bounded waits, Go tools, helm, watches, scraping. Uses nothing else.
//! - [`bed`]'s parts ([`bed::cluster`], [`bed::certs`], [`bed::apply`], [`bed::rbac`],
//!   [`bed::crds`], [`bed::kubevirt`]): etcd, the API servers and what goes into them. Use [`util`] (and the address
//!   constants of [`real::podnet`] and [`real::vm`] for the serving certificates).
//! - [`real`]: real processes, devices and networks (node, images, Pod network, registrar,
//!   livenessprobe, QEMU guest, NFS server, network namespaces, mounts, pod logs). Use [`util`]
//!   and [`bed`]'s parts.
//! - [`sim`]: the Harvester stand-in. Uses [`util`], [`bed`]'s parts and [`real::nfs`].
//! - [`bed`] itself ([`TestBed`], [`bed::guest_cluster`], [`bed::users_cluster`]): composes all of
//!   the above into a running bed.
//! - [`csi_client`]: CSI request builders (no layer of its own: it uses only `csi-proto`).
//! - [`suites`]: fixtures the integration suites in `tests/tests` share (the products running
//!   in-process against a bed, CSI clients, chart helpers). Uses everything above.

pub mod bed;
pub mod csi_client;
pub mod real;
pub mod sim;
pub mod suites;
pub mod util;

use std::path::PathBuf;

pub use bed::{BedOptions, TestBed};

#[derive(Debug, thiserror::Error)]
pub enum BedError {
    #[error("test bed: {tool} is not built ({path}); run {script} (`make test` does)")]
    MissingTool {
        tool: String,
        path: PathBuf,
        script: PathBuf,
    },
    #[error("test bed: starting {component} failed: {reason} (log: {log})")]
    Start {
        component: String,
        log: PathBuf,
        reason: String,
    },
    #[error("test bed: {component} exited ({status}); log: {log}\n{tail}")]
    Died {
        component: String,
        log: PathBuf,
        status: String,
        tail: String,
    },
    #[error(
        "test bed: timed out waiting for {component}: {what} (log: {log}); its last lines:\n{}",
        crate::util::process::tail(.log, 15)
    )]
    Timeout {
        component: String,
        log: PathBuf,
        what: String,
    },
    #[error("test bed: {0}")]
    Setup(String),
    #[error("test bed: API call failed: {0}")]
    Api(String),
    #[error("test bed: {0}")]
    Storage(String),
}

impl From<kube::Error> for BedError {
    fn from(e: kube::Error) -> Self {
        BedError::Api(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_component_that_does_not_get_ready_is_named_with_its_log_and_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("kubelet-guest-1.log");
        let lines: Vec<String> = (1..=40).map(|i| format!("line {i}")).collect();
        std::fs::write(&log, lines.join("\n")).unwrap();
        let e = BedError::Timeout {
            component: "kubelet-guest-1".into(),
            log: log.clone(),
            what: "Node guest-1 to be registered (90s)".into(),
        }
        .to_string();
        assert!(e.contains("kubelet-guest-1"), "{e}");
        assert!(e.contains(&log.display().to_string()), "{e}");
        assert!(e.contains("line 40") && e.contains("line 26"), "{e}");
        assert!(!e.contains("line 25\n"), "only the last 15 lines: {e}");
    }
}
