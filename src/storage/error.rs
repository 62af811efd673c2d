//! The one error type of the storage layer, and its `Result` alias.
//!
//! Every storage call reports a [`StorageError`]. Stored bytes that do not decode are
//! reported as [`StorageError::Corrupt`], never as a panic, so a damaged database is named
//! as such rather than misread.

use std::path::PathBuf;

/// Storage errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    /// The data directory could not be created.
    #[error("cannot create data directory {}: {source}", path.display())]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The data directory's lock file (`lock.rs`) could not be opened or written.
    #[error("cannot use lock file {}: {source}", path.display())]
    LockFile {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A read-only open found no store to read (it never creates one).
    #[error("no store in {}", path.display())]
    NoStore {
        /// Where the store was looked for.
        path: PathBuf,
    },
    /// Another `runner run` holds the data directory (`lock.rs`).
    #[error("data directory {} is in use by another `runner run`{}", path.display(), holder.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    InUse {
        /// The directory.
        path: PathBuf,
        /// The holder's process id, as it wrote it in the lock file.
        holder: Option<u32>,
    },
    /// libmdbx reported an error.
    #[error("libmdbx: {0}")]
    Mdbx(#[from] libmdbx::Error),
    /// Stored bytes do not decode: the database is damaged or was written by another program.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// A blocking storage task panicked or was cancelled.
    #[error("storage task failed: {0}")]
    Task(String),
}

/// Result alias for storage calls.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;
