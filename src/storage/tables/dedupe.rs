//! The `dedupe` table: one marker per event applied to a saga (`tenant 0 saga 0 event_id`),
//! holding the wall-clock time it was applied (a big-endian `u64`) and, since markers record
//! it, a fingerprint of the instance it was applied to (a second big-endian `u64`), so an
//! event id reused for another instance is told apart from a redelivery. Markers written
//! since snapshots carry them also hold the instance's partition and the partition count
//! (two big-endian `u32`s, [`MarkerPlace`]): that is how a snapshot of a partition finds
//! its markers, although their key names no instance. Older markers (8 or 16 bytes) are
//! read the same way and simply stay with the store that wrote them.
//!
//! Guarantee: a marker is written in the transaction that applies its event, so an event
//! published twice (under two stream sequences) is applied once for as long as its marker
//! is kept (`saga.dedupe_retention`); the sweep deletes only markers older than that.

use libmdbx::{RW, TransactionKind, WriteFlags};

use super::keys::{instance_key, u64_of};
use super::txn::Tables;
use crate::storage::error::Result;

/// Key of a dedupe marker.
pub fn dedupe_key(tenant: &str, saga: &str, event_id: &str) -> Vec<u8> {
    instance_key(tenant, saga, event_id)
}

/// The fingerprint of an instance key a marker records (FNV-1a, 64 bits).
pub fn instance_fingerprint(correlation_id: &str) -> u64 {
    correlation_id
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// The partition of the instance a marker's event was applied to, and the partition count
/// then: a marker belongs to partition `partition` only while the count is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkerPlace {
    /// The instance's partition.
    pub partition: u32,
    /// The partition count when the marker was written.
    pub partitions: u32,
}

impl MarkerPlace {
    /// The place a marker value records, if it records one.
    pub fn of_marker(value: &[u8]) -> Option<Self> {
        let b = value.get(16..24)?;
        Some(Self {
            partition: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            partitions: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
        })
    }
}

/// What a dedupe marker says about an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Not applied to this saga (or its marker expired).
    No,
    /// Applied to the instance with this fingerprint (`None`: a marker from before
    /// fingerprints were recorded).
    To(Option<u64>),
}

impl<K: TransactionKind> Tables<'_, K> {
    /// Whether the event was already applied to that saga.
    pub fn is_applied(&self, tenant: &str, saga: &str, event_id: &str) -> Result<bool> {
        Ok(self.applied(tenant, saga, event_id)? != Applied::No)
    }

    /// Whether, and to which instance, the event was already applied to that saga.
    pub fn applied(&self, tenant: &str, saga: &str, event_id: &str) -> Result<Applied> {
        let v: Option<Vec<u8>> = self
            .txn
            .get(&self.dedupe, dedupe_key(tenant, saga, event_id))?;
        Ok(match v {
            None => Applied::No,
            Some(b) if b.len() >= 16 => Applied::To(Some(u64_of(&b[8..16], "dedupe marker")?)),
            Some(_) => Applied::To(None),
        })
    }
}

impl Tables<'_, RW> {
    /// Records that the event was applied to that saga (to no particular instance).
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

    /// Records that the event was applied to instance `correlation_id` of that saga, which
    /// lives in partition `place` (so the partition's snapshots carry the marker).
    pub fn mark_applied_to(
        &self,
        tenant: &str,
        saga: &str,
        event_id: &str,
        correlation_id: &str,
        now_ms: u64,
        place: MarkerPlace,
    ) -> Result<()> {
        let key = dedupe_key(tenant, saga, event_id);
        let mut v = [0u8; 24];
        v[..8].copy_from_slice(&now_ms.to_be_bytes());
        v[8..16].copy_from_slice(&instance_fingerprint(correlation_id).to_be_bytes());
        v[16..20].copy_from_slice(&place.partition.to_be_bytes());
        v[20..].copy_from_slice(&place.partitions.to_be_bytes());
        Ok(self.txn.put(&self.dedupe, key, v, WriteFlags::UPSERT)?)
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
            if u64_of(v.get(..8).unwrap_or(&v), "dedupe marker")? < older_than_ms {
                doomed.push(k);
            }
        }
        for k in &doomed {
            self.txn.del(&self.dedupe, k, None)?;
        }
        Ok((doomed.len(), next))
    }
}
