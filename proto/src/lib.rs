//! The CSI spec v1.12.0 as Rust types, tonic servers and tonic clients.
//!
//! Source: `csi/v1.12.0/csi.proto`, see `csi/v1.12.0/SOURCE.md` for its tag and sha256.
//!
//! Also the kubelet's plugin registration API (`pluginregistration`, from k8s.io/kubelet v0.34.4,
//! see `pluginregistration/v0.34.4/SOURCE.md`), which the test bed's registrar serves.

#[allow(clippy::all, clippy::pedantic)]
pub mod csi {
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// k8s.io/kubelet `pkg/apis/pluginregistration/v1`: the `Registration` service a plugin serves
/// on a socket in `<kubelet root>/plugins_registry/`. The proto package is `pluginregistration`.
#[allow(clippy::all, clippy::pedantic)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// `CSIPlugin`, the plugin type of a CSI driver (k8s.io/kubelet v0.34.4
    /// `pkg/apis/pluginregistration/v1/constants.go`).
    pub const CSI_PLUGIN: &str = "CSIPlugin";
}

/// The encoded file descriptor set of `csi.proto`, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/csi_descriptor.bin"));

/// The CSI spec version this crate was generated from.
pub const CSI_SPEC_VERSION: &str = "1.12.0";
