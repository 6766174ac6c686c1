//! Stopping a controller in bounded time.
//!
//! kube-runtime's `graceful_shutdown_on` stops new triggers and waits for the reconciles in
//! flight, but its applier keeps the work it has queued (a requeue after an error, every 5 s
//! for a policy that keeps failing): a controller could then never end, and the process would
//! outlive its SIGTERM until the kubelet kills it (seen in the `helm` test, where the
//! controller task never finished). [`until_drained`] gives the work [`GRACE`] after the
//! shutdown, then drops it.

use std::time::Duration;

/// How long in-flight and queued work may go on once shutdown is asked for.
pub const GRACE: Duration = Duration::from_secs(10);

/// Runs `work` until it ends, or until [`GRACE`] after `shutdown` resolves.
pub async fn until_drained(work: impl Future<Output = ()>, shutdown: impl Future<Output = ()>) {
    tokio::select! {
        () = work => {}
        () = async {
            shutdown.await;
            tokio::time::sleep(GRACE).await;
        } => {
            tracing::info!(grace = ?GRACE, "stopped with work still queued after the shutdown grace");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn work_that_never_ends_is_dropped_after_the_grace() {
        let started = tokio::time::Instant::now();
        until_drained(futures::future::pending::<()>(), async {}).await;
        assert_eq!(started.elapsed(), GRACE);
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_ends_is_not_waited_for() {
        let started = tokio::time::Instant::now();
        until_drained(async {}, futures::future::pending::<()>()).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
