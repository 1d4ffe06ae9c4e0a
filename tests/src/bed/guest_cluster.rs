//! The real guest cluster of the bed (issue 15, `BedOptions::real_node`): on top of the guest API
//! server, kube-controller-manager, kube-scheduler and the snapshot-controller (node tools), one
//! real node ([`RealNode`]: containerd + kubelet on the [`PodNetwork`] bridge) whose VM the
//! stand-in runs, every image imported into its containerd, and both charts installed with
//! `helm install`: the cloud provider Pod initialises the Node, the CSI controller Deployment and
//! node DaemonSet serve the StorageClass `harvester`.
//!
//! Hot-plugged disks of this node are linked in the host's `/dev/disk/by-id`, where the node
//! plugin Pod (host `/dev` mounted) looks, as a VM's udev would link them; the links the stand-in
//! made are removed on drop, like everything else the cluster changed on the host.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};

use crate::BedError;
use crate::bed::certs::Pki;
use crate::bed::cluster::{ApiServer, kubeconfig_text};
use crate::real::images::{self, Image, ImageSet, Program, Recipe};
use crate::real::node::{RealNode, node_tool};
use crate::real::podnet::{GATEWAY, PodNetwork};
use crate::sim::{GuestVm, Sim};
use crate::util::helm::Helm;
use crate::util::process::{Proc, free_port};
use crate::util::wait;

/// The real node's name: its Node in the guest cluster and its VM in Harvester.
pub const NODE: &str = "guest-1";
/// The Harvester host its VM runs on, with the topology the cloud provider copies.
pub const HOST: &str = "harvester-1";
pub const REGION: &str = "region-1";
pub const ZONE: &str = "zone-a";
/// `--cluster-name` of the cloud provider (`global.cattle.clusterName`, as Rancher sets it).
pub const CLUSTER_NAME: &str = "testbed";
/// Namespace of both releases, as Rancher installs them.
pub const NAMESPACE: &str = "kube-system";
/// The Secret holding the cloud-config for both charts (keys `cloud-config` for the cloud
/// provider, `cloud-provider-config` for the CSI driver: each chart's default key).
pub const CLOUD_CONFIG_SECRET: &str = "harvester-cloud-config";
pub const CCM_RELEASE: &str = "harvester-cloud-provider";
pub const CSI_RELEASE: &str = "harvester-csi-driver";
/// Where the stand-in links this node's hot-plugged disks: the host's udev directory.
pub const HOST_BY_ID: &str = "/dev/disk/by-id";

/// The image of the tests' Pods: busybox (static, from Debian's busybox-static) as `/bin/sh`
/// and `/bin/busybox`; [`workload_command`] installs its applets first.
pub const WORKLOAD: &str = "localhost/testbed/busybox:testbed";
const BUSYBOX: &str = "/bin/busybox";

/// A Pod command for the workload image: `sh -c <script>` with busybox's applets (cat, dd, df,
/// sleep, ...) linked into `/bin` first.
pub fn workload_command(script: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!("busybox --install -s /bin 2>/dev/null; {script}"),
    ]
}

fn workload_image(dir: &Path) -> Result<Image, BedError> {
    if !Path::new(BUSYBOX).is_file() {
        return Err(BedError::MissingTool {
            tool: "busybox (Debian busybox-static)".into(),
            path: BUSYBOX.into(),
            script: Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/node-tools.sh"),
        });
    }
    let at = |p: &str| Program {
        host: BUSYBOX.into(),
        image_path: p.into(),
        libraries: Vec::new(),
    };
    let recipe = Recipe {
        name: WORKLOAD.into(),
        entrypoint: vec!["/bin/sh".into()],
        programs: vec![at("/bin/busybox"), at("/bin/sh")],
        files: Vec::new(),
    };
    let tarball = dir.join("workload.tar");
    images::pack(&recipe, &tarball, images::Compression::None)?;
    Ok(Image {
        name: WORKLOAD.into(),
        tarball,
    })
}

/// How long a chart's workloads get to become Ready after `helm install`.
const ROLLOUT: Duration = Duration::from_secs(180);

pub struct GuestCluster {
    /// kubelet and containerd: stopped first, with their Pods' mounts.
    pub node: RealNode,
    /// kube-controller-manager, kube-scheduler, snapshot-controller.
    control_plane: Vec<Proc>,
    pub net: PodNetwork,
    pub images: ImageSet,
    /// helm's home (cache, config, data) in the bed's directory.
    pub helm_home: PathBuf,
    /// The admin kubeconfig helm and kubectl users of the guest cluster get.
    pub kubeconfig: PathBuf,
}

/// `host:port` of an API server's `https://127.0.0.1:<port>` URL.
fn socket_addr(server: &ApiServer) -> Result<SocketAddr, BedError> {
    server
        .url
        .trim_start_matches("https://")
        .parse()
        .map_err(|e| BedError::Setup(format!("API server URL {}: {e}", server.url)))
}

impl GuestCluster {
    pub async fn start(
        dir: &Path,
        pki: &Pki,
        guest: &ApiServer,
        harvester: &ApiServer,
        sim: &Sim,
        vm_namespace: &str,
        charts: bool,
    ) -> Result<GuestCluster, BedError> {
        let net = PodNetwork::start(socket_addr(guest)?, socket_addr(harvester)?).await?;
        crate::bed::crds::install_crd_yaml(
            &guest.client,
            "snapshot.yaml",
            include_str!("../../crds/snapshot.yaml"),
        )
        .await?;
        let control_plane = start_control_plane(dir, pki, &guest.kubeconfig)?;

        let images = images::build_all(&dir.join("images"))?;
        let workload = workload_image(&dir.join("images"))?;
        sim.create_default_storage_class().await?;
        sim.create_host(HOST, Some(REGION), Some(ZONE)).await?;
        sim.create_vm(&GuestVm::new(NODE).on_host(HOST).ip(GATEWAY))
            .await?;
        sim.hotplug.set_by_id_dir(NODE, PathBuf::from(HOST_BY_ID));

        let node = RealNode::start(
            dir,
            NODE,
            GATEWAY,
            &guest.kubeconfig,
            &pki.ca.cert,
            &guest.client,
            |dirs| {
                let mut all = images.all();
                all.push(&workload);
                images::import(&dirs.containerd_socket, &all)
            },
        )
        .await?;
        let mut cluster = GuestCluster {
            node,
            control_plane,
            net,
            images,
            helm_home: dir.join("helm"),
            kubeconfig: guest.kubeconfig.clone(),
        };
        // RKE2 labels its servers so; the CSI controller Pods need it (upstream's affinity). The
        // kubelet may not set node-role labels itself.
        Api::<Node>::all(guest.client.clone())
            .patch(
                NODE,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"metadata": {"labels": {
                    "node-role.kubernetes.io/control-plane": "true"}}})),
            )
            .await?;
        if charts {
            cluster
                .install_charts(pki, harvester, &guest.client, vm_namespace)
                .await?;
        }
        Ok(cluster)
    }

    /// helm with the guest admin kubeconfig, its homes in the bed's directory.
    pub fn helm(&self) -> Helm {
        Helm {
            kubeconfig: self.kubeconfig.clone(),
            home: self.helm_home.clone(),
        }
    }

    /// The cloud-config Secret, then `helm install` of both charts with the local images, then
    /// waits until the cloud provider Deployment, the CSI controller Deployment and the CSI node
    /// DaemonSet are Ready.
    async fn install_charts(
        &mut self,
        pki: &Pki,
        harvester: &ApiServer,
        guest: &kube::Client,
        vm_namespace: &str,
    ) -> Result<(), BedError> {
        let cloud_config = cloud_config(pki, harvester, vm_namespace)?;
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": CLOUD_CONFIG_SECRET, "namespace": NAMESPACE},
            "stringData": {"cloud-config": cloud_config, "cloud-provider-config": cloud_config},
        }))
        .map_err(|e| BedError::Setup(format!("the cloud-config Secret: {e}")))?;
        Api::<Secret>::namespaced(guest.clone(), NAMESPACE)
            .create(&PostParams::default(), &secret)
            .await?;

        let charts = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/charts");
        let ccm_chart = charts.join(CCM_RELEASE);
        let csi_chart = charts.join(CSI_RELEASE);
        let (repo, tag) = split_image(&self.images.cloud_provider.name)?;
        let ccm_values = [
            format!("image.repository={repo}"),
            format!("image.tag={tag}"),
            format!("cloudConfig.secretName={CLOUD_CONFIG_SECRET}"),
            format!("global.cattle.clusterName={CLUSTER_NAME}"),
            "kube-vip.enabled=false".to_string(),
        ];
        self.helm_install(CCM_RELEASE, &ccm_chart, &ccm_values)?;

        let mut csi_values = vec![
            format!("cloudConfig.secretName={CLOUD_CONFIG_SECRET}"),
            format!("kubeletRootDir={}", self.node.dirs.kubelet_root.display()),
            "replicasCount=1".to_string(),
        ];
        let (repo, tag) = split_image(&self.images.csi_driver.name)?;
        csi_values.push(format!("image.harvester.csiDriver.repository={repo}"));
        csi_values.push(format!("image.harvester.csiDriver.tag={tag}"));
        for (key, image) in [
            ("nodeDriverRegistrar", &self.images.registrar),
            ("provisioner", &self.images.provisioner),
            ("attacher", &self.images.attacher),
            ("resizer", &self.images.resizer),
            ("snapshotter", &self.images.snapshotter),
            ("livenessProbe", &self.images.livenessprobe),
        ] {
            let (repo, tag) = split_image(&image.name)?;
            csi_values.push(format!("image.csi.{key}.repository={repo}"));
            csi_values.push(format!("image.csi.{key}.tag={tag}"));
        }
        self.helm_install(CSI_RELEASE, &csi_chart, &csi_values)?;

        wait_deployment(guest, NAMESPACE, CCM_RELEASE, ROLLOUT).await?;
        wait_deployment(
            guest,
            NAMESPACE,
            &format!("{CSI_RELEASE}-controllers"),
            ROLLOUT,
        )
        .await?;
        wait_daemonset(guest, NAMESPACE, CSI_RELEASE, ROLLOUT).await
    }

    fn helm_install(&self, release: &str, chart: &Path, set: &[String]) -> Result<(), BedError> {
        let chart = chart.to_string_lossy();
        let mut args = vec!["install", release, &chart, "--namespace", NAMESPACE];
        for s in set {
            args.extend(["--set", s]);
        }
        self.helm().run(&args).map(|_| ()).map_err(BedError::Setup)
    }

    /// Pids of the processes the cluster started itself (not its Pods).
    pub fn pids(&self) -> Vec<u32> {
        self.control_plane
            .iter()
            .map(Proc::pid)
            .chain(self.node.pids())
            .collect()
    }
}

/// The cloud-config the guest cluster's Pods use: the Harvester admin at the address they reach
/// it on (the Pod network's gateway), context namespace `vm_namespace`.
pub fn cloud_config(
    pki: &Pki,
    harvester: &ApiServer,
    vm_namespace: &str,
) -> Result<String, BedError> {
    Ok(kubeconfig_text(
        &harvester_url_from_pods(harvester)?,
        pki,
        &pki.admin,
        "admin",
        vm_namespace,
    ))
}

/// The Harvester API server's URL as the guest cluster's Pods reach it (the Pod network's
/// gateway).
pub fn harvester_url_from_pods(harvester: &ApiServer) -> Result<String, BedError> {
    let port = socket_addr(harvester)?.port();
    Ok(format!("https://{GATEWAY}:{port}"))
}

/// `repo:tag` split at the last colon after the last slash.
fn split_image(name: &str) -> Result<(&str, &str), BedError> {
    let slash = name.rfind('/').map_or(0, |i| i + 1);
    name[slash..]
        .rfind(':')
        .map(|i| (&name[..slash + i], &name[slash + i + 1..]))
        .ok_or_else(|| BedError::Setup(format!("image {name} has no tag")))
}

/// kube-controller-manager (the `default` ServiceAccounts, the root CA ConfigMap Pods' tokens
/// trust, Deployments, DaemonSets, PV binding, attach-detach, the not-ready taint),
/// kube-scheduler and the snapshot-controller, all with the guest admin kubeconfig.
fn start_control_plane(dir: &Path, pki: &Pki, kubeconfig: &Path) -> Result<Vec<Proc>, BedError> {
    let kc = format!("--kubeconfig={}", kubeconfig.display());
    let mut kcm = Command::new(node_tool("kube-controller-manager")?);
    kcm.arg(&kc)
        .arg("--leader-elect=false")
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={}", free_port()?))
        .arg(format!("--root-ca-file={}", pki.ca.cert.display()))
        .arg(format!(
            "--service-account-private-key-file={}",
            pki.sa_key.display()
        ))
        .arg("--allocate-node-cidrs=false")
        .arg("--v=1");
    let mut scheduler = Command::new(node_tool("kube-scheduler")?);
    scheduler
        .arg(&kc)
        .arg("--leader-elect=false")
        .arg("--bind-address=127.0.0.1")
        .arg(format!("--secure-port={}", free_port()?))
        .arg("--v=1");
    let mut snapshots = Command::new(node_tool("snapshot-controller")?);
    snapshots
        .arg(&kc)
        .arg("--leader-election=false")
        .arg("--v=2");
    Ok(vec![
        Proc::spawn("kube-controller-manager", kcm, dir)?,
        Proc::spawn("kube-scheduler", scheduler, dir)?,
        Proc::spawn("snapshot-controller", snapshots, dir)?,
    ])
}

/// Waits until Deployment `name` has all its replicas Ready; on timeout the error lists its
/// Pods' states and Events.
pub async fn wait_deployment(
    client: &kube::Client,
    ns: &str,
    name: &str,
    bound: Duration,
) -> Result<(), BedError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let ready = wait::until(&format!("Deployment {ns}/{name} Ready"), bound, || {
        let api = api.clone();
        async move {
            let d = api.get(name).await.map_err(|e| e.to_string())?;
            let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let status = d.status.unwrap_or_default();
            let ready = status.ready_replicas.unwrap_or(0);
            Ok(if ready >= want && want > 0 {
                Ok(())
            } else {
                Err(format!("{ready}/{want} ready"))
            })
        }
    })
    .await;
    with_pod_report(client, ns, ready).await
}

/// Waits until DaemonSet `name` runs a Ready Pod on every node it wants one on.
pub async fn wait_daemonset(
    client: &kube::Client,
    ns: &str,
    name: &str,
    bound: Duration,
) -> Result<(), BedError> {
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), ns);
    let ready = wait::until(&format!("DaemonSet {ns}/{name} Ready"), bound, || {
        let api = api.clone();
        async move {
            let d = api.get(name).await.map_err(|e| e.to_string())?;
            let s = d.status.unwrap_or_default();
            Ok(
                if s.desired_number_scheduled > 0 && s.number_ready == s.desired_number_scheduled {
                    Ok(())
                } else {
                    Err(format!(
                        "{}/{} ready",
                        s.number_ready, s.desired_number_scheduled
                    ))
                },
            )
        }
    })
    .await;
    with_pod_report(client, ns, ready).await
}

/// Waits until Pod `name` is Running and Ready; on timeout the error has its state and Events
/// (e.g. a Pod stuck in ContainerCreating shows why).
pub async fn wait_pod_ready(
    client: &kube::Client,
    ns: &str,
    name: &str,
    bound: Duration,
) -> Result<Pod, BedError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let res = wait::until(&format!("Pod {ns}/{name} Ready"), bound, || {
        let api = api.clone();
        async move {
            let p = api.get(name).await.map_err(|e| e.to_string())?;
            Ok(if pod_ready(&p) {
                Ok(p)
            } else {
                Err(pod_state(&p))
            })
        }
    })
    .await;
    match res {
        Ok(p) => Ok(p),
        Err(e) => Err(BedError::Setup(format!(
            "{e}\nEvents of Pod {ns}/{name}:\n{}",
            events_of(client, ns, "Pod", name).await
        ))),
    }
}

pub fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Phase and each container's waiting/terminated reason, on one line.
pub fn pod_state(p: &Pod) -> String {
    let status = p.status.clone().unwrap_or_default();
    let containers: Vec<String> = status
        .container_statuses
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let state = c.state.clone().unwrap_or_default();
            let why = state
                .waiting
                .map(|w| {
                    format!(
                        "waiting {}: {}",
                        w.reason.unwrap_or_default(),
                        w.message.unwrap_or_default()
                    )
                })
                .or(state.terminated.map(|t| {
                    format!(
                        "terminated {} ({})",
                        t.reason.unwrap_or_default(),
                        t.exit_code
                    )
                }))
                .unwrap_or_else(|| "running".into());
            format!(
                "{} ready={} restarts={} {why}",
                c.name, c.ready, c.restart_count
            )
        })
        .collect();
    format!(
        "{} phase={} [{}]",
        p.metadata.name.clone().unwrap_or_default(),
        status.phase.unwrap_or_default(),
        containers.join("; ")
    )
}

/// The Events of object `kind/name` in `ns`, one per line (type, reason, message).
pub async fn events_of(client: &kube::Client, ns: &str, kind: &str, name: &str) -> String {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().fields(&format!(
        "involvedObject.kind={kind},involvedObject.name={name}"
    ));
    match api.list(&lp).await {
        Ok(list) => list
            .items
            .iter()
            .map(|e| {
                format!(
                    "  {} {}: {}",
                    e.type_.clone().unwrap_or_default(),
                    e.reason.clone().unwrap_or_default(),
                    e.message.clone().unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("  (listing Events: {e})"),
    }
}

/// On a failed wait, the states and Events of every Pod in `ns` that is not Ready.
async fn with_pod_report(
    client: &kube::Client,
    ns: &str,
    res: Result<(), String>,
) -> Result<(), BedError> {
    let Err(e) = res else { return Ok(()) };
    let mut report = e;
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for p in pods.iter().filter(|p| !pod_ready(p)) {
        let name = p.metadata.name.clone().unwrap_or_default();
        report.push_str(&format!(
            "\n{}\n{}",
            pod_state(p),
            events_of(client, ns, "Pod", &name).await
        ));
    }
    Err(BedError::Setup(report))
}

/// The links in `dir` whose target is a loop device: what the stand-in linked for this node
/// (a real disk's link points at `../../sdX`).
pub fn loop_links(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|t| t.to_string_lossy().starts_with("/dev/loop"))
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

impl Drop for GuestCluster {
    fn drop(&mut self) {
        for link in loop_links(Path::new(HOST_BY_ID)) {
            let _ = std::fs::remove_file(link);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_split_into_repository_and_tag() {
        assert_eq!(
            split_image("localhost/a/b:testbed").unwrap(),
            ("localhost/a/b", "testbed")
        );
        assert_eq!(
            split_image("localhost:5000/a:v1").unwrap(),
            ("localhost:5000/a", "v1")
        );
        assert!(split_image("localhost:5000/a").is_err());
    }
}
