//! The Harvester "cloud-config": a kubeconfig for the Harvester cluster whose current context's
//! namespace is the namespace holding the guest VMs (same format and path as upstream).

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};

/// Default path of the cloud-config inside the upstream charts' pods.
pub const DEFAULT_PATH: &str = "/etc/kubernetes/cloud-config";

#[derive(Debug, thiserror::Error)]
pub enum CloudConfigError {
    #[error("reading cloud-config {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("cloud-config {path} has no usable current context: {source}")]
    Context {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("building the Harvester client from cloud-config {path}: {source}")]
    Client {
        path: PathBuf,
        #[source]
        source: kube::Error,
    },
}

/// A client for the Harvester cluster and the namespace that holds the guest VMs.
#[derive(Clone)]
pub struct Harvester {
    pub client: kube::Client,
    pub namespace: String,
    pub path: PathBuf,
}

impl std::fmt::Debug for Harvester {
    // The client holds credentials; never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harvester")
            .field("namespace", &self.namespace)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Harvester {
    /// Loads the cloud-config at `path`. The namespace is the current context's, `default` if unset.
    pub async fn load(path: &Path) -> Result<Self, CloudConfigError> {
        Self::load_with_metrics(path, None).await
    }

    /// As [`Harvester::load`], counting the client's API requests in `metrics`.
    pub async fn load_with_metrics(
        path: &Path,
        metrics: Option<&crate::telemetry::Metrics>,
    ) -> Result<Self, CloudConfigError> {
        let kubeconfig = Kubeconfig::read_from(path).map_err(|source| CloudConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| CloudConfigError::Context {
                    path: path.to_path_buf(),
                    source,
                })?;
        let namespace = config.default_namespace.clone();
        let client = crate::telemetry::kube_client(config, metrics).map_err(|source| {
            CloudConfigError::Client {
                path: path.to_path_buf(),
                source,
            }
        })?;
        Ok(Harvester {
            client,
            namespace,
            path: path.to_path_buf(),
        })
    }
}
