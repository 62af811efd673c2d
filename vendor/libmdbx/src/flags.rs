use bitflags::bitflags;
use ffi::*;
use libc::c_uint;

/// MDBX sync mode
#[derive(Clone, Copy, Debug, Default)]
pub enum SyncMode {
    /// Default robust and durable sync mode.
    /// Metadata is written and flushed to disk after a data is written and flushed, which guarantees the integrity of the database in the event of a crash at any time.
    #[default]
    Durable,

    /// Don't sync the meta-page after commit.
    ///
    /// Flush system buffers to disk only once per transaction commit, omit the metadata flush.
    /// Defer that until the system flushes files to disk, or next non-read-only commit or [Database::sync()](crate::Database::sync).
    /// Depending on the platform and hardware, with [SyncMode::NoMetaSync] you may get a doubling of write performance.
    ///
    /// This trade-off maintains database integrity, but a system crash may undo the last committed transaction.
    /// I.e. it preserves the ACI (atomicity, consistency, isolation) but not D (durability) database property.
    NoMetaSync,

    /// Don't sync anything but keep previous steady commits.
    ///
    /// [SyncMode::UtterlyNoSync] the [SyncMode::SafeNoSync] flag disable similarly flush system buffers to disk when committing a transaction.
    /// But there is a huge difference in how are recycled the MVCC snapshots corresponding to previous "steady" transactions (see below).
    ///
    /// With [crate::WriteMap] the [SyncMode::SafeNoSync] instructs MDBX to use asynchronous mmap-flushes to disk.
    /// Asynchronous mmap-flushes means that actually all writes will scheduled and performed by operation system on it own manner, i.e. unordered.
    /// MDBX itself just notify operating system that it would be nice to write data to disk, but no more.
    ///
    /// Depending on the platform and hardware, with [SyncMode::SafeNoSync] you may get a multiple increase of write performance, even 10 times or more.
    ///
    /// In contrast to [SyncMode::UtterlyNoSync] mode, with [SyncMode::SafeNoSync] flag MDBX will keeps untouched pages within B-tree of the last transaction "steady" which was synced to disk completely.
    /// This has big implications for both data durability and (unfortunately) performance:
    ///
    /// A system crash can't corrupt the database, but you will lose the last transactions; because MDBX will rollback to last steady commit since it kept explicitly.
    /// The last steady transaction makes an effect similar to "long-lived" read transaction since prevents reuse of pages freed by newer write transactions, thus the any data changes will be placed in newly allocated pages.
    /// To avoid rapid database growth, the system will sync data and issue a steady commit-point to resume reuse pages, each time there is insufficient space and before increasing the size of the file on disk.
    /// In other words, with [SyncMode::SafeNoSync] flag MDBX protects you from the whole database corruption, at the cost increasing database size and/or number of disk IOPs.
    /// So, [SyncMode::SafeNoSync] flag could be used with [Database::sync()](crate::Database::sync) as alternatively for batch committing or nested transaction (in some cases).
    ///
    /// The number and volume of of disk IOPs with [SyncMode::SafeNoSync] flag will exactly the as without any no-sync flags.
    /// However, you should expect a larger process's work set and significantly worse a locality of reference, due to the more intensive allocation of previously unused pages and increase the size of the database.
    SafeNoSync,

    /// Don't sync anything and wipe previous steady commits.
    ///
    /// Don't flush system buffers to disk when committing a transaction.
    /// This optimization means a system crash can corrupt the database, if buffers are not yet flushed to disk.
    /// Depending on the platform and hardware, with [SyncMode::UtterlyNoSync] you may get a multiple increase of write performance, even 100 times or more.
    ///
    /// If the filesystem preserves write order (which is rare and never provided unless explicitly noted) and the [WriteMap](crate::WriteMap) and [DatabaseOptions::liforeclaim](crate::DatabaseOptions::liforeclaim) flags are not used,
    /// then a system crash can't corrupt the database, but you can lose the last transactions, if at least one buffer is not yet flushed to disk.
    /// The risk is governed by how often the system flushes dirty buffers to disk and how often [Database::sync()](crate::Database::sync) is called.
    /// So, transactions exhibit ACI (atomicity, consistency, isolation) properties and only lose D (durability).
    /// I.e. database integrity is maintained, but a system crash may undo the final transactions.
    ///
    /// Otherwise, if the filesystem not preserves write order (which is typically) or [WriteMap](crate::WriteMap) or [DatabaseOptions::liforeclaim](crate::DatabaseOptions::liforeclaim) flags are used, you should expect the corrupted database after a system crash.
    ///
    /// So, most important thing about [SyncMode::UtterlyNoSync]:
    ///
    /// A system crash immediately after commit the write transaction high likely lead to database corruption.
    /// Successful completion of [Database::sync(force=true)](crate::Database::sync) after one or more committed transactions guarantees consistency and durability.
    /// BUT by committing two or more transactions you back database into a weak state, in which a system crash may lead to database corruption!
    /// In case single transaction after [Database::sync()](crate::Database::sync), you may lose transaction itself, but not a whole database.
    /// Nevertheless, [SyncMode::UtterlyNoSync] provides "weak" durability in case of an application crash (but no durability on system failure),
    /// and therefore may be very useful in scenarios where data durability is not required over a system failure (e.g for short-lived data), or if you can take such risk.
    UtterlyNoSync,
}

/// Whether a database is opened read-only or read-write.
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    /// Read-only (`MDBX_RDONLY`): only read transactions can be started.
    ReadOnly,
    /// Read-write, with durability and file-geometry settings (the default).
    ReadWrite(ReadWriteOptions),
}

impl Default for Mode {
    fn default() -> Self {
        Self::ReadWrite(ReadWriteOptions::default())
    }
}

/// Settings of a read-write database. File sizes are in bytes; `None` keeps
/// the current value (or libmdbx's default for a new database).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadWriteOptions {
    /// Durability of commits.
    pub sync_mode: SyncMode,
    /// Lower bound of the database file size.
    pub min_size: Option<isize>,
    /// Upper bound of the database file size; writes beyond it fail with
    /// [Error::MapFull](crate::Error::MapFull).
    pub max_size: Option<isize>,
    /// Step by which the file grows.
    pub growth_step: Option<isize>,
    /// Free space at the end of the file above which it is shrunk.
    pub shrink_threshold: Option<isize>,
}

bitflags! {
    /// Table options, fixed when a table is created.
    #[derive(Default, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Clone, Copy)]
    pub struct TableFlags: c_uint {
        /// Compare keys back to front.
        const REVERSE_KEY = MDBX_REVERSEKEY as u32;
        /// Allow several sorted values (duplicates) per key.
        const DUP_SORT = MDBX_DUPSORT as u32;
        /// Keys are native-endian `u32` or `u64` integers, compared numerically.
        const INTEGER_KEY = MDBX_INTEGERKEY as u32;
        /// [TableFlags::DUP_SORT] with all values of one size (enables
        /// `get_multiple` and `put_multiple`).
        const DUP_FIXED = MDBX_DUPFIXED as u32;
        /// [TableFlags::DUP_FIXED] with native-endian integer values, compared
        /// numerically.
        const INTEGER_DUP = MDBX_INTEGERDUP as u32;
        /// [TableFlags::DUP_SORT] with values compared back to front.
        const REVERSE_DUP = MDBX_REVERSEDUP as u32;
    }
}

bitflags! {
    /// Write options for put and delete operations.
    ///
    /// `MDBX_RESERVE` and `MDBX_MULTIPLE` are deliberately absent: they change
    /// the meaning of the data argument (an uninitialized reservation, or an
    /// array of two `MDBX_val`s), so they are only reachable through
    /// [Transaction::put_with](crate::Transaction::put_with) and the
    /// `put_multiple` methods, which set up the data accordingly.
    #[derive(Default, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Clone, Copy)]
    pub struct WriteFlags: c_uint {
        /// Insert or replace (the default; no bits set).
        const UPSERT = MDBX_UPSERT as u32;
        /// Fail with [Error::KeyExist](crate::Error::KeyExist) if the key already exists.
        const NO_OVERWRITE = MDBX_NOOVERWRITE as u32;
        /// [TableFlags::DUP_SORT]-only: fail if the key/data pair already exists.
        const NO_DUP_DATA = MDBX_NODUPDATA as u32;
        /// Replace the item at the current cursor position (the key must match).
        const CURRENT = MDBX_CURRENT as u32;
        /// [TableFlags::DUP_SORT]-only: replace or delete all duplicates of the key.
        const ALLDUPS = MDBX_ALLDUPS as u32;
        /// Append at the end of the table; keys must be supplied in order.
        const APPEND = MDBX_APPEND as u32;
        /// [TableFlags::DUP_SORT]-only: append a duplicate; data must be supplied in order.
        const APPEND_DUP = MDBX_APPENDDUP as u32;
    }
}

impl WriteFlags {
    /// The flag bits to pass to libmdbx.
    ///
    /// Bits outside the declared flags (e.g. smuggled in via
    /// [WriteFlags::from_bits_retain]) are dropped: `MDBX_RESERVE` or
    /// `MDBX_MULTIPLE` would make libmdbx misread the data argument.
    pub(crate) fn ffi_bits(self) -> c_uint {
        self.intersection(Self::all()).bits()
    }
}

/// Compatibility shim to convert between `i32` and `u32` enums on Windows and UNIX.
///
/// Windows treats C enums as `i32`, while Unix uses `u32`. We use `u32` enums internally
/// and then cast back to `i32` only where Windows requires it.
///
/// See https://github.com/rust-lang/rust-bindgen/issues/1907
#[cfg(windows)]
#[inline(always)]
pub(crate) const fn c_enum(rust_value: u32) -> i32 {
    rust_value as i32
}

#[cfg(not(windows))]
#[inline(always)]
pub(crate) const fn c_enum(rust_value: u32) -> u32 {
    rust_value
}
