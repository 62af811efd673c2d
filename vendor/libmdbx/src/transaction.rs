use crate::{
    Cursor, Decodable, Error, Stat,
    database::{Database, DatabaseKind, NoWriteMap, TxnManagerMessage, TxnPtr, WriteSlot},
    error::{Result, mdbx_result},
    flags::{TableFlags, WriteFlags, c_enum},
    table::Table,
};
use ffi::{MDBX_TXN_RDONLY, MDBX_TXN_READWRITE, MDBX_txn_flags_t};
use indexmap::IndexSet;
use libc::{c_int, c_uint, c_void};
use parking_lot::Mutex;
use sealed::sealed;
use std::{
    fmt,
    fmt::Debug,
    marker::PhantomData,
    mem::size_of,
    ptr, result, slice,
    sync::{Arc, mpsc::sync_channel},
};

/// Whether a [Transaction] is read-only ([RO]) or read-write ([RW]). Sealed.
#[sealed]
pub trait TransactionKind: Debug + 'static {
    #[doc(hidden)]
    const ONLY_CLEAN: bool;

    #[doc(hidden)]
    const OPEN_FLAGS: MDBX_txn_flags_t;
}

/// [TransactionKind] of read-only transactions: MVCC snapshots with zero-copy reads.
#[derive(Debug)]
pub struct RO;
/// [TransactionKind] of read-write transactions; one at a time per database.
#[derive(Debug)]
pub struct RW;

#[sealed]
impl TransactionKind for RO {
    const ONLY_CLEAN: bool = true;
    const OPEN_FLAGS: MDBX_txn_flags_t = MDBX_TXN_RDONLY;
}
#[sealed]
impl TransactionKind for RW {
    const ONLY_CLEAN: bool = false;
    const OPEN_FLAGS: MDBX_txn_flags_t = MDBX_TXN_READWRITE;
}

/// An MDBX transaction.
///
/// All table operations require a transaction.
pub struct Transaction<'db, K, E>
where
    K: TransactionKind,
    E: DatabaseKind,
{
    txn: Arc<Mutex<TxnPtr>>,
    primed_dbis: Mutex<IndexSet<ffi::MDBX_dbi>>,
    committed: bool,
    /// Begun on the caller's thread ([`Database::begin_rw_txn_here`]): committed and
    /// aborted there too, not through the manager thread. (Runner's patch.)
    local: bool,
    db: &'db Database<E>,
    /// Held by top-level write transactions. Declared last so it is released
    /// only after `Drop` has aborted (or `commit` has committed) the handle.
    _write_slot: Option<WriteSlot<'db>>,
    _marker: PhantomData<fn() -> K>,
}

impl<'db, K, E> Transaction<'db, K, E>
where
    K: TransactionKind,
    E: DatabaseKind,
{
    pub(crate) fn new(db: &'db Database<E>) -> Result<Self> {
        let mut txn: *mut ffi::MDBX_txn = ptr::null_mut();
        unsafe {
            mdbx_result(ffi::mdbx_txn_begin_ex(
                db.ptr().0,
                ptr::null_mut(),
                K::OPEN_FLAGS,
                &mut txn,
                ptr::null_mut(),
            ))?;
            Ok(Self::new_from_ptr(db, txn, None))
        }
    }

    pub(crate) fn new_from_ptr(
        db: &'db Database<E>,
        txn: *mut ffi::MDBX_txn,
        write_slot: Option<WriteSlot<'db>>,
    ) -> Self {
        Self {
            txn: Arc::new(Mutex::new(TxnPtr(txn))),
            primed_dbis: Mutex::new(IndexSet::new()),
            committed: false,
            local: false,
            db,
            _write_slot: write_slot,
            _marker: PhantomData,
        }
    }

    /// The lock that serializes every libmdbx call on this transaction.
    pub(crate) fn txn_mutex(&self) -> Arc<Mutex<TxnPtr>> {
        self.txn.clone()
    }

    /// Returns the raw libmdbx transaction handle.
    ///
    /// Using it bypasses this crate's synchronization: the caller must not use
    /// it after the transaction ends, nor concurrently with any other use of
    /// the transaction (e.g. from another thread sharing it).
    pub fn txn(&self) -> TxnPtr {
        *self.txn.lock()
    }

    /// The database this transaction belongs to.
    pub fn db(&self) -> &Database<E> {
        self.db
    }

    /// Returns the transaction id.
    pub fn id(&self) -> u64 {
        txn_execute(&self.txn, |txn| unsafe { ffi::mdbx_txn_id(txn) })
    }

    /// Gets an item from a table.
    ///
    /// This function retrieves the data associated with the given key in the
    /// table. If the table supports duplicate keys
    /// ([TableFlags::DUP_SORT]) then the first data item for the key will be
    /// returned. Retrieval of other items requires the use of
    /// [Cursor]. If the item is not in the table, then
    /// [None] will be returned.
    ///
    /// In a read-write transaction, zero-copy decoders such as
    /// [Cow](std::borrow::Cow) copy the returned bytes for safety (MDBX may
    /// relocate pages on subsequent writes). For zero-copy reads prefer a
    /// read-only transaction.
    pub fn get<'txn, Key>(
        &'txn self,
        table: &Table<'txn>,
        key: impl AsRef<[u8]>,
    ) -> Result<Option<Key>>
    where
        Key: Decodable<'txn>,
    {
        let key = key.as_ref();
        let key_val: ffi::MDBX_val = ffi::MDBX_val {
            iov_len: key.len(),
            iov_base: key.as_ptr() as *mut c_void,
        };
        let mut data_val: ffi::MDBX_val = ffi::MDBX_val {
            iov_len: 0,
            iov_base: ptr::null_mut(),
        };

        txn_execute(&self.txn, |txn| unsafe {
            match ffi::mdbx_get(txn, table.dbi(), &key_val, &mut data_val) {
                ffi::MDBX_SUCCESS => Key::decode_val::<K>(txn, &data_val).map(Some),
                ffi::MDBX_NOTFOUND => Ok(None),
                err_code => Err(Error::from_err_code(err_code)),
            }
        })
    }

    /// Commits the transaction.
    ///
    /// Any pending operations will be saved.
    ///
    /// Returns `true` if the transaction did not contain any changes to
    /// commit, in which case no actions were performed.
    pub fn commit(self) -> Result<bool> {
        self.commit_and_rebind_open_dbs().map(|v| v.0)
    }

    /// Marks `table` to be returned by
    /// [commit_and_rebind_open_dbs](Transaction::commit_and_rebind_open_dbs)
    /// as a handle that stays valid for the database's lifetime.
    pub fn prime_for_permaopen(&self, table: Table<'_>) {
        self.primed_dbis.lock().insert(table.dbi());
    }

    /// Commits the transaction and returns table handles permanently open for the lifetime of `Database`.
    ///
    /// The returned `bool` has the same meaning as in
    /// [`commit`](Transaction::commit): `true` means the transaction did not
    /// contain any changes to commit.
    pub fn commit_and_rebind_open_dbs(mut self) -> Result<(bool, Vec<Table<'db>>)> {
        let txnlck = self.txn.lock();
        let txn = txnlck.0;
        let result = if K::ONLY_CLEAN || self.local {
            mdbx_result(unsafe { ffi::mdbx_txn_commit_ex(txn, ptr::null_mut()) })
        } else {
            let (sender, rx) = sync_channel(0);
            self.db
                .txn_manager
                .as_ref()
                .unwrap()
                .send(TxnManagerMessage::Commit {
                    tx: TxnPtr(txn),
                    sender,
                })
                .ok();
            rx.recv().unwrap_or_else(|_| Err(Error::Panic))
        };
        // MDBX_THREAD_MISMATCH is the only commit error that does NOT free
        // the transaction (libmdbx mdbx.h: only a result other than
        // MDBX_THREAD_MISMATCH means the transaction is terminated). Keep
        // `committed` false so Drop still aborts the live handle.
        if !matches!(result, Err(Error::ThreadMismatch)) {
            self.committed = true;
        }
        result.map(|v| {
            (
                v,
                self.primed_dbis
                    .lock()
                    .iter()
                    .map(|&dbi| Table::new_from_ptr(dbi))
                    .collect(),
            )
        })
    }

    /// Opens a handle to an MDBX table.
    ///
    /// If `name` is [None], then the returned handle will be for the default table.
    ///
    /// If `name` is not [None], then the returned handle will be for a named table. In this
    /// case the database must be configured to allow named tables through
    /// [DatabaseOptions::max_tables](crate::DatabaseOptions::max_tables) when opening the database
    /// with [Database::open_with_options](crate::Database::open_with_options).
    ///
    /// The returned table handle may be shared among any transaction in the database.
    ///
    /// The table name may not contain the null character.
    pub fn open_table<'txn>(&'txn self, name: Option<&str>) -> Result<Table<'txn>> {
        Table::new(self, name, ffi::MDBX_DB_ACCEDE as c_uint)
    }

    /// Gets the option flags for the given table in the transaction.
    ///
    /// Unknown bits set by newer libmdbx versions are preserved.
    pub fn table_flags<'txn>(&'txn self, table: &Table<'txn>) -> Result<TableFlags> {
        let mut flags: c_uint = 0;
        let mut state: c_uint = 0;
        mdbx_result(txn_execute(&self.txn, |txn| unsafe {
            ffi::mdbx_dbi_flags_ex(txn, table.dbi(), &mut flags, &mut state)
        }))?;
        Ok(TableFlags::from_bits_retain(flags))
    }

    /// Retrieves table statistics.
    pub fn table_stat<'txn>(&'txn self, table: &Table<'txn>) -> Result<Stat> {
        unsafe {
            let mut stat = Stat::new();
            mdbx_result(txn_execute(&self.txn, |txn| {
                ffi::mdbx_dbi_stat(txn, table.dbi(), stat.mdb_stat(), size_of::<Stat>())
            }))?;
            Ok(stat)
        }
    }

    /// Open a new cursor on the given table.
    pub fn cursor<'txn>(&'txn self, table: &Table<'txn>) -> Result<Cursor<'txn, K>> {
        Cursor::new(self, table)
    }
}

pub(crate) fn txn_execute<F: FnOnce(*mut ffi::MDBX_txn) -> T, T>(txn: &Mutex<TxnPtr>, f: F) -> T {
    let lck = txn.lock();
    (f)(lck.0)
}

/// Validates a `put_multiple` request and runs `put` with the two-element
/// `MDBX_val` array that `MDBX_MULTIPLE` requires: `[0]` spans the first
/// element, `[1].iov_len` holds the element count in and the stored count out.
pub(crate) fn put_multiple_with(
    values: &[u8],
    value_len: usize,
    put: impl FnOnce(&mut [ffi::MDBX_val; 2]) -> c_int,
) -> Result<usize> {
    if value_len == 0 {
        return Err(Error::InvalidArgument(
            "put_multiple: value_len must be non-zero",
        ));
    }
    if !values.len().is_multiple_of(value_len) {
        return Err(Error::InvalidArgument(
            "put_multiple: values.len() must be a multiple of value_len",
        ));
    }
    if values.is_empty() {
        return Ok(0);
    }
    // libmdbx requires INTEGER_DUP elements to be naturally aligned; copy
    // misaligned input into an 8-aligned buffer rather than make every
    // caller get this right.
    let aligned: Vec<u64>;
    let base = if values.as_ptr().align_offset(8) == 0 {
        values.as_ptr()
    } else {
        let mut buf = vec![0u64; values.len().div_ceil(8)];
        // SAFETY: `buf` spans at least `values.len()` bytes and cannot
        // overlap the borrowed `values`.
        unsafe { ptr::copy_nonoverlapping(values.as_ptr(), buf.as_mut_ptr().cast(), values.len()) };
        aligned = buf;
        aligned.as_ptr().cast()
    };
    let mut data = [
        ffi::MDBX_val {
            iov_len: value_len,
            iov_base: base as *mut c_void,
        },
        ffi::MDBX_val {
            iov_len: values.len() / value_len,
            iov_base: ptr::null_mut(),
        },
    ];
    mdbx_result(put(&mut data))?;
    Ok(data[1].iov_len)
}

impl<E> Transaction<'_, RW, E>
where
    E: DatabaseKind,
{
    /// Opens a handle to an MDBX table, creating the table if necessary.
    ///
    /// If the table is already created, the given option flags will be added to it.
    ///
    /// If `name` is [None], then the returned handle will be for the default table.
    ///
    /// If `name` is not [None], then the returned handle will be for a named table. In this
    /// case the database must be configured to allow named tables through
    /// [DatabaseOptions::max_tables](crate::DatabaseOptions::max_tables) when opening the database
    /// with [Database::open_with_options](crate::Database::open_with_options).
    pub fn create_table<'txn>(
        &'txn self,
        name: Option<&str>,
        flags: TableFlags,
    ) -> Result<Table<'txn>> {
        Table::new(self, name, flags.bits() | ffi::MDBX_CREATE as c_uint)
    }

    /// Stores an item into a table.
    ///
    /// This function stores key/data pairs in the table. The default
    /// behavior is to enter the new key/data pair, replacing any previously
    /// existing key if duplicates are disallowed, or adding a duplicate data
    /// item if duplicates are allowed ([TableFlags::DUP_SORT]).
    pub fn put<'txn>(
        &'txn self,
        table: &Table<'txn>,
        key: impl AsRef<[u8]>,
        data: impl AsRef<[u8]>,
        flags: WriteFlags,
    ) -> Result<()> {
        let key = key.as_ref();
        let data = data.as_ref();
        let key_val: ffi::MDBX_val = ffi::MDBX_val {
            iov_len: key.len(),
            iov_base: key.as_ptr() as *mut c_void,
        };
        let mut data_val: ffi::MDBX_val = ffi::MDBX_val {
            iov_len: data.len(),
            iov_base: data.as_ptr() as *mut c_void,
        };
        mdbx_result(txn_execute(&self.txn, |txn| unsafe {
            ffi::mdbx_put(
                txn,
                table.dbi(),
                &key_val,
                &mut data_val,
                c_enum(flags.ffi_bits()),
            )
        }))?;

        Ok(())
    }

    /// [TableFlags::DUP_FIXED]-only: stores `values`, a concatenation of
    /// `value_len`-byte elements, as duplicates of `key` in one operation
    /// (MDBX's `MDBX_MULTIPLE`).
    ///
    /// Returns the number of elements stored. Fails with
    /// [Error::InvalidArgument] if `value_len` is zero or does not divide
    /// `values.len()`.
    pub fn put_multiple<'txn>(
        &'txn self,
        table: &Table<'txn>,
        key: impl AsRef<[u8]>,
        values: &[u8],
        value_len: usize,
        flags: WriteFlags,
    ) -> Result<usize> {
        let key = key.as_ref();
        let key_val = ffi::MDBX_val {
            iov_len: key.len(),
            iov_base: key.as_ptr() as *mut c_void,
        };
        put_multiple_with(values, value_len, |data| {
            txn_execute(&self.txn, |txn| unsafe {
                ffi::mdbx_put(
                    txn,
                    table.dbi(),
                    &key_val,
                    data.as_mut_ptr(),
                    c_enum(flags.ffi_bits() | ffi::MDBX_MULTIPLE as u32),
                )
            })
        })
    }

    /// Puts a value of `len` bytes at `key`, filling the reserved buffer
    /// in place via `write` (MDBX's `MDBX_RESERVE` operation).
    ///
    /// The buffer is only valid inside `write`; it aliases the transaction's
    /// page memory and MUST NOT outlive the closure. This method therefore
    /// cannot produce two outstanding buffers over the same memory.
    ///
    /// The buffer is zero-filled before `write` runs, so bytes it leaves
    /// untouched are stored as zeros. (libmdbx may hand out memory holding
    /// the key's previous value, a freed page's content, or — with
    /// `no_meminit` — never-initialized bytes, which safe code must not read.)
    ///
    /// `write` runs under the transaction's lock, so it must not call
    /// methods on the same transaction: they would block until `put_with`
    /// returns, i.e. deadlock (this is a deadlock, not undefined behavior).
    pub fn put_with<'txn, R>(
        &'txn self,
        table: &Table<'txn>,
        key: impl AsRef<[u8]>,
        len: usize,
        flags: WriteFlags,
        write: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        let key = key.as_ref();
        let key_val: ffi::MDBX_val = ffi::MDBX_val {
            iov_len: key.len(),
            iov_base: key.as_ptr() as *mut c_void,
        };
        let mut data_val: ffi::MDBX_val = ffi::MDBX_val {
            iov_len: len,
            iov_base: ptr::null_mut::<c_void>(),
        };
        // The put and the user closure run under one lock hold: the reserved
        // buffer aliases the transaction's page memory, which another thread
        // sharing this transaction could otherwise reorganize (via put/del)
        // while `write` fills it.
        txn_execute(&self.txn, |txn| {
            mdbx_result(unsafe {
                ffi::mdbx_put(
                    txn,
                    table.dbi(),
                    &key_val,
                    &mut data_val,
                    c_enum(flags.ffi_bits() | ffi::MDBX_RESERVE as u32),
                )
            })
            .map(|_| {
                // SAFETY: on success libmdbx has filled `data_val` with the
                // reserved buffer, valid until the transaction is touched
                // again — we are still under its lock. It is zeroed through
                // the raw pointer before any reference to it exists.
                let buf = unsafe {
                    if data_val.iov_len == 0 {
                        &mut []
                    } else {
                        let base = data_val.iov_base as *mut u8;
                        ptr::write_bytes(base, 0, data_val.iov_len);
                        slice::from_raw_parts_mut(base, data_val.iov_len)
                    }
                };
                write(buf)
            })
        })
    }

    /// Delete items from a table.
    /// This function removes key/data pairs from the table.
    ///
    /// The data parameter is NOT ignored regardless the table does support sorted duplicate data items or not.
    /// If the data parameter is [Some] only the matching data item will be deleted.
    /// Otherwise, if data parameter is [None], any/all value(s) for specified key will be deleted.
    ///
    /// Returns `true` if the key/value pair was present.
    pub fn del<'txn>(
        &'txn self,
        table: &Table<'txn>,
        key: impl AsRef<[u8]>,
        data: Option<&[u8]>,
    ) -> Result<bool> {
        let key = key.as_ref();
        let key_val: ffi::MDBX_val = ffi::MDBX_val {
            iov_len: key.len(),
            iov_base: key.as_ptr() as *mut c_void,
        };
        let data_val: Option<ffi::MDBX_val> = data.map(|data| ffi::MDBX_val {
            iov_len: data.len(),
            iov_base: data.as_ptr() as *mut c_void,
        });

        mdbx_result({
            txn_execute(&self.txn, |txn| {
                if let Some(d) = data_val {
                    unsafe { ffi::mdbx_del(txn, table.dbi(), &key_val, &d) }
                } else {
                    unsafe { ffi::mdbx_del(txn, table.dbi(), &key_val, ptr::null()) }
                }
            })
        })
        .map(|_| true)
        .or_else(|e| match e {
            Error::NotFound => Ok(false),
            other => Err(other),
        })
    }

    /// Empties the given table. All items will be removed.
    pub fn clear_table<'txn>(&'txn self, table: &Table<'txn>) -> Result<()> {
        mdbx_result(txn_execute(&self.txn, |txn| unsafe {
            ffi::mdbx_drop(txn, table.dbi(), false)
        }))?;

        Ok(())
    }

    /// Drops the table from the database.
    ///
    /// # Safety
    /// Caller must close ALL other [Table] and [Cursor] instances pointing to the same dbi BEFORE calling this function.
    pub unsafe fn drop_table<'txn>(&'txn self, table: Table<'txn>) -> Result<()> {
        mdbx_result(txn_execute(&self.txn, |txn| unsafe {
            ffi::mdbx_drop(txn, table.dbi(), true)
        }))?;

        Ok(())
    }
}

impl<'db, E> Transaction<'db, RW, E>
where
    E: DatabaseKind,
{
    /// A write transaction begun on the calling thread (Runner's patch).
    pub(crate) fn new_local(
        db: &'db Database<E>,
        txn: *mut ffi::MDBX_txn,
        write_slot: WriteSlot<'db>,
    ) -> Self {
        let mut t = Self::new_from_ptr(db, txn, Some(write_slot));
        t.local = true;
        t
    }
}

impl<E> Transaction<'_, RO, E>
where
    E: DatabaseKind,
{
    /// Closes the table handle.
    ///
    /// # Safety
    /// Caller must close ALL other [Table] and [Cursor] instances pointing to the same dbi BEFORE calling this function.
    ///
    /// This call is not synchronized with transactions running in other
    /// threads: it must not run concurrently with any transaction using this
    /// dbi, nor while another thread commits or aborts a write transaction.
    pub unsafe fn close_table(&self, table: Table<'_>) -> Result<()> {
        mdbx_result(unsafe { ffi::mdbx_dbi_close(self.db.ptr().0, table.dbi()) })?;

        Ok(())
    }
}

impl Transaction<'_, RW, NoWriteMap> {
    /// Begins a new nested transaction inside of this transaction.
    pub fn begin_nested_txn(&mut self) -> Result<Transaction<'_, RW, NoWriteMap>> {
        txn_execute(&self.txn, |txn| {
            let (tx, rx) = sync_channel(0);
            self.db
                .txn_manager
                .as_ref()
                .unwrap()
                .send(TxnManagerMessage::Begin {
                    parent: TxnPtr(txn),
                    flags: RW::OPEN_FLAGS,
                    sender: tx,
                })
                .ok();

            rx.recv()
                .unwrap_or_else(|_| Err(Error::Panic))
                .map(|ptr| Transaction::new_from_ptr(self.db, ptr.0, None))
        })
    }
}

impl<K, E> fmt::Debug for Transaction<'_, K, E>
where
    K: TransactionKind,
    E: DatabaseKind,
{
    fn fmt(&self, f: &mut fmt::Formatter) -> result::Result<(), fmt::Error> {
        f.debug_struct(if K::ONLY_CLEAN {
            "RoTransaction"
        } else {
            "RwTransaction"
        })
        .finish()
    }
}

impl<K, E> Drop for Transaction<'_, K, E>
where
    K: TransactionKind,
    E: DatabaseKind,
{
    fn drop(&mut self) {
        txn_execute(&self.txn, |txn| {
            if !self.committed {
                if K::ONLY_CLEAN || self.local {
                    unsafe {
                        ffi::mdbx_txn_abort_ex(txn, ptr::null_mut());
                    }
                } else {
                    let (sender, rx) = sync_channel(0);
                    let sent = self
                        .db
                        .txn_manager
                        .as_ref()
                        .unwrap()
                        .send(TxnManagerMessage::Abort {
                            tx: TxnPtr(txn),
                            sender,
                        })
                        .is_ok();
                    // If the manager thread is gone, the environment is
                    // being destroyed and the transaction is leaked on
                    // purpose: aborting through a dead channel is impossible,
                    // and panicking in drop would be worse.
                    if !sent || rx.recv().is_err() {
                        self.committed = true;
                    }
                }
            }
        })
    }
}
