//! ListVolumes and ControllerGetVolume: the driver's volumes with the nodes they are published
//! to and their condition ([`super::status`]). The VMs and VMIs come from the watch cache; the
//! host PVCs from one list of the namespace's PVCs (ListVolumes) or one read (GetVolume).
//!
//! The driver's volumes: this guest cluster's host PVCs ([`crate::controller::owner`]) that
//! are labelled [`LABEL_DRIVER`] (every one this driver creates) or hot-plugged into a VM
//! (adopted ones upstream's driver made, which carry no label), in name order so that a page token (an index, as ListSnapshots') stays meaningful.
//! A host PVC being deleted (Terminating) is no volume any more: DeleteVolume has answered.

use std::collections::BTreeSet;
use std::sync::Arc;

use csi_proto::csi::v1::*;
use harvester_common::harvester::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;

use super::Hotplug;
use super::status::{abnormal, published_nodes};
use crate::controller::host_pvc::{LABEL_DRIVER, csi_volume, requested_bytes};
use crate::controller::snapshots::page;
use crate::error::ControllerError;
use crate::request::required;

type Cached = (Vec<Arc<VirtualMachine>>, Vec<Arc<VirtualMachineInstance>>);

impl Hotplug<'_> {
    pub async fn list_volumes(
        &self,
        req: &ListVolumesRequest,
    ) -> Result<ListVolumesResponse, ControllerError> {
        // Reject a bad token before any read.
        if !req.starting_token.is_empty() && req.starting_token.parse::<usize>().is_err() {
            return Err(ControllerError::BadToken(req.starting_token.clone()));
        }
        let cached = self.vm_cache.all().await?;
        let hotplugged: BTreeSet<String> = cached
            .0
            .iter()
            .flat_map(|vm| vm.spec.template.spec.volumes.iter())
            .filter(|v| v.hotpluggable())
            .filter_map(|v| v.persistent_volume_claim.as_ref())
            .map(|p| p.claim_name.clone())
            .collect();
        let pvcs = self.pvcs().list(&Default::default()).await;
        let pvcs = pvcs.map_err(ControllerError::api(format!(
            "listing PVCs in {}",
            self.ns()
        )))?;
        let mut mine: Vec<PersistentVolumeClaim> = pvcs
            .items
            .into_iter()
            // A PVC being deleted is a deleted volume (DeleteVolume has answered).
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            // Another guest cluster's volumes are not listed, even where a VM has them.
            .filter(|p| self.owner.owns(&p.metadata))
            .filter(|p| {
                let labelled = p.metadata.labels.as_ref().and_then(|l| l.get(LABEL_DRIVER));
                labelled.is_some_and(|v| v == crate::DRIVER_NAME)
                    || p.metadata
                        .name
                        .as_ref()
                        .is_some_and(|n| hotplugged.contains(n))
            })
            .collect();
        mine.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let (pvcs, next_token) = page(&mine, &req.starting_token, req.max_entries)?;
        let entries = pvcs
            .iter()
            .map(|pvc| {
                let (volume, published, condition) = self.describe(pvc, &cached);
                list_volumes_response::Entry {
                    volume: Some(volume),
                    status: Some(list_volumes_response::VolumeStatus {
                        published_node_ids: published,
                        volume_condition: Some(condition),
                    }),
                }
            })
            .collect();
        Ok(ListVolumesResponse {
            entries,
            next_token,
        })
    }

    pub async fn get_volume(
        &self,
        req: &ControllerGetVolumeRequest,
    ) -> Result<ControllerGetVolumeResponse, ControllerError> {
        let id = required("volume_id", &req.volume_id)?;
        let pvc = self.existing(id).await?;
        if pvc.metadata.deletion_timestamp.is_some() {
            return Err(ControllerError::VolumeNotFound {
                namespace: self.ns().to_string(),
                volume: id.to_string(),
            });
        }
        let cached = self.vm_cache.all().await?;
        let (volume, published, condition) = self.describe(&pvc, &cached);
        Ok(ControllerGetVolumeResponse {
            volume: Some(volume),
            status: Some(controller_get_volume_response::VolumeStatus {
                published_node_ids: published,
                volume_condition: Some(condition),
            }),
        })
    }

    /// The CSI volume of host PVC `pvc`, its published nodes and its condition.
    fn describe(
        &self,
        pvc: &PersistentVolumeClaim,
        (vms, vmis): &Cached,
    ) -> (Volume, Vec<String>, VolumeCondition) {
        let id = pvc.metadata.name.clone().unwrap_or_default();
        let volume = csi_volume(&id, requested_bytes(pvc).unwrap_or(0), None);
        let published = published_nodes(&id, vms, vmis);
        let condition = match abnormal(&id, pvc, vms, vmis) {
            Some(message) => VolumeCondition {
                abnormal: true,
                message,
            },
            None => VolumeCondition {
                abnormal: false,
                message: format!(
                    "host PVC {}/{id} is Bound; every VM that has the volume reports it Ready",
                    self.ns()
                ),
            },
        };
        (volume, published, condition)
    }
}
