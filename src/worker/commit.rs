//! Group commit: the [`Committer`], the one thread that writes the consumer loops' batches.
//!
//! The hop from a consumer loop to the transaction: a loop calls [`Committer::submit`] with
//! its batch and waits; the commit thread (a blocking task of its own for the worker's
//! life, so a commit costs one hand-off and no thread of a pool picked per commit) takes
//! that batch and every other one already waiting (from any stream, at most
//! [`MAX_MERGED`]; when fewer than [`LINGER_BELOW`] are, it waits [`LINGER`] once for more),
//! applies them all in one libmdbx write transaction together with the deletion of the
//! outbox records the relay has published, commits once, and answers each loop with its
//! new checkpoint and [`Tally`].
//!
//! Guarantees:
//! - **Atomic with the checkpoint.** Each batch advances only its own stream's checkpoint,
//!   in the same transaction as the state, outbox records, timers and markers its inputs
//!   produced; inputs at or below the stored checkpoint are skipped as already applied.
//! - **Answered only after the commit.** A loop hears `Ok` only once the transaction is
//!   durable; on failure every batch of the transaction is answered with the error and
//!   nothing of it was written, so each loop re-reads from its checkpoint. The error keeps
//!   its text (a full disk is named: ENOSPC and the data directory), and the store marks
//!   writes as failing until a commit succeeds (`storage` module doc).
//! - **Every committed record reaches the relay.** After a commit, and before answering,
//!   the thread hands each batch's outbox records to its partition's relay memory
//!   (`relay/fresh.rs`), also for a batch whose loop stopped waiting during the commit
//!   (aborted when its partition was lost): a relay never counts that memory complete
//!   without them. A batch whose loop had already stopped waiting is not applied at all;
//!   the partition's next owner applies its inputs from the checkpoint.
//! - **Order per stream.** A loop submits its next batch only after the answer to the
//!   previous one, so batches of one stream never overtake each other.
//! - **Bounded outputs.** A transaction stops taking inputs once the outbox records it
//!   wrote reach `saga.max_batch_bytes` (one input's outputs alone never pass it: such an
//!   input is dead-lettered, `process/apply.rs`); the inputs it did not take are answered back
//!   as [`Applied::deferred`] and submitted again, in order, before anything newer.
//! - The commit thread ends when every [`Committer`] handle is dropped (every consumer loop
//!   has returned), after answering what it holds.

use std::collections::BTreeSet;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;

use super::admission::{Limits, RawInput};
use super::control::CONTROL_SUBJECT;
use super::process::{Processor, Scope, TIMER_SUBJECT};
use super::tally::Tally;
use crate::clock::now_ms;
use crate::manifest::Catalog;
use crate::relay::RelayHandle;
use crate::runtime::AppState;
use crate::storage::{Result, StorageError, Store, Tables};

/// What a batch commit returns (or the error that kept its transaction from committing).
pub(crate) type Committed = Result<Applied>;

/// A batch's part in a committed transaction.
pub(crate) struct Applied {
    /// The stream's new checkpoint.
    pub checkpoint: u64,
    /// What happened.
    pub tally: Tally,
    /// The batch's inputs after the checkpoint, not applied because the transaction's
    /// outputs reached `saga.max_batch_bytes` first: the loop submits them again, first.
    pub deferred: Vec<(u64, RawInput)>,
}

/// Most batches merged into one transaction: one from each partition loop of a node that
/// owns the default 64 partitions. Each loop has at most one batch waiting, so a commit can
/// take every partition that is ready; merging fewer (8 until the pipeline was partitioned)
/// made more, smaller commits, each writing its tables' branch pages and the GC again
/// (about 9 % more store pages per input at the maximum rate, `scripts/bench pipeline`).
pub(crate) const MAX_MERGED: usize = 64;

/// A group of fewer batches than this waits [`LINGER`] for more before it commits. Below
/// the maximum rate most groups held one or two batches, each commit paying its sync and
/// its tables' branch pages for a few inputs: at half the maximum rate, waiting once for
/// company took about a tenth off the runner's CPU per order and lowered the p99s
/// (`scripts/bench pipeline`, docs/benchmarks.md). Under load groups are larger than this
/// and never wait.
const LINGER_BELOW: usize = 8;

/// How long a small group waits for more batches: one millisecond on each commit of an
/// input's path, against the sync it saves.
const LINGER: std::time::Duration = std::time::Duration::from_millis(1);

/// Batches that may wait for the commit thread before [`Committer::submit`] waits to send:
/// as many as one commit takes, so a ready loop is not left waiting to send while the
/// thread takes what is queued.
const QUEUE: usize = MAX_MERGED;

/// One consumer loop's batch, waiting for the commit thread.
struct Job {
    checkpoint: String,
    batch: Vec<(u64, RawInput)>,
    scope: Scoped,
    reply: oneshot::Sender<Committed>,
}

/// The partition a batch belongs to: its inputs are applied to that
/// partition's keys only, its outbox records go to that partition with their causes, and
/// the records its relay has published are deleted in the same transaction.
#[derive(Clone, Debug)]
pub(crate) struct Scoped {
    /// The partition.
    pub partition: u32,
    /// P.
    pub count: u32,
    /// The partition's relay handle.
    pub relay: RelayHandle,
    /// Inputs at or below this inbox sequence were applied by an earlier owner (the fence
    /// watermark at take-over): applying them here is replay, and is counted.
    pub replay_until: u64,
}

/// The consumer loops' handle on the group commit: cheap to clone, one per loop.
#[derive(Clone)]
pub(crate) struct Committer {
    jobs: mpsc::Sender<Job>,
}

impl Committer {
    /// Starts the commit thread on `tracker` (a blocking task) and returns the handle that
    /// feeds it.
    pub(crate) fn spawn(tracker: &TaskTracker, state: Arc<AppState>) -> Self {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let task = CommitTask { state, queue };
        tracker.spawn_blocking(move || task.run());
        Self { jobs }
    }

    /// Hands `batch` (stream sequence and input, in stream order) to the commit thread and
    /// waits until it is durably applied under checkpoint key `checkpoint`. Returns the new
    /// checkpoint and what happened, or the error that kept the transaction from committing.
    pub(crate) async fn submit(
        &self,
        checkpoint: &str,
        batch: Vec<(u64, RawInput)>,
        scope: Scoped,
    ) -> Committed {
        let (reply, answer) = oneshot::channel();
        let gone = || StorageError::Task("the committer has stopped".into());
        self.jobs
            .send(Job {
                checkpoint: checkpoint.to_string(),
                batch,
                scope,
                reply,
            })
            .await
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// The receiving side: owns the write transactions of the consumer loops, on a thread.
struct CommitTask {
    state: Arc<AppState>,
    queue: mpsc::Receiver<Job>,
}

impl CommitTask {
    /// Commits group after group until every [`Committer`] is dropped (blocking).
    fn run(mut self) {
        while let Some(first) = self.queue.blocking_recv() {
            let mut group = vec![first];
            self.take_ready(&mut group);
            if group.len() < LINGER_BELOW {
                // Few loops are ready: wait a moment for company rather than pay a sync
                // for one or two batches.
                std::thread::sleep(LINGER);
                self.take_ready(&mut group);
            }
            self.commit(group);
        }
    }

    /// Adds the batches already waiting to `group`, up to [`MAX_MERGED`].
    fn take_ready(&mut self, group: &mut Vec<Job>) {
        while group.len() < MAX_MERGED {
            match self.queue.try_recv() {
                Ok(j) => group.push(j),
                Err(_) => break,
            }
        }
    }

    /// Applies `group` (and the deletion of published outbox records) in one write
    /// transaction, commits, and answers each job.
    fn commit(&self, mut group: Vec<Job>) {
        // A batch whose loop stopped waiting (aborted: its partition was lost) is not
        // applied; whoever owns the partition next applies its inputs from the checkpoint.
        group.retain(|j| !j.reply.is_closed());
        if group.is_empty() {
            return;
        }
        let metrics = &self.state.metrics;
        let started = Instant::now();
        let inputs: usize = group.iter().map(|j| j.batch.len()).sum();
        let published: Vec<(u16, RelayHandle, u64)> = group
            .iter()
            .filter_map(|j| {
                let h = &j.scope.relay;
                h.deletable_through()
                    .map(|upto| (j.scope.partition as u16, h.clone(), upto))
            })
            .collect();
        let relays: Vec<RelayHandle> = group.iter().map(|j| j.scope.relay.clone()).collect();
        let (replies, work): (Vec<_>, Vec<_>) = group
            .into_iter()
            .map(|j| {
                let scope = Scope::new(j.scope.partition, j.scope.count);
                (j.reply, (j.checkpoint, j.batch, scope))
            })
            .unzip();
        let catalog = self.state.catalog();
        let limits = Limits::from_config(&self.state.config)
            .with_max_payload(self.state.broker.max_payload())
            .with_seal(&self.state.seal);
        let doomed: Vec<(u16, u64)> = published.iter().map(|(p, _, u)| (*p, *u)).collect();
        let state = &self.state;
        // A panic while applying aborts the transaction (it is dropped while unwinding) and is
        // answered like any failed commit (the panic hook has logged its message); the thread
        // goes on with the next group.
        let out = panic::catch_unwind(AssertUnwindSafe(|| {
            // Logged: what it applies moves the partitions' checkpoints, and the outbox
            // records it deletes are under their fence watermarks.
            state.store.write_logged_blocking(|t| {
                // Read under the write lock: a resume's release is a write transaction too, so
                // this batch sees the pause as it is after any earlier release.
                let paused = state.paused.get();
                for (p, upto) in &doomed {
                    t.delete_outbox_through(*p, *upto)?;
                }
                let mut written = 0u64;
                work.iter()
                    .map(|(key, batch, scope)| {
                        let (cp, tally) = apply_in(
                            t,
                            &catalog,
                            &limits,
                            key,
                            batch,
                            *scope,
                            &paused,
                            &mut written,
                        )?;
                        Ok((cp, tally))
                    })
                    .collect::<Result<Vec<_>>>()
            })
        }))
        .unwrap_or_else(|_| Err(StorageError::Task("the commit panicked".into())));
        match out {
            Ok(results) => {
                for (_, tally) in &results {
                    for tenant in &tally.resumed {
                        self.state.paused.remove(tenant);
                    }
                }
                for (_, handle, upto) in &published {
                    handle.note_deleted(*upto);
                }
                metrics
                    .saga_commit_seconds
                    .observe(started.elapsed().as_secs_f64());
                let mut applied = inputs;
                for (((reply, (checkpoint, mut tally)), (_, batch, _)), relay) in
                    replies.into_iter().zip(results).zip(work).zip(relays)
                {
                    // Here, not in the loop: a batch whose loop was aborted meanwhile is
                    // committed all the same, and its records must reach the relay.
                    hand_over(&relay, &mut tally);
                    let deferred: Vec<_> =
                        batch.into_iter().filter(|(s, _)| *s > checkpoint).collect();
                    metrics.saga_deferred.inc_by(deferred.len() as u64);
                    applied -= deferred.len();
                    let _ = reply.send(Ok(Applied {
                        checkpoint,
                        tally,
                        deferred,
                    }));
                }
                metrics.saga_batch_size.observe(applied as f64);
            }
            Err(e) => {
                let why = e.to_string();
                for reply in replies {
                    let _ = reply.send(Err(StorageError::Commit(why.clone())));
                }
            }
        }
    }
}

/// Tells `relay` what a committed batch wrote to its partition's outbox: its bytes per
/// tenant and its records.
fn hand_over(relay: &RelayHandle, tally: &mut Tally) {
    relay.hand_over(
        std::mem::take(&mut tally.written),
        std::mem::take(&mut tally.outbox_by_tenant),
    );
}

/// Applies inputs in one write transaction (blocking), as the one partition of a deployment
/// of one ([`Scope::whole`]): those at or below the checkpoint of `checkpoint_key` are
/// skipped as already applied; the checkpoint advances to the last one in the same commit.
/// Returns the new checkpoint and what happened.
pub fn apply_inputs(
    store: &Store,
    catalog: &Catalog,
    limits: &Limits,
    checkpoint_key: &str,
    batch: &[(u64, RawInput)],
) -> Result<(u64, Tally)> {
    store.write_blocking(|t| {
        apply_in(
            t,
            catalog,
            limits,
            checkpoint_key,
            batch,
            Scope::whole(),
            &Arc::default(),
            &mut 0,
        )
    })
}

/// [`apply_inputs`] inside the caller's transaction. `written` counts the output bytes the
/// transaction wrote so far: once it reaches [`Limits::max_output_bytes`] no further input
/// is taken (the checkpoint says where it stopped).
#[allow(clippy::too_many_arguments)]
fn apply_in(
    t: &Tables<'_, libmdbx::RW>,
    catalog: &Catalog,
    limits: &Limits,
    checkpoint_key: &str,
    batch: &[(u64, RawInput)],
    scope: Scope,
    paused: &Arc<BTreeSet<String>>,
    written: &mut u64,
) -> Result<(u64, Tally)> {
    let cp = t.checkpoint(checkpoint_key)?;
    let mut p = Processor::new(catalog, limits, now_ms(), scope);
    p.paused = paused.clone();
    let mut last = cp;
    let max = u64::try_from(limits.max_output_bytes).unwrap_or(u64::MAX);
    for (seq, raw) in batch {
        if *seq <= last {
            continue;
        }
        if *written + p.tally.outbox_bytes >= max {
            break;
        }
        p.cause(*seq);
        if raw.subject == TIMER_SUBJECT {
            p.fired_timer(t, raw)?;
        } else if raw.subject == CONTROL_SUBJECT {
            p.control(t, raw)?;
        } else {
            p.input(t, raw)?;
        }
        p.release_freed(t)?;
        last = *seq;
    }
    if last > cp {
        t.set_checkpoint(checkpoint_key, last)?;
    }
    *written += p.tally.outbox_bytes;
    Ok((last, p.tally))
}
