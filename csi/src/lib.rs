//! `harvester-csi-driver`: a CSI plugin passing Harvester volumes through to guest clusters.
//!
//! A volume is a PVC on Harvester, of one of two kinds:
//! - hot-plugged (the default): block mode (or `hostVolumeMode: filesystem`), ReadWriteMany so
//!   the VM can live-migrate, hot-plugged into one guest VM at a time as a SCSI disk with a
//!   serial derived from the volume ID; the node plugin in the VM finds the disk by that serial,
//!   formats it once and mounts it;
//! - RWX (MULTI_NODE_MULTI_WRITER): a Longhorn filesystem PVC that Longhorn's share manager
//!   exports over NFS once its NetworkFilesystem is enabled; every node mounts the export.
//!
//! Snapshots are Harvester VolumeSnapshots, and with `type: backup` remote backups
//! (VolumeRemoteBackup); a volume can be made from either, or cloned from another volume.
//!
//! Layout: [`controller`] (the CSI trait and a dispatcher over one module per volume kind:
//! `hotplug`, `nfs`, `snapshots`, on a toolbox of Kubernetes helpers and the pure host-PVC
//! rules), [`node`] (stage/publish of disks and NFS mounts), [`identity`]; [`request`] and
//! [`naming`] read and name what the RPCs carry, [`error`] maps every failure to a CSI code
//! once, and [`rpc`] logs and times each call.
//!
//! [`serve`] runs the Identity service and, by [`Mode`], the Controller and/or Node services on a
//! unix socket (or a TCP address) until a shutdown future completes. The binary is a thin CLI
//! over it; tests and the demo run it in-process.

pub mod controller;
pub mod error;
pub mod identity;
mod inflight;
pub mod naming;
pub mod node;
pub mod request;
pub mod rpc;

use harvester_common::running::OnDrop;
use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_proto::csi::v1::controller_server::ControllerServer;
use csi_proto::csi::v1::identity_server::IdentityServer;
use csi_proto::csi::v1::node_server::NodeServer;
use futures::FutureExt;
use harvester_common::cloud_config::{CloudConfigError, Harvester};
use harvester_common::telemetry::{Metrics, Readiness};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};

/// The CSI driver name, as upstream.
pub const DRIVER_NAME: &str = "driver.harvesterhci.io";
/// This driver's version, reported by GetPluginInfo.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Which CSI services to serve (Identity is always served).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Controller,
    Node,
    All,
}

impl Mode {
    pub fn controller(self) -> bool {
        matches!(self, Mode::Controller | Mode::All)
    }
    pub fn node(self) -> bool {
        matches!(self, Mode::Node | Mode::All)
    }
}

/// Bounds of the waits inside RPCs. Each wait watches (or, for devices, polls) and fails with
/// a message naming what it waited for.
#[derive(Clone, Debug)]
pub struct Timeouts {
    /// Publish: Harvester PVC Bound.
    pub bind: Duration,
    /// Publish: VMI volumeStatus Ready.
    pub attach: Duration,
    /// Unpublish: volume gone from VM and VMI.
    pub detach: Duration,
    /// ControllerExpand: PVC status capacity reached.
    pub resize: Duration,
    /// CreateSnapshot: how long to wait for readyToUse before answering `ready_to_use: false`.
    pub snapshot_ready: Duration,
    /// NodeStage/NodePublish: the disk appears in the by-id directory or sysfs.
    pub device: Duration,
    /// NodeStage of an RWX volume: `mount.nfs` answers (else it is killed: UNAVAILABLE).
    pub nfs_mount: Duration,
    /// ControllerPublish of an RWX volume: the NetworkFilesystem's endpoint Ready.
    pub nfs_ready: Duration,
    /// ControllerPublish of an RWX volume being disabled (the last node unpublished): the
    /// NetworkFilesystem gets from `Disabling` to `Disabled` (Longhorn's share manager stopped)
    /// before it is enabled again; past it, UNAVAILABLE naming the state.
    pub nfs_disabled: Duration,
    /// NodeGetVolumeStats, NodeUnpublish and NodeUnstage of an RWX volume: the NFS server answers
    /// statvfs or the unmount; past it, an unmount is forced and lazy, and the answer is
    /// UNAVAILABLE naming the server.
    pub nfs_server: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            bind: Duration::from_secs(60),
            attach: Duration::from_secs(90),
            detach: Duration::from_secs(90),
            resize: Duration::from_secs(90),
            snapshot_ready: Duration::from_secs(10),
            device: Duration::from_secs(30),
            nfs_mount: Duration::from_secs(30),
            nfs_ready: Duration::from_secs(90),
            nfs_disabled: Duration::from_secs(60),
            nfs_server: Duration::from_secs(10),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// `unix:///path/csi.sock`, `unix:/path` or an absolute path.
    pub endpoint: String,
    pub mode: Mode,
    /// The node ID as given (`--nodeid`, the hostname); the VM name is discovered from it.
    pub node_id: Option<String>,
    /// The Harvester cloud-config (kubeconfig whose context namespace holds the VMs); `None`
    /// (`--kubeconfig=`): none, which only the node plugin can do without (docs/security.md).
    pub cloud_config: Option<PathBuf>,
    /// Default Harvester StorageClass for new volumes (the `hostStorageClass` parameter wins).
    pub host_storage_class: Option<String>,
    /// Where hot-plugged disks appear by id (`/dev/disk/by-id`).
    pub disk_by_id_dir: PathBuf,
    /// The kubelet's directory: staging and target paths outside it are refused; `None`: any
    /// path, as upstream.
    pub kubelet_dir: Option<PathBuf>,
    /// sysfs root, for the by-serial fallback (`/sys`).
    pub sysfs_dir: PathBuf,
    /// Reported in NodeGetInfo; `None` derives it from the VMI (256 minus its static disks).
    pub max_volumes_per_node: Option<u32>,
    pub timeouts: Timeouts,
    /// Where `/healthz`, `/readyz` and `/metrics` are served; `None`: not served.
    pub metrics_address: Option<SocketAddr>,
    /// Warn this long before the cloud-config's token expires.
    pub token_expiry_warning: Duration,
    /// After the shutdown signal, how long RPCs in flight may take before the server stops
    /// anyway (below the kubelet's default 30 s grace period).
    pub shutdown_grace: Duration,
    /// How often Harvester is asked for the `harvester` readiness check.
    pub harvester_check_period: Duration,
    /// The guest cluster's kubeconfig for the controller (it reads Nodes for the out-of-service
    /// taint); `None`: the in-cluster config, else `KUBECONFIG`.
    pub guest_kubeconfig: Option<PathBuf>,
    /// `--cluster-name`: labels this cluster's objects on Harvester; the driver acts on no
    /// other's (`controller::owner`).
    pub cluster_name: String,
    /// `--adopt-unlabelled-volumes`: objects without the cluster label count as this cluster's
    /// (for a switch from upstream's driver, whose volumes carry none).
    pub adopt_unlabelled_volumes: bool,
    /// `--allow-cross-namespace-backups`: ListSnapshots shows, and CreateVolume restores, remote
    /// backups of other Harvester namespaces (other guest clusters').
    pub cross_namespace_backups: bool,
}

/// The cluster name when `--cluster-name` is not given (the cloud provider's and upstream's).
pub const DEFAULT_CLUSTER_NAME: &str = "kubernetes";

/// How long start-up waits for the first read of Harvester's `server-version` (the hot-plug mode)
/// before serving anyway (then publish answers UNAVAILABLE until it is read).
const HOTPLUG_MODE_FIRST_READ: Duration = Duration::from_secs(10);

/// Readiness checks: Harvester answers with the cloud-config's credentials; the CSI socket serves.
pub const READY_HARVESTER: &str = "harvester";
pub const READY_CSI: &str = "csi";
/// Node mode: Harvester let the plugin look up its VMI (node ID, volume limit).
pub const READY_NODE: &str = "node";

impl Config {
    /// Defaults for everything but the endpoint and the cloud-config.
    pub fn new(endpoint: impl Into<String>, cloud_config: impl Into<PathBuf>) -> Config {
        Config {
            endpoint: endpoint.into(),
            mode: Mode::All,
            node_id: None,
            cloud_config: Some(cloud_config.into()),
            host_storage_class: None,
            disk_by_id_dir: PathBuf::from("/dev/disk/by-id"),
            kubelet_dir: None,
            sysfs_dir: PathBuf::from("/sys"),
            max_volumes_per_node: None,
            timeouts: Timeouts::default(),
            metrics_address: None,
            token_expiry_warning: Duration::from_secs(7 * 86_400),
            shutdown_grace: Duration::from_secs(25),
            harvester_check_period: harvester_common::cloud_config::CREDENTIALS_CHECK_PERIOD,
            guest_kubeconfig: None,
            cluster_name: DEFAULT_CLUSTER_NAME.to_string(),
            adopt_unlabelled_volumes: false,
            cross_namespace_backups: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("socket {path}: {action}: {source}")]
    Socket {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("tcp endpoint {address}: binding: {source}")]
    Tcp {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("socket {path} exists and is not a socket; refusing to remove it")]
    NotASocket { path: PathBuf },
    #[error(transparent)]
    CloudConfig(#[from] CloudConfigError),
    #[error("--nodeid is required in {0:?} mode")]
    NoNodeId(Mode),
    #[error("--kubeconfig is required in {0:?} mode: the controller acts on Harvester")]
    NoCloudConfig(Mode),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("--metrics-address {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("driver task: {0}")]
    Task(String),
}

/// A driver task that panicked or was cancelled ([`Running`]).
impl From<tokio::task::JoinError> for ServeError {
    fn from(e: tokio::task::JoinError) -> Self {
        ServeError::Task(e.to_string())
    }
}

/// Where the driver serves CSI: a unix socket (what kubelet and the sidecars use) or, as the CSI
/// spec allows, a TCP address (a node plugin in a VM reached through a forwarded port).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port` as given after `tcp://`; the host may be an IP address or a name.
    Tcp {
        host: String,
        port: u16,
    },
}

/// Parses `unix:///path`, `unix:/path`, an absolute path, or `tcp://host:port`
/// (`tcp://[::1]:port` for IPv6).
pub fn parse_endpoint(endpoint: &str) -> Result<Endpoint, ServeError> {
    let bad = |reason: &str| ServeError::Endpoint {
        endpoint: endpoint.to_string(),
        reason: reason.to_string(),
    };
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let rest = rest.trim_end_matches('/');
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| bad("a tcp endpoint needs a port: tcp://<host>:<port>"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains('/') {
            return Err(bad("a tcp endpoint needs a host: tcp://<host>:<port>"));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| bad(&format!("port {port:?} is not a number from 0 to 65535")))?;
        return Ok(Endpoint::Tcp {
            host: host.to_string(),
            port,
        });
    }
    let path = if let Some(rest) = endpoint.strip_prefix("unix://") {
        rest
    } else if let Some(rest) = endpoint.strip_prefix("unix:") {
        rest
    } else if endpoint.contains("://") {
        return Err(bad("only unix:// and tcp:// endpoints are supported"));
    } else {
        endpoint
    };
    if !path.starts_with('/') {
        return Err(bad("the socket path must be absolute"));
    }
    Ok(Endpoint::Unix(PathBuf::from(path)))
}

/// The socket path of a unix CSI endpoint (an error for any other kind).
pub fn socket_path(endpoint: &str) -> Result<PathBuf, ServeError> {
    match parse_endpoint(endpoint)? {
        Endpoint::Unix(path) => Ok(path),
        Endpoint::Tcp { .. } => Err(ServeError::Endpoint {
            endpoint: endpoint.to_string(),
            reason: "not a unix socket".into(),
        }),
    }
}

/// A bound CSI listener of either kind, as a stream of connections for tonic.
enum Listener {
    Unix(tokio::net::UnixListener, PathBuf),
    Tcp(tokio::net::TcpListener, SocketAddr),
}

impl Listener {
    async fn bind(endpoint: &Endpoint) -> Result<Listener, ServeError> {
        match endpoint {
            Endpoint::Unix(path) => Ok(Listener::Unix(bind(path)?, path.clone())),
            Endpoint::Tcp { host, port } => {
                let l = tokio::net::TcpListener::bind((host.as_str(), *port))
                    .await
                    .map_err(|source| ServeError::Tcp {
                        address: format!("{host}:{port}"),
                        source,
                    })?;
                let addr = l.local_addr().map_err(|source| ServeError::Tcp {
                    address: format!("{host}:{port}"),
                    source,
                })?;
                Ok(Listener::Tcp(l, addr))
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Listener::Unix(_, path) => format!("unix://{}", path.display()),
            Listener::Tcp(_, addr) => format!("tcp://{addr}"),
        }
    }
}

/// Binds the socket in its directory (created when missing): see [`bind_unix_socket`].
fn bind(path: &Path) -> Result<tokio::net::UnixListener, ServeError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ServeError::Socket {
            path: path.to_path_buf(),
            action: "creating its directory",
            source,
        })?;
    }
    bind_unix_socket(path)
}

/// Binds a unix socket at `path`: a stale socket is removed, anything else at the path is left
/// alone; the socket is made owner-only (0600). (The test bed's kubelet plugin registrar binds
/// its registration socket with this too.)
pub fn bind_unix_socket(path: &Path) -> Result<tokio::net::UnixListener, ServeError> {
    let err = |action: &'static str| {
        let path = path.to_path_buf();
        move |source| ServeError::Socket {
            path,
            action,
            source,
        }
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(err("removing the stale socket"))?
        }
        Ok(_) => {
            return Err(ServeError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("inspecting")(e)),
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(err("binding"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(err("setting mode 0600"))?;
    Ok(listener)
}

/// Serves CSI on `config.endpoint` until `shutdown` completes, then removes a unix socket.
pub async fn serve(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let readiness = Readiness::with_checks(&[READY_HARVESTER, READY_CSI]);
    serve_with(config, Metrics::new(), readiness, shutdown).await
}

/// [`serve`], reporting into `metrics` and `readiness` (served over HTTP when
/// `config.metrics_address` is set). On `shutdown` the socket stops accepting calls and RPCs in
/// flight get `config.shutdown_grace` to finish.
pub async fn serve_with(
    config: Config,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let endpoint = parse_endpoint(&config.endpoint)?;
    let shutdown = shutdown.boxed().shared();
    if let Some(addr) = config.metrics_address {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Metrics { addr, source })?;
        tracing::info!("health and metrics on http://{addr}");
        tokio::spawn(harvester_common::telemetry::server::serve_on(
            listener,
            metrics.clone(),
            readiness.clone(),
            shutdown.clone(),
        ));
    }
    let harvester = match &config.cloud_config {
        Some(path) => Some(Harvester::load_with_metrics(path, Some(&metrics)).await?),
        None if config.mode.controller() => return Err(ServeError::NoCloudConfig(config.mode)),
        None => None,
    };
    let credentials = harvester.clone().map(|harvester| {
        let readiness = readiness.clone();
        let (warn_before, period) = (config.token_expiry_warning, config.harvester_check_period);
        tokio::spawn(async move {
            harvester
                .watch_credentials(&readiness, READY_HARVESTER, warn_before, period, |_| {})
                .await
        })
    });
    if harvester.is_none() {
        readiness.set(READY_HARVESTER, Ok(()));
    }
    let identity = identity::IdentityService::new(config.mode);
    let (controller, hotplug_follower) = match (&harvester, config.mode.controller()) {
        (Some(harvester), true) => {
            let (service, task) = start_controller(&config, harvester, &metrics, &readiness).await;
            (Some(service), Some(task))
        }
        _ => (None, None),
    };
    let node = if config.mode.node() {
        let given = config
            .node_id
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or(ServeError::NoNodeId(config.mode))?;
        let node = node::NodeService::start(harvester.as_ref(), &given, &config).await;
        readiness.set(READY_NODE, node.discovery());
        Some(node)
    } else {
        None
    };
    let listener = Listener::bind(&endpoint).await?;
    tracing::info!(
        endpoint = %listener.describe(),
        mode = ?config.mode,
        namespace = harvester.as_ref().map_or("", |h| h.namespace.as_str()),
        node = node.as_ref().map(|n| n.node_id()).unwrap_or_default(),
        "harvester-csi-driver {VERSION} serving CSI {}",
        csi_proto::CSI_SPEC_VERSION
    );
    readiness.set(READY_CSI, Ok(()));
    let router = tonic::transport::Server::builder()
        .layer(rpc::RpcMetricsLayer::new(metrics))
        .add_service(IdentityServer::new(identity))
        .add_optional_service(controller.map(ControllerServer::new))
        .add_optional_service(node.map(NodeServer::new));
    let socket = match &listener {
        Listener::Unix(_, path) => Some(path.clone()),
        Listener::Tcp(..) => None,
    };
    let server = match listener {
        Listener::Unix(l, _) => router
            .serve_with_incoming_shutdown(UnixListenerStream::new(l), shutdown.clone())
            .boxed(),
        Listener::Tcp(l, _) => router
            .serve_with_incoming_shutdown(TcpListenerStream::new(l), shutdown.clone())
            .boxed(),
    };
    let grace = config.shutdown_grace;
    let result = tokio::select! {
        r = server => r.map_err(ServeError::from),
        () = async { shutdown.await; tokio::time::sleep(grace).await } => {
            tracing::warn!("RPCs still running {grace:?} after the shutdown signal; stopping anyway");
            Ok(())
        }
    };
    if let Some(task) = credentials {
        task.abort();
    }
    if let Some(task) = hotplug_follower {
        task.abort();
    }
    if let Some(path) = socket {
        let _ = std::fs::remove_file(&path);
    }
    tracing::info!("harvester-csi-driver stopped");
    result
}

/// The controller service, and the task that follows Harvester's hot-plug mode for it (to
/// abort on shutdown).
async fn start_controller(
    config: &Config,
    harvester: &Harvester,
    metrics: &Metrics,
    readiness: &Readiness,
) -> (controller::ControllerService, tokio::task::JoinHandle<()>) {
    let guest = controller::guest_client(config.guest_kubeconfig.as_deref(), metrics).await;
    let (mut modes, task) = controller::hotplug::mode::HotplugModes::follow(
        harvester.client.clone(),
        readiness.clone(),
    );
    modes.first_read(HOTPLUG_MODE_FIRST_READ).await;
    let service = controller::ControllerService::new(harvester.clone(), guest, modes, config);
    (service, task)
}

/// A gRPC channel to a driver's unix socket (for tests, the demo and tools).
pub async fn connect(socket: &Path) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = socket.to_path_buf();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
}

/// A CSI driver serving on the current Tokio runtime (tests, the demo, the bench, embedding), as
/// `harvester_cloud_provider::spawn` runs the provider. Dropping it stops the driver gracefully,
/// not by abort: the driver still removes its socket.
pub type Running = harvester_common::running::Running<ServeError>;

/// Starts [`serve`] as a task; [`Running::stop`] shuts it down (calls in flight get the shutdown
/// grace, the socket is removed).
pub fn spawn(config: Config) -> Running {
    Running::spawn(|stopped| serve(config, stopped), OnDrop::Stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_name_unix_sockets() {
        for (e, want) in [
            ("unix:///csi/csi.sock", Some("/csi/csi.sock")),
            ("unix:/csi/csi.sock", Some("/csi/csi.sock")),
            ("/tmp/x.sock", Some("/tmp/x.sock")),
            ("tcp://127.0.0.1:10000", None),
            ("unix://relative.sock", None),
            ("http://127.0.0.1:10000", None),
            ("", None),
        ] {
            assert_eq!(
                socket_path(e).ok(),
                want.map(PathBuf::from),
                "endpoint {e:?}"
            );
        }
    }

    #[test]
    fn tcp_endpoints_name_host_and_port() {
        let tcp = |host: &str, port| Endpoint::Tcp {
            host: host.into(),
            port,
        };
        for (e, want) in [
            ("tcp://0.0.0.0:10000", Ok(tcp("0.0.0.0", 10000))),
            ("tcp://127.0.0.1:0/", Ok(tcp("127.0.0.1", 0))),
            ("tcp://[::1]:9000", Ok(tcp("::1", 9000))),
            ("tcp://csi-node.local:9000", Ok(tcp("csi-node.local", 9000))),
            ("tcp://127.0.0.1", Err("needs a port")),
            ("tcp://:9000", Err("needs a host")),
            ("tcp://127.0.0.1:70000", Err("port \"70000\"")),
            ("tcp://127.0.0.1:x", Err("port \"x\"")),
            ("ftp://host:1", Err("only unix:// and tcp://")),
        ] {
            match (parse_endpoint(e), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "endpoint {e:?}"),
                (Err(err), Err(part)) => {
                    let text = err.to_string();
                    assert!(
                        text.contains(part) && text.contains(e),
                        "endpoint {e:?}: {text}"
                    );
                }
                (got, want) => panic!("endpoint {e:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn serves_identity_over_tcp() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let listener = Listener::bind(&Endpoint::Tcp {
                host: "127.0.0.1".into(),
                port: 0,
            })
            .await
            .expect("binding 127.0.0.1:0");
            let Listener::Tcp(l, addr) = listener else {
                panic!("not a tcp listener")
            };
            let server = tonic::transport::Server::builder()
                .add_service(IdentityServer::new(identity::IdentityService::new(
                    Mode::Node,
                )))
                .serve_with_incoming(TcpListenerStream::new(l));
            let task = tokio::spawn(server);
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .expect("uri")
                .connect()
                .await
                .expect("connecting over tcp");
            let info = csi_proto::csi::v1::identity_client::IdentityClient::new(channel)
                .get_plugin_info(csi_proto::csi::v1::GetPluginInfoRequest {})
                .await
                .expect("GetPluginInfo over tcp")
                .into_inner();
            assert_eq!(info.name, DRIVER_NAME);
            task.abort();
        });
    }

    #[test]
    fn bind_replaces_a_stale_socket_but_not_a_file() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let dir = tempfile::tempdir().expect("tempdir");
            let sock = dir.path().join("sub/csi.sock");
            drop(bind(&sock).expect("first bind"));
            let l = bind(&sock).expect("a stale socket is replaced");
            let mode = std::fs::metadata(&sock)
                .expect("socket")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
            drop(l);
            let file = dir.path().join("file");
            std::fs::write(&file, b"data").expect("file");
            assert!(matches!(bind(&file), Err(ServeError::NotASocket { .. })));
            assert_eq!(std::fs::read(&file).expect("file kept"), b"data");
        });
    }
}
