//! Processes a component started that are not the bed's children and so outlive it: found by
//! their name and command line in `/proc`, killed with their process group, waited for.
//!
//! containerd's shims are the case: `containerd-shim-runc-v2 start` re-executes itself with
//! `-namespace <ns> -id <id> -address <containerd's socket>` in a process group of its own
//! (`Setpgid`) and exits, so the shim is reparented away from containerd and neither
//! `PR_SET_PDEATHSIG` nor killing containerd reaches it (containerd v1.6.20
//! `runtime/v2/runc/manager/manager_linux.go` `newCommand`, `Start`).

use std::path::Path;
use std::time::{Duration, Instant};

/// Does a command line (`/proc/<pid>/cmdline`: arguments separated by NUL bytes) hold `args`
/// as consecutive arguments?
pub fn cmdline_holds(cmdline: &[u8], args: &[&str]) -> bool {
    let argv: Vec<&[u8]> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .collect();
    !args.is_empty()
        && argv
            .windows(args.len())
            .any(|w| w.iter().zip(args).all(|(a, b)| *a == b.as_bytes()))
}

/// Pids of the live processes whose name (`/proc/<pid>/comm`, the kernel's first 15 bytes of the
/// program's file name) starts with `comm` and whose command line holds `args` in a row.
pub fn find(comm: &str, args: &[&str]) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let dir = Path::new("/proc").join(pid.to_string());
            let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            name.trim_end().starts_with(comm)
                && alive(*pid)
                && std::fs::read(dir.join("cmdline")).is_ok_and(|c| cmdline_holds(&c, args))
        })
        .collect()
}

/// A process that exists and is not a zombie (a killed process whose parent has not reaped
/// it yet is gone for our purposes).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // `pid (comm) S ...`: the state follows the last `)` (comm may hold one).
            let state = s.get(s.rfind(')')? + 1..)?.split_whitespace().next()?;
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// SIGKILLs each process and its process group, then waits up to `bound` for all of them to be
/// gone; returns the pids still alive after it.
pub fn kill(pids: &[i32], bound: Duration) -> Vec<i32> {
    use rustix::process::{Pid, Signal, kill_process, kill_process_group};
    for pid in pids.iter().filter_map(|p| Pid::from_raw(*p)) {
        // The group first (the shim's own, holding whatever it started), then the process in
        // case it left the group.
        let _ = kill_process_group(pid, Signal::KILL);
        let _ = kill_process(pid, Signal::KILL);
    }
    wait_gone(pids, bound)
}

/// Waits up to `bound` for every pid to be gone; returns those still alive.
pub fn wait_gone(pids: &[i32], bound: Duration) -> Vec<i32> {
    let deadline = Instant::now() + bound;
    loop {
        let left: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_are_matched_on_consecutive_arguments() {
        let shim = b"/usr/bin/containerd-shim-runc-v2\0-namespace\0k8s.io\0-id\0abc\0-address\0/t/n/containerd.sock\0";
        assert!(cmdline_holds(shim, &["-address", "/t/n/containerd.sock"]));
        assert!(!cmdline_holds(
            shim,
            &["-address", "/t/other/containerd.sock"]
        ));
        assert!(
            !cmdline_holds(shim, &["-address", "/t/n/containerd"]),
            "whole arguments only"
        );
        assert!(
            !cmdline_holds(shim, &["k8s.io", "-address"]),
            "consecutive only"
        );
        assert!(!cmdline_holds(shim, &[]));
        assert!(!cmdline_holds(b"", &["-address"]));
    }

    /// A stand-in shim (a script named like one, in a process group of its own with a child)
    /// is found by its `-address` and killed with its group; another address is left alone.
    #[test]
    fn a_stray_is_found_by_its_address_and_killed_with_its_group() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("containerd-shim-runc-v2");
        std::fs::write(&script, "#!/bin/sh\nsleep 600 &\nwait\n").expect("script");
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let ours = dir.path().join("containerd.sock").display().to_string();
        let theirs = dir.path().join("other.sock").display().to_string();
        let start = |address: &str| {
            std::process::Command::new(&script)
                .args(["-namespace", "k8s.io", "-address", address])
                .process_group(0)
                .spawn()
                .expect("stand-in shim")
        };
        let (mut a, mut b) = (start(&ours), start(&theirs));
        let found = |address: &str| find("containerd-shim", &["-address", address]);
        let children = |pid: i32| -> Vec<i32> {
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        // The shell's child carries the shell's command line from its fork until it execs
        // `sleep`, so for a moment it is found too; before the fork, the stand-in is found alone
        // but has no child yet. Wait for the child to exist and to have exec'd.
        let a_pid = a.id() as i32;
        while !(children(a_pid).len() == 1 && found(&ours) == vec![a_pid])
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let pids = found(&ours);
        assert_eq!(pids, vec![a_pid], "only the shim of our address");
        let sleep = children(a_pid);
        assert_eq!(sleep.len(), 1, "the stand-in's child");
        assert!(kill(&pids, Duration::from_secs(10)).is_empty(), "killed");
        assert!(found(&ours).is_empty());
        assert!(
            wait_gone(&sleep, Duration::from_secs(10)).is_empty(),
            "its process group too"
        );
        while found(&theirs) != vec![b.id() as i32] && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(
            found(&theirs),
            vec![b.id() as i32],
            "the other one is left alone"
        );
        let _ = a.wait();
        let _ = b.kill();
        let _ = b.wait();
    }
}
