//! One node per data directory.
//!
//! libmdbx lets several processes open a store for writing (it serialises their write
//! transactions), and Runner's operator commands rely on that to write beside a live node
//! (`dlq redrive`, `migrate`). Two *nodes* on one store are another matter: each would
//! consume, apply and relay as if it were alone. So `runner run` holds an exclusive lock on
//! `<data_dir>/runner.lock` from before it opens the store until it exits, and a second
//! `runner run` on the same directory is refused at start, naming the directory and the
//! holder's pid.
//!
//! Guarantee: while a [`NodeLock`] lives, no other `runner run` on the same host can start
//! on that directory. The kernel releases the lock when the process dies, however it dies,
//! so a crash never leaves a stale lock behind. (An advisory `flock`: it binds `runner run`
//! only, and only where the filesystem supports it — not across hosts on network storage.)

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::Path;

use super::error::{Result, StorageError};

/// The lock's file name inside the data directory.
pub const LOCK_FILE: &str = "runner.lock";
/// The file holding the data directory's identity ([`NodeLock::store_id`]).
pub const ID_FILE: &str = "runner.id";

/// Held for the life of a node; dropping it releases the directory.
#[derive(Debug)]
pub struct NodeLock {
    _file: File,
    store_id: String,
}

impl NodeLock {
    /// Takes the data directory `dir` for this process (creating the directory if needed),
    /// or says who holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| StorageError::DataDir {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join(LOCK_FILE);
        let io = |source| StorageError::LockFile {
            path: path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(StorageError::InUse {
                    path: dir.to_path_buf(),
                    holder: holder.trim().parse().ok(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        // Who holds it, for the message a second node gets.
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        write!(file, "{}", std::process::id()).map_err(io)?;
        let store_id = store_id(dir)?;
        Ok(Self {
            _file: file,
            store_id,
        })
    }

    /// The data directory's identity: a random id written at its first `runner run` and
    /// kept with it. A lease whose owner names it was taken by a process that held this
    /// directory, and so is dead while this lock is held (`worker/single.rs`).
    pub fn store_id(&self) -> &str {
        &self.store_id
    }
}

/// The id of the data directory `dir` when it has one already, read without its lock (for
/// naming a process before it opens its store; the lock's [`NodeLock::store_id`] is the one
/// to trust).
pub fn peek_store_id(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join(ID_FILE))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Reads `<dir>/runner.id`, writing a new random id first when there is none (called with
/// the directory's lock held, so nobody races it).
fn store_id(dir: &Path) -> Result<String> {
    let path = dir.join(ID_FILE);
    let io = |source| StorageError::LockFile {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let tmp = dir.join(format!("{ID_FILE}.tmp"));
    let mut f = File::create(&tmp).map_err(io)?;
    f.write_all(id.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_one_s_pid_until_it_lets_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let first = NodeLock::acquire(&data).expect("the directory is free");
        let err = NodeLock::acquire(&data).expect_err("already held");
        match &err {
            StorageError::InUse { path, holder } => {
                assert_eq!(path, &data);
                assert_eq!(*holder, Some(std::process::id()));
            }
            other => panic!("{other:?}"),
        }
        assert!(
            err.to_string().contains("in use by another `runner run`"),
            "{err}"
        );
        let id = first.store_id().to_string();
        assert_eq!(id.len(), 32, "{id}");
        drop(first);
        let again = NodeLock::acquire(&data).expect("free once released");
        assert!(data.join(LOCK_FILE).exists());
        assert_eq!(again.store_id(), id, "the directory keeps its identity");
        let other = NodeLock::acquire(&dir.path().join("other")).expect("another directory");
        assert_ne!(other.store_id(), id);
    }
}
