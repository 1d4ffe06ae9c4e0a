//! Waiting for a condition with a bound; on timeout the error shows what was seen last.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `probe` every 100 ms until it returns `Ok(Some(v))`, for at most `limit`.
/// `probe` returns `Ok(None)` to keep waiting; the last `Err` or seen value is reported on timeout.
pub async fn until<T, S, F, Fut>(what: &str, limit: Duration, mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Result<T, S>, String>>,
    S: Debug,
{
    let deadline = Instant::now() + limit;
    loop {
        let last = match probe().await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(seen)) => format!("{seen:?}"),
            Err(e) => format!("error: {e}"),
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "timed out after {limit:?} waiting for {what}; last seen: {last}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
