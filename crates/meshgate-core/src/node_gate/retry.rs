//! How work that keeps failing (a node's reconcile, asking whether DRA is served) is retried:
//! with capped exponential backoff, and one warning per streak of failures, not one per try. A
//! stale refusal (a conditional write refused because the node changed since it was read) is
//! retried sooner and warned about only when it persists.

use std::time::Duration;

/// The first retry's delay.
pub const FIRST: Duration = Duration::from_millis(500);
/// The longest delay between two tries.
pub const MAX: Duration = Duration::from_secs(60);

/// `first`, doubled for each failure after the first, at most [`MAX`].
fn doubled(first: Duration, failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    first.saturating_mul(1 << doublings).min(MAX)
}

/// Why a node's reconcile failed, as far as retrying it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A write conditional on what was read was refused because the node changed since (another
    /// writer, or meshgate's own node-condition write): expected wherever several controllers
    /// write a node, and retried soon from the newer copy the watch brings.
    Stale,
    /// Anything else: the API server unreachable or refusing, a patch that cannot be built.
    Other,
}

/// The first retry's delay after a stale refusal: the watch brings the newer node within
/// milliseconds.
pub const STALE_FIRST: Duration = Duration::from_millis(50);
/// Stale refusals in a row before one is warned about: a cache that stays behind the API server
/// this long (or a write that can never apply) is worth a line.
pub const STALE_WARN_AFTER: u32 = 5;

/// A node's failures in a row, and whether this streak has been warned about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streak {
    pub failures: u32,
    pub warned: bool,
}

impl Streak {
    /// Counts a failure of `kind`: the delay before the next try (doubling from 500 ms, or from
    /// 50 ms for a stale refusal, at most 60 s), and whether to log it as a warning: once a
    /// streak, at its first failure that is not a stale refusal or at its
    /// [`STALE_WARN_AFTER`]th failure, whichever comes first.
    pub fn fail(&mut self, kind: Failure) -> (Duration, bool) {
        self.failures = self.failures.saturating_add(1);
        let first = match kind {
            Failure::Stale => STALE_FIRST,
            Failure::Other => FIRST,
        };
        let delay = doubled(first, self.failures);
        let warn = !self.warned && (kind == Failure::Other || self.failures >= STALE_WARN_AFTER);
        self.warned |= warn;
        (delay, warn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` failures of `kind` in a row: each one's delay in ms and whether it warned.
    fn tries(s: &mut Streak, kind: Failure, n: usize) -> Vec<(u64, bool)> {
        (0..n)
            .map(|_| {
                let (d, w) = s.fail(kind);
                (d.as_millis() as u64, w)
            })
            .collect()
    }

    #[test]
    fn backoff_doubles_up_to_a_minute_and_warns_once_a_streak() {
        let mut s = Streak::default();
        assert_eq!(
            tries(&mut s, Failure::Other, 9),
            [
                (500, true),
                (1000, false),
                (2000, false),
                (4000, false),
                (8000, false),
                (16000, false),
                (32000, false),
                (60000, false),
                (60000, false)
            ]
        );
        assert!(!(0..100).any(|_| s.fail(Failure::Other).1));
        let mut long = Streak {
            failures: u32::MAX - 1,
            warned: true,
        };
        assert_eq!(long.fail(Failure::Other).0, MAX);
        assert_eq!(long.fail(Failure::Other).0, MAX, "the count saturates");
    }

    #[test]
    fn stale_refusals_retry_soon_and_warn_only_when_they_persist() {
        assert_eq!(
            tries(&mut Streak::default(), Failure::Stale, 6),
            [
                (50, false),
                (100, false),
                (200, false),
                (400, false),
                (800, true),
                (1600, false)
            ]
        );
    }

    #[test]
    fn a_streak_warns_once_at_its_first_other_failure() {
        let mut s = Streak::default();
        assert!(!s.fail(Failure::Stale).1);
        let (delay, warn) = s.fail(Failure::Other);
        assert!(warn, "the first failure that is not a stale refusal");
        assert_eq!(delay, Duration::from_secs(1));
        assert!(!s.fail(Failure::Other).1);
        assert!(!(0..10).any(|_| s.fail(Failure::Stale).1));
        assert!(Streak::default().fail(Failure::Other).1);
    }
}
