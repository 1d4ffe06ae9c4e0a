//! Identity service: name and version, capabilities, and Probe.

use csi_proto::csi::v1::identity_server::Identity;
use csi_proto::csi::v1::plugin_capability::{self, service, volume_expansion};
use csi_proto::csi::v1::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};
use tonic::{Request, Response, Status};

use crate::{DRIVER_NAME, Mode, VERSION};

pub struct IdentityService {
    mode: Mode,
}

impl IdentityService {
    pub fn new(mode: Mode) -> Self {
        IdentityService { mode }
    }
}

/// Plugin capabilities: the controller service when it is served, and online expansion.
pub fn plugin_capabilities(mode: Mode) -> Vec<PluginCapability> {
    let mut caps = Vec::new();
    if mode.controller() {
        caps.push(PluginCapability {
            r#type: Some(plugin_capability::Type::Service(
                plugin_capability::Service {
                    r#type: service::Type::ControllerService as i32,
                },
            )),
        });
    }
    caps.push(PluginCapability {
        r#type: Some(plugin_capability::Type::VolumeExpansion(
            plugin_capability::VolumeExpansion {
                r#type: volume_expansion::Type::Online as i32,
            },
        )),
    });
    caps
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.to_string(),
            vendor_version: VERSION.to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: plugin_capabilities(self.mode),
        }))
    }

    /// Ready whenever the plugin serves. Harvester's reachability is reported on `/readyz`, not
    /// here: the livenessprobe sidecar restarts the plugin on a failed Probe, and a restart cannot
    /// bring Harvester back (it would only put the plugin into a crash loop during an outage).
    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_only_plugins_do_not_claim_the_controller_service() {
        assert_eq!(plugin_capabilities(Mode::All).len(), 2);
        assert_eq!(plugin_capabilities(Mode::Controller).len(), 2);
        let node = plugin_capabilities(Mode::Node);
        assert_eq!(node.len(), 1);
        assert!(matches!(
            node[0].r#type,
            Some(plugin_capability::Type::VolumeExpansion(_))
        ));
    }
}
