//! Section 4: peak resident memory of the release binaries.

use super::*;

/// `VmHWM` and `VmRSS` of a process, in KiB.
pub(crate) fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let [hwm, rss] = status_kib(pid, ["VmHWM:", "VmRSS:"])?;
    Ok((hwm, rss))
}

/// Fields of `/proc/<pid>/status` given in kB, in the order asked.
fn status_kib<const N: usize>(pid: u32, names: [&str; N]) -> anyhow::Result<[u64; N]> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let mut values = [0; N];
    for (value, name) in values.iter_mut().zip(names) {
        *value = text
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .with_context(|| format!("{name} in /proc/{pid}/status"))?;
    }
    Ok(values)
}

pub(crate) fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// The release binaries `make release` puts next to this program.
pub(crate) fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{} is not built: run `make release` (make bench does)",
            path.display()
        );
    }
    Ok(path)
}

pub(crate) fn binary_size(path: &Path) -> String {
    std::fs::metadata(path)
        .map(|m| mib(m.len() / 1024))
        .unwrap_or_else(|_| "?".into())
}

pub(crate) async fn memory(
    services: usize,
    nodes: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    progress(format!(
        "4. Peak memory: the cloud provider binary with {services} Services and {nodes} Nodes, the idle CSI node plugin"
    ));
    let ccm_bin = sibling_binary("harvester-cloud-provider")?;
    let csi_bin = sibling_binary("harvester-csi-driver")?;
    let bed = bed(None).await?;
    create_pool(&bed).await?;
    let log_dir = bed.dir.path();
    let mut cmd = Command::new(&ccm_bin);
    cmd.args(provider_args(&bed)).args([
        "--leader-elect=false",
        "--metrics-address=",
        "--secure-port=0",
    ]);
    let mut ccm = Proc::spawn("harvester-cloud-provider", cmd, log_dir)?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    ccm.check_alive()?;
    let (idle_hwm, idle_rss) = memory_kib(ccm.pid())?;
    progress(format!(
        "  provider idle: VmHWM {}, VmRSS {}",
        mib(idle_hwm),
        mib(idle_rss)
    ));

    let vms = create_vms(&bed, nodes).await?;
    let svc_api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let node_api: Api<Node> = Api::all(bed.guest.client.clone());
    let (svc_seen, svc_watch) = observe(svc_api.clone(), service_address);
    let (node_seen, node_watch) = observe(node_api, node_initialised);
    let node_names = create_all(nodes, |i| {
        let name = vms[i].clone();
        let bed = &bed;
        async move {
            bed.sim.create_guest_node(&name).await?;
            Ok(name)
        }
    })
    .await?;
    let svc_names = create_all(services, |i| {
        let api = svc_api.clone();
        async move {
            let name = format!("bench-lb-{i:04}");
            api.create(&PostParams::default(), &lb_service(&name)?)
                .await?;
            Ok(name)
        }
    })
    .await?;
    let svc_names: Vec<String> = svc_names.sent.into_keys().collect();
    let node_names: Vec<String> = node_names.sent.into_keys().collect();
    let limit = Duration::from_secs(120 + services as u64 / 2);
    let waited = async {
        wait_all("Services with an address", &svc_seen, &svc_names, limit).await?;
        wait_all("Nodes initialised", &node_seen, &node_names, limit).await
    }
    .await;
    svc_watch.abort();
    node_watch.abort();
    ccm.check_alive()?;
    waited.map_err(anyhow::Error::msg)?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (hwm, rss) = memory_kib(ccm.pid())?;
    ccm.stop();
    let objects = (services + nodes) as u64;
    report.rows.push(Row {
        section: "4",
        what: format!(
            "peak RSS of the `harvester-cloud-provider` binary holding {services} LoadBalancer Services and {nodes} Nodes"
        ),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "**VmHWM {}** (VmRSS {} after 5 s quiet); idle after start: VmHWM {} → {:.1} KiB per object held; binary {}",
            mib(hwm),
            mib(rss),
            mib(idle_hwm),
            hwm.saturating_sub(idle_hwm) as f64 / objects as f64,
            binary_size(&ccm_bin)
        ),
    });
    progress(format!(
        "  provider with {services} Services + {nodes} Nodes: VmHWM {}, VmRSS {}",
        mib(hwm),
        mib(rss)
    ));

    // The node plugin of VM bench-node-000, serving nothing.
    let socket = bed.dir.path().join("csi-node.sock");
    let mut cmd = Command::new(&csi_bin);
    cmd.args(["--mode", "node"])
        .arg(format!("--endpoint=unix://{}", socket.display()))
        .arg(format!("--nodeid={}", vms[0]))
        .arg(format!("--kubeconfig={}", bed.cloud_config.display()))
        .arg(format!(
            "--disk-by-id-dir={}",
            bed.sim.by_id_dir(&vms[0]).display()
        ));
    let mut csi = Proc::spawn("harvester-csi-driver-node", cmd, log_dir)?;
    wait_for_socket(&socket, || csi.check_alive().is_err()).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    csi.check_alive()?;
    // Anonymous against file-backed: the idle plugin's resident set is mostly code pages of the
    // binary and libc that the kernel maps around each fault, not heap.
    let [hwm, rss, anon, file] =
        status_kib(csi.pid(), ["VmHWM:", "VmRSS:", "RssAnon:", "RssFile:"])?;
    csi.stop();
    report.targets.push(Target {
        what: "CSI node plugin idle VmHWM".into(),
        target: "≤ 8 MiB".into(),
        measured: mib(hwm),
        met: hwm <= 8 * 1024,
    });
    report.rows.push(Row {
        section: "4",
        what: "peak RSS of the idle `harvester-csi-driver --mode node` binary".into(),
        n: "—".into(),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "**VmHWM {}** (VmRSS {}: anonymous {}, file-backed {}), 5 s after its socket appeared; binary {}",
            mib(hwm),
            mib(rss),
            mib(anon),
            mib(file),
            binary_size(&csi_bin)
        ),
    });
    progress(format!(
        "  idle CSI node plugin: VmHWM {}, VmRSS {}",
        mib(hwm),
        mib(rss)
    ));
    Ok(())
}
