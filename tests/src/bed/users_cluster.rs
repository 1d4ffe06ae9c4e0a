//! The bed of `make cluster` and of the user's-day test (`tests/tests/real_cluster.rs`), started
//! by the same code: the real guest cluster with both charts ([`crate::bed::guest_cluster`]), an IP
//! pool on the Harvester side so LoadBalancer Services get an address, and a directory with the
//! `kubectl` and `helm` the bed built, for the commands `make cluster` prints.

use std::path::PathBuf;

use crate::{BedError, BedOptions, TestBed};

/// The Harvester IPPool LoadBalancer Services of the guest cluster take their address from
/// (scope `*`: every project, namespace and guest cluster).
pub const LB_POOL: &str = "guest-lb";
pub const LB_POOL_SUBNET: &str = "192.168.177.0/28";

/// The command `make cluster` prints to try a LoadBalancer Service; the user's-day test runs it
/// as printed (split on spaces) and waits for the address.
pub const TRY_LB_SERVICE: &str = "kubectl create service loadbalancer web --tcp=80:8080";
/// The Service [`TRY_LB_SERVICE`] creates (namespace `default`).
pub const TRY_LB_SERVICE_NAME: &str = "web";

/// Starts the real guest cluster (root; `make node-tools`) and creates [`LB_POOL`].
pub async fn start() -> Result<TestBed, BedError> {
    let bed = TestBed::start(BedOptions {
        real_node: true,
        ..BedOptions::hotplugging()
    })
    .await?;
    bed.sim.create_pool(LB_POOL, LB_POOL_SUBNET).await?;
    Ok(bed)
}

/// `<bed dir>/bin` holding links to the bed's `kubectl` (node tools, built like the kubelet) and
/// `helm` (tools): a fresh machine has neither on its PATH. Removed with the bed's directory.
pub fn tools_bin(bed: &TestBed) -> Result<PathBuf, BedError> {
    let bin = bed.dir.path().join("bin");
    std::fs::create_dir_all(&bin)
        .map_err(|e| BedError::Setup(format!("creating {}: {e}", bin.display())))?;
    for (name, target) in [
        ("kubectl", crate::real::node::node_tool("kubectl")?),
        ("helm", crate::util::tools::tool("helm")?),
    ] {
        let link = bin.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).map_err(|e| {
            BedError::Setup(format!(
                "linking {} to {}: {e}",
                link.display(),
                target.display()
            ))
        })?;
    }
    Ok(bin)
}
