//! Section 6: scale, many Services and Nodes on one bed with the release binary of the provider.

use super::*;

/// One scale level: this many LoadBalancer Services and tainted Nodes on one fresh bed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Level {
    pub(crate) services: usize,
    pub(crate) nodes: usize,
}

/// The figures of one level, for its rows and the growth table.
pub(crate) struct Scaled {
    pub(crate) level: Level,
    pub(crate) svc_to_cr: Stats,
    pub(crate) alloc_to_address: Stats,
    pub(crate) standin: Option<Stats>,
    pub(crate) node_init: Stats,
    pub(crate) per_service: f64,
    pub(crate) per_node: f64,
    pub(crate) hwm_kib: u64,
    pub(crate) cpu_s: f64,
    /// Service reconciles per Service woken by anything but the periodic resync.
    pub(crate) converging: f64,
}

/// The VM without a VMI (stopped) whose tainted Node is created under the Service load.
pub(crate) const NO_VMI: &str = "bench-no-vmi";

/// `(controller, trigger) -> reconciles` scraped from a provider process's `/metrics`.
pub(crate) async fn scraped_triggers(port: u16) -> anyhow::Result<BTreeMap<(String, String), u64>> {
    scraped_pairs(
        port,
        "harvester_reconcile_triggers_total",
        ["controller", "trigger"],
    )
    .await
}

/// The per-level table of reconciles by controller and what woke them.
pub(crate) fn triggers_table(level: Level, t: &BTreeMap<(String, String), u64>) -> String {
    let Level { services, nodes } = level;
    let mut s = format!(
        "### Scale: reconciles by trigger, {services} Services + {nodes} Nodes\n\nWhat woke each reconcile of the provider (`harvester_reconcile_triggers_total`), from start to the last Service settled: `service` / `node` a change of the object itself (echoes of the provider's own writes wake nothing), `loadbalancer` a change of its CR that the reconcile reads, `related service` the other side of a shared address, `vm` / `vmi` its VM or VMI, `start` and `resync` the sweeps over every object, `requeue` the reconcile's own retry. Per object: per Service for the service controller, per Node for the others.\n\n| controller | trigger | reconciles | per object |\n|---|---|---|---|\n"
    );
    for ((controller, trigger), n) in t {
        let per = if controller == "service" {
            services
        } else {
            nodes
        };
        let _ = writeln!(
            s,
            "| {controller} | {trigger} | {n} | {:.2} |",
            *n as f64 / per.max(1) as f64
        );
    }
    s
}

/// Service reconciles per Service on the way to convergence: every trigger but the resync.
fn converging_per_service(t: &BTreeMap<(String, String), u64>, services: usize) -> f64 {
    let n: u64 = t
        .iter()
        .filter(|((c, trigger), _)| c == "service" && trigger != "resync")
        .map(|(_, n)| n)
        .sum();
    n as f64 / services.max(1) as f64
}

/// The Warning on the Node of [`NO_VMI`] that says its VM does not run.
pub(crate) async fn no_vmi_event(bed: &TestBed) -> anyhow::Result<String> {
    warning_on(bed, NO_VMI, "VirtualMachineNotRunning", |_| true).await
}

/// The Service with a malformed annotation among the others.
pub(crate) const BAD_SERVICE: &str = "bench-bad-annotation";

/// `(verb, resource) -> requests` scraped from a provider process's `/metrics`.
pub(crate) async fn scraped_requests(port: u16) -> anyhow::Result<BTreeMap<(String, String), u64>> {
    scraped_pairs(
        port,
        "harvester_kube_api_requests_total",
        ["verb", "resource"],
    )
    .await
}

/// The counter `name` scraped from a provider process's `/metrics`, summed by two of its labels.
async fn scraped_pairs(
    port: u16,
    name: &str,
    [a, b]: [&str; 2],
) -> anyhow::Result<BTreeMap<(String, String), u64>> {
    let (code, body) = testbed::util::scrape::get(port, "/metrics")
        .await
        .map_err(anyhow::Error::msg)?;
    if code != 200 {
        bail!("/metrics answered {code}");
    }
    let samples = testbed::util::scrape::parse(&body).map_err(anyhow::Error::msg)?;
    let mut out = BTreeMap::new();
    for s in samples.iter().filter(|s| s.name == name) {
        let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
        *out.entry((label(a), label(b))).or_insert(0) += s.value as u64;
    }
    Ok(out)
}

/// Reconciles, their mean duration and their mean wait for their turn per controller, from a
/// provider process's `/metrics`: how much of a latency is the provider's own work (its API
/// round trips included) and how much is waiting behind other reconciles.
pub(crate) async fn reconcile_figures(port: u16) -> anyhow::Result<String> {
    let (_, body) = testbed::util::scrape::get(port, "/metrics")
        .await
        .map_err(anyhow::Error::msg)?;
    let samples = testbed::util::scrape::parse(&body).map_err(anyhow::Error::msg)?;
    // Per controller: duration sum and count, queue wait sum and count.
    let mut per: BTreeMap<String, [f64; 4]> = BTreeMap::new();
    for s in &samples {
        let Some(c) = s.labels.get("controller") else {
            continue;
        };
        let slot = match s.name.as_str() {
            "harvester_reconcile_duration_seconds_sum" => 0,
            "harvester_reconcile_duration_seconds_count" => 1,
            "harvester_reconcile_queue_seconds_sum" => 2,
            "harvester_reconcile_queue_seconds_count" => 3,
            _ => continue,
        };
        per.entry(c.clone()).or_default()[slot] += s.value;
    }
    let mean = |sum: f64, n: f64| secs(Duration::from_secs_f64(sum / n.max(1.0)));
    Ok(per
        .iter()
        .filter(|(_, [_, n, _, _])| *n > 0.0)
        .map(|(c, [sum, n, wait, waited])| {
            format!(
                "{c} {n:.0} × {} (waited {})",
                mean(*sum, *n),
                mean(*wait, *waited)
            )
        })
        .collect::<Vec<_>>()
        .join(", "))
}

/// Waits until the process's request counter has not moved for `quiet` (at most `limit`).
pub(crate) async fn settle_scraped(
    port: u16,
    quiet: Duration,
    limit: Duration,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut last: u64 = scraped_requests(port).await?.values().sum();
    let mut since = Instant::now();
    while start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now: u64 = scraped_requests(port).await?.values().sum();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            return Ok(());
        }
    }
    Ok(())
}

/// User + system CPU time of a process, from `/proc/<pid>/stat` (fields 14 and 15, clock ticks).
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count from the closing parenthesis.
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("no ')' in /proc/<pid>/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': field 3 is index 0, so utime (14) is 11 and stime (15) is 12.
    let tick = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("field {} of /proc/{pid}/stat", i + 3))
    };
    // The kernel reports these in USER_HZ, which is 100 on x86_64 and aarch64.
    Ok((tick(11)? + tick(12)?) as f64 / 100.0)
}

pub(crate) fn stats_cell(s: &Stats) -> String {
    format!("{} / {} / {}", secs(s.p50), secs(s.p99), secs(s.max))
}

pub(crate) async fn scale(level: Level, report: &mut Report) -> anyhow::Result<Scaled> {
    let Level { services, nodes } = level;
    progress(format!(
        "6. Scale: {services} LoadBalancer Services and {nodes} tainted Nodes on one bed"
    ));
    let ccm_bin = sibling_binary("harvester-cloud-provider")?;
    let bed = bed(None).await?;
    create_pool(&bed).await?;
    let vms = create_vms(&bed, nodes).await?;
    bed.sim
        .create_vm(&GuestVm::new(NO_VMI).on_host(HOST).ip("10.52.255.254"))
        .await?;
    bed.sim.stop_vm(NO_VMI).await?;
    progress(format!("  {nodes} VMs running, {NO_VMI} stopped"));
    let port = testbed::util::process::free_port()?;
    let mut cmd = Command::new(&ccm_bin);
    cmd.args(provider_args(&bed)).args([
        "--leader-elect=false".to_string(),
        format!("--metrics-address=127.0.0.1:{port}"),
        "--secure-port=0".to_string(),
    ]);
    let mut ccm = Proc::spawn("harvester-cloud-provider", cmd, bed.dir.path())?;
    testbed::util::scrape::wait_for_200(port, "/readyz", Duration::from_secs(60))
        .await
        .map_err(|e| anyhow::anyhow!("the provider did not get ready: {e}"))?;
    settle_scraped(port, Duration::from_secs(1), Duration::from_secs(20)).await?;
    ccm.check_alive()?;
    let cpu_start = cpu_seconds(ccm.pid())?;

    // Nodes first, on their own, so each request is counted against the right kind of object.
    let ([node_exists, node_addressed, node_seen], node_watch) =
        observe_each(Api::<Node>::all(bed.guest.client.clone()), |n: &Node| {
            let name = || (n.name_any(), String::new());
            let addressed = n
                .status
                .as_ref()
                .and_then(|s| s.addresses.as_ref())
                .is_some_and(|a| !a.is_empty());
            [Some(name()), addressed.then(name), node_initialised(n)]
        });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = scraped_requests(port).await?;
    let node_created = create_nodes(&bed, &vms).await?;
    let node_result = wait_all(
        "Nodes initialised",
        &node_seen,
        &vms,
        Duration::from_secs(60 + nodes as u64 / 2),
    )
    .await;
    settle_scraped(port, Duration::from_secs(2), Duration::from_secs(30)).await?;
    let after_nodes = scraped_requests(port).await?;
    node_watch.abort();
    let node_seen = node_result.map_err(anyhow::Error::msg)?;
    let node_req = delta(&after_nodes, &before);
    // The provider's step starts when the Node exists (its create answered); from the request
    // sent, the API server's own time for the create is in it too (shown beside).
    let node_init =
        Stats::of(between(&node_created.answered, &node_seen)).context("no Node latencies")?;
    let node_whole =
        Stats::of(latencies(&node_created.sent, &node_seen)).context("no Node latencies")?;
    progress(format!(
        "  {nodes} Nodes initialised: p50 {}, p99 {} (from the create request sent: p99 {})",
        secs(node_init.p50),
        secs(node_init.p99),
        secs(node_whole.p99)
    ));
    // Where a Node's time goes, as the bench's watch sees it: the Node itself, its addresses
    // (the provider's status patch, written first), then providerID and the taint removed.
    let (node_exists, node_addressed) = (seen_now(&node_exists), seen_now(&node_addressed));
    let mut node_phases = Vec::new();
    for (what, from, to) in [
        (
            "create answered → Node seen",
            &node_created.answered,
            &node_exists,
        ),
        ("Node seen → addresses seen", &node_exists, &node_addressed),
        (
            "addresses seen → initialised seen",
            &node_addressed,
            &node_seen,
        ),
    ] {
        if let Some(s) = Stats::of(between(from, to)) {
            let phase = format!("{what} p50 {}, p99 {}", secs(s.p50), secs(s.p99));
            progress(format!("    {phase}"));
            node_phases.push(phase);
        }
    }

    // Then the Services, 16 creates in flight, one of them with a malformed annotation.
    let svc_api: Api<Service> = Api::namespaced(bed.guest.client.clone(), "default");
    let crs: Api<LoadBalancer> = Api::namespaced(bed.harvester.client.clone(), &bed.vm_namespace);
    let (seen, watch) = observe(svc_api.clone(), service_address);
    let ([cr_seen, alloc_seen], cr_watch) =
        observe_each(crs, |lb| [cr_created(lb), cr_allocated(lb)]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    // A tainted Node whose VM has no VMI, under the Service load: its Warning, and no delay.
    bed.sim
        .create_guest_node(NO_VMI)
        .await
        .context("creating the Node of the VM without a VMI")?;
    let Created { sent, answered } = create_all(services, |i| {
        let api = svc_api.clone();
        async move {
            let name = format!("bench-lb-{i:05}");
            api.create(&PostParams::default(), &lb_service(&name)?)
                .await
                .with_context(|| format!("creating Service {name}"))?;
            Ok(name)
        }
    })
    .await?;
    let mut bad = lb_service(BAD_SERVICE)?;
    bad.annotations_mut()
        .insert("cloudprovider.harvesterhci.io/ipam".into(), "static".into());
    svc_api
        .create(&PostParams::default(), &bad)
        .await
        .context("creating the Service with a malformed annotation")?;
    progress(format!(
        "  {services} Services created in {}",
        secs(t0.elapsed())
    ));
    let names: Vec<String> = sent.keys().cloned().collect();
    // The stand-in allocates one LoadBalancer at a time, each write carrying the whole IPPool
    // status: the limit grows with N.
    let limit = Duration::from_secs(120 + services as u64 * 3 / 5);
    let result = wait_all("Services with an address", &seen, &names, limit).await;
    settle_scraped(port, Duration::from_secs(2), Duration::from_secs(60)).await?;
    let after = scraped_requests(port).await?;
    for w in [watch, cr_watch] {
        w.abort();
    }
    ccm.check_alive()?;
    let cpu_s = cpu_seconds(ccm.pid())? - cpu_start;
    let reconciles = reconcile_figures(port).await?;
    let triggers = scraped_triggers(port).await?;
    let (hwm_kib, rss_kib) = memory_kib(ccm.pid())?;
    let seen = result.map_err(anyhow::Error::msg)?;
    let bad_note = bad_annotation_event(&bed).await?;
    let no_vmi_note = no_vmi_event(&bed).await?;
    let no_vmi_tainted = !initialised(
        &Api::<Node>::all(bed.guest.client.clone())
            .get(NO_VMI)
            .await?,
    );
    let bad_has_cr = seen_now(&cr_seen).contains_key(BAD_SERVICE);
    ccm.stop();
    if bad_has_cr {
        bail!("{BAD_SERVICE} got a LoadBalancer CR from a malformed annotation");
    }
    if !no_vmi_tainted {
        bail!("Node {NO_VMI} was initialised although its VM has no VMI");
    }
    let (cr_seen, alloc_seen) = (seen_now(&cr_seen), seen_now(&alloc_seen));
    let svc_to_cr = Stats::of(between(&answered, &cr_seen)).context("no CR latencies")?;
    let sent_to_cr = Stats::of(latencies(&sent, &cr_seen)).context("no CR latencies")?;
    let alloc_to_address =
        Stats::of(between(&alloc_seen, &seen)).context("no address latencies")?;
    let standin = Stats::of(between(&cr_seen, &alloc_seen));
    let whole = Stats::of(latencies(&sent, &seen)).context("no latencies")?;
    let svc_req = delta(&after, &after_nodes);
    let per = |d: &BTreeMap<(String, String), u64>, n: usize| {
        d.values().sum::<u64>() as f64 / n.max(1) as f64
    };
    let (per_service, per_node) = (per(&svc_req, services), per(&node_req, nodes));
    let converging = converging_per_service(&triggers, services);
    let all_in = seen
        .values()
        .map(|(t, _)| t.saturating_duration_since(t0))
        .max()
        .unwrap_or_default();
    report.rows.push(Row {
        section: "6",
        what: "scale: provider's own step Service created (its create answered) → its LoadBalancer CR exists".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: secs(svc_to_cr.p50),
        p99: secs(svc_to_cr.p99),
        figures: format!(
            "max {}; from the create request sent (the API server's create included) p50 {}, p99 {}; **{per_service:.1} API requests/Service**; all {services} addressed {} after the first create (the stand-in allocates one at a time: p50 {} from CR to address); whole Service create sent → ingress p50 {}, p99 {}",
            secs(svc_to_cr.max),
            secs(sent_to_cr.p50),
            secs(sent_to_cr.p99),
            secs(all_in),
            standin.as_ref().map(|s| secs(s.p50)).unwrap_or_default(),
            secs(whole.p50),
            secs(whole.p99)
        ),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: provider's own step CR allocated → Service ingress seen".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: secs(alloc_to_address.p50),
        p99: secs(alloc_to_address.p99),
        figures: format!("max {}", secs(alloc_to_address.max)),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: Node tainted (its create answered) → initialised".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: secs(node_init.p50),
        p99: secs(node_init.p99),
        figures: format!(
            "max {}; from the create request sent (the API server's create included) p50 {}, p99 {}; by the bench's Node watch: {}; **{per_node:.1} API requests/Node**",
            secs(node_init.max),
            secs(node_whole.p50),
            secs(node_whole.p99),
            node_phases.join("; ")
        ),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: the `harvester-cloud-provider` release binary holding them".into(),
        n: format!("{services} + {nodes}"),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "**VmHWM {}** (VmRSS {}); **{cpu_s:.1} CPU seconds** (user + system) from ready to the last Service settled, {:.1} ms per object; **{converging:.2} service reconciles per Service** on the way to convergence (every trigger but the resync; by trigger below); reconciles (count × mean duration, API round trips included; in parentheses the mean wait for their turn, `harvester_reconcile_queue_seconds`): {reconciles}",
            mib(hwm_kib),
            mib(rss_kib),
            cpu_s * 1000.0 / (services + nodes) as f64,
        ),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: one Service with a malformed annotation among them".into(),
        n: "1".into(),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "Warning `SyncLoadBalancerFailed`: {}; no CR; the other {services} all addressed",
            bad_note.replace('|', "\\|")
        ),
    });
    report.rows.push(Row {
        section: "6",
        what: "scale: one tainted Node whose VM has no VMI, created under the Service load".into(),
        n: "1".into(),
        total: "—".into(),
        p50: "—".into(),
        p99: "—".into(),
        figures: format!(
            "Warning `VirtualMachineNotRunning`: {}; the Node stays tainted; the {services} Services' steps above were measured beside it",
            no_vmi_note.replace('|', "\\|")
        ),
    });
    report.details.push(triggers_table(level, &triggers));
    report.details.push(breakdown_table(
        &format!("Scale: cloud provider API requests, {services} LoadBalancer Services (with {nodes} Nodes held)"),
        "Service",
        services,
        &svc_req,
    ));
    report.details.push(breakdown_table(
        &format!("Scale: cloud provider API requests, {nodes} Nodes"),
        "Node",
        nodes,
        &node_req,
    ));
    progress(format!(
        "  {services} Services: CR p99 {}, address p99 {}, {per_service:.1} req/Service, {per_node:.1} req/Node, VmHWM {}, {cpu_s:.1} CPU s",
        secs(svc_to_cr.p99),
        secs(alloc_to_address.p99),
        mib(hwm_kib)
    ));
    Ok(Scaled {
        level,
        svc_to_cr,
        alloc_to_address,
        standin,
        node_init,
        per_service,
        per_node,
        hwm_kib,
        cpu_s,
        converging,
    })
}

/// The note of the Warning Event on [`BAD_SERVICE`] that names the malformed annotation.
pub(crate) async fn bad_annotation_event(bed: &TestBed) -> anyhow::Result<String> {
    warning_on(bed, BAD_SERVICE, "SyncLoadBalancerFailed", |n| {
        n.contains("cloudprovider.harvesterhci.io/ipam") && n.contains("static")
    })
    .await
}

/// The note of a Warning Event with `reason` on the object `name` (a Service in `default`, or a
/// Node, whose Events go there too) whose note `matches`; waits 30 s at most.
async fn warning_on(
    bed: &TestBed,
    name: &str,
    reason: &str,
    matches: impl Fn(&str) -> bool,
) -> anyhow::Result<String> {
    let api: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(bed.guest.client.clone(), "default");
    let start = Instant::now();
    loop {
        let events = api
            .list(&kube::api::ListParams::default().fields(&format!("regarding.name={name}")))
            .await?;
        if let Some(note) = events.items.iter().find_map(|e| {
            (e.type_.as_deref() == Some("Warning") && e.reason.as_deref() == Some(reason))
                .then(|| e.note.clone().unwrap_or_default())
                .filter(|n| matches(n))
        }) {
            return Ok(note);
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!(
                "no Warning {reason} on {name}; its events: {:?}",
                events
                    .items
                    .iter()
                    .map(|e| (e.reason.clone(), e.note.clone()))
                    .collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Issue 26's targets for the provider, measured at the largest level, and the growth of CPU
/// per object from the level of 1 000 Services (or the one before the largest) to it.
pub(crate) fn scale_targets(levels: &[Scaled]) -> Vec<Target> {
    let Some(l) = levels.iter().max_by_key(|l| l.level.services) else {
        return Vec::new();
    };
    let at = format!("{} Services + {} Nodes", l.level.services, l.level.nodes);
    let p99 = |what: &str, s: &Stats, limit: Duration| Target {
        what: format!("provider's own step p99, {what} ({at})"),
        target: format!("≤ {}", secs(limit)),
        measured: secs(s.p99),
        met: s.p99 <= limit,
    };
    let mut targets = vec![
        Target {
            what: format!("provider VmHWM ({at})"),
            target: "≤ 64 MiB".into(),
            measured: mib(l.hwm_kib),
            met: l.hwm_kib <= 64 * 1024,
        },
        Target {
            what: format!("provider CPU seconds, ready → settled ({at})"),
            target: "≤ 30 s".into(),
            measured: format!("{:.1} s", l.cpu_s),
            met: l.cpu_s <= 30.0,
        },
        Target {
            what: format!(
                "service reconciles per Service on the way to convergence, every trigger but the resync ({at})"
            ),
            target: "≤ 3".into(),
            measured: format!("{:.2}", l.converging),
            met: l.converging <= 3.0,
        },
        p99(
            "Service created → its LoadBalancer CR",
            &l.svc_to_cr,
            Duration::from_millis(250),
        ),
        p99(
            "CR allocated → Service address",
            &l.alloc_to_address,
            Duration::from_millis(100),
        ),
        p99(
            "Node tainted → initialised",
            &l.node_init,
            Duration::from_secs(1),
        ),
        Target {
            what: format!("API requests per Service ({at})"),
            target: "≤ 5".into(),
            measured: format!("{:.2}", l.per_service),
            met: l.per_service <= 5.0,
        },
        Target {
            what: format!("API requests per Node ({at})"),
            target: "≤ 3".into(),
            measured: format!("{:.2}", l.per_node),
            met: l.per_node <= 3.0,
        },
    ];
    let smaller = levels
        .iter()
        .filter(|s| s.level.services < l.level.services)
        .max_by_key(|s| s.level.services);
    if let Some(s) = smaller {
        let growth = cpu_per_object(l) / cpu_per_object(s).max(f64::EPSILON);
        targets.push(Target {
            what: format!(
                "provider CPU per object, {} + {} against {} + {}",
                l.level.services, l.level.nodes, s.level.services, s.level.nodes
            ),
            target: "within 1.5×".into(),
            measured: format!("{growth:.2}×"),
            met: growth <= 1.5,
        });
    }
    targets
}

/// CPU milliseconds per object (Services + Nodes) of a level.
fn cpu_per_object(l: &Scaled) -> f64 {
    l.cpu_s * 1000.0 / (l.level.services + l.level.nodes).max(1) as f64
}

/// How each figure grows from the first level to the others.
pub(crate) fn growth_table(levels: &[Scaled]) -> String {
    let Some(first) = levels.first() else {
        return String::new();
    };
    let mut s = String::from(
        "### Scale: how the figures grow\n\nEach level on a fresh bed; the provider's own steps as p50 / p99 / max; ratios to the first level in brackets (for CPU per object: to the level before).\n\n| Services + Nodes | Service → CR | CR allocated → address | Node tainted → initialised | stand-in CR → allocated (p50) | requests/Service | requests/Node | service reconciles/Service (converging) | VmHWM | CPU seconds | CPU ms per object |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            format!(" ({:.1}×)", a / b)
        } else {
            String::new()
        }
    };
    let mut before: Option<&Scaled> = None;
    for l in levels {
        let _ = writeln!(
            s,
            "| {} + {} | {}{} | {}{} | {}{} | {} | {:.2} | {:.2} | {:.2} | {}{} | {:.1}{} | {:.2}{} |",
            l.level.services,
            l.level.nodes,
            stats_cell(&l.svc_to_cr),
            ratio(
                l.svc_to_cr.p99.as_secs_f64(),
                first.svc_to_cr.p99.as_secs_f64()
            ),
            stats_cell(&l.alloc_to_address),
            ratio(
                l.alloc_to_address.p99.as_secs_f64(),
                first.alloc_to_address.p99.as_secs_f64()
            ),
            stats_cell(&l.node_init),
            ratio(
                l.node_init.p99.as_secs_f64(),
                first.node_init.p99.as_secs_f64()
            ),
            l.standin.as_ref().map(|s| secs(s.p50)).unwrap_or_default(),
            l.per_service,
            l.per_node,
            l.converging,
            mib(l.hwm_kib),
            ratio(l.hwm_kib as f64, first.hwm_kib as f64),
            l.cpu_s,
            ratio(l.cpu_s, first.cpu_s),
            cpu_per_object(l),
            before
                .map(|b| ratio(cpu_per_object(l), cpu_per_object(b)))
                .unwrap_or_default(),
        );
        before = Some(l);
    }
    s.push_str("\n(The ratio in a latency column is that of the p99.)\n");
    s
}
