//! The outbox relay: libmdbx outbox → JetStream.
//!
//! Storage is the source of truth. The relay reads records in sequence order, publishes a
//! window of them with `Nats-Msg-Id` set to each record's deterministic id (plus
//! `Runner-Tenant` and the causing input's `traceparent`), waits for the acknowledgements,
//! and only then marks the acknowledged prefix as published ([`RelayHandle::acked_through`]).
//! Published records are deleted later, by the saga worker inside its next batch
//! transaction (saving a durable commit per window), or by the relay itself when it is idle,
//! draining, or far ahead. A crash before the deletion republishes them; JetStream's
//! duplicate window drops the repeat.
//!
//! Delivery: at least once, in outbox order on first publication. During a NATS outage the
//! relay retries with backoff forever; nothing is dropped. It wakes on every commit
//! ([`RelayHandle::wake`]) and also polls.
//!
//! On drain it keeps publishing until the outbox is empty, then returns.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::storage::Store;
use crate::storage::tables::{DEFAULT_PARTITION, OutboxRecord};
use crate::telemetry::Metrics;

/// Shared between the relay and the writers of the outbox: wakes the relay early, and
/// tells writers which published records they may delete.
#[derive(Clone, Default, Debug)]
pub struct RelayHandle {
    notify: Arc<Notify>,
    /// Every record with this sequence or lower has been acknowledged by JetStream.
    acked: Arc<AtomicU64>,
    /// Every record with this sequence or lower has been deleted (durably).
    deleted: Arc<AtomicU64>,
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
    /// Records that everything through `upto` was deleted in a committed transaction.
    pub fn note_deleted(&self, upto: u64) {
        self.deleted.fetch_max(upto, Ordering::SeqCst);
    }
}

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
}

/// Header carrying the tenant.
pub const TENANT_HEADER: &str = "Runner-Tenant";
/// W3C trace context header.
pub const TRACEPARENT_HEADER: &str = "traceparent";

fn headers(rec: &OutboxRecord) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(async_nats::header::NATS_MESSAGE_ID, rec.msg_id.as_str());
    h.insert(TENANT_HEADER, rec.tenant.as_str());
    if let Some(tp) = &rec.traceparent {
        h.insert(TRACEPARENT_HEADER, tp.as_str());
    }
    h
}

impl Relay {
    /// Runs until `stop` is cancelled and the outbox is empty.
    pub async fn run(self, stop: CancellationToken) {
        let mut backoff = Duration::from_millis(50);
        loop {
            // Read whether the drain had begun *before* reading the outbox: the workers'
            // last commits happen before it begins, so an empty read after it is final.
            let stopping = stop.is_cancelled();
            let window = self.window;
            let from = self.handle.acked.load(Ordering::SeqCst) + 1;
            let batch = match self
                .store
                .read(move |t| t.outbox_batch(DEFAULT_PARTITION, from, window))
                .await
            {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(message = "Relay cannot read the outbox.", error = %e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            let far_ahead = self.handle.deletable_through().is_some_and(|upto| {
                upto - self.handle.deleted.load(Ordering::SeqCst)
                    > MAX_WINDOWS_UNDELETED * window as u64
            });
            if batch.is_empty() || far_ahead {
                self.delete_published().await;
            }
            if batch.is_empty() {
                if let Ok(depth) = self.store.read(|t| t.outbox_depth()).await {
                    self.metrics.outbox_depth.set(depth as i64);
                }
                if stopping {
                    tracing::info!(
                        message = "Relay flushed.",
                        through = self.handle.acked.load(Ordering::SeqCst)
                    );
                    return;
                }
                tokio::select! {
                    _ = self.handle.notify.notified() => {}
                    _ = tokio::time::sleep(self.poll) => {}
                    _ = stop.cancelled() => {}
                }
                continue;
            }
            match self.publish(&batch).await {
                Ok(acked) => {
                    backoff = Duration::from_millis(50);
                    if acked > 0 {
                        self.handle
                            .acked
                            .fetch_max(batch[acked - 1].0, Ordering::SeqCst);
                    }
                    self.metrics.relay_published.inc_by(acked as u64);
                    if acked < batch.len() {
                        self.metrics.relay_errors.inc();
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
                Err(e) => {
                    self.metrics.relay_errors.inc();
                    tracing::warn!(message = "Relay publish failed; retrying.", error = %e, retry_in = ?backoff);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Deletes what is published and not yet deleted, in a transaction of its own.
    async fn delete_published(&self) {
        let Some(upto) = self.handle.deletable_through() else {
            return;
        };
        match self
            .store
            .write(move |t| t.delete_outbox_through(DEFAULT_PARTITION, upto))
            .await
        {
            Ok(_) => self.handle.note_deleted(upto),
            // The records stay and are republished after a restart; de-duplication drops them.
            Err(e) => {
                tracing::error!(message = "Relay cannot delete published records.", error = %e)
            }
        }
    }

    /// Publishes a window; returns how many records from the start were acknowledged.
    async fn publish(&self, batch: &[(u64, OutboxRecord)]) -> Result<usize, async_nats::Error> {
        let started = Instant::now();
        let mut pending = Vec::with_capacity(batch.len());
        for (_, rec) in batch {
            let fut = self
                .js
                .publish_with_headers(rec.subject.clone(), headers(rec), rec.body.clone().into())
                .await;
            match fut {
                Ok(f) => pending.push(f),
                Err(e) => {
                    if pending.is_empty() {
                        return Err(e.into());
                    }
                    break;
                }
            }
        }
        let results = futures::future::join_all(pending.into_iter().map(|f| f.into_future())).await;
        let acked = results.iter().take_while(|r| r.is_ok()).count();
        if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
            tracing::warn!(message = "Some relay publishes were not acknowledged.", error = %e, acked);
        }
        self.metrics
            .relay_window_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(acked)
    }
}
