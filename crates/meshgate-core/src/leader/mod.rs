//! Leadership on a `coordination.k8s.io` Lease: until when the holder may act as the leader on
//! its own knowledge, without waiting to hear that another replica took the lease.
//!
//! Another replica takes the lease once its `renewTime` plus `leaseDurationSeconds` has passed
//! by its own wall clock. The holder wrote `renewTime` with its wall clock, so it can tell, from
//! the last renewal it has read back, when the others will see the lease expire, and stop a
//! margin before that: a paused process, or one whose renewals fail, stops writing before
//! another can start (client-go's leader election does the same with its renew deadline).
//!
//! The holder reads its Lease every [`read_interval`]; with the margin and the read interval
//! both a third of the grace (the time before expiry at which the holder renews), a renewal is
//! read back with a third of the grace to spare before the deadline.

use std::time::{Duration, SystemTime};

/// The least time between two reads of the Lease.
const MIN_READ_INTERVAL: Duration = Duration::from_millis(100);

/// How often the holder reads its Lease back: a third of `grace`.
pub fn read_interval(grace: Duration) -> Duration {
    (grace / 3).max(MIN_READ_INTERVAL)
}

/// How long before the lease expires the holder stops: a third of `grace`.
pub fn margin(grace: Duration) -> Duration {
    grace / 3
}

/// How long after `read_at` the holder may still act, given the `renewed` time it last wrote
/// and read back (`read_at` is its wall clock when it sent the read): until `renewed +
/// duration - margin(grace)`. `None` when that has passed. A renewal that looks later than
/// `read_at` (the wall clock stepped back since) counts as made at `read_at`.
pub fn time_left(
    duration: Duration,
    grace: Duration,
    renewed: SystemTime,
    read_at: SystemTime,
) -> Option<Duration> {
    let age = read_at.duration_since(renewed).unwrap_or(Duration::ZERO);
    duration
        .saturating_sub(margin(grace))
        .checked_sub(age)
        .filter(|left| !left.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(15);
    const G: Duration = Duration::from_secs(5);

    fn at(secs: f64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs_f64(1_000_000.0 + secs)
    }

    #[test]
    fn the_holder_stops_a_margin_before_expiry() {
        // Renewed at 0, read at 1: expiry at 15, stop at 15 - 5/3.
        let left = time_left(D, G, at(0.0), at(1.0)).expect("still leading");
        assert_eq!(left, D - margin(G) - Duration::from_secs(1));
        // 15 s - 1.667 s = 13.333 s.
        assert!(time_left(D, G, at(0.0), at(13.3)).is_some());
        assert_eq!(time_left(D, G, at(0.0), at(13.4)), None);
        assert_eq!(time_left(D, G, at(0.0), at(60.0)), None);
    }

    #[test]
    fn a_renewal_from_the_future_counts_from_the_read() {
        assert_eq!(time_left(D, G, at(5.0), at(1.0)), Some(D - margin(G)));
    }

    #[test]
    fn a_renewal_is_read_back_before_the_deadline() {
        // The holder renews `grace` before expiry and reads every read_interval: the renewal
        // made at duration - grace is read by duration - grace + read_interval, a third of the
        // grace before the deadline (duration - margin).
        for (d, g) in [(15, 5), (3, 1), (60, 20)] {
            let (d, g) = (Duration::from_secs(d), Duration::from_secs(g));
            let read_by = d - g + read_interval(g);
            let deadline = d - margin(g);
            assert!(deadline > read_by, "{d:?}/{g:?}");
            assert!(deadline - read_by >= g / 3 - Duration::from_millis(1));
        }
    }

    #[test]
    fn the_read_interval_has_a_floor() {
        assert_eq!(read_interval(Duration::from_millis(30)), MIN_READ_INTERVAL);
    }
}
