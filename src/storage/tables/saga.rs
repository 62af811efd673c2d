//! The `saga` table: one saga instance per `tenant 0 saga 0 correlation_id` key, as JSON.
//!
//! Guarantee: an instance is only ever written whole, inside the caller's transaction, so a
//! reader sees the state of the last committed input and never a half-applied one. The
//! instance's history ring shares this table (see [`super::history`]); readers here skip it.

use libmdbx::{RW, TransactionKind, WriteFlags};

use super::keys::{instance_key, json, to_json};
use super::txn::Tables;
use crate::saga::Instance;
use crate::storage::error::Result;

impl<K: TransactionKind> Tables<'_, K> {
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
}

/// The fields of a stored instance the retention sweep reads (the rest is skipped).
#[derive(serde::Deserialize)]
struct Head {
    tenant: String,
    saga: String,
    correlation_id: String,
    status: crate::saga::Status,
    updated_ms: u64,
}

impl Tables<'_, RW> {
    /// Removes up to `limit` instances scanned from `from` (a key; empty for the start)
    /// that finished (completed, failed or compensated: not those waiting for an operator)
    /// before `older_than_ms` and whose key is not parked, with their history. Returns how
    /// many were removed and the key to continue from (`None` at the end). Their dedupe
    /// markers stay until their own retention passes.
    pub fn sweep_finished(
        &self,
        older_than_ms: u64,
        from: &[u8],
        limit: usize,
    ) -> Result<(usize, Option<Vec<u8>>)> {
        use crate::saga::Status;
        let mut cur = self.txn.cursor(&self.saga)?;
        let mut doomed = Vec::new();
        let mut next = None;
        for (scanned, item) in cur.iter_from::<Vec<u8>, Vec<u8>>(from).enumerate() {
            let (k, v) = item?;
            if scanned >= limit {
                next = Some(k);
                break;
            }
            if v.first() != Some(&b'{') {
                continue; // a history entry
            }
            let h: Head = json(&v, "saga instance")?;
            let finished = matches!(
                h.status,
                Status::Completed | Status::Failed | Status::Compensated
            );
            if finished
                && h.updated_ms < older_than_ms
                && self
                    .parked_by(&h.tenant, &h.saga, &h.correlation_id)?
                    .is_none()
            {
                doomed.push(k);
            }
        }
        for k in &doomed {
            if let Some(v) = self.txn.get::<Vec<u8>>(&self.saga, k)? {
                self.unindex_stored(&v)?;
            }
            self.txn.del(&self.saga, k, None)?;
            let mut prefix = k.clone();
            prefix.push(0);
            let history: Vec<Vec<u8>> = {
                let mut c = self.txn.cursor(&self.saga)?;
                c.iter_from::<Vec<u8>, Vec<u8>>(&prefix)
                    .map_while(|i| i.ok())
                    .map(|(hk, _)| hk)
                    .take_while(|hk| hk.starts_with(&prefix))
                    .collect()
            };
            for hk in history {
                self.txn.del(&self.saga, hk, None)?;
            }
        }
        Ok((doomed.len(), next))
    }

    /// Stores an instance and its index entries; `before` is the state it had when read
    /// (`None` for a new instance). A write that starts or ends an instance also moves its
    /// tenant's count of running instances (`Tables::count_live`, `live.rs`): the saga
    /// worker does so beside this call; a migration keeps the status and moves nothing.
    pub fn put_instance(&self, inst: &Instance, before: Option<&str>) -> Result<()> {
        let key = instance_key(&inst.tenant, &inst.saga, &inst.correlation_id);
        self.txn
            .put(&self.saga, key, to_json(inst)?, WriteFlags::UPSERT)?;
        self.index_instance(inst, before)
    }
}
