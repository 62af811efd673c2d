//! Write transactions: a closure over the tables runs in one write transaction and commits
//! when it succeeds; when it fails, nothing is written.
//!
//! A write transaction through [`Store::write_blocking`] is begun, filled and committed on the
//! calling thread, within that one call: the vendored libmdbx crate's first change
//! (`vendor/libmdbx/PATCH.md`) lets it skip the crate's manager thread, which would cost two
//! hand-offs between threads per commit. Write transactions still run one at a time in the
//! process, whichever way they were begun.

use super::{Result, Store, Tables};

impl Store {
    /// Runs `f` over the tables in one write transaction on a blocking thread and commits
    /// when `f` succeeds (durably, under
    /// [`Durability::Full`](crate::config::Durability::Full)); on error nothing is written.
    pub async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Tables<'_, libmdbx::RW>) -> Result<T> + Send + 'static,
    {
        self.run(move |s| s.write_blocking(f)).await
    }

    /// [`Store::write`] for code already on a blocking thread.
    ///
    /// A libmdbx error on the way (the disk full, an I/O error, the map full) marks storage
    /// writes as failing ([`Store::write_failure`]) until a write commits; one for want of
    /// disk space is returned as [`StorageError::DiskFull`](super::StorageError::DiskFull).
    pub fn write_blocking<T, F>(&self, f: F) -> Result<T>
    where
        F: FnOnce(&Tables<'_, libmdbx::RW>) -> Result<T>,
    {
        match self.write_here(f) {
            Ok(out) => {
                self.wrote();
                Ok(out)
            }
            Err(e) => {
                let e = self.classify(e);
                self.failed(&e);
                Err(e)
            }
        }
    }

    fn write_here<T, F>(&self, f: F) -> Result<T>
    where
        F: FnOnce(&Tables<'_, libmdbx::RW>) -> Result<T>,
    {
        // SAFETY: the transaction is begun, used and committed (or dropped, on an error or a
        // panic in `f`) inside this call, so on the thread that began it.
        let txn = unsafe { self.db.begin_rw_txn_here() }?;
        let out = {
            let tables = Tables::open(&txn)?;
            let out = f(&tables)?;
            tables.finish()?;
            out
        };
        txn.commit()?;
        Ok(out)
    }
}
