//! Read transactions, and what the health probe and the metrics read of the store.
//!
//! A read transaction sees the last committed state; like every call into libmdbx it blocks,
//! so async code reads through [`Store::read`], which runs it on a blocking thread.

use super::{Result, Store, TABLES, Tables};

impl Store {
    /// Runs `f` over the tables in one read transaction on a blocking thread.
    pub async fn read<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Tables<'_, libmdbx::RO>) -> Result<T> + Send + 'static,
    {
        self.run(move |s| s.read_blocking(f)).await
    }

    /// [`Store::read`] for code already on a blocking thread.
    pub fn read_blocking<T, F>(&self, f: F) -> Result<T>
    where
        F: FnOnce(&Tables<'_, libmdbx::RO>) -> Result<T>,
    {
        let txn = self.db.begin_ro_txn()?;
        let tables = Tables::open(&txn)?;
        f(&tables)
    }

    /// Health probe: opens a read transaction and reads every table's statistics.
    pub async fn check(&self) -> Result<StoreStats> {
        self.run(|s| {
            let txn = s.db.begin_ro_txn()?;
            let mut entries = 0;
            for name in TABLES {
                let table = txn.open_table(Some(name))?;
                entries += txn.table_stat(&table)?.entries() as u64;
            }
            let info = s.db.info()?;
            Ok(StoreStats {
                entries,
                map_size: info.map_size() as u64,
                page_size: s.page_size,
            })
        })
        .await
    }

    /// Pages write transactions have added or copied for update since the store was first
    /// opened in this session (libmdbx's count: it includes aborted transactions and a page
    /// freed and taken again within one), close to what commits write: the store's write
    /// cost. Reads libmdbx's counters, no transaction. Blocking, but brief.
    pub fn pages_dirtied(&self) -> Result<u64> {
        Ok(self.db.info()?.pages_dirtied())
    }
}

/// What the health probe reads.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct StoreStats {
    /// Entries across all tables.
    pub entries: u64,
    /// Current size of the memory map in bytes.
    pub map_size: u64,
    /// The store's page size in bytes (fixed when it was created: `storage.page_size`).
    pub page_size: u32,
}
