//! Write transactions: a closure over the tables runs in one write transaction and commits
//! when it succeeds; when it fails, nothing is written.
//!
//! A write transaction through [`Store::write_blocking`] is begun, filled and committed on the
//! calling thread, within that one call: the vendored libmdbx crate's first change
//! (`vendor/libmdbx/PATCH.md`) lets it skip the crate's manager thread, which would cost two
//! hand-offs between threads per commit. Write transactions still run one at a time in the
//! process, whichever way they were begun.
//!
//! **Logged and unlogged writes.** A partition snapshot is only retaken when the partition
//! may have changed in a way its successor could not redo (`worker/ownership`), so the store
//! counts every committed write transaction except those that say, by going through
//! [`Store::write_logged_blocking`] / [`Store::write_logged`], that a successor holding the
//! last snapshot of each partition whose checkpoint they leave where it was redoes them
//! itself: inputs applied from a partition's log (they move its checkpoint), deletions of
//! outbox records the fence watermark covers, rows expired by age. Any other write (a
//! redrive, an operator's change, an import) goes through [`Store::write_blocking`] and is
//! counted ([`Store::unlogged_writes`]); a write counted by mistake only costs a snapshot.

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
        let out = self.write_logged_blocking(f)?;
        self.note_unlogged();
        Ok(out)
    }

    /// [`Store::write_logged_blocking`] on a blocking thread.
    pub async fn write_logged<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Tables<'_, libmdbx::RW>) -> Result<T> + Send + 'static,
    {
        self.run(move |s| s.write_logged_blocking(f)).await
    }

    /// [`Store::write_blocking`] for a write a partition's successor redoes from its last
    /// snapshot without being told (see the module docs): not counted in
    /// [`Store::unlogged_writes`].
    pub fn write_logged_blocking<T, F>(&self, f: F) -> Result<T>
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

    /// How many write transactions have committed since the store opened that a partition
    /// snapshot must be retaken for ([`Store::write_blocking`], imports), whatever
    /// partitions' checkpoints say. Counted after the commit, so a reader that takes this
    /// before a read transaction sees every write it counts.
    pub fn unlogged_writes(&self) -> u64 {
        self.unlogged.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Counts, after its commit, a write made through [`Store::write_logged_blocking`] that
    /// turned out to change what a successor cannot redo (a purge that removed something).
    pub fn note_unlogged(&self) {
        self.unlogged
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
}
