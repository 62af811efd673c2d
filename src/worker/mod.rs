//! The saga worker: streams → engine → one libmdbx commit per group of batches.
//!
//! ```text
//!  AGGREGATE_EVENTS ─► consume.rs ─┐ Committer::submit(batch)
//!  WORKFLOW_EVENTS  ─► consume.rs ─┴──► commit.rs ── one write transaction per group of
//!                                        │            batches (admission.rs, process.rs)
//!  schedule table   ─► timers.rs ── its own write transaction per set of due timers
//!                                        │            (process.rs; no admission)
//!                                        ▼
//!                                            libmdbx: state, outbox, checkpoint, timers
//!                                                                 │
//!                                                                 ▼
//!                                                     relay ──► JetStream
//!  consume.rs, commit.rs ◄── RelayHandle: acked prefix, unpublished count ◄── relay
//!  dedupe table ◄── sweep.rs (expiry)
//! ```
//!
//! | file | owns |
//! |---|---|
//! | `consume.rs` | one consuming loop per input stream, backpressure, reconnects |
//! | `commit.rs` | the group commit: the `Committer` and its write transaction |
//! | [`admission`] | the envelope checks that decide poison before routing |
//! | [`process`] | routing and applying inputs and timers to the tables of one transaction |
//! | [`tally`] | what a batch did, turned into metrics after its commit |
//! | `timers.rs` | the timer loop |
//! | `sweep.rs` | expiry of dedupe markers |
//! | `admit.rs` | work under way first: new triggers wait (single-active loop, or the aggregate router) while work under way is queued deep |
//! | [`pause`] | paused tenants: their inputs held whole, released in order on resume |
//! | [`control`] | operator actions sent through a partition's inbox (resume, redrive) |
//! | [`replay`] | an operator's replay of a partition from an inbox sequence |
//! | [`single`] | one single-active replica per set of streams, never beside partitioned ones |
//!
//! **Partitioned mode** (`partitions.enabled`, DESIGN §8) runs the same consuming loop,
//! group commit and processor per owned partition of the saga inbox:
//!
//! ```text
//!  AGGREGATE_EVENTS ─► router.rs ─┐ fenced atomic batches, one leased router per source
//!  WORKFLOW_EVENTS  ─► router.rs ─┴──► SAGA_INBOX runner.inbox.<p>.…
//!  due timers (owned) ─► timers.rs ─────┘      │
//!                                               ▼ one consume.rs loop per owned partition
//!                                   commit.rs (scoped to p) ─► libmdbx ─► relay/fenced.rs
//!  ownership.rs: heartbeats, assign.rs, lease per partition, fences, snapshot restore/upload
//! ```
//!
//! | file | owns |
//! |---|---|
//! | [`partition`] | the partition of a saga instance, as the server's `partition()` transform computes it |
//! | [`router`] | one router per source stream: leased, fenced, exact progress in its fence marker |
//! | [`assign`] | sticky, balanced (±1) assignment of partitions to members |
//! | [`ownership`] | leases, hand-over and take-over of partitions |
//! | `members` | this replica's heartbeat and the watched view of members and holders |
//! | [`lease`] | ownership leases in a KV bucket: acquire, renew, release, monotonic deadline |
//! | [`keeper`] | a held lease renewed by its own task, whatever its holder is busy with |
//! | [`snapshot`] | partition snapshots in an Object Store: upload, prune, restore |
//!
//! Broker-side fencing itself is [`crate::broker::fence`]; the fenced relay of one partition
//! is [`crate::relay::fenced`].
//!
//! **Position of truth.** Each loop reads its stream through an ordered consumer that
//! starts at the committed checkpoint + 1. Inputs are applied strictly in stream order, and
//! the checkpoint advances in the same write transaction as the state, outbox records,
//! timers and dedupe markers they produced. Nothing is acknowledged to JetStream because
//! nothing needs to be: the stream keeps the messages (limits retention) and the committed
//! checkpoint, not a server-side ack floor, says what was applied. A crash before the
//! commit re-reads the batch; a crash after it resumes after it. An input is therefore
//! applied exactly once to saga state, in order, across crashes, redeliveries and NATS
//! outages (on any consumer error the loop recreates its consumer at checkpoint + 1).
//! Per-event dedupe markers also catch one event published twice under two sequences.
//!
//! **Group commit.** The consumer loops do not commit themselves: they hand their batches
//! to the committer, which applies every batch waiting at that moment — from both
//! streams — in a single write transaction (each batch still advancing only its own
//! stream's checkpoint), commits once, and then answers each loop. A loop sends its next
//! batch only after the answer for the previous one, so each stream stays in order.
//!
//! **Backpressure.** Fetching pauses while the outbox holds more than
//! `saga.max_outbox_depth` records. A batch holds at most `saga.batch_size` inputs.
//!
//! **Drain.** On cancellation a loop finishes the batch in hand, commits it and returns;
//! the committer ends once every loop has returned.
//!
//! **The one flow back.** Data moves one way: stream → worker → outbox → relay. The only
//! information that flows against it, from the relay back to the worker, goes through the
//! [`RelayHandle`]: the acknowledged prefix (the committer deletes published records up to
//! it inside its next transaction) and the unpublished count (backpressure). The worker
//! tells the relay, through the same handle, what it wrote and deleted and when to wake.
//! Nothing else in the worker reads relay state.
//!
//! **Timers** are rows of the `schedule` table. The timer loop applies due timers through
//! the same [`process::Processor`] and commit discipline; the firing input's timestamp is
//! the timer's due time, so replays stay deterministic. A cancelled timer's row is deleted
//! in the transaction that cancels it, and the engine ignores a firing it no longer
//! expects, so a cancelled timer never fires.

pub mod admission;
mod admit;
pub mod assign;
mod commit;
mod consume;
pub mod control;

pub mod keeper;
pub mod lease;
mod members;
pub mod ownership;
pub mod partition;
pub mod pause;
pub mod process;
pub mod pull;
pub mod replay;
pub mod router;
pub mod single;
pub mod snapshot;
mod sweep;
pub mod tally;
mod timers;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::relay::RelayHandle;
use crate::runtime::AppState;
use commit::Committer;

pub use commit::apply_inputs;
pub use consume::{Input, inputs};

/// Spawns the committer, the consumer loops, the timer loop and the dedupe sweep on
/// `tracker`; the loops stop taking work when `cancel` fires, and the committer ends after
/// the last consumer loop.
pub fn spawn(
    tracker: &TaskTracker,
    state: Arc<AppState>,
    relay: RelayHandle,
    cancel: CancellationToken,
) {
    let committer = Committer::spawn(tracker, state.clone(), relay.clone());
    for input in inputs(&state) {
        // The series exists from the start, so a zero reads as zero, not as a missing metric.
        state
            .metrics
            .saga_inputs
            .with_label_values(&[&input.stream]);
        tracker.spawn(consume::run(
            state.clone(),
            input,
            relay.clone(),
            committer.clone(),
            cancel.clone(),
        ));
    }
    tracker.spawn(timers::run(state.clone(), relay, cancel.clone()));
    tracker.spawn(sweep::run(state, cancel));
}

/// Partitioned mode: spawns a router per source stream, partition ownership (each owned
/// partition's consumer loop and fenced relay), the timer loop and the dedupe sweep on
/// `tracker`; all stop when `cancel` fires, after handing over what they hold.
pub fn spawn_partitioned(
    tracker: &TaskTracker,
    state: Arc<AppState>,
    leases: async_nats::jetstream::kv::Store,
    snapshots: async_nats::jetstream::object_store::ObjectStore,
    cancel: CancellationToken,
) {
    // No unpartitioned outbox in this mode: the committer's own relay handle stays idle.
    let committer = Committer::spawn(tracker, state.clone(), RelayHandle::new());
    for source in inputs(&state) {
        tracker.spawn(router::run(
            state.clone(),
            leases.clone(),
            source,
            cancel.clone(),
        ));
    }
    tracker.spawn(ownership::run(
        ownership::Ctx {
            state: state.clone(),
            leases,
            snapshots,
            committer,
        },
        cancel.clone(),
    ));
    tracker.spawn(timers::run_partitioned(state.clone(), cancel.clone()));
    tracker.spawn(sweep::run(state, cancel));
}
