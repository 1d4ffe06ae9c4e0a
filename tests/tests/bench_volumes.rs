//! Smoke run of the bench program's volume section (issue 26): `bench --smoke --only 3` (root:
//! loop devices, mkfs, mount), so the section `make bench` runs with 500 VMs cannot rot. The
//! times mean nothing at this size; the request breakdown is exact: publish and unpublish must
//! cost the same requests with 1 and with 20 VMs in the namespace, and none of them may list
//! VMs or VMIs.

use std::process::Command;

#[test]
fn bench_volume_section_smoke_run_reports_publish_cost_per_namespace_size_root() {
    assert!(
        testbed::sim::storage::is_root(),
        "this test needs root (loop devices, mkfs, mount); run it as root (`make test` does)"
    );
    let bench = env!("CARGO_BIN_EXE_bench");
    let dir = tempfile::tempdir().expect("temporary directory");
    let out = dir.path().join("benchmarks.md");
    let run = Command::new(bench)
        .args(["--smoke", "--only", "3", "--out"])
        .arg(&out)
        .output()
        .expect("running the bench program");
    let stderr = String::from_utf8_lossy(&run.stderr);
    // Read before the status check: a failed section's error is in the report, which goes with
    // the temporary directory.
    let report = std::fs::read_to_string(&out);
    assert!(
        run.status.success(),
        "bench --smoke --only 3 failed ({}):\n{stderr}\nits report:\n{}",
        run.status,
        report.as_deref().unwrap_or("(none written)")
    );
    let report = report.expect("the bench writes its report");
    assert!(!report.contains("**failed**"), "{report}");
    for rpc in ["ControllerPublishVolume", "ControllerUnpublishVolume"] {
        for vms in [1, 20] {
            let row = format!("| 3 | `{rpc}` with {vms} VMs (and their VMIs) in the namespace |");
            let line = report
                .lines()
                .find(|l| l.starts_with(&row))
                .unwrap_or_else(|| panic!("no row {row:?} in\n{report}"));
            assert!(line.contains("get virtualmachines"), "{line}");
            assert!(
                !line.contains("list virtualmachines")
                    && !line.contains("list virtualmachineinstances"),
                "a volume operation listed the namespace's VMs or VMIs: {line}"
            );
        }
        let requests = format!("| `{rpc}` API requests, 20 VMs vs 1 VM(s) | within 20 % |");
        let line = report
            .lines()
            .find(|l| l.starts_with(&requests))
            .unwrap_or_else(|| panic!("no target {requests:?} in\n{report}"));
        assert!(line.ends_with("| yes |"), "{line}");
    }
}
