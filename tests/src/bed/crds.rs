//! The CRDs the bed installs (KubeVirt, Harvester LoadBalancer, snapshot, backup, settings,
//! networkfs) and the `server-version` the bed gives Harvester: what the whole bed
//! ([`crate::bed::TestBed`]), the real guest cluster and the stand-in all need, kept here so that
//! none of them imports another.

use std::time::Duration;

use harvester_common::harvester::HotplugMode;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

use crate::bed::apply::apply_yaml;
use crate::{BedError, util::wait};

pub(crate) const CRDS: [(&str, &str); 6] = [
    ("kubevirt.yaml", include_str!("../../crds/kubevirt.yaml")),
    (
        "loadbalancer.yaml",
        include_str!("../../crds/loadbalancer.yaml"),
    ),
    ("snapshot.yaml", include_str!("../../crds/snapshot.yaml")),
    ("backup.yaml", include_str!("../../crds/backup.yaml")),
    ("settings.yaml", include_str!("../../crds/settings.yaml")),
    ("networkfs.yaml", include_str!("../../crds/networkfs.yaml")),
];

/// Multus' NetworkAttachmentDefinition CRD, which Harvester installs: virt-controller reads a VM's
/// Multus network from it, and Harvester's real LB controller watches it.
pub(crate) const NAD_CRD: (&str, &str) = ("nad.yaml", include_str!("../../crds/nad.yaml"));

/// `server-version` the bed gives Harvester for each hot-plug mode.
pub fn server_version_for(mode: HotplugMode) -> &'static str {
    match mode {
        HotplugMode::Subresource => "v1.7.1",
        HotplugMode::Declarative => "v1.8.0",
    }
}

/// Every CRD of [`CRDS`]. With KubeVirt's own binaries (`kubevirt_own`, [`crate::bed::kubevirt`])
/// their install brings the KubeVirt CRDs instead of `kubevirt.yaml`, and [`NAD_CRD`] comes too:
/// their virt-controller reads a VM's Multus network.
pub(crate) async fn install_crds(
    client: &kube::Client,
    kubevirt_own: bool,
) -> Result<(), BedError> {
    for (file, yaml) in CRDS {
        if file == "kubevirt.yaml" && kubevirt_own {
            continue;
        }
        install_crd_yaml(client, file, yaml).await?;
    }
    if kubevirt_own {
        install_crd_yaml(client, NAD_CRD.0, NAD_CRD.1).await?;
    }
    Ok(())
}

/// Applies the CRDs of `yaml` (from `file`) and waits until each is Established.
pub(crate) async fn install_crd_yaml(
    client: &kube::Client,
    file: &str,
    yaml: &str,
) -> Result<(), BedError> {
    let mut names = Vec::new();
    for obj in apply_yaml(client, yaml, "default")
        .await
        .map_err(|e| BedError::Setup(format!("installing {file}: {e}")))?
    {
        names.extend(obj.metadata.name);
    }
    wait_established(client, names).await
}

/// The `metadata.name`s of the CRDs in a multi-document YAML.
pub(crate) fn crd_names(yaml: &str) -> Vec<String> {
    serde_saphyr::from_multiple::<serde_json::Value>(yaml)
        .unwrap_or_default()
        .iter()
        .filter_map(|doc| doc["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

pub(crate) async fn wait_established(
    client: &kube::Client,
    names: Vec<String>,
) -> Result<(), BedError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in names {
        wait::until(
            &format!("CRD {name} Established"),
            Duration::from_secs(30),
            || {
                let crds = crds.clone();
                let name = name.clone();
                async move {
                    let crd = crds.get(&name).await.map_err(|e| e.to_string())?;
                    let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
                    Ok(
                        if conditions
                            .iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                        {
                            Ok(())
                        } else {
                            Err(conditions)
                        },
                    )
                }
            },
        )
        .await
        .map_err(BedError::Setup)?;
    }
    Ok(())
}
