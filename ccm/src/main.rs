//! `harvester-cloud-provider`: the cloud controller manager of Kubernetes guest clusters on
//! Harvester HCI. Flags are parsed and checked here; the controllers are in the library.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use harvester_cloud_provider::Context;
use harvester_cloud_provider::config::secure::SecureServing;
use harvester_cloud_provider::config::{Config, ConfigError, OpsFlags, parse_go_duration};
use harvester_cloud_provider::error::one_line;
use harvester_cloud_provider::leader::{LeaderConfig, run_as_leader};
use harvester_cloud_provider::secure::{self, Delegated};
use harvester_cloud_provider::{
    READY_CLIENTS, READY_HARVESTER, Telemetry, guest_client, token_expiry_event,
};
use harvester_common::cloud_config::{CREDENTIALS_CHECK_PERIOD, Harvester};
use harvester_common::flags::Outcome;
use harvester_common::telemetry;

/// Exit code of a refused command line (a flag or a flag's value), as pflag programs use.
const BAD_FLAG: u8 = 2;

fn main() -> ExitCode {
    let parsed = match harvester_cloud_provider::config::parse_args(std::env::args_os()) {
        Ok(p) => p,
        Err(Outcome::Print(text)) => {
            print!("{text}");
            return ExitCode::SUCCESS;
        }
        Err(Outcome::Refused(line)) => {
            eprintln!("harvester-cloud-provider: {line}");
            return ExitCode::from(BAD_FLAG);
        }
    };
    let flags = parsed.flags;
    if flags.ops.version == Some(true) {
        println!("harvester-cloud-provider {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    telemetry::init_logging(
        flags.ops.logging_format.unwrap_or(flags.ops.log_format),
        Config::log_filter(flags.common.verbosity),
    );
    if !parsed.without_effect.is_empty() {
        tracing::info!(
            "upstream flags accepted without effect here (docs/ccm.md): {}",
            parsed.without_effect.join(" ")
        );
    }
    let checked = (|| -> Result<_, String> {
        let config = Config::from_flags(flags.clone()).map_err(|e| e.to_string())?;
        let leader = leader_config(&flags.ops).map_err(|e| e.to_string())?;
        let metrics_address =
            telemetry::server::parse_address("--metrics-address", &flags.ops.metrics_address)?;
        let secure = SecureServing::from_flags(&flags.secure).map_err(|e| e.to_string())?;
        Ok((config, leader, metrics_address, secure))
    })();
    let (config, leader, metrics_address, secure) = match checked {
        Ok(c) => c,
        Err(e) => {
            eprintln!("harvester-cloud-provider: {e}");
            return ExitCode::from(BAD_FLAG);
        }
    };
    // The certificate is read (or made) before anything else, as upstream does in Complete().
    let https = match https_endpoint(secure) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("harvester-cloud-provider: {e}");
            return ExitCode::FAILURE;
        }
    };
    let endpoints = Endpoints {
        metrics_address,
        https,
    };
    match start(config, leader, endpoints) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("harvester-cloud-provider: {}", one_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Where the endpoints are served: plain HTTP (`--metrics-address`) and HTTPS (`--secure-port`).
struct Endpoints {
    metrics_address: Option<std::net::SocketAddr>,
    https: Option<Https>,
}

/// The HTTPS endpoint, its certificate loaded.
struct Https {
    addr: std::net::SocketAddr,
    tls: std::sync::Arc<rustls::ServerConfig>,
    /// The served certificate and the files it follows.
    served: (std::sync::Arc<secure::tls::ServedCert>, secure::CertOptions),
    auth: secure::AuthOptions,
    authentication_kubeconfig: Option<std::path::PathBuf>,
    authorization_kubeconfig: Option<std::path::PathBuf>,
}

fn https_endpoint(s: SecureServing) -> Result<Option<Https>, secure::TlsError> {
    let Some(addr) = s.addr else {
        return Ok(None);
    };
    let cert = secure::tls::serving_cert(&s.cert)?;
    tracing::info!("serving certificate: {}", cert.origin);
    let (tls, served) = secure::tls::server_config(cert)?;
    Ok(Some(Https {
        addr,
        tls: std::sync::Arc::new(tls),
        served: (served, s.cert),
        auth: s.auth,
        authentication_kubeconfig: s.authentication_kubeconfig,
        authorization_kubeconfig: s.authorization_kubeconfig,
    }))
}

fn start(config: Config, leader: Option<LeaderConfig>, endpoints: Endpoints) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    let shutdown = telemetry::shutdown_signal().boxed().shared();
    let stop_waiting = shutdown.clone();
    runtime.block_on(async move {
        tokio::select! {
            result = serve(config, leader, endpoints, shutdown) => result,
            () = async { stop_waiting.await; tokio::time::sleep(SHUTDOWN_GRACE).await } => {
                tracing::warn!("reconciles still running {SHUTDOWN_GRACE:?} after the shutdown signal; exiting anyway");
                Ok(())
            }
        }
    })
}

/// How long in-flight reconciles may take after SIGTERM (below the kubelet's 30 s grace period).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(25);

async fn serve(
    config: Config,
    leader: Option<LeaderConfig>,
    endpoints: Endpoints,
    shutdown: Shared<BoxFuture<'static, ()>>,
) -> anyhow::Result<()> {
    let telemetry = Telemetry::new();
    // Fail on a bad cloud-config or kubeconfig at once (before taking the metrics port), even on
    // a replica that is not (yet) the leader; a standby is ready (it can take over) and warns of
    // an expiring token too.
    let harvester = Harvester::load_with_metrics(&config.cloud_config, Some(&telemetry.metrics))
        .await
        .map_err(harvester_cloud_provider::Error::from)?;
    let guest = guest_client(
        config.kubeconfig.as_deref(),
        config.master.as_ref(),
        Some(&telemetry.metrics),
    )
    .await?;
    if let Some(https) = endpoints.https {
        // Upstream reads these kubeconfigs as they are (no --master override).
        let review_client = |flag: &'static str, path: Option<std::path::PathBuf>| {
            let (guest, metrics) = (guest.clone(), telemetry.metrics.clone());
            async move {
                match path {
                    None => Ok(guest),
                    Some(p) => guest_client(Some(&p), None, Some(&metrics))
                        .await
                        .with_context(|| flag),
                }
            }
        };
        let authn = review_client(
            "--authentication-kubeconfig",
            https.authentication_kubeconfig,
        )
        .await?;
        let authz =
            review_client("--authorization-kubeconfig", https.authorization_kubeconfig).await?;
        let listener = tokio::net::TcpListener::bind(https.addr)
            .await
            .with_context(|| format!("--bind-address/--secure-port {}", https.addr))?;
        tracing::info!("health and metrics on https://{}", https.addr);
        let (served, files) = https.served;
        tokio::spawn(secure::tls::follow(
            served,
            files,
            secure::tls::CERT_CHECK_PERIOD,
        ));
        tokio::spawn(secure::serve_on(
            listener,
            https.tls,
            Delegated::new(authn, authz, https.auth),
            telemetry.metrics.clone(),
            telemetry.readiness.clone(),
            shutdown.clone(),
        ));
    }
    if let Some(addr) = endpoints.metrics_address {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--metrics-address {addr}"))?;
        tracing::info!("health and metrics on http://{addr}");
        tokio::spawn(telemetry::server::serve_on(
            listener,
            telemetry.metrics.clone(),
            telemetry.readiness.clone(),
            shutdown.clone(),
        ));
    }
    telemetry.readiness.set(READY_CLIENTS, Ok(()));
    let warn_before = Duration::from_secs(u64::from(config.token_expiry_warning_days) * 86_400);
    tokio::spawn({
        let (readiness, shutdown) = (telemetry.readiness.clone(), shutdown.clone());
        let harvester = harvester.clone();
        let expiry_event = token_expiry_event(guest.clone());
        async move {
            let watch = harvester.watch_credentials(
                &readiness,
                READY_HARVESTER,
                warn_before,
                CREDENTIALS_CHECK_PERIOD,
                expiry_event,
            );
            tokio::select! {
                () = watch => {},
                () = shutdown => {},
            }
        }
    });
    // The controllers use this process's clients: one connection to each API server, and their
    // Harvester requests answer the credential check above.
    let ctx = Context::loaded(guest.clone(), harvester, config, telemetry);
    let Some(leader) = leader else {
        harvester_cloud_provider::run_on(ctx, shutdown).await;
        return Ok(());
    };
    run_as_leader(guest, leader, shutdown, |mut stop| async move {
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        harvester_cloud_provider::run_on(ctx, stopped).await;
    })
    .await?;
    Ok(())
}

fn leader_config(ops: &OpsFlags) -> Result<Option<LeaderConfig>, ConfigError> {
    let duration = |flag: &'static str, v: &str| {
        parse_go_duration(v).map_err(|e| ConfigError {
            flag,
            value: v.to_string(),
            reason: e,
        })
    };
    let identity = std::env::var("POD_NAME").unwrap_or_else(|_| unique_identity());
    let cfg = LeaderConfig {
        lease_duration: duration(
            "--leader-elect-lease-duration",
            &ops.leader_elect_lease_duration,
        )?,
        renew_deadline: duration(
            "--leader-elect-renew-deadline",
            &ops.leader_elect_renew_deadline,
        )?,
        retry_period: duration(
            "--leader-elect-retry-period",
            &ops.leader_elect_retry_period,
        )?,
        ..LeaderConfig::new(
            &ops.leader_elect_resource_namespace,
            &ops.leader_elect_resource_name,
            &identity,
        )
    };
    if cfg.renew_deadline >= cfg.lease_duration {
        return Err(ConfigError {
            flag: "--leader-elect-renew-deadline",
            value: ops.leader_elect_renew_deadline.clone(),
            reason: format!(
                "must be shorter than --leader-elect-lease-duration {:?}",
                ops.leader_elect_lease_duration
            ),
        });
    }
    // Checked even without --leader-elect, as upstream validates every flag.
    Ok(ops.leader_elect.then_some(cfg))
}

/// A leader identity like client-go's `<hostname>_<uuid>`: unique even for two pods on one host
/// (upstream's chart runs with hostNetwork, so the hostname is the Node's).
fn unique_identity() -> String {
    use std::hash::{BuildHasher, RandomState};
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "harvester-cloud-provider".into());
    // RandomState is seeded from the OS per process: a fresh 64-bit suffix.
    let suffix = RandomState::new().hash_one(std::process::id());
    format!("{host}_{suffix:016x}")
}
