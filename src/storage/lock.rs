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

/// Held for the life of a node; dropping it releases the directory.
#[derive(Debug)]
pub struct NodeLock {
    _file: File,
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
        Ok(Self { _file: file })
    }
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
        drop(first);
        let _again = NodeLock::acquire(&data).expect("free once released");
        assert!(data.join(LOCK_FILE).exists());
    }
}
