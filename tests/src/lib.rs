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

pub mod apply;
pub mod bed;
pub mod certs;
pub mod cluster;
pub mod guest_cluster;
pub mod helm;
pub mod images;
pub mod livenessprobe;
pub mod mounts;
pub mod netns;
pub mod nfs;
pub mod node;
pub mod observe;
pub mod pod_logs;
pub mod podnet;
pub mod process;
pub mod rbac;
pub mod registrar;
pub mod scrape;
pub mod service_controller;
pub mod sim;
pub mod tools;
pub mod users_cluster;
pub mod vm;
pub mod wait;

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
        crate::process::tail(.log, 15)
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
