//! Partition ownership (partitioned mode, DESIGN §8.3–§8.7): the sticky assignment (over
//! the members `members.rs` sees), one lease per owned partition, and the start and stop of each owned
//! partition's consumer loop and fenced relay. Everything that decides who works on what
//! lives in this folder; the saga pipeline it starts (read, commit, apply, relay, timers)
//! is the same whoever owns what, and learns of ownership only through what it is handed
//! (a partition's scope, its relay handle, a stop token).
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | what a running partition is made of, the snapshots it uploads, forgetting one no longer held |
//! | `watch.rs` | the ownership task: the watched view of the bucket, each tick's reap and balance, the drain |
//! | `take.rs` | the take-over of one won partition: fences, restore, its relay and consumer loop |
//! | `hand.rs` | the hand-over of one held partition: stop, flush, snapshot, lease handed on |
//! | [`assign`] | sticky, balanced (±1) assignment of partitions to members |
//! | `members.rs` | this replica's heartbeat and the watched view of members and holders |
//! | [`lease`] | ownership leases in a KV bucket: acquire, renew, release, monotonic deadline |
//! | [`keeper`] | a held lease renewed by its own task, whatever its holder is busy with |
//! | `snap.rs` | the snapshots this replica takes: on hand-over, and each round those due, in one pass per group |
//! | [`snapshot`] | partition snapshots in an Object Store: upload, prune, restore |
//! | [`router`] | each source stream routed in shares: leased, fenced, exact progress in each share's fence marker |
//! | `claims.rs` | fence markers and snapshots whose claims pass what the streams hold are refused, not obeyed |
//! | [`upgrade`] | taking over what a single-active release left: its lease, outbox and positions |
//!
//! **The bucket** (`partitions.leases_bucket`, `max_age` = `partitions.lease_ttl`) holds
//! `m.<node>` — a member's heartbeat, written every TTL/3, gone TTL after the last one —
//! and `p.<partition>` — a partition's lease ([`lease`]). Every replica watches the
//! whole bucket (`members.rs`), so it sees members come and go and leases expire at once (limit markers).
//!
//! **Renewals run beside the task**, never in it: each held lease has its keeper
//! ([`keeper`]) and the heartbeat a task of its own, so a slow step here (a
//! hand-over's flush, a snapshot's upload or download) cannot let the other leases lapse.
//!
//! **Each tick** (a twentieth of the TTL, and on every bucket change) the task stops what
//! it no longer holds, computes the target ([`assign::assign`]) from the live members and
//! holders, takes every free partition assigned to it, and hands over at most one partition
//! it holds beyond its share (stop reading, flush the outbox, snapshot, hand the lease over
//! naming the snapshot; the heir sees the key freed, takes it, and waits for that snapshot
//! to be listed before restoring).
//!
//! **Guarantees.**
//! - **Stop before the deadline.** A partition whose lease is lost (renewal refused) or
//!   whose monotonic deadline passed is stopped at once — reading and publishing both —
//!   without waiting for anything.
//! - **Fenced before work.** A partition starts reading only after this owner raised its
//!   fence in every stream it publishes to ([`crate::broker::fence`]); its relay publishes only
//!   under those fences, so once an heir raised its own, nothing of this owner reaches a
//!   stream, however long it was paused.
//! - **In-flight batch on loss.** A batch being committed when the lease is lost still
//!   commits locally (harmless: a deterministic prefix of the partition's log); its outbox
//!   records are never published by this owner. The heir replays the inputs its copy lacks
//!   and publishes only what the fence watermark shows is missing.
//! - **Drain.** On cancellation every partition stops reading at once, then each is handed
//!   over the same way as a rebalance (flush, snapshot, hand over), one after the other with
//!   every lease still renewed, then the heartbeat is deleted. A hand-over whose flush completed leaves a
//!   snapshot covering everything applied and names it in the lease: the heir restores that
//!   one (waiting, up to half a TTL, for a bucket listing that lags the upload) and replays
//!   nothing.

pub mod assign;
pub(crate) mod claims;
mod hand;
pub mod keeper;
pub mod lease;
mod members;
pub mod router;
mod snap;
pub mod snapshot;
mod take;
pub mod upgrade;
mod watch;

use std::sync::Arc;

use async_nats::jetstream::kv;
use async_nats::jetstream::object_store::ObjectStore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::commit::Committer;
use crate::relay::fenced::Fenced;
use crate::runtime::AppState;
use crate::storage::snapshot::partition_checkpoint_key;
use keeper::Kept;
use snap::Snap;

pub(crate) use watch::run;

/// The lease key of partition `p`.
pub fn partition_key(p: u32) -> String {
    format!("p.{p}")
}

/// The checkpoint key of partition `p`: the last inbox sequence applied to it.
pub fn partition_checkpoint(state: &AppState, p: u32) -> String {
    partition_checkpoint_key(
        &state.config.consumers.saga,
        &state.config.streams.saga_inbox,
        p,
    )
}

/// What the ownership task works with.
pub(crate) struct Ctx {
    /// The shared context.
    pub state: Arc<AppState>,
    /// The leases bucket.
    pub leases: kv::Store,
    /// The snapshots bucket.
    pub snapshots: ObjectStore,
    /// The group commit.
    pub committer: Committer,
}

/// A partition this replica works on.
struct Running {
    /// Counts this partition's outbox in the node's depth while it is owned.
    _registered: crate::relay::Registered,
    lease: Kept,
    consume_stop: CancellationToken,
    consume: JoinHandle<()>,
    relay_stop: CancellationToken,
    relay: JoinHandle<Result<(), Fenced>>,
}

/// Records that partition `p` is no longer held here: placement and its gauges.
fn forget(state: &AppState, p: u32) {
    state.placement.gave_up(p);
    let label = p.to_string();
    // Its snapshots are the new owner's business now (and no alert of ours should age).
    let _ = state
        .metrics
        .snapshot_last_timestamp
        .remove_label_values(&[&label]);
    state
        .metrics
        .partition_epoch
        .with_label_values(&[&label])
        .set(0);
    state
        .metrics
        .partition_lag
        .with_label_values(&[&label])
        .set(0);
    // Another node owns it now: its checkpoint is no longer this node's to report.
    let _ = state
        .metrics
        .partition_checkpoint
        .remove_label_values(&[&label]);
}
