//! Leader election on a `coordination.k8s.io` Lease.
//!
//! Every replica runs its watches; the leader alone writes. [`elect`] returns a channel that is
//! `true` while this replica holds the lease. When the leader stops (or stops renewing), another
//! replica takes the lease once it expires: at most `duration` seconds.

use kube_lease_manager::{LeaseManagerBuilder, LeaseParams};
use tokio::sync::watch;

/// Lease settings.
#[derive(Clone, Debug)]
pub struct LeaseSettings {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (the pod name in a cluster).
    pub identity: String,
    /// Seconds a lease is valid after its last renewal.
    pub duration: u64,
    /// Seconds before expiry at which the holder renews.
    pub grace: u64,
}

/// Competes for the lease in the background. The lease is renewed while any clone of the
/// returned receiver lives; the task ends when all are dropped.
pub async fn elect(
    client: kube::Client,
    s: LeaseSettings,
) -> Result<watch::Receiver<bool>, kube_lease_manager::LeaseManagerError> {
    let manager = LeaseManagerBuilder::new(client, &s.name)
        .with_namespace(&s.namespace)
        .with_parameters(
            LeaseParams::new(&s.identity, s.duration, s.grace)
                .with_field_manager(format!("meshgate-{}", s.identity)),
        )
        .build()
        .await?;
    let (rx, _task) = manager.watch().await;
    Ok(rx)
}

/// A channel that always says "leader" (a single replica without election).
pub fn always() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(true);
    // Keep the sender alive for the life of the process.
    std::mem::forget(tx);
    rx
}
