//! The fenced relay of one owned partition: the partition's outbox → JetStream, under the
//! partition's fence in each stream (DESIGN §8.4, §8.6).
//!
//! The partition's records are read a window at a time, in outbox order, and split by the
//! stream each goes to; each stream's records keep their order (nothing orders two streams
//! for a reader), and the streams of a window go out side by side. A stream's records go out
//! under this owner's fence for that stream (`runner.fence.<stream>.<p>`), followed by a
//! marker whose watermark is the cause of its last record; the transport follows the
//! stream's replicas ([`fenced_batch::Transport`]): a fenced round on one replica, an atomic
//! batch on a replicated stream, shared with the other partitions' relays publishing at the
//! same moment (`combine.rs`). One window is in flight per partition.
//!
//! **Guarantees.**
//! - **Nothing from a former owner.** Once a newer owner raised its fence, every publish of
//!   ours is refused by the broker; the relay returns [`Fenced`] and stops.
//! - **Nothing twice.** A record whose cause is at or below the stream's watermark (what
//!   this partition's owners, this one included, have stored) is not published again: a
//!   new owner replaying inputs its predecessor had already published skips their records
//!   ([`crate::telemetry::Metrics::relay_suppressed`]). A marker is stored only once every
//!   record it covers is (in the same atomic batch, or after their acknowledgements in a
//!   round), so the watermark never claims too much; what a crash leaves stored above it
//!   is at most the last round's, which a successor re-sends under the same
//!   `Nats-Msg-Id` (`crate::broker::fenced_round`).
//! - **Nothing lost.** A record is acknowledged to the worker ([`RelayHandle`]) only after
//!   its window is stored (or found covered by the watermark); a window whose answer is
//!   lost is checked against the fence before it is sent again.
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
use crate::broker::fenced_round::{self, RELAY_MARK_EVERY};
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
        // The largest message each stream takes; read again after every failed window.
        let mut sizes = self.stream_limits().await;
        // What an earlier relay of this partition kept is not known to be complete.
        let claim = self.handle.fresh_lock().claim();
        loop {
            let stopping = stop.is_cancelled();
            let from = self.handle.acked.load(Ordering::SeqCst) + 1;
            let records = match self.next_window(claim, from).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(message = "Relay cannot read the outbox.", partition = p, error = %e);
                    tokio::time::sleep(backoff.next_wait()).await;
                    continue;
                }
            };
            let server = self.client.server_info().max_payload;
            let max = |r: &OutboxRecord| {
                let stream = (self.stream_of)(&r.subject).and_then(|n| sizes.get(&n).copied());
                match stream {
                    Some(l) if server == 0 || l < server => l,
                    _ => server,
                }
            };
            if records
                .iter()
                .any(|(_, r)| super::park::unpublishable(r, max(r)).is_some())
            {
                // The store is about to hold a dead letter in an output's place.
                self.handle.fresh_lock().forget_for(claim);
                if let Err(e) =
                    super::park::screen(&self.store, &self.metrics, p, &records, max).await
                {
                    tracing::error!(message = "Relay cannot park an unpublishable output.", partition = p, error = %e);
                    tokio::time::sleep(backoff.next_wait()).await;
                }
                continue;
            }
            if records.is_empty() {
                // Nothing waits to be published: no tenant's bytes do either.
                self.handle.note_drained();
                // Nothing to send: once no new work came for a marking interval (or at
                // once when stopping), cover what the last rounds stored with a marker.
                let unmarked = self.fences.values().any(|f| f.unmarked().is_some());
                if unmarked
                    && (stopping || self.handle.idle(RELAY_MARK_EVERY, &stop).await)
                    && let Err(f) = self.mark_all().await
                {
                    self.metrics.stalls.gone(&self.stage());
                    return Err(f);
                }
                if unmarked && !stopping {
                    continue;
                }
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
            let n = records.len() as u64;
            let last = records.last().map_or(0, |(s, _)| *s);
            match self.send_window(&records).await {
                Ok(()) => {
                    self.handle.acked.fetch_max(last, Ordering::SeqCst);
                    self.handle.note_published(n);
                    self.handle
                        .note_bytes_published(records.iter().map(|(_, r)| r));
                    self.metrics.stalls.progressed(&self.stage());
                    backoff.reset();
                }
                Err(Outcome::Fenced(f)) => {
                    self.metrics.stalls.gone(&self.stage());
                    return Err(f);
                }
                Err(Outcome::Retry(why)) => {
                    // The window's records left memory with it: read them again.
                    self.handle.fresh_lock().forget_for(claim);
                    self.metrics.stalls.failed(&self.stage(), &why);
                    self.metrics.relay_errors.inc();
                    tokio::time::sleep(backoff.next_wait()).await;
                    // A stream's limit may have shrunk under a record: screen again.
                    sizes = self.stream_limits().await;
                }
            }
        }
    }

    /// The next window of records from sequence `from`: from memory when it holds every
    /// record left (`fresh.rs`), otherwise read from the store.
    async fn next_window(
        &self,
        claim: u64,
        from: u64,
    ) -> Result<Vec<(u64, OutboxRecord)>, crate::storage::StorageError> {
        let window = self.window;
        {
            let mut fresh = self.handle.fresh_lock();
            if let Some(records) = fresh.window(claim, from, window, self.handle.written()) {
                return Ok(records);
            }
            // Kept from here on; a commit handed over before this is durable and read below.
            fresh.collect(claim);
        }
        let p = self.partition as u16;
        let records = self
            .store
            .read(move |t| t.outbox_batch(p, from, window))
            .await?;
        if records.len() < window {
            let last = records.last().map_or(0, |(s, _)| *s);
            self.handle.fresh_lock().read_through(claim, last);
        }
        Ok(records)
    }

    /// The largest message (`max_msg_size`) of each stream this partition publishes to
    /// that sets one; a stream that cannot be read now is left out (the server's limit
    /// applies to it until the next read).
    async fn stream_limits(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for stream in self.fences.keys() {
            if let Ok(s) = self.js.get_stream(stream).await
                && let Ok(l) = usize::try_from(s.cached_info().config.max_message_size)
                && l > 0
            {
                out.insert(stream.clone(), l);
            }
        }
        out
    }

    /// This relay's name among the stalled stages ([`crate::telemetry::stall`]).
    fn stage(&self) -> String {
        format!("relay.p{}", self.partition)
    }

    /// Publishes one window of records: each stream's records in outbox order, the
    /// streams side by side (nothing orders two streams for a reader), each ending with
    /// its marker. Records a stream's watermark already covers are skipped.
    async fn send_window(&mut self, records: &[(u64, OutboxRecord)]) -> Result<(), Outcome> {
        let mut groups = by_stream(records, &*self.stream_of);
        if let Some(unfenced) = groups.remove(&None) {
            // No stream of Runner's captures them: nothing can fence them; publish as is.
            for (_, rec) in unfenced {
                let ack = self
                    .js
                    .publish_with_headers(
                        rec.subject.clone(),
                        headers(rec),
                        rec.body.clone().into(),
                    )
                    .await;
                if let Err(e) = async { ack?.await.map_err(async_nats::Error::from) }.await {
                    super::election::publish_failed("unfenced publish", &e);
                    return Err(Outcome::Retry(format!("unfenced publish: {e}")));
                }
            }
        }
        let sender = Sender {
            js: &self.js,
            client: &self.client,
            metrics: &self.metrics,
            shared: &self.shared,
            transport: self.transport,
            partition: self.partition,
            timeout: self.timeout,
        };
        let mut sends = Vec::with_capacity(groups.len());
        for (stream, fence) in &mut self.fences {
            if let Some(recs) = groups.remove(&Some(stream.clone())) {
                sends.push(sender.stream(stream, fence, recs));
            }
        }
        if let Some((Some(stream), _)) = groups.into_iter().next() {
            tracing::error!(message = "No fence for a stream this partition publishes to.", stream = %stream, partition = self.partition);
            return Err(Outcome::Retry(format!("no fence for stream {stream}")));
        }
        let mut outcome = Ok(());
        for r in futures::future::join_all(sends).await {
            match (r, &outcome) {
                (Err(Outcome::Fenced(f)), _) => outcome = Err(Outcome::Fenced(f)),
                (Err(Outcome::Retry(why)), Ok(())) => outcome = Err(Outcome::Retry(why)),
                _ => {}
            }
        }
        outcome
    }

    /// Stores a marker on every fence with rounds stored and not yet marked.
    async fn mark_all(&mut self) -> Result<(), Fenced> {
        for (stream, fence) in &mut self.fences {
            match fenced_round::mark(&self.js, fence).await {
                fenced_batch::Outcome::Stored => {}
                fenced_batch::Outcome::Fenced => {
                    self.metrics.fenced_rejections.inc();
                    return Err(Fenced {
                        partition: self.partition,
                        stream: stream.clone(),
                    });
                }
                // Marked by a later try (the next idle turn, or the next round's marker).
                fenced_batch::Outcome::Retry(why) => {
                    tracing::debug!(message = "Marker not stored; will try again.", partition = self.partition, stream = %stream, error = %why);
                }
            }
        }
        Ok(())
    }

    /// Deletes what is published and not yet deleted, in a transaction of its own.
    async fn delete_published(&self) {
        self.handle
            .delete_published(&self.store, self.partition as u16)
            .await;
    }
}

/// How a window went wrong.
enum Outcome {
    Fenced(Fenced),
    /// Not stored, or not known to be; why.
    Retry(String),
}

/// What one window's publishes share.
struct Sender<'a> {
    js: &'a Context,
    client: &'a Client,
    metrics: &'a Metrics,
    shared: &'a Arc<Combiner>,
    transport: fenced_batch::Transport,
    partition: u32,
    timeout: Duration,
}

impl Sender<'_> {
    /// Publishes one stream's records of a window under `fence`, in order, each chunk
    /// ending with its marker.
    async fn stream(
        &self,
        stream: &str,
        fence: &mut Fence,
        records: Vec<&(u64, OutboxRecord)>,
    ) -> Result<(), Outcome> {
        let through = fence.through();
        let total = records.len();
        let fresh: Vec<&(u64, OutboxRecord)> = records
            .into_iter()
            .filter(|(_, r)| through.is_none_or(|t| cause(r) > t))
            .collect();
        self.metrics
            .relay_suppressed
            .inc_by((total - fresh.len()) as u64);
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
            self.publish(stream, fence, messages, position).await?;
            self.metrics.relay_published.inc_by(chunk.len() as u64);
        }
        Ok(())
    }

    /// Publishes `messages` and a marker at `position` under `fence` in `stream`: as a
    /// round, or as an atomic batch shared with the other partitions' relays.
    async fn publish(
        &self,
        stream: &str,
        fence: &mut Fence,
        messages: Vec<BatchMessage>,
        position: Position,
    ) -> Result<(), Outcome> {
        let started = std::time::Instant::now();
        let outcome = match self.transport {
            fenced_batch::Transport::Round => {
                fenced_round::publish(
                    self.js,
                    fence,
                    &messages,
                    position,
                    self.timeout,
                    RELAY_MARK_EVERY,
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
                    .publish(self.client, stream, part, self.timeout)
                    .await
                {
                    PartOutcome::Stored(seq) => {
                        fence.advance(seq, Some(position));
                        fenced_batch::Outcome::Stored
                    }
                    PartOutcome::Alone => {
                        fenced_batch::publish(
                            self.js,
                            self.client,
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
                super::election::publish_failed("fenced publish", &why);
                Err(Outcome::Retry(format!("{stream}: {why}")))
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
}

/// A window's records by the stream each goes to (`None`: no stream of Runner's), each
/// stream's in outbox order.
fn by_stream<'a>(
    records: &'a [(u64, OutboxRecord)],
    stream_of: &dyn Fn(&str) -> Option<String>,
) -> HashMap<Option<String>, Vec<&'a (u64, OutboxRecord)>> {
    let mut out: HashMap<Option<String>, Vec<&'a (u64, OutboxRecord)>> = HashMap::new();
    for r in records {
        out.entry(stream_of(&r.1.subject)).or_default().push(r);
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
    fn a_window_is_split_by_stream_keeping_each_stream_s_order() {
        let records: Vec<(u64, OutboxRecord)> = ["a.1", "a.2", "b.1", "a.3", "x.1"]
            .iter()
            .enumerate()
            .map(|(i, s)| (i as u64, rec(s).1))
            .collect();
        let of = |s: &str| (!s.starts_with('x')).then(|| s[..1].to_string());
        let g = by_stream(&records, &of);
        let seqs = |k: Option<&str>| -> Vec<u64> {
            g[&k.map(str::to_string)].iter().map(|(s, _)| *s).collect()
        };
        assert_eq!(seqs(Some("a")), vec![0, 1, 3]);
        assert_eq!(seqs(Some("b")), vec![2]);
        assert_eq!(seqs(None), vec![4]);
        assert!(by_stream(&[], &of).is_empty());
    }
}
