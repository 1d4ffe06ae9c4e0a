//! `testbed demo`: brings the bed up, creates a Harvester host, a guest VM and its guest Node,
//! prints them, and tears everything down.
//! `testbed cluster` (`make cluster`): the real guest cluster with both charts installed, until
//! Ctrl-C.
//! `testbed images` (`make images`): the release images as OCI archives.

mod demo;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};
use testbed::sim::GuestVm;
use testbed::{BedOptions, TestBed, bed::users_cluster};

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
    /// Start the real guest cluster (kubelet, containerd, control plane, both charts installed;
    /// root and `make node-tools`), print how to reach both clusters, stay until Ctrl-C.
    Cluster,
    /// Build the images harvester-cloud-provider and harvester-csi-driver as OCI archives
    /// (`make images`: from target/release into target/images), print their paths and digests.
    Images {
        /// Where the binaries are; default: beside this program (target/<profile>).
        #[arg(long)]
        bin_dir: Option<PathBuf>,
        /// Where the archives go; default: target/images.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Repository prefix of the image names (host[:port][/path]).
        #[arg(long, default_value = testbed::real::images::release::DEFAULT_PREFIX)]
        prefix: String,
    },
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
        Cmd::Cluster => cluster().await,
        Cmd::Images {
            bin_dir,
            out,
            prefix,
        } => images(bin_dir, out, &prefix),
    }
}

/// `testbed images`: both release images, then one line per image (name, digest, archive).
fn images(bin_dir: Option<PathBuf>, out: Option<PathBuf>, prefix: &str) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding this program")?;
    let here = exe
        .parent()
        .context("this program's directory")?
        .to_path_buf();
    let bin_dir = bin_dir.unwrap_or(here);
    // target/<profile>/.. is target/.
    let out = match out {
        Some(o) => o,
        None => bin_dir
            .parent()
            .context("the binaries' directory has no parent")?
            .join("images"),
    };
    let t0 = Instant::now();
    let built = testbed::real::images::release::build(&bin_dir, &out, prefix)?;
    println!(
        "built {} images from {} in {:.1}s:",
        built.len(),
        bin_dir.display(),
        t0.elapsed().as_secs_f64()
    );
    for b in built {
        println!("{}", b.name);
        println!("  image digest   {}", b.digest);
        println!("  archive        {}", b.archive.display());
        println!("  archive sha256 {}", b.archive_sha256);
    }
    Ok(())
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

async fn cluster() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let bed = users_cluster::start()
        .await
        .context("starting the real guest cluster")?;
    let bin = users_cluster::tools_bin(&bed).context("kubectl and helm for the user")?;
    let real = bed.real();
    println!(
        r#"
real guest cluster ready in {secs:.1}s: Node {node} initialised by the cloud provider Pod, the CSI
driver's controller and node Pods Ready (logs and state under {dir})

# kubectl and helm of the bed (`make node-tools` builds kubectl, `make tools` fetches helm):
export PATH={bin}:$PATH
# the guest cluster (both charts in kube-system, StorageClass harvester):
export KUBECONFIG={guest}
# the Harvester stand-in (VMs, VMIs and PVCs in namespace {ns}; IPPools, LoadBalancers):
export HARVESTER_KUBECONFIG={harvester}

kubectl get nodes -o wide
kubectl -n kube-system get pods
helm list -n kube-system

# a volume: a PVC of StorageClass harvester and a Pod using it
kubectl apply -f - <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: demo}}
spec: {{accessModes: [ReadWriteOnce], resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: demo}}
spec:
  containers:
  - {{name: c, image: {workload}, imagePullPolicy: Never, command: [sh, -c, "busybox --install -s /bin; df -h /data; sleep 3600"],
     volumeMounts: [{{name: d, mountPath: /data}}]}}
  volumes: [{{name: d, persistentVolumeClaim: {{claimName: demo}}}}]
EOF
kubectl wait --for=condition=Ready pod/demo --timeout=120s
kubectl logs demo
kubectl --kubeconfig "$HARVESTER_KUBECONFIG" -n {ns} get vm,vmi,pvc

# a LoadBalancer Service: its address comes from Harvester IPPool {pool} ({subnet})
{try_lb}
kubectl wait --for=jsonpath='{{.status.loadBalancer.ingress}}' service/{svc} --timeout=60s
kubectl get service {svc}
kubectl --kubeconfig "$HARVESTER_KUBECONFIG" get ippools,loadbalancers -A

Ctrl-C stops everything and undoes what it changed on this machine."#,
        secs = t0.elapsed().as_secs_f64(),
        node = testbed::bed::guest_cluster::NODE,
        dir = bed.dir.path().display(),
        bin = bin.display(),
        guest = real.kubeconfig.display(),
        harvester = bed.harvester.kubeconfig.display(),
        ns = bed.vm_namespace,
        workload = testbed::bed::guest_cluster::WORKLOAD,
        pool = users_cluster::LB_POOL,
        subnet = users_cluster::LB_POOL_SUBNET,
        try_lb = users_cluster::TRY_LB_SERVICE,
        svc = users_cluster::TRY_LB_SERVICE_NAME,
    );
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    println!("stopping the real guest cluster ...");
    drop(bed);
    println!("stopped");
    Ok(())
}
