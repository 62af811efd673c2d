//! Instance history: the last [`HISTORY_KEEP`] transitions of each instance, for
//! `runner inspect`, kept as a ring of [`HistoryEntry`] rows in the `saga` table right after
//! their instance's key (`tenant 0 saga 0 correlation_id 0 slot:u64`, slot = n mod
//! [`HISTORY_KEEP`]). The `history` table holds what earlier versions wrote; it is read,
//! no longer written.
//!
//! Guarantee: bounded and cheap. Each transition overwrites one slot in the transaction
//! that applies it (one write, usually on the page its instance already dirtied), so the
//! history never grows past [`HISTORY_KEEP`] entries per instance and never lags its state.

use libmdbx::{RW, TransactionKind, WriteFlags};
use serde::{Deserialize, Serialize};

use super::keys::{instance_key, json};
use super::txn::Tables;
use crate::storage::codec::{Reader, Writer};
use crate::storage::error::Result;

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

/// Format byte of a binary history entry (see [`crate::storage::codec`]).
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

impl<K: TransactionKind> Tables<'_, K> {
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
}

impl Tables<'_, RW> {
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
}
