//! The real node's images (`testbed::images`): every image is built as a `docker save` tarball
//! with the right name, entrypoint and layer; a containerd of its own imports them all; and the
//! images run: each program in its image prints what the same program prints on the host (so
//! every library it loads is in the image), and the pause image exits 0 on SIGTERM as PID 1.
//!
//! Needs root, containerd/runc and the CSI sidecars (`make node-tools`), and the workspace's
//! binaries (`cargo build --bins`; `cargo test --workspace` builds them):
//! `cargo test -p testbed --test images`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use testbed::images::{self, Image};
use testbed::mounts::MountSweeper;
use testbed::node::{NodeDirs, containerd_config};
use testbed::process::Proc;

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
                testbed::process::tail(&proc.log, 20)
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

/// A member of a tarball, as bytes.
fn member(tarball: &Path, name: &str) -> Vec<u8> {
    sh(Command::new("tar").arg("-xOf").arg(tarball).arg(name)).stdout
}

fn sha256_of_member(tarball: &Path, name: &str) -> String {
    let out = sh(Command::new("sh").arg("-c").arg(format!(
        "tar -xOf '{}' '{name}' | sha256sum",
        tarball.display()
    )));
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("a hash")
        .to_string()
}

/// The layer's file list (`tar -t` of the layer inside the tarball).
fn layer_files(tarball: &Path, layer: &str) -> Vec<String> {
    let out = sh(Command::new("sh").arg("-c").arg(format!(
        "tar -xOf '{}' '{layer}' | tar -t",
        tarball.display()
    )));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim_end_matches('/').to_string())
        .collect()
}

/// Checks the `docker save` layout of `image` and returns its layer's file list.
fn check_layout(image: &Image, entrypoint: &str) -> Vec<String> {
    let manifest: serde_json::Value =
        serde_json::from_slice(&member(&image.tarball, "manifest.json")).expect("manifest JSON");
    let m = &manifest[0];
    assert_eq!(
        m["RepoTags"],
        serde_json::json!([image.name]),
        "{}",
        image.name
    );
    let layers = m["Layers"].as_array().expect("Layers");
    assert_eq!(layers.len(), 1, "{}: one layer", image.name);
    let layer = layers[0].as_str().expect("layer path");
    let config_name = m["Config"].as_str().expect("Config");
    let config: serde_json::Value =
        serde_json::from_slice(&member(&image.tarball, config_name)).expect("config JSON");
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
    // The config names the layer by its content, and is named by its own.
    let diff_id = sha256_of_member(&image.tarball, layer);
    assert_eq!(
        config["rootfs"]["diff_ids"],
        serde_json::json!([format!("sha256:{diff_id}")]),
        "{}",
        image.name
    );
    assert_eq!(
        format!("{}.json", sha256_of_member(&image.tarball, config_name)),
        config_name
    );
    let files = layer_files(&image.tarball, layer);
    let entry = entrypoint.trim_start_matches('/');
    assert!(
        files.iter().any(|f| f == entry),
        "{}: no {entry} in {files:?}",
        image.name
    );
    files
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
    images::pack(pause, &again).expect("packing pause again");
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
    let listed = text(&sh(containerd.ctr().args(["images", "ls", "-q"])).stdout);
    for i in set.all() {
        assert!(
            listed.lines().any(|l| l == i.name),
            "{} not in `ctr images ls`:\n{listed}",
            i.name
        );
    }

    // Each program prints in its image what it prints on the host: same status, same output.
    // A library missing from the image would make the loader fail instead (status 127).
    let ccm = testbed::process::built_binary("harvester-cloud-provider");
    let csi = testbed::process::built_binary("harvester-csi-driver");
    let tools = testbed::node::node_tools_dir().expect("node tools dir");
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
            &set.registrar,
            host(&testbed::process::built_binary("registrar")),
            "registrar",
            vec!["--version"],
        ),
        (
            &set.livenessprobe,
            host(&testbed::process::built_binary("livenessprobe")),
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
        testbed::mounts::mounts_under(&node_root).is_empty(),
        "mounts left under {}",
        node_root.display()
    );
}
