//! The guest cluster's client, as both programs reach it: a kubeconfig file when given, else
//! the in-cluster config (then `KUBECONFIG`), counted into the process's API request metrics.

use std::path::Path;

use crate::telemetry::Metrics;

/// The guest client's config: `path`, else inferred (in-cluster, then `KUBECONFIG`).
pub async fn config(path: Option<&Path>) -> Result<kube::Config, String> {
    match path {
        Some(p) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(p).map_err(|e| e.to_string())?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|e| e.to_string())
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string()),
    }
}

/// A client from `config`, its requests counted into `metrics`.
pub fn client(config: kube::Config, metrics: Option<&Metrics>) -> Result<kube::Client, String> {
    crate::api_client::kube_client(config, metrics).map_err(|e| e.to_string())
}
