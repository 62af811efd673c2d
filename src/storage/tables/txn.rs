//! [`Tables`]: every named table of the store, opened inside one libmdbx transaction.
//!
//! Guarantee: nothing here commits. A caller reaches state, outbox, timers, dedupe markers,
//! dead letters and checkpoints through one `Tables` and commits them together (see
//! [`crate::storage::Store::write`]), so a batch's writes are durable all at once or not at
//! all. Each table's reads and writes live in the file of that table.

use std::cell::Cell;

use libmdbx::{NoWriteMap, RW, Table, Transaction, TransactionKind, WriteFlags};

use super::keys::{OUTBOX_SEQ, u64_of};
use crate::storage::error::Result;

/// The tables of one transaction.
pub struct Tables<'t, K: TransactionKind> {
    pub(super) txn: &'t Transaction<'t, K, NoWriteMap>,
    pub(super) saga: Table<'t>,
    pub(super) outbox: Table<'t>,
    pub(super) checkpoint: Table<'t>,
    pub(super) dedupe: Table<'t>,
    pub(super) schedule: Table<'t>,
    pub(super) deadletter: Table<'t>,
    pub(super) parked: Table<'t>,
    pub(super) meta: Table<'t>,
    pub(super) history: Table<'t>,
    pub(super) index: Table<'t>,
    pub(super) live: Table<'t>,
    pub(super) capped: Table<'t>,
    /// The outbox sequence last assigned in this transaction (read once, then counted here).
    pub(super) outbox_seq: Cell<Option<u64>>,
}

impl<'t, K: TransactionKind> Tables<'t, K> {
    /// Opens every table in `txn`.
    pub fn open(txn: &'t Transaction<'t, K, NoWriteMap>) -> Result<Self> {
        Ok(Self {
            txn,
            saga: txn.open_table(Some("saga"))?,
            outbox: txn.open_table(Some("outbox"))?,
            checkpoint: txn.open_table(Some("checkpoint"))?,
            dedupe: txn.open_table(Some("dedupe"))?,
            schedule: txn.open_table(Some("schedule"))?,
            deadletter: txn.open_table(Some("deadletter"))?,
            parked: txn.open_table(Some("parked"))?,
            meta: txn.open_table(Some("meta"))?,
            history: txn.open_table(Some("history"))?,
            index: txn.open_table(Some("index"))?,
            live: txn.open_table(Some("live"))?,
            capped: txn.open_table(Some("capped"))?,
            outbox_seq: Cell::new(None),
        })
    }

    /// A counter of the `meta` table (0 when never written).
    pub(super) fn meta(&self, name: &str) -> Result<u64> {
        let v: Option<Vec<u8>> = self.txn.get(&self.meta, name.as_bytes())?;
        v.map(|b| u64_of(&b, name))
            .transpose()
            .map(|o| o.unwrap_or(0))
    }
}

impl Tables<'_, RW> {
    /// Writes what this transaction counted in memory (the outbox sequence). The store
    /// calls it right before committing; a transaction that is not committed writes nothing.
    pub fn finish(&self) -> Result<()> {
        if let Some(seq) = self.outbox_seq.get() {
            self.txn.put(
                &self.meta,
                OUTBOX_SEQ.as_bytes(),
                seq.to_be_bytes(),
                WriteFlags::UPSERT,
            )?;
        }
        Ok(())
    }
}
