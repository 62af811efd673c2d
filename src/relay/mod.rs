//! The outbox relay: libmdbx outbox → JetStream.
//!
//! Storage is the source of truth. The relay reads records in sequence order, publishes a
//! window of them with `Nats-Msg-Id` set to each record's deterministic id (plus
//! `Runner-Tenant` and the causing input's `traceparent`) and, while the next window goes
//! out, awaits the acknowledgements; only then does it mark the acknowledged prefix as
//! published ([`RelayHandle::deletable_through`]).
//! Published records are deleted later, by the saga worker inside its next batch
//! transaction (saving a durable commit per window), or by the relay itself after a poll
//! interval with no new work, when draining, or when far ahead. A crash before the deletion
//! republishes them; JetStream's duplicate window drops the repeat.
//!
//! Delivery: at least once, in outbox order on first publication. During a NATS outage the
//! relay retries with backoff forever; nothing is dropped. It wakes on every commit
//! ([`RelayHandle::wake`]) and also polls.
//!
//! On drain it keeps publishing until the outbox is empty, then returns.

pub mod combine;
pub(crate) mod election;
pub mod fenced;
mod park;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::storage::Store;
use crate::storage::tables::{DEFAULT_PARTITION, OutboxRecord};
use crate::telemetry::Metrics;

/// Shared between the relay and the saga worker, the writer of the outbox in this process:
/// the one channel between them, and the only flow that runs against the pipeline's
/// direction (stream → worker → outbox → relay → JetStream).
///
/// - Relay → writers: the acknowledged prefix ([`deletable_through`](Self::deletable_through):
///   the saga worker deletes published records up to it inside its next batch
///   transaction) and the count of records not yet acknowledged
///   ([`unpublished`](Self::unpublished): the saga worker pauses fetching while it is above
///   `saga.max_outbox_depth`).
/// - Writers → relay: a wake-up after each commit that wrote records
///   ([`wake`](Self::wake)), the highest sequence written
///   ([`note_written`](Self::note_written)) and deleted ([`note_deleted`](Self::note_deleted)).
///
/// Everything here is in memory and advisory: storage stays the source of truth, so a lost
/// wake-up costs at most a poll interval and a restart starts from the stored outbox.
#[derive(Clone, Default, Debug)]
pub struct RelayHandle {
    notify: Arc<Notify>,
    /// Every record with this sequence or lower has been acknowledged by JetStream.
    acked: Arc<AtomicU64>,
    /// Every record with this sequence or lower has been deleted (durably).
    deleted: Arc<AtomicU64>,
    /// Highest sequence a writer has committed.
    written: Arc<AtomicU64>,
    /// Records committed (or found stored at start) and not yet published: a count, since
    /// outbox sequences are shared by every partition of the store and say nothing about
    /// how many records one partition holds.
    pending: Arc<AtomicU64>,
}

impl RelayHandle {
    /// A handle nobody listens to yet.
    pub fn new() -> Self {
        Self::default()
    }
    /// Tells the relay new records may be waiting.
    pub fn wake(&self) {
        self.notify.notify_one();
    }
    /// The sequence through which records are published and may be deleted, when some
    /// are published but not yet deleted.
    pub fn deletable_through(&self) -> Option<u64> {
        let acked = self.acked.load(Ordering::SeqCst);
        (acked > self.deleted.load(Ordering::SeqCst)).then_some(acked)
    }
    /// Records that a writer committed `records` records, through sequence `seq`.
    pub fn note_written(&self, seq: u64, records: u64) {
        self.written.fetch_max(seq, Ordering::SeqCst);
        self.pending.fetch_add(records, Ordering::SeqCst);
    }
    /// Counts `records` already stored when the relay starts (an earlier run's, or a
    /// restored snapshot's): it publishes them first.
    pub fn note_stored(&self, records: u64) {
        self.pending.fetch_add(records, Ordering::SeqCst);
    }
    /// Records that the relay is done with `records` records (acknowledged, or skipped as
    /// covered by the fence watermark).
    pub(crate) fn note_published(&self, records: u64) {
        let _ = self
            .pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |p| {
                Some(p.saturating_sub(records))
            });
    }
    /// Records committed but not yet acknowledged by JetStream, as far as this process
    /// knows (cheap: no storage read).
    pub fn unpublished(&self) -> u64 {
        self.pending.load(Ordering::SeqCst)
    }
    /// Records that everything through `upto` was deleted in a committed transaction.
    pub fn note_deleted(&self, upto: u64) {
        self.deleted.fetch_max(upto, Ordering::SeqCst);
    }

    /// Deletes the records of `partition` that are published and not yet deleted, in a
    /// transaction of its own (a relay does this only when idle, far ahead or draining).
    /// On failure the records stay and are republished after a restart, where
    /// de-duplication (or, partitioned, the fence watermark) drops them.
    pub(crate) async fn delete_published(&self, store: &Store, partition: u16) {
        let Some(upto) = self.deletable_through() else {
            return;
        };
        match store
            .write(move |t| t.delete_outbox_through(partition, upto))
            .await
        {
            Ok(_) => self.note_deleted(upto),
            Err(e) => {
                tracing::error!(message = "Relay cannot delete published records.", error = %e)
            }
        }
    }

    /// Waits for a wake-up, `poll` or `stop`; true when `poll` passed with no wake-up (the
    /// relay is idle and may spend a commit of its own on deletions).
    pub(crate) async fn idle(&self, poll: Duration, stop: &CancellationToken) -> bool {
        tokio::select! {
            _ = self.notify.notified() => false,
            _ = tokio::time::sleep(poll) => true,
            _ = stop.cancelled() => false,
        }
    }
}

/// Every relay handle of this node: what makes `saga.max_outbox_depth` and the
/// `runner_outbox_depth` gauge hold for the node, not per partition (a node owning P
/// partitions would otherwise hold P times the bound, and each partition would overwrite the
/// gauge with its own depth). A partition's handle is registered while the partition is
/// owned ([`Relays::register`]; dropping the returned guard forgets it).
#[derive(Debug, Default)]
pub struct Relays {
    handles: std::sync::Mutex<Vec<RelayHandle>>,
}

/// Keeps a handle registered in [`Relays`] until dropped.
#[must_use = "the handle is forgotten when this is dropped"]
pub struct Registered {
    relays: Arc<Relays>,
    handle: RelayHandle,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.relays
            .lock()
            .retain(|h| !Arc::ptr_eq(&h.acked, &self.handle.acked));
    }
}

impl Relays {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RelayHandle>> {
        match self.handles.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Counts `handle` in the node's depth until the guard is dropped.
    pub fn register(self: &Arc<Self>, handle: RelayHandle) -> Registered {
        self.lock().push(handle.clone());
        Registered {
            relays: self.clone(),
            handle,
        }
    }

    /// Records written and not yet acknowledged, over every relay of the node.
    pub fn unpublished(&self) -> u64 {
        self.lock().iter().map(RelayHandle::unpublished).sum()
    }
}

/// This relay's name among the stalled stages ([`crate::telemetry::stall`]).
const STAGE: &str = "relay";

/// When the relay is this many windows ahead of the deletions, it deletes itself.
const MAX_WINDOWS_UNDELETED: u64 = 8;

/// The relay task.
pub struct Relay {
    /// JetStream.
    pub js: Context,
    /// Storage.
    pub store: Store,
    /// Metrics.
    pub metrics: Metrics,
    /// Wake-ups.
    pub handle: RelayHandle,
    /// Records per window.
    pub window: usize,
    /// Poll interval.
    pub poll: Duration,
    /// A record the broker refused for good (`park::refused_for_good`) in the last window,
    /// with the refusal: parked before publishing resumes.
    pub refused: std::sync::Mutex<Option<(u64, String)>>,
    /// The node's relays, for the `runner_outbox_depth` gauge (node-wide).
    pub relays: Option<Arc<Relays>>,
}

/// The headers a record is published with. With span export on, the publication is an
/// `outbox.publish` span, child of the transition that wrote the record, and the message
/// names that span; otherwise it carries the record's trace context unchanged.
fn headers(rec: &OutboxRecord) -> HeaderMap {
    use crate::telemetry::otel;
    let parent = rec.traceparent.as_deref();
    let hop = otel::hop("outbox.publish", otel::Kind::Producer, parent, || {
        vec![
            otel::attr("runner.tenant", rec.tenant.as_str()),
            otel::attr("messaging.destination.name", rec.subject.as_str()),
            otel::attr("messaging.message.id", rec.msg_id.as_str()),
        ]
    });
    let tp = otel::onward(hop.as_ref(), parent);
    crate::broker::headers::outgoing(&rec.msg_id, Some(&rec.tenant), tp)
}

/// A window whose publications went out and whose acknowledgements are awaited.
struct InFlight {
    /// Sequences of the records sent, in order.
    seqs: Vec<u64>,
    /// Their acknowledgements, in the same order.
    acks: Vec<async_nats::jetstream::context::PublishAckFuture>,
    started: Instant,
}

impl Relay {
    /// Runs until `stop` is cancelled and the outbox is empty.
    ///
    /// Two windows overlap: the next window is read and sent while the previous one's
    /// acknowledgements are awaited, so the connection never idles for a round trip between
    /// windows. Acknowledgements are settled window by window, in order, so
    /// [`RelayHandle::deletable_through`] only ever covers a gap-free prefix; when a window is
    /// not fully acknowledged, the newer window is forgotten too and publishing resumes
    /// after the acknowledged prefix (repeats are dropped by JetStream's de-duplication).
    /// After such a refusal the windows stop overlapping until one is acknowledged whole,
    /// so a window cannot be taken while the one before it is still being refused. (At the
    /// very onset of a refusal, a newer window may already be on its way; a publish that
    /// fails while a later one succeeds — a stream leader lost mid-window — can still land
    /// out of order. The partitioned relay's fenced atomic batches do not have this gap.)
    pub async fn run(self, stop: CancellationToken) {
        // Waits after a window that was not fully acknowledged, and after a failed read of
        // the outbox (a storage fault: waits grow longer).
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        let mut read_backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
        let mut next_from = self.handle.acked.load(Ordering::SeqCst) + 1;
        let mut inflight: Option<InFlight> = None;
        // Set by a refused window, cleared by the next window acknowledged whole.
        let mut careful = false;
        loop {
            // Read whether the drain had begun *before* reading the outbox: the workers'
            // last commits happen before it begins, so an empty read after it is final.
            let stopping = stop.is_cancelled();
            let window = self.window;
            let from = next_from;
            let batch = match self
                .store
                .read(move |t| t.outbox_batch(DEFAULT_PARTITION, from, window))
                .await
            {
                Ok(b) => {
                    read_backoff.reset();
                    b
                }
                Err(e) => {
                    tracing::error!(message = "Relay cannot read the outbox.", error = %e);
                    tokio::time::sleep(read_backoff.next_wait()).await;
                    continue;
                }
            };
            let far_ahead = self.handle.deletable_through().is_some_and(|upto| {
                upto - self.handle.deleted.load(Ordering::SeqCst)
                    > MAX_WINDOWS_UNDELETED * window as u64
            });
            if far_ahead {
                self.delete_published().await;
            }
            let max = self.js.client().server_info().max_payload;
            if batch
                .iter()
                .any(|(_, r)| park::unpublishable(r, max).is_some())
            {
                // Settle what is in flight first, so the parked record's dead letter (written
                // after it in outbox order) does not overtake anything.
                if let Some(w) = inflight.take()
                    && !self.settle(w).await
                {
                    next_from = self.retry_point(&mut backoff).await;
                    careful = true;
                    continue;
                }
                if let Err(e) =
                    park::screen(&self.store, &self.metrics, DEFAULT_PARTITION, &batch, max).await
                {
                    tracing::error!(message = "Relay cannot park an unpublishable output.", error = %e);
                    tokio::time::sleep(read_backoff.next_wait()).await;
                }
                continue;
            }
            if batch.is_empty() {
                if let Some(w) = inflight.take() {
                    if !self.settle(w).await {
                        next_from = self.retry_point(&mut backoff).await;
                        careful = true;
                    }
                    continue;
                }
                if let Some(relays) = &self.relays {
                    self.metrics.outbox_depth.set(relays.unpublished() as i64);
                }
                if stopping {
                    self.delete_published().await;
                    tracing::info!(
                        message = "Relay flushed.",
                        through = self.handle.acked.load(Ordering::SeqCst)
                    );
                    return;
                }
                // Published records are normally deleted inside the workers' next batch
                // transaction; the relay spends a durable commit of its own on them only
                // after a whole poll interval with no new work (or when far ahead, or
                // draining), so it does not compete with the workers for the writer.
                if self.handle.idle(self.poll, &stop).await {
                    self.delete_published().await;
                }
                continue;
            }
            let sent = self.send(&batch).await;
            if let Some(last) = sent.seqs.last() {
                next_from = last + 1;
            }
            let complete = sent.seqs.len() == batch.len();
            let newer = (!sent.seqs.is_empty()).then_some(sent);
            let settled_ok = match inflight.take() {
                Some(prev) => self.settle(prev).await,
                None => true,
            };
            if !settled_ok {
                // The newer window's acks cannot count past a hole; drop it and resume.
                next_from = self.retry_point(&mut backoff).await;
                careful = true;
                continue;
            }
            inflight = newer;
            if careful && complete {
                // After a refusal, windows do not overlap until one is acknowledged whole:
                // a window sent while the one before it is still being refused could be
                // taken first and land ahead of it.
                if let Some(w) = inflight.take()
                    && !self.settle(w).await
                {
                    next_from = self.retry_point(&mut backoff).await;
                    continue;
                }
                careful = false;
            }
            if complete {
                backoff.reset();
            } else {
                // A publish could not even be queued: settle what went out, then back off.
                if let Some(w) = inflight.take() {
                    self.settle(w).await;
                }
                next_from = self.retry_point(&mut backoff).await;
                careful = true;
            }
        }
    }

    /// After a failure: waits out the backoff and returns where publishing resumes.
    async fn retry_point(&self, backoff: &mut Backoff) -> u64 {
        self.metrics.relay_errors.inc();
        let refused = match self.refused.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some((seq, why)) = refused {
            // Sending it again cannot help: park it now and go on from it (its dead letter
            // takes its place), without waiting.
            match park::park_seq(&self.store, &self.metrics, DEFAULT_PARTITION, seq, why).await {
                Ok(()) => return self.handle.acked.load(Ordering::SeqCst) + 1,
                Err(e) => {
                    tracing::error!(message = "Relay cannot park an output the broker refused.", error = %e)
                }
            }
        }
        tokio::time::sleep(backoff.next_wait()).await;
        self.handle.acked.load(Ordering::SeqCst) + 1
    }

    /// Notes that record `seq` was refused for good, unless an earlier one was already.
    fn refused_for_good(&self, seq: u64, e: &async_nats::jetstream::context::PublishError) {
        if !park::refused_for_good(e) {
            return;
        }
        let mut g = match self.refused.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if g.as_ref().is_none_or(|(s, _)| seq < *s) {
            *g = Some((seq, e.to_string()));
        }
    }

    /// Sends a window's publications (without waiting for acknowledgements); stops at the
    /// first that cannot be queued.
    async fn send(&self, batch: &[(u64, OutboxRecord)]) -> InFlight {
        let mut w = InFlight {
            seqs: Vec::with_capacity(batch.len()),
            acks: Vec::with_capacity(batch.len()),
            started: Instant::now(),
        };
        for (seq, rec) in batch {
            let fut = self
                .js
                .publish_with_headers(rec.subject.clone(), headers(rec), rec.body.clone().into())
                .await;
            match fut {
                Ok(f) => {
                    w.seqs.push(*seq);
                    w.acks.push(f);
                }
                Err(e) => {
                    election::publish_failed("publish", &e);
                    self.metrics.stalls.failed(STAGE, &e);
                    self.refused_for_good(*seq, &e);
                    break;
                }
            }
        }
        w
    }

    /// Awaits a window's acknowledgements and advances the acknowledged prefix; true when
    /// every record was acknowledged.
    async fn settle(&self, w: InFlight) -> bool {
        let results = futures::future::join_all(w.acks.into_iter().map(|f| f.into_future())).await;
        let acked = results.iter().take_while(|r| r.is_ok()).count();
        self.handle.note_published(acked as u64);
        if acked > 0 {
            self.handle
                .acked
                .fetch_max(w.seqs[acked - 1], Ordering::SeqCst);
        }
        self.metrics.relay_published.inc_by(acked as u64);
        self.metrics
            .relay_window_seconds
            .observe(w.started.elapsed().as_secs_f64());
        if acked == w.seqs.len() {
            self.metrics.stalls.progressed(STAGE);
        }
        if let Some(Err(e)) = results.get(acked) {
            election::publish_failed("acknowledgement", e);
            self.metrics.stalls.failed(STAGE, e);
            self.refused_for_good(w.seqs[acked], e);
        }
        acked == w.seqs.len()
    }

    /// Deletes what is published and not yet deleted, in a transaction of its own.
    async fn delete_published(&self) {
        self.handle
            .delete_published(&self.store, DEFAULT_PARTITION)
            .await;
    }
}
