//! The outbox relay: libmdbx outbox → JetStream.
//!
//! Storage is the source of truth. The relay reads records in sequence order, publishes a
//! window of them with `Nats-Msg-Id` set to each record's deterministic id (plus
//! `Runner-Tenant` and the causing input's `traceparent`), waits for the acknowledgements,
//! and only then deletes the acknowledged prefix in one write transaction. A crash between
//! publish and delete republishes; JetStream's duplicate window drops the repeat.
//!
//! Delivery: at least once, in outbox order on first publication. During a NATS outage the
//! relay retries with backoff forever; nothing is dropped. It wakes on every commit
//! ([`RelayHandle::wake`]) and also polls.
//!
//! On drain it keeps publishing until the outbox is empty, then returns.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::storage::Store;
use crate::storage::tables::{DEFAULT_PARTITION, OutboxRecord};
use crate::telemetry::Metrics;

/// Wakes the relay early.
#[derive(Clone, Default, Debug)]
pub struct RelayHandle {
    notify: Arc<Notify>,
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
}

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
            let window = self.window;
            let batch = match self
                .store
                .read(move |t| t.outbox_batch(DEFAULT_PARTITION, window))
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
            if batch.is_empty() {
                self.metrics.outbox_depth.set(0);
                if stop.is_cancelled() {
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
                    let seqs: Vec<u64> = batch[..acked].iter().map(|(s, _)| *s).collect();
                    let n = seqs.len() as u64;
                    if let Err(e) = self
                        .store
                        .write(move |t| t.delete_outbox(DEFAULT_PARTITION, &seqs))
                        .await
                    {
                        // The records stay and are republished; de-duplication drops them.
                        tracing::error!(message = "Relay cannot delete published records.", error = %e);
                    }
                    self.metrics.relay_published.inc_by(n);
                    if let Ok(depth) = self.store.read(|t| t.outbox_depth()).await {
                        self.metrics.outbox_depth.set(depth as i64);
                    }
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
