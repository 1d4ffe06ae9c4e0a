//! `harvester-csi-driver`: CSI driver passing Harvester volumes through to guest clusters.

use std::path::PathBuf;
use std::time::Duration;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser};
use harvester_common::flags::{self, Outcome, Syntax};
use harvester_csi_driver::{Config, Mode, Timeouts};

/// Flags compatible with the upstream harvester-csi-driver where they exist. Read as upstream's
/// urfave/cli v1 (Go `flag`) reads them: `-name` or `--name`, `=value` or a separate value, a
/// bare bool, the last of a repeated flag; `-v`/`--version` prints the version.
#[derive(Parser, Debug)]
#[command(
    version,
    about = "CSI driver passing Harvester storage through to guest clusters",
    args_override_self = true
)]
struct Cli {
    /// CSI endpoint, `unix:///path/csi.sock`.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Node ID: the guest node's name (the hostname); the VM name is discovered from it.
    #[arg(long, env = "NODE_ID")]
    nodeid: Option<String>,
    /// The Harvester cloud-config (kubeconfig; its context namespace holds the guest VMs). Empty:
    /// none, for a node plugin (`--mode=node`) that needs no Harvester credential.
    #[arg(long, default_value = harvester_common::cloud_config::DEFAULT_PATH,
          value_parser = path_or_empty)]
    kubeconfig: PathBuf,
    /// Harvester StorageClass for new volumes when the guest StorageClass has no `hostStorageClass`.
    #[arg(long, env = "HOST_STORAGE_CLASS")]
    host_storage_class: Option<String>,
    /// Which CSI services to serve (Identity is always served).
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
    /// Where hot-plugged disks appear by id.
    #[arg(long, default_value = "/dev/disk/by-id")]
    disk_by_id_dir: PathBuf,
    /// The kubelet's directory (its --root-dir): the node plugin refuses staging and target
    /// paths outside it; empty: any path, as upstream (warned about at start).
    #[arg(long, default_value = "", value_parser = path_or_empty)]
    kubelet_dir: PathBuf,
    /// Volumes a node can take (NodeGetInfo); default: 256 minus the VM's own disks.
    #[arg(long)]
    max_volumes_per_node: Option<u32>,
    /// Debug logging (as upstream's `--debug`).
    #[arg(long, env = "DEBUG", default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = flags::parse_go_bool)]
    debug: bool,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: harvester_common::telemetry::LogFormat,
    /// Address of the /healthz, /readyz and /metrics endpoints (`host:port` or `:port`); empty:
    /// not served.
    #[arg(long, default_value = "")]
    metrics_address: String,
    /// Warn this many days before the cloud-config's token expires.
    #[arg(long, default_value_t = 7)]
    token_expiry_warning_days: u16,
    /// Seconds RPCs in flight may take to finish after SIGTERM.
    #[arg(long, default_value_t = 25)]
    shutdown_grace_seconds: u16,
    /// This guest cluster's name: labels the volumes, snapshots and backups the controller
    /// makes on Harvester (`guestcluster.harvesterhci.io/name`); it acts on no others.
    #[arg(long, default_value = harvester_csi_driver::DEFAULT_CLUSTER_NAME)]
    cluster_name: String,
    /// Also act on Harvester volumes, snapshots and backups without the cluster label (those
    /// of upstream's driver), for the time of a switch from it: any such object of the
    /// namespace is then reachable by volume ID (docs/install.md).
    #[arg(long, default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = flags::parse_go_bool)]
    adopt_unlabelled_volumes: bool,
    /// List and restore remote backups of other Harvester namespaces (other guest clusters'),
    /// as upstream does; needs the cluster-wide backups binding.
    #[arg(long, default_value = "false", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = flags::parse_go_bool)]
    allow_cross_namespace_backups: bool,
    /// Seconds NodeStageVolume waits for a hot-plugged disk to appear in the node (then
    /// NOT_FOUND naming its serial).
    #[arg(long, default_value_t = Timeouts::default().device.as_secs(), value_parser = bound_seconds())]
    device_timeout_seconds: u64,
    /// Seconds NodeStageVolume of an RWX volume gives `mount.nfs` (then it is killed: UNAVAILABLE).
    #[arg(long, default_value_t = Timeouts::default().nfs_mount.as_secs(), value_parser = bound_seconds())]
    nfs_mount_timeout_seconds: u64,
    /// Seconds an RWX volume's NFS server gets to answer statvfs or an unmount (then
    /// UNAVAILABLE naming the server; the unmount is forced and lazy).
    #[arg(long, default_value_t = Timeouts::default().nfs_server.as_secs(), value_parser = bound_seconds())]
    nfs_server_timeout_seconds: u64,
}

/// A path, or nothing (clap's own path parser refuses an empty value).
fn path_or_empty(s: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(s))
}

/// A node-side wait's bound: at least a second (a zero bound fails every wait), at most an hour.
fn bound_seconds() -> clap::builder::RangedU64ValueParser {
    clap::value_parser!(u64).range(1..=3600)
}

/// Exit code of a refused command line, as Go flag programs use.
const BAD_FLAG: u8 = 2;

/// Reads a command line (program name first) as upstream's urfave/cli does.
fn parse_cli<I, T>(args: I) -> Result<Cli, Outcome>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString>,
{
    // urfave/cli's `-v, --version` (clap's own is `-V`).
    let version = clap::Arg::new("version")
        .short('v')
        .long("version")
        .action(clap::ArgAction::Version)
        .help("Print version");
    let command = Cli::command().disable_version_flag(true).arg(version);
    flags::take_hyphen_values(command)
        .try_get_matches_from(flags::normalize_args(args, Syntax::GoFlag))
        .and_then(|m| Cli::from_arg_matches(&m))
        .map_err(|e| flags::clap_outcome(&e))
}

fn main() -> ExitCode {
    let cli = match parse_cli(std::env::args_os()) {
        Ok(cli) => cli,
        Err(Outcome::Print(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(Outcome::Refused(line)) => {
            eprintln!("harvester-csi-driver: {line}");
            return ExitCode::from(BAD_FLAG);
        }
    };
    let default_filter = if cli.debug { "debug" } else { "info" };
    harvester_common::telemetry::init_logging(cli.log_format, default_filter);
    let config = match config(cli) {
        Ok(c) => c,
        Err(line) => {
            eprintln!("harvester-csi-driver: {line}");
            return ExitCode::from(BAD_FLAG);
        }
    };
    let served = runtime(config.mode)
        .map_err(|e| format!("starting the runtime: {e}"))
        .and_then(|runtime| {
            runtime
                .block_on(harvester_csi_driver::serve(
                    config,
                    harvester_common::telemetry::shutdown_signal(),
                ))
                .map_err(|e| harvester_common::api_error::one_line(&e))
        });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(line) => {
            eprintln!("harvester-csi-driver: {line}");
            ExitCode::FAILURE
        }
    }
}

/// The node plugin runs on every guest node and mostly waits: one thread serves it (its calls
/// are short: local file-system calls, and child processes such as mkfs and mount awaited
/// without holding the thread). A worker thread per core would add its stack and malloc arena to
/// every node's footprint. The controller (and `all`) keeps a worker per core.
fn runtime(mode: Mode) -> std::io::Result<tokio::runtime::Runtime> {
    if mode.controller() {
        tokio::runtime::Runtime::new()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    }
}

/// The driver's configuration from the flags; a value that does not parse is named.
fn config(cli: Cli) -> Result<Config, String> {
    harvester_csi_driver::parse_endpoint(&cli.endpoint).map_err(|e| e.to_string())?;
    let mut config = Config::new(cli.endpoint, PathBuf::new());
    config.cloud_config =
        (!cli.kubeconfig.as_os_str().is_empty()).then(|| cloud_config_path(cli.kubeconfig));
    config.mode = cli.mode;
    config.node_id = cli.nodeid;
    config.host_storage_class = cli.host_storage_class;
    config.disk_by_id_dir = cli.disk_by_id_dir;
    config.max_volumes_per_node = cli.max_volumes_per_node;
    config.kubelet_dir = match cli.kubelet_dir.to_str() {
        Some("") => None,
        Some(dir) => match harvester_csi_driver::request::path_problem(dir) {
            None => Some(cli.kubelet_dir.clone()),
            Some(problem) => return Err(format!("--kubelet-dir {dir:?} {problem}")),
        },
        None => return Err(format!("--kubelet-dir {:?} is not UTF-8", cli.kubelet_dir)),
    };
    config.metrics_address = harvester_common::telemetry::server::parse_address(
        "--metrics-address",
        &cli.metrics_address,
    )?;
    config.token_expiry_warning =
        Duration::from_secs(u64::from(cli.token_expiry_warning_days) * 86_400);
    config.shutdown_grace = Duration::from_secs(u64::from(cli.shutdown_grace_seconds));
    config.timeouts.device = Duration::from_secs(cli.device_timeout_seconds);
    config.timeouts.nfs_mount = Duration::from_secs(cli.nfs_mount_timeout_seconds);
    config.timeouts.nfs_server = Duration::from_secs(cli.nfs_server_timeout_seconds);
    config.cluster_name =
        harvester_csi_driver::controller::owner::parse_cluster_name(&cli.cluster_name)?;
    config.adopt_unlabelled_volumes = cli.adopt_unlabelled_volumes;
    config.cross_namespace_backups = cli.allow_cross_namespace_backups;
    Ok(config)
}

/// `--kubeconfig`, or `/etc/kubernetes/cloud-config` when that file is missing and the default
/// exists (upstream's fallback: a chart that mounts the cloud-config elsewhere keeps working).
fn cloud_config_path(given: PathBuf) -> PathBuf {
    let fallback = PathBuf::from(harvester_common::cloud_config::DEFAULT_PATH);
    if !given.exists() && given != fallback && fallback.exists() {
        tracing::info!(
            "--kubeconfig {} does not exist; using {} as upstream does",
            given.display(),
            fallback.display()
        );
        return fallback;
    }
    given
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, Outcome> {
        parse_cli(std::iter::once("harvester-csi-driver").chain(args.iter().copied()))
    }

    /// What upstream's node DaemonSet renders (harvester/charts
    /// charts/harvester-csi-driver/templates/daemonset.yaml), the kubelet having expanded $(VARS).
    #[test]
    fn upstream_chart_args() {
        let cli = parse(&[
            "--nodeid=worker-1",
            "--endpoint=unix:///csi/csi.sock",
            "--kubeconfig=/var/lib/harvester/cloud-provider-config",
            "--host-storage-class=longhorn-single",
        ])
        .unwrap();
        assert_eq!(cli.nodeid.as_deref(), Some("worker-1"));
        assert_eq!(cli.endpoint, "unix:///csi/csi.sock");
        assert_eq!(
            cli.kubeconfig,
            PathBuf::from("/var/lib/harvester/cloud-provider-config")
        );
        assert_eq!(cli.host_storage_class.as_deref(), Some("longhorn-single"));
        assert!(
            matches!(cli.mode, Mode::All),
            "one process serves all, as upstream"
        );
    }

    #[test]
    fn the_kubelet_dir_is_a_clean_absolute_path_or_nothing() {
        let dir = |v: &str| config(parse(&[&format!("--kubelet-dir={v}")]).unwrap());
        assert_eq!(dir("").unwrap().kubelet_dir, None);
        assert_eq!(
            dir("/var/lib/kubelet").unwrap().kubelet_dir,
            Some(PathBuf::from("/var/lib/kubelet"))
        );
        for bad in [
            "var/lib/kubelet",
            "/var/lib/../kubelet",
            "/var/lib/kubelet/",
        ] {
            let e = dir(bad).unwrap_err();
            assert!(e.contains("--kubelet-dir") && e.contains(bad), "{e}");
        }
    }

    /// Our chart's node DaemonSet passes `--kubeconfig=` (no Harvester credential).
    #[test]
    fn an_empty_kubeconfig_means_none() {
        let none =
            config(parse(&["--mode=node", "--nodeid=n1", "--kubeconfig="]).unwrap()).unwrap();
        assert_eq!(none.cloud_config, None);
        let given = config(parse(&["--kubeconfig=/c/cloud-config"]).unwrap()).unwrap();
        assert_eq!(given.cloud_config, Some(PathBuf::from("/c/cloud-config")));
    }

    #[test]
    fn go_flag_spellings() {
        let cli = parse(&[
            "-nodeid",
            "n1",
            "-endpoint=unix:///a.sock",
            "-debug",
            "--endpoint",
            "unix:///b.sock",
        ])
        .unwrap();
        assert_eq!(cli.nodeid.as_deref(), Some("n1"));
        assert_eq!(
            cli.endpoint, "unix:///b.sock",
            "the last of a repeated flag"
        );
        assert!(cli.debug, "a bare bool");
        assert!(!parse(&["--debug=false"]).unwrap().debug);
        assert!(
            matches!(parse(&["-v"]), Err(Outcome::Print(_))),
            "-v prints the version"
        );
        assert!(matches!(parse(&["-h"]), Err(Outcome::Print(_))));
    }

    #[test]
    fn node_wait_bounds_default_to_the_driver_s_and_are_set_by_flags() {
        let defaults = config(parse(&[]).unwrap()).unwrap().timeouts;
        assert_eq!(defaults.device, Timeouts::default().device);
        assert_eq!(defaults.nfs_mount, Timeouts::default().nfs_mount);
        assert_eq!(defaults.nfs_server, Timeouts::default().nfs_server);
        let set = config(
            parse(&[
                "--device-timeout-seconds=5",
                "-nfs-mount-timeout-seconds",
                "6",
                "--nfs-server-timeout-seconds=7",
            ])
            .unwrap(),
        )
        .unwrap()
        .timeouts;
        assert_eq!(set.device, Duration::from_secs(5));
        assert_eq!(set.nfs_mount, Duration::from_secs(6));
        assert_eq!(set.nfs_server, Duration::from_secs(7));
        assert_eq!(set.attach, Timeouts::default().attach, "the rest unchanged");
    }

    #[test]
    fn tenancy_flags_default_to_the_safe_side_and_are_set_by_flags() {
        let defaults = config(parse(&[]).unwrap()).unwrap();
        assert_eq!(
            defaults.cluster_name,
            harvester_csi_driver::DEFAULT_CLUSTER_NAME
        );
        assert!(!defaults.adopt_unlabelled_volumes);
        assert!(!defaults.cross_namespace_backups);
        let set = config(
            parse(&[
                "--cluster-name=rke2-prod",
                "--adopt-unlabelled-volumes",
                "-allow-cross-namespace-backups=true",
            ])
            .unwrap(),
        )
        .unwrap();
        assert_eq!(set.cluster_name, "rke2-prod");
        assert!(set.adopt_unlabelled_volumes && set.cross_namespace_backups);
        let e = config(parse(&["--cluster-name=a/b"]).unwrap()).unwrap_err();
        assert!(e.contains("--cluster-name") && e.contains("a/b"), "{e}");
    }

    #[test]
    fn bad_flags_are_one_line_naming_them() {
        for (args, names) in [
            (&["--no-such"][..], &["--no-such"][..]),
            (&["--debug=maybe"], &["--debug", "maybe"]),
            (&["--mode=sideways"], &["--mode", "sideways"]),
            (
                &["--device-timeout-seconds=0"],
                &["--device-timeout-seconds", "0"],
            ),
            (
                &["--nfs-server-timeout-seconds=3601"],
                &["--nfs-server-timeout-seconds", "3601"],
            ),
            (
                &["--nfs-mount-timeout-seconds=soon"],
                &["--nfs-mount-timeout-seconds", "soon"],
            ),
        ] {
            match parse(args) {
                Err(Outcome::Refused(line)) => {
                    assert!(!line.contains('\n'), "{line}");
                    for n in names {
                        assert!(line.contains(n), "{line:?} names {n}");
                    }
                }
                Err(Outcome::Print(p)) => panic!("{args:?} printed {p}"),
                Ok(_) => panic!("{args:?} must be refused"),
            }
        }
    }
}
