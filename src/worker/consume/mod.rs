//! The consuming loop: one per owned partition, from its part of the saga inbox
//! (`runner.inbox.<p>.>`) to the [`Committer`].
//!
//! A loop opens an ordered consumer at its committed checkpoint + 1, reads the inbox in
//! chunks of at most `saga.batch_size` messages and submits each chunk as one batch; while
//! a batch commits it reads the next one (at most `saga.batch_size` messages and the
//! loop's part of the node's read-ahead budget held: [`ReadAhead`], [`crate::readahead`]),
//! and submits that only after the commit's answer. It pauses while the outbox is deeper than `saga.max_outbox_depth`
//! (backpressure, read from the [`RelayHandle`]).
//!
//! Guarantees:
//! - **Resume at the checkpoint.** On any consumer error, NATS reconnection, end of the
//!   message stream or failed commit, the loop drops its consumer and opens a new one at the
//!   committed checkpoint + 1 (after a consumer error or a failed commit with [`Backoff`]
//!   between tries; after a reconnection at once), so no input is skipped and none is
//!   applied twice (the commit skips what the checkpoint already covers).
//! - **Liveness.** A consumer that has delivered nothing for `consumers.stall_check` while
//!   its stream holds a message for it past the last one read is reopened at once at the
//!   checkpoint, logged and counted; reopen attempts use `consumers.reopen_timeout`, so
//!   one made during a leader election fails fast ([`crate::broker::liveness`]).
//! - **Drain.** On cancellation the loop stops reading; a batch already submitted is
//!   committed and answered before the loop returns, since it waits for the answer.
//! - Metrics and the relay's wake-up follow a commit, never precede it.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the loop: opening a consumer, waiting for chunks, replays, reconnects and backoff |
//! | `chunk.rs` | consumer messages turned into inputs; which messages a reader wants |
//! | `submit.rs` | a chunk submitted to the committer in pieces, and what follows each answer |

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::{Ordered, OrderedConfig, OrderedError};
use futures::StreamExt;
use futures::stream::ReadyChunks;
use tokio_util::sync::CancellationToken;

use super::commit::{Committer, Scoped};
use super::pull::{PullSize, ReadAhead};
use crate::backoff::Backoff;
use crate::broker::liveness::{Liveness, Probe};
use crate::manifest::Catalog;
use crate::relay::RelayHandle;
use crate::runtime::AppState;
use chunk::{Chunk, read_chunk};

mod chunk;
mod submit;

pub(crate) use chunk::{body_of, server_filters, wanted};

/// A source stream of saga inputs, read by its router ([`super::ownership::router`]).
#[derive(Debug, Clone)]
pub struct Source {
    /// Stream name.
    pub stream: String,
    /// The subjects of saga inputs it captures; its routers read through the narrower
    /// filter the loaded triggers give ([`Source::filters_under`]).
    pub filters: Vec<String>,
}

impl Source {
    /// What a router of this source asks the server for while `catalog` is in force: one
    /// filter, the narrowest covering every trigger that can match a subject of this
    /// source ([`crate::broker::widen`]), so the server skips what no saga can want —
    /// another source's kind of event, a fence marker, an output no trigger names —
    /// instead of delivering it to every share. The source's own filters when no trigger
    /// can match any of its subjects (read and skipped, as a source nothing wants).
    pub fn filters_under(&self, catalog: &Catalog) -> Vec<String> {
        let wanted: Vec<String> = catalog
            .trigger_patterns()
            .map(|p| format!("tenant.*.{p}"))
            .filter(|t| self.filters.iter().any(|f| crate::broker::overlaps(f, t)))
            .collect();
        match crate::broker::widen(&wanted) {
            Some(one) => vec![one],
            None => self.filters.clone(),
        }
    }
}

/// The source streams of saga inputs, from config.
pub fn sources(state: &AppState) -> Vec<Source> {
    let c = &state.config;
    let mk = |stream: &str, filters: &[&str]| Source {
        stream: stream.to_string(),
        filters: filters.iter().map(|f| f.to_string()).collect(),
    };
    vec![
        mk(&c.streams.aggregate_events, &["tenant.*.aggregate.>"]),
        mk(
            &c.streams.workflow_events,
            &["tenant.*.effect_result.>", "tenant.*.workflow_event.>"],
        ),
    ]
}

/// The inbox part of one owned partition, as its loop reads it.
#[derive(Debug, Clone)]
pub(crate) struct Input {
    /// The inbox stream.
    pub stream: String,
    /// Its subject filter (`runner.inbox.<p>.>`).
    pub filters: Vec<String>,
    /// Checkpoint key (`<consumer>:<inbox>:<p>`).
    pub checkpoint: String,
    /// The partition read.
    pub scope: Scoped,
}

/// Longest pull of an ordered consumer; its idle heartbeat is half of it, so a consumer that
/// died with its server is recreated within about this long.
pub(crate) const ORDERED_PULL_EXPIRY: Duration = Duration::from_secs(4);

/// How long a consumer found stalled may still deliver before it is recreated (a message
/// published right at the probe may be on its way).
const STALL_GRACE: Duration = Duration::from_millis(500);

/// How often a loop held back by backpressure looks at the outbox depth again.
const BACKPRESSURE_POLL: Duration = Duration::from_millis(20);

/// The consumer a loop reads: its partition's ordered consumer, chunked, read ahead while a
/// batch commits.
type Reader = ReadAhead<ReadyChunks<Ordered>, Result<Message, OrderedError>>;

/// What a loop does once its consumer is given up.
enum Next {
    /// Open a new consumer at the committed checkpoint + 1 (any backoff already slept).
    Reopen,
    /// Return: the drain has begun.
    Stop,
}

/// What waiting for the next chunk gave.
enum Read {
    /// Messages from the consumer.
    Chunk(Vec<Result<Message, OrderedError>>),
    /// Nothing yet (a replay was asked for, or the stall probe found nothing waiting):
    /// look again.
    Again,
    /// The consumer is given up.
    Done(Next),
}

/// The consuming loop of one partition: what it keeps from one consumer to the next.
struct Loop {
    state: Arc<AppState>,
    input: Input,
    relay: RelayHandle,
    committer: Committer,
    cancel: CancellationToken,
    /// Inputs read per batch (`saga.batch_size`).
    batch_size: usize,
    /// Body bytes submitted per batch at most (`saga.max_batch_bytes`).
    max_batch_bytes: usize,
    /// The pull's count, and the payload bytes read ahead at most: this loop's part of the
    /// node's read-ahead budget.
    pull: PullSize,
    /// Between tries after a consumer error or a failed commit; reset by a commit.
    backoff: Backoff,
    /// Changes on each NATS reconnection.
    connections: tokio::sync::watch::Receiver<u64>,
    liveness: Liveness,
    /// The consumer's name in liveness logs and metrics.
    label: String,
}

/// Reads `input` into the committer until `cancel` fires.
pub(crate) async fn run(
    state: Arc<AppState>,
    input: Input,
    relay: RelayHandle,
    committer: Committer,
    cancel: CancellationToken,
) {
    let mut l = Loop::new(state, input, relay, committer, cancel);
    while !l.cancel.is_cancelled() {
        l.connections.mark_unchanged();
        let next = match l.open().await {
            Ok((reader, cp)) => l.consume(reader, cp).await,
            Err(next) => next,
        };
        if let Next::Stop = next {
            return;
        }
    }
}

impl Loop {
    fn new(
        state: Arc<AppState>,
        input: Input,
        relay: RelayHandle,
        committer: Committer,
        cancel: CancellationToken,
    ) -> Self {
        let saga = &state.config.saga;
        let liveness = Liveness::new(
            state.broker.jetstream(),
            &state.metrics.registry,
            state.config.consumers.stall_check.get(),
            state.config.consumers.reopen_timeout.get(),
        );
        Self {
            batch_size: saga.batch_size,
            max_batch_bytes: usize::try_from(saga.max_batch_bytes.get()).unwrap_or(usize::MAX),
            pull: PullSize::new(state.readahead.part()),
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).with_jitter(),
            connections: state.broker.connections(),
            liveness,
            label: format!("saga:{}:{}", input.stream, input.scope.partition),
            state,
            input,
            relay,
            committer,
            cancel,
        }
    }

    /// Opens an ordered consumer at the committed checkpoint + 1: the reader and that
    /// checkpoint, or, when the checkpoint cannot be read or the consumer opened, what to do
    /// instead (after a backoff, reopen; on cancellation, stop).
    async fn open(&mut self) -> Result<(Reader, u64), Next> {
        let input = &self.input;
        let key = input.checkpoint.clone();
        let cp = match self.state.store.read(move |t| t.checkpoint(&key)).await {
            Ok(cp) => cp,
            Err(e) => {
                tracing::error!(message = "Cannot read checkpoint.", stream = %input.stream, error = %e);
                self.backoff.sleep(&self.cancel).await;
                return Err(Next::Reopen);
            }
        };
        checkpoint_gauge(&self.state.metrics, input, cp);
        let pull = &mut self.pull;
        let liveness = &self.liveness;
        let messages = async {
            let stream = liveness.context().get_stream(&input.stream).await?;
            let consumer = stream
                .create_consumer(OrderedConfig {
                    filter_subjects: server_filters(&input.filters),
                    deliver_policy: if cp == 0 {
                        DeliverPolicy::All
                    } else {
                        DeliverPolicy::ByStartSequence {
                            start_sequence: cp + 1,
                        }
                    },
                    // Short pulls: a consumer lost with its server (a stream leader that
                    // died) is noticed by missed heartbeats within seconds, not after the
                    // default 30 s pull expiry.
                    max_expires: ORDERED_PULL_EXPIRY,
                    max_batch: pull.open(),
                    ..OrderedConfig::default()
                })
                .await?;
            Ok::<_, async_nats::Error>(consumer.messages().await?)
        };
        let messages = tokio::select! {
            _ = self.cancel.cancelled() => return Err(Next::Stop),
            m = messages => m,
        };
        let (batch_size, max_pull_bytes) = (self.batch_size, self.pull.bytes());
        let reader = match messages {
            Ok(m) => ReadAhead::new(m.ready_chunks(batch_size), batch_size, max_pull_bytes),
            Err(e) => {
                tracing::warn!(message = "Cannot open consumer; retrying.", stream = %input.stream, error = %e);
                self.backoff.sleep(&self.cancel).await;
                return Err(Next::Reopen);
            }
        };
        tracing::info!(message = "Consuming.", stream = %input.stream, from_sequence = cp + 1);
        Ok((reader, cp))
    }

    /// Reads `reader`, opened at checkpoint `cp`, batch after batch into the committer until
    /// the consumer is given up: on a replay, a reconnection, a stall, a rewind, the end of
    /// the messages, a consumer error, a failed commit or a new pull size (reopen), or on
    /// cancellation (stop).
    async fn consume(&mut self, mut reader: Reader, cp: u64) -> Next {
        // The last stream sequence read from this consumer (the probe asks what lies past it).
        let mut position = cp;
        loop {
            if let Some(from) = self.state.replays.take(self.input.scope.partition) {
                self.replay(from).await;
                return Next::Reopen;
            }
            wait_for_relay(&self.state, &self.relay, &self.cancel).await;
            let chunk = match self.next_chunk(&mut reader, position).await {
                Read::Chunk(chunk) => chunk,
                Read::Again => continue,
                Read::Done(next) => return next,
            };
            let input = &self.input;
            let Chunk {
                batch,
                failure,
                lag,
            } = read_chunk(
                &input.stream,
                &input.filters,
                chunk,
                &self.state.metrics.input_wait,
            );
            // A consumer that went back (async-nats restarts an ordered consumer from the
            // stream's start when it had delivered nothing yet) would have the whole stream
            // read again: reopen at the checkpoint instead.
            if let Some((seq, _)) = batch.first()
                && *seq <= position
            {
                let detail = format!("delivered {seq} after {position}");
                self.liveness.rewound(&self.label, &detail);
                return Next::Reopen;
            }
            if let Some((seq, _)) = batch.last() {
                position = position.max(*seq);
            }
            self.pull.observe(batch.iter().map(|(_, r)| r.body.len()));
            if let Err(next) = self.submit(&mut reader, batch, lag).await {
                return next;
            }
            if let Some(e) = failure {
                tracing::warn!(message = "Consumer error; reopening at the checkpoint.", stream = %self.input.stream, error = %e);
                self.backoff.sleep(&self.cancel).await;
                return Next::Reopen;
            }
            if self.pull.should_reopen() {
                // What is committed is the checkpoint: reopening there loses nothing.
                tracing::debug!(message = "Input sizes changed; reopening with another pull size.", stream = %self.input.stream, pull = self.pull.wanted());
                return Next::Reopen;
            }
        }
    }

    /// An operator's replay (`replay.rs`) from inbox sequence `from`: moves the checkpoint
    /// back to `from - 1` (never forward) and counts what lies up to where it was as replayed;
    /// the caller then reopens there.
    async fn replay(&mut self, from: u64) {
        let s = &mut self.input.scope;
        let key = self.input.checkpoint.clone();
        let back = from.saturating_sub(1);
        match self
            .state
            .store
            .write(move |t| {
                let cp = t.checkpoint(&key)?;
                if back < cp {
                    t.set_checkpoint(&key, back)?;
                }
                Ok(cp)
            })
            .await
        {
            Ok(was) => {
                s.replay_until = s.replay_until.max(was);
                tracing::warn!(
                    message = "Replaying the partition from an operator's request.",
                    partition = s.partition,
                    from_sequence = from,
                    checkpoint_was = was
                );
            }
            Err(e) => {
                tracing::error!(message = "Cannot move the checkpoint back for a replay; not replaying.", partition = s.partition, error = %e);
            }
        }
    }

    /// Waits for the next chunk of `reader`, whose last message read is `position`, while
    /// watching for a replay, the drain, a NATS reconnection and a stalled consumer (one
    /// that delivers nothing while its stream holds a message for it past `position`).
    async fn next_chunk(&mut self, reader: &mut Reader, position: u64) -> Read {
        let input = &self.input;
        let liveness = &self.liveness;
        let next = tokio::select! {
            _ = self.state.replays.asked() => return Read::Again,
            _ = self.cancel.cancelled() => {
                tracing::info!(message = "Consumer stopped for the drain.", stream = %input.stream);
                return Read::Done(Next::Stop);
            }
            Ok(()) = self.connections.changed() => {
                tracing::info!(message = "NATS reconnected; reopening at the checkpoint.", stream = %input.stream);
                return Read::Done(Next::Reopen);
            }
            c = reader.next() => c,
            _ = tokio::time::sleep(liveness.stall_check()) => {
                let Probe::Pending(seq) =
                    liveness.probe(&input.stream, &input.filters, position).await
                else {
                    return Read::Again;
                };
                // A message published just now may be on its way: give it a moment.
                match tokio::time::timeout(STALL_GRACE, reader.next()).await {
                    Ok(c) => c,
                    Err(_) => {
                        let detail = format!("message {seq} waits past sequence {position}");
                        liveness.recreating(&self.label, "stalled", &detail);
                        return Read::Done(Next::Reopen);
                    }
                }
            }
        };
        match next {
            Some(chunk) => Read::Chunk(chunk),
            None => {
                tracing::warn!(message = "Consumer ended; reopening at the checkpoint.", stream = %input.stream);
                Read::Done(Next::Reopen)
            }
        }
    }
}

/// Sets the checkpoint gauge of `input`'s partition (every partition reads the same inbox
/// stream, so one stream-labelled gauge would hold whichever partition wrote last).
fn checkpoint_gauge(metrics: &crate::telemetry::Metrics, input: &Input, cp: u64) {
    metrics
        .partition_checkpoint
        .with_label_values(&[&input.scope.partition.to_string()])
        .set(cp as i64);
}

/// Backpressure: waits while the node's outboxes hold more than `saga.max_outbox_depth`
/// records not yet acknowledged by JetStream (as its relays report them, over every owned
/// partition: [`crate::relay::Relays`]), waking this loop's relay, unless `cancel` has fired.
async fn wait_for_relay(state: &AppState, relay: &RelayHandle, cancel: &CancellationToken) {
    let max_depth = state.config.saga.max_outbox_depth;
    loop {
        let depth = state.relays.unpublished();
        state.metrics.outbox_depth.set(depth as i64);
        if depth <= max_depth || cancel.is_cancelled() {
            return;
        }
        relay.wake();
        tokio::time::sleep(BACKPRESSURE_POLL).await;
    }
}
