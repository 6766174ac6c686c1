//! meshgate's controllers.
//!
//! * [`nodegate`]: keeps each node's startup taint and gate resource in line with its mesh
//!   agents' readiness (rules in `meshgate_core::nodegate`).
//! * [`agents`]: the index of agent pods and DaemonSets by node that the node gate reads.
//! * [`leader`]: leader election on a Lease; every replica keeps warm caches, only the leader
//!   writes.
//! * [`registration`]: the policies webhook's rules follow the kinds the MutationPolicies name.
//! * [`native_gate`]: the native gate's routing (namespaces with LimitRanges to the webhook).
//! * [`run`]: the controller process (all of the above, leader election, health and metrics),
//!   as the webhook crate's `Server` is the webhook's.
//!
//! The controllers are thin: they watch, call the pure decisions of `meshgate-core`, and write
//! the result with optimistic locking.

// A shell's functions stay short (clippy.toml: too-many-lines-threshold).
#![deny(clippy::too_many_lines)]

pub mod agents;
pub mod certs;
pub mod conditions;
pub mod crds;
pub mod discovery;
pub mod dra;
pub mod drain;
pub mod events;
pub mod leader;
pub mod metrics;
pub mod native_gate;
pub mod nodegate;
pub mod policies;
pub mod registration;
pub mod repair;
pub mod run;

pub use metrics::Metrics;

/// Seconds since the Unix epoch.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Seconds since the Unix epoch, with fractions.
pub fn now_precise() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
