//! A program's main loop run as a task on the current Tokio runtime (tests, the demo, the bench,
//! embedding), with one way to stop it and read how it ended. The provider and the CSI driver
//! both hand out this handle from their `spawn`.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::oneshot;
use tokio::task::{JoinError, JoinHandle};

/// Resolves when [`Running::stop`] is called or the handle is dropped with [`OnDrop::Stop`]:
/// the shutdown future a program's run loop takes.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What dropping the handle does to the task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDrop {
    /// Cancel the task at its next await (nothing of the program's own shutdown runs).
    Abort,
    /// Send the stop signal and let the program shut down on its own (e.g. remove its socket).
    Stop,
}

/// A running program; `E` is its error, which also carries a task that panicked or was
/// cancelled (`From<JoinError>`).
pub struct Running<E> {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), E>>,
    on_drop: OnDrop,
}

impl<E: From<JoinError> + Send + 'static> Running<E> {
    /// Spawns `run(stop_signal)` as a task.
    pub fn spawn<F>(run: impl FnOnce(StopSignal) -> F, on_drop: OnDrop) -> Running<E>
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(Box::pin(async move {
            let _ = stopped.await;
        })));
        Running {
            stop: Some(stop),
            task,
            on_drop,
        }
    }

    /// Whether the task has ended (a start-up failure ends it at once).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Sends the stop signal and waits for the program to end.
    pub async fn stop(mut self) -> Result<(), E> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.join().await
    }

    /// Waits for the program to end without asking it to (how a start-up failure is read).
    pub async fn join(mut self) -> Result<(), E> {
        match (&mut self.task).await {
            Ok(result) => result,
            Err(e) => Err(E::from(e)),
        }
    }
}

impl<E> Drop for Running<E> {
    fn drop(&mut self) {
        match self.on_drop {
            OnDrop::Abort => self.task.abort(),
            OnDrop::Stop => {
                if let Some(stop) = self.stop.take() {
                    let _ = stop.send(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    enum E {
        Task(String),
        Failed,
    }

    impl From<JoinError> for E {
        fn from(e: JoinError) -> Self {
            E::Task(e.to_string())
        }
    }

    #[tokio::test]
    async fn stop_sends_the_signal_and_returns_the_programs_result() {
        let running = Running::<E>::spawn(
            |stopped| async move {
                stopped.await;
                Err(E::Failed)
            },
            OnDrop::Abort,
        );
        assert!(!running.is_finished());
        assert_eq!(running.stop().await, Err(E::Failed));
    }

    #[tokio::test]
    async fn a_panic_is_the_task_error() {
        let running = Running::<E>::spawn(|_| async { panic!("boom") }, OnDrop::Abort);
        assert!(matches!(running.join().await, Err(E::Task(m)) if m.contains("panicked")));
    }

    #[tokio::test]
    async fn drop_with_stop_lets_the_program_finish_its_shutdown() {
        let (done, finished) = oneshot::channel();
        let running = Running::<E>::spawn(
            |stopped| async move {
                stopped.await;
                let _ = done.send("cleaned up");
                Ok(())
            },
            OnDrop::Stop,
        );
        drop(running);
        assert_eq!(finished.await, Ok("cleaned up"));
    }

    #[tokio::test]
    async fn drop_with_abort_cancels_the_program() {
        let (done, finished) = oneshot::channel::<()>();
        let running = Running::<E>::spawn(
            |stopped| async move {
                stopped.await;
                let _ = done.send(());
                Ok(())
            },
            OnDrop::Abort,
        );
        drop(running);
        assert!(finished.await.is_err(), "aborted: the shutdown never ran");
    }
}
