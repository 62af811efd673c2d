//! The fenced relay of one owned partition (partitioned mode): the partition's outbox →
//! JetStream, through fenced atomic batches (DESIGN §8.4, §8.6).
//!
//! The partition's records are read in outbox order and cut into runs of consecutive
//! records bound for the same stream. Each run goes out as one atomic batch (cut at the
//! batch limit): the records, the first carrying this owner's fence headers for that
//! stream (`runner.fence.<stream>.<p>`), then a marker whose watermark is the cause of the
//! run's last record. One batch is in flight per partition; runs go out in order. Runs of
//! several partitions ready at once share one atomic batch (`combine.rs`), each part with
//! its own fence headers and marker.
//!
//! **Guarantees.**
//! - **Nothing from a former owner.** Once a newer owner raised its fence, every batch of
//!   ours is refused whole by the broker; the relay returns [`Fenced`] and stores nothing.
//! - **Nothing twice, without the de-duplication window.** A record whose cause is at or
//!   below the stream's watermark (what this partition's owners, this one included, have
//!   stored) is not published again: a new owner replaying inputs its predecessor had
//!   already published skips their records ([`crate::telemetry::Metrics::relay_suppressed`]).
//!   The watermark and the records it covers are stored in one atomic batch, so it is exact.
//! - **Nothing lost.** A record is acknowledged to the worker ([`RelayHandle`]) only after
//!   its batch is stored (or it was found covered by the watermark); a batch whose answer
//!   is lost is checked against the fence before it is sent again.
//!
//! An effect command carries the partition (`Runner-Partition`): its executor publishes the
//! result straight into this partition's inbox, where no router has to copy it.
//!
//! On `stop` it publishes until the partition's outbox is empty, then returns.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::Context;
use tokio_util::sync::CancellationToken;

use super::combine::Combiner;
use super::{RelayHandle, headers};
use crate::backoff::Backoff;
use crate::broker::batch::{BatchMessage, MAX_MESSAGES};
use crate::broker::fence::{Fence, Position};
use crate::broker::fenced_batch::{self, Part, PartOutcome};
use crate::storage::Store;
use crate::storage::tables::OutboxRecord;
use crate::telemetry::Metrics;

/// The partition's fence was raised by a newer owner: stop working on it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("partition {partition} is fenced off in stream {stream}")]
pub struct Fenced {
    /// The partition.
    pub partition: u32,
    /// The stream whose fence moved.
    pub stream: String,
}

/// Names the stream a subject is stored in.
pub type StreamOf = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The relay of one owned partition.
pub struct PartitionRelay {
    /// JetStream (fence reads).
    pub js: Context,
    /// The connection batches go out on.
    pub client: Client,
    /// Storage.
    pub store: Store,
    /// Metrics.
    pub metrics: Metrics,
    /// The partition.
    pub partition: u32,
    /// The partition's handle, shared with its consumer loop.
    pub handle: RelayHandle,
    /// This owner's fence in each stream the partition publishes to, by stream name.
    pub fences: HashMap<String, Fence>,
    /// The stream each subject goes to.
    pub stream_of: StreamOf,
    /// Records read per round.
    pub window: usize,
    /// Poll interval when nothing woke the relay.
    pub poll: Duration,
    /// How long to wait for a batch's answer.
    pub timeout: Duration,
    /// Batches shared with this process's other partition relays (replicated streams).
    pub shared: Arc<Combiner>,
    /// How fenced records travel ([`fenced_batch::Transport`], by the streams' replicas).
    pub transport: fenced_batch::Transport,
}

impl PartitionRelay {
    /// Publishes the partition's outbox until `stop` fires and the outbox is empty, or until
    /// the partition is fenced off.
    pub async fn run(mut self, stop: CancellationToken) -> Result<(), Fenced> {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        let p = self.partition as u16;
        loop {
            let stopping = stop.is_cancelled();
            let from = self.handle.acked.load(Ordering::SeqCst) + 1;
            let window = self.window;
            let records = match self
                .store
                .read(move |t| t.outbox_batch(p, from, window))
                .await
            {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(message = "Relay cannot read the outbox.", partition = p, error = %e);
                    tokio::time::sleep(backoff.next_wait()).await;
                    continue;
                }
            };
            let max = self.client.server_info().max_payload;
            if records
                .iter()
                .any(|(_, r)| super::park::unpublishable(r, max).is_some())
            {
                if let Err(e) =
                    super::park::screen(&self.store, &self.metrics, p, &records, max).await
                {
                    tracing::error!(message = "Relay cannot park an unpublishable output.", partition = p, error = %e);
                    tokio::time::sleep(backoff.next_wait()).await;
                }
                continue;
            }
            if records.is_empty() {
                if stopping {
                    self.delete_published().await;
                    self.metrics.stalls.gone(&self.stage());
                    return Ok(());
                }
                if self.handle.idle(self.poll, &stop).await {
                    self.delete_published().await;
                }
                continue;
            }
            for run in runs(&records, &*self.stream_of) {
                let n = run.records.len() as u64;
                match self.send_run(run).await {
                    Ok(through) => {
                        self.handle.acked.fetch_max(through, Ordering::SeqCst);
                        self.handle.note_published(n);
                        self.metrics.stalls.progressed(&self.stage());
                        backoff.reset();
                    }
                    Err(Outcome::Fenced(f)) => {
                        self.metrics.stalls.gone(&self.stage());
                        return Err(f);
                    }
                    Err(Outcome::Retry) => {
                        self.metrics
                            .stalls
                            .failed(&self.stage(), "a batch was not stored (see the log)");
                        self.metrics.relay_errors.inc();
                        tokio::time::sleep(backoff.next_wait()).await;
                        break;
                    }
                }
            }
        }
    }

    /// This relay's name among the stalled stages ([`crate::telemetry::stall`]).
    fn stage(&self) -> String {
        format!("relay.p{}", self.partition)
    }

    /// Publishes one run; returns the outbox sequence through which it is stored.
    async fn send_run(&mut self, run: Run<'_>) -> Result<u64, Outcome> {
        let last_seq = run.records.last().map_or(0, |(s, _)| *s);
        let Some(stream) = run.stream else {
            // No stream of Runner's captures it: nothing can fence it; publish as is.
            for (_, rec) in run.records {
                let ack = self
                    .js
                    .publish_with_headers(
                        rec.subject.clone(),
                        headers(rec),
                        rec.body.clone().into(),
                    )
                    .await;
                if let Err(e) = async { ack?.await.map_err(async_nats::Error::from) }.await {
                    tracing::warn!(message = "Unfenced publish failed.", subject = %rec.subject, error = %e);
                    return Err(Outcome::Retry);
                }
            }
            return Ok(last_seq);
        };
        let Some(fence) = self.fences.get(&stream) else {
            tracing::error!(message = "No fence for a stream this partition publishes to.", stream = %stream, partition = self.partition);
            return Err(Outcome::Retry);
        };
        let through = fence.through();
        let fresh: Vec<&(u64, OutboxRecord)> = run
            .records
            .iter()
            .filter(|(_, r)| through.is_none_or(|t| cause(r) > t))
            .collect();
        self.metrics
            .relay_suppressed
            .inc_by((run.records.len() - fresh.len()) as u64);
        for chunk in fresh.chunks(MAX_MESSAGES - 1) {
            let messages: Vec<BatchMessage> = chunk
                .iter()
                .map(|(_, r)| BatchMessage {
                    subject: r.subject.clone(),
                    headers: self.headers(r),
                    payload: r.body.clone().into(),
                })
                .collect();
            let position = chunk.last().map_or(Position::default(), |(_, r)| cause(r));
            self.publish(&stream, messages, position).await?;
            self.metrics.relay_published.inc_by(chunk.len() as u64);
        }
        Ok(last_seq)
    }

    /// Publishes `messages` and a marker at `position` under this partition's fence in
    /// `stream`: as a round, or as an atomic batch shared with the other partitions' relays.
    async fn publish(
        &mut self,
        stream: &str,
        messages: Vec<BatchMessage>,
        position: Position,
    ) -> Result<(), Outcome> {
        let started = std::time::Instant::now();
        let fence = self.fences.get_mut(stream).ok_or(Outcome::Retry)?;
        let outcome = match self.transport {
            fenced_batch::Transport::Round => {
                self.transport
                    .publish(
                        &self.js,
                        &self.client,
                        fence,
                        &messages,
                        position,
                        self.timeout,
                    )
                    .await
            }
            fenced_batch::Transport::Batch => {
                // Shared with the other partitions' relays when they publish at the same
                // time (`combine.rs`); a part that did not go out shared goes alone, decided
                // by the fence.
                let part = Part {
                    fence: fence.clone(),
                    messages: messages.clone(),
                    position,
                    expect: true,
                };
                match self
                    .shared
                    .publish(&self.client, stream, part, self.timeout)
                    .await
                {
                    PartOutcome::Stored(seq) => {
                        fence.advance(seq, Some(position));
                        fenced_batch::Outcome::Stored
                    }
                    PartOutcome::Alone => {
                        fenced_batch::publish(
                            &self.js,
                            &self.client,
                            fence,
                            &messages,
                            position,
                            self.timeout,
                        )
                        .await
                    }
                }
            }
        };
        match outcome {
            fenced_batch::Outcome::Stored => {
                self.metrics
                    .relay_window_seconds
                    .observe(started.elapsed().as_secs_f64());
                Ok(())
            }
            fenced_batch::Outcome::Fenced => {
                self.metrics.fenced_rejections.inc();
                Err(Outcome::Fenced(Fenced {
                    partition: self.partition,
                    stream: stream.to_string(),
                }))
            }
            fenced_batch::Outcome::Retry(why) => {
                tracing::warn!(message = "Relay batch not stored; will retry.", partition = self.partition, stream = %stream, error = %why);
                Err(Outcome::Retry)
            }
        }
    }

    /// A record's headers; an effect command also names this partition, so its result is
    /// published straight into this partition's inbox (`crate::effect`, step 4).
    fn headers(&self, r: &OutboxRecord) -> async_nats::HeaderMap {
        let mut h = headers(r);
        if r.subject.split('.').nth(2) == Some("effect") {
            h.insert(
                crate::broker::headers::REPLY_PARTITION,
                self.partition.to_string().as_str(),
            );
        }
        h
    }

    /// Deletes what is published and not yet deleted, in a transaction of its own.
    async fn delete_published(&self) {
        self.handle
            .delete_published(&self.store, self.partition as u16)
            .await;
    }
}

/// How a run went wrong.
enum Outcome {
    Fenced(Fenced),
    Retry,
}

/// Consecutive records bound for one stream.
struct Run<'a> {
    stream: Option<String>,
    records: &'a [(u64, OutboxRecord)],
}

/// Cuts `records` into runs of consecutive records bound for the same stream.
fn runs<'a>(
    records: &'a [(u64, OutboxRecord)],
    stream_of: &dyn Fn(&str) -> Option<String>,
) -> Vec<Run<'a>> {
    let mut out: Vec<Run<'a>> = Vec::new();
    let mut start = 0;
    let mut current = records.first().and_then(|(_, r)| stream_of(&r.subject));
    for i in 1..=records.len() {
        let next = records.get(i).map(|(_, r)| stream_of(&r.subject));
        if next.as_ref() != Some(&current) {
            out.push(Run {
                stream: current.clone(),
                records: &records[start..i],
            });
            start = i;
            if let Some(n) = next {
                current = n;
            }
        }
    }
    out
}

fn cause(r: &OutboxRecord) -> Position {
    Position {
        seq: r.cause.0,
        ord: r.cause.1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(subject: &str) -> (u64, OutboxRecord) {
        (
            0,
            OutboxRecord {
                subject: subject.into(),
                msg_id: String::new(),
                tenant: "t".into(),
                traceparent: None,
                body: String::new(),
                cause: (0, 0),
            },
        )
    }

    #[test]
    fn runs_split_where_the_stream_changes() {
        let records = vec![rec("a.1"), rec("a.2"), rec("b.1"), rec("a.3")];
        let of = |s: &str| Some(s[..1].to_string());
        let r = runs(&records, &of);
        let shape: Vec<(Option<String>, usize)> = r
            .iter()
            .map(|r| (r.stream.clone(), r.records.len()))
            .collect();
        assert_eq!(
            shape,
            vec![
                (Some("a".into()), 2),
                (Some("b".into()), 1),
                (Some("a".into()), 1)
            ]
        );
        assert!(runs(&[], &of).is_empty());
    }
}
