//! The release images of `make images`: `harvester-cloud-provider` and `harvester-csi-driver`
//! (with every program its node plugin runs), from the binaries of one cargo profile, as
//! gzip-layered OCI archives `<out>/<image>-<version>.oci.tar`, tagged with the workspace
//! version (the charts' appVersion, their default tag). Same binaries, same digests.

use std::path::{Path, PathBuf};

use crate::BedError;

use super::{Compression, Recipe};

/// The workspace version (Cargo.toml `[workspace.package]`; this crate inherits it).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The image names' default prefix: `ctr images import` on a node stores
/// `localhost/harvester-cloud-provider:<version>`, a name no registry answers for.
pub const DEFAULT_PREFIX: &str = "localhost";

/// The two images: (program and image name, recipe builder).
type RecipeFn = fn(String, &Path) -> Result<Recipe, BedError>;
const IMAGES: &[(&str, RecipeFn)] = &[
    ("harvester-cloud-provider", super::cloud_provider),
    ("harvester-csi-driver", super::csi_driver),
];

/// One image written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    /// `<prefix>/<program>:<version>`.
    pub name: String,
    pub archive: PathBuf,
    /// The manifest's digest (`sha256:...`): what a registry reports after a push.
    pub digest: String,
    /// The archive file's sha256.
    pub archive_sha256: String,
}

/// A repository prefix: `host[:port]` and path components (`registry.example.com:5000/team`),
/// as the distribution reference grammar spells them; no scheme, no tag, no spaces.
pub fn parse_prefix(prefix: &str) -> Result<String, BedError> {
    let bad = |why: &str| {
        BedError::Setup(format!(
            "image prefix {prefix:?} {why} (expected host[:port][/path], e.g. registry.example.com/team)"
        ))
    };
    let prefix = prefix.trim_end_matches('/');
    if prefix.contains("://") {
        return Err(bad("has a scheme"));
    }
    let mut parts = prefix.split('/');
    let host = parts.next().unwrap_or_default();
    let (name, port) = match host.split_once(':') {
        Some((n, p)) => (n, Some(p)),
        None => (host, None),
    };
    let host_ok = !name.is_empty()
        && name
            .split('.')
            .all(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        && port.is_none_or(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
    if !host_ok {
        return Err(bad("has no valid host"));
    }
    for part in parts {
        let ok = !part.is_empty()
            && part.chars().all(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')
            })
            && part.starts_with(|c: char| c.is_ascii_alphanumeric())
            && part.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !ok {
            return Err(bad(&format!("has a bad path component {part:?}")));
        }
    }
    Ok(prefix.to_string())
}

/// The archive of `program`: `<program>-<version>.oci.tar`.
pub fn archive_name(program: &str) -> String {
    format!("{program}-{VERSION}.oci.tar")
}

/// Builds both images from the binaries in `bin_dir` (`target/release` for `make images`)
/// into `out_dir`, named `<prefix>/<program>:<version>`.
pub fn build(bin_dir: &Path, out_dir: &Path, prefix: &str) -> Result<Vec<Built>, BedError> {
    let prefix = parse_prefix(prefix)?;
    std::fs::create_dir_all(out_dir)
        .map_err(|e| BedError::Setup(format!("creating {}: {e}", out_dir.display())))?;
    let mut built = Vec::new();
    for (program, recipe) in IMAGES {
        let binary = bin_dir.join(program);
        if !binary.is_file() {
            return Err(BedError::Setup(format!(
                "{} is not built: run `make release`",
                binary.display()
            )));
        }
        let name = format!("{prefix}/{program}:{VERSION}");
        let archive = out_dir.join(archive_name(program));
        let digest = super::pack(&recipe(name.clone(), &binary)?, &archive, Compression::Gzip)?;
        built.push(Built {
            name,
            archive_sha256: super::sha256(&archive)?,
            archive,
            digest,
        });
    }
    Ok(built)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_hosts_and_paths_without_scheme() {
        for ok in [
            "localhost",
            "registry.example.com",
            "registry.example.com:5000/team/sub",
            "10.0.0.1:5000",
            "ghcr.io/my-org/",
        ] {
            assert!(parse_prefix(ok).is_ok(), "{ok}");
        }
        assert_eq!(parse_prefix("ghcr.io/org/").unwrap(), "ghcr.io/org");
        for (bad, says) in [
            ("https://registry.example.com", "has a scheme"),
            ("registry example.com", "no valid host"),
            ("", "no valid host"),
            ("registry:port", "no valid host"),
            ("registry.example.com/Team", "bad path component \"Team\""),
            ("registry.example.com/team:v1", "bad path component"),
            ("registry.example.com//team", "bad path component \"\""),
        ] {
            let e = parse_prefix(bad).unwrap_err().to_string();
            assert!(
                e.contains(says) && e.contains(&format!("{bad:?}")),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn archives_carry_the_workspace_version() {
        assert_eq!(
            archive_name("harvester-csi-driver"),
            format!("harvester-csi-driver-{VERSION}.oci.tar")
        );
        assert!(!VERSION.is_empty());
    }

    #[test]
    fn a_missing_binary_names_the_build_step() {
        let dir = tempfile::tempdir().unwrap();
        let e = build(dir.path(), &dir.path().join("out"), "localhost")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("harvester-cloud-provider is not built") && e.contains("make release"),
            "{e}"
        );
    }
}
