//! Taking over what a single-active release left (DESIGN §8.9): its lease, its outbox and
//! its place in the source streams. Runs at every start of saga mode, before the node joins;
//! on a store and streams the old release never touched it finds nothing and does nothing.
//!
//! Releases before the one saga pipeline ran saga mode single-active by default: one replica
//! read the source streams itself, kept one checkpoint per stream (`<consumers.saga>:<stream>`)
//! and relayed its outbox from partition 0 of the outbox table, unfenced, every record with
//! the cause `(0, 0)`. It held the lease `saga.single-active` while it ran.
//!
//! **Guarantees.**
//! - **Never beside an old replica.** While a replica of an old release holds its lease this
//!   node does not start: it would apply the inputs that one applies. A lease left by this
//!   data directory's own previous process is void (that process is dead: this one holds the
//!   directory's lock) and is deleted.
//! - **Routing resumes where the old replica stopped.** For each source stream with an old
//!   checkpoint in this store, the stream's router position in the saga inbox is raised to
//!   that checkpoint — a marker stored under the router's lease and fence, as a router's own
//!   progress is — unless a marker at or past it is there already. Only then is the old
//!   checkpoint deleted, so a crash in between does it again, and a later start finds nothing
//!   to do. So no input the old replica applied is routed again, and every later one is
//!   routed once.
//! - **Its outbox is published once, in order.** Old records get distinct causes `(0, 1)`,
//!   `(0, 2)`, … in outbox order (below every cause an inbox input gives, which starts at
//!   sequence 1), so partition 0's fenced relay publishes them under their own message ids
//!   and its watermark tells published from unpublished ones, as for any record.
//! - **The rest is read as it is.** Instances, timers, dead letters and dedupe markers are
//!   keyed by instance or id in the same tables; each owned partition finds its instances
//!   there, with nothing in its inbox to replay, and fires their timers.
//!
//! **Order of an upgrade.** Stop the old replica; start the new release on its data
//! directory; add replicas after it is ready. A new replica on an empty store has no way to
//! know the old position: if one routed a source before this node carried the position
//! over, the position is raised all the same (nothing not yet copied is copied twice) and
//! the error is logged, naming the source and both positions.

use std::time::{Duration, Instant};

use async_nats::jetstream::kv;

use super::lease::{self, Lease, LeaseError};
use super::router::router_key;
use crate::broker::fence::{Fence, Position};
use crate::runtime::AppState;
use crate::storage::tables::{DEFAULT_PARTITION, OutboxRecord};
use crate::worker::consume::sources;

/// The lease key a replica of a single-active release holds while its saga pipeline runs.
pub const OLD_LEASE: &str = "saga.single-active";

/// Why this replica may not start its saga pipeline on these streams.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpgradeError {
    /// A replica of an old release runs single-active on these streams.
    #[error(
        "a replica of an older release (`{owner}`) runs the saga pipeline single-active on \
         these streams; this one would apply every input it applies. Stop it, then start \
         this release on its data directory first"
    )]
    OldReplica {
        /// The holder's owner string, `<node id>@<store id>`.
        owner: String,
    },
    /// The router lease of a source stayed held by another replica.
    #[error(
        "cannot carry the single-active position of {stream} (sequence {applied}) over: its \
         router lease is held by `{owner}`. Stop every saga replica and start this one first"
    )]
    RouterHeld {
        /// The source stream.
        stream: String,
        /// The old checkpoint.
        applied: u64,
        /// Who holds the router lease.
        owner: String,
    },
    /// The leases bucket did not answer.
    #[error("taking over from a single-active release: {0}")]
    Lease(#[from] LeaseError),
    /// The store or the broker failed.
    #[error("taking over from a single-active release: {0}")]
    Io(String),
}

/// Refuses to start beside an old single-active replica, then carries this store's old
/// layout over (see the module doc). `store_id` is this data directory's id.
pub async fn take_over(
    state: &AppState,
    leases: &kv::Store,
    store_id: &str,
) -> Result<(), UpgradeError> {
    refuse_beside_old(leases, store_id).await?;
    let ranked = state
        .store
        .write(rank_old_outbox)
        .await
        .map_err(|e| UpgradeError::Io(e.to_string()))?;
    if ranked > 0 {
        tracing::info!(
            message = "Outbox records of the single-active release are published by partition 0.",
            records = ranked
        );
    }
    for source in sources(state) {
        let old_key = format!("{}:{}", state.config.consumers.saga, source.stream);
        let key = old_key.clone();
        let applied = state
            .store
            .read(move |t| t.checkpoint(&key))
            .await
            .map_err(|e| UpgradeError::Io(e.to_string()))?;
        if applied == 0 {
            continue;
        }
        carry_position(state, leases, &source.stream, applied).await?;
        let key = old_key;
        state
            .store
            .write(move |t| t.delete_checkpoint(&key))
            .await
            .map_err(|e| UpgradeError::Io(e.to_string()))?;
        tracing::info!(message = "Took over the position of the single-active release.", source = %source.stream, applied);
    }
    Ok(())
}

/// Fails while an old single-active replica holds its lease; deletes a lease this data
/// directory's previous process left.
async fn refuse_beside_old(leases: &kv::Store, store_id: &str) -> Result<(), UpgradeError> {
    let Some(h) = lease::holder(leases, OLD_LEASE).await? else {
        return Ok(());
    };
    if h.owner.rsplit_once('@').map(|(_, s)| s) != Some(store_id) {
        return Err(UpgradeError::OldReplica { owner: h.owner });
    }
    tracing::info!(message = "Deleting the single-active lease this data directory's previous run left.", previous = %h.owner);
    if let Err(e) = leases
        .delete_expect_revision(OLD_LEASE, Some(h.revision))
        .await
    {
        tracing::debug!(message = "The old single-active lease changed meanwhile.", error = %e);
    }
    Ok(())
}

/// Gives the old release's records in partition 0 (cause `(0, 0)`) the causes `(0, 1)`,
/// `(0, 2)`, … in outbox order; returns how many it changed.
fn rank_old_outbox(
    t: &crate::storage::tables::Tables<'_, libmdbx::RW>,
) -> crate::storage::Result<u64> {
    let mut rank = 0u32;
    let mut changed = 0u64;
    let mut from = 0u64;
    loop {
        let batch: Vec<(u64, OutboxRecord)> = t.outbox_batch(DEFAULT_PARTITION, from, 1024)?;
        let Some(&(last, _)) = batch.last() else {
            return Ok(changed);
        };
        for (seq, mut rec) in batch {
            if rec.cause.0 != 0 {
                continue;
            }
            rank = rank.max(rec.cause.1);
            if rec.cause == (0, 0) {
                rank += 1;
                rec.cause = (0, rank);
                t.replace_outbox(DEFAULT_PARTITION, seq, &rec)?;
                changed += 1;
            }
        }
        from = last + 1;
    }
}

/// Stores a router marker for `stream` at `applied` under the router's lease and fence,
/// unless one at or past it is there.
async fn carry_position(
    state: &AppState,
    leases: &kv::Store,
    stream: &str,
    applied: u64,
) -> Result<(), UpgradeError> {
    let ttl = state.config.partitions.lease_ttl.get();
    let key = router_key(stream);
    // A router lease left by this data directory's earlier process is taken back at once;
    // one another replica holds is waited for, up to two TTLs.
    let until = Instant::now() + ttl * 2;
    let lease = loop {
        let store = Some(state.store_id.as_str());
        if let Some(l) = Lease::reclaim_or_acquire(leases, &key, &state.node_id, store, ttl).await?
        {
            break l;
        }
        if Instant::now() >= until {
            let owner = lease::holder(leases, &key)
                .await?
                .map_or_else(|| "nobody now".into(), |h| h.owner);
            return Err(UpgradeError::RouterHeld {
                stream: stream.into(),
                applied,
                owner,
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let result = async {
        let mut fence = Fence::raise(js, inbox, stream, lease.epoch(), &state.node_id)
            .await
            .map_err(|e| UpgradeError::Io(e.to_string()))?;
        match fence.through() {
            Some(t) if t.seq >= applied => return Ok(()),
            Some(t) => {
                // Raised all the same: what is not copied yet is never copied twice.
                tracing::error!(message = "A replica of this release routed this source without the single-active release's position: inputs it applied up to the routed sequence are in the saga inbox again, and are applied twice where their dedupe markers have expired. Start the node that ran single-active first.", source = %stream, routed = t.seq, applied);
            }
            None => {}
        }
        fence
            .publish_marker(js, Position { seq: applied, ord: 0 })
            .await
            .map_err(UpgradeError::Io)
    }
    .await;
    if let Err(e) = lease.release().await {
        tracing::debug!(message = "Cannot release the router lease after the take-over; it ages out.", error = %e);
    }
    result
}
