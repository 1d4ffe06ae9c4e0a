//! csi-sanity (kubernetes-csi/csi-test, the real Go binary) against the driver in `all` mode
//! over the test bed: the Harvester API server, the virt-api stand-in behind the aggregator and
//! loop-device volumes. Once with mount volumes, once with block volumes; 0 failures expected,
//! skips only for capabilities the driver does not advertise (see the README).

#[path = "csi_common.rs"]
mod common;

use std::io::Write;
use std::path::Path;

use common::{Driver, MountSweeper, assert_root, bed_with_vm};

const VOLUME_SIZE: u64 = 64 << 20;
const EXPAND_SIZE: u64 = 128 << 20;
const ATTACH_LIMIT: u32 = 3;

/// Runs csi-sanity and returns (exit success, full output).
async fn csi_sanity(socket: &Path, work: &Path, access_type: &str) -> (bool, String) {
    let bin = testbed::tools::tool("csi-sanity").unwrap_or_else(|e| panic!("{e}"));
    let out = tokio::process::Command::new(&bin)
        .arg(format!("--csi.endpoint={}", socket.display()))
        .arg(format!(
            "--csi.stagingdir={}",
            work.join("staging").display()
        ))
        .arg(format!("--csi.mountdir={}", work.join("mount").display()))
        .arg(format!("--csi.testvolumeaccesstype={access_type}"))
        .arg(format!("--csi.testvolumesize={VOLUME_SIZE}"))
        .arg(format!("--csi.testvolumeexpandsize={EXPAND_SIZE}"))
        .arg("--csi.testnodevolumeattachlimit")
        .arg("--ginkgo.v")
        .arg("--ginkgo.no-color")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// csi-sanity's summary: the `Ran N of M Specs` line and the pass/fail/skip counts.
fn summary(output: &str) -> Vec<&str> {
    output
        .lines()
        .filter(|l| {
            l.starts_with("Ran ")
                || l.contains(" Passed | ")
                || l.starts_with("SUCCESS!")
                || l.starts_with("FAIL!")
        })
        .collect()
}

/// Prints past libtest's output capture (a direct write to the stderr handle), so `make test`
/// shows csi-sanity's summary even when the test passes.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Why specs were skipped: each `[SKIPPED] <reason>` line of ginkgo's report, with a count.
fn skip_reasons(output: &str) -> Vec<(String, usize)> {
    let mut reasons: Vec<(String, usize)> = Vec::new();
    for l in output.lines() {
        let Some(reason) = l.trim().strip_prefix("[SKIPPED] ") else {
            continue;
        };
        if reason.starts_with("in [") {
            continue;
        }
        match reasons.iter_mut().find(|(r, _)| r == reason) {
            Some((_, n)) => *n += 1,
            None => reasons.push((reason.to_string(), 1)),
        }
    }
    reasons
}

async fn run(access_type: &str) {
    assert_root();
    let bed = bed_with_vm().await;
    // A small attach limit lets csi-sanity's max-attach test run with a few loop devices.
    let driver = Driver::start(&bed, |c| c.max_volumes_per_node = Some(ATTACH_LIMIT)).await;
    let work = bed.dir.path().join(format!("sanity-{access_type}"));
    std::fs::create_dir_all(&work).expect("work dir");
    let sweeper = MountSweeper(work.clone());
    let (ok, output) = csi_sanity(&driver.socket, &work, access_type).await;
    let log = std::env::temp_dir().join(format!("csi-sanity-{access_type}.log"));
    let _ = std::fs::write(&log, &output);
    report(&format!(
        "csi-sanity --csi.testvolumeaccesstype={access_type} (full log: {})",
        log.display()
    ));
    for line in summary(&output) {
        report(&format!("  [{access_type}] {line}"));
    }
    let left = sweeper.sweep();
    driver.stop().await;
    if !ok || !summary(&output).iter().any(|l| l.contains(" 0 Failed ")) {
        let tail: Vec<&str> = output.lines().rev().take(150).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!(
            "csi-sanity ({access_type}) failed; summary {:?}\n{}",
            summary(&output),
            tail.join("\n")
        );
    }
    for (reason, n) in skip_reasons(&output) {
        report(&format!("  [{access_type}] skipped {n}x: {reason}"));
    }
    assert!(left.is_empty(), "csi-sanity left mounts behind: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_sanity_passes_with_mount_volumes_root() {
    run("mount").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn csi_sanity_passes_with_block_volumes_root() {
    run("block").await;
}
