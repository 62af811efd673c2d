//! The `outbox` table: messages waiting for the relay, keyed `partition:u16 seq:u64`, each an
//! [`OutboxRecord`] in the binary layout of [`crate::storage::codec`].
//!
//! Guarantee: a record is written in the same transaction as the state change that emitted
//! it, under the next sequence of its partition (the counter lives in `meta` and is written
//! once per transaction by [`Tables::finish`]), so records are published in the order their
//! causes were committed, and a message exists if and only if its cause is durable.
//! Writers delete records only up to the relay's acknowledged prefix
//! ([`crate::relay::RelayHandle::deletable_through`]).

use libmdbx::{RW, TransactionKind, WriteFlags};
use serde::{Deserialize, Serialize};

use super::keys::{OUTBOX_SEQ, json, u64_of};
use super::txn::Tables;
use crate::storage::codec::{Reader, Writer};
use crate::storage::error::Result;

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
    /// What caused the record, in partitioned mode: the SAGA_INBOX sequence of the input
    /// (or the partition's checkpoint when a timer fired) and the record's rank among that
    /// cause's records. The relay compares it with the partition's fence watermark, so a
    /// record whose cause a predecessor already published is not published again.
    /// `(0, 0)`: unpartitioned.
    #[serde(default)]
    pub cause: (u64, u32),
}

/// Format byte of a binary outbox record (see [`crate::storage::codec`]).
const OUTBOX_FORMAT_1: u8 = 1;
/// Format 2: format 1 with the cause (sequence, rank) before the body.
const OUTBOX_FORMAT_2: u8 = 2;

impl OutboxRecord {
    /// The bytes the record takes as a message: subject, id, tenant, trace context and
    /// body (what a tenant's cap on outbox bytes counts).
    pub fn size(&self) -> u64 {
        (self.subject.len()
            + self.msg_id.len()
            + self.tenant.len()
            + self.traceparent.as_ref().map_or(0, String::len)
            + self.body.len()) as u64
    }

    /// Encodes the record: subject, msg id, tenant, traceparent, then the body bytes to
    /// the end, stored as they are (no escaping, no second JSON around them).
    pub fn encode(&self) -> Vec<u8> {
        let size = 16 + self.subject.len() + self.msg_id.len() + self.tenant.len();
        if self.cause == (0, 0) {
            return Writer::new(OUTBOX_FORMAT_1, size + self.body.len() + 64)
                .str(&self.subject)
                .str(&self.msg_id)
                .str(&self.tenant)
                .opt_str(self.traceparent.as_deref())
                .tail(self.body.as_bytes())
                .finish();
        }
        Writer::new(OUTBOX_FORMAT_2, size + self.body.len() + 80)
            .str(&self.subject)
            .str(&self.msg_id)
            .str(&self.tenant)
            .opt_str(self.traceparent.as_deref())
            .u64(self.cause.0)
            .u64(u64::from(self.cause.1))
            .tail(self.body.as_bytes())
            .finish()
    }

    /// Decodes what [`OutboxRecord::encode`] wrote, or the JSON form of older stores.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        if let Some(mut r) = Reader::open(bytes, OUTBOX_FORMAT_2, "outbox record") {
            return Ok(Self {
                subject: r.str()?,
                msg_id: r.str()?,
                tenant: r.str()?,
                traceparent: r.opt_str()?,
                cause: (r.u64()?, r.u64()? as u32),
                body: r.rest()?,
            });
        }
        let Some(mut r) = Reader::open(bytes, OUTBOX_FORMAT_1, "outbox record") else {
            return json(bytes, "outbox record");
        };
        Ok(Self {
            subject: r.str()?,
            msg_id: r.str()?,
            tenant: r.str()?,
            traceparent: r.opt_str()?,
            body: r.rest()?,
            cause: (0, 0),
        })
    }
}

fn outbox_key(partition: u16, seq: u64) -> [u8; 10] {
    let mut k = [0u8; 10];
    k[..2].copy_from_slice(&partition.to_be_bytes());
    k[2..].copy_from_slice(&seq.to_be_bytes());
    k
}

impl<K: TransactionKind> Tables<'_, K> {
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

    /// Number of outbox records of `partition` (a scan of its keys: for start-up).
    pub fn outbox_len(&self, partition: u16) -> Result<u64> {
        let mut cur = self.txn.cursor(&self.outbox)?;
        let mut n = 0;
        for item in cur.iter_from::<Vec<u8>, ()>(&outbox_key(partition, 0)) {
            let (k, ()) = item?;
            if k.len() != 10 || k[..2] != partition.to_be_bytes() {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Bytes ([`OutboxRecord::size`]) of `partition`'s records, per tenant (a scan of its
    /// records: for start-up).
    pub fn outbox_bytes_by_tenant(
        &self,
        partition: u16,
    ) -> Result<std::collections::HashMap<String, u64>> {
        let mut out = std::collections::HashMap::new();
        let mut cur = self.txn.cursor(&self.outbox)?;
        for item in cur.iter_from::<Vec<u8>, Vec<u8>>(&outbox_key(partition, 0)) {
            let (k, v) = item?;
            if k.len() != 10 || k[..2] != partition.to_be_bytes() {
                break;
            }
            let rec = OutboxRecord::decode(&v)?;
            let size = rec.size();
            *out.entry(rec.tenant).or_insert(0) += size;
        }
        Ok(out)
    }

    /// Number of outbox records (all partitions).
    pub fn outbox_depth(&self) -> Result<u64> {
        Ok(self.txn.table_stat(&self.outbox)?.entries() as u64)
    }
}

impl Tables<'_, RW> {
    /// Appends a record to the outbox; returns its sequence.
    pub fn push_outbox(&self, partition: u16, rec: &OutboxRecord) -> Result<u64> {
        let seq = match self.outbox_seq.get() {
            Some(s) => s,
            None => self.meta(OUTBOX_SEQ)?,
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

    /// Writes `rec` in place of outbox record `seq` of `partition` (same place in outbox
    /// order; used to put a dead letter where an unpublishable record was).
    pub fn replace_outbox(&self, partition: u16, seq: u64, rec: &OutboxRecord) -> Result<()> {
        Ok(self.txn.put(
            &self.outbox,
            outbox_key(partition, seq),
            rec.encode(),
            WriteFlags::UPSERT,
        )?)
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
}
