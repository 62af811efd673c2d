//! Group commit: the [`Committer`], the one task that writes the consumer loops' batches.
//!
//! The hop from a consumer loop to the transaction: a loop calls [`Committer::submit`] with
//! its batch and waits; the commit task takes that batch and every other one already
//! waiting (from any stream, at most [`MAX_MERGED`]), applies them all in one libmdbx write
//! transaction together with the deletion of the outbox records the relay has published,
//! commits once, and answers each loop with its new checkpoint and [`Tally`].
//!
//! Guarantees:
//! - **Atomic with the checkpoint.** Each batch advances only its own stream's checkpoint,
//!   in the same transaction as the state, outbox records, timers and markers its inputs
//!   produced; inputs at or below the stored checkpoint are skipped as already applied.
//! - **Answered only after the commit.** A loop hears `Ok` only once the transaction is
//!   durable; on failure every batch of the transaction is answered with the error and
//!   nothing of it was written, so each loop re-reads from its checkpoint.
//! - **Order per stream.** A loop submits its next batch only after the answer to the
//!   previous one, so batches of one stream never overtake each other.
//! - The commit task ends when every [`Committer`] handle is dropped (every consumer loop
//!   has returned), after answering what it holds.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;

use super::admission::{Limits, RawInput};
use super::process::Processor;
use super::tally::Tally;
use crate::clock::now_ms;
use crate::manifest::Catalog;
use crate::relay::RelayHandle;
use crate::runtime::AppState;
use crate::storage::tables::DEFAULT_PARTITION;
use crate::storage::{Result, StorageError, Store, Tables};

/// What a batch commit returns: the stream's new checkpoint and what happened.
pub(crate) type Committed = Result<(u64, Tally)>;

/// Most batches merged into one transaction.
pub(crate) const MAX_MERGED: usize = 8;

/// Batches that may wait for the commit task before [`Committer::submit`] waits to send.
const QUEUE: usize = 8;

/// One consumer loop's batch, waiting for the commit task.
struct Job {
    checkpoint: String,
    batch: Vec<(u64, RawInput)>,
    reply: oneshot::Sender<Committed>,
}

/// The consumer loops' handle on the group commit: cheap to clone, one per loop.
#[derive(Clone)]
pub(crate) struct Committer {
    jobs: mpsc::Sender<Job>,
}

impl Committer {
    /// Starts the commit task on `tracker` and returns the handle that feeds it.
    pub(crate) fn spawn(tracker: &TaskTracker, state: Arc<AppState>, relay: RelayHandle) -> Self {
        let (jobs, queue) = mpsc::channel(QUEUE);
        tracker.spawn(
            CommitTask {
                state,
                relay,
                queue,
            }
            .run(),
        );
        Self { jobs }
    }

    /// Hands `batch` (stream sequence and input, in stream order) to the commit task and
    /// waits until it is durably applied under checkpoint key `checkpoint`. Returns the new
    /// checkpoint and what happened, or the error that kept the transaction from committing.
    pub(crate) async fn submit(&self, checkpoint: &str, batch: Vec<(u64, RawInput)>) -> Committed {
        let (reply, answer) = oneshot::channel();
        let gone = || StorageError::Task("the committer has stopped".into());
        self.jobs
            .send(Job {
                checkpoint: checkpoint.to_string(),
                batch,
                reply,
            })
            .await
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// The receiving side: owns the write transactions of the consumer loops.
struct CommitTask {
    state: Arc<AppState>,
    relay: RelayHandle,
    queue: mpsc::Receiver<Job>,
}

impl CommitTask {
    /// Commits group after group until every [`Committer`] is dropped.
    async fn run(mut self) {
        while let Some(first) = self.queue.recv().await {
            let mut group = vec![first];
            while group.len() < MAX_MERGED {
                match self.queue.try_recv() {
                    Ok(j) => group.push(j),
                    Err(_) => break,
                }
            }
            self.commit(group).await;
        }
    }

    /// Applies `group` (and the deletion of published outbox records) in one write
    /// transaction, commits, and answers each job.
    async fn commit(&self, group: Vec<Job>) {
        let metrics = &self.state.metrics;
        let started = Instant::now();
        let inputs: usize = group.iter().map(|j| j.batch.len()).sum();
        let (replies, work): (Vec<_>, Vec<_>) = group
            .into_iter()
            .map(|j| (j.reply, (j.checkpoint, j.batch)))
            .unzip();
        let catalog = self.state.catalog();
        let limits = Limits::from_config(&self.state.config);
        let published = self.relay.deletable_through();
        let out = self
            .state
            .store
            .run(move |s| {
                s.write_blocking(|t| {
                    if let Some(upto) = published {
                        t.delete_outbox_through(DEFAULT_PARTITION, upto)?;
                    }
                    work.iter()
                        .map(|(key, batch)| apply_in(t, &catalog, &limits, key, batch))
                        .collect::<Result<Vec<_>>>()
                })
            })
            .await;
        match out {
            Ok(results) => {
                if let Some(upto) = published {
                    self.relay.note_deleted(upto);
                }
                metrics
                    .saga_commit_seconds
                    .observe(started.elapsed().as_secs_f64());
                metrics.saga_batch_size.observe(inputs as f64);
                for (reply, r) in replies.into_iter().zip(results) {
                    let _ = reply.send(Ok(r));
                }
            }
            Err(e) => {
                let why = e.to_string();
                for reply in replies {
                    let _ = reply.send(Err(StorageError::Task(why.clone())));
                }
            }
        }
    }
}

/// Applies inputs in one write transaction (blocking): those at or below the checkpoint of
/// `checkpoint_key` are skipped as already applied; the checkpoint advances to the last
/// one in the same commit. Returns the new checkpoint and what happened.
pub fn apply_inputs(
    store: &Store,
    catalog: &Catalog,
    limits: &Limits,
    checkpoint_key: &str,
    batch: &[(u64, RawInput)],
) -> Result<(u64, Tally)> {
    store.write_blocking(|t| apply_in(t, catalog, limits, checkpoint_key, batch))
}

/// [`apply_inputs`] inside the caller's transaction.
fn apply_in(
    t: &Tables<'_, libmdbx::RW>,
    catalog: &Catalog,
    limits: &Limits,
    checkpoint_key: &str,
    batch: &[(u64, RawInput)],
) -> Result<(u64, Tally)> {
    let cp = t.checkpoint(checkpoint_key)?;
    let mut p = Processor::new(catalog, limits, now_ms());
    let mut last = cp;
    for (seq, raw) in batch {
        if *seq <= last {
            continue;
        }
        p.input(t, raw)?;
        last = *seq;
    }
    if last > cp {
        t.set_checkpoint(checkpoint_key, last)?;
    }
    Ok((last, p.tally))
}
