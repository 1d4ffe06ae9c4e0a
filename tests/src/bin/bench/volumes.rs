//! Section 3: volumes through the CSI driver (create, publish, stage, publish, and back).

use super::*;
use testbed::csi_client::{
    create_request, mount_cap, node_publish_request, publish_request, stage_request,
    unpublish_request,
};

pub(crate) const VOLUME_NODE: &str = "worker-1";
pub(crate) const STEPS: [&str; 8] = [
    "CreateVolume",
    "ControllerPublishVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteVolume",
];

pub(crate) async fn install_default_storage_class(bed: &TestBed) -> anyhow::Result<()> {
    let sc: k8s_openapi::api::storage::v1::StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "harvester-longhorn",
                     "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
        "provisioner": "driver.longhorn.io",
        "allowVolumeExpansion": true,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate"
    }))?;
    Api::<k8s_openapi::api::storage::v1::StorageClass>::all(bed.harvester.client.clone())
        .create(&PostParams::default(), &sc)
        .await?;
    Ok(())
}

/// Waits until the stand-in has bound Harvester PVC `name` (its binder also detaches the loop
/// devices of deleted volumes, one at a time); that wait is the stand-in's, not the driver's.
pub(crate) async fn wait_bound(
    pvcs: &Api<PersistentVolumeClaim>,
    name: &str,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    loop {
        let pvc = pvcs.get(name).await?;
        if pvc.status.and_then(|s| s.phase).as_deref() == Some("Bound") {
            return Ok(t.elapsed());
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("PVC {name} not Bound after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One volume up and down; the duration of each step in [`STEPS`] order, and the wait for the
/// stand-in to bind the PVC (between CreateVolume and ControllerPublishVolume, not in either).
pub(crate) async fn volume_round_trip(
    controller: &mut ControllerClient<Channel>,
    node: &mut NodeClient<Channel>,
    pvcs: &Api<PersistentVolumeClaim>,
    dir: &Path,
    i: usize,
) -> anyhow::Result<([Duration; 8], Duration)> {
    let mut took = [Duration::ZERO; 8];
    let name = format!("pvc-bench-{i:03}");
    let staging = dir.join(format!("{name}-staging"));
    let target = dir.join(format!("{name}-target"));
    let t = Instant::now();
    let volume = controller
        .create_volume(create_request(&name, 32 << 20, &mount_cap("ext4")))
        .await
        .context("CreateVolume")?
        .into_inner()
        .volume
        .context("CreateVolume returned no volume")?;
    took[0] = t.elapsed();
    let id = volume.volume_id;
    let bound = wait_bound(pvcs, &id).await?;
    let t = Instant::now();
    let ctx = controller
        .controller_publish_volume(publish_request(&id, VOLUME_NODE, &mount_cap("ext4")))
        .await
        .context("ControllerPublishVolume")?
        .into_inner()
        .publish_context;
    took[1] = t.elapsed();
    let t = Instant::now();
    node.node_stage_volume(stage_request(&id, &ctx, &staging, &mount_cap("ext4")))
        .await
        .context("NodeStageVolume")?;
    took[2] = t.elapsed();
    let t = Instant::now();
    node.node_publish_volume(node_publish_request(
        &id,
        &ctx,
        &staging,
        &target,
        &mount_cap("ext4"),
    ))
    .await
    .context("NodePublishVolume")?;
    took[3] = t.elapsed();
    std::fs::write(target.join("bench.txt"), name.as_bytes())
        .context("writing into the published volume")?;
    let t = Instant::now();
    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await
    .context("NodeUnpublishVolume")?;
    took[4] = t.elapsed();
    let t = Instant::now();
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await
    .context("NodeUnstageVolume")?;
    took[5] = t.elapsed();
    let t = Instant::now();
    controller
        .controller_unpublish_volume(unpublish_request(&id, VOLUME_NODE))
        .await
        .context("ControllerUnpublishVolume")?;
    took[6] = t.elapsed();
    let t = Instant::now();
    controller
        .delete_volume(DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .context("DeleteVolume")?;
    took[7] = t.elapsed();
    Ok((took, bound))
}

/// A fresh bed with the stand-in's hot-plug delay 0, the default StorageClass, a host and the
/// running VM [`VOLUME_NODE`].
async fn volume_bed() -> anyhow::Result<TestBed> {
    let bed = bed(Some(Duration::ZERO)).await?;
    install_default_storage_class(&bed).await?;
    bed.sim
        .create_host(HOST, Some("region-a"), Some("zone-1"))
        .await?;
    bed.sim
        .create_vm(&GuestVm::new(VOLUME_NODE).on_host(HOST).ip("10.52.0.11"))
        .await?;
    Ok(bed)
}

pub(crate) async fn volumes(n: usize, report: &mut Report) -> anyhow::Result<()> {
    progress(format!(
        "3. Volumes, N = {n} (one after another, hot-plug delay 0)"
    ));
    let bed = volume_bed().await?;
    let dir = bed.dir.path().join("bench-csi");
    std::fs::create_dir_all(&dir)?;
    let _sweep = testbed::real::mounts::MountSweeper(dir.clone());
    let socket = dir.join("csi.sock");
    let mut config = harvester_csi_driver::Config::new(
        format!("unix://{}", socket.display()),
        &bed.cloud_config,
    );
    config.node_id = Some(VOLUME_NODE.into());
    config.disk_by_id_dir = bed.sim.by_id_dir(VOLUME_NODE);
    let server = harvester_csi_driver::spawn(config);
    wait_for_socket(&socket, || server.is_finished()).await?;
    let channel = harvester_csi_driver::connect(&socket).await?;
    let mut controller = ControllerClient::new(channel.clone());
    let mut node = NodeClient::new(channel);

    let pvcs: Api<PersistentVolumeClaim> =
        Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let mut binding = Vec::new();
    let mut per_step: Vec<Vec<Duration>> = vec![Vec::new(); STEPS.len()];
    let mut round_trips = Vec::new();
    let t0 = Instant::now();
    let mut last_print = Instant::now();
    let mut outcome = Ok(());
    for i in 0..n {
        match volume_round_trip(&mut controller, &mut node, &pvcs, &dir, i).await {
            Ok((took, bound)) => {
                binding.push(bound);
                for (s, d) in took.iter().enumerate() {
                    per_step[s].push(*d);
                }
                round_trips.push(took.iter().sum::<Duration>());
            }
            Err(e) => {
                outcome = Err(e.context(format!("volume {i}")));
                break;
            }
        }
        if last_print.elapsed() > Duration::from_secs(5) {
            progress(format!("  {}/{n} volumes up and down", i + 1));
            last_print = Instant::now();
        }
    }
    let all_in = t0.elapsed();
    let _ = tokio::time::timeout(Duration::from_secs(20), server.stop()).await;
    outcome?;

    for (s, sample) in per_step.into_iter().enumerate() {
        let stats = Stats::of(sample).context("no samples")?;
        report.rows.push(Row {
            section: "3",
            what: format!("volume step `{}`", STEPS[s]),
            n: stats.n.to_string(),
            total: "—".into(),
            p50: secs(stats.p50),
            p99: secs(stats.p99),
            figures: format!("max {}", secs(stats.max)),
        });
    }
    let rt = Stats::of(round_trips).context("no round trips")?;
    let mean = rt.sum / rt.n as u32;
    report.rows.push(Row {
        section: "3",
        what: "volume round trip (all 8 steps, 32 MiB ext4, one after another)".into(),
        n: n.to_string(),
        total: secs(all_in),
        p50: secs(rt.p50),
        p99: secs(rt.p99),
        figures: format!(
            "mean {}; {:.2} volumes/s up and down (wall clock, stand-in binding included); stand-in hot-plug delay set to 0 (`BedOptions::hotplug_delay = Duration::ZERO`)",
            secs(mean),
            n as f64 / all_in.as_secs_f64()
        ),
    });
    let b = Stats::of(binding).context("no binding times")?;
    report.rows.push(Row {
        section: "3",
        what: "(not the driver) stand-in binds the Harvester PVC after CreateVolume".into(),
        n: b.n.to_string(),
        total: "—".into(),
        p50: secs(b.p50),
        p99: secs(b.p99),
        figures: format!(
            "max {}; waited for by the bench between CreateVolume and ControllerPublishVolume and kept out of both (the stand-in's binder also detaches the previous volume's loop device)",
            secs(b.max)
        ),
    });
    progress(format!(
        "  {n} volumes up and down in {} (round trip p50 {}, p99 {})",
        secs(all_in),
        secs(rt.p50),
        secs(rt.p99)
    ));
    Ok(())
}

pub(crate) async fn wait_for_socket(
    socket: &Path,
    mut died: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let start = Instant::now();
    while !socket.exists() {
        if died() {
            bail!("the CSI driver stopped while starting");
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("the CSI driver socket {} did not appear", socket.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// ControllerPublishVolume and ControllerUnpublishVolume of `volumes` volumes, one after
/// another, with `others` more running VMs (each with its VMI) in the namespace beside
/// [`VOLUME_NODE`]: per call, the time and the driver's Harvester API requests (from its own
/// metrics). The driver reads who holds a claim from its watch cache and by name, so neither
/// figure may grow with `others` (issue 26: within 20 %).
pub(crate) async fn publish_in_namespace(
    others: usize,
    volumes: usize,
) -> anyhow::Result<NamespaceCost> {
    progress(format!(
        "3. Publish/unpublish with {} VMs in the namespace, {volumes} volumes",
        others + 1
    ));
    let bed = volume_bed().await?;
    futures::stream::iter(0..others)
        .map(|i| {
            let sim = &bed.sim;
            async move {
                let ip = format!("10.53.{}.{}", i / 250, i % 250 + 1);
                sim.create_vm(&GuestVm::new(&format!("other-{i:03}")).on_host(HOST).ip(&ip))
                    .await
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?;
    let dir = bed.dir.path().join("bench-csi-ns");
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("csi.sock");
    let mut config = harvester_csi_driver::Config::new(
        format!("unix://{}", socket.display()),
        &bed.cloud_config,
    );
    config.mode = harvester_csi_driver::Mode::Controller;
    let metrics = Metrics::new();
    let readiness = harvester_common::telemetry::Readiness::with_checks(&[]);
    let m = metrics.clone();
    let server = harvester_csi_driver::Running::spawn(
        |stopped| harvester_csi_driver::serve_with(config, m, readiness, stopped),
        harvester_common::running::OnDrop::Stop,
    );
    wait_for_socket(&socket, || server.is_finished()).await?;
    let mut controller = ControllerClient::new(harvester_csi_driver::connect(&socket).await?);
    let pvcs: Api<PersistentVolumeClaim> =
        Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let mut cost = NamespaceCost::default();
    let outcome = async {
        // Volume 0 warms up (the driver's first watch list, connections) and is not counted.
        for i in 0..=volumes {
            let id = controller
                .create_volume(create_request(
                    &format!("pvc-ns-{i:03}"),
                    32 << 20,
                    &mount_cap("ext4"),
                ))
                .await
                .context("CreateVolume")?
                .into_inner()
                .volume
                .context("CreateVolume returned no volume")?
                .volume_id;
            wait_bound(&pvcs, &id).await?;
            let counted = i > 0;
            measure(
                &metrics,
                counted,
                (&mut cost.publish, &mut cost.publish_requests),
                controller.controller_publish_volume(publish_request(
                    &id,
                    VOLUME_NODE,
                    &mount_cap("ext4"),
                )),
            )
            .await
            .context("ControllerPublishVolume")?;
            measure(
                &metrics,
                counted,
                (&mut cost.unpublish, &mut cost.unpublish_requests),
                controller.controller_unpublish_volume(unpublish_request(&id, VOLUME_NODE)),
            )
            .await
            .context("ControllerUnpublishVolume")?;
            controller
                .delete_volume(DeleteVolumeRequest {
                    volume_id: id,
                    ..Default::default()
                })
                .await
                .context("DeleteVolume")?;
        }
        anyhow::Ok(())
    }
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(20), server.stop()).await;
    outcome?;
    cost.vms = others + 1;
    cost.volumes = volumes;
    Ok(cost)
}

/// What [`publish_in_namespace`] measured at one namespace size.
#[derive(Default)]
pub(crate) struct NamespaceCost {
    vms: usize,
    volumes: usize,
    publish: Vec<Duration>,
    unpublish: Vec<Duration>,
    /// `(verb, resource) -> requests`, summed over the counted calls.
    publish_requests: BTreeMap<(String, String), u64>,
    unpublish_requests: BTreeMap<(String, String), u64>,
}

/// `call`'s outcome; when `counted`, its time and the API requests it made are added to `into`.
async fn measure<T>(
    metrics: &Metrics,
    counted: bool,
    into: (&mut Vec<Duration>, &mut BTreeMap<(String, String), u64>),
    call: impl std::future::Future<Output = T>,
) -> T {
    let before = api_requests(metrics);
    let t = Instant::now();
    let out = call.await;
    if counted {
        into.0.push(t.elapsed());
        add(into.1, delta(&api_requests(metrics), &before));
    }
    out
}

fn add(sum: &mut BTreeMap<(String, String), u64>, more: BTreeMap<(String, String), u64>) {
    for (k, v) in more {
        *sum.entry(k).or_insert(0) += v;
    }
}

/// The rows of each namespace size, and the targets comparing the largest with the smallest.
pub(crate) fn namespace_rows(costs: &[NamespaceCost], report: &mut Report) -> anyhow::Result<()> {
    let mut summary = Vec::new();
    for c in costs {
        for (what, sample, requests) in [
            ("ControllerPublishVolume", &c.publish, &c.publish_requests),
            (
                "ControllerUnpublishVolume",
                &c.unpublish,
                &c.unpublish_requests,
            ),
        ] {
            let stats = Stats::of(sample.clone()).context("no samples")?;
            let calls = c.volumes.max(1) as f64;
            let per_call = requests.values().sum::<u64>() as f64 / calls;
            let by_verb: Vec<String> = requests
                .iter()
                .map(|((verb, resource), n)| format!("{verb} {resource} {:.1}", *n as f64 / calls))
                .collect();
            report.rows.push(Row {
                section: "3",
                what: format!("`{what}` with {} VMs (and their VMIs) in the namespace", c.vms),
                n: c.volumes.to_string(),
                total: "—".into(),
                p50: secs(stats.p50),
                p99: secs(stats.p99),
                figures: format!(
                    "{per_call:.1} Harvester API requests per call (the driver's own metrics: {}); mean {}",
                    by_verb.join(", "),
                    secs(stats.sum / stats.n as u32)
                ),
            });
            summary.push((what, c.vms, per_call, stats.sum / stats.n as u32));
        }
    }
    for what in ["ControllerPublishVolume", "ControllerUnpublishVolume"] {
        let rows: Vec<_> = summary.iter().filter(|r| r.0 == what).collect();
        let (Some(small), Some(large)) = (
            rows.iter().min_by_key(|r| r.1),
            rows.iter().max_by_key(|r| r.1),
        ) else {
            continue;
        };
        if small.1 == large.1 {
            // A level failed (its error is a row of its own): one level cannot be compared.
            report.targets.push(Target {
                what: format!("`{what}` API requests and mean time, few vs many VMs"),
                target: "within 20 %".into(),
                measured: format!("not measured: only the {}-VM level ran", large.1),
                met: false,
            });
            continue;
        }
        let requests = large.2 / small.2.max(f64::MIN_POSITIVE);
        let time = large.3.as_secs_f64() / small.3.as_secs_f64().max(f64::MIN_POSITIVE);
        report.targets.push(Target {
            what: format!(
                "`{what}` API requests, {} VMs vs {} VM(s)",
                large.1, small.1
            ),
            target: "within 20 %".into(),
            measured: format!(
                "{:.1} vs {:.1} ({:+.0} %)",
                large.2,
                small.2,
                (requests - 1.0) * 100.0
            ),
            met: (requests - 1.0).abs() <= 0.2,
        });
        report.targets.push(Target {
            what: format!("`{what}` mean time, {} VMs vs {} VM(s)", large.1, small.1),
            target: "within 20 %".into(),
            measured: format!(
                "{} vs {} ({:+.0} %)",
                secs(large.3),
                secs(small.3),
                (time - 1.0) * 100.0
            ),
            met: (time - 1.0).abs() <= 0.2,
        });
    }
    Ok(())
}
