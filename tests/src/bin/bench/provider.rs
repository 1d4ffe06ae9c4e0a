//! The bed and the provider under measurement: API-request counts from the provider's own
//! metrics, the provider running in-process, and the object helpers the sections share.

use super::*;

/// `(verb, resource) -> requests` from the OpenMetrics text.
pub(crate) fn api_requests(metrics: &Metrics) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for line in metrics.encode().lines() {
        let Some(rest) = line.strip_prefix("harvester_kube_api_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let v: u64 = value.trim().parse().unwrap_or(0);
        *out.entry((label("verb"), label("resource"))).or_insert(0) += v;
    }
    out
}

pub(crate) fn delta(
    after: &BTreeMap<(String, String), u64>,
    before: &BTreeMap<(String, String), u64>,
) -> BTreeMap<(String, String), u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

pub(crate) fn breakdown_table(
    title: &str,
    per: &str,
    n: usize,
    d: &BTreeMap<(String, String), u64>,
) -> String {
    let total: u64 = d.values().sum();
    let mut rows: Vec<_> = d.iter().collect();
    rows.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let mut s = format!(
        "### {title}\n\n{total} requests for {n} {per}s = **{:.1} per {per}**.\n\n| verb | resource | requests | per {per} |\n|---|---|---|---|\n",
        total as f64 / n as f64
    );
    for ((verb, resource), v) in rows {
        let _ = writeln!(
            s,
            "| {verb} | {resource} | {v} | {:.2} |",
            *v as f64 / n as f64
        );
    }
    s
}

/// Sum and count of a histogram in the OpenMetrics text.
pub(crate) fn histogram_mean(metrics: &Metrics, name: &str) -> Option<(f64, u64)> {
    let text = metrics.encode();
    let value = |suffix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_{suffix} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    let count = value("count")? as u64;
    (count > 0).then(|| (value("sum").unwrap_or(0.0) / count as f64, count))
}

/// Waits until the provider's request counter has not moved for `quiet` (its watches are up).
pub(crate) async fn settle(metrics: &Metrics, quiet: Duration, limit: Duration) {
    let start = Instant::now();
    let mut last = metrics.api_request_total();
    let mut since = Instant::now();
    while start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = metrics.api_request_total();
        if now != last {
            last = now;
            since = Instant::now();
        } else if last > 0 && since.elapsed() >= quiet {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The bed and the provider

pub(crate) async fn bed(hotplug_delay: Option<Duration>) -> anyhow::Result<TestBed> {
    let mut opts = BedOptions::default();
    if let Some(d) = hotplug_delay {
        opts.hotplug_delay = d;
    }
    let bed = TestBed::start(opts).await?;
    Ok(bed)
}

pub(crate) fn provider_args(bed: &TestBed) -> Vec<String> {
    vec![
        "--cloud-config".into(),
        bed.cloud_config.display().to_string(),
        "--kubeconfig".into(),
        bed.guest.kubeconfig.display().to_string(),
        "--cluster-name".into(),
        CLUSTER.into(),
    ]
}

/// The cloud provider running in this process, counting its API requests into `telemetry`.
pub(crate) struct InProcess {
    pub(crate) telemetry: Telemetry,
    pub(crate) stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub(crate) task: tokio::task::JoinHandle<Result<(), harvester_cloud_provider::Error>>,
}

impl InProcess {
    pub(crate) async fn start(bed: &TestBed) -> anyhow::Result<InProcess> {
        let mut argv = vec!["harvester-cloud-provider".to_string()];
        argv.extend(provider_args(bed));
        let config = Config::from_args(argv)?;
        let telemetry = Telemetry::new();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(harvester_cloud_provider::run_with(
            config,
            telemetry.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        // Its lists and watches are up once the request counter stands still.
        settle(
            &telemetry.metrics,
            Duration::from_secs(1),
            Duration::from_secs(20),
        )
        .await;
        if task.is_finished() {
            bail!("the cloud provider ended at start: {:?}", task.await);
        }
        Ok(InProcess {
            telemetry,
            stop: Some(stop),
            task,
        })
    }

    pub(crate) async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if tokio::time::timeout(Duration::from_secs(20), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

pub(crate) async fn create_pool(bed: &TestBed) -> anyhow::Result<()> {
    bed.sim.create_pool("bench-pool", "10.128.0.0/16").await?;
    Ok(())
}

/// A LoadBalancer Service without NodePorts (kube-vip announces the address itself): the guest
/// API server's NodePort range (30000-32767) holds 2 768 Services, the scale section makes 5 000.
pub(crate) fn lb_service(name: &str) -> anyhow::Result<Service> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"type": "LoadBalancer", "selector": {"app": name},
                 "allocateLoadBalancerNodePorts": false,
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    }))?)
}

pub(crate) fn initialised(node: &Node) -> bool {
    let spec = node.spec.as_ref();
    spec.and_then(|s| s.provider_id.as_ref()).is_some()
        && !spec
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == UNINITIALIZED_TAINT))
}

/// Waits until `seen` holds every name in `names`; Err with the count when `limit` passes.
pub(crate) async fn wait_all(
    what: &str,
    seen: &Seen,
    names: &[String],
    limit: Duration,
) -> Result<HashMap<String, (Instant, String)>, String> {
    let start = Instant::now();
    let mut last_print = Instant::now();
    loop {
        let now = seen_now(seen);
        let done = names.iter().filter(|n| now.contains_key(*n)).count();
        if done == names.len() {
            return Ok(now);
        }
        if start.elapsed() > limit {
            return Err(format!(
                "{done} of {} {what} after {}",
                names.len(),
                secs(limit)
            ));
        }
        if last_print.elapsed() > Duration::from_secs(5) {
            progress(format!("  {done}/{} {what}", names.len()));
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The guest Node of each VM in `vms` (tainted, as the kubelet registers it), with the times of
/// each create ([`Created`]).
pub(crate) async fn create_nodes(bed: &TestBed, vms: &[String]) -> anyhow::Result<Created> {
    create_all(vms.len(), |i| {
        let name = vms[i].clone();
        async move {
            bed.sim
                .create_guest_node(&name)
                .await
                .with_context(|| format!("creating Node {name}"))?;
            Ok(name)
        }
    })
    .await
}

/// Per object: when its create request was sent and when the API server answered it (from then
/// the object exists, and the provider's step can start).
pub(crate) struct Created {
    pub(crate) sent: HashMap<String, Instant>,
    /// In the shape of the watches' maps, for [`between`].
    pub(crate) answered: HashMap<String, (Instant, String)>,
}

/// Runs `make(i)` for `0..n` with [`CREATE_CONCURRENCY`] in flight; returns when each named
/// object's create was sent and answered.
pub(crate) async fn create_all<F, Fut>(n: usize, make: F) -> anyhow::Result<Created>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
{
    let make = &make;
    let times: Vec<(String, Instant, Instant)> = futures::stream::iter(0..n)
        .map(|i| async move {
            let t = Instant::now();
            make(i).await.map(|name| (name, t, Instant::now()))
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_collect()
        .await?;
    let sent = times.iter().map(|(k, s, _)| (k.clone(), *s)).collect();
    let answered = times
        .into_iter()
        .map(|(k, _, a)| (k, (a, String::new())))
        .collect();
    Ok(Created { sent, answered })
}

pub(crate) fn latencies(
    sent: &HashMap<String, Instant>,
    seen: &HashMap<String, (Instant, String)>,
) -> Vec<Duration> {
    sent.iter()
        .filter_map(|(name, t)| seen.get(name).map(|(s, _)| s.saturating_duration_since(*t)))
        .collect()
}

/// `to − from` for every key both saw.
pub(crate) fn between(
    from: &HashMap<String, (Instant, String)>,
    to: &HashMap<String, (Instant, String)>,
) -> Vec<Duration> {
    from.iter()
        .filter_map(|(k, (f, _))| to.get(k).map(|(t, _)| t.saturating_duration_since(*f)))
        .collect()
}

pub(crate) fn service_address(svc: &Service) -> Option<(String, String)> {
    Some((svc.name_any(), ingress_ip(svc)?))
}

pub(crate) fn node_initialised(node: &Node) -> Option<(String, String)> {
    initialised(node).then(|| (node.name_any(), String::new()))
}

/// The Service a CR belongs to (by its labels), once the CR exists.
pub(crate) fn cr_created(lb: &LoadBalancer) -> Option<(String, String)> {
    Some((lb.labels().get(LABEL_SERVICE_NAME)?.clone(), String::new()))
}

/// The Service a CR belongs to, once Harvester (the stand-in) allocated its address.
pub(crate) fn cr_allocated(lb: &LoadBalancer) -> Option<(String, String)> {
    let ip = lb.allocated_ip()?.to_string();
    Some((lb.labels().get(LABEL_SERVICE_NAME)?.clone(), ip))
}
