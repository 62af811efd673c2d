//! Local state in libmdbx.
//!
//! One libmdbx environment per process, under `storage.data_dir`. Every call into libmdbx
//! blocks, so async code reaches the store only through [`Store::run`], which moves the work
//! to a blocking thread; no transaction ever lives across an `.await`.
//!
//! Durability: with the default [`Durability::Full`](crate::config::Durability::Full) every
//! write transaction is on disk (data and meta page fsynced) when its commit returns, so an
//! input acknowledged after a commit survives a crash or power loss. The relaxed modes trade
//! that away and are for disposable data only (see
//! [`Durability`](crate::config::Durability)).
//!
//! The named tables are created when the store opens; their key layouts are documented
//! next to the code that writes them.
//!
//! Layout, one submodule per concern, each adding to [`Store`]'s methods: `open` (creating
//! or opening the environment with its durability, page size and write path), `write` (write
//! transactions), `failing` (telling a full disk from other failures and tracking whether
//! writes fail, for `/health` and the metrics) and `read` (read transactions, the health
//! probe and the write-cost counter).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use libmdbx::{Database, NoWriteMap};

pub mod codec;
pub mod error;
pub mod lock;
pub mod snapshot;
pub mod tables;

mod failing;
mod open;
mod read;
mod write;

#[cfg(test)]
mod table_tests;

pub use error::{Result, StorageError};
pub use failing::{WriteFailure, WriteFailures};
pub use read::StoreStats;
pub use tables::Tables;

/// The named tables of the store (DESIGN §5 keyspaces).
pub const TABLES: [&str; 12] = [
    "saga",
    "outbox",
    "checkpoint",
    "dedupe",
    "schedule",
    "deadletter",
    "parked",
    "meta",
    "history",
    "index",
    "live",
    "capped",
];

/// A handle to the open store; cheap to clone.
#[derive(Clone)]
pub struct Store {
    db: Arc<Database<NoWriteMap>>,
    path: PathBuf,
    /// Read once at open: it never changes for the life of a store.
    page_size: u32,
    /// Whether writes fail now, shared by every clone.
    writes: Arc<failing::WriteHealth>,
    /// Committed writes a partition snapshot must be retaken for (`write.rs`).
    unlogged: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// The store's page size in bytes (fixed when the store was created).
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Where the database lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The environment, for code running on a blocking thread.
    pub fn db(&self) -> &Database<NoWriteMap> {
        &self.db
    }

    /// Runs `f` with the store on a blocking thread and returns its result.
    pub async fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Store) -> Result<T> + Send + 'static,
    {
        let store = self.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| StorageError::Task(e.to_string()))?
    }
}
