//! The kubelet plugin registrar of the test bed: what node-driver-registrar does, which the Go
//! module proxy does not serve here. It asks the CSI driver on `--csi-address` for its name, then
//! serves `pluginregistration.Registration` on `<--plugin-registration-path>/<name>@reg.sock`,
//! where the kubelet's plugin watcher finds it, calls `GetInfo` and then dials the driver's
//! endpoint (`--kubelet-registration-path`, the driver socket's path on the host).
//!
//! Behaviour and flags follow kubernetes-csi/node-driver-registrar
//! `cmd/csi-node-driver-registrar/{main,node_register}.go`: supported versions `["1.0.0"]`;
//! `GetInfo` touches `<dir of --kubelet-registration-path>/registration`, the file the
//! `--mode=kubelet-registration-probe` check looks for; a `NotifyRegistrationStatus` saying the
//! registration failed makes the process exit 1 (the container restarts and registers again);
//! SIGTERM removes the socket and exits 0. Not served: the diagnostics HTTP server
//! (`--http-endpoint`, `--health-port`) and pprof.

use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_proto::csi::v1::GetPluginInfoRequest;
use csi_proto::csi::v1::identity_client::IdentityClient;
use csi_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use csi_proto::pluginregistration::{
    CSI_PLUGIN, InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnixListenerStream;

/// The registration API versions node-driver-registrar announces (`supportedVersions`).
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// node-driver-registrar's modes (`--mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RegistrarMode {
    /// Long-running: serve the registration socket.
    Registration,
    /// An exec probe: exit 0 if the kubelet has called GetInfo, 1 otherwise.
    KubeletRegistrationProbe,
}

#[derive(Debug, clap::Parser)]
#[command(
    name = "registrar",
    version,
    about = "Registers a CSI driver with the kubelet (pluginregistration.v1), like node-driver-registrar"
)]
pub struct Flags {
    /// Path of the CSI driver socket the registrar connects to (a path or unix:// URL).
    #[arg(long, default_value = "/run/csi/socket")]
    pub csi_address: String,
    /// Path to the kubelet's plugin registration directory (as mounted in this container).
    #[arg(long, default_value = "/registration")]
    pub plugin_registration_path: PathBuf,
    /// Path of the CSI driver socket on the host: the endpoint the kubelet will dial. Required.
    #[arg(long)]
    pub kubelet_registration_path: Option<String>,
    /// Timeout for calls to the driver (Go-style duration: 1s, 500ms, 2m).
    #[arg(long, default_value = "1s", value_parser = harvester_common::flags::parse_go_duration)]
    pub timeout: Duration,
    #[arg(long, value_enum, default_value = "registration")]
    pub mode: RegistrarMode,
    /// Log verbosity as klog's -v: 4 and above log at debug level.
    #[arg(long = "v", default_value_t = 0)]
    pub verbosity: u8,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistrarError {
    #[error("--kubelet-registration-path is a required parameter")]
    NoKubeletRegistrationPath,
    #[error("--kubelet-registration-path {0:?} must be an absolute path")]
    RelativeKubeletRegistrationPath(String),
    #[error("--csi-address {address:?}: {reason}")]
    CsiAddress { address: String, reason: String },
    #[error("the CSI driver on {address:?} reported an unusable name {name:?}: {reason}")]
    DriverName {
        address: String,
        name: String,
        reason: &'static str,
    },
    #[error("calling GetPluginInfo on the CSI driver at {address:?}: {reason}")]
    Driver { address: String, reason: String },
    #[error("registration socket: {0}")]
    Socket(#[from] harvester_csi_driver::ServeError),
    #[error("the kubelet has not registered the plugin yet: {0} does not exist")]
    NotRegistered(PathBuf),
    #[error("the kubelet reported that registering {driver:?} failed: {error}")]
    RegistrationFailed { driver: String, error: String },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// What the registrar serves, computed from the flags and the driver's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub driver: String,
    /// The endpoint `GetInfo` returns: the driver socket on the host.
    pub endpoint: String,
    /// `<plugin registration dir>/<driver>@reg.sock` (see [`socket_name`]).
    pub socket: PathBuf,
    /// `<dir of the endpoint>/registration`, touched on `GetInfo`.
    pub probe_file: PathBuf,
}

/// The registration socket's file name: `<driver>@reg.sock`, where node-driver-registrar uses
/// `<driver>-reg.sock`. The kubelet dials it without an authority override (kubernetes v1.34.4
/// `pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`, `dial`), so grpc-go
/// sends the socket path, %-encoded, as `:authority`; h2 (tonic's HTTP/2) refuses a `%` in a
/// host with PROTOCOL_ERROR (hyperium/tonic#1876) and the kubelet never registers the driver.
/// The `@` makes the encoded path the authority's userinfo, where h2 allows `%`.
pub fn socket_name(driver: &str) -> String {
    format!("{driver}@reg.sock")
}

/// The `:authority` grpc-go (v1.72.1, `clientconn.go` `encodeAuthority`, the version kubelet
/// 1.34.4 uses) sends for a dial target that is a socket path: every byte but unreserved,
/// sub-delims, `:`, `[`, `]` and `@` %-encoded.
pub fn grpc_go_authority(path: &str) -> String {
    path.bytes()
        .map(|c| {
            if c.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&c) {
                (c as char).to_string()
            } else {
                format!("%{c:02X}")
            }
        })
        .collect()
}

/// The probe file of node-driver-registrar: `registration` beside the host's driver socket.
pub fn probe_file(flags: &Flags) -> Result<PathBuf, RegistrarError> {
    let endpoint = flags
        .kubelet_registration_path
        .as_deref()
        .filter(|p| !p.is_empty())
        .ok_or(RegistrarError::NoKubeletRegistrationPath)?;
    let path = Path::new(endpoint);
    if !path.is_absolute() {
        return Err(RegistrarError::RelativeKubeletRegistrationPath(
            endpoint.to_string(),
        ));
    }
    Ok(path.parent().unwrap_or(Path::new("/")).join("registration"))
}

/// Checks the flags and the driver's name and says where to serve. The name becomes a file
/// name, so one with a `/` or a NUL (or empty, `.`, `..`) is refused.
pub fn plan(flags: &Flags, driver: &str) -> Result<Plan, RegistrarError> {
    let probe_file = probe_file(flags)?;
    let bad = |reason| RegistrarError::DriverName {
        address: flags.csi_address.clone(),
        name: driver.to_string(),
        reason,
    };
    if driver.is_empty() || driver == "." || driver == ".." {
        return Err(bad("empty or a dot name"));
    }
    if driver.contains(['/', '\0']) {
        return Err(bad("contains '/' or NUL"));
    }
    Ok(Plan {
        driver: driver.to_string(),
        endpoint: flags.kubelet_registration_path.clone().unwrap_or_default(),
        socket: flags.plugin_registration_path.join(socket_name(driver)),
        probe_file,
    })
}

/// Asks the driver on `--csi-address` for its name (Identity.GetPluginInfo).
pub async fn driver_name(flags: &Flags) -> Result<String, RegistrarError> {
    let address = flags.csi_address.clone();
    let socket =
        harvester_csi_driver::socket_path(&address).map_err(|e| RegistrarError::CsiAddress {
            address: address.clone(),
            reason: e.to_string(),
        })?;
    let failed = |reason: String| RegistrarError::Driver {
        address: address.clone(),
        reason,
    };
    let channel = connect_waiting(&socket, &address).await;
    let mut client = IdentityClient::new(channel);
    tokio::time::timeout(
        flags.timeout,
        client.get_plugin_info(GetPluginInfoRequest {}),
    )
    .await
    .map_err(|_| failed(format!("no answer within {:?} (--timeout)", flags.timeout)))?
    .map(|r| r.into_inner().name)
    .map_err(|s| failed(format!("{:?}: {}", s.code(), s.message())))
}

/// Connects to the driver's socket, waiting for it as long as it takes: the driver container
/// may start after this one. Like csi-lib-utils' `connection.Connect` (a blocking dial that
/// logs "Still connecting to <address>" every 10 s), which node-driver-registrar uses.
async fn connect_waiting(socket: &Path, address: &str) -> tonic::transport::Channel {
    const LOG_EVERY: Duration = Duration::from_secs(10);
    let mut backoff = Duration::from_millis(50);
    let mut last_log = tokio::time::Instant::now();
    loop {
        match harvester_csi_driver::connect(socket).await {
            Ok(channel) => return channel,
            Err(e) if last_log.elapsed() >= LOG_EVERY => {
                tracing::warn!("Still connecting to {address}: {e}");
                last_log = tokio::time::Instant::now();
            }
            Err(_) => {}
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// The `Registration` service. A failed registration is sent on `failures`; the server then stops
/// and the process exits 1, as node-driver-registrar does.
pub struct RegistrationService {
    plan: Plan,
    failures: mpsc::UnboundedSender<String>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        tracing::info!(driver = %self.plan.driver, endpoint = %self.plan.endpoint, "GetInfo");
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.plan.probe_file)
        {
            Ok(_) => {
                tracing::info!(path = %self.plan.probe_file.display(), "registration probe file created")
            }
            Err(e) => {
                tracing::error!(path = %self.plan.probe_file.display(), "creating the registration probe file: {e}")
            }
        }
        Ok(tonic::Response::new(PluginInfo {
            r#type: CSI_PLUGIN.to_string(),
            name: self.plan.driver.clone(),
            endpoint: self.plan.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.plan.driver, "the kubelet registered the plugin");
        } else {
            tracing::error!(driver = %self.plan.driver, error = %status.error, "registration failed; exiting so the container restarts");
            let _ = self.failures.send(status.error);
        }
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}

/// Binds the registration socket: a stale socket is replaced, anything else at the path is left
/// alone; the socket is owner-only (0600) as node-driver-registrar's umask 0077 makes it.
fn bind(path: &Path) -> Result<tokio::net::UnixListener, RegistrarError> {
    Ok(harvester_csi_driver::bind_unix_socket(path)?)
}

/// Serves the registration socket until `shutdown` completes (then `Ok`) or the kubelet reports a
/// failed registration (then [`RegistrarError::RegistrationFailed`]); removes the socket either way.
pub async fn serve(
    plan: Plan,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), RegistrarError> {
    let listener = bind(&plan.socket)?;
    tracing::info!(socket = %plan.socket.display(), driver = %plan.driver, "registration server started");
    let (tx, mut failures) = mpsc::unbounded_channel();
    let service = RegistrationService {
        plan: plan.clone(),
        failures: tx,
    };
    let mut failure = None;
    let stop = async {
        tokio::select! {
            () = shutdown => {}
            Some(error) = failures.recv() => failure = Some(error),
        }
    };
    let result = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(service))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
        .await;
    let _ = std::fs::remove_file(&plan.socket);
    result?;
    match failure {
        Some(error) => Err(RegistrarError::RegistrationFailed {
            driver: plan.driver,
            error,
        }),
        None => Ok(()),
    }
}

/// `--mode=kubelet-registration-probe`: `Ok` once the kubelet has called `GetInfo`.
pub fn probe(flags: &Flags) -> Result<(), RegistrarError> {
    let file = probe_file(flags)?;
    if file.exists() {
        Ok(())
    } else {
        Err(RegistrarError::NotRegistered(file))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn flags(args: &[&str]) -> Flags {
        Flags::try_parse_from(std::iter::once("registrar").chain(args.iter().copied()))
            .expect("flags parse")
    }

    #[test]
    fn plan_follows_node_driver_registrar() {
        let f = flags(&[
            "--csi-address=/csi/csi.sock",
            "--kubelet-registration-path=/var/lib/kubelet/plugins/driver.harvesterhci.io/csi.sock",
        ]);
        assert_eq!(
            plan(&f, "driver.harvesterhci.io").unwrap(),
            Plan {
                driver: "driver.harvesterhci.io".into(),
                endpoint: "/var/lib/kubelet/plugins/driver.harvesterhci.io/csi.sock".into(),
                socket: "/registration/driver.harvesterhci.io@reg.sock".into(),
                probe_file: "/var/lib/kubelet/plugins/driver.harvesterhci.io/registration".into(),
            }
        );
        assert_eq!(f.timeout, Duration::from_secs(1));
        assert_eq!(f.mode, RegistrarMode::Registration);
    }

    #[test]
    fn kubelets_authority_for_the_socket_is_one_h2_accepts() {
        let dir = "/var/lib/kubelet/plugins_registry";
        let ours = format!("{dir}/{}", socket_name("driver.harvesterhci.io"));
        let upstream = format!("{dir}/driver.harvesterhci.io-reg.sock");
        assert_eq!(
            grpc_go_authority(&upstream),
            "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fdriver.harvesterhci.io-reg.sock"
        );
        assert!(
            http::uri::Authority::try_from(grpc_go_authority(&upstream)).is_err(),
            "h2 refuses the authority of node-driver-registrar's name (why ours differs)"
        );
        http::uri::Authority::try_from(grpc_go_authority(&ours))
            .unwrap_or_else(|e| panic!("h2 refuses the authority of {ours}: {e}"));
    }

    #[test]
    fn bad_flags_and_names_are_named() {
        let none = flags(&[]);
        assert_eq!(
            plan(&none, "d").unwrap_err().to_string(),
            "--kubelet-registration-path is a required parameter"
        );
        let rel = flags(&["--kubelet-registration-path=csi.sock"]);
        assert!(
            plan(&rel, "d")
                .unwrap_err()
                .to_string()
                .contains("\"csi.sock\" must be an absolute path")
        );
        let ok = flags(&["--kubelet-registration-path=/p/csi.sock"]);
        for name in ["", ".", "..", "a/b"] {
            let e = plan(&ok, name).unwrap_err().to_string();
            assert!(e.contains(&format!("name {name:?}")), "{e}");
        }
        let e = Flags::try_parse_from(["registrar", "--timeout=soon"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"soon\" is not a duration"), "{e}");
        assert_eq!(
            flags(&["--timeout=500ms"]).timeout,
            Duration::from_millis(500)
        );
    }
}
