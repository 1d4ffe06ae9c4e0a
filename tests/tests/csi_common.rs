//! Shared by the CSI suites (`csi_sanity.rs`, `csi_node.rs`): the driver started in-process
//! against the test bed, gRPC clients on its socket, and mount cleanup that also runs when a test
//! fails. (Compiled on its own as well, where it holds no tests.)

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use csi_proto::csi::v1::controller_client::ControllerClient;
use csi_proto::csi::v1::identity_client::IdentityClient;
use csi_proto::csi::v1::node_client::NodeClient;
use harvester_csi_driver::{Config, ServeError};
use testbed::TestBed;
use testbed::sim::GuestVm;
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// The guest VM (and CSI node ID) the suites use.
pub const NODE: &str = "worker-1";

pub fn assert_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root (loop devices, mkfs, mount); run it as root (`make test` does)"
    );
}

pub async fn bed() -> TestBed {
    match TestBed::start(testbed::BedOptions::default()).await {
        Ok(bed) => bed,
        Err(e) => panic!("the test bed must start for this test: {e}"),
    }
}

/// Harvester's default StorageClass, as a Harvester install has it: PVCs without a class get
/// it, and kube-apiserver's PersistentVolumeClaimResize admission lets them grow only because
/// it has `allowVolumeExpansion: true`.
pub async fn install_default_storage_class(bed: &TestBed) {
    let sc: k8s_openapi::api::storage::v1::StorageClass =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "harvester-longhorn",
                         "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": "driver.longhorn.io",
            "allowVolumeExpansion": true,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
            "parameters": {"migratable": "true", "numberOfReplicas": "3"}
        }))
        .expect("StorageClass literal");
    kube::Api::<k8s_openapi::api::storage::v1::StorageClass>::all(bed.harvester.client.clone())
        .create(&Default::default(), &sc)
        .await
        .expect("creating the default StorageClass on Harvester");
}

/// A bed with Harvester's default StorageClass, a host and the running guest VM [`NODE`].
pub async fn bed_with_vm() -> TestBed {
    let bed = bed().await;
    install_default_storage_class(&bed).await;
    bed.sim
        .create_host("harvester-1", Some("region-a"), Some("zone-1"))
        .await
        .expect("host");
    bed.sim
        .create_vm(&GuestVm::new(NODE).on_host("harvester-1").ip("10.52.0.11"))
        .await
        .expect("guest VM");
    bed
}

/// The driver serving on a socket in the bed's directory, until [`Driver::stop`] or drop.
pub struct Driver {
    pub socket: PathBuf,
    pub channel: Channel,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

impl Driver {
    /// Starts the driver in `all` mode for node [`NODE`]; `tweak` adjusts the config.
    pub async fn start(bed: &TestBed, tweak: impl FnOnce(&mut Config)) -> Driver {
        let socket = bed
            .dir
            .path()
            .join(format!("csi-{}.sock", std::process::id()));
        let mut config = Config::new(format!("unix://{}", socket.display()), &bed.cloud_config);
        config.node_id = Some(NODE.into());
        config.disk_by_id_dir = bed.sim.by_id_dir(NODE);
        tweak(&mut config);
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(harvester_csi_driver::serve(config, async {
            let _ = rx.await;
        }));
        let start = Instant::now();
        while !socket.exists() {
            if task.is_finished() {
                match task.await {
                    Ok(Err(e)) => panic!("the driver failed to start: {e}"),
                    other => panic!("the driver stopped while starting: {other:?}"),
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "driver socket {} did not appear within 30s",
                socket.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let channel = harvester_csi_driver::connect(&socket)
            .await
            .expect("connecting to the driver socket");
        Driver {
            socket,
            channel,
            stop: Some(tx),
            task,
        }
    }

    pub fn identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.channel.clone())
    }
    pub fn controller(&self) -> ControllerClient<Channel> {
        ControllerClient::new(self.channel.clone())
    }
    pub fn node(&self) -> NodeClient<Channel> {
        NodeClient::new(self.channel.clone())
    }

    /// Stops the driver gracefully and checks it removed its socket.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let task = &mut self.task;
        match tokio::time::timeout(Duration::from_secs(20), task).await {
            Ok(Ok(Ok(()))) => {}
            other => panic!("the driver did not stop cleanly: {other:?}"),
        }
        assert!(!self.socket.exists(), "the driver left its socket behind");
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

#[allow(unused_imports)]
pub use testbed::mounts::MountSweeper;
