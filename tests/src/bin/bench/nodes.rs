//! Section 2: Node initialisation.

use super::*;

pub(crate) fn vm_ip(i: usize) -> String {
    format!("10.52.{}.{}", i / 200, i % 200 + 10)
}

pub(crate) async fn create_vms(bed: &TestBed, n: usize) -> anyhow::Result<Vec<String>> {
    bed.sim
        .create_host(HOST, Some("region-a"), Some("zone-1"))
        .await?;
    let names = create_all(n, |i| async move {
        let name = format!("bench-node-{i:03}");
        bed.sim
            .create_vm(&GuestVm::new(&name).on_host(HOST).ip(&vm_ip(i)))
            .await
            .with_context(|| format!("creating VM {name}"))?;
        Ok(name)
    })
    .await?;
    let mut names: Vec<String> = names.sent.into_keys().collect();
    names.sort();
    Ok(names)
}

pub(crate) async fn node_initialisation(n: usize, report: &mut Report) -> anyhow::Result<()> {
    progress(format!("2. Node initialisation, N = {n}"));
    let bed = bed(None).await?;
    let vms = create_vms(&bed, n).await?;
    progress(format!("  {n} VMs running"));
    let ccm = InProcess::start(&bed).await?;
    let nodes: Api<Node> = Api::all(bed.guest.client.clone());
    let (seen, watch) = observe(nodes, node_initialised);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let before = api_requests(&ccm.telemetry.metrics);
    let t0 = Instant::now();
    let sent = create_nodes(&bed, &vms).await?.sent;
    let created_in = t0.elapsed();
    let result = wait_all(
        "Nodes initialised",
        &seen,
        &vms,
        Duration::from_secs(60 + n as u64),
    )
    .await;
    settle(
        &ccm.telemetry.metrics,
        Duration::from_secs(2),
        Duration::from_secs(20),
    )
    .await;
    let d = delta(&api_requests(&ccm.telemetry.metrics), &before);
    watch.abort();
    ccm.stop().await;
    let seen = result.map_err(anyhow::Error::msg)?;
    let all_in = seen
        .values()
        .map(|(t, _)| t.saturating_duration_since(t0))
        .max()
        .unwrap_or_default();
    let stats = Stats::of(latencies(&sent, &seen)).context("no latencies")?;
    let total: u64 = d.values().sum();
    report.rows.push(Row {
        section: "2",
        what: "tainted Nodes (VMs running) → initialised (providerID, addresses, zone, taint removed)".into(),
        n: n.to_string(),
        total: secs(all_in),
        p50: secs(stats.p50),
        p99: secs(stats.p99),
        figures: format!(
            "**{:.1} API requests/Node**; {:.0} Nodes/s with the default `--concurrent-node-syncs` ({}); creating took {}",
            total as f64 / n as f64,
            n as f64 / all_in.as_secs_f64(),
            harvester_cloud_provider::config::DEFAULT_NODE_SYNCS,
            secs(created_in)
        ),
    });
    report.details.push(breakdown_table(
        &format!("Cloud provider API requests, {n} Nodes"),
        "Node",
        n,
        &d,
    ));
    progress(format!(
        "  all {n} initialised in {} (p50 {}, p99 {})",
        secs(all_in),
        secs(stats.p50),
        secs(stats.p99)
    ));
    Ok(())
}
