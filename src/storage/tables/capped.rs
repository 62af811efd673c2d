//! The `capped` table: per tenant and partition, the keys whose inputs are held at the
//! tenant's cap on running instances, oldest first (`worker/cap.rs` decides; this is where it
//! keeps its queue).
//!
//! A queued key is the row `tenant 0 partition:u16 first:u64`, where `first` is the id of the
//! held letter that parks the key (ids increase, so key order is arrival order); each letter
//! held behind it is a row `tenant 0 partition:u16 first:u64 id:u64`, right after it in key
//! order. Values are empty. Holding one more input behind a key writes one row, however many
//! wait there already.
//!
//! **Guarantees.**
//! - **Derived, never the only record.** Each row mirrors `tenant_capped` letters, which hold
//!   the inputs whole; [`Tables::rebuild_capped`] remakes a partition's rows from them, which
//!   a partition restored from a snapshot does (snapshots carry the letters, not this queue).
//! - **Oldest first, per partition.** [`Tables::oldest_capped`] is one seek.

use std::collections::BTreeMap;

use libmdbx::{RW, TransactionKind, WriteFlags};

use super::keys::{split_tenant_partition, tenant_partition, u64_of};
use super::txn::Tables;
use crate::storage::error::{Result, StorageError};
use crate::storage::tables::{DeadLetter, DeadLetterStatus};

/// The kind of letter this table queues (`crate::deadletter::kind::TENANT_CAPPED`).
const CAPPED: &str = "tenant_capped";

fn key(tenant: &str, partition: u32, first: u64) -> Result<Vec<u8>> {
    let mut k = tenant_partition(tenant, partition)?;
    k.extend_from_slice(&first.to_be_bytes());
    Ok(k)
}

/// What one `capped` row says: the tenant, the partition, the key's first letter and, for a
/// row of a letter held behind it, that letter.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    tenant: String,
    partition: u32,
    first: u64,
    behind: Option<u64>,
}

fn parts(k: &[u8]) -> Result<Row> {
    let (tenant, partition, rest) = split_tenant_partition(k, "capped")?;
    if rest.len() != 8 && rest.len() != 16 {
        return Err(StorageError::Corrupt("capped: malformed key".into()));
    }
    Ok(Row {
        tenant: tenant.to_string(),
        partition,
        first: u64_of(&rest[..8], "capped key")?,
        behind: rest
            .get(8..16)
            .map(|b| u64_of(b, "capped key"))
            .transpose()?,
    })
}

/// One key held at a cap: the letter that parks it and those held behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CappedKey {
    /// The id of the letter that parks the key.
    pub first: u64,
    /// The ids of the letters held behind it, oldest first.
    pub behind: Vec<u64>,
}

/// A tenant's inputs held at its cap, over some partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldAtCap {
    /// Inputs held: each key's first and those behind it.
    pub inputs: u64,
    /// The id of the letter of the oldest key held (ids increase with time).
    pub oldest: u64,
}

impl<K: TransactionKind> Tables<'_, K> {
    /// The oldest key of `tenant` held at its cap in `partition`.
    pub fn oldest_capped(&self, tenant: &str, partition: u32) -> Result<Option<CappedKey>> {
        let pre = tenant_partition(tenant, partition)?;
        let mut cur = self.txn.cursor(&self.capped)?;
        let mut key: Option<CappedKey> = None;
        for item in cur.iter_from::<Vec<u8>, Vec<u8>>(&pre) {
            let (k, _) = item?;
            if !k.starts_with(&pre) {
                break;
            }
            let row = parts(&k)?;
            match (&mut key, row.behind) {
                (None, None) => {
                    key = Some(CappedKey {
                        first: row.first,
                        behind: Vec::new(),
                    })
                }
                (None, Some(_)) => {
                    return Err(StorageError::Corrupt(
                        "capped: a letter queued behind no key".into(),
                    ));
                }
                (Some(q), Some(id)) if row.first == q.first => q.behind.push(id),
                (Some(_), _) => break,
            }
        }
        Ok(key)
    }

    /// Inputs held at a cap per tenant (each key's first and those behind it), over the
    /// partitions `mine` accepts, with the id of the tenant's oldest held key's letter.
    pub fn capped_by_tenant(
        &self,
        mine: impl Fn(u32) -> bool,
    ) -> Result<BTreeMap<String, HeldAtCap>> {
        let mut out: BTreeMap<String, HeldAtCap> = BTreeMap::new();
        let mut cur = self.txn.cursor(&self.capped)?;
        for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
            let (k, _) = item?;
            let row = parts(&k)?;
            if mine(row.partition) {
                let e = out.entry(row.tenant).or_insert(HeldAtCap {
                    inputs: 0,
                    oldest: row.first,
                });
                e.inputs += 1;
                e.oldest = e.oldest.min(row.first);
            }
        }
        Ok(out)
    }
}

impl Tables<'_, RW> {
    /// Queues a key of `tenant` in `partition`, parked by letter `first`.
    pub fn push_capped(&self, tenant: &str, partition: u32, first: u64) -> Result<()> {
        let k = key(tenant, partition, first)?;
        Ok(self
            .txn
            .put(&self.capped, k, [] as [u8; 0], WriteFlags::UPSERT)?)
    }

    /// Adds letter `id` behind the key parked by `first`; false when no such key is queued.
    pub fn behind_capped(&self, tenant: &str, partition: u32, first: u64, id: u64) -> Result<bool> {
        let mut k = key(tenant, partition, first)?;
        if self.txn.get::<Vec<u8>>(&self.capped, &k)?.is_none() {
            return Ok(false);
        }
        k.extend_from_slice(&id.to_be_bytes());
        self.txn
            .put(&self.capped, k, [] as [u8; 0], WriteFlags::UPSERT)?;
        Ok(true)
    }

    /// Takes the key parked by `first` off the queue, with the letters behind it.
    pub fn drop_capped(&self, tenant: &str, partition: u32, first: u64) -> Result<()> {
        let k = key(tenant, partition, first)?;
        let mut rows: Vec<Vec<u8>> = Vec::new();
        {
            let mut cur = self.txn.cursor(&self.capped)?;
            for item in cur.iter_from::<Vec<u8>, Vec<u8>>(&k) {
                let (r, _) = item?;
                if !r.starts_with(&k) {
                    break;
                }
                rows.push(r);
            }
        }
        for r in rows {
            self.txn.del(&self.capped, r, None)?;
        }
        Ok(())
    }

    /// Remakes the queue of the partitions `only` accepts from the pending `tenant_capped`
    /// letters, placing a letter's key with `of`; returns the keys queued.
    pub fn rebuild_capped(
        &self,
        of: impl Fn(&str, &str, &str) -> u32,
        only: impl Fn(u32) -> bool,
    ) -> Result<usize> {
        let stale: Vec<Vec<u8>> = {
            let mut cur = self.txn.cursor(&self.capped)?;
            let mut stale = Vec::new();
            for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
                let (k, _) = item?;
                if only(parts(&k)?.partition) {
                    stale.push(k);
                }
            }
            stale
        };
        for k in stale {
            self.txn.del(&self.capped, k, None)?;
        }
        // Per key, its held letters in id order (the letters are read in key order,
        // `tenant 0 id`, so each tenant's come oldest first).
        let mut keys: BTreeMap<(String, u32, String, String), Vec<u64>> = BTreeMap::new();
        for d in self.dead_letters()? {
            let DeadLetter {
                tenant,
                kind,
                status,
                saga: Some(saga),
                correlation_id: Some(corr),
                id,
                ..
            } = d
            else {
                continue;
            };
            if kind != CAPPED || status != DeadLetterStatus::Pending {
                continue;
            }
            let p = of(&tenant, &saga, &corr);
            if only(p) {
                keys.entry((tenant, p, saga, corr)).or_default().push(id);
            }
        }
        let mut queued = 0;
        for ((tenant, p, saga, corr), letters) in keys {
            // Only a key a capped letter parks is queued; one parked by something else (a
            // failure during a release) waits for its operator.
            let Some(first) = self.parked_by(&tenant, &saga, &corr)? else {
                continue;
            };
            if letters.first() != Some(&first) {
                continue;
            }
            self.push_capped(&tenant, p, first)?;
            for id in &letters[1..] {
                self.behind_capped(&tenant, p, first, *id)?;
            }
            queued += 1;
        }
        Ok(queued)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_reads_back_and_orders_by_arrival() {
        let k = key("acme", 3, 42).expect("key");
        let row = |behind| Row {
            tenant: "acme".to_string(),
            partition: 3,
            first: 42,
            behind,
        };
        assert_eq!(parts(&k).expect("parts"), row(None));
        let mut b = k.clone();
        b.extend_from_slice(&7u64.to_be_bytes());
        assert_eq!(parts(&b).expect("parts"), row(Some(7)));
        // A key's letters behind it sort right after it, before the next key.
        assert!(k < b && b < key("acme", 3, 43).expect("key"));
        assert!(key("acme", 3, 9).expect("key") < key("acme", 3, 10).expect("key"));
        assert!(parts(b"short").is_err());
    }
}
