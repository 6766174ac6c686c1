//! Leader election on a `coordination.k8s.io` Lease.
//!
//! Every replica runs its watches; the leader alone writes. [`elect`] returns a [`Leader`] that
//! says whether this replica may write now. When the leader stops (or stops renewing), another
//! replica takes the lease once it expires: at most `duration` seconds.
//!
//! kube-lease-manager renews the lease and says when it holds it, but keeps saying so while its
//! renewals fail, until a later read shows another holder: a paused or partitioned leader would
//! go on writing after another replica took over. So the holder also reads its Lease back every
//! [`meshgate_core::leader::read_interval`], and [`Leader::is_leader`] turns false on the local
//! deadline [`meshgate_core::leader::time_left`] computes from the last renewal read back, a
//! margin before the others can see the lease expire. The check compares the monotonic clock
//! at the moment of each write decision, so a process resumed after a pause is not the leader
//! even before any of its tasks has run.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
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

/// What this replica may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Term {
    Follower,
    /// The leader until this instant (the local renew deadline).
    Until(Instant),
    /// The leader for good (a single replica, or set by hand).
    Always,
}

impl Term {
    fn leads(self) -> bool {
        !matches!(self, Term::Follower)
    }
}

/// Whether this replica leads. Clones share the state; [`Leader::changed`] wakes on each gain
/// or loss of leadership (not on each renewal).
#[derive(Clone, Debug)]
pub struct Leader {
    rx: watch::Receiver<Term>,
}

impl Leader {
    /// True while this replica holds the lease and its deadline has not passed: ask right
    /// before each write.
    pub fn is_leader(&self) -> bool {
        leads_now(*self.rx.borrow())
    }

    /// [`Leader::is_leader`], marking the current state as seen by [`Leader::changed`].
    pub fn update(&mut self) -> bool {
        leads_now(*self.rx.borrow_and_update())
    }

    /// Resolves on the next gain or loss of leadership; an error once the election ended.
    pub async fn changed(&mut self) -> Result<(), watch::error::RecvError> {
        self.rx.changed().await
    }

    /// One item each time this replica becomes the leader (the first at once if it leads).
    pub fn gains(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        use futures::StreamExt;
        tokio_stream::wrappers::WatchStream::new(self.rx.clone())
            .filter_map(|term| futures::future::ready(leads_now(term).then_some(())))
    }
}

fn leads_now(term: Term) -> bool {
    match term {
        Term::Follower => false,
        Term::Until(deadline) => Instant::now() < deadline,
        Term::Always => true,
    }
}

/// Leadership set by hand: [`manual`].
#[derive(Debug)]
pub struct Manual(watch::Sender<Term>);

impl Manual {
    /// Makes the replica the leader (for good) or a follower.
    pub fn set(&self, leads: bool) {
        self.0
            .send_replace(if leads { Term::Always } else { Term::Follower });
    }
}

/// A [`Leader`] driven by hand (tests, benches).
pub fn manual(leads: bool) -> (Manual, Leader) {
    let (tx, rx) = watch::channel(if leads { Term::Always } else { Term::Follower });
    (Manual(tx), Leader { rx })
}

/// Always the leader (a single replica without election).
pub fn always() -> Leader {
    let (tx, leader) = manual(true);
    // Keep the sender alive for the life of the process.
    std::mem::forget(tx);
    leader
}

/// Competes for the lease in the background. The lease is renewed while any clone of the
/// returned [`Leader`] lives; the tasks end when all are dropped.
pub async fn elect(
    client: kube::Client,
    s: LeaseSettings,
) -> Result<Leader, kube_lease_manager::LeaseManagerError> {
    let manager = LeaseManagerBuilder::new(client.clone(), &s.name)
        .with_namespace(&s.namespace)
        .with_parameters(
            LeaseParams::new(&s.identity, s.duration, s.grace)
                .with_field_manager(format!("meshgate-{}", s.identity)),
        )
        .build()
        .await?;
    let (held, _task) = manager.watch().await;
    let (tx, rx) = watch::channel(Term::Follower);
    let leases: Api<Lease> = Api::namespaced(client, &s.namespace);
    tokio::spawn(follow(leases, s, held, tx));
    Ok(Leader { rx })
}

/// Keeps `tx` at [`Term::Until`] the local deadline of the last renewal read back while
/// kube-lease-manager says it holds the lease (`held`), [`Term::Follower`] otherwise.
async fn follow(
    leases: Api<Lease>,
    s: LeaseSettings,
    mut held: watch::Receiver<bool>,
    tx: watch::Sender<Term>,
) {
    let duration = Duration::from_secs(s.duration);
    let grace = Duration::from_secs(s.grace);
    let every = meshgate_core::leader::read_interval(grace);
    // Sets the term; wakes the receivers only when leadership is gained or lost.
    let set = |term: Term| {
        tx.send_if_modified(|t| {
            let changed = t.leads() != term.leads();
            *t = term;
            changed
        })
    };
    loop {
        if *held.borrow_and_update() {
            let read_at = Instant::now();
            let wall = SystemTime::now();
            match leases.get_opt(&s.name).await {
                Ok(lease) => {
                    let spec = lease.and_then(|l| l.spec).unwrap_or_default();
                    let left = (spec.holder_identity.as_deref() == Some(s.identity.as_str()))
                        .then_some(spec.renew_time)
                        .flatten()
                        .and_then(|renewed| {
                            meshgate_core::leader::time_left(
                                duration,
                                grace,
                                renewed.0.into(),
                                wall,
                            )
                        });
                    if set(left.map_or(Term::Follower, |l| Term::Until(read_at + l))) {
                        if left.is_some() {
                            tracing::info!(lease = %s.name, leader = true, "leadership changed");
                        } else {
                            // The same report whichever of the read and the deadline saw it
                            // first (a process resumed after a pause sees both at once).
                            tracing::warn!(
                                lease = %s.name,
                                leader = false,
                                "stepping down: the lease read back names another holder or \
                                 has expired; no writes until it holds the lease again"
                            );
                        }
                    }
                }
                // The deadline decides: a renewal not read back in time ends the term.
                Err(e) => {
                    tracing::debug!(lease = %s.name, error = %e, "reading the lease back failed")
                }
            }
        } else if set(Term::Follower) {
            tracing::info!(lease = %s.name, "leadership lost: another replica holds the lease");
        }
        let deadline = match *tx.borrow() {
            Term::Until(deadline) => Some(deadline),
            _ => None,
        };
        let reading = *held.borrow();
        tokio::select! {
            // The deadline first: a process resumed after a pause finds every branch ready.
            biased;
            () = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now).into()), if deadline.is_some() => {
                set(Term::Follower);
                tracing::warn!(
                    lease = %s.name,
                    "stepping down: the lease's renewal was not read back before the local \
                     deadline (renewals failing, or this process was paused); no writes until \
                     it holds the lease again"
                );
            }
            () = tx.closed() => return,
            changed = held.changed() => {
                if changed.is_err() {
                    set(Term::Follower);
                    return;
                }
            }
            () = tokio::time::sleep(every), if reading => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_term_ends_at_its_deadline_without_any_task_running() {
        let (tx, rx) = watch::channel(Term::Until(Instant::now() + Duration::from_secs(60)));
        let leader = Leader { rx };
        assert!(leader.is_leader());
        // A deadline in the past (a process resumed after a pause): not the leader, although
        // nothing has changed the channel.
        tx.send_replace(Term::Until(Instant::now() - Duration::from_millis(1)));
        assert!(!leader.is_leader());
    }

    #[test]
    fn manual_leadership() {
        let (lead, mut leader) = manual(false);
        assert!(!leader.update());
        lead.set(true);
        assert!(leader.is_leader());
        assert!(always().is_leader());
    }
}
