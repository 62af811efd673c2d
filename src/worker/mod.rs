//! The saga worker: streams → engine → one libmdbx commit per batch.
//!
//! One consumer loop per input stream (aggregate events; effect results and workflow
//! events) and one timer loop.
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
//! to one committer task, which applies every batch waiting at that moment — from both
//! streams — in a single write transaction (each batch still advancing only its own
//! stream's checkpoint), commits once, and then answers each loop. A loop sends its next
//! batch only after the answer for the previous one, so each stream stays in order.
//!
//! **Backpressure.** Fetching pauses while the outbox holds more than
//! `saga.max_outbox_depth` records. A batch holds at most `saga.batch_size` inputs.
//!
//! **Drain.** On cancellation a loop finishes the batch in hand, commits it and returns.
//!
//! **Timers** are rows of the `schedule` table. The timer loop applies due timers through
//! the same [`process::Processor`] and commit discipline; the firing input's timestamp is
//! the timer's due time, so replays stay deterministic. A cancelled timer's row is deleted
//! in the transaction that cancels it, and the engine ignores a firing it no longer
//! expects, so a cancelled timer never fires.

pub mod process;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backoff::Backoff;
use crate::clock::now_ms;

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::broker::headers;
use crate::relay::RelayHandle;
use crate::runtime::AppState;
use crate::storage::tables::{DEFAULT_PARTITION, TimerEntry};
use process::{Limits, Processor, RawInput, Tally};

/// One input stream the worker reads.
#[derive(Debug, Clone)]
pub struct Input {
    /// Stream name.
    pub stream: String,
    /// Subject filters.
    pub filters: Vec<String>,
    /// Checkpoint key (`<consumer>:<stream>`).
    pub checkpoint: String,
}

/// The inputs of a saga worker, from config.
pub fn inputs(state: &AppState) -> Vec<Input> {
    let c = &state.config;
    let mk = |stream: &str, filters: &[&str]| Input {
        stream: stream.to_string(),
        filters: filters.iter().map(|f| f.to_string()).collect(),
        checkpoint: format!("{}:{stream}", c.consumers.saga),
    };
    vec![
        mk(&c.streams.aggregate_events, &["tenant.*.aggregate.>"]),
        mk(
            &c.streams.workflow_events,
            &["tenant.*.effect_result.>", "tenant.*.workflow_event.>"],
        ),
    ]
}

fn limits(state: &AppState) -> Limits {
    Limits::from_config(&state.config)
}

/// Spawns the consumer loops and the timer loop on `tracker`; they stop taking work when
/// `cancel` fires.
pub fn spawn(
    tracker: &TaskTracker,
    state: Arc<AppState>,
    relay: RelayHandle,
    cancel: CancellationToken,
) {
    let (committer, jobs) = tokio::sync::mpsc::channel(8);
    tracker.spawn(commit_loop(state.clone(), relay.clone(), jobs));
    for input in inputs(&state) {
        tracker.spawn(consume(
            state.clone(),
            input,
            relay.clone(),
            committer.clone(),
            cancel.clone(),
        ));
    }
    tracker.spawn(timers(state.clone(), relay, cancel.clone()));
    tracker.spawn(sweep_dedupe(state, cancel));
}

/// Markers examined per sweep transaction.
const SWEEP_CHUNK: usize = 10_000;

/// Deletes expired dedupe markers, a chunk per transaction, once a minute.
async fn sweep_dedupe(state: Arc<AppState>, cancel: CancellationToken) {
    let retention = state.config.saga.dedupe_retention.get().as_millis() as u64;
    let mut from: Vec<u8> = Vec::new();
    loop {
        let cutoff = now_ms().saturating_sub(retention);
        let start = std::mem::take(&mut from);
        match state
            .store
            .write(move |t| t.sweep_dedupe(cutoff, &start, SWEEP_CHUNK))
            .await
        {
            Ok((deleted, next)) => {
                if deleted > 0 {
                    tracing::debug!(message = "Expired dedupe markers deleted.", deleted);
                }
                if let Some(k) = next {
                    from = k;
                    continue;
                }
            }
            Err(e) => tracing::warn!(message = "Dedupe sweep failed; will retry.", error = %e),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(60)) => {}
        }
    }
}

fn record(state: &AppState, tally: &Tally) {
    let m = &state.metrics;
    for (saga, outcome, n) in &tally.transitions {
        m.saga_transitions
            .with_label_values(&[saga.as_str(), outcome])
            .inc_by(*n);
    }
    for k in &tally.dead_letters {
        m.deadletters.with_label_values(&[k]).inc();
    }
    m.saga_unrouted.inc_by(tally.unrouted);
}

/// What a batch commit returns: the new checkpoint and what happened.
type Committed = crate::storage::Result<(u64, Tally)>;

/// One consumer loop's batch, waiting for the committer.
struct Job {
    checkpoint: String,
    batch: Vec<(u64, RawInput)>,
    reply: tokio::sync::oneshot::Sender<Committed>,
}

/// Most batches merged into one transaction.
const MAX_MERGED: usize = 8;

/// The committer: applies every batch waiting, from any stream, in one write transaction
/// (plus the deletion of the outbox records the relay has published), commits once, and
/// answers each batch's loop. Ends when every consumer loop has ended.
async fn commit_loop(
    state: Arc<AppState>,
    relay: RelayHandle,
    mut jobs: tokio::sync::mpsc::Receiver<Job>,
) {
    let metrics = &state.metrics;
    while let Some(first) = jobs.recv().await {
        let mut merged = vec![first];
        while merged.len() < MAX_MERGED {
            match jobs.try_recv() {
                Ok(j) => merged.push(j),
                Err(_) => break,
            }
        }
        let started = Instant::now();
        let inputs: usize = merged.iter().map(|j| j.batch.len()).sum();
        let (replies, work): (Vec<_>, Vec<_>) = merged
            .into_iter()
            .map(|j| (j.reply, (j.checkpoint, j.batch)))
            .unzip();
        let catalog = state.catalog();
        let limits = limits(&state);
        let published = relay.deletable_through();
        let out = state
            .store
            .run(move |s| {
                s.write_blocking(|t| {
                    if let Some(upto) = published {
                        t.delete_outbox_through(DEFAULT_PARTITION, upto)?;
                    }
                    work.iter()
                        .map(|(key, batch)| apply_in(t, &catalog, &limits, key, batch))
                        .collect::<crate::storage::Result<Vec<_>>>()
                })
            })
            .await;
        match out {
            Ok(results) => {
                if let Some(upto) = published {
                    relay.note_deleted(upto);
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
                    let _ = reply.send(Err(crate::storage::StorageError::Task(why.clone())));
                }
            }
        }
    }
}

/// Hands a batch to the committer and waits until it is durably applied.
async fn commit(
    committer: &tokio::sync::mpsc::Sender<Job>,
    checkpoint: &str,
    batch: Vec<(u64, RawInput)>,
) -> Committed {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let gone = || crate::storage::StorageError::Task("the committer has stopped".into());
    committer
        .send(Job {
            checkpoint: checkpoint.to_string(),
            batch,
            reply,
        })
        .await
        .map_err(|_| gone())?;
    answer.await.map_err(|_| gone())?
}

/// Applies inputs in one write transaction (blocking): those at or below the checkpoint of
/// `checkpoint_key` are skipped as already applied; the checkpoint advances to the last
/// one in the same commit. Returns the new checkpoint and what happened.
pub fn apply_inputs(
    store: &crate::storage::Store,
    catalog: &crate::manifest::Catalog,
    limits: &Limits,
    checkpoint_key: &str,
    batch: &[(u64, RawInput)],
) -> crate::storage::Result<(u64, Tally)> {
    store.write_blocking(|t| apply_in(t, catalog, limits, checkpoint_key, batch))
}

fn apply_in(
    t: &crate::storage::Tables<'_, libmdbx::RW>,
    catalog: &crate::manifest::Catalog,
    limits: &Limits,
    checkpoint_key: &str,
    batch: &[(u64, RawInput)],
) -> crate::storage::Result<(u64, Tally)> {
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

async fn consume(
    state: Arc<AppState>,
    input: Input,
    relay: RelayHandle,
    committer: tokio::sync::mpsc::Sender<Job>,
    cancel: CancellationToken,
) {
    let batch_size = state.config.saga.batch_size;
    let max_depth = state.config.saga.max_outbox_depth;
    let metrics = &state.metrics;
    let mut backoff =
        Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).with_jitter();
    let mut connections = state.broker.connections();
    'connect: while !cancel.is_cancelled() {
        connections.mark_unchanged();
        let key = input.checkpoint.clone();
        let cp = match state.store.read(move |t| t.checkpoint(&key)).await {
            Ok(cp) => cp,
            Err(e) => {
                tracing::error!(message = "Cannot read checkpoint.", stream = %input.stream, error = %e);
                backoff.sleep(&cancel).await;
                continue;
            }
        };
        metrics
            .consumer_checkpoint
            .with_label_values(&[&input.stream])
            .set(cp as i64);
        let messages = async {
            let stream = state.broker.jetstream().get_stream(&input.stream).await?;
            let consumer = stream
                .create_consumer(OrderedConfig {
                    filter_subjects: input.filters.clone(),
                    deliver_policy: if cp == 0 {
                        DeliverPolicy::All
                    } else {
                        DeliverPolicy::ByStartSequence {
                            start_sequence: cp + 1,
                        }
                    },
                    ..OrderedConfig::default()
                })
                .await?;
            Ok::<_, async_nats::Error>(consumer.messages().await?)
        };
        let messages = tokio::select! {
            _ = cancel.cancelled() => return,
            m = messages => m,
        };
        let mut chunks = match messages {
            Ok(m) => m.ready_chunks(batch_size),
            Err(e) => {
                tracing::warn!(message = "Cannot open consumer; retrying.", stream = %input.stream, error = %e);
                backoff.sleep(&cancel).await;
                continue;
            }
        };
        tracing::info!(message = "Consuming.", stream = %input.stream, from_sequence = cp + 1);
        loop {
            // Backpressure: let the relay catch up before taking more work.
            loop {
                let depth = relay.unpublished();
                metrics.outbox_depth.set(depth as i64);
                if depth <= max_depth || cancel.is_cancelled() {
                    break;
                }
                relay.wake();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let next = tokio::select! {
                _ = cancel.cancelled() => {
                    tracing::info!(message = "Consumer stopped for the drain.", stream = %input.stream);
                    return;
                }
                Ok(()) = connections.changed() => {
                    tracing::info!(message = "NATS reconnected; reopening at the checkpoint.", stream = %input.stream);
                    continue 'connect;
                }
                c = chunks.next() => c,
            };
            let Some(chunk) = next else {
                tracing::warn!(message = "Consumer ended; reopening at the checkpoint.", stream = %input.stream);
                continue 'connect;
            };
            let mut batch = Vec::with_capacity(chunk.len());
            let mut failure = None;
            let mut lag = None;
            for item in chunk {
                match item {
                    Ok(msg) => {
                        let Ok(info) = msg.info() else { continue };
                        let seq = info.stream_sequence;
                        lag = Some(info.pending);
                        let traceparent = headers::traceparent(msg.headers.as_ref());
                        batch.push((
                            seq,
                            RawInput {
                                subject: msg.subject.to_string(),
                                body: msg.payload.to_vec(),
                                traceparent,
                                source: format!("{}:{seq}", input.stream),
                            },
                        ));
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            if !batch.is_empty() {
                let n = batch.len();
                match commit(&committer, &input.checkpoint, batch).await {
                    Ok((cp, tally)) => {
                        metrics
                            .saga_inputs
                            .with_label_values(&[&input.stream])
                            .inc_by(n as u64);
                        metrics
                            .consumer_checkpoint
                            .with_label_values(&[&input.stream])
                            .set(cp as i64);
                        if let Some(l) = lag {
                            metrics
                                .consumer_lag
                                .with_label_values(&[&input.stream])
                                .set(l as i64);
                        }
                        record(&state, &tally);
                        if tally.outbox > 0 {
                            relay.note_written(tally.last_outbox);
                            relay.wake();
                        }
                        backoff.reset();
                    }
                    Err(e) => {
                        tracing::error!(message = "Batch commit failed; re-reading from the checkpoint.", stream = %input.stream, error = %e);
                        backoff.sleep(&cancel).await;
                        continue 'connect;
                    }
                }
            }
            if let Some(e) = failure {
                tracing::warn!(message = "Consumer error; reopening at the checkpoint.", stream = %input.stream, error = %e);
                backoff.sleep(&cancel).await;
                continue 'connect;
            }
        }
    }
}

/// Most timers fired in one transaction.
const TIMER_BATCH: usize = 1024;

async fn timers(state: Arc<AppState>, relay: RelayHandle, cancel: CancellationToken) {
    let poll = state.config.saga.timer_poll.get();
    let metrics = &state.metrics;
    while !cancel.is_cancelled() {
        let now = now_ms();
        let peek = state
            .store
            .read(|t| Ok((t.next_timer_due()?, t.timers_pending()?)))
            .await;
        let (next_due, pending) = match peek {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(message = "Cannot read timers.", error = %e);
                (None, 0)
            }
        };
        metrics.timers_pending.set(pending as i64);
        if next_due.is_some_and(|d| d <= now) {
            let catalog = state.catalog();
            let limits = limits(&state);
            let fired = state
                .store
                .write(move |t| {
                    let due: Vec<TimerEntry> = t.due_timers(now, TIMER_BATCH)?;
                    let mut p = Processor::new(&catalog, &limits, now);
                    let mut lags = Vec::with_capacity(due.len());
                    for e in &due {
                        p.timer(t, e)?;
                        lags.push(now.saturating_sub(e.due_ms));
                    }
                    Ok((lags, p.tally))
                })
                .await;
            match fired {
                Ok((lags, tally)) => {
                    for l in &lags {
                        metrics.timer_fire_lag.observe(*l as f64 / 1000.0);
                    }
                    metrics.timers_fired.inc_by(lags.len() as u64);
                    record(&state, &tally);
                    if tally.outbox > 0 {
                        relay.note_written(tally.last_outbox);
                        relay.wake();
                    }
                    if lags.len() == TIMER_BATCH {
                        continue;
                    }
                }
                Err(e) => {
                    tracing::error!(message = "Firing timers failed; will retry.", error = %e)
                }
            }
        }
        let wait = next_due
            .map(|d| Duration::from_millis(d.saturating_sub(now_ms())))
            .unwrap_or(poll)
            .min(poll);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
