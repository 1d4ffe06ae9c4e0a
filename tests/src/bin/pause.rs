//! `pause`: the sandbox process of every Pod on the bed's real node (the local pause image,
//! `testbed::real::node::SANDBOX_IMAGE`). It holds the Pod's namespaces open and does nothing else:
//! waits forever, reaps any child that is re-parented to it (SIGCHLD) and exits 0 on SIGTERM or
//! SIGINT, like kubernetes' `build/pause/linux/pause.c`. It runs as PID 1 of its PID namespace,
//! where a signal without a handler does nothing, so the handlers are what make it stoppable.

use std::process::ExitCode;

use rustix::process::{WaitOptions, wait};
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let handlers = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::child()),
    );
    let (mut term, mut int, mut child) = match handlers {
        (Ok(t), Ok(i), Ok(c)) => (t, i, c),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            eprintln!("pause: installing the signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = child.recv() => reap(),
        }
    }
    eprintln!("pause: shutting down, got signal");
    ExitCode::SUCCESS
}

/// Collects every child that has exited (several SIGCHLDs may arrive as one).
fn reap() {
    while let Ok(Some(_)) = wait(WaitOptions::NOHANG) {}
}
