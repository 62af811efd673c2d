//! The one error type of the storage layer, and its `Result` alias.
//!
//! Every storage call reports a [`StorageError`]. Stored bytes that do not decode are
//! reported as [`StorageError::Corrupt`], never as a panic, so a damaged database is named
//! as such rather than misread. A write that fails for want of disk space is reported as
//! [`StorageError::DiskFull`], naming ENOSPC and the data directory, never as a bare
//! "Input/output error".

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
    /// A write found no room on the disk holding the data directory: libmdbx said ENOSPC,
    /// or it cut a write short (which it reports as EIO) with the disk full. Nothing of the
    /// transaction was written; the write succeeds again once there is room.
    #[error("the disk holding {} is full (ENOSPC): libmdbx: {source}", path.display())]
    DiskFull {
        /// The data directory.
        path: PathBuf,
        /// What libmdbx reported.
        source: libmdbx::Error,
    },
    /// A group commit failed; every batch of the group is answered with this text.
    #[error("{0}")]
    Commit(String),
    /// Stored bytes do not decode: the database is damaged or was written by another program.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// A blocking storage task panicked or was cancelled.
    #[error("storage task failed: {0}")]
    Task(String),
}

/// Result alias for storage calls.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;
