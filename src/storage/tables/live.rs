//! The `live` table: how many saga instances each tenant has running, per partition.
//!
//! Key `tenant 0 partition:u16`, value the count as a big-endian `u64` (a row at zero is
//! deleted). An instance is *live* while its status is `running`: once it completes,
//! fails, is compensated or waits for an operator it no longer counts.
//!
//! **Guarantees.**
//! - **Exact, in the same commit.** The count moves in the transaction that writes the
//!   instance ([`Tables::count_live`], called by the saga worker for every transition), so
//!   a committed count is the number of committed running instances, never ahead of or
//!   behind them.
//! - **Per partition, decided by the partition's own log.** A partition's counts are
//!   changed only by applying that partition's inputs, so every owner that applies the
//!   same inputs to the same snapshot reaches the same counts (what a per-partition limit
//!   needs to decide the same way on a replay).
//! - **Rebuilt where rows arrive whole.** A store written before this table existed is
//!   counted once when partition ownership starts ([`Tables::count_live_if_missing`]), and
//!   a partition restored from a snapshot is counted again from the rows it brought
//!   ([`Tables::recount_live`]): snapshots carry instances, not counts, so a count can
//!   never disagree with the rows it describes.

use std::collections::BTreeMap;

use libmdbx::{RW, TransactionKind, WriteFlags};

use super::keys::{split_tenant_partition, tenant_partition, u64_of};
use super::txn::Tables;
use crate::saga::Status;
use crate::storage::error::{Result, StorageError};

/// `meta` entry: the partition count the `live` table was last counted for in full.
const LIVE_COUNTED_FOR: &str = "live_counted_for";

/// The tenant and partition of a `live` key.
fn parts(k: &[u8]) -> Result<(String, u32)> {
    match split_tenant_partition(k, "live count")? {
        (tenant, p, []) => Ok((tenant.to_string(), p)),
        _ => Err(StorageError::Corrupt("live count: malformed key".into())),
    }
}

/// The fields of a stored instance a count reads.
#[derive(serde::Deserialize)]
struct Head {
    tenant: String,
    status: Status,
}

impl<K: TransactionKind> Tables<'_, K> {
    /// Running instances of `tenant` in `partition`.
    pub fn live(&self, tenant: &str, partition: u32) -> Result<u64> {
        let v: Option<Vec<u8>> = self
            .txn
            .get(&self.live, tenant_partition(tenant, partition)?)?;
        v.map(|b| u64_of(&b, "live count"))
            .transpose()
            .map(|o| o.unwrap_or(0))
    }

    /// Running instances per tenant, over the partitions `mine` accepts.
    pub fn live_by_tenant(&self, mine: impl Fn(u32) -> bool) -> Result<BTreeMap<String, u64>> {
        let mut out = BTreeMap::new();
        let mut cur = self.txn.cursor(&self.live)?;
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (k, v) = item?;
            let (tenant, p) = parts(&k)?;
            if mine(p) {
                *out.entry(tenant).or_insert(0) += u64_of(&v, "live count")?;
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
        self.set_live(tenant, partition, n)
    }

    fn set_live(&self, tenant: &str, partition: u32, n: u64) -> Result<()> {
        let k = tenant_partition(tenant, partition)?;
        if n == 0 {
            self.txn.del(&self.live, k, None)?;
        } else {
            self.txn
                .put(&self.live, k, n.to_be_bytes(), WriteFlags::UPSERT)?;
        }
        Ok(())
    }

    /// Counts again, from the stored instances, the partitions `only` accepts, of
    /// `partitions`, placing an instance with `of`; returns the running instances counted.
    pub fn recount_live(
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
        let mut total = 0;
        for ((tenant, p), n) in counts {
            total += n;
            self.set_live(&tenant, p, n)?;
        }
        Ok(total)
    }

    /// Counts every partition once, when the table was never counted for `partitions`
    /// partitions (a store written before it existed); returns the running instances
    /// counted then, `None` when it was counted already.
    pub fn count_live_if_missing(
        &self,
        partitions: u32,
        of: impl Fn(&str, &str, &str) -> u32,
    ) -> Result<Option<u64>> {
        if self.meta(LIVE_COUNTED_FOR)? == u64::from(partitions) {
            return Ok(None);
        }
        let n = self.recount_live(partitions, of, |_| true)?;
        self.txn.put(
            &self.meta,
            LIVE_COUNTED_FOR.as_bytes(),
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
        let k = tenant_partition("acme", 513).expect("a key");
        assert_eq!(parts(&k).expect("its parts"), ("acme".to_string(), 513));
        assert!(tenant_partition("acme", 70_000).is_err());
        assert!(parts(b"x").is_err());
    }
}
