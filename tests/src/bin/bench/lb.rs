//! Section 1: LoadBalancer convergence.

use super::*;

pub(crate) async fn lb_convergence(n: usize, report: &mut Report) -> anyhow::Result<()> {
    progress(format!("1. LoadBalancer convergence, N = {n}"));
    let bed = bed(None).await?;
    create_pool(&bed).await?;
    let ccm = InProcess::start(&bed).await?;
    let services: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let (seen, watch) = observe(services.clone(), service_address);
    let ([cr_seen, alloc_seen], cr_watch) =
        observe_each(crs, |lb| [cr_created(lb), cr_allocated(lb)]);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let before = api_requests(&ccm.telemetry.metrics);
    let t0 = Instant::now();
    let Created { sent, answered } = create_all(n, |i| {
        let services = services.clone();
        async move {
            let name = format!("bench-lb-{i:04}");
            services
                .create(&PostParams::default(), &lb_service(&name)?)
                .await
                .with_context(|| format!("creating Service {name}"))?;
            Ok(name)
        }
    })
    .await?;
    let created_in = t0.elapsed();
    progress(format!("  {n} Services created in {}", secs(created_in)));
    let names: Vec<String> = sent.keys().cloned().collect();
    let limit = Duration::from_secs(60 + n as u64 / 2);
    let result = wait_all("Services with an address", &seen, &names, limit).await;
    let at_convergence = api_requests(&ccm.telemetry.metrics);
    // Let trailing work (events, the CR's status mirror, the reconcile its own patch causes)
    // finish, so the count is the whole cost of a Service.
    settle(
        &ccm.telemetry.metrics,
        Duration::from_secs(2),
        Duration::from_secs(20),
    )
    .await;
    let after = api_requests(&ccm.telemetry.metrics);
    let address_metric =
        histogram_mean(&ccm.telemetry.metrics, "harvester_service_address_seconds");
    for w in [watch, cr_watch] {
        w.abort();
    }
    ccm.stop().await;
    let seen = result.map_err(anyhow::Error::msg)?;
    let (cr_seen, alloc_seen) = (seen_now(&cr_seen), seen_now(&alloc_seen));

    let all_in = seen
        .values()
        .map(|(t, _)| t.saturating_duration_since(t0))
        .max()
        .unwrap_or_default();
    let stats = Stats::of(latencies(&sent, &seen)).context("no latencies")?;
    let distinct: HashSet<&String> = seen.values().map(|(_, ip)| ip).collect();
    let d_conv: u64 = delta(&at_convergence, &before).values().sum();
    let d = delta(&after, &before);
    let total: u64 = d.values().sum();
    // Where the time goes: the provider before the CR exists, the stand-in allocating (one
    // LoadBalancer at a time), the provider from the allocation to the Service's address.
    let phases: [(&str, Vec<Duration>); 4] = [
        (
            "provider: Service created (its create answered) → its LoadBalancer CR exists",
            between(&answered, &cr_seen),
        ),
        (
            "Harvester stand-in: CR exists → address allocated",
            between(&cr_seen, &alloc_seen),
        ),
        (
            "provider: address allocated → Service ingress seen",
            between(&alloc_seen, &seen),
        ),
        (
            "whole: Service created → ingress seen",
            latencies(&sent, &seen),
        ),
    ];
    let mut figures = format!(
        "**{:.1} API requests/Service** ({:.1} when the last address was seen); {:.1} Services/s; {} distinct addresses for {n} Services; the {n} creates took {}",
        total as f64 / n as f64,
        d_conv as f64 / n as f64,
        n as f64 / all_in.as_secs_f64(),
        distinct.len(),
        secs(created_in),
    );
    if let Some((mean, count)) = address_metric {
        let _ = write!(
            figures,
            "; the provider's own `service_address_seconds`: mean {} over {count} (from `creationTimestamp`, whole seconds)",
            secs(Duration::from_secs_f64(mean))
        );
    }
    let p50 = |i: usize| {
        Stats::of(phases[i].1.clone())
            .map(|s| secs(s.p50))
            .unwrap_or_default()
    };
    let _ = write!(
        figures,
        "; per Service (p50) the provider took {} to create the CR and {} from allocation to address, the stand-in {} to allocate (one LoadBalancer at a time)",
        p50(0),
        p50(2),
        p50(1)
    );
    report.rows.push(Row {
        section: "1",
        what: "LoadBalancer Services created at once → ingress address".into(),
        n: n.to_string(),
        total: secs(all_in),
        p50: secs(stats.p50),
        p99: secs(stats.p99),
        figures,
    });

    let mut table = format!(
        "### Where a Service's time goes, N = {n}\n\nEach phase from the watches of the bench (Services in the guest, LoadBalancer CRs in Harvester).\n\n| phase | p50 | p99 | max |\n|---|---|---|---|\n"
    );
    for (what, sample) in &phases {
        if let Some(s) = Stats::of(sample.clone()) {
            let _ = writeln!(
                table,
                "| {what} | {} | {} | {} |",
                secs(s.p50),
                secs(s.p99),
                secs(s.max)
            );
        }
    }
    report.details.push(table);
    report.details.push(breakdown_table(
        &format!("Cloud provider API requests, {n} LoadBalancer Services"),
        "Service",
        n,
        &d,
    ));
    progress(format!(
        "  all {n} addressed in {} (p50 {}, p99 {}), {:.1} requests/Service",
        secs(all_in),
        secs(stats.p50),
        secs(stats.p99),
        total as f64 / n as f64
    ));
    Ok(())
}
