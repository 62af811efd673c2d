//! The saga worker: source streams → routers → saga inbox partitions → one libmdbx commit
//! per group of batches → fenced relays (DESIGN §8).
//!
//! ```text
//!  AGGREGATE_EVENTS ─► ownership/router ─┐ fenced batches or rounds, one leased router per source
//!  WORKFLOW_EVENTS  ─► ownership/router ─┤
//!  effect results (executor) ────────────┤ (straight into the waiting partition's inbox)
//!  due timers (owned) ─► timers.rs ──────┴──► SAGA_INBOX runner.inbox.<p>.…
//!                                        │ one consume/ loop per owned partition
//!                                        ▼
//!                 commit.rs ── one write transaction per group of batches
//!                              (admission.rs, process/)
//!                                        ▼
//!                libmdbx: state, outbox, checkpoints, timers, dedupe markers
//!                                        ▼
//!                 relay/fenced.rs ── one fenced relay per owned partition ──► JetStream
//!  ownership/: heartbeats, assignment, a lease per partition, fences, snapshots, routers
//!  dedupe table ◄── sweep.rs (expiry)
//! ```
//!
//! One replica owns every partition; more replicas share them. The pipeline (read, commit,
//! apply, relay, timers) is the same whoever owns what.
//!
//! | file | owns |
//! |---|---|
//! | `consume/` | one consuming loop per owned partition, backpressure, reconnects |
//! | `commit.rs` | the group commit: the `Committer` and its write transaction |
//! | [`admission`] | the envelope checks that decide poison before routing |
//! | [`process`] | routing and applying inputs and timers to the tables of one transaction |
//! | [`tally`] | what a batch did, turned into metrics after its commit |
//! | `timers.rs` | due timers of owned partitions published into their inboxes |
//! | `sweep.rs` | expiry of dedupe markers |
//! | `admit.rs` | work under way first: the aggregate router takes new triggers only as far as the queued work allows |
//! | [`pause`] | paused tenants: their inputs held whole, released in order on resume |
//! | [`control`] | operator actions sent through a partition's inbox (resume, redrive) |
//! | [`replay`] | an operator's replay of a partition from an inbox sequence |
//! | [`partition`] | the partition of a saga instance, as the server's `partition()` transform computes it |
//! | [`ownership`] (folder) | who works on what: members and heartbeats, sticky assignment, a lease per partition (kept by its own task), take-over and hand-over of partitions, snapshots, the leased routers, the upgrade from a single-active release; its own table lists its files |
//!
//! Broker-side fencing itself is [`crate::broker::fence`]; the fenced relay of one partition
//! is [`crate::relay::fenced`].
//!
//! **Position of truth.** Each loop reads its partition of the inbox through an ordered
//! consumer that starts at the committed checkpoint + 1. Inputs are applied strictly in stream order, and
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
//! to the committer, which applies every batch waiting at that moment — from every owned
//! partition — in a single write transaction (each batch still advancing only its own
//! partition's checkpoint), commits once, and then answers each loop. A loop sends its next
//! batch only after the answer for the previous one, so each partition stays in order.
//!
//! **Backpressure.** Fetching pauses while the node's outboxes hold more than
//! `saga.max_outbox_depth` records in all. A batch holds at most `saga.batch_size` inputs.
//!
//! **Drain.** On cancellation each owned partition is handed over (`ownership/hand.rs`): its loop
//! finishes the batch in hand, commits it and returns, its relay flushes, a snapshot is
//! uploaded and the lease handed over; the committer ends once every loop has returned.
//!
//! **The one flow back.** Data moves one way: stream → worker → outbox → relay. The only
//! information that flows against it, from the relay back to the worker, goes through the
//! [`crate::relay::RelayHandle`]: the acknowledged prefix (the committer deletes published records up to
//! it inside its next transaction) and the unpublished count (backpressure). The worker
//! tells the relay, through the same handle, what it wrote and deleted and when to wake.
//! Nothing else in the worker reads relay state.
//!
//! **Timers** are rows of the `schedule` table. The timer loop publishes each due timer of
//! an owned partition into that partition's inbox, where it is applied in log order like any
//! input; the firing's timestamp is the timer's due time, so replays stay deterministic. A
//! cancelled timer's row is deleted in the transaction that cancels it, and the engine
//! ignores a firing it no longer expects, so a cancelled timer never fires.

pub mod admission;
mod admit;
pub mod cap;
mod commit;
mod consume;
pub mod control;
pub mod ownership;
pub mod partition;
pub mod pause;
pub mod process;
pub mod pull;
pub mod replay;
mod sweep;
pub mod tally;
mod timers;
mod usage;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::runtime::AppState;
use commit::Committer;
use ownership::router;

pub use commit::apply_inputs;
pub use consume::{Source, sources};

/// Spawns a router per source stream, partition ownership (each owned partition's consumer
/// loop and fenced relay), the timer loop, the tenant usage gauges and the dedupe sweep on
/// `tracker`; all stop when
/// `cancel` fires, after handing over what they hold.
pub fn spawn(
    tracker: &TaskTracker,
    state: Arc<AppState>,
    leases: async_nats::jetstream::kv::Store,
    snapshots: async_nats::jetstream::object_store::ObjectStore,
    cancel: CancellationToken,
) {
    let committer = Committer::spawn(tracker, state.clone());
    for source in sources(&state) {
        // New triggers wait behind work under way (admit.rs); results are never held. The
        // node's shares of the aggregate stream share one gate.
        let gate = (source.stream == state.config.streams.aggregate_events).then(admit::Gate::new);
        for share in router::share::Share::all(&source) {
            tracker.spawn(router::run(
                state.clone(),
                leases.clone(),
                share,
                gate.clone(),
                cancel.clone(),
            ));
        }
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
    tracker.spawn(timers::run(state.clone(), cancel.clone()));
    tracker.spawn(usage::run(state.clone(), cancel.clone()));
    tracker.spawn(sweep::run(state, cancel));
}
