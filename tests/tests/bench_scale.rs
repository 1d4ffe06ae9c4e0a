//! Smoke run of the bench program's scale section (issue 18): `bench --smoke --only 6` (20
//! LoadBalancer Services and 5 tainted Nodes on one bed, the provider's binary as a child
//! process), so the section `make bench` runs at 5 000 Services cannot rot. The figures mean
//! nothing at this size; the test checks that the section ran to the end and reported every row,
//! the request breakdowns, the reconciles by trigger (issue 26) and the growth table, and that it
//! fails when the section fails.

use std::process::Command;

/// The rows the scale section writes for each level.
const ROWS: [&str; 6] = [
    "scale: provider's own step Service created (its create answered) → its LoadBalancer CR exists",
    "scale: provider's own step CR allocated → Service ingress seen",
    "scale: Node tainted (its create answered) → initialised",
    "scale: the `harvester-cloud-provider` release binary holding them",
    "scale: one Service with a malformed annotation among them",
    "scale: one tainted Node whose VM has no VMI, created under the Service load",
];

#[test]
fn bench_scale_section_smoke_run_reports_every_figure() {
    let bench = env!("CARGO_BIN_EXE_bench");
    // The bench runs the provider binary that cargo built next to it.
    let provider = testbed::util::process::built_binary("harvester-cloud-provider");
    let dir = tempfile::tempdir().expect("temporary directory");
    let out = dir.path().join("benchmarks.md");
    let run = Command::new(bench)
        .args(["--smoke", "--only", "6", "--out"])
        .arg(&out)
        .output()
        .expect("running the bench program");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "bench --smoke --only 6 failed ({}; provider {}):\n{stdout}\n{stderr}",
        run.status,
        provider.display()
    );
    let report = std::fs::read_to_string(&out).expect("the bench writes its report");
    assert!(
        !report.contains("**failed**"),
        "a section failed:\n{report}"
    );
    for row in ROWS {
        let line = report
            .lines()
            .find(|l| l.starts_with("| 6 | ") && l.contains(row))
            .unwrap_or_else(|| panic!("no row {row:?} in the report:\n{report}"));
        assert!(
            line.contains("| 20 + 5 |") || line.contains("| 1 |"),
            "{line}"
        );
    }
    let per_service = figure(&report, "API requests/Service**");
    let per_node = figure(&report, "API requests/Node**");
    assert!(
        per_service > 0.0 && per_node > 0.0,
        "requests were counted: {per_service} per Service, {per_node} per Node"
    );
    assert!(
        report.contains("SyncLoadBalancerFailed`: invalid")
            && report.contains("cloudprovider.harvesterhci.io/ipam"),
        "the malformed Service's Warning is quoted:\n{report}"
    );
    assert!(
        report.contains("VirtualMachineNotRunning`: ") && report.contains("bench-no-vmi"),
        "the Warning of the VM without a VMI is quoted:\n{report}"
    );
    let converging = figure(&report, "service reconciles per Service**");
    assert!(
        converging > 0.0,
        "service reconciles by trigger were counted: {converging}"
    );
    assert!(
        report.contains("| service | service | ") && report.contains("| service | loadbalancer | "),
        "the trigger table shows what woke the service reconciles:\n{report}"
    );
    for heading in [
        "### Scale: cloud provider API requests, 20 LoadBalancer Services",
        "### Scale: cloud provider API requests, 5 Nodes",
        "### Scale: reconciles by trigger, 20 Services + 5 Nodes",
        "### Scale: how the figures grow",
    ] {
        assert!(report.contains(heading), "no {heading:?}:\n{report}");
    }
    assert!(
        report.contains("| 20 + 5 | "),
        "the growth table has the level:\n{report}"
    );
}

/// The number just before `marker` in `**9.3 API requests/Service**`.
fn figure(report: &str, marker: &str) -> f64 {
    let at = report
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker:?} in:\n{report}"));
    let before = report[..at].trim_end();
    let start = before
        .rfind(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map_or(0, |i| i + 1);
    before[start..]
        .parse()
        .unwrap_or_else(|e| panic!("{marker}: {:?}: {e}", &before[start..]))
}
