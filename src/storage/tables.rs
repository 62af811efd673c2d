//! Typed access to the keyspaces inside one libmdbx transaction.
//!
//! Key layouts (numbers big-endian so byte order is numeric order; strings separated by a
//! 0x00 byte, which subject tokens and ids never contain; the tenant in every tenant key):
//!
//! | table | key | value |
//! |---|---|---|
//! | `saga` | `t 0 saga 0 correlation_id` | [`Instance`] as JSON |
//! | `saga` | `t 0 saga 0 correlation_id 0 slot:u64` | [`HistoryEntry`], binary (see [`HistoryEntry::encode`]); slot = n mod [`HISTORY_KEEP`]: each instance keeps its last transitions in a ring beside it |
//! | `outbox` | `partition:u16 seq:u64` | [`OutboxRecord`], binary (see [`OutboxRecord::encode`]) |
//! | `checkpoint` | consumer name | last applied stream sequence, `u64` |
//! | `dedupe` | `t 0 saga 0 event_id` | applied-at ms, `u64` |
//! | `schedule` | `due_ms:u64 t 0 saga 0 correlation_id 0 timer` | [`TimerEntry`] as JSON |
//! | `deadletter` | `t 0 id:u64` | [`DeadLetter`] as JSON |
//! | `parked` | `t 0 saga 0 correlation_id` | id of the dead letter that parked the key, `u64` |
//! | `meta` | name | counters (`outbox_seq`, `deadletter_id`), `u64` |
//! | `history` | as the ring keys above | history written by earlier versions (read, no longer written) |
//!
//! Everything here runs inside a caller's transaction; nothing commits on its own, so a
//! caller composes state, outbox, timers, markers and checkpoint into one atomic commit.

use libmdbx::{NoWriteMap, RW, Table, Transaction, TransactionKind, WriteFlags};
use serde::{Deserialize, Serialize};

use super::codec::{Reader, Writer};
use super::{Result, StorageError};
use crate::saga::Instance;

/// The outbox partition used until partitions exist.
pub const DEFAULT_PARTITION: u16 = 0;

/// A message waiting in the outbox for the relay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutboxRecord {
    /// Full subject, `tenant.<t>.…`.
    pub subject: String,
    /// `Nats-Msg-Id`.
    pub msg_id: String,
    /// Tenant (the `Runner-Tenant` header).
    pub tenant: String,
    /// W3C trace context copied from the causing input, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// Body bytes (JSON text).
    pub body: String,
}

/// Format byte of a binary outbox record (see [`super::codec`]).
const OUTBOX_FORMAT_1: u8 = 1;

impl OutboxRecord {
    /// Encodes the record: subject, msg id, tenant, traceparent, then the body bytes to
    /// the end, stored as they are (no escaping, no second JSON around them).
    pub fn encode(&self) -> Vec<u8> {
        let size = 16 + self.subject.len() + self.msg_id.len() + self.tenant.len();
        Writer::new(OUTBOX_FORMAT_1, size + self.body.len() + 64)
            .str(&self.subject)
            .str(&self.msg_id)
            .str(&self.tenant)
            .opt_str(self.traceparent.as_deref())
            .tail(self.body.as_bytes())
            .finish()
    }

    /// Decodes what [`OutboxRecord::encode`] wrote, or the JSON form of older stores.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let Some(mut r) = Reader::open(bytes, OUTBOX_FORMAT_1, "outbox record") else {
            return json(bytes, "outbox record");
        };
        Ok(Self {
            subject: r.str()?,
            msg_id: r.str()?,
            tenant: r.str()?,
            traceparent: r.opt_str()?,
            body: r.rest()?,
        })
    }
}

/// Transitions kept per instance for `runner inspect`.
pub const HISTORY_KEEP: u64 = 20;

/// One applied transition, kept for operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEntry {
    /// The instance's applied-input counter after this transition.
    pub n: u64,
    /// Event name handled.
    pub event: String,
    /// The input's event id.
    pub event_id: String,
    /// State before.
    pub from: String,
    /// State after.
    pub to: String,
    /// Input timestamp, ms since the epoch.
    pub at_ms: u64,
    /// Where the input came from (`stream:seq`, `timer`, `redrive:<id>`).
    pub source: String,
    /// Outputs emitted.
    pub emitted: usize,
}

/// Format byte of a binary history entry (see [`super::codec`]).
const HISTORY_FORMAT_1: u8 = 1;

impl HistoryEntry {
    /// Encodes the entry: the three integers, then the five strings.
    pub fn encode(&self) -> Vec<u8> {
        let strings = [
            &self.event,
            &self.event_id,
            &self.from,
            &self.to,
            &self.source,
        ];
        let size = 24 + strings.iter().map(|s| s.len() + 4).sum::<usize>();
        let mut w = Writer::new(HISTORY_FORMAT_1, size);
        w.u64(self.n).u64(self.at_ms).u64(self.emitted as u64);
        for s in strings {
            w.str(s);
        }
        w.finish()
    }

    /// Decodes what [`HistoryEntry::encode`] wrote, or the JSON form of older stores.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let Some(mut r) = Reader::open(bytes, HISTORY_FORMAT_1, "history entry") else {
            return json(bytes, "history entry");
        };
        let (n, at_ms, emitted) = (r.u64()?, r.u64()?, r.u64()?);
        Ok(Self {
            n,
            event: r.str()?,
            event_id: r.str()?,
            from: r.str()?,
            to: r.str()?,
            at_ms,
            source: r.str()?,
            emitted: usize::try_from(emitted).unwrap_or(usize::MAX),
        })
    }
}

fn history_key(tenant: &str, saga: &str, corr: &str, n: u64) -> Vec<u8> {
    let mut k = instance_key(tenant, saga, corr);
    k.push(0);
    k.extend_from_slice(&n.to_be_bytes());
    k
}

/// A pending timer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerEntry {
    /// Tenant.
    pub tenant: String,
    /// Saga.
    pub saga: String,
    /// Instance key.
    pub correlation_id: String,
    /// Timer name.
    pub name: String,
    /// The id the firing input carries as its event id.
    pub timer_id: String,
    /// Due time, ms since the epoch.
    pub due_ms: u64,
}

impl TimerEntry {
    /// The schedule key of this entry.
    pub fn key(&self) -> Vec<u8> {
        let mut k = self.due_ms.to_be_bytes().to_vec();
        push_parts(
            &mut k,
            &[&self.tenant, &self.saga, &self.correlation_id, &self.name],
        );
        k
    }
}

/// Where a dead letter stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterStatus {
    /// Waiting for an operator.
    Pending,
    /// Redriven and processed.
    Redriven,
}

/// A dead-lettered input with its reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Id, increasing.
    pub id: u64,
    /// Tenant (from the subject; `_` when none could be read).
    pub tenant: String,
    /// Reason class: `undecodable`, `tenant_mismatch`, `unknown_tenant`, `too_large`,
    /// `expression`, `version_not_loaded`, `parked` (held behind an earlier dead letter), ...
    pub kind: String,
    /// What went wrong, for a person.
    pub reason: String,
    /// The original subject.
    pub subject: String,
    /// The input's stream and sequence (`stream:seq`), or `timer` for a timer.
    pub source: String,
    /// The original body, as text (lossy if it was not UTF-8).
    pub body: String,
    /// The original `traceparent`, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The saga instance this concerns, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saga: Option<String>,
    /// The instance key, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// How many times it was attempted.
    pub attempts: u32,
    /// When it was dead-lettered, ms since the epoch.
    pub at_ms: u64,
    /// Pending or redriven.
    pub status: DeadLetterStatus,
}

fn push_parts(k: &mut Vec<u8>, parts: &[&str]) {
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            k.push(0);
        }
        k.extend_from_slice(p.as_bytes());
    }
}

/// Key of a saga instance (also of its parked marker).
pub fn instance_key(tenant: &str, saga: &str, correlation_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(tenant.len() + saga.len() + correlation_id.len() + 2);
    push_parts(&mut k, &[tenant, saga, correlation_id]);
    k
}

/// Key of a dedupe marker.
pub fn dedupe_key(tenant: &str, saga: &str, event_id: &str) -> Vec<u8> {
    instance_key(tenant, saga, event_id)
}

fn outbox_key(partition: u16, seq: u64) -> [u8; 10] {
    let mut k = [0u8; 10];
    k[..2].copy_from_slice(&partition.to_be_bytes());
    k[2..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn deadletter_key(tenant: &str, id: u64) -> Vec<u8> {
    let mut k = tenant.as_bytes().to_vec();
    k.push(0);
    k.extend_from_slice(&id.to_be_bytes());
    k
}

fn u64_of(bytes: &[u8], what: &str) -> Result<u64> {
    let arr: [u8; 8] = bytes
        .try_into()
        .map_err(|_| StorageError::Corrupt(format!("{what}: not 8 bytes")))?;
    Ok(u64::from_be_bytes(arr))
}

fn json<T: for<'de> Deserialize<'de>>(bytes: &[u8], what: &str) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| StorageError::Corrupt(format!("{what}: {e}")))
}

fn to_json<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| StorageError::Corrupt(format!("encoding: {e}")))
}

/// The tables of one transaction.
pub struct Tables<'t, K: TransactionKind> {
    txn: &'t Transaction<'t, K, NoWriteMap>,
    saga: Table<'t>,
    outbox: Table<'t>,
    checkpoint: Table<'t>,
    dedupe: Table<'t>,
    schedule: Table<'t>,
    deadletter: Table<'t>,
    parked: Table<'t>,
    meta: Table<'t>,
    history: Table<'t>,
    /// The outbox sequence last assigned in this transaction (read once, then counted here).
    outbox_seq: std::cell::Cell<Option<u64>>,
}

impl<'t, K: TransactionKind> Tables<'t, K> {
    /// Opens every table in `txn`.
    pub fn open(txn: &'t Transaction<'t, K, NoWriteMap>) -> Result<Self> {
        Ok(Self {
            txn,
            saga: txn.open_table(Some("saga"))?,
            outbox: txn.open_table(Some("outbox"))?,
            checkpoint: txn.open_table(Some("checkpoint"))?,
            dedupe: txn.open_table(Some("dedupe"))?,
            schedule: txn.open_table(Some("schedule"))?,
            deadletter: txn.open_table(Some("deadletter"))?,
            parked: txn.open_table(Some("parked"))?,
            meta: txn.open_table(Some("meta"))?,
            history: txn.open_table(Some("history"))?,
            outbox_seq: std::cell::Cell::new(None),
        })
    }

    /// A saga instance.
    pub fn instance(&self, tenant: &str, saga: &str, corr: &str) -> Result<Option<Instance>> {
        let v: Option<Vec<u8>> = self.txn.get(&self.saga, instance_key(tenant, saga, corr))?;
        v.map(|b| json(&b, "saga instance")).transpose()
    }

    /// Every instance of a tenant's saga (for tests and tools; scans).
    pub fn instances(&self) -> Result<Vec<Instance>> {
        let mut cur = self.txn.cursor(&self.saga)?;
        let mut out = Vec::new();
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (_, v) = item?;
            // History entries live beside their instance; only instances are JSON objects.
            if v.first() == Some(&b'{') {
                out.push(json(&v, "saga instance")?);
            }
        }
        Ok(out)
    }

    /// The distinct (saga, version) pairs of instances still running (scans the table).
    pub fn running_versions(&self) -> Result<Vec<(String, u32)>> {
        let mut set = std::collections::BTreeSet::new();
        for i in self.instances()? {
            if !i.status.is_final() {
                set.insert((i.saga, i.version));
            }
        }
        Ok(set.into_iter().collect())
    }

    /// Last applied stream sequence of `consumer` (0 when none).
    pub fn checkpoint(&self, consumer: &str) -> Result<u64> {
        let v: Option<Vec<u8>> = self.txn.get(&self.checkpoint, consumer.as_bytes())?;
        v.map(|b| u64_of(&b, "checkpoint"))
            .transpose()
            .map(|o| o.unwrap_or(0))
    }

    /// Whether the event was already applied to that saga.
    pub fn is_applied(&self, tenant: &str, saga: &str, event_id: &str) -> Result<bool> {
        let v: Option<()> = self
            .txn
            .get(&self.dedupe, dedupe_key(tenant, saga, event_id))?;
        Ok(v.is_some())
    }

    /// The dead letter that parked an instance key, if parked.
    pub fn parked_by(&self, tenant: &str, saga: &str, corr: &str) -> Result<Option<u64>> {
        let v: Option<Vec<u8>> = self
            .txn
            .get(&self.parked, instance_key(tenant, saga, corr))?;
        v.map(|b| u64_of(&b, "parked")).transpose()
    }

    /// Up to `limit` outbox records of `partition` with sequence `from` or later, in sequence
    /// order, with their sequences.
    pub fn outbox_batch(
        &self,
        partition: u16,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, OutboxRecord)>> {
        let mut cur = self.txn.cursor(&self.outbox)?;
        let mut out = Vec::new();
        for item in cur.iter_from::<Vec<u8>, Vec<u8>>(&outbox_key(partition, from)) {
            let (k, v) = item?;
            if k.len() != 10 || k[..2] != partition.to_be_bytes() || out.len() >= limit {
                break;
            }
            out.push((u64_of(&k[2..], "outbox key")?, OutboxRecord::decode(&v)?));
        }
        Ok(out)
    }

    /// Number of outbox records (all partitions).
    pub fn outbox_depth(&self) -> Result<u64> {
        Ok(self.txn.table_stat(&self.outbox)?.entries() as u64)
    }

    /// Number of pending timers.
    pub fn timers_pending(&self) -> Result<u64> {
        Ok(self.txn.table_stat(&self.schedule)?.entries() as u64)
    }

    /// Up to `limit` timers due at or before `now_ms`, earliest first.
    pub fn due_timers(&self, now_ms: u64, limit: usize) -> Result<Vec<TimerEntry>> {
        let mut cur = self.txn.cursor(&self.schedule)?;
        let mut out = Vec::new();
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (k, v) = item?;
            if out.len() >= limit || k.len() < 8 || u64_of(&k[..8], "schedule key")? > now_ms {
                break;
            }
            out.push(json(&v, "timer")?);
        }
        Ok(out)
    }

    /// Due time of the earliest timer.
    pub fn next_timer_due(&self) -> Result<Option<u64>> {
        let mut cur = self.txn.cursor(&self.schedule)?;
        match cur.first::<Vec<u8>, ()>()? {
            Some((k, ())) if k.len() >= 8 => Ok(Some(u64_of(&k[..8], "schedule key")?)),
            _ => Ok(None),
        }
    }

    /// Timers of one instance.
    pub fn timers_of(&self, tenant: &str, saga: &str, corr: &str) -> Result<Vec<TimerEntry>> {
        let mut cur = self.txn.cursor(&self.schedule)?;
        let mut out = Vec::new();
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (_, v) = item?;
            let t: TimerEntry = json(&v, "timer")?;
            if t.tenant == tenant && t.saga == saga && t.correlation_id == corr {
                out.push(t);
            }
        }
        Ok(out)
    }

    /// One dead letter.
    pub fn dead_letter(&self, tenant: &str, id: u64) -> Result<Option<DeadLetter>> {
        let v: Option<Vec<u8>> = self.txn.get(&self.deadletter, deadletter_key(tenant, id))?;
        v.map(|b| json(&b, "dead letter")).transpose()
    }

    /// Every dead letter, by tenant then id.
    pub fn dead_letters(&self) -> Result<Vec<DeadLetter>> {
        let mut cur = self.txn.cursor(&self.deadletter)?;
        let mut out = Vec::new();
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (_, v) = item?;
            out.push(json(&v, "dead letter")?);
        }
        Ok(out)
    }

    /// The kept transitions of one instance, oldest first.
    pub fn history(&self, tenant: &str, saga: &str, corr: &str) -> Result<Vec<HistoryEntry>> {
        let prefix = history_key(tenant, saga, corr, 0);
        let stem = &prefix[..prefix.len() - 8];
        // Stores written before history moved beside the instances keep it in `history`.
        let mut out = Vec::new();
        for table in [&self.saga, &self.history] {
            let mut cur = self.txn.cursor(table)?;
            for item in cur.iter_from::<Vec<u8>, Vec<u8>>(&prefix) {
                let (k, v) = item?;
                if k.len() != prefix.len() || !k.starts_with(stem) {
                    break;
                }
                out.push(HistoryEntry::decode(&v)?);
            }
            if !out.is_empty() {
                break;
            }
        }
        out.sort_by_key(|e| e.n);
        Ok(out)
    }

    fn meta(&self, name: &str) -> Result<u64> {
        let v: Option<Vec<u8>> = self.txn.get(&self.meta, name.as_bytes())?;
        v.map(|b| u64_of(&b, name))
            .transpose()
            .map(|o| o.unwrap_or(0))
    }
}

impl<'t> Tables<'t, RW> {
    /// Stores an instance.
    pub fn put_instance(&self, inst: &Instance) -> Result<()> {
        let key = instance_key(&inst.tenant, &inst.saga, &inst.correlation_id);
        Ok(self
            .txn
            .put(&self.saga, key, to_json(inst)?, WriteFlags::UPSERT)?)
    }

    /// Advances a consumer's checkpoint.
    pub fn set_checkpoint(&self, consumer: &str, seq: u64) -> Result<()> {
        Ok(self.txn.put(
            &self.checkpoint,
            consumer.as_bytes(),
            seq.to_be_bytes(),
            WriteFlags::UPSERT,
        )?)
    }

    /// Records that the event was applied to that saga.
    pub fn mark_applied(
        &self,
        tenant: &str,
        saga: &str,
        event_id: &str,
        now_ms: u64,
    ) -> Result<()> {
        let key = dedupe_key(tenant, saga, event_id);
        Ok(self
            .txn
            .put(&self.dedupe, key, now_ms.to_be_bytes(), WriteFlags::UPSERT)?)
    }

    /// Appends a record to the outbox; returns its sequence.
    pub fn push_outbox(&self, partition: u16, rec: &OutboxRecord) -> Result<u64> {
        let seq = match self.outbox_seq.get() {
            Some(s) => s,
            None => self.meta("outbox_seq")?,
        } + 1;
        // The counter itself is written once, by `finish`, before the commit.
        self.outbox_seq.set(Some(seq));
        self.txn.put(
            &self.outbox,
            outbox_key(partition, seq),
            rec.encode(),
            WriteFlags::UPSERT,
        )?;
        Ok(seq)
    }

    /// Writes what this transaction counted in memory (the outbox sequence). The store
    /// calls it right before committing; a transaction that is not committed writes nothing.
    pub fn finish(&self) -> Result<()> {
        if let Some(seq) = self.outbox_seq.get() {
            self.txn.put(
                &self.meta,
                b"outbox_seq",
                seq.to_be_bytes(),
                WriteFlags::UPSERT,
            )?;
        }
        Ok(())
    }

    /// Removes published outbox records.
    pub fn delete_outbox(&self, partition: u16, seqs: &[u64]) -> Result<()> {
        for s in seqs {
            self.txn
                .del(&self.outbox, outbox_key(partition, *s), None)?;
        }
        Ok(())
    }

    /// Removes every record of `partition` with sequence `upto` or lower; returns how many.
    pub fn delete_outbox_through(&self, partition: u16, upto: u64) -> Result<usize> {
        let mut doomed = Vec::new();
        {
            let mut cur = self.txn.cursor(&self.outbox)?;
            for item in cur.iter_from::<Vec<u8>, ()>(&outbox_key(partition, 0)) {
                let (k, ()) = item?;
                if k.len() != 10
                    || k[..2] != partition.to_be_bytes()
                    || u64_of(&k[2..], "outbox key")? > upto
                {
                    break;
                }
                doomed.push(k);
            }
        }
        for k in &doomed {
            self.txn.del(&self.outbox, k, None)?;
        }
        Ok(doomed.len())
    }

    /// Schedules a timer.
    pub fn put_timer(&self, t: &TimerEntry) -> Result<()> {
        Ok(self
            .txn
            .put(&self.schedule, t.key(), to_json(t)?, WriteFlags::UPSERT)?)
    }

    /// Unschedules a timer; true if it was there.
    pub fn delete_timer(&self, t: &TimerEntry) -> Result<bool> {
        Ok(self.txn.del(&self.schedule, t.key(), None)?)
    }

    /// Stores a new dead letter, assigning its id.
    pub fn push_dead_letter(&self, mut dl: DeadLetter) -> Result<DeadLetter> {
        let id = self.meta("deadletter_id")? + 1;
        self.txn.put(
            &self.meta,
            b"deadletter_id",
            id.to_be_bytes(),
            WriteFlags::UPSERT,
        )?;
        dl.id = id;
        self.put_dead_letter(&dl)?;
        Ok(dl)
    }

    /// Rewrites a dead letter (status change).
    pub fn put_dead_letter(&self, dl: &DeadLetter) -> Result<()> {
        Ok(self.txn.put(
            &self.deadletter,
            deadletter_key(&dl.tenant, dl.id),
            to_json(dl)?,
            WriteFlags::UPSERT,
        )?)
    }

    /// Parks an instance key behind dead letter `id`.
    pub fn park(&self, tenant: &str, saga: &str, corr: &str, id: u64) -> Result<()> {
        let key = instance_key(tenant, saga, corr);
        Ok(self
            .txn
            .put(&self.parked, key, id.to_be_bytes(), WriteFlags::UPSERT)?)
    }

    /// Records a transition, replacing the one [`HISTORY_KEEP`] transitions older.
    pub fn push_history(
        &self,
        tenant: &str,
        saga: &str,
        corr: &str,
        e: &HistoryEntry,
    ) -> Result<()> {
        // One write per transition: the slot of entry n - HISTORY_KEEP is overwritten. The
        // ring sits in the `saga` table right after its instance's key, so the instance and
        // its history usually share a page and a transition dirties one page, not two.
        let key = history_key(tenant, saga, corr, e.n % HISTORY_KEEP);
        Ok(self
            .txn
            .put(&self.saga, key, e.encode(), WriteFlags::UPSERT)?)
    }

    /// Deletes up to `limit` dedupe markers recorded before `older_than_ms`, scanning from
    /// `from` (a key; empty for the start). Returns how many were deleted and the key to
    /// continue from (`None` when the scan reached the end).
    pub fn sweep_dedupe(
        &self,
        older_than_ms: u64,
        from: &[u8],
        limit: usize,
    ) -> Result<(usize, Option<Vec<u8>>)> {
        let mut cur = self.txn.cursor(&self.dedupe)?;
        let mut doomed = Vec::new();
        let mut next = None;
        for (scanned, item) in cur.iter_from::<Vec<u8>, Vec<u8>>(from).enumerate() {
            let (k, v) = item?;
            if scanned >= limit {
                next = Some(k);
                break;
            }
            if u64_of(&v, "dedupe marker")? < older_than_ms {
                doomed.push(k);
            }
        }
        for k in &doomed {
            self.txn.del(&self.dedupe, k, None)?;
        }
        Ok((doomed.len(), next))
    }

    /// Unparks an instance key.
    pub fn unpark(&self, tenant: &str, saga: &str, corr: &str) -> Result<()> {
        self.txn
            .del(&self.parked, instance_key(tenant, saga, corr), None)?;
        Ok(())
    }
}
