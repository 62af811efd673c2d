//! The hand-over of one partition this replica holds, on a rebalance, when the node's mode
//! stops owning partitions, and for each partition on a drain.
//!
//! Guarantees kept here: reading stops first and the batch in hand is committed; the relay
//! then flushes the outbox, bounded by the lease's deadline and one TTL so a relay that
//! cannot publish never holds the ownership task. While the lease is still held a snapshot
//! is uploaded and named in the lease, flushed or not, so the heir that waits for it
//! replays nothing: the snapshot is taken after the last commit and holds the records the
//! relay had not published yet, which the heir's relay publishes (what the old relay
//! published meanwhile is suppressed by the fence's watermark or the duplicate window, as
//! after any take-over). A lease already past its deadline, or a partition fenced off by
//! a newer owner, gets no snapshot; a lease that cannot be released is left to expire on
//! its own.

use std::collections::BTreeMap;
use std::time::Instant;

use super::{Running, Snap, forget};
use crate::runtime::AppState;

/// Hands partition `p` over: stops reading (the batch in hand is committed), flushes its
/// outbox, snapshots, releases the lease. The lease is renewed meanwhile by its keeper;
/// the flush is given up once the lease's deadline passes (renewals failing: no snapshot)
/// or after one TTL (the relay is stopped and the snapshot carries what it had left), so a
/// relay that cannot publish never holds the ownership task.
pub(super) async fn hand_over(
    state: &AppState,
    snap: &Snap,
    running: &mut BTreeMap<u32, Running>,
    p: u32,
) {
    let Some(mut r) = running.remove(&p) else {
        return;
    };
    let stopping = Instant::now();
    let mut handed = None;
    r.consume_stop.cancel();
    let _ = (&mut r.consume).await;
    r.relay_stop.cancel();
    let flushed = tokio::select! {
        done = &mut r.relay => Ok(done),
        () = r.lease.expired() => Err(true),
        () = tokio::time::sleep(r.lease.ttl()) => Err(false),
    };
    match flushed {
        // Flushed: the snapshot holds everything applied, so the heir replays nothing.
        Ok(Ok(Ok(()))) => handed = snap.upload(state, p).await,
        Ok(_) => {
            tracing::warn!(
                message = "Hand-over after the partition was fenced off.",
                partition = p
            )
        }
        Err(expired) => {
            r.relay.abort();
            let _ = (&mut r.relay).await;
            if expired {
                tracing::warn!(
                    message = "Hand-over without a snapshot: the lease's deadline passed before the outbox was flushed; the heir replays from an earlier snapshot.",
                    partition = p
                );
            } else {
                // Still held: the snapshot carries the records the relay had left.
                handed = snap.upload(state, p).await;
                tracing::warn!(
                    message = "Hand-over before the outbox was flushed (one lease TTL); the snapshot carries the records left.",
                    partition = p,
                    snapshot = ?handed
                );
            }
        }
    }
    state
        .metrics
        .partition_handoff_seconds
        .observe(stopping.elapsed().as_secs_f64());
    forget(state, p);
    let epoch = r.lease.epoch();
    // With the snapshot named in the lease, the heir waits for it rather than restoring an
    // older one its first listing may show.
    let released = match handed {
        Some(checkpoint) => r.lease.hand_over(checkpoint).await,
        None => r.lease.release().await,
    };
    match released {
        Ok(()) => {
            state
                .metrics
                .lease_events
                .with_label_values(&["released"])
                .inc();
            tracing::info!(message = "Partition handed over.", partition = p, epoch, snapshot = ?handed);
        }
        Err(e) => {
            tracing::warn!(message = "Partition release failed; it expires on its own.", partition = p, error = %e)
        }
    }
}
