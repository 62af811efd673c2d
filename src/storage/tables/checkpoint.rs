//! The `checkpoint` table: per consumer (`<consumer>:<stream>`), the last stream sequence
//! applied, as a big-endian `u64`.
//!
//! Guarantee: the checkpoint is the position of truth of the saga worker. It advances in
//! the same transaction as the writes of the inputs it covers, so after a crash the worker
//! resumes exactly after the last input whose effects are durable.

use libmdbx::{RW, TransactionKind, WriteFlags};

use super::keys::u64_of;
use super::txn::Tables;
use crate::storage::error::Result;

impl<K: TransactionKind> Tables<'_, K> {
    /// Last applied stream sequence of `consumer` (0 when none).
    pub fn checkpoint(&self, consumer: &str) -> Result<u64> {
        let v: Option<Vec<u8>> = self.txn.get(&self.checkpoint, consumer.as_bytes())?;
        v.map(|b| u64_of(&b, "checkpoint"))
            .transpose()
            .map(|o| o.unwrap_or(0))
    }
}

impl Tables<'_, RW> {
    /// Advances a consumer's checkpoint.
    pub fn set_checkpoint(&self, consumer: &str, seq: u64) -> Result<()> {
        Ok(self.txn.put(
            &self.checkpoint,
            consumer.as_bytes(),
            seq.to_be_bytes(),
            WriteFlags::UPSERT,
        )?)
    }

    /// Deletes a consumer's checkpoint (one no pipeline reads any more); absent is fine.
    pub fn delete_checkpoint(&self, consumer: &str) -> Result<()> {
        self.txn.del(&self.checkpoint, consumer.as_bytes(), None)?;
        Ok(())
    }
}
