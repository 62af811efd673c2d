//! Local state in libmdbx.
//!
//! One libmdbx environment per process, under `storage.data_dir`. Every call into libmdbx
//! blocks, so async code reaches the store only through [`Store::run`], which moves the work
//! to a blocking thread; no transaction ever lives across an `.await`.
//!
//! A write transaction through [`Store::write_blocking`] is begun, filled and committed on the
//! calling thread, within that one call: the vendored libmdbx crate's first change
//! (`vendor/libmdbx/PATCH.md`) lets it skip the crate's manager thread, which would cost two
//! hand-offs between threads per commit. Write transactions still run one at a time in the
//! process, whichever way they were begun.
//!
//! Durability: with the default [`Durability::Full`] every write transaction is on disk
//! (data and meta page fsynced) when its commit returns, so an input acknowledged after a
//! commit survives a crash or power loss. The relaxed modes trade that away and are for
//! disposable data only (see [`Durability`]).
//!
//! Failing writes: a write transaction that fails in libmdbx (the disk full, an I/O error,
//! the map at `storage.max_size`) writes nothing, and marks storage writes as failing until
//! the next write commits ([`Store::write_failure`]): `/health` reports it (`storage.ok`
//! false, status `degraded`), `runner_storage_write_failing` is 1 and
//! `runner_storage_write_failures_total` counts the failures by reason. A failure for want
//! of disk space is named as such, [`StorageError::DiskFull`] — "the disk holding
//! `<data_dir>` is full (ENOSPC)" — also when libmdbx reports it as EIO, which it does for a
//! write the kernel cut short: an EIO with less than 1 MiB free there is taken for a full
//! disk. Callers retry from what is committed, so nothing acknowledged is lost and the node
//! goes on by itself once there is room.
//!
//! The named tables are created when the store opens; their key layouts are documented
//! next to the code that writes them.
//!
//! Page size: a store is created with `storage.page_size` (8 KiB by default) and keeps the
//! size it was created with. Larger pages than the 4 KiB libmdbx would pick make the tree
//! shallower, so a commit of inputs spread at random over many instances rewrites fewer
//! branch pages, and the kernel handles fewer, larger writes per commit; much larger pages
//! write more bytes per instance touched.
//!
//! Write path: by default a commit copies each page it changes into a buffer and writes the
//! buffers to the file, then syncs it. With `storage.write_map` it changes the pages in the
//! memory map (copied on write inside the map) and syncs those: no buffers and no write
//! calls, at the price of a page fault per page written after each sync, which costs more
//! than it saves when every commit rewrites the same few pages (a small store). Under
//! [`Durability::Full`] durability is the same either way, and a store written one way
//! reopens the other; under the relaxed modes, processes writing at the same time must
//! agree on it. The readahead is turned off with it: the kernel may hold a file's cache in
//! folios of many pages (ext4 on Linux 6.16 and later does), and a write through the map
//! marks a whole folio dirty, so a page brought in by a readahead-sized fault would sync its
//! neighbours too; faults without readahead bring in single pages. The same folios make the
//! default path's writes costlier on a store far larger than one commit's pages: each write
//! into a folio, and each sync of a dirty one, walks the whole folio in the kernel (figures:
//! `docs/benchmarks.md`, "Writing through the map").

use std::path::{Path, PathBuf};
use std::sync::Arc;

use libmdbx::{
    Database, DatabaseOptions, Mode, NoWriteMap, ReadWriteOptions, SyncMode, TableFlags,
};

use crate::config::{Durability, StorageConfig};

pub mod codec;
pub mod error;
pub mod lock;
pub mod snapshot;
pub mod tables;

pub use error::{Result, StorageError};
pub use tables::Tables;

/// The named tables of the store (DESIGN §5 keyspaces).
pub const TABLES: [&str; 10] = [
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
];

/// A handle to the open store; cheap to clone.
#[derive(Clone)]
pub struct Store {
    db: Arc<Database<NoWriteMap>>,
    path: PathBuf,
    /// Read once at open: it never changes for the life of a store.
    page_size: u32,
    /// Whether writes fail now, shared by every clone.
    writes: Arc<WriteHealth>,
}

/// Free bytes on the data directory's file system below which a write that failed with
/// EIO is taken for a full disk: libmdbx reports a write the kernel cut short for want of
/// space as EIO, not ENOSPC, and a write cut short has taken what space there was.
const FULL_BELOW: u64 = 1 << 20;

/// What the writes of this process have found, for `/health` and the metrics.
#[derive(Debug, Default)]
struct WriteHealth {
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

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (creating if needed) the store under `cfg.data_dir` and its tables. Blocking.
    pub fn open(cfg: &StorageConfig) -> Result<Self> {
        let path = cfg.data_dir.join("runner.mdbx");
        std::fs::create_dir_all(&path).map_err(|source| StorageError::DataDir {
            path: path.clone(),
            source,
        })?;
        let sync_mode = match cfg.durability {
            Durability::Full => SyncMode::Durable,
            Durability::NoMetaSync => SyncMode::NoMetaSync,
            Durability::UnsafeNoSync => SyncMode::UtterlyNoSync,
        };
        let opts = DatabaseOptions {
            max_tables: Some(TABLES.len() as u64 + 8),
            mode: Mode::ReadWrite(ReadWriteOptions {
                sync_mode,
                min_size: None,
                max_size: Some(isize::try_from(cfg.max_size.get()).unwrap_or(isize::MAX)),
                growth_step: Some(isize::try_from(cfg.growth_step.get()).unwrap_or(isize::MAX)),
                shrink_threshold: None,
            }),
            // Applies only when the file is created; an existing store keeps its own.
            page_size: Some(libmdbx::PageSize::Set(
                usize::try_from(cfg.page_size.get()).unwrap_or(4096),
            )),
            // See "Write path" in the module doc: with the map written, faults must bring in
            // single pages, or a commit dirties (and syncs) whole multi-page folios.
            write_map: cfg.write_map,
            no_rdahead: cfg.write_map,
            ..DatabaseOptions::default()
        };
        let db = Database::<NoWriteMap>::open_with_options(&path, opts)?;
        let txn = db.begin_rw_txn()?;
        for name in TABLES {
            txn.create_table(Some(name), TableFlags::empty())?;
        }
        tables::index::build_if_missing(&txn)?;
        txn.commit()?;
        Self::opened(db, path)
    }

    /// Opens an existing store for reading only, the way operator tools read a live node's
    /// store: a read-only open is compatible with whatever durability mode the writer
    /// runs with (a read-write open in another mode fails with `MDBX_INCOMPATIBLE`), and it
    /// never creates a store where there is none. Blocking.
    pub fn open_read_only(cfg: &StorageConfig) -> Result<Self> {
        let path = cfg.data_dir.join("runner.mdbx");
        if !path.join("mdbx.dat").exists() {
            return Err(StorageError::NoStore { path });
        }
        let opts = DatabaseOptions {
            max_tables: Some(TABLES.len() as u64 + 8),
            mode: Mode::ReadOnly,
            ..DatabaseOptions::default()
        };
        let db = Database::<NoWriteMap>::open_with_options(&path, opts)?;
        Self::opened(db, path)
    }

    fn opened(db: Database<NoWriteMap>, path: PathBuf) -> Result<Self> {
        let page_size = db.stat()?.page_size();
        Ok(Self {
            db: Arc::new(db),
            path,
            page_size,
            writes: Arc::default(),
        })
    }

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

    /// Runs `f` over the tables in one write transaction on a blocking thread and commits
    /// when `f` succeeds (durably, under [`Durability::Full`]); on error nothing is written.
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
    /// disk space is returned as [`StorageError::DiskFull`].
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

    /// The data directory (the store lives in its `runner.mdbx`).
    fn data_dir(&self) -> &Path {
        self.path.parent().unwrap_or(&self.path)
    }

    /// `e`, or [`StorageError::DiskFull`] when it was for want of disk space.
    fn classify(&self, e: StorageError) -> StorageError {
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
    fn failed(&self, e: &StorageError) {
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
    fn wrote(&self) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn opens_durably_and_checks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        };
        let store = Store::open(&cfg).expect("opens");
        let stats = store.check().await.expect("check");
        assert_eq!(
            stats.entries, 1,
            "only the instance index's layout version, in meta"
        );
        drop(store);
        // Reopening an existing store works and finds the same tables.
        let store = Store::open(&cfg).expect("reopens");
        store.check().await.expect("check after reopen");
    }

    #[tokio::test]
    async fn a_store_keeps_the_page_size_it_was_created_with() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = |page: u64| StorageConfig {
            data_dir: dir.path().to_path_buf(),
            page_size: crate::config::ByteSize(page),
            ..StorageConfig::default()
        };
        let store = Store::open(&StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        })
        .expect("creates");
        assert_eq!(store.page_size(), 8192, "the default");
        store
            .write(|t| t.set_checkpoint("S", 7))
            .await
            .expect("writes");
        drop(store);
        // Opened by a node configured for another size, the store keeps its own.
        for page in [4096, 65536] {
            let store = Store::open(&cfg(page)).expect("reopens");
            assert_eq!(store.page_size(), 8192);
            let cp = store.read(|t| t.checkpoint("S")).await.expect("reads");
            assert_eq!(cp, 7, "what was written is there");
            store.check().await.expect("check");
        }
        let ro = Store::open_read_only(&cfg(4096)).expect("operator tools open it");
        assert_eq!(ro.page_size(), 8192);
        drop(ro);
        // A store created with another size has that size.
        let other = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&StorageConfig {
            data_dir: other.path().to_path_buf(),
            page_size: crate::config::ByteSize(16384),
            ..StorageConfig::default()
        })
        .expect("creates");
        assert_eq!(store.page_size(), 16384);
    }
}

#[cfg(test)]
mod write_path_tests {
    use super::*;

    /// Whether this process maps `store`'s data file writable (the `storage.write_map` path).
    fn mapped_writable(store: &Store) -> Option<bool> {
        let file = std::fs::canonicalize(store.path().join("mdbx.dat")).ok()?;
        let file = file.to_str()?;
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let line = maps.lines().find(|l| l.ends_with(file))?;
        Some(line.split_whitespace().nth(1)?.starts_with("rw"))
    }

    #[tokio::test]
    async fn either_write_path_reads_what_the_other_wrote() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = |write_map: bool| StorageConfig {
            data_dir: dir.path().to_path_buf(),
            write_map,
            ..StorageConfig::default()
        };
        let store = Store::open(&cfg(true)).expect("opens writing through the map");
        assert_eq!(mapped_writable(&store), Some(true), "the map is written");
        store
            .write(|t| t.set_checkpoint("S", 7))
            .await
            .expect("writes");
        drop(store);
        // (Read-only opens beside a live node, another process: `tests/store_readers.rs`.)

        let store = Store::open(&cfg(false)).expect("reopens writing the file");
        assert_eq!(mapped_writable(&store), Some(false), "the map is read-only");
        assert_eq!(store.read(|t| t.checkpoint("S")).await.expect("reads"), 7);
        store
            .write(|t| t.set_checkpoint("S", 8))
            .await
            .expect("writes");
        drop(store);

        let store = Store::open(&cfg(true)).expect("reopens writing through the map");
        assert_eq!(store.read(|t| t.checkpoint("S")).await.expect("reads"), 8);
        store.check().await.expect("check");
        // Each commit's pages are counted (the checkpoint's leaf and the tree above it).
        let before = store.pages_dirtied().expect("counts");
        store
            .write(|t| t.set_checkpoint("S", 9))
            .await
            .expect("writes");
        assert!(store.pages_dirtied().expect("counts") > before);
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    fn temp_store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = StorageConfig {
            data_dir: dir.path().to_path_buf(),
            ..StorageConfig::default()
        };
        let store = Store::open(&cfg).expect("opens");
        (dir, store)
    }

    #[test]
    fn tables_open_in_read_and_write_transactions() {
        let (_dir, store) = temp_store();
        {
            let txn = store.db().begin_ro_txn().expect("ro");
            for name in TABLES {
                txn.open_table(Some(name))
                    .unwrap_or_else(|e| panic!("{name}: {e:?}"));
            }
            let t = txn.open_table(Some("checkpoint")).expect("cp");
            let v: Option<Vec<u8>> = txn.get(&t, b"c").expect("get");
            assert!(v.is_none());
        }
        assert_eq!(store.read_blocking(|t| t.checkpoint("c")).expect("read"), 0);
        store
            .write_blocking(|t| t.set_checkpoint("c", 7))
            .expect("write");
        assert_eq!(store.read_blocking(|t| t.checkpoint("c")).expect("read"), 7);
    }

    #[test]
    fn dedupe_markers_expire_in_chunks() {
        let (_dir, store) = temp_store();
        store
            .write_blocking(|t| {
                for i in 0..10u64 {
                    // Even markers are old (t=100), odd ones recent (t=10_000).
                    let at = if i % 2 == 0 { 100 } else { 10_000 };
                    t.mark_applied("acme", "order", &format!("e{i}"), at)?;
                }
                Ok(())
            })
            .expect("marks");
        let mut from = Vec::new();
        let mut deleted = 0;
        loop {
            let start = std::mem::take(&mut from);
            let (n, next) = store
                .write_blocking(|t| t.sweep_dedupe(5_000, &start, 3))
                .expect("sweep");
            deleted += n;
            match next {
                Some(k) => from = k,
                None => break,
            }
        }
        assert_eq!(deleted, 5);
        for i in 0..10u64 {
            let kept = store
                .read_blocking(|t| t.is_applied("acme", "order", &format!("e{i}")))
                .expect("read");
            assert_eq!(kept, i % 2 == 1, "marker e{i}");
        }
    }

    #[test]
    fn outbox_records_round_trip_and_older_json_still_reads() {
        use tables::OutboxRecord;
        let with_tp = OutboxRecord {
            subject: "tenant.acme.effect.charge.c-1".into(),
            msg_id: "c-1".into(),
            tenant: "acme".into(),
            traceparent: Some("00-abc-def-01".into()),
            body: r#"{"quote":"\"x\"","n":1}"#.into(),
            cause: (0, 0),
        };
        let without = OutboxRecord {
            traceparent: None,
            body: String::new(),
            ..with_tp.clone()
        };
        for rec in [&with_tp, &without] {
            assert_eq!(&OutboxRecord::decode(&rec.encode()).expect("decodes"), rec);
        }
        let legacy = serde_json::to_vec(&with_tp).expect("json");
        assert_eq!(OutboxRecord::decode(&legacy).expect("legacy"), with_tp);
        let mut cut = with_tp.encode();
        cut.truncate(6);
        assert!(
            OutboxRecord::decode(&cut).is_err(),
            "a truncated record is corrupt"
        );
        // Sequences keep counting across writes in one transaction and across transactions.
        let (_dir, store) = temp_store();
        let seqs = store
            .write_blocking(|t| Ok((t.push_outbox(0, &with_tp)?, t.push_outbox(0, &without)?)))
            .expect("push");
        assert_eq!(seqs, (1, 2));
        let next = store
            .write_blocking(|t| t.push_outbox(0, &with_tp))
            .expect("push");
        assert_eq!(next, 3);
        let read = store
            .read_blocking(|t| t.outbox_batch(0, 1, 10))
            .expect("read");
        assert_eq!(read.len(), 3);
        assert_eq!(read[1], (2, without));
    }

    #[test]
    fn history_keeps_the_last_transitions_in_order() {
        use tables::{HISTORY_KEEP, HistoryEntry};
        let (_dir, store) = temp_store();
        store
            .write_blocking(|t| {
                for n in 1..=25u64 {
                    let e = HistoryEntry {
                        n,
                        event: format!("e{n}"),
                        event_id: String::new(),
                        from: String::new(),
                        to: String::new(),
                        at_ms: n,
                        source: String::new(),
                        emitted: 0,
                    };
                    t.push_history("acme", "order", "o-1", &e)?;
                    t.push_history("acme", "order", "o-2", &e)?;
                }
                Ok(())
            })
            .expect("writes");
        let h = store
            .read_blocking(|t| t.history("acme", "order", "o-1"))
            .expect("reads");
        // Entries written as JSON by older versions still read.
        let old = HistoryEntry {
            source: "AGG:7".into(),
            ..h[0].clone()
        };
        assert_eq!(
            HistoryEntry::decode(&serde_json::to_vec(&old).expect("json")).expect("legacy"),
            old
        );
        assert_eq!(HistoryEntry::decode(&old.encode()).expect("binary"), old);
        // The ring lives beside the instances but is never taken for one.
        assert!(
            store
                .read_blocking(|t| t.instances())
                .expect("scan")
                .is_empty()
        );
        let ns: Vec<u64> = h.iter().map(|e| e.n).collect();
        assert_eq!(ns, (25 - HISTORY_KEEP + 1..=25).collect::<Vec<_>>());
    }
}
