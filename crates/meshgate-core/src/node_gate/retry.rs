//! How a node whose reconcile keeps failing is retried: with capped exponential backoff, and
//! one warning per streak of failures (the first), not one per try.

use std::time::Duration;

/// The first retry's delay.
pub const FIRST: Duration = Duration::from_millis(500);
/// The longest delay between two tries.
pub const MAX: Duration = Duration::from_secs(60);

/// How long to wait before the next try after `failures` failures in a row (1 for the first):
/// 500 ms, doubling, at most 60 s.
pub fn retry_after(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FIRST.saturating_mul(1 << doublings).min(MAX)
}

/// Whether the failure that makes `failures` in a row is logged as a warning: only the first
/// of a streak (the others are counted, and logged at debug level).
pub fn warn_on(failures: u32) -> bool {
    failures == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_a_minute() {
        let delays: Vec<u64> = (1..=9).map(|n| retry_after(n).as_millis() as u64).collect();
        assert_eq!(
            delays,
            [500, 1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000]
        );
        assert_eq!(retry_after(u32::MAX), MAX);
        assert_eq!(retry_after(0), FIRST);
    }

    #[test]
    fn one_warning_per_streak() {
        assert!(warn_on(1));
        assert!(!(2..100).any(warn_on));
    }
}
