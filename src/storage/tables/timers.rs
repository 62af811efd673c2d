//! The `schedule` table: pending saga timers, keyed `due_ms:u64 tenant 0 saga 0
//! correlation_id 0 timer`, each a [`TimerEntry`] as JSON.
//!
//! Guarantee: the key starts with the due time, so the earliest timer is the first key and
//! due timers are read in due order without an index. A timer is set and cancelled in the
//! transaction of the transition that decides it, so a cancelled timer's row is gone
//! before anything could fire it; the saga worker moves its tenant's count of pending
//! timers (`live.rs`) in that same transaction.

use libmdbx::{RW, TransactionKind, WriteFlags};
use serde::{Deserialize, Serialize};

use super::keys::{json, push_parts, to_json, u64_of};
use super::txn::Tables;
use crate::storage::error::Result;

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

impl<K: TransactionKind> Tables<'_, K> {
    /// Number of pending timers.
    pub fn timers_pending(&self) -> Result<u64> {
        Ok(self.txn.table_stat(&self.schedule)?.entries() as u64)
    }

    /// Up to `limit` timers due at or before `now_ms`, earliest first.
    pub fn due_timers(&self, now_ms: u64, limit: usize) -> Result<Vec<TimerEntry>> {
        Ok(self
            .due_timers_kept(now_ms, limit, usize::MAX, |_, _, _, _| true)?
            .0)
    }

    /// Up to `limit` timers due at or before `now_ms` whose row `keep(key, tenant, saga,
    /// correlation_id)` accepts, earliest first, looking at no more than `scan` due rows:
    /// rows `keep` refuses (a partition this node no longer owns, a firing published and
    /// not yet applied) neither count toward `limit` nor hide the rows behind them, and are
    /// judged by their key alone. Returns
    /// the timers and whether the scan stopped at `scan` rows.
    pub fn due_timers_kept(
        &self,
        now_ms: u64,
        limit: usize,
        scan: usize,
        keep: impl Fn(&[u8], &str, &str, &str) -> bool,
    ) -> Result<(Vec<TimerEntry>, bool)> {
        let mut cur = self.txn.cursor(&self.schedule)?;
        let mut out = Vec::new();
        for (looked, item) in cur.iter_start::<Vec<u8>, Vec<u8>>().enumerate() {
            if looked >= scan {
                return Ok((out, true));
            }
            let (k, v) = item?;
            if out.len() >= limit || k.len() < 8 || u64_of(&k[..8], "schedule key")? > now_ms {
                break;
            }
            let mut parts = k[8..].split(|&b| b == 0).map(std::str::from_utf8);
            let kept = match (parts.next(), parts.next(), parts.next()) {
                (Some(Ok(t)), Some(Ok(s)), Some(Ok(c))) => keep(&k, t, s, c),
                // A key not of this layout: judged by its row.
                _ => {
                    let t: TimerEntry = json(&v, "timer")?;
                    keep(&k, &t.tenant, &t.saga, &t.correlation_id)
                }
            };
            if kept {
                out.push(json(&v, "timer")?);
            }
        }
        Ok((out, false))
    }

    /// Due time of the earliest timer.
    pub fn next_timer_due(&self) -> Result<Option<u64>> {
        let mut cur = self.txn.cursor(&self.schedule)?;
        match cur.first::<Vec<u8>, ()>()? {
            Some((k, ())) if k.len() >= 8 => Ok(Some(u64_of(&k[..8], "schedule key")?)),
            _ => Ok(None),
        }
    }

    /// Whether `t` is still pending, exactly as scheduled (one lookup by its key).
    pub fn timer_pending(&self, t: &TimerEntry) -> Result<bool> {
        let v: Option<Vec<u8>> = self.txn.get(&self.schedule, t.key())?;
        v.map(|b| json::<TimerEntry>(&b, "timer").map(|e| e == *t))
            .transpose()
            .map(|p| p.unwrap_or(false))
    }

    /// Timers of one instance (a scan of the whole schedule: for an operator's view, not
    /// for the pipeline).
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
}

impl Tables<'_, RW> {
    /// Schedules a timer; true if no row of its key was there (one more pending).
    pub fn put_timer(&self, t: &TimerEntry) -> Result<bool> {
        let k = t.key();
        let was: Option<()> = self.txn.get(&self.schedule, &k)?;
        self.txn
            .put(&self.schedule, k, to_json(t)?, WriteFlags::UPSERT)?;
        Ok(was.is_none())
    }

    /// Unschedules a timer; true if it was there.
    pub fn delete_timer(&self, t: &TimerEntry) -> Result<bool> {
        Ok(self.txn.del(&self.schedule, t.key(), None)?)
    }
}
