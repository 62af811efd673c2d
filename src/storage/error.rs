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
    /// A read-only open found no store to read (it never creates one).
    #[error("no store in {}", path.display())]
    NoStore {
        /// Where the store was looked for.
        path: PathBuf,
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
