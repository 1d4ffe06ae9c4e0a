//! `testbed demo`: brings the bed up, creates a Harvester host, a guest VM and its guest Node,
//! prints them, and tears everything down.

mod demo;

use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};
use testbed::sim::GuestVm;
use testbed::{BedOptions, TestBed};

#[derive(Parser)]
#[command(
    version,
    about = "Test bed for the Harvester cloud provider and CSI driver"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the bed, create a host, a guest VM and its Node, print them, tear down.
    Demo,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,kube_client::client::builder=off".into()),
        )
        .init();
    match Cli::parse().command.unwrap_or(Cmd::Demo) {
        Cmd::Demo => demo().await,
    }
}

/// Prints an object as YAML without the noise of managedFields.
fn show<T: serde::Serialize>(title: &str, obj: &T) -> anyhow::Result<()> {
    let mut v = serde_json::to_value(obj)?;
    if let Some(m) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        m.remove("managedFields");
    }
    println!("--- {title}\n{}", serde_saphyr::to_string(&v)?);
    Ok(())
}

async fn demo() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let bed = TestBed::start(BedOptions::default())
        .await
        .context("starting the test bed")?;
    println!(
        "test bed up in {:.1}s: guest API {}, Harvester API {}, cloud-config {}",
        bed.started_in.as_secs_f64(),
        bed.guest.url,
        bed.harvester.url,
        bed.cloud_config.display()
    );
    let host = bed
        .sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await?;
    let (vm, vmi) = bed
        .sim
        .create_vm(
            &GuestVm::new("worker-1")
                .on_host("harvester-1")
                .ip("10.52.0.11"),
        )
        .await?;
    let node = bed.sim.create_guest_node("worker-1").await?;
    show("Harvester host Node", &host)?;
    show("Harvester VirtualMachine", &vm)?;
    show("Harvester VirtualMachineInstance", &vmi)?;
    show("guest Node", &node)?;
    demo::ccm::run(&bed).await.context("cloud provider demo")?;
    demo::lb::run(&bed).await.context("LoadBalancer demo")?;
    demo::lb::run_dhcp(&bed)
        .await
        .context("LoadBalancer DHCP demo")?;
    demo::csi::run(&bed).await.context("CSI driver demo")?;
    drop(bed);
    println!(
        "test bed stopped; demo took {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
