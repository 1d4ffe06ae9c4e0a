//! The CSI spec v1.12.0 as Rust types, tonic servers and tonic clients.
//!
//! Source: `csi/v1.12.0/csi.proto`, see `csi/v1.12.0/SOURCE.md` for its tag and sha256.

#[allow(clippy::all, clippy::pedantic)]
pub mod csi {
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// The encoded file descriptor set of `csi.proto`, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/csi_descriptor.bin"));

/// The CSI spec version this crate was generated from.
pub const CSI_SPEC_VERSION: &str = "1.12.0";
