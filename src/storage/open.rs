//! Opening the store: the libmdbx environment under `storage.data_dir`, created with its
//! tables when missing, with the durability, page size and write path the configuration
//! asks for; or an existing store opened read-only, as operator tools do.
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

use std::path::PathBuf;
use std::sync::Arc;

use libmdbx::{
    Database, DatabaseOptions, Mode, NoWriteMap, ReadWriteOptions, SyncMode, TableFlags,
};

use super::{Result, StorageError, Store, TABLES, tables};
use crate::config::{Durability, StorageConfig};

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
            unlogged: Arc::default(),
        })
    }
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
