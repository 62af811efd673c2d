//! The `live` table: per tenant and partition, how many saga instances run and how many
//! timers are pending.
//!
//! Key `tenant 0 partition:u16` for running instances, the same followed by `T` for
//! pending timers; value the count as a big-endian `u64` (a row at zero is deleted). An
//! instance is *live* while its status is `running`: once it completes, fails, is
//! compensated or waits for an operator it no longer counts. A timer is *pending* while its
//! row is in the schedule (`timers.rs`): set and not yet fired or cancelled.
//!
//! **Guarantees.**
//! - **Exact, in the same commit.** A count moves in the transaction that writes the
//!   instance ([`Tables::count_live`], called by the saga worker for every transition) or
//!   the schedule row ([`Tables::count_timers`], for every timer set, cancelled or fired),
//!   so a committed count is the number of committed rows it describes, never ahead of or
//!   behind them.
//! - **Per partition, decided by the partition's own log.** A partition's counts are
//!   changed only by applying that partition's inputs, so every owner that applies the
//!   same inputs to the same snapshot reaches the same counts (what a per-partition limit
//!   needs to decide the same way on a replay).
//! - **Rebuilt where rows arrive whole.** A store written before a count existed is
//!   counted once when partition ownership starts ([`Tables::count_if_missing`]), and a
//!   partition restored from a snapshot is counted again from the rows it brought
//!   ([`Tables::recount`]): snapshots carry instances and timers, not counts, so a count
//!   can never disagree with the rows it describes.

use std::collections::BTreeMap;

use libmdbx::{RW, TransactionKind, WriteFlags};

use super::keys::{json, split_tenant_partition, tenant_partition, u64_of};
use super::timers::TimerEntry;
use super::txn::Tables;
use crate::saga::Status;
use crate::storage::error::{Result, StorageError};

/// `meta` entry: the partition count the `live` table was last counted for in full (both
/// counts; stores that kept only running instances wrote `live_counted_for`).
const COUNTED_FOR: &str = "tenant_counts_for";

/// What a row of the `live` table counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Running instances.
    Live,
    /// Pending timers.
    Timers,
}

impl Counted {
    /// What follows the tenant and partition in the key.
    fn suffix(self) -> &'static [u8] {
        match self {
            Counted::Live => b"",
            Counted::Timers => b"T",
        }
    }
}

/// One tenant's counts over some partitions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantCounts {
    /// Running instances.
    pub live: u64,
    /// Pending timers.
    pub timers: u64,
}

/// The key of `tenant`'s count of `what` in `partition`.
fn key(tenant: &str, partition: u32, what: Counted) -> Result<Vec<u8>> {
    let mut k = tenant_partition(tenant, partition)?;
    k.extend_from_slice(what.suffix());
    Ok(k)
}

/// The tenant, partition and kind of a `live` key.
fn parts(k: &[u8]) -> Result<(String, u32, Counted)> {
    match split_tenant_partition(k, "tenant count")? {
        (tenant, p, []) => Ok((tenant.to_string(), p, Counted::Live)),
        (tenant, p, b"T") => Ok((tenant.to_string(), p, Counted::Timers)),
        _ => Err(StorageError::Corrupt("tenant count: malformed key".into())),
    }
}

/// The fields of a stored instance a count reads.
#[derive(serde::Deserialize)]
struct Head {
    tenant: String,
    status: Status,
}

impl<K: TransactionKind> Tables<'_, K> {
    /// `tenant`'s count of `what` in `partition`.
    pub fn counted(&self, tenant: &str, partition: u32, what: Counted) -> Result<u64> {
        let v: Option<Vec<u8>> = self.txn.get(&self.live, key(tenant, partition, what)?)?;
        v.map(|b| u64_of(&b, "tenant count"))
            .transpose()
            .map(|o| o.unwrap_or(0))
    }

    /// Running instances of `tenant` in `partition`.
    pub fn live(&self, tenant: &str, partition: u32) -> Result<u64> {
        self.counted(tenant, partition, Counted::Live)
    }

    /// Both counts per tenant, over the partitions `mine` accepts.
    pub fn counts_by_tenant(
        &self,
        mine: impl Fn(u32) -> bool,
    ) -> Result<BTreeMap<String, TenantCounts>> {
        let mut out: BTreeMap<String, TenantCounts> = BTreeMap::new();
        let mut cur = self.txn.cursor(&self.live)?;
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (k, v) = item?;
            let (tenant, p, what) = parts(&k)?;
            if mine(p) {
                let n = u64_of(&v, "tenant count")?;
                let c = out.entry(tenant).or_default();
                match what {
                    Counted::Live => c.live += n,
                    Counted::Timers => c.timers += n,
                }
            }
        }
        Ok(out)
    }
}

impl Tables<'_, RW> {
    /// Moves `tenant`'s count in `partition` for one instance write: `before` is the
    /// instance's status when read (`None`: new), `after` the status written.
    pub fn count_live(
        &self,
        tenant: &str,
        partition: u32,
        before: Option<Status>,
        after: Status,
    ) -> Result<()> {
        let was = before.is_some_and(|s| !s.is_final());
        let is = !after.is_final();
        if was == is {
            return Ok(());
        }
        let n = self.live(tenant, partition)?;
        let n = if is { n + 1 } else { n.saturating_sub(1) };
        self.set_count(tenant, partition, Counted::Live, n)
    }

    /// Moves `tenant`'s count of pending timers in `partition` by `set` timers added to
    /// the schedule and `gone` taken from it (fired or cancelled).
    pub fn count_timers(&self, tenant: &str, partition: u32, set: u64, gone: u64) -> Result<()> {
        if set == gone {
            return Ok(());
        }
        let n = self.counted(tenant, partition, Counted::Timers)?;
        let n = (n + set).saturating_sub(gone);
        self.set_count(tenant, partition, Counted::Timers, n)
    }

    fn set_count(&self, tenant: &str, partition: u32, what: Counted, n: u64) -> Result<()> {
        let k = key(tenant, partition, what)?;
        if n == 0 {
            self.txn.del(&self.live, k, None)?;
        } else {
            self.txn
                .put(&self.live, k, n.to_be_bytes(), WriteFlags::UPSERT)?;
        }
        Ok(())
    }

    /// Counts again, from the stored instances and timers, the partitions `only` accepts,
    /// of `partitions`, placing an instance with `of`; returns the running instances
    /// counted.
    pub fn recount(
        &self,
        partitions: u32,
        of: impl Fn(&str, &str, &str) -> u32,
        only: impl Fn(u32) -> bool,
    ) -> Result<u64> {
        let stale: Vec<Vec<u8>> = {
            let mut cur = self.txn.cursor(&self.live)?;
            let mut stale = Vec::new();
            for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
                let (k, _) = item?;
                if only(parts(&k)?.1) {
                    stale.push(k);
                }
            }
            stale
        };
        for k in stale {
            self.txn.del(&self.live, k, None)?;
        }
        let mut counts: BTreeMap<(String, u32), u64> = BTreeMap::new();
        {
            let mut cur = self.txn.cursor(&self.saga)?;
            for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
                let (k, v) = item?;
                // History entries live beside their instance (a fourth key part); only
                // instances are JSON. The key places the instance before anything is decoded.
                let mut key_parts = k.split(|&b| b == 0).map(std::str::from_utf8);
                let (Some(Ok(t)), Some(Ok(saga)), Some(Ok(corr)), None) = (
                    key_parts.next(),
                    key_parts.next(),
                    key_parts.next(),
                    key_parts.next(),
                ) else {
                    continue;
                };
                let p = of(t, saga, corr);
                if p >= partitions || !only(p) || v.first() != Some(&b'{') {
                    continue;
                }
                let h: Head = serde_json::from_slice(&v)
                    .map_err(|e| StorageError::Corrupt(format!("saga instance: {e}")))?;
                if !h.status.is_final() {
                    *counts.entry((h.tenant, p)).or_insert(0) += 1;
                }
            }
        }
        let mut timers: BTreeMap<(String, u32), u64> = BTreeMap::new();
        {
            let mut cur = self.txn.cursor(&self.schedule)?;
            for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
                let (_, v) = item?;
                let t: TimerEntry = json(&v, "timer")?;
                let p = of(&t.tenant, &t.saga, &t.correlation_id);
                if p < partitions && only(p) {
                    *timers.entry((t.tenant, p)).or_insert(0) += 1;
                }
            }
        }
        for ((tenant, p), n) in timers {
            self.set_count(&tenant, p, Counted::Timers, n)?;
        }
        let mut total = 0;
        for ((tenant, p), n) in counts {
            total += n;
            self.set_count(&tenant, p, Counted::Live, n)?;
        }
        Ok(total)
    }

    /// Counts every partition once, when the table was never counted for `partitions`
    /// partitions (a store written before its counts existed); returns the running
    /// instances counted then, `None` when it was counted already.
    pub fn count_if_missing(
        &self,
        partitions: u32,
        of: impl Fn(&str, &str, &str) -> u32,
    ) -> Result<Option<u64>> {
        if self.meta(COUNTED_FOR)? == u64::from(partitions) {
            return Ok(None);
        }
        let n = self.recount(partitions, of, |_| true)?;
        self.txn.put(
            &self.meta,
            COUNTED_FOR.as_bytes(),
            u64::from(partitions).to_be_bytes(),
            WriteFlags::UPSERT,
        )?;
        Ok(Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_reads_back_as_its_tenant_and_partition() {
        let k = key("acme", 513, Counted::Live).expect("a key");
        assert_eq!(
            parts(&k).expect("its parts"),
            ("acme".to_string(), 513, Counted::Live)
        );
        let k = key("acme", 7, Counted::Timers).expect("a key");
        assert_eq!(
            parts(&k).expect("its parts"),
            ("acme".to_string(), 7, Counted::Timers)
        );
        assert!(tenant_partition("acme", 70_000).is_err());
        assert!(parts(b"x").is_err());
    }
}
