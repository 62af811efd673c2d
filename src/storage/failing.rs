//! Failing writes: which write failures are for want of disk space, and whether storage
//! writes fail now, shared by every clone of a [`Store`].
//!
//! A write transaction that fails in libmdbx (the disk full, an I/O error,
//! the map at `storage.max_size`) writes nothing, and marks storage writes as failing until
//! the next write commits ([`Store::write_failure`]): `/health` reports it (`storage.ok`
//! false, status `degraded`), `runner_storage_write_failing` is 1 and
//! `runner_storage_write_failures_total` counts the failures by reason. A failure for want
//! of disk space is named as such, [`StorageError::DiskFull`] — "the disk holding
//! `<data_dir>` is full (ENOSPC)" — also when libmdbx reports it as EIO, which it does for a
//! write the kernel cut short: an EIO with less than 1 MiB free there is taken for a full
//! disk. Callers retry from what is committed, so nothing acknowledged is lost and the node
//! goes on by itself once there is room.

use std::path::Path;

use super::{StorageError, Store};

/// Free bytes on the data directory's file system below which a write that failed with
/// EIO is taken for a full disk: libmdbx reports a write the kernel cut short for want of
/// space as EIO, not ENOSPC, and a write cut short has taken what space there was.
const FULL_BELOW: u64 = 1 << 20;

/// What the writes of this process have found, for `/health` and the metrics.
#[derive(Debug, Default)]
pub(super) struct WriteHealth {
    /// Set by a write that fails, cleared by the next one that commits.
    failing: std::sync::Mutex<Option<WriteFailure>>,
    /// Writes failed for want of disk space, since start.
    disk_full: std::sync::atomic::AtomicU64,
    /// Writes failed otherwise (libmdbx errors), since start.
    other: std::sync::atomic::AtomicU64,
}

/// Storage writes are failing: every write transaction since `since` has failed.
#[derive(Debug, Clone)]
pub struct WriteFailure {
    /// The last failure, as logged.
    pub error: String,
    /// Whether it was for want of disk space (ENOSPC).
    pub disk_full: bool,
    /// Writes failed since the last one that committed.
    pub failed_writes: u64,
    /// When the first of them failed.
    pub since: std::time::Instant,
}

/// Storage writes failed since start, by reason (counters for the metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteFailures {
    /// For want of disk space.
    pub disk_full: u64,
    /// Any other libmdbx error.
    pub other: u64,
}

impl Store {
    /// The data directory (the store lives in its `runner.mdbx`).
    fn data_dir(&self) -> &Path {
        self.path.parent().unwrap_or(&self.path)
    }

    /// `e`, or [`StorageError::DiskFull`] when it was for want of disk space.
    pub(super) fn classify(&self, e: StorageError) -> StorageError {
        let StorageError::Mdbx(source) = e else {
            return e;
        };
        let full = match &source {
            libmdbx::Error::Other(code) => *code == libc::ENOSPC,
            libmdbx::Error::IoError(io) => io.raw_os_error() == Some(libc::ENOSPC),
            libmdbx::Error::Io => free_bytes(self.data_dir()).is_some_and(|b| b < FULL_BELOW),
            _ => false,
        };
        if full {
            StorageError::DiskFull {
                path: self.data_dir().to_path_buf(),
                source,
            }
        } else {
            StorageError::Mdbx(source)
        }
    }

    /// Notes a failed write: libmdbx errors (not the caller's own) mark writes as failing.
    pub(super) fn failed(&self, e: &StorageError) {
        use std::sync::atomic::Ordering;
        let disk_full = match e {
            StorageError::DiskFull { .. } => true,
            StorageError::Mdbx(_) => false,
            _ => return,
        };
        let counter = if disk_full {
            &self.writes.disk_full
        } else {
            &self.writes.other
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let mut failing = self
            .writes
            .failing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let error = e.to_string();
        match failing.as_mut() {
            Some(f) => {
                f.failed_writes += 1;
                f.disk_full = disk_full;
                f.error = error;
            }
            None => {
                tracing::error!(message = "Storage writes are failing: inputs are not applied until a commit succeeds again (nothing acknowledged is lost; commits are retried).", data_dir = %self.data_dir().display(), disk_full, error = %error);
                *failing = Some(WriteFailure {
                    error,
                    disk_full,
                    failed_writes: 1,
                    since: std::time::Instant::now(),
                });
            }
        }
    }

    /// Notes a committed write: writes no longer fail.
    pub(super) fn wrote(&self) {
        let mut failing = self
            .writes
            .failing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = failing.take() {
            tracing::info!(message = "Storage writes succeed again.", data_dir = %self.data_dir().display(), failed_writes = f.failed_writes, failing_for_s = f.since.elapsed().as_secs_f64(), last_error = %f.error);
        }
    }

    /// `Some` while storage writes fail: the last write transaction failed (libmdbx
    /// errors; set by [`Store::write_blocking`], cleared by the next write that commits).
    pub fn write_failure(&self) -> Option<WriteFailure> {
        self.writes
            .failing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Writes failed since the store was opened, by reason.
    pub fn write_failures(&self) -> WriteFailures {
        use std::sync::atomic::Ordering;
        WriteFailures {
            disk_full: self.writes.disk_full.load(Ordering::Relaxed),
            other: self.writes.other.load(Ordering::Relaxed),
        }
    }
}

/// Bytes free to this process on the file system holding `dir` (the root's reserve
/// counts for root), or `None` when it cannot be read.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `st` is a buffer of the type statvfs fills.
    if unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let blocks = if root { st.f_bfree } else { st.f_bavail };
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Some((blocks as u64).saturating_mul(st.f_frsize as u64))
}
