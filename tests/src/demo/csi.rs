//! Demo steps of the CSI driver: start it in-process (`all` mode) against the bed, then take one
//! volume through its whole life on the guest node `worker-1` — create (a Harvester PVC on a loop
//! device), publish (KubeVirt hot-plug through the aggregator), stage (format + mount), publish
//! (bind mount), write and read back a file, and all the way back down. Needs root.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::identity_client::IdentityClient;
use csi_proto::csi::v1::node_client::NodeClient;
use csi_proto::csi::v1::*;
use harvester_csi_driver::Config;
use testbed::TestBed;
use testbed::csi_client::{
    create_request, mount_cap, node_publish_request, publish_request, stage_request,
    unpublish_request,
};

const NODE: &str = "worker-1";
const NAME: &str = "pvc-2f0c5d2e-demo-4c1b-9a51-6f7d3c1e0a01";

fn step(n: u32, what: &str, t0: Instant) {
    println!(
        "--- CSI step {n} ({:.1}s): {what}",
        t0.elapsed().as_secs_f64()
    );
}

pub async fn run(bed: &TestBed) -> anyhow::Result<()> {
    if !testbed::sim::storage::is_root() {
        bail!("the CSI demo needs root (loop devices, mkfs, mount); run `make demo` as root");
    }
    let t0 = Instant::now();
    let dir = bed.dir.path().join("csi-demo");
    std::fs::create_dir_all(&dir)?;
    let _sweep = testbed::real::mounts::MountSweeper(dir.clone());
    let socket = dir.join("csi.sock");
    let mut config = Config::new(format!("unix://{}", socket.display()), &bed.cloud_config);
    config.node_id = Some(NODE.into());
    config.disk_by_id_dir = bed.sim.by_id_dir(NODE);
    let server = harvester_csi_driver::spawn(config);
    let start = Instant::now();
    while !socket.exists() {
        if server.is_finished() {
            bail!(
                "the CSI driver stopped while starting: {:?}",
                server.join().await
            );
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the CSI driver socket {} did not appear", socket.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let channel = harvester_csi_driver::connect(&socket).await?;
    let mut identity = IdentityClient::new(channel.clone());
    let mut controller = ControllerClient::new(channel.clone());
    let mut node = NodeClient::new(channel);

    let info = identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await?
        .into_inner();
    let probe = identity.probe(ProbeRequest {}).await?.into_inner();
    let node_info = node
        .node_get_info(NodeGetInfoRequest {})
        .await?
        .into_inner();
    step(
        0,
        &format!(
            "driver {} {} on {} (probe ready: {:?}; node ID {}, max volumes {})",
            info.name,
            info.vendor_version,
            socket.display(),
            probe.ready,
            node_info.node_id,
            node_info.max_volumes_per_node
        ),
        t0,
    );

    let volume = controller
        .create_volume(create_request(NAME, 64 << 20, &mount_cap("ext4")))
        .await
        .context("CreateVolume")?
        .into_inner()
        .volume
        .context("CreateVolume returned no volume")?;
    let id = volume.volume_id.clone();
    step(
        1,
        &format!(
            "CreateVolume {NAME}: Harvester PVC {}/{id}, {} bytes (block mode, ReadWriteMany)",
            bed.vm_namespace, volume.capacity_bytes
        ),
        t0,
    );

    let published = controller
        .controller_publish_volume(publish_request(&id, NODE, &mount_cap("ext4")))
        .await
        .context("ControllerPublishVolume")?
        .into_inner();
    let ctx: HashMap<String, String> = published.publish_context;
    let serial = ctx.get("serial").cloned().unwrap_or_default();
    let link = bed
        .sim
        .by_id_dir(NODE)
        .join(format!("scsi-0QEMU_QEMU_HARDDISK_{serial}"));
    step(
        2,
        &format!(
            "ControllerPublishVolume to {NODE}: hot-plugged with serial {serial} (target {}); {} -> {}",
            ctx.get("target").map(String::as_str).unwrap_or("?"),
            link.display(),
            std::fs::read_link(&link)
                .map(|p| p.display().to_string())
                .unwrap_or_else(|e| e.to_string())
        ),
        t0,
    );

    let staging = dir.join("staging");
    let target = dir.join("pods/demo-pod/volumes/data");
    node.node_stage_volume(stage_request(&id, &ctx, &staging, &mount_cap("ext4")))
        .await
        .context("NodeStageVolume")?;
    step(
        3,
        &format!(
            "NodeStageVolume: blank disk formatted ext4, mounted at {}",
            staging.display()
        ),
        t0,
    );

    node.node_publish_volume(node_publish_request(
        &id,
        &ctx,
        &staging,
        &target,
        &mount_cap("ext4"),
    ))
    .await
    .context("NodePublishVolume")?;
    step(
        4,
        &format!("NodePublishVolume: bind-mounted at {}", target.display()),
        t0,
    );

    let file = target.join("hello.txt");
    let text = format!(
        "written through {} at {:.1}s\n",
        info.name,
        t0.elapsed().as_secs_f64()
    );
    std::fs::write(&file, &text)?;
    let back = std::fs::read_to_string(&file)?;
    if back != text {
        bail!("read back {back:?}, wrote {text:?}");
    }
    let stats = node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await
        .context("NodeGetVolumeStats")?
        .into_inner();
    let bytes = stats
        .usage
        .first()
        .map(|u| (u.used, u.total))
        .unwrap_or_default();
    step(
        5,
        &format!(
            "wrote and read back {}: {:?}; filesystem {} of {} bytes used",
            file.display(),
            back.trim(),
            bytes.0,
            bytes.1
        ),
        t0,
    );

    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await
    .context("NodeUnpublishVolume")?;
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .context("NodeUnstageVolume")?;
    step(
        6,
        "NodeUnpublishVolume + NodeUnstageVolume: unmounted, target removed",
        t0,
    );

    controller
        .controller_unpublish_volume(unpublish_request(&id, NODE))
        .await
        .context("ControllerUnpublishVolume")?;
    step(
        7,
        &format!(
            "ControllerUnpublishVolume: removevolume done, disk gone from the VM and the guest ({} exists: {})",
            link.display(),
            link.exists()
        ),
        t0,
    );

    controller
        .delete_volume(DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .context("DeleteVolume")?;
    step(8, &format!("DeleteVolume: Harvester PVC {id} deleted"), t0);

    server.stop().await.context("the CSI driver")?;
    step(
        9,
        &format!("driver stopped, socket removed: {}", !socket.exists()),
        t0,
    );
    Ok(())
}
