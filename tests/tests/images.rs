//! The real node's images (`testbed::real::images`): every image is built as an OCI image layout
//! archive with the right name, entrypoint and layer; a containerd of its own imports them all; and the
//! images run: each program in its image prints what the same program prints on the host (so
//! every library it loads is in the image), and the pause image exits 0 on SIGTERM as PID 1.
//!
//! The release images of `make images` (`testbed::real::images::release`, built here from the debug
//! binaries: the same code) are reproducible OCI archives skopeo copies, and containerd imports
//! and runs them too.
//!
//! Needs root, containerd/runc and the CSI sidecars (`make node-tools`), skopeo
//! (tests/scripts/tools.sh), and the workspace's binaries (`cargo build --bins`; `cargo test
//! --workspace` builds them): `cargo test -p testbed --test images`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use testbed::real::images::{self, Image, release};
use testbed::real::mounts::MountSweeper;
use testbed::real::node::{NodeDirs, containerd_config};
use testbed::util::process::Proc;

/// A containerd of the test's own (the real node's config), stopped as pitfall 4 of
/// `real-node.md` says: tasks killed first, containers removed, then mounts and cgroups swept.
struct Containerd {
    dirs: NodeDirs,
    proc: Option<Proc>,
    containers: Vec<String>,
    _sweeper: MountSweeper,
}

impl Containerd {
    fn start(dir: &Path) -> Containerd {
        let containerd = Path::new("/usr/bin/containerd");
        assert!(
            containerd.is_file() && Path::new("/usr/sbin/runc").is_file(),
            "containerd and runc are not installed: run `make node-tools`"
        );
        let dirs = NodeDirs::under(&dir.join("node"));
        for d in [
            &dirs.containerd_root,
            &dirs.containerd_state,
            &dirs.cni_conf,
        ] {
            std::fs::create_dir_all(d).expect("node dirs");
        }
        let config = dirs.root.join("containerd.toml");
        std::fs::write(&config, containerd_config(&dirs)).expect("containerd config");
        let mut cmd = Command::new(containerd);
        cmd.arg("--config").arg(&config);
        let mut proc = Proc::spawn("containerd", cmd, dir).expect("starting containerd");
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&dirs.containerd_socket).is_err() {
            if let Err(e) = proc.check_alive() {
                panic!("containerd did not come up: {e}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "containerd's socket did not appear within 30s; log {}:\n{}",
                proc.log.display(),
                testbed::util::process::tail(&proc.log, 20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Containerd {
            _sweeper: MountSweeper(dir.to_path_buf()),
            dirs,
            proc: Some(proc),
            containers: Vec::new(),
        }
    }

    fn ctr(&self) -> Command {
        let mut c = Command::new("ctr");
        c.arg("--address")
            .arg(&self.dirs.containerd_socket)
            .args(["-n", "k8s.io"]);
        c
    }

    /// `ctr run --rm <image> <id> <args>`: the container's exit code, stdout and stderr.
    fn run(&mut self, image: &str, args: &[&str]) -> Output {
        let id = format!(
            "images-test-{}-{}",
            std::process::id(),
            self.containers.len()
        );
        self.containers.push(id.clone());
        self.ctr()
            .args(["run", "--rm", image, &id])
            .args(args)
            .output()
            .expect("running ctr run")
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let ctr = |args: &[&str]| self.ctr().args(args).output();
        if let Ok(out) = ctr(&["tasks", "ls", "-q"]) {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
                let _ = ctr(&["tasks", "delete", "-f", id]);
            }
        }
        if let Ok(out) = ctr(&["containers", "ls", "-q"]) {
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = ctr(&["containers", "rm", id]);
            }
        }
        if let Some(mut p) = self.proc.take() {
            p.stop();
        }
        // ctr puts a container in the cgroup /k8s.io/<id> of each hierarchy; runc removes the
        // container's own on delete, an empty parent is removed here (rmdir of a non-empty
        // one fails and leaves it).
        if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in hierarchies.flatten() {
                for id in &self.containers {
                    let _ = std::fs::remove_dir(h.path().join("k8s.io").join(id));
                }
                let _ = std::fs::remove_dir(h.path().join("k8s.io"));
            }
        }
    }
}

fn sh(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// An OCI archive checked member by member: what [`check_oci`] found.
struct Layout {
    /// The manifest's digest (`sha256:...`).
    digest: String,
    /// The layer's file list.
    files: Vec<String>,
    config: serde_json::Value,
    layer_media_type: String,
}

fn read_json(path: &Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The blob a descriptor names, after checking that it exists with the descriptor's size.
fn blob(root: &Path, descriptor: &serde_json::Value) -> PathBuf {
    let digest = descriptor["digest"].as_str().expect("descriptor digest");
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    let path = root.join("blobs/sha256").join(hex);
    let size = std::fs::metadata(&path)
        .unwrap_or_else(|e| panic!("blob {digest}: {e}"))
        .len();
    assert_eq!(
        descriptor["size"].as_u64(),
        Some(size),
        "blob {digest}: size"
    );
    path
}

/// Checks that `tarball` is an OCI image layout (image-spec `image-layout.md`) of the image
/// `name`: `oci-layout`, `index.json` naming it for containerd and skopeo, every blob under
/// `blobs/sha256` named by its sha256, a manifest whose config names the layer's diff ID.
fn check_oci(tarball: &Path, name: &str) -> Layout {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    sh(Command::new("tar")
        .arg("-xf")
        .arg(tarball)
        .arg("-C")
        .arg(root));
    let mut top: Vec<String> = std::fs::read_dir(root)
        .expect("unpacked archive")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    assert_eq!(top, ["blobs", "index.json", "oci-layout"], "{name}");
    assert_eq!(
        read_json(&root.join("oci-layout")),
        serde_json::json!({"imageLayoutVersion": "1.0.0"})
    );
    for b in std::fs::read_dir(root.join("blobs/sha256")).expect("blobs/sha256") {
        let b = b.expect("blob").path();
        let named = b.file_name().expect("name").to_string_lossy().into_owned();
        assert_eq!(
            images::sha256(&b).expect("hashing"),
            named,
            "{name}: a blob not named by its content"
        );
    }
    let index = read_json(&root.join("index.json"));
    assert_eq!(index["schemaVersion"], 2);
    let manifests = index["manifests"].as_array().expect("manifests");
    assert_eq!(manifests.len(), 1, "{name}: one manifest");
    let m = &manifests[0];
    assert_eq!(m["mediaType"], images::oci::MANIFEST_MEDIA_TYPE);
    assert_eq!(m["annotations"][images::oci::CONTAINERD_NAME], name);
    assert_eq!(
        m["annotations"][images::oci::REF_NAME],
        images::oci::tag_of(name)
    );
    assert_eq!(
        m["platform"],
        serde_json::json!({"architecture": "amd64", "os": "linux"})
    );
    let manifest = read_json(&blob(root, m));
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["config"]["mediaType"],
        images::oci::CONFIG_MEDIA_TYPE
    );
    let config = read_json(&blob(root, &manifest["config"]));
    let layers = manifest["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 1, "{name}: one layer");
    let layer = blob(root, &layers[0]);
    let layer_media_type = layers[0]["mediaType"]
        .as_str()
        .expect("layer mediaType")
        .to_string();
    // The diff ID is the sha256 of the layer tar as it unpacks (gunzipped when gzip).
    let diff_id = if layer_media_type.ends_with("+gzip") {
        let out = sh(Command::new("sh")
            .arg("-c")
            .arg(format!("gzip -dc '{}' | sha256sum", layer.display())));
        text(&out.stdout)
            .split_whitespace()
            .next()
            .expect("a hash")
            .to_string()
    } else {
        assert_eq!(layer_media_type, "application/vnd.oci.image.layer.v1.tar");
        images::sha256(&layer).expect("hashing")
    };
    assert_eq!(
        config["rootfs"]["diff_ids"],
        serde_json::json!([format!("sha256:{diff_id}")]),
        "{name}"
    );
    let files = text(&sh(Command::new("tar").arg("-tf").arg(&layer)).stdout)
        .lines()
        .map(|l| l.trim_end_matches('/').to_string())
        .collect();
    Layout {
        digest: m["digest"].as_str().expect("digest").to_string(),
        files,
        config,
        layer_media_type,
    }
}

/// Checks the layout of a bed image and returns its layer's file list.
fn check_layout(image: &Image, entrypoint: &str) -> Vec<String> {
    let layout = check_oci(&image.tarball, &image.name);
    let config = &layout.config;
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!([entrypoint]),
        "{}",
        image.name
    );
    assert_eq!(config["architecture"], "amd64");
    assert_eq!(config["os"], "linux");
    assert_eq!(
        config["config"]["Env"],
        serde_json::json!([images::PATH_ENV])
    );
    let entry = entrypoint.trim_start_matches('/');
    assert!(
        layout.files.iter().any(|f| f == entry),
        "{}: no {entry} in {:?}",
        image.name,
        layout.files
    );
    layout.files
}

fn mib(p: &Path) -> f64 {
    std::fs::metadata(p).expect("tarball").len() as f64 / (1024.0 * 1024.0)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn images_build_import_and_run_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root (containerd, runc, overlay mounts); run it as root"
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("images");

    let t = Instant::now();
    let set = images::build_all(&out).unwrap_or_else(|e| panic!("building the images: {e}"));
    let build = t.elapsed();
    let total: f64 = set.all().iter().map(|i| mib(&i.tarball)).sum();
    eprintln!(
        "built {} images in {build:.1?}, {total:.0} MiB:",
        set.all().len()
    );
    for i in set.all() {
        eprintln!("  {:>7.1} MiB  {}", mib(&i.tarball), i.name);
    }

    // Names and entrypoints: what the charts expect (the cloud provider's Deployment runs
    // `command: [harvester-cloud-provider]`, the CSI containers pass only `args`).
    let expected = [
        (&set.pause, "localhost/pause:3.10", "/pause"),
        (
            &set.cloud_provider,
            "localhost/harvester-rs/harvester-cloud-provider:testbed",
            "/usr/bin/harvester-cloud-provider",
        ),
        (
            &set.csi_driver,
            "localhost/harvester-rs/harvester-csi-driver:testbed",
            "/usr/bin/harvester-csi-driver",
        ),
        (
            &set.registrar,
            "localhost/testbed/csi-node-driver-registrar:testbed",
            "/usr/bin/registrar",
        ),
        (
            &set.livenessprobe,
            "localhost/testbed/livenessprobe:testbed",
            "/usr/bin/livenessprobe",
        ),
        (
            &set.provisioner,
            "localhost/testbed/csi-provisioner:testbed",
            "/usr/bin/csi-provisioner",
        ),
        (
            &set.attacher,
            "localhost/testbed/csi-attacher:testbed",
            "/usr/bin/csi-attacher",
        ),
        (
            &set.resizer,
            "localhost/testbed/csi-resizer:testbed",
            "/usr/bin/csi-resizer",
        ),
        (
            &set.snapshotter,
            "localhost/testbed/csi-snapshotter:testbed",
            "/usr/bin/csi-snapshotter",
        ),
    ];
    assert_eq!(expected.len(), set.all().len());
    let mut csi_files = Vec::new();
    for (image, name, entrypoint) in expected {
        assert_eq!(image.name, name);
        let files = check_layout(image, entrypoint);
        if image.name == set.csi_driver.name {
            csi_files = files;
        }
    }
    for f in [
        "usr/sbin/mkfs.ext4",
        "usr/sbin/mkfs.xfs",
        "usr/sbin/blkid",
        "usr/bin/mount",
        "usr/lib64/ld-linux-x86-64.so.2",
        "usr/lib/x86_64-linux-gnu/libc.so.6",
        "usr/lib/x86_64-linux-gnu/libext2fs.so.2",
        "lib64",
    ] {
        assert!(
            csi_files.iter().any(|x| x == f),
            "CSI driver image lacks {f}"
        );
    }

    // Deterministic: the same recipe packs to the same bytes.
    let recipes = images::recipes().expect("recipes");
    let (_, pause) = recipes
        .iter()
        .find(|(k, _)| *k == "pause")
        .expect("pause recipe");
    let again = dir.path().join("pause-again.tar");
    images::pack(pause, &again, images::Compression::None).expect("packing pause again");
    assert_eq!(
        std::fs::read(&again).expect("tarball"),
        std::fs::read(&set.pause.tarball).expect("tarball"),
        "packing the same image twice gave different tarballs"
    );

    let mut containerd = Containerd::start(dir.path());
    // A tarball ctr cannot read: the error names the image and says what ctr said.
    let broken = images::Image {
        name: "localhost/testbed/broken:testbed".into(),
        tarball: dir.path().join("broken.tar"),
    };
    std::fs::write(&broken.tarball, b"not a tarball").expect("broken tarball");
    let e = images::import(&containerd.dirs.containerd_socket, &[&broken])
        .expect_err("importing a file that is not a tarball")
        .to_string();
    assert!(
        e.contains("localhost/testbed/broken:testbed") && e.contains("ctr: "),
        "{e}"
    );
    eprintln!("a broken tarball: {e}");
    let t = Instant::now();
    for i in set.all() {
        let one = Instant::now();
        images::import(&containerd.dirs.containerd_socket, &[i])
            .unwrap_or_else(|e| panic!("importing: {e}"));
        eprintln!("  imported {} in {:.1?}", i.name, one.elapsed());
    }
    eprintln!("imported {} images in {:.1?}", set.all().len(), t.elapsed());
    // The release images (`make images`: gzip layers) import the same way.
    let t = Instant::now();
    let release: Vec<Image> = release::build(&bin_dir(), &dir.path().join("release"), "localhost")
        .unwrap_or_else(|e| panic!("building the release images: {e}"))
        .into_iter()
        .map(|b| Image {
            name: b.name,
            tarball: b.archive,
        })
        .collect();
    let release_ccm = &release[0];
    let release_csi = &release[1];
    for i in [release_ccm, release_csi] {
        images::import(&containerd.dirs.containerd_socket, &[i])
            .unwrap_or_else(|e| panic!("importing: {e}"));
    }
    eprintln!(
        "built and imported the release images in {:.1?}",
        t.elapsed()
    );
    let listed = text(&sh(containerd.ctr().args(["images", "ls", "-q"])).stdout);
    for i in set.all().into_iter().chain([release_ccm, release_csi]) {
        assert!(
            listed.lines().any(|l| l == i.name),
            "{} not in `ctr images ls`:\n{listed}",
            i.name
        );
    }

    // Each program prints in its image what it prints on the host: same status, same output.
    // A library missing from the image would make the loader fail instead (status 127).
    let ccm = testbed::util::process::built_binary("harvester-cloud-provider");
    let csi = testbed::util::process::built_binary("harvester-csi-driver");
    let tools = testbed::real::node::node_tools_dir().expect("node tools dir");
    let host = |p: &Path| p.display().to_string();
    let runs: Vec<(&Image, String, &str, Vec<&str>)> = vec![
        (
            &set.csi_driver,
            host(&csi),
            "harvester-csi-driver",
            vec!["--version"],
        ),
        (
            &set.csi_driver,
            "/usr/sbin/mkfs.ext4".into(),
            "mkfs.ext4",
            vec!["-V"],
        ),
        (
            &set.csi_driver,
            "/usr/sbin/mkfs.xfs".into(),
            "mkfs.xfs",
            vec!["-V"],
        ),
        (
            &set.csi_driver,
            "/usr/sbin/blkid".into(),
            "blkid",
            vec!["-V"],
        ),
        (
            &set.csi_driver,
            "/usr/bin/mount".into(),
            "mount",
            vec!["-V"],
        ),
        (
            &set.csi_driver,
            "/usr/bin/umount".into(),
            "umount",
            vec!["-V"],
        ),
        (
            &set.csi_driver,
            "/usr/bin/setpriv".into(),
            "setpriv",
            vec!["-V"],
        ),
        (
            &set.csi_driver,
            "/usr/sbin/xfs_growfs".into(),
            "xfs_growfs",
            vec!["-V"],
        ),
        // resize2fs has no version flag: its usage (status 1) names its version.
        (
            &set.csi_driver,
            "/usr/sbin/resize2fs".into(),
            "resize2fs",
            vec![],
        ),
        (
            &set.cloud_provider,
            host(&ccm),
            "harvester-cloud-provider",
            vec!["--version"],
        ),
        (
            release_ccm,
            host(&ccm),
            "harvester-cloud-provider",
            vec!["--version"],
        ),
        (
            release_csi,
            host(&csi),
            "harvester-csi-driver",
            vec!["--version"],
        ),
        (
            release_csi,
            "/usr/sbin/mkfs.xfs".into(),
            "mkfs.xfs",
            vec!["-V"],
        ),
        (
            release_csi,
            "/usr/sbin/mount.nfs".into(),
            "mount.nfs",
            vec!["-V"],
        ),
        (
            &set.registrar,
            host(&testbed::util::process::built_binary("registrar")),
            "registrar",
            vec!["--version"],
        ),
        (
            &set.livenessprobe,
            host(&testbed::util::process::built_binary("livenessprobe")),
            "livenessprobe",
            vec!["--version"],
        ),
        (
            &set.provisioner,
            host(&tools.join("csi-provisioner")),
            "csi-provisioner",
            vec!["--version"],
        ),
        (
            &set.attacher,
            host(&tools.join("csi-attacher")),
            "csi-attacher",
            vec!["--version"],
        ),
        (
            &set.resizer,
            host(&tools.join("csi-resizer")),
            "csi-resizer",
            vec!["--version"],
        ),
        (
            &set.snapshotter,
            host(&tools.join("csi-snapshotter")),
            "csi-snapshotter",
            vec!["--version"],
        ),
    ];
    let t = Instant::now();
    for (image, host_path, in_image, args) in &runs {
        // Under the name it has in the image: usage texts print argv[0].
        let on_host = Command::new(host_path)
            .arg0(in_image)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running {host_path} on the host: {e}"));
        let mut argv = vec![*in_image];
        argv.extend(args.iter().copied());
        let inside = containerd.run(&image.name, &argv);
        let what = format!("`{}` in {}", argv.join(" "), image.name);
        assert_ne!(
            inside.status.code(),
            Some(127),
            "{what}: not found or a library is missing: {}",
            text(&inside.stderr)
        );
        assert_eq!(
            inside.status.code(),
            on_host.status.code(),
            "{what}: status differs from the host's; stderr: {}",
            text(&inside.stderr)
        );
        let combined = |o: &Output| format!("{}{}", text(&o.stdout), text(&o.stderr));
        assert!(
            !combined(&on_host).trim().is_empty(),
            "{host_path} printed nothing on the host"
        );
        assert_eq!(
            combined(&inside),
            combined(&on_host),
            "{what}: output differs from the host's"
        );
    }
    eprintln!(
        "{} programs run in their images in {:.1?}",
        runs.len(),
        t.elapsed()
    );

    // The pause image as a sandbox's PID 1: runs until SIGTERM, then exits 0.
    let id = format!("images-test-{}-pause", std::process::id());
    containerd.containers.push(id.clone());
    let mut run = containerd
        .ctr()
        .args(["run", "--rm", &set.pause.name, &id])
        .spawn()
        .expect("ctr run pause");
    let start = Instant::now();
    loop {
        let tasks = text(&sh(containerd.ctr().args(["tasks", "ls"])).stdout);
        if tasks
            .lines()
            .any(|l| l.starts_with(&id) && l.contains("RUNNING"))
        {
            break;
        }
        if let Some(status) = run.try_wait().expect("ctr run status") {
            panic!("pause exited by itself ({status})");
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "pause not running within 20s: {tasks}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        run.try_wait().expect("status").is_none(),
        "pause did not keep running"
    );
    sh(containerd
        .ctr()
        .args(["tasks", "kill", "-s", "SIGTERM", &id]));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = run.try_wait().expect("ctr run status") {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "pause ignored SIGTERM as PID 1 for 20s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "pause exited {status} on SIGTERM");

    let node_root: PathBuf = containerd.dirs.root.clone();
    drop(containerd);
    assert!(
        testbed::real::mounts::mounts_under(&node_root).is_empty(),
        "mounts left under {}",
        node_root.display()
    );
}

/// Where `cargo build --bins` put this profile's binaries (target/debug under `cargo test`).
fn bin_dir() -> PathBuf {
    testbed::util::process::built_binary("harvester-cloud-provider")
        .parent()
        .expect("target/<profile>")
        .to_path_buf()
}

/// skopeo, or a panic saying how to install it.
fn skopeo() -> Command {
    assert!(
        Path::new("/usr/bin/skopeo").is_file(),
        "skopeo is not installed: run tests/scripts/tools.sh (Debian package skopeo)"
    );
    let mut c = Command::new("/usr/bin/skopeo");
    // No /etc/containers/policy.json needed: nothing is pulled from a registry here.
    c.arg("--insecure-policy");
    c
}

/// `make images` (`testbed images` -> `testbed::real::images::release`) from the debug binaries (the
/// release build takes the same path), twice into two directories: the same archives byte for
/// byte and the same digests; each a valid OCI layout with a gzip layer, named
/// `<prefix>/<program>:<workspace version>`; skopeo (how docs/install.md pushes them) copies
/// each with every digest checked and keeps the image's digest.
#[test]
fn release_images_are_reproducible_oci_archives() {
    let dir = tempfile::tempdir().expect("temp dir");
    let prefix = "registry.example.com:5000/team";
    let t = Instant::now();
    let first = release::build(&bin_dir(), &dir.path().join("a"), prefix)
        .unwrap_or_else(|e| panic!("building the release images: {e}"));
    let once = t.elapsed();
    let second = release::build(&bin_dir(), &dir.path().join("b"), prefix)
        .unwrap_or_else(|e| panic!("building the release images again: {e}"));
    eprintln!(
        "built both release images in {once:.1?} ({:.1?} the second time)",
        t.elapsed() - once
    );
    let programs = ["harvester-cloud-provider", "harvester-csi-driver"];
    assert_eq!(first.len(), programs.len());
    assert_eq!(second.len(), programs.len());
    let mut csi_files = Vec::new();
    for ((a, b), program) in first.iter().zip(&second).zip(programs) {
        eprintln!(
            "  {:>6.1} MiB  {}  {}",
            mib(&a.archive),
            a.digest,
            a.archive.display()
        );
        assert_eq!(a.name, format!("{prefix}/{program}:{}", release::VERSION));
        assert_eq!(
            a.archive.file_name().expect("file name").to_string_lossy(),
            format!("{program}-{}.oci.tar", release::VERSION)
        );
        assert_eq!(a.digest, b.digest, "{program}: image digests differ");
        assert_eq!(
            a.archive_sha256, b.archive_sha256,
            "{program}: archives differ"
        );
        assert_eq!(
            std::fs::read(&a.archive).expect("archive"),
            std::fs::read(&b.archive).expect("archive"),
            "{program}: archives differ"
        );
        assert_eq!(images::sha256(&a.archive).expect("hash"), a.archive_sha256);
        let layout = check_oci(&a.archive, &a.name);
        assert_eq!(layout.digest, a.digest, "{program}: the digest printed");
        assert_eq!(
            layout.layer_media_type,
            "application/vnd.oci.image.layer.v1.tar+gzip"
        );
        let entrypoint = format!("/usr/bin/{program}");
        assert_eq!(
            layout.config["config"]["Entrypoint"],
            serde_json::json!([entrypoint])
        );
        assert_eq!(layout.config["created"], "1970-01-01T00:00:00Z");
        assert!(
            layout.files.contains(&entrypoint[1..].to_string()),
            "{program}: no {entrypoint}"
        );
        if program == "harvester-csi-driver" {
            csi_files = layout.files;
        }

        // skopeo reads the archive (checking each blob's digest) into a layout of its own; the
        // manifest, hence the image's digest, is unchanged.
        let copy = dir.path().join(format!("{program}-copy"));
        let from = format!("oci-archive:{}", a.archive.display());
        let to = format!("oci:{}:{}", copy.display(), release::VERSION);
        sh(skopeo().args(["copy", "--quiet", &from, &to]));
        let raw = sh(skopeo().args(["inspect", "--raw", &to])).stdout;
        let raw_file = dir.path().join(format!("{program}-manifest.json"));
        std::fs::write(&raw_file, &raw).expect("manifest");
        assert_eq!(
            format!("sha256:{}", images::sha256(&raw_file).expect("hash")),
            a.digest,
            "{program}: skopeo's copy has another manifest"
        );
    }
    // Every program the node plugin runs is in the CSI driver's image.
    for p in images::NODE_PLUGIN_PROGRAMS {
        assert!(
            ["usr/bin", "usr/sbin"]
                .iter()
                .any(|d| csi_files.contains(&format!("{d}/{p}"))),
            "the CSI driver's release image lacks {p}"
        );
    }

    // A prefix that is no registry fails before anything is built, naming it.
    let e = release::build(
        &bin_dir(),
        &dir.path().join("c"),
        "https://registry.example.com",
    )
    .expect_err("a prefix with a scheme")
    .to_string();
    assert!(
        e.contains("\"https://registry.example.com\" has a scheme"),
        "{e}"
    );
    assert!(!dir.path().join("c").exists());
}
