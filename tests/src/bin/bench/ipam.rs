//! Section 5: criterion's estimates for IPAM.

use super::*;

pub(crate) fn criterion_dir(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(d) = &args.criterion_dir {
        return Ok(d.clone());
    }
    // <target>/release/bench -> <target>/criterion
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(Path::parent)
        .context("no target directory above this program")?;
    Ok(target.join("criterion"))
}

pub(crate) fn ipam(dir: &Path, report: &mut Report) -> anyhow::Result<()> {
    progress(format!(
        "5. IPAM: criterion estimates from {}",
        dir.display()
    ));
    let layouts = [
        ("in_order", "in order"),
        ("scattered", "scattered"),
        ("wrapped", "wrapped (worst case)"),
    ];
    for (layout, how) in layouts {
        let mut empty = None;
        for percent in [0, 90, 99] {
            let file = dir
                .join(format!("ipam_slash16_{layout}"))
                .join(percent.to_string())
                .join("new/estimates.json");
            let text = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "{} (run `cargo bench -p testbed --bench ipam` first; make bench does)",
                    file.display()
                )
            })?;
            let age = std::fs::metadata(&file)?
                .modified()?
                .elapsed()
                .unwrap_or_default();
            let v: serde_json::Value = serde_json::from_str(&text)?;
            let ns = |k: &str| v[k]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            let (mean, median) = (ns("mean"), ns("median"));
            let bound = |k: &str| {
                v["mean"]["confidence_interval"][k]
                    .as_f64()
                    .unwrap_or(f64::NAN)
            };
            let stale = if age > Duration::from_secs(3600) {
                format!(" (**stale: {} h old**)", age.as_secs() / 3600)
            } else {
                String::new()
            };
            let ratio = match empty {
                Some(e) if percent > 0 => format!("; **{:.0}×** the empty pool's time", mean / e),
                _ => String::new(),
            };
            empty = empty.or(Some(mean));
            report.rows.push(Row {
                section: "5",
                what: format!("`ipam::allocate`, /16 {percent} % full, {how}"),
                n: "criterion `--quick`".into(),
                total: "—".into(),
                p50: format!("{} (median)", nanos(median)),
                p99: "—".into(),
                figures: format!(
                    "**{} allocations/s**; mean {} (95 % CI {} – {}){ratio}{stale}",
                    per_second(mean),
                    nanos(mean),
                    nanos(bound("lower_bound")),
                    nanos(bound("upper_bound"))
                ),
            });
        }
    }
    Ok(())
}

pub(crate) fn nanos(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

pub(crate) fn per_second(ns: f64) -> String {
    let per = 1e9 / ns;
    if per >= 1e6 {
        format!("{:.1} M", per / 1e6)
    } else if per >= 1e3 {
        format!("{:.0} k", per / 1e3)
    } else {
        format!("{per:.0}")
    }
}
