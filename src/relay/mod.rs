//! The outbox relay: libmdbx outbox → JetStream, one relay per owned partition
//! ([`fenced`]), and what it shares with the saga worker ([`RelayHandle`]) and the node
//! ([`Relays`]).
//!
//! Storage is the source of truth. A relay reads its partition's records in sequence
//! order — from the memory the commits hand them to while that memory is known complete
//! ([`fresh`]), from the store otherwise — publishes them under the partition's fences
//! with `Nats-Msg-Id` set to each record's deterministic id (plus `Runner-Tenant` and the
//! causing input's `traceparent`), and only once they are acknowledged marks the
//! acknowledged prefix as published ([`RelayHandle::deletable_through`]). Published
//! records are deleted later, by the saga worker inside its next batch transaction, or by
//! the relay itself when idle or far ahead.
//! A crash before the deletion republishes them; the fence watermark and JetStream's
//! duplicate window drop the repeat.
//!
//! Delivery: at least once, in outbox order on first publication. During a NATS outage a
//! relay retries with backoff; nothing is dropped. It wakes on every commit
//! ([`RelayHandle::wake`]) and also polls.

pub mod combine;
pub(crate) mod election;
pub mod fenced;
pub mod fresh;
mod park;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::storage::Store;
use crate::storage::tables::OutboxRecord;

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
///   ([`wake`](Self::wake)), the records themselves with the highest sequence written
///   ([`hand_over`](Self::hand_over), or [`note_written`](Self::note_written) alone for a
///   writer that only stores them) and deleted ([`note_deleted`](Self::note_deleted)).
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
    /// how many records one partition holds. Signed, like `bytes`: a relay reading the
    /// store may publish a commit's records in the moment between the commit and its
    /// hand-over, and the debt it leaves is paid by the note (the records found stored at
    /// a take are counted before its relay starts, or the take is given up).
    pending: Arc<AtomicI64>,
    /// The bytes of those records, per tenant ([`OutboxRecord::size`]; what a tenant's cap
    /// on outbox bytes counts). Signed: a window the relay published before the writer
    /// counted it leaves a debt the count then pays, so the order of the two does not
    /// matter. Emptied when the relay finds nothing left to publish and every record a
    /// writer noted is published ([`RelayHandle::note_drained`]), so a record counted at
    /// one size and published at another (a dead letter parked in an output's place)
    /// does not stay counted.
    bytes: Arc<std::sync::Mutex<HashMap<String, i64>>>,
    /// Records the commit handed over once durable, for the relay to take without reading
    /// the store back (`fresh.rs`).
    fresh: Arc<std::sync::Mutex<fresh::Fresh>>,
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
    /// A commit made `records` of this partition durable, in outbox order: noted as
    /// [`RelayHandle::note_written`] does, and handed to the relay in memory
    /// (`fresh.rs`), under one lock so the relay never sees the note without the records.
    /// Called by the commit thread for every committed batch, before it answers, whether
    /// or not the batch's loop still waits for the answer.
    /// `bytes` are the records' sizes per tenant, counted first (until the write is noted
    /// too, the relay keeps every count, `RelayHandle::note_drained`, so a window it
    /// published meanwhile is paid).
    pub fn hand_over(&self, records: Vec<(u64, OutboxRecord)>, bytes: Vec<(String, u64)>) {
        let Some(&(last, _)) = records.last() else {
            return;
        };
        let mut fresh = self.fresh_lock();
        self.note_bytes(bytes);
        self.note_written(last, records.len() as u64);
        fresh.hand_over(records);
    }
    /// The highest sequence a writer noted.
    pub(crate) fn written(&self) -> u64 {
        self.written.load(Ordering::SeqCst)
    }
    /// The partition's memory of fresh records: only the relay calls anything but
    /// [`RelayHandle::hand_over`].
    pub(crate) fn fresh_lock(&self) -> std::sync::MutexGuard<'_, fresh::Fresh> {
        self.fresh
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
        self.pending.fetch_add(signed(records), Ordering::SeqCst);
    }
    /// Counts `records` already stored when the relay starts (an earlier run's, or a
    /// restored snapshot's): it publishes them first.
    pub fn note_stored(&self, records: u64) {
        self.pending.fetch_add(signed(records), Ordering::SeqCst);
    }
    /// Counts, per tenant, the bytes of records committed or found stored.
    pub fn note_bytes(&self, by_tenant: impl IntoIterator<Item = (String, u64)>) {
        let mut bytes = self.bytes_lock();
        for (t, n) in by_tenant {
            move_by(&mut bytes, &t, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    /// Takes the bytes of `records`, published, off their tenants' counts.
    pub(crate) fn note_bytes_published<'r>(
        &self,
        records: impl IntoIterator<Item = &'r OutboxRecord>,
    ) {
        let mut bytes = self.bytes_lock();
        for r in records {
            let n = i64::try_from(r.size()).unwrap_or(i64::MAX);
            move_by(&mut bytes, &r.tenant, -n);
        }
    }
    /// The relay found nothing left to publish: no tenant has bytes waiting, so counts
    /// left over (a record counted at one size and published at another) are dropped —
    /// but only when the last record a writer noted is the last one published. Otherwise
    /// a commit is between its write and its note (its bytes, or its published records'
    /// debt, are on their way) and dropping the counts would leave the note behind.
    pub(crate) fn note_drained(&self) {
        // Under the memory's lock, which a hand-over holds from its bytes to its note.
        let _fresh = self.fresh_lock();
        let mut bytes = self.bytes_lock();
        if self.written.load(Ordering::SeqCst) == self.acked.load(Ordering::SeqCst) {
            bytes.clear();
        }
    }
    /// Bytes waiting to be published, per tenant with some.
    pub fn bytes_by_tenant(&self) -> HashMap<String, u64> {
        self.bytes_lock()
            .iter()
            .filter_map(|(t, n)| Some((t.clone(), u64::try_from(*n).ok().filter(|n| *n > 0)?)))
            .collect()
    }
    /// Bytes of `tenant`'s records waiting to be published.
    fn bytes_of(&self, tenant: &str) -> u64 {
        self.bytes_lock()
            .get(tenant)
            .map_or(0, |n| u64::try_from(*n).unwrap_or(0))
    }
    fn bytes_lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, i64>> {
        self.bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    /// Records that the relay is done with `records` records (acknowledged, or skipped as
    /// covered by the fence watermark).
    pub(crate) fn note_published(&self, records: u64) {
        self.pending.fetch_sub(signed(records), Ordering::SeqCst);
    }
    /// Records committed but not yet acknowledged by JetStream, as far as this process
    /// knows (cheap: no storage read).
    pub fn unpublished(&self) -> u64 {
        u64::try_from(self.pending.load(Ordering::SeqCst)).unwrap_or(0)
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
            .write_logged(move |t| t.delete_outbox_through(partition, upto))
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

/// A count of records as the signed `pending`.
fn signed(records: u64) -> i64 {
    i64::try_from(records).unwrap_or(i64::MAX)
}

/// Moves `tenant`'s count in `bytes` by `by`, forgetting it at zero.
fn move_by(bytes: &mut HashMap<String, i64>, tenant: &str, by: i64) {
    match bytes.get_mut(tenant) {
        Some(n) => {
            *n = n.saturating_add(by);
            if *n == 0 {
                bytes.remove(tenant);
            }
        }
        None if by != 0 => {
            bytes.insert(tenant.to_string(), by);
        }
        None => {}
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
    /// Each partition's memory of fresh records (`fresh.rs`), shared by every handle of
    /// the partition this node makes: a commit of an earlier owning period (a loop aborted
    /// with its batch still committing) hands its records to the memory the next period's
    /// relay reads, so that relay never counts memory complete without them.
    fresh: std::sync::Mutex<HashMap<u32, Arc<std::sync::Mutex<fresh::Fresh>>>>,
    /// What the other saga nodes last said waits in their outboxes, per tenant with a cap on
    /// outbox bytes (their heartbeats, `worker/ownership/members.rs`), by node.
    others: std::sync::Mutex<BTreeMap<String, BTreeMap<String, u64>>>,
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

    /// A new handle for partition `p`, sharing the partition's memory of fresh records
    /// with every other handle of `p` this node made.
    pub fn handle_for(&self, p: u32) -> RelayHandle {
        let fresh = self
            .fresh
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(p)
            .or_default()
            .clone();
        RelayHandle {
            fresh,
            ..RelayHandle::default()
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

    /// Bytes waiting to be published, per tenant, over every relay of the node.
    pub fn bytes_by_tenant(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for h in self.lock().iter() {
            for (t, n) in h.bytes_by_tenant() {
                *out.entry(t).or_insert(0) += n;
            }
        }
        out
    }

    /// Sets what the other saga nodes say waits in their outboxes, by node.
    pub fn set_others(&self, others: BTreeMap<String, BTreeMap<String, u64>>) {
        *self
            .others
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = others;
    }

    /// Bytes of `tenant`'s outputs waiting to be published in the deployment: this node's,
    /// exact, plus what the other nodes said in their last heartbeats.
    pub fn deployment_bytes(&self, tenant: &str) -> u64 {
        let here: u64 = self.lock().iter().map(|h| h.bytes_of(tenant)).sum();
        let others: u64 = self
            .others
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .filter_map(|m| m.get(tenant))
            .sum();
        here + others
    }
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
