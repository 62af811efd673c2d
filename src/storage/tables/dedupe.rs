//! The `dedupe` table: one marker per event applied to a saga (`tenant 0 saga 0 event_id`),
//! holding the wall-clock time it was applied, a big-endian `u64`.
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

impl<K: TransactionKind> Tables<'_, K> {
    /// Whether the event was already applied to that saga.
    pub fn is_applied(&self, tenant: &str, saga: &str, event_id: &str) -> Result<bool> {
        let v: Option<()> = self
            .txn
            .get(&self.dedupe, dedupe_key(tenant, saga, event_id))?;
        Ok(v.is_some())
    }
}

impl Tables<'_, RW> {
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
}
