//! A held [`Lease`] renewed by a task of its own, so that no work its holder does — a
//! partition's hand-over flush, a snapshot upload or download, a router's publish — can
//! delay a renewal past the lease's deadline.
//!
//! Before this, the partition ownership task and each router renewed their leases between
//! their other steps. A step that took longer than two thirds of the TTL (a drain handing
//! several partitions over one after the other on a loaded host, a large snapshot) let the
//! other leases it held lapse: those partitions stopped without a flush and their heirs had
//! to replay inputs. Renewal now never waits for anything but the bucket.
//!
//! **Guarantees.**
//! - **Renewed on time.** The keeper renews every [`Lease::renew_every`] after the last
//!   success and retries a failed renewal after a quarter of that, whatever its holder is
//!   doing.
//! - **One view of the deadline.** [`Kept::valid_until`] is the deadline of the last
//!   successful write as [`Lease`] computes it (monotonic clock, TTL − margin); the keeper
//!   only ever publishes what the lease says, so keeping a lease never extends trust
//!   beyond what the bucket granted. Once the lease is lost the keeper stops and the
//!   deadline stays in the past.
//! - **Released once, by its holder.** [`Kept::release`] (or [`Kept::hand_over`]) stops the
//!   keeper (waiting for a renewal in flight, so the release compares against the newest
//!   revision) and deletes the key (or writes the hand-over). Dropping a `Kept` stops the
//!   keeper without releasing: the key then ages out after one TTL.
//!
//! - **Failures logged once per episode, per process.** A broker outage fails the renewal of
//!   every lease a process holds (one per partition and router) at once. The first failure
//!   logs one warning, the others and the retries log at debug, and one line says when no
//!   lease of the process is failing any more ([`Episode`]), with how many leases failed
//!   and how many attempts.
//!
//! Fencing stays the safety net (see [`super::lease`]): a holder paused past its deadline
//! can still write nothing a newer holder's fence refuses.

use std::time::{Duration, Instant};

use prometheus::IntCounter;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::lease::{Lease, LeaseError};

/// A lease whose renewals run on their own task.
pub struct Kept {
    key: String,
    epoch: u64,
    handed_over_at: Option<u64>,
    ttl: Duration,
    deadline: watch::Receiver<Instant>,
    stop: CancellationToken,
    task: Option<JoinHandle<Lease>>,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept")
            .field("key", &self.key)
            .field("epoch", &self.epoch)
            .field("valid_until", &self.valid_until())
            .finish()
    }
}

impl Kept {
    /// Starts renewing `lease` (just acquired: its deadline is fresh); `renewed`, when
    /// given, counts each successful renewal.
    pub fn keep(lease: Lease, renewed: Option<IntCounter>) -> Self {
        let (tx, deadline) = watch::channel(lease.valid_until());
        let stop = CancellationToken::new();
        let key = lease.key().to_string();
        let epoch = lease.epoch();
        let handed_over_at = lease.handed_over_at();
        let ttl = lease.ttl();
        let task = tokio::spawn(renew(lease, tx, stop.clone(), renewed));
        Self {
            key,
            epoch,
            handed_over_at,
            ttl,
            deadline,
            stop,
            task: Some(task),
        }
    }

    /// The lease's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The snapshot checkpoint the previous holder handed over with ([`Lease::handed_over_at`]).
    pub fn handed_over_at(&self) -> Option<u64> {
        self.handed_over_at
    }

    /// The lease's TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The deadline of the last successful write (see [`Lease::valid_until`]).
    pub fn valid_until(&self) -> Instant {
        *self.deadline.borrow()
    }

    /// Whether the deadline is still ahead.
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until()
    }

    /// Resolves once the deadline has passed (a renewal that moves it meanwhile moves the
    /// wait with it).
    pub async fn expired(&self) {
        let mut deadline = self.deadline.clone();
        loop {
            let until = *deadline.borrow_and_update();
            if Instant::now() >= until {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(until.into()) => {}
                changed = deadline.changed() => {
                    if changed.is_err() {
                        // The keeper ended (lost): the deadline no longer moves.
                        let last = *deadline.borrow();
                        tokio::time::sleep_until(last.into()).await;
                        return;
                    }
                }
            }
        }
    }

    /// Stops renewing and gives the key up ([`Lease::release`]).
    pub async fn release(self) -> Result<(), LeaseError> {
        match self.stopped().await? {
            Some(lease) => lease.release().await,
            None => Ok(()),
        }
    }

    /// Stops renewing and hands the key over with the snapshot at `checkpoint`
    /// ([`Lease::hand_over`]).
    pub async fn hand_over(self, checkpoint: u64) -> Result<(), LeaseError> {
        match self.stopped().await? {
            Some(lease) => lease.hand_over(checkpoint).await,
            None => Ok(()),
        }
    }

    /// Stops the keeper, waiting for a renewal in flight; the lease back.
    async fn stopped(mut self) -> Result<Option<Lease>, LeaseError> {
        self.stop.cancel();
        let Some(task) = self.task.take() else {
            return Ok(None);
        };
        task.await.map(Some).map_err(|e| LeaseError::Kv {
            key: self.key.clone(),
            op: "renewal task",
            reason: e.to_string(),
        })
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The keeper: renews until `stop` fires or the lease is lost; hands the lease back.
async fn renew(
    mut lease: Lease,
    deadline: watch::Sender<Instant>,
    stop: CancellationToken,
    renewed: Option<IntCounter>,
) -> Lease {
    let every = lease.renew_every();
    let mut next = Instant::now() + every;
    // While this lease's renewals fail it is part of the process's failing episode
    // (logged once for every lease, see `Episode`); dropping the guard leaves it.
    let mut failing: Option<Episode> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return lease,
            _ = tokio::time::sleep_until(next.into()) => {}
        }
        match lease.renew().await {
            Ok(()) => {
                next = Instant::now() + every;
                failing = None;
                if let Some(c) = &renewed {
                    c.inc();
                }
            }
            Err(e @ LeaseError::Lost { .. }) => {
                deadline.send_replace(lease.valid_until());
                tracing::warn!(message = "Lease lost.", key = %lease.key(), epoch = lease.epoch(), error = %e);
                stop.cancelled().await;
                return lease;
            }
            Err(e) => {
                next = Instant::now() + every / 4;
                match &failing {
                    Some(episode) => episode.failed_again(lease.key(), &e),
                    None => failing = Some(Episode::join(lease.key(), &e)),
                }
            }
        }
        deadline.send_replace(lease.valid_until());
    }
}

/// The renewal failures of every lease of this process, as one episode: the first failure
/// starts it (one warning), the last lease to renew again or be given up ends it (one line).
struct Failing {
    /// Leases whose last renewal failed.
    leases: usize,
    /// Leases that failed at least once since the episode started.
    seen: u64,
    /// Failed renewals since the episode started.
    attempts: u64,
    since: Option<Instant>,
}

static FAILING: std::sync::Mutex<Failing> = std::sync::Mutex::new(Failing {
    leases: 0,
    seen: 0,
    attempts: 0,
    since: None,
});

fn failing() -> std::sync::MutexGuard<'static, Failing> {
    FAILING.lock().unwrap_or_else(|p| p.into_inner())
}

/// One lease's part in the process's failing episode; dropped when the lease renews
/// again, is lost or is given up.
struct Episode;

impl Episode {
    fn join(key: &str, e: &LeaseError) -> Self {
        let mut f = failing();
        f.leases += 1;
        f.seen += 1;
        f.attempts += 1;
        if f.since.is_none() {
            f.since = Some(Instant::now());
            if crate::relay::election::is_election(&e.to_string()) {
                tracing::warn!(message = "Lease renewals not answered: the leases bucket is electing a leader (or unreachable); retrying, logged again when no lease is failing.", key = %key, error = %e);
            } else {
                tracing::warn!(message = "Lease renewals failing; retrying, logged again when no lease is failing.", key = %key, error = %e);
            }
        } else {
            tracing::debug!(message = "Lease renewal failed; retrying.", key = %key, error = %e);
        }
        Episode
    }

    fn failed_again(&self, key: &str, e: &LeaseError) {
        failing().attempts += 1;
        tracing::debug!(message = "Lease renewal failed again; retrying.", key = %key, error = %e);
    }
}

impl Drop for Episode {
    fn drop(&mut self) {
        let mut f = failing();
        f.leases = f.leases.saturating_sub(1);
        if f.leases == 0 {
            let seconds = f.since.take().map_or(0, |s| s.elapsed().as_secs());
            tracing::info!(
                message = "No lease renewal failing any more.",
                leases = f.seen,
                failed_attempts = f.attempts,
                seconds
            );
            f.seen = 0;
            f.attempts = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outage(key: &str) -> LeaseError {
        LeaseError::Kv {
            key: key.into(),
            op: "update",
            reason: "timed out".into(),
        }
    }

    #[test]
    fn one_episode_spans_every_failing_lease_and_ends_with_the_last() {
        let a = Episode::join("p.1", &outage("p.1"));
        let b = Episode::join("p.2", &outage("p.2"));
        b.failed_again("p.2", &outage("p.2"));
        {
            let f = failing();
            assert!(f.leases >= 2, "both leases are in the episode");
            assert!(f.since.is_some(), "the episode started once");
            assert!(f.attempts >= 3);
        }
        drop(a);
        assert!(failing().since.is_some(), "one lease still failing");
        drop(b);
        let f = failing();
        assert_eq!(f.leases, 0);
        assert!(f.since.is_none(), "the episode ended with its last lease");
        assert_eq!((f.seen, f.attempts), (0, 0));
    }
}
