//! The OCI image layout (image-spec v1.1: `image-layout.md`, `manifest.md`, `config.md`) of one
//! image: `oci-layout`, `index.json` and `blobs/sha256/<digest>` (layer, config, manifest). As
//! a tar it is what `skopeo copy oci-archive:...` and `ctr images import` take (containerd names
//! the image from the `io.containerd.image.name` annotation, `core/images/annotations.go`;
//! skopeo reads `org.opencontainers.image.ref.name`, the tag).
//!
//! Nothing here reads the clock: the same layer gives the same config, manifest and digests.

use serde_json::{Value, json};

pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
/// containerd's annotation naming an imported image (`images.AnnotationImageName`).
pub const CONTAINERD_NAME: &str = "io.containerd.image.name";
/// The OCI annotation of a reference in a layout (`ocispec.AnnotationRefName`).
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Every image's creation time: the epoch, so a rebuild gives the same config.
pub const CREATED: &str = "1970-01-01T00:00:00Z";

/// How the layer blob is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// The tar as it is: the test bed's images (imported locally, packing stays fast).
    None,
    /// `gzip -n` (no name, no timestamp): images users push to a registry and nodes pull.
    Gzip,
}

impl Compression {
    pub fn layer_media_type(self) -> &'static str {
        match self {
            Compression::None => "application/vnd.oci.image.layer.v1.tar",
            Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
        }
    }
}

/// A blob: `sha256:<hex>` and its size in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub hex: String,
    pub size: u64,
}

impl Blob {
    pub fn digest(&self) -> String {
        format!("sha256:{}", self.hex)
    }

    fn descriptor(&self, media_type: &str) -> Value {
        json!({"mediaType": media_type, "digest": self.digest(), "size": self.size})
    }
}

/// The image config: amd64/linux, the entrypoint, `PATH`, and the layer's diff ID (the
/// sha256 of the uncompressed layer tar).
pub fn config_json(entrypoint: &[String], diff_id: &str) -> Value {
    json!({
        "architecture": "amd64",
        "os": "linux",
        "created": CREATED,
        "config": {
            "Entrypoint": entrypoint,
            "Env": [super::PATH_ENV],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
        "history": [{"created": CREATED, "created_by": "testbed::real::images"}],
    })
}

/// The image manifest: the config and the one layer.
pub fn manifest_json(config: &Blob, layer: &Blob, compression: Compression) -> Value {
    json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": config.descriptor(CONFIG_MEDIA_TYPE),
        "layers": [layer.descriptor(compression.layer_media_type())],
    })
}

/// `index.json`: the manifest, its platform, and the image's names (`repository:tag` for
/// containerd, the tag for skopeo).
pub fn index_json(manifest: &Blob, name: &str) -> Value {
    let mut descriptor = manifest.descriptor(MANIFEST_MEDIA_TYPE);
    descriptor["platform"] = json!({"architecture": "amd64", "os": "linux"});
    descriptor["annotations"] = json!({CONTAINERD_NAME: name, REF_NAME: tag_of(name)});
    json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": [descriptor],
    })
}

/// `oci-layout`.
pub fn layout_json() -> Value {
    json!({"imageLayoutVersion": "1.0.0"})
}

/// The tag of `repository:tag` (a `:` before the last `/` is a registry's port); "latest" when
/// the name has none, as a registry takes it.
pub fn tag_of(name: &str) -> &str {
    let last = name.rsplit('/').next().unwrap_or(name);
    match last.rsplit_once(':') {
        Some((_, tag)) if !tag.is_empty() => tag,
        _ => "latest",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(hex: &str, size: u64) -> Blob {
        Blob {
            hex: hex.into(),
            size,
        }
    }

    #[test]
    fn tags_are_after_the_last_path_component_colon() {
        assert_eq!(tag_of("localhost/pause:3.10"), "3.10");
        assert_eq!(tag_of("registry:5000/team/ccm:0.1.0"), "0.1.0");
        assert_eq!(tag_of("registry:5000/team/ccm"), "latest");
        assert_eq!(tag_of("ccm"), "latest");
    }

    #[test]
    fn config_names_the_layer_by_its_diff_id() {
        let c = config_json(&["/pause".into()], "ab");
        assert_eq!(c["architecture"], "amd64");
        assert_eq!(c["os"], "linux");
        assert_eq!(c["created"], CREATED);
        assert_eq!(c["config"]["Entrypoint"], json!(["/pause"]));
        assert_eq!(c["config"]["Env"], json!([super::super::PATH_ENV]));
        assert_eq!(c["rootfs"]["diff_ids"], json!(["sha256:ab"]));
    }

    #[test]
    fn manifest_and_index_have_the_image_spec_shape() {
        let m = manifest_json(&blob("cc", 10), &blob("11", 20), Compression::Gzip);
        assert_eq!(
            m,
            json!({
                "schemaVersion": 2,
                "mediaType": MANIFEST_MEDIA_TYPE,
                "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": "sha256:cc", "size": 10},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                            "digest": "sha256:11", "size": 20}],
            })
        );
        let m = manifest_json(&blob("cc", 10), &blob("11", 20), Compression::None);
        assert_eq!(
            m["layers"][0]["mediaType"],
            "application/vnd.oci.image.layer.v1.tar"
        );
        let i = index_json(&blob("ee", 30), "localhost/harvester-csi-driver:0.1.0");
        assert_eq!(
            i,
            json!({
                "schemaVersion": 2,
                "mediaType": INDEX_MEDIA_TYPE,
                "manifests": [{
                    "mediaType": MANIFEST_MEDIA_TYPE, "digest": "sha256:ee", "size": 30,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        CONTAINERD_NAME: "localhost/harvester-csi-driver:0.1.0",
                        REF_NAME: "0.1.0",
                    },
                }],
            })
        );
    }
}
