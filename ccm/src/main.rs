//! `harvester-cloud-provider`: the cloud controller manager of Kubernetes guest clusters on
//! Harvester HCI. Flags are parsed and checked here; the controllers are in the library.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use harvester_cloud_provider::config::{Config, Flags, OpsFlags, parse_go_duration};
use harvester_cloud_provider::error::one_line;
use harvester_cloud_provider::{
    READY_CLIENTS, READY_HARVESTER, Telemetry, guest_client, token_expiry_event,
};
use harvester_common::cloud_config::{CREDENTIALS_CHECK_PERIOD, Harvester};
use harvester_common::telemetry::{self, LeaderConfig};

fn main() -> ExitCode {
    let flags = Flags::parse();
    telemetry::init_logging(
        flags.ops.log_format,
        Config::log_filter(flags.common.verbosity),
    );
    match start(flags) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("harvester-cloud-provider: {}", one_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn start(flags: Flags) -> anyhow::Result<()> {
    let ops = flags.ops.clone();
    let config = Config::from_flags(flags)?;
    let leader = leader_config(&ops)?;
    let metrics_address =
        telemetry::server::parse_address("--metrics-address", &ops.metrics_address)
            .map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let shutdown = telemetry::shutdown_signal().boxed().shared();
    let stop_waiting = shutdown.clone();
    runtime.block_on(async move {
        tokio::select! {
            result = serve(config, leader, metrics_address, shutdown) => result,
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
    metrics_address: Option<std::net::SocketAddr>,
    shutdown: Shared<BoxFuture<'static, ()>>,
) -> anyhow::Result<()> {
    let telemetry = Telemetry::new();
    if let Some(addr) = metrics_address {
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
    // Fail on a bad cloud-config or kubeconfig at once, even on a replica that is not (yet)
    // the leader; a standby is ready (it can take over) and warns of an expiring token too.
    let harvester = Harvester::load_with_metrics(&config.cloud_config, Some(&telemetry.metrics))
        .await
        .map_err(harvester_cloud_provider::Error::from)?;
    let guest = guest_client(config.kubeconfig.as_deref(), Some(&telemetry.metrics)).await?;
    telemetry.readiness.set(READY_CLIENTS, Ok(()));
    let warn_before = Duration::from_secs(u64::from(config.token_expiry_warning_days) * 86_400);
    tokio::spawn({
        let (readiness, shutdown) = (telemetry.readiness.clone(), shutdown.clone());
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
    let Some(leader) = leader else {
        harvester_cloud_provider::run_with(config, telemetry, shutdown).await?;
        return Ok(());
    };
    telemetry::run_as_leader(guest, leader, shutdown, |mut stop| async move {
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = harvester_cloud_provider::run_with(config, telemetry, stopped).await {
            tracing::error!("{}", one_line(&e));
        }
    })
    .await?;
    Ok(())
}

fn leader_config(ops: &OpsFlags) -> anyhow::Result<Option<LeaderConfig>> {
    if !ops.leader_elect {
        return Ok(None);
    }
    let duration = |flag: &str, v: &str| {
        parse_go_duration(v).map_err(|e| anyhow::anyhow!("invalid value {v:?} for {flag}: {e}"))
    };
    let identity = std::env::var("POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| format!("harvester-cloud-provider-{}", std::process::id()));
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
        anyhow::bail!(
            "--leader-elect-renew-deadline {:?} must be shorter than --leader-elect-lease-duration {:?}",
            ops.leader_elect_renew_deadline,
            ops.leader_elect_lease_duration
        );
    }
    Ok(Some(cfg))
}
