//! `TestBed::start`: the whole bed, up and ready; dropping it stops everything it started.
//!
//! The layer of the API servers and of the bed composed from all layers. Its parts
//! ([`cluster`]: etcd and kube-apiserver, [`certs`], [`apply`], [`rbac`], [`crds`]) use only
//! `util` (and the address constants of `real::podnet` and `real::vm`); the stand-in and the
//! real node build on them. This file ([`TestBed`]), [`guest_cluster`] and [`users_cluster`]
//! compose everything into a running bed, so nothing below imports them.

pub mod apply;
pub mod certs;
pub mod cluster;
pub mod crds;
pub mod guest_cluster;
pub mod kubevirt;
pub mod lb_upstream;
pub mod rbac;
pub mod users_cluster;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine;
use harvester_common::harvester::HotplugMode;

use kube::api::Api;

use crate::bed::apply::apply_yaml;
use crate::bed::certs::Pki;
use crate::bed::cluster::{ApiServer, ApiServerArgs, Etcd, kubeconfig_text};
use crate::bed::crds::{CRDS, crd_names, install_crds, wait_established};
use crate::bed::guest_cluster::GuestCluster;
use crate::bed::kubevirt::{KubevirtLine, RealKubevirt};
use crate::sim::lb_webhook::{LbWebhook, Rules};
use crate::sim::virt_api::Gates;
use crate::sim::webhook::WebhookServer;
use crate::sim::{GuestVm, Sim};
use crate::{BedError, util::wait};

#[derive(Clone, Debug)]
pub struct BedOptions {
    /// Harvester namespace holding the guest VMs (the cloud-config's context namespace).
    pub vm_namespace: String,
    /// How long a hot-plugged disk takes to reach the guest once attached (the stand-in: from
    /// `addvolume` to volumeStatus `Ready`; the node play: from `AttachedToNode` to `MountedToPod`).
    pub hotplug_delay: Duration,
    /// Keep the bed's directory (logs, kubeconfigs) after drop.
    pub keep_dir: bool,
    /// A real guest cluster on top (root; `make node-tools`): control plane, one real node,
    /// both charts installed ([`GuestCluster`]). One per machine at a time.
    pub real_node: bool,
    /// With `real_node`: install both charts (the default). Off, the real guest cluster comes up
    /// with its images imported and nothing installed, for a test that installs the charts itself
    /// (`install_docs`: the commands of docs/install.md).
    pub real_node_charts: bool,
    /// Which Harvester release the stand-in plays (its `server-version` setting): v1.7
    /// (`Subresource`, the default) or v1.8 (`Declarative`).
    pub hotplug: HotplugMode,
    /// The stand-in's KubeVirt feature gates when not the release's own ([`Gates::of`]):
    /// `Gates::BOTH` is v1.8 with `HotplugVolumes` enabled again.
    pub gates: Option<Gates>,
    /// Which release of Harvester's LoadBalancer mutating webhook the bed registers (always
    /// registered): `TESTBED_LB_WEBHOOK=v1.8|v1.9`, default v1.9.
    pub lb_webhook: Rules,
    /// KubeVirt's own virt-api and virt-controller of this line (`tests/scripts/kubevirt.sh`
    /// builds them) instead of the stand-in's virt-api, KubeVirt webhooks and controller; the
    /// line's gates and Harvester release replace `hotplug` and `gates`. A line not built fails
    /// the bed with its build log. `TESTBED_KUBEVIRT` ([`KubevirtLine::from_env`]) sets it.
    pub kubevirt: Option<KubevirtLine>,
    /// Harvester's real LB controller and webhook from this directory instead of the stand-ins
    /// (`TESTBED_LB_UPSTREAM`, [`lb_upstream`]).
    pub lb_upstream: Option<PathBuf>,
}

impl Default for BedOptions {
    fn default() -> Self {
        BedOptions {
            vm_namespace: "guest-vms".into(),
            hotplug_delay: Duration::from_millis(200),
            keep_dir: std::env::var_os("TESTBED_KEEP_DIR").is_some(),
            real_node: false,
            real_node_charts: true,
            hotplug: HotplugMode::Subresource,
            gates: None,
            lb_webhook: Rules::from_env(),
            kubevirt: KubevirtLine::from_env(),
            lb_upstream: lb_upstream::from_env(),
        }
    }
}

impl BedOptions {
    /// The options of a bed whose tests hot-plug: KubeVirt's own virt-api and virt-controller
    /// of the line `TESTBED_KUBEVIRT` names, else of Harvester v1.7's line (KubeVirt v1.6.1,
    /// `HotplugVolumes`), the oldest Harvester release the driver supports.
    pub fn hotplugging() -> BedOptions {
        BedOptions {
            kubevirt: Some(KubevirtLine::from_env().unwrap_or(KubevirtLine::V1_6_HOTPLUG)),
            ..BedOptions::default()
        }
    }
}

/// Field order is drop order: the real guest cluster stops first, then the stand-in, etcd last,
/// the directory after all.
pub struct TestBed {
    pub cluster: Option<GuestCluster>,
    /// Harvester's real LB controller and webhook, with `BedOptions::lb_upstream`.
    pub lb_upstream: Option<lb_upstream::LbUpstream>,
    pub sim: Sim,
    /// KubeVirt's own virt-api and virt-controller, with `BedOptions::kubevirt`.
    pub kubevirt: Option<RealKubevirt>,
    /// Harvester's LoadBalancer mutating webhook, registered with the Harvester API server.
    pub lb_webhook: LbWebhook,
    /// The HTTPS server every admission webhook of the bed is served by ([`crate::sim::webhook`]).
    pub webhooks: WebhookServer,
    pub guest: ApiServer,
    pub harvester: ApiServer,
    pub etcd: Etcd,
    /// The Harvester cloud-config: a kubeconfig whose context namespace is `vm_namespace`.
    pub cloud_config: PathBuf,
    pub vm_namespace: String,
    pub pki: Pki,
    pub started_in: Duration,
    pub dir: tempfile::TempDir,
}

impl TestBed {
    /// [`TestBed::start`] for a test that cannot run without the bed: a failure panics with why.
    pub async fn started_with(opts: BedOptions) -> TestBed {
        match TestBed::start(opts).await {
            Ok(bed) => bed,
            Err(e) => panic!("the test bed must start for this test: {e}"),
        }
    }

    /// [`TestBed::started_with`] the default options.
    pub async fn started() -> TestBed {
        TestBed::started_with(BedOptions::default()).await
    }

    /// Adds Harvester's default StorageClass ([`Sim::create_default_storage_class`]).
    pub async fn with_default_storage_class(self) -> TestBed {
        self.sim
            .create_default_storage_class()
            .await
            .expect("creating the default StorageClass on Harvester");
        self
    }

    /// Adds the one-VM setup of the CSI and RBAC suites: host `harvester-1` (region-a, zone-1)
    /// and the running guest VM `vm` on it with address 10.52.0.11.
    pub async fn with_vm(self, vm: &str) -> TestBed {
        self.sim
            .create_host("harvester-1", Some("region-a"), Some("zone-1"))
            .await
            .expect("host");
        self.sim
            .create_vm(&GuestVm::new(vm).on_host("harvester-1").ip("10.52.0.11"))
            .await
            .expect("guest VM");
        self
    }

    pub async fn start(opts: BedOptions) -> Result<TestBed, BedError> {
        let t0 = Instant::now();
        if let Some(line) = &opts.kubevirt {
            line.check_built()?;
        }
        let dir = tempfile::Builder::new()
            .prefix("harvester-testbed-")
            .disable_cleanup(opts.keep_dir)
            .tempdir()
            .map_err(|e| BedError::Setup(format!("creating the bed directory: {e}")))?;
        let root = dir.path().to_path_buf();
        let pki = Pki::generate(&root)?;
        let etcd = Etcd::start(&root).await?;
        let (guest, harvester) = tokio::try_join!(
            ApiServer::start(
                &root,
                &pki,
                ApiServerArgs {
                    name: "guest",
                    etcd_url: &etcd.url,
                    service_cidr: crate::real::podnet::GUEST_SERVICE_CIDR,
                    namespace: "default",
                },
            ),
            ApiServer::start(
                &root,
                &pki,
                ApiServerArgs {
                    name: "harvester",
                    etcd_url: &etcd.url,
                    service_cidr: "10.97.0.0/16",
                    namespace: &opts.vm_namespace,
                },
            ),
        )?;
        let cloud_config = root.join("cloud-config");
        std::fs::write(
            &cloud_config,
            kubeconfig_text(
                &harvester.url,
                &pki,
                &pki.admin,
                "admin",
                &opts.vm_namespace,
            ),
        )
        .map_err(|e| BedError::Setup(format!("writing the cloud-config: {e}")))?;

        install_crds(&harvester.client, opts.kubevirt.is_some()).await?;
        let namespaces = format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {}}}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: kubevirt}}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: harvester-system}}\n",
            opts.vm_namespace
        );
        apply_yaml(&harvester.client, &namespaces, "default").await?;
        apply_yaml(
            &harvester.client,
            include_str!("../../crds/harvester-authenticated.yaml"),
            "default",
        )
        .await?;

        // KubeVirt starts serving while the rest of the bed is set up (nothing before the wait
        // for it makes a KubeVirt object).
        let mut kubevirt = match opts.kubevirt {
            Some(line) => Some(
                RealKubevirt::launch(line, &root, &pki, &harvester.client, &harvester.url).await?,
            ),
            None => None,
        };
        let (hotplug, gates) = match opts.kubevirt {
            Some(line) => (
                line.harvester,
                Gates {
                    hotplug_volumes: line.has_gate(kubevirt::HOTPLUG_VOLUMES),
                    declarative: line.has_gate(kubevirt::DECLARATIVE_HOTPLUG_VOLUMES),
                },
            ),
            None => (opts.hotplug, opts.gates.unwrap_or(Gates::of(opts.hotplug))),
        };
        if kubevirt.is_some() {
            // No kube-controller-manager makes it; virt-controller's launcher Pod names it.
            apply_yaml(
                &harvester.client,
                &format!(
                    "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: default, namespace: {}}}\n",
                    opts.vm_namespace
                ),
                "default",
            )
            .await?;
        }
        let mut sim = Sim::start(
            &pki,
            harvester.client.clone(),
            guest.client.clone(),
            opts.vm_namespace.clone(),
            &root,
            opts.hotplug_delay,
            gates,
            kubevirt.as_ref().map(|k| k.handler.clone()),
        )
        .await?;
        sim.set_harvester(hotplug, gates).await?;
        if opts.lb_upstream.is_none() {
            sim.start_lb_controller();
        }
        let kubevirt_serving = async {
            match kubevirt.as_mut() {
                Some(k) => k.wait_serving(&harvester.client).await,
                None => register_virt_api(&harvester.client, &pki, sim.virt_api.port).await,
            }
        };
        let (webhooks, lb_webhook, lb_upstream) = tokio::try_join!(
            harvester_webhooks(&opts, &root, &pki, &harvester.client, &cloud_config),
            kubevirt_serving
        )?
        .0;
        let cluster = if opts.real_node {
            Some(
                GuestCluster::start(
                    &root,
                    &pki,
                    &guest,
                    &harvester,
                    &sim,
                    &opts.vm_namespace,
                    opts.real_node_charts,
                )
                .await?,
            )
        } else {
            None
        };

        let started_in = t0.elapsed();
        eprintln!(
            "test bed ready in {:.1}s (dir {}, guest {}, harvester {})",
            started_in.as_secs_f64(),
            root.display(),
            guest.url,
            harvester.url
        );
        Ok(TestBed {
            cluster,
            lb_upstream,
            sim,
            kubevirt,
            lb_webhook,
            webhooks,
            guest,
            harvester,
            etcd,
            cloud_config,
            vm_namespace: opts.vm_namespace,
            pki,
            started_in,
            dir,
        })
    }

    /// Restarts the Harvester kube-apiserver (SIGKILL, then the same port, flags and
    /// certificates) and waits until it serves again: `/readyz`, every CRD Established, the
    /// virt-api APIService Available through the aggregator and the LoadBalancer webhook called. The stand-in's watches recover by
    /// themselves (they retry with backoff and relist).
    pub async fn restart_harvester(&mut self) -> Result<(), BedError> {
        self.harvester.restart().await?;
        self.wait_harvester_serving().await
    }

    /// After [`ApiServer::start_again`](crate::bed::cluster::ApiServer::start_again) of the Harvester
    /// server: every CRD Established and the virt-api APIService Available.
    pub async fn wait_harvester_serving(&self) -> Result<(), BedError> {
        let names: Vec<String> = CRDS.iter().flat_map(|(_, yaml)| crd_names(yaml)).collect();
        wait_established(&self.harvester.client, names).await?;
        wait_virt_api_available(&self.harvester.client).await?;
        crate::sim::lb_webhook::wait_called(&self.harvester.client, &self.vm_namespace).await?;
        crate::sim::lb_validator::wait_called(&self.harvester.client, &self.vm_namespace).await?;
        crate::sim::backup_validator::wait_called(&self.harvester.client, &self.vm_namespace).await
    }

    /// Pids of every process the bed started (for the no-orphans test).
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = vec![
            self.etcd.proc.pid(),
            self.guest.proc.pid(),
            self.harvester.proc.pid(),
        ];
        pids.extend(self.cluster.iter().flat_map(GuestCluster::pids));
        pids.extend(self.kubevirt.iter().flat_map(RealKubevirt::pids));
        pids.extend(
            self.lb_upstream
                .iter()
                .flat_map(lb_upstream::LbUpstream::pids),
        );
        pids
    }

    /// The real guest cluster; panics naming the option when the bed has none.
    pub fn real(&self) -> &GuestCluster {
        self.cluster.as_ref().expect(
            "this bed has no real guest cluster: start it with BedOptions { real_node: true, .. }",
        )
    }
}

/// The admission webhooks of the Harvester side (the stand-ins' LB and backup validators,
/// Harvester's LB mutating webhook) registered and called once each, or Harvester's real LB
/// controller and webhook (`BedOptions::lb_upstream`).
async fn harvester_webhooks(
    opts: &BedOptions,
    root: &std::path::Path,
    pki: &Pki,
    client: &kube::Client,
    cloud_config: &std::path::Path,
) -> Result<(WebhookServer, LbWebhook, Option<lb_upstream::LbUpstream>), BedError> {
    let ns = &opts.vm_namespace;
    let webhooks = WebhookServer::start(pki).await?;
    if opts.lb_upstream.is_none() {
        crate::sim::lb_validator::install(&webhooks, client.clone(), pki).await?;
        crate::sim::lb_validator::wait_called(client, ns).await?;
    }
    crate::sim::backup_validator::install(&webhooks, client.clone(), pki).await?;
    crate::sim::backup_validator::wait_called(client, ns).await?;
    let lb_webhook = LbWebhook::install(&webhooks, client.clone(), opts.lb_webhook);
    let lb_upstream = match &opts.lb_upstream {
        None => {
            lb_webhook.register(&webhooks, client, pki, ns).await?;
            None
        }
        Some(bin_dir) => {
            Some(lb_upstream::LbUpstream::start(bin_dir, root, client, cloud_config, ns).await?)
        }
    };
    Ok((webhooks, lb_webhook, lb_upstream))
}

/// APIService `v1.subresources.kubevirt.io` -> ExternalName Service `kubevirt/virt-api` ->
/// localhost:<port>, as real KubeVirt registers it; waits until the aggregator calls it Available.
async fn register_virt_api(client: &kube::Client, pki: &Pki, port: u16) -> Result<(), BedError> {
    let ca = base64::engine::general_purpose::STANDARD.encode(&pki.ca.cert_pem);
    let yaml = format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: virt-api, namespace: kubevirt}}
spec: {{type: ExternalName, externalName: localhost, ports: [{{name: https, port: {port}, protocol: TCP}}]}}
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {{name: v1.subresources.kubevirt.io}}
spec:
  group: subresources.kubevirt.io
  version: v1
  groupPriorityMinimum: 1000
  versionPriority: 15
  service: {{namespace: kubevirt, name: virt-api, port: {port}}}
  caBundle: {ca}
"#
    );
    apply_yaml(client, &yaml, "kubevirt").await?;
    wait_virt_api_available(client).await
}

async fn wait_virt_api_available(client: &kube::Client) -> Result<(), BedError> {
    let api: Api<k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService> =
        Api::all(client.clone());
    wait::until(
        "APIService v1.subresources.kubevirt.io Available",
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                let svc = api
                    .get("v1.subresources.kubevirt.io")
                    .await
                    .map_err(|e| e.to_string())?;
                let conditions = svc.status.and_then(|s| s.conditions).unwrap_or_default();
                Ok(
                    if conditions
                        .iter()
                        .any(|c| c.type_ == "Available" && c.status == "True")
                    {
                        Ok(())
                    } else {
                        Err(conditions)
                    },
                )
            }
        },
    )
    .await
    .map_err(BedError::Setup)
}
