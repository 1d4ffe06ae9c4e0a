//! The Harvester stand-in: plays KubeVirt (VM/VMI status, hot-plug), Longhorn (PVC binding on loop
//! devices), the Harvester LB controller (IPPool allocation) and Harvester's LoadBalancer
//! mutating webhook (a real admission webhook, [`lb_webhook`], served with the bed's other
//! webhooks by [`webhook`]) against the real Harvester API server. It never stands in for an API: every object lives in kube-apiserver.

pub mod backup;
pub mod backup_validator;
pub mod cache;
pub mod ipam;
pub mod lb;
pub mod lb_validator;
pub mod lb_webhook;
pub mod networkfs;
pub mod snapshot;
pub mod storage;
pub mod virt_api;
pub mod virt_handler;
pub mod vm;
pub mod webhook;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use harvester_common::harvester::HotplugMode;

use crate::BedError;
use crate::bed::certs::Pki;
use storage::Storage;
use virt_api::{HotplugCtx, VirtApi};

/// A stand-in controller's watch: kube's watcher with its default backoff. Without one a watcher
/// retries a failed request at once, so with the API server gone (a restart, or the bed's
/// teardown while the runtime shuts down and every request fails at once) its task never yields
/// and spins a worker thread; a test once hung that way after it had passed.
pub fn watch<K>(
    api: kube::Api<K>,
) -> futures::stream::BoxStream<
    'static,
    Result<kube::runtime::watcher::Event<K>, kube::runtime::watcher::Error>,
>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed()
}

pub use vm::GuestVm;

pub struct Sim {
    /// networkfs-manager and its NFS server, once [`Sim::start_networkfs`] ran; dropped before
    /// `storage` (its host mounts sit on the storage's loop devices).
    networkfs: std::sync::Mutex<Option<(Arc<networkfs::NetworkFs>, tokio::task::JoinHandle<()>)>>,
    dir: PathBuf,
    /// Admin client of the Harvester API server.
    pub harvester: kube::Client,
    /// Admin client of the guest API server (guest Nodes are created there).
    pub guest: kube::Client,
    pub vm_namespace: String,
    pub storage: Arc<Storage>,
    pub hotplug: Arc<HotplugCtx>,
    pub virt_api: VirtApi,
    /// With KubeVirt's own virt-api and virt-controller ([`crate::bed::kubevirt`]): the node
    /// side they need ([`virt_handler`]), in place of the stand-in's controller.
    pub node_play: Option<Arc<virt_handler::NodePlay>>,
    tasks: JoinSet<()>,
}

impl Sim {
    /// `real_kubevirt`: kubevirt-handler's client when KubeVirt's own virt-api and
    /// virt-controller run ([`crate::bed::kubevirt`]); then the node play runs instead of the
    /// stand-in's controller.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        pki: &Pki,
        harvester: kube::Client,
        guest: kube::Client,
        vm_namespace: String,
        dir: &Path,
        hotplug_delay: Duration,
        gates: virt_api::Gates,
        real_kubevirt: Option<kube::Client>,
    ) -> Result<Sim, BedError> {
        let storage = Arc::new(Storage::new(dir)?);
        let hotplug = Arc::new(HotplugCtx {
            client: harvester.clone(),
            storage: storage.clone(),
            by_id_root: dir.join("by-id"),
            delay: hotplug_delay,
            calls: Default::default(),
            vms: Default::default(),
            by_id_dirs: Default::default(),
            gates: std::sync::Mutex::new(gates),
            agent_hostnames: Default::default(),
        });
        let virt_api = VirtApi::start(pki, hotplug.clone()).await?;
        let mut tasks = JoinSet::new();
        tasks.spawn(storage::run_pvc_binder(harvester.clone(), storage.clone()));
        tasks.spawn(backup::run(
            harvester.clone(),
            storage.clone(),
            dir.to_path_buf(),
        ));
        let node_play = match real_kubevirt {
            Some(handler) => {
                let play = virt_handler::NodePlay::new(
                    harvester.clone(),
                    handler,
                    vm_namespace.clone(),
                    storage.clone(),
                    hotplug.clone(),
                );
                tasks.spawn(play.clone().run());
                Some(play)
            }
            None => {
                tasks.spawn(virt_api::run_controller(hotplug.clone()));
                None
            }
        };
        tasks.spawn(snapshot::run(
            harvester.clone(),
            storage.clone(),
            dir.to_path_buf(),
        ));
        Ok(Sim {
            networkfs: Default::default(),
            dir: dir.to_path_buf(),
            harvester,
            guest,
            vm_namespace,
            storage,
            hotplug,
            virt_api,
            node_play,
            tasks,
        })
    }

    /// Starts the stand-in LB controller ([`lb`]); a bed running Harvester's real one
    /// (`BedOptions::lb_upstream`) does not.
    pub fn start_lb_controller(&mut self) {
        self.tasks.spawn(lb::run(self.harvester.clone()));
    }

    /// Harvester's default StorageClass, as a Harvester install has it: PVCs without a class get
    /// it, and kube-apiserver's PersistentVolumeClaimResize admission lets them grow only
    /// because it has `allowVolumeExpansion: true`.
    pub async fn create_default_storage_class(&self) -> Result<(), BedError> {
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
            .map_err(|e| BedError::Setup(format!("the default StorageClass: {e}")))?;
        kube::Api::<k8s_openapi::api::storage::v1::StorageClass>::all(self.harvester.clone())
            .create(&Default::default(), &sc)
            .await?;
        Ok(())
    }

    /// IPPool `name` on Harvester: one range, `subnet`, for every project, namespace and guest
    /// cluster.
    pub async fn create_pool(
        &self,
        name: &str,
        subnet: &str,
    ) -> Result<harvester_common::harvester::IPPool, BedError> {
        let pool: harvester_common::harvester::IPPool = serde_json::from_value(serde_json::json!({
            "apiVersion": "loadbalancer.harvesterhci.io/v1beta1", "kind": "IPPool",
            "metadata": {"name": name},
            "spec": {"ranges": [{"subnet": subnet}],
                     "selector": {"scope": [{"project": "*", "namespace": "*", "guestCluster": "*"}]}}
        }))
        .map_err(|e| BedError::Setup(format!("IPPool {name}: {e}")))?;
        Ok(kube::Api::all(self.harvester.clone())
            .create(&Default::default(), &pool)
            .await?)
    }

    /// Starts the NFS server (nfs-ganesha, [`crate::real::nfs`]) and networkfs-manager's part
    /// ([`networkfs`]), reporting `endpoint` as the address clients mount (10.0.2.2 for QEMU
    /// guests). Idempotent: a second call returns the running one. Only RWX tests need it.
    pub fn start_networkfs(&self, endpoint: &str) -> Result<Arc<networkfs::NetworkFs>, BedError> {
        let mut slot = self.networkfs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((fs, _)) = slot.as_ref() {
            return Ok(fs.clone());
        }
        let nfs = Arc::new(crate::real::nfs::NfsServer::start(&self.dir)?);
        let fs = Arc::new(networkfs::NetworkFs::new(nfs, endpoint));
        let task = tokio::spawn(networkfs::run(
            self.harvester.clone(),
            self.storage.clone(),
            fs.clone(),
        ));
        *slot = Some((fs.clone(), task));
        Ok(fs)
    }

    /// Harvester upgraded or downgraded across v1.8: `server-version` set for `mode` (created when
    /// missing) and the stand-in's KubeVirt feature gates switched to that release's.
    pub async fn set_hotplug_mode(&self, mode: HotplugMode) -> Result<(), BedError> {
        self.set_harvester(mode, virt_api::Gates::of(mode)).await
    }

    /// `server-version` set for `mode` and the KubeVirt feature gates set to `gates` (an
    /// administrator may enable `HotplugVolumes` again on v1.8).
    pub async fn set_harvester(
        &self,
        mode: HotplugMode,
        gates: virt_api::Gates,
    ) -> Result<(), BedError> {
        let yaml = format!(
            "apiVersion: harvesterhci.io/v1beta1\nkind: Setting\nmetadata: {{name: server-version}}\nvalue: {}\n",
            crate::bed::crds::server_version_for(mode)
        );
        self.hotplug.set_gates(gates);
        crate::bed::apply::apply_yaml(&self.harvester, &yaml, "default")
            .await
            .map(|_| ())
    }

    /// The by-id directory (`/dev/disk/by-id` stand-in) of guest node `node`.
    pub fn by_id_dir(&self, node: &str) -> PathBuf {
        self.hotplug.by_id_dir(node)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.tasks.abort_all();
        if let Some((_, task)) = self
            .networkfs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}
