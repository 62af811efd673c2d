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

impl Tables<'_, RW> {
    /// Stores an instance.
    pub fn put_instance(&self, inst: &Instance) -> Result<()> {
        let key = instance_key(&inst.tenant, &inst.saga, &inst.correlation_id);
        Ok(self
            .txn
            .put(&self.saga, key, to_json(inst)?, WriteFlags::UPSERT)?)
    }
}
