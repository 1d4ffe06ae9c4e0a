//! Container images built without a registry or docker: each image is an OCI image layout
//! archive ([`oci`]: one layer, config, manifest, `index.json`) that `ctr images import` and
//! `skopeo copy oci-archive:...` take. One writer ([`pack`]) serves the test bed and the release
//! images of `make images` ([`release`]).
//!
//! The bed's images (issue 15), for the real guest node:
//! - the pause image containerd runs in every sandbox ([`crate::real::node::SANDBOX_IMAGE`]): the
//!   `pause` binary of this crate;
//! - our two programs (`harvester-cloud-provider`, `harvester-csi-driver`: the debug build
//!   `cargo test` makes), the CSI driver with every program its node plugin runs (mkfs, blkid,
//!   mount, ...; [`NODE_PLUGIN_PROGRAMS`]);
//! - the bed's stand-ins for node-driver-registrar and livenessprobe (`registrar`,
//!   `livenessprobe`), which the Go module proxy does not serve here;
//! - the CSI sidecars from `make node-tools` (static Go binaries, one file each).
//!
//! A dynamic binary brings the libraries `ldd` names and the ELF interpreter. The image is
//! "usr-merged" as Debian 12 is: `/bin`, `/sbin`, `/lib`, `/lib64` are links into `/usr`. Layers
//! and archives are deterministic: sorted, mtime 0, owner root (GNU tar), fixed modes, no clock
//! in the config, so the same inputs give the same digests.

pub mod oci;
pub mod release;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::BedError;
pub use oci::Compression;

/// The tag of every image the bed builds.
pub const TAG: &str = "testbed";

/// Repositories (image names without the tag), for the charts' `image.repository` values.
pub const CLOUD_PROVIDER_REPO: &str = "localhost/harvester-rs/harvester-cloud-provider";
pub const CSI_DRIVER_REPO: &str = "localhost/harvester-rs/harvester-csi-driver";
pub const REGISTRAR_REPO: &str = "localhost/testbed/csi-node-driver-registrar";
pub const LIVENESSPROBE_REPO: &str = "localhost/testbed/livenessprobe";
pub const PROVISIONER_REPO: &str = "localhost/testbed/csi-provisioner";
pub const ATTACHER_REPO: &str = "localhost/testbed/csi-attacher";
pub const RESIZER_REPO: &str = "localhost/testbed/csi-resizer";
pub const SNAPSHOTTER_REPO: &str = "localhost/testbed/csi-snapshotter";

/// What the node plugin executes (`csi/src/node/{filesystem,mount}.rs`: `Cmd::new(..)`, and
/// `setpriv --pdeathsig` for the commands that must die with the plugin).
pub const NODE_PLUGIN_PROGRAMS: &[&str] = &[
    "setpriv",
    "mkfs.ext4",
    "mkfs.xfs",
    "blkid",
    "mount",
    "umount",
    "resize2fs",
    "xfs_growfs",
    // RWX volumes (`csi/src/node/nfs.rs`): Debian nfs-common's NFS mount helper.
    "mount.nfs",
    // RWX under upstream's chart (hostPID, no host network): `nsenter --net=/proc/1/ns/net`.
    "nsenter",
];

/// Configuration files the node plugin's programs read, brought along when the host has them
/// (`/etc/netconfig`: libtirpc's transports, read by mount.nfs).
pub const NODE_PLUGIN_FILES: &[&str] = &["/etc/mke2fs.conf", "/etc/netconfig"];

/// `PATH` in every image, Debian's default for root.
pub const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Directories every image has (containerd mounts over some of them).
const BASE_DIRS: &[&str] = &[
    "dev",
    "etc",
    "proc",
    "run",
    "sys",
    "tmp",
    "usr",
    "usr/bin",
    "usr/lib",
    "usr/lib64",
    "usr/sbin",
    "var",
];

/// The top-level links of a usr-merged root, as Debian 12 has them.
const USR_MERGED: &[(&str, &str)] = &[
    ("bin", "usr/bin"),
    ("lib", "usr/lib"),
    ("lib64", "usr/lib64"),
    ("sbin", "usr/sbin"),
];

/// A built image: its full name (`repository:tag`) and its OCI image layout archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub name: String,
    pub tarball: PathBuf,
}

/// Every image of the bed.
#[derive(Debug, Clone)]
pub struct ImageSet {
    pub pause: Image,
    pub cloud_provider: Image,
    pub csi_driver: Image,
    pub registrar: Image,
    pub livenessprobe: Image,
    pub provisioner: Image,
    pub attacher: Image,
    pub resizer: Image,
    pub snapshotter: Image,
}

impl ImageSet {
    pub fn all(&self) -> Vec<&Image> {
        vec![
            &self.pause,
            &self.cloud_provider,
            &self.csi_driver,
            &self.registrar,
            &self.livenessprobe,
            &self.provisioner,
            &self.attacher,
            &self.resizer,
            &self.snapshotter,
        ]
    }
}

/// `<repository>:testbed`.
pub fn name(repository: &str) -> String {
    format!("{repository}:{TAG}")
}

/// A program going into an image: where it is on the host, where it goes in the image, and
/// the shared libraries and ELF interpreter it loads (as `ldd` names them; empty when static).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    pub host: PathBuf,
    pub image_path: PathBuf,
    pub libraries: Vec<PathBuf>,
}

/// What to build: the image's name, entrypoint and programs, and extra files (host path, path
/// in the image).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipe {
    pub name: String,
    pub entrypoint: Vec<String>,
    pub programs: Vec<Program>,
    pub files: Vec<(PathBuf, PathBuf)>,
}

/// One entry of an image's file system (paths in the image are relative, without a leading `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Dir,
    /// A regular file with the content (and mode) of this host file.
    File(PathBuf),
    Symlink(PathBuf),
}

/// Where a path of a usr-merged system lives in the image: `/lib/x` -> `usr/lib/x`,
/// `/lib64/ld.so` -> `usr/lib64/ld.so`, `/usr/bin/x` -> `usr/bin/x`.
pub fn image_path(path: &Path) -> PathBuf {
    let rel = path.strip_prefix("/").unwrap_or(path);
    for (link, target) in USR_MERGED {
        if let Ok(rest) = rel.strip_prefix(link) {
            return Path::new(target).join(rest);
        }
    }
    rel.to_path_buf()
}

/// The file list of an image (path in the image -> entry): base directories, the usr-merge
/// links, every program at its path and every library at its usual path, the extra files, and
/// the parent directories of all of them. Two different host files for one path are an error.
pub fn file_list(recipe: &Recipe) -> Result<BTreeMap<PathBuf, Entry>, BedError> {
    let mut out: BTreeMap<PathBuf, Entry> = BTreeMap::new();
    for d in BASE_DIRS {
        out.insert(PathBuf::from(d), Entry::Dir);
    }
    for (link, target) in USR_MERGED {
        out.insert(PathBuf::from(link), Entry::Symlink(PathBuf::from(target)));
    }
    out.insert(
        PathBuf::from("etc/mtab"),
        Entry::Symlink(PathBuf::from("../proc/self/mounts")),
    );
    let mut files: Vec<(PathBuf, PathBuf)> = Vec::new();
    for p in &recipe.programs {
        files.push((p.host.clone(), image_path(&p.image_path)));
        for lib in &p.libraries {
            files.push((lib.clone(), image_path(lib)));
        }
    }
    files.extend(
        recipe
            .files
            .iter()
            .map(|(host, at)| (host.clone(), image_path(at))),
    );
    for (host, at) in files {
        if at.as_os_str().is_empty() || at.components().any(|c| c.as_os_str() == "..") {
            return Err(BedError::Setup(format!(
                "image {}: bad path {} for {}",
                recipe.name,
                at.display(),
                host.display()
            )));
        }
        let mut parent = at.parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            match out.get(p) {
                None => {
                    out.insert(p.to_path_buf(), Entry::Dir);
                }
                Some(Entry::Dir) => {}
                Some(other) => {
                    return Err(BedError::Setup(format!(
                        "image {}: {} needs directory {}, which is {other:?}",
                        recipe.name,
                        at.display(),
                        p.display()
                    )));
                }
            }
            parent = p.parent();
        }
        match out.get(&at) {
            None => {
                out.insert(at, Entry::File(host));
            }
            Some(Entry::File(h)) if *h == host => {}
            Some(other) => {
                return Err(BedError::Setup(format!(
                    "image {}: {} would be both {} and {other:?}",
                    recipe.name,
                    at.display(),
                    host.display()
                )));
            }
        }
    }
    Ok(out)
}

/// The libraries and ELF interpreter in `ldd`'s output, in its order. A library that is "not
/// found" is an error naming it; a static binary has none.
pub fn parse_ldd(output: &str) -> Result<Vec<PathBuf>, String> {
    let mut libs = Vec::new();
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("not a dynamic executable") || line.contains("statically linked") {
            return Ok(Vec::new());
        }
        let path = match line.split_once("=>") {
            Some((lib, rest)) => {
                let rest = rest.trim();
                if rest.starts_with("not found") {
                    return Err(format!("library {} not found", lib.trim()));
                }
                rest.split_whitespace().next().unwrap_or_default()
            }
            None => line.split_whitespace().next().unwrap_or_default(),
        };
        // linux-vdso.so.1 (0x...) is in the kernel, not a file.
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        }
    }
    Ok(libs)
}

/// The program's libraries, from `ldd` (none for a static binary).
pub fn libraries(program: &Path) -> Result<Vec<PathBuf>, BedError> {
    let out = Command::new("ldd")
        .arg(program)
        .output()
        .map_err(|e| BedError::Setup(format!("running ldd {}: {e}", program.display())))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        // ldd exits 1 for a static binary, saying so.
        if text.contains("not a dynamic executable") {
            return Ok(Vec::new());
        }
        return Err(BedError::Setup(format!(
            "ldd {} failed ({}): {}",
            program.display(),
            out.status,
            text.trim()
        )));
    }
    parse_ldd(&text).map_err(|e| BedError::Setup(format!("ldd {}: {e}", program.display())))
}

/// A program of the host found in `PATH`-like `dirs`, going to the same path in the image.
fn host_program(name: &str) -> Result<Program, BedError> {
    let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            BedError::Setup(format!(
                "{name} is not installed on this host (the CSI driver image needs it; \
                 tests/scripts/tools.sh installs e2fsprogs, xfsprogs, util-linux and, with nfs-ganesha, nfs-common)"
            ))
        })?;
    program(&found, &found)
}

fn program(host: &Path, at: &Path) -> Result<Program, BedError> {
    Ok(Program {
        host: host.to_path_buf(),
        image_path: at.to_path_buf(),
        libraries: libraries(host)?,
    })
}

/// A binary of this workspace (`target/<profile>/<name>`), or an error naming the build step.
fn workspace_binary(name: &str) -> Result<PathBuf, BedError> {
    crate::util::process::find_built_binary(name).map_err(BedError::Setup)
}

/// A CSI sidecar from `make node-tools`, or an error saying to run it.
fn sidecar(dir: &Path, name: &str) -> Result<PathBuf, BedError> {
    let p = dir.join(name);
    if p.is_file() {
        Ok(p)
    } else {
        Err(BedError::Setup(format!(
            "{name} is not built ({}): run `make node-tools` (tests/scripts/node-tools.sh)",
            p.display()
        )))
    }
}

/// The recipe of an image holding one binary as `/usr/bin/<file name>`, its entrypoint.
fn single(name: String, binary: &Path) -> Result<Recipe, BedError> {
    let file = binary
        .file_name()
        .ok_or_else(|| BedError::Setup(format!("{} has no file name", binary.display())))?;
    let at = Path::new("/usr/bin").join(file);
    Ok(Recipe {
        name,
        entrypoint: vec![at.display().to_string()],
        programs: vec![program(binary, &at)?],
        files: Vec::new(),
    })
}

/// The cloud provider's image `name`: the binary as `/usr/bin/harvester-cloud-provider`, the
/// entrypoint (the chart's Deployment runs `command: [harvester-cloud-provider]`).
pub fn cloud_provider(name: String, binary: &Path) -> Result<Recipe, BedError> {
    single(name, binary)
}

/// The CSI driver's image `name`: the binary as its entrypoint, every program its node plugin
/// runs ([`NODE_PLUGIN_PROGRAMS`], from the host) and their configuration files.
pub fn csi_driver(name: String, binary: &Path) -> Result<Recipe, BedError> {
    let mut csi = single(name, binary)?;
    for p in NODE_PLUGIN_PROGRAMS {
        csi.programs.push(host_program(p)?);
    }
    csi.files.extend(
        NODE_PLUGIN_FILES
            .iter()
            .map(Path::new)
            .filter(|p| p.is_file())
            .map(|p| (p.to_path_buf(), p.to_path_buf())),
    );
    Ok(csi)
}

/// Every recipe of the bed, with the host's files found (I/O: `ldd`, the binaries' paths).
pub fn recipes() -> Result<Vec<(&'static str, Recipe)>, BedError> {
    let tools = crate::real::node::node_tools_dir()?;
    let pause = workspace_binary("pause")?;
    let csi = csi_driver(
        name(CSI_DRIVER_REPO),
        &workspace_binary("harvester-csi-driver")?,
    )?;
    Ok(vec![
        (
            "pause",
            Recipe {
                name: crate::real::node::SANDBOX_IMAGE.to_string(),
                entrypoint: vec!["/pause".to_string()],
                programs: vec![program(&pause, Path::new("/pause"))?],
                files: Vec::new(),
            },
        ),
        (
            "cloud-provider",
            cloud_provider(
                name(CLOUD_PROVIDER_REPO),
                &workspace_binary("harvester-cloud-provider")?,
            )?,
        ),
        ("csi-driver", csi),
        (
            "registrar",
            single(name(REGISTRAR_REPO), &workspace_binary("registrar")?)?,
        ),
        (
            "livenessprobe",
            single(
                name(LIVENESSPROBE_REPO),
                &workspace_binary("livenessprobe")?,
            )?,
        ),
        (
            "provisioner",
            single(name(PROVISIONER_REPO), &sidecar(&tools, "csi-provisioner")?)?,
        ),
        (
            "attacher",
            single(name(ATTACHER_REPO), &sidecar(&tools, "csi-attacher")?)?,
        ),
        (
            "resizer",
            single(name(RESIZER_REPO), &sidecar(&tools, "csi-resizer")?)?,
        ),
        (
            "snapshotter",
            single(name(SNAPSHOTTER_REPO), &sidecar(&tools, "csi-snapshotter")?)?,
        ),
    ])
}

/// Packs every image of the bed into OCI archives under `out_dir` (`<out_dir>/<image>.tar`),
/// layers uncompressed (imported locally; packing stays fast).
pub fn build_all(out_dir: &Path) -> Result<ImageSet, BedError> {
    std::fs::create_dir_all(out_dir)
        .map_err(|e| BedError::Setup(format!("creating {}: {e}", out_dir.display())))?;
    let mut built = BTreeMap::new();
    for (key, recipe) in recipes()? {
        let tarball = out_dir.join(format!("{key}.tar"));
        pack(&recipe, &tarball, Compression::None)?;
        built.insert(
            key,
            Image {
                name: recipe.name,
                tarball,
            },
        );
    }
    let mut take = |key: &str| {
        built
            .remove(key)
            .ok_or_else(|| BedError::Setup(format!("no recipe for image {key}")))
    };
    Ok(ImageSet {
        pause: take("pause")?,
        cloud_provider: take("cloud-provider")?,
        csi_driver: take("csi-driver")?,
        registrar: take("registrar")?,
        livenessprobe: take("livenessprobe")?,
        provisioner: take("provisioner")?,
        attacher: take("attacher")?,
        resizer: take("resizer")?,
        snapshotter: take("snapshotter")?,
    })
}

fn io_err(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> BedError {
    let msg = format!("{what} {}", path.display());
    move |e| BedError::Setup(format!("{msg}: {e}"))
}

/// Runs `cmd`; a failure is an error naming `what` and the command's stderr.
fn run(what: &str, cmd: &mut Command) -> Result<String, BedError> {
    let out = cmd
        .output()
        .map_err(|e| BedError::Setup(format!("{what}: running {:?}: {e}", cmd.get_program())))?;
    if !out.status.success() {
        return Err(BedError::Setup(format!(
            "{what}: {:?} failed ({}): {}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The sha256 of a file, in hex.
pub fn sha256(path: &Path) -> Result<String, BedError> {
    let out = run(
        &format!("hashing {}", path.display()),
        Command::new("sha256sum").arg(path),
    )?;
    out.split_whitespace()
        .next()
        .filter(|h| h.len() == 64)
        .map(str::to_string)
        .ok_or_else(|| BedError::Setup(format!("sha256sum {}: no hash in {out:?}", path.display())))
}

/// How many times [`tar`] packs again after `file changed as we read it`.
const TAR_ATTEMPTS: usize = 3;

/// A deterministic tar of `names` (relative to `dir`): sorted, mtime 0, owner root. Packed again
/// when GNU tar says `file changed as we read it`: it compares a file's ctime before and after
/// reading it, and the hard links of the rootfs share their inode with every other link of the
/// binary, whose count moves the ctime (another test packing the same binary beside this one,
/// or the other lane's cargo putting `target/debug/<bin>` in place again; 4 Dec: `images` lost
/// its second pack of `pause` so). The content is the same; a copy instead would double the
/// time of `images`.
fn tar(what: &str, dir: &Path, names: &[String], out: &Path) -> Result<(), BedError> {
    let mut attempt = 1;
    loop {
        match tar_once(what, dir, names, out) {
            Err(BedError::Setup(e))
                if e.contains("file changed as we read it") && attempt < TAR_ATTEMPTS =>
            {
                tracing::info!("{what}: packing again: {e}");
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn tar_once(what: &str, dir: &Path, names: &[String], out: &Path) -> Result<(), BedError> {
    run(
        what,
        Command::new("tar")
            .arg("--create")
            .arg("--file")
            .arg(out)
            .arg("--directory")
            .arg(dir)
            .args([
                "--format=gnu",
                "--sort=name",
                "--mtime=@0",
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "--hard-dereference",
                "--",
            ])
            .args(names),
    )
    .map(drop)
}

/// Writes the image of `recipe` as an OCI image layout archive at `tarball`; returns the
/// image's digest (its manifest's, what a registry reports after a push).
pub fn pack(recipe: &Recipe, tarball: &Path, compression: Compression) -> Result<String, BedError> {
    let files = file_list(recipe)?;
    let work = tarball.with_extension("work");
    if work.exists() {
        std::fs::remove_dir_all(&work).map_err(io_err("removing", &work))?;
    }
    let result = pack_in(recipe, &files, &work, tarball, compression);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Sets `path`'s mode: what lands in an archive must not depend on the umask.
fn chmod(path: &Path, mode: u32) -> Result<(), BedError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io_err("chmod", path))
}

/// Writes `bytes` as a blob of `blobs` (`blobs/sha256/<hex>`, mode 0644).
fn write_blob(blobs: &Path, bytes: &[u8]) -> Result<oci::Blob, BedError> {
    let tmp = blobs.join("new");
    std::fs::write(&tmp, bytes).map_err(io_err("writing", &tmp))?;
    move_blob(blobs, &tmp)
}

/// Moves the file `from` into `blobs` under its digest (mode 0644).
fn move_blob(blobs: &Path, from: &Path) -> Result<oci::Blob, BedError> {
    let hex = sha256(from)?;
    let size = std::fs::metadata(from)
        .map_err(io_err("reading", from))?
        .len();
    let to = blobs.join(&hex);
    std::fs::rename(from, &to).map_err(io_err("moving", from))?;
    chmod(&to, 0o644)?;
    Ok(oci::Blob { hex, size })
}

fn json_bytes(what: &str, v: &serde_json::Value) -> Result<Vec<u8>, BedError> {
    serde_json::to_vec(v).map_err(|e| BedError::Setup(format!("{what}: {e}")))
}

fn pack_in(
    recipe: &Recipe,
    files: &BTreeMap<PathBuf, Entry>,
    work: &Path,
    tarball: &Path,
    compression: Compression,
) -> Result<String, BedError> {
    let rootfs = work.join("rootfs");
    let archive = work.join("archive");
    let blobs = archive.join("blobs/sha256");
    std::fs::create_dir_all(&rootfs).map_err(io_err("creating", &rootfs))?;
    std::fs::create_dir_all(&blobs).map_err(io_err("creating", &blobs))?;
    for d in [&archive, &archive.join("blobs"), &blobs] {
        chmod(d, 0o755)?;
    }
    // BTreeMap order: every directory comes before what is in it.
    for (at, entry) in files {
        let dest = rootfs.join(at);
        match entry {
            Entry::Dir => {
                std::fs::create_dir(&dest).map_err(io_err("creating", &dest))?;
                chmod(
                    &dest,
                    if at == Path::new("tmp") {
                        0o1777
                    } else {
                        0o755
                    },
                )?;
            }
            Entry::Symlink(target) => {
                std::os::unix::fs::symlink(target, &dest).map_err(io_err("linking", &dest))?
            }
            // A hard link of the real file when it can be (no copy of 70 MB sidecars), else a
            // copy; the tar stores the content either way ([`tar`] on a moving ctime).
            Entry::File(host) => {
                let real = std::fs::canonicalize(host).map_err(io_err("resolving", host))?;
                if std::fs::hard_link(&real, &dest).is_err() {
                    std::fs::copy(&real, &dest).map_err(io_err("copying", &real))?;
                }
            }
        }
    }
    let top: Vec<String> = files
        .keys()
        .filter(|p| p.components().count() == 1)
        .map(|p| p.display().to_string())
        .collect();
    let layer_tar = work.join("layer.tar");
    tar(
        &format!("image {}: layer", recipe.name),
        &rootfs,
        &top,
        &layer_tar,
    )?;
    let diff_id = sha256(&layer_tar)?;
    let layer = match compression {
        Compression::None => move_blob(&blobs, &layer_tar)?,
        Compression::Gzip => {
            let gz = work.join("layer.tar.gz");
            gzip(&layer_tar, &gz)?;
            move_blob(&blobs, &gz)?
        }
    };
    let what = format!("image {}", recipe.name);
    let config = write_blob(
        &blobs,
        &json_bytes(&what, &oci::config_json(&recipe.entrypoint, &diff_id))?,
    )?;
    let manifest = write_blob(
        &blobs,
        &json_bytes(&what, &oci::manifest_json(&config, &layer, compression))?,
    )?;
    for (name, value) in [
        ("index.json", oci::index_json(&manifest, &recipe.name)),
        ("oci-layout", oci::layout_json()),
    ] {
        let path = archive.join(name);
        std::fs::write(&path, json_bytes(&what, &value)?).map_err(io_err("writing", &path))?;
        chmod(&path, 0o644)?;
    }
    tar(
        &what,
        &archive,
        &["blobs".into(), "index.json".into(), "oci-layout".into()],
        tarball,
    )?;
    Ok(manifest.digest())
}

/// `gzip -n` of `from` into `to`: no file name or time in the header, so the same tar gives
/// the same bytes (with the same gzip: Debian 12's 1.12).
fn gzip(from: &Path, to: &Path) -> Result<(), BedError> {
    let out = std::fs::File::create(to).map_err(io_err("creating", to))?;
    let status = Command::new("gzip")
        .args(["-n", "-c", "--"])
        .arg(from)
        .stdout(out)
        .status()
        .map_err(|e| BedError::Setup(format!("running gzip for {}: {e}", from.display())))?;
    if !status.success() {
        return Err(BedError::Setup(format!(
            "gzip {} failed ({status})",
            from.display()
        )));
    }
    Ok(())
}

/// `ctr --address <socket> -n k8s.io images import` of each tarball (unpacked for the CRI).
pub fn import(containerd_socket: &Path, images: &[&Image]) -> Result<(), BedError> {
    for image in images {
        run(
            &format!(
                "importing image {} from {}",
                image.name,
                image.tarball.display()
            ),
            Command::new("ctr")
                .arg("--address")
                .arg(containerd_socket)
                .args(["-n", "k8s.io", "images", "import"])
                .arg(&image.tarball),
        )?;
    }
    Ok(())
}

/// Tags image `from` (already imported) as `to` in the node's containerd (namespace `k8s.io`,
/// the kubelet's): the name a chart's default renders resolves to the bed's build of that
/// program, as an image already on a node without registry access would.
pub fn tag(containerd_socket: &Path, from: &str, to: &str) -> Result<(), BedError> {
    run(
        &format!("tagging image {from} as {to}"),
        Command::new("ctr")
            .arg("--address")
            .arg(containerd_socket)
            .args(["-n", "k8s.io", "images", "tag", "--force", from, to]),
    )
    .map(|_| ())
}

/// The fully qualified name the kubelet resolves an image reference to (`busybox:1.36` is
/// `docker.io/library/busybox:1.36`, `rancher/x:t` is `docker.io/rancher/x:t`).
pub fn qualified(reference: &str) -> String {
    match reference.split_once('/') {
        None => format!("docker.io/library/{reference}"),
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => {
            reference.to_string()
        }
        Some(_) => format!("docker.io/{reference}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ldd /usr/sbin/mkfs.ext4` on Debian 12, and on a static Go binary.
    const LDD_MKFS: &str = "\tlinux-vdso.so.1 (0x00007ffd)\n\
        \tlibext2fs.so.2 => /lib/x86_64-linux-gnu/libext2fs.so.2 (0x00007f79)\n\
        \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f79)\n\
        \t/lib64/ld-linux-x86-64.so.2 (0x00007f79)\n";

    #[test]
    fn references_qualify_as_the_kubelet_resolves_them() {
        assert_eq!(qualified("busybox:1.36"), "docker.io/library/busybox:1.36");
        assert_eq!(qualified("rancher/x:v1"), "docker.io/rancher/x:v1");
        assert_eq!(qualified("localhost/a/b:t"), "localhost/a/b:t");
        assert_eq!(qualified("reg.example:5000/a:t"), "reg.example:5000/a:t");
    }

    #[test]
    fn ldd_output_gives_libraries_and_interpreter() {
        assert_eq!(
            parse_ldd(LDD_MKFS).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libext2fs.so.2",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert!(
            parse_ldd("\tnot a dynamic executable\n")
                .unwrap()
                .is_empty()
        );
        assert!(parse_ldd("\tstatically linked\n").unwrap().is_empty());
        let e = parse_ldd("\tlibfoo.so.1 => not found\n").unwrap_err();
        assert_eq!(e, "library libfoo.so.1 not found");
    }

    #[test]
    fn paths_are_usr_merged() {
        for (host, image) in [
            (
                "/lib/x86_64-linux-gnu/libc.so.6",
                "usr/lib/x86_64-linux-gnu/libc.so.6",
            ),
            (
                "/lib64/ld-linux-x86-64.so.2",
                "usr/lib64/ld-linux-x86-64.so.2",
            ),
            ("/sbin/blkid", "usr/sbin/blkid"),
            ("/usr/bin/mount", "usr/bin/mount"),
            ("/pause", "pause"),
            ("/libexec/x", "libexec/x"),
        ] {
            assert_eq!(image_path(Path::new(host)), PathBuf::from(image), "{host}");
        }
    }

    fn recipe() -> Recipe {
        Recipe {
            name: name(CSI_DRIVER_REPO),
            entrypoint: vec!["/usr/bin/harvester-csi-driver".into()],
            programs: vec![
                Program {
                    host: "/t/debug/harvester-csi-driver".into(),
                    image_path: "/usr/bin/harvester-csi-driver".into(),
                    libraries: vec![
                        "/lib/x86_64-linux-gnu/libc.so.6".into(),
                        "/lib64/ld-linux-x86-64.so.2".into(),
                    ],
                },
                Program {
                    host: "/usr/sbin/mkfs.ext4".into(),
                    image_path: "/usr/sbin/mkfs.ext4".into(),
                    libraries: vec!["/lib/x86_64-linux-gnu/libc.so.6".into()],
                },
            ],
            files: vec![("/etc/mke2fs.conf".into(), "/etc/mke2fs.conf".into())],
        }
    }

    #[test]
    fn file_list_places_programs_libraries_and_links() {
        let files = file_list(&recipe()).unwrap();
        let file = |p: &str| files.get(Path::new(p)).cloned();
        assert_eq!(
            file("usr/bin/harvester-csi-driver"),
            Some(Entry::File("/t/debug/harvester-csi-driver".into()))
        );
        assert_eq!(
            file("usr/sbin/mkfs.ext4"),
            Some(Entry::File("/usr/sbin/mkfs.ext4".into()))
        );
        // Shared by two programs, once.
        assert_eq!(
            file("usr/lib/x86_64-linux-gnu/libc.so.6"),
            Some(Entry::File("/lib/x86_64-linux-gnu/libc.so.6".into()))
        );
        assert_eq!(
            file("usr/lib64/ld-linux-x86-64.so.2"),
            Some(Entry::File("/lib64/ld-linux-x86-64.so.2".into()))
        );
        assert_eq!(file("lib64"), Some(Entry::Symlink("usr/lib64".into())));
        assert_eq!(file("sbin"), Some(Entry::Symlink("usr/sbin".into())));
        assert_eq!(
            file("etc/mke2fs.conf"),
            Some(Entry::File("/etc/mke2fs.conf".into()))
        );
        assert_eq!(file("usr/lib/x86_64-linux-gnu"), Some(Entry::Dir));
        assert_eq!(file("tmp"), Some(Entry::Dir));
        // Every entry's parent is a directory of the list.
        for p in files.keys() {
            if let Some(parent) = p.parent().filter(|p| !p.as_os_str().is_empty()) {
                assert_eq!(files.get(parent), Some(&Entry::Dir), "parent of {p:?}");
            }
        }
    }

    #[test]
    fn conflicting_files_are_refused() {
        let mut r = recipe();
        r.files.push((
            "/elsewhere/libc.so.6".into(),
            "/lib/x86_64-linux-gnu/libc.so.6".into(),
        ));
        let e = file_list(&r).unwrap_err().to_string();
        assert!(
            e.contains("usr/lib/x86_64-linux-gnu/libc.so.6") && e.contains("/elsewhere/libc.so.6"),
            "{e}"
        );
        let mut r = recipe();
        r.files.push(("/x".into(), "/lib64/../etc/passwd".into()));
        assert!(file_list(&r).unwrap_err().to_string().contains("bad path"));
        let mut r = recipe();
        r.files
            .push(("/x".into(), "/lib64/ld-linux-x86-64.so.2/x".into()));
        assert!(
            file_list(&r)
                .unwrap_err()
                .to_string()
                .contains("needs directory")
        );
    }

    #[test]
    fn a_missing_sidecar_names_make_node_tools() {
        let dir = tempfile::tempdir().unwrap();
        let e = sidecar(dir.path(), "csi-attacher").unwrap_err().to_string();
        assert!(
            e.contains("csi-attacher is not built") && e.contains("`make node-tools`"),
            "{e}"
        );
        std::fs::write(dir.path().join("csi-attacher"), "").unwrap();
        assert_eq!(
            sidecar(dir.path(), "csi-attacher").unwrap(),
            dir.path().join("csi-attacher")
        );
    }
}
