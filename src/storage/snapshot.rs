//! Partition snapshots: one saga partition's keyspace as bytes, and back (DESIGN §8.6).
//!
//! State moves with its partition: the owner exports partition `p` with
//! [`Store::export_partition`], the bytes go to an object store (the NATS side is
//! `worker/ownership/snapshot.rs`), and a new owner replaces its copy of `p` with
//! [`Store::import_partition`], then replays SAGA_INBOX from the snapshot's checkpoint + 1.
//!
//! **What a snapshot of `p` holds.** Every row whose saga instance `(tenant, saga,
//! correlation id)` falls in `p` by the deployment's partition function
//! ([`Partitioning`]): instances and their history rings (`saga` table, and the `history`
//! table older stores wrote), timers (`schedule`), parked keys (`parked`) and dead letters
//! that name their instance (`deadletter`); the outbox records stored under partition `p`
//! (`outbox`); the dedupe markers of events applied to its instances (`dedupe`, those whose
//! value records partition `p` of the same partition count,
//! [`MarkerPlace`](super::tables::dedupe::MarkerPlace)); and, in the header, the checkpoint
//! of `p` (the last applied SAGA_INBOX sequence, under [`partition_checkpoint_key`]). Values
//! are copied byte for byte.
//!
//! Carrying the markers is what keeps an event published twice, under two stream sequences
//! on either side of the snapshot's checkpoint, applied once by a new owner: the second copy
//! finds the first one's marker. Only the partition's own markers travel, and an import
//! replaces the store's markers of `p` with them, so a store never holds a marker for an
//! input further along `p`'s log than its copy of `p`.
//!
//! **Not carried, and why.**
//! - *Dedupe markers written before markers recorded their partition* (8- or 16-byte
//!   values): their partition cannot be told from them. They stay with the store that wrote
//!   them and expire there (`saga.dedupe_retention`).
//! - *Dead letters that name no instance* (an undecodable input, say) belong to no
//!   partition; they stay in the store that recorded them.
//!
//! **Format 2.** A [`codec`](super::codec) record: format byte `2`, the string
//! [`MAGIC`], then partition, partition count and checkpoint (`u64` each), then rows until
//! the end, each a table name, a key and a value (byte strings); after it, the SHA-256 of
//! everything before. A reader refuses another format byte ([`SnapshotError::Format`]) and
//! anything that does not check out ([`SnapshotError::Corrupt`]). Format 1, written before
//! markers were carried, is the same record without `dedupe` rows, and is still read.
//!
//! **Guarantees.**
//! - An export reads one read transaction: the rows and the checkpoint are one committed
//!   state, so replaying from checkpoint + 1 continues exactly where the rows stop.
//!   Export is deterministic (tables in a fixed order, rows in key order): two stores
//!   holding the same partition produce the same bytes.
//! - An import is one write transaction: it deletes every row the store holds for `p`,
//!   writes the snapshot's and sets the checkpoint, or does nothing at all. A stale local
//!   copy is replaced whole, never merged; rows of other partitions are not touched.
//! - An import refuses, before writing anything, a snapshot of another partition, of
//!   another partition count, or with any row outside its partition.
//! - Store-wide counters only move up: after an import the next outbox sequence and the next
//!   dead-letter id lie above every imported one. Dead-letter ids are unique per store, so
//!   when an imported id is taken locally, all imported dead letters get new ids, in their
//!   original order (a key's held entries still redrive oldest first), and parked markers
//!   follow them.

use libmdbx::{NoWriteMap, RW, Transaction, TransactionKind, WriteFlags};
use sha2::{Digest, Sha256};

use super::Store;
use super::codec::{Reader, Writer};
use super::error::StorageError;
use super::tables::dedupe::MarkerPlace;
use super::tables::keys::{DEADLETTER_ID, OUTBOX_SEQ, u64_of};
use super::tables::{DeadLetter, Tables};

/// The partition of an instance: `(tenant, saga, correlation_id, partitions)` → `0..partitions`.
pub type PartitionOf = fn(&str, &str, &str, u32) -> u32;

/// The snapshot format this version writes.
pub const FORMAT: u8 = 2;
/// The earlier format, read still: format 2 without dedupe markers.
const FORMAT_1: u8 = 1;
/// The string after the format byte, so another program's record is not taken for a snapshot.
pub const MAGIC: &str = "runner-partition-snapshot";
/// The tables rows are taken from, in the order a snapshot lists them.
const SNAPSHOT_TABLES: [&str; 7] = [
    "saga",
    "history",
    "schedule",
    "outbox",
    "parked",
    "deadletter",
    "dedupe",
];
/// Length of the SHA-256 trailer.
const DIGEST_LEN: usize = 32;

/// The `checkpoint` table key of partition `p`: `<consumers.saga>:<streams.saga_inbox>:<p>`.
pub fn partition_checkpoint_key(consumers_saga: &str, saga_inbox: &str, p: u32) -> String {
    format!("{consumers_saga}:{saga_inbox}:{p}")
}

/// How a deployment splits saga state: the partition count, the partition function and the
/// names its checkpoints are kept under.
#[derive(Debug, Clone)]
pub struct Partitioning {
    consumers_saga: String,
    saga_inbox: String,
    partitions: u32,
    of: PartitionOf,
}

impl Partitioning {
    /// `partitions` partitions, instance placement by `of`, checkpoints named by
    /// [`partition_checkpoint_key`] from `consumers_saga` and `saga_inbox`.
    pub fn new(consumers_saga: &str, saga_inbox: &str, partitions: u32, of: PartitionOf) -> Self {
        Self {
            consumers_saga: consumers_saga.to_string(),
            saga_inbox: saga_inbox.to_string(),
            partitions,
            of,
        }
    }

    /// The partition count.
    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// The `checkpoint` table key of partition `p`.
    pub fn checkpoint_key(&self, p: u32) -> String {
        partition_checkpoint_key(&self.consumers_saga, &self.saga_inbox, p)
    }

    fn of(&self, [tenant, saga, corr]: [&str; 3]) -> u32 {
        (self.of)(tenant, saga, corr, self.partitions)
    }

    fn check(&self, p: u32) -> Result<(), SnapshotError> {
        // Outbox records carry their partition as a u16.
        if p >= self.partitions || p > u32::from(u16::MAX) {
            return Err(SnapshotError::OutOfRange {
                partition: p,
                partitions: self.partitions,
            });
        }
        Ok(())
    }

    /// The partition a row belongs to, or `None` when it belongs to none.
    fn owner(&self, table: &str, key: &[u8], value: &[u8]) -> Result<Option<u32>, SnapshotError> {
        Ok(match table {
            "saga" | "history" => instance_of_row(key).map(|k| self.of(k)),
            "parked" => parts::<3>(key).map(|k| self.of(k)),
            "schedule" => key
                .get(8..)
                .and_then(parts::<4>)
                .map(|[t, s, c, _]| self.of([t, s, c])),
            "outbox" => key
                .get(..2)
                .map(|b| u32::from(u16::from_be_bytes([b[0], b[1]]))),
            "dedupe" => MarkerPlace::of_marker(value)
                .filter(|m| m.partitions == self.partitions)
                .map(|m| m.partition),
            "deadletter" => {
                let dl = dead_letter(value)?;
                match (&dl.saga, &dl.correlation_id) {
                    (Some(s), Some(c)) => Some(self.of([&dl.tenant, s, c])),
                    _ => None,
                }
            }
            _ => None,
        })
    }
}

/// What a snapshot says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotHeader {
    /// The format it was written in.
    pub format: u8,
    /// The partition it holds.
    pub partition: u32,
    /// The partition count of the deployment that wrote it.
    pub partitions: u32,
    /// The last SAGA_INBOX sequence applied to its rows (0: none).
    pub checkpoint: u64,
}

impl SnapshotHeader {
    /// Reads the header of `bytes`, after checking the whole snapshot's digest.
    pub fn read(bytes: &[u8]) -> Result<Self, SnapshotError> {
        decode(bytes).map(|(h, _)| h)
    }
}

/// Snapshot errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The local store failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The bytes are not a whole, intact snapshot (truncated, altered, or not a snapshot).
    #[error("corrupt snapshot: {0}")]
    Corrupt(String),
    /// The snapshot was written in a format this version does not read.
    #[error("snapshot format {0} is not readable by this version (reads formats 1 and {FORMAT})")]
    Format(u8),
    /// The snapshot comes from a deployment with another partition count.
    #[error("snapshot was taken with {snapshot} partitions, this deployment has {local}")]
    PartitionCount {
        /// The snapshot's count.
        snapshot: u32,
        /// The local count.
        local: u32,
    },
    /// The snapshot holds another partition than the one asked for.
    #[error("snapshot holds partition {snapshot}, not {wanted}")]
    WrongPartition {
        /// The snapshot's partition.
        snapshot: u32,
        /// The partition asked for.
        wanted: u32,
    },
    /// The partition number is not below the partition count (or above 65535).
    #[error("partition {partition} is out of range for {partitions} partitions")]
    OutOfRange {
        /// The partition asked for.
        partition: u32,
        /// The partition count.
        partitions: u32,
    },
}

impl From<libmdbx::Error> for SnapshotError {
    fn from(e: libmdbx::Error) -> Self {
        Self::Storage(e.into())
    }
}

/// One row of a snapshot.
struct Row<'a> {
    table: &'a str,
    key: &'a [u8],
    value: &'a [u8],
}

impl Store {
    /// The checkpoint of partition `p` (0 when none). Blocking.
    pub fn partition_checkpoint(&self, how: &Partitioning, p: u32) -> Result<u64, StorageError> {
        self.read_blocking(|t| t.checkpoint(&how.checkpoint_key(p)))
    }

    /// A snapshot of partition `p`, read in one read transaction. Blocking.
    pub fn export_partition(&self, how: &Partitioning, p: u32) -> Result<Vec<u8>, SnapshotError> {
        let mut out = self.export_partitions(how, &[p])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Snapshots of each partition in `ps` (distinct; answered in that order), all from one
    /// read transaction and one pass over the tables. Blocking.
    pub fn export_partitions(
        &self,
        how: &Partitioning,
        ps: &[u32],
    ) -> Result<Vec<Vec<u8>>, SnapshotError> {
        let txn = self.db().begin_ro_txn()?;
        let checkpoints = txn.open_table(Some("checkpoint"))?;
        let mut writers = Vec::with_capacity(ps.len());
        for &p in ps {
            how.check(p)?;
            let v: Option<Vec<u8>> = txn.get(&checkpoints, how.checkpoint_key(p).as_bytes())?;
            let checkpoint = v.map(|b| u64_of(&b, "checkpoint")).transpose()?;
            let mut w = Writer::new(FORMAT, 4096);
            w.str(MAGIC)
                .u64(u64::from(p))
                .u64(u64::from(how.partitions))
                .u64(checkpoint.unwrap_or(0));
            writers.push((p, w));
        }
        for table in SNAPSHOT_TABLES {
            scan(&txn, table, |key, value| {
                if let Some(q) = how.owner(table, key, value)?
                    && let Some((_, w)) = writers.iter_mut().find(|(p, _)| *p == q)
                {
                    w.str(table).bytes(key).bytes(value);
                }
                Ok(())
            })?;
        }
        Ok(writers
            .into_iter()
            .map(|(_, mut w)| {
                let mut body = w.finish();
                let digest = Sha256::digest(&body);
                body.extend_from_slice(&digest);
                body
            })
            .collect())
    }

    /// Replaces everything the store holds for partition `p` with the snapshot `bytes`, in one
    /// write transaction; returns the snapshot's header. Refuses, writing nothing, a snapshot
    /// that is corrupt, of another format, of another partition count or partition, or with a
    /// row outside `p`. Blocking.
    pub fn import_partition(
        &self,
        how: &Partitioning,
        p: u32,
        bytes: &[u8],
    ) -> Result<SnapshotHeader, SnapshotError> {
        how.check(p)?;
        let (header, rows) = decode(bytes)?;
        if header.partitions != how.partitions {
            return Err(SnapshotError::PartitionCount {
                snapshot: header.partitions,
                local: how.partitions,
            });
        }
        if header.partition != p {
            return Err(SnapshotError::WrongPartition {
                snapshot: header.partition,
                wanted: p,
            });
        }
        for r in &rows {
            if !SNAPSHOT_TABLES.contains(&r.table) {
                return Err(corrupt(format!("row of unknown table {:?}", r.table)));
            }
            let owner = how.owner(r.table, r.key, r.value)?;
            if owner != Some(p) {
                return Err(corrupt(format!(
                    "a {} row belongs to partition {owner:?}, not {p}",
                    r.table
                )));
            }
        }
        let txn = self.db().begin_rw_txn()?;
        for table in SNAPSHOT_TABLES {
            let mut doomed = Vec::new();
            scan(&txn, table, |key, value| {
                if how.owner(table, key, value)? == Some(p) {
                    doomed.push(key.to_vec());
                }
                Ok(())
            })?;
            let t = txn.open_table(Some(table))?;
            for k in &doomed {
                txn.del(&t, k, None)?;
            }
        }
        write_rows(&txn, &rows)?;
        // The instance index is derived: rebuilt for the partition's instances as imported.
        let tables = Tables::open(&txn)?;
        tables.rebuild_index(|k| how.of(k) == p)?;
        // So are the partition's counts of running instances (`tables/live.rs`).
        tables.recount(how.partitions, |t, s, c| how.of([t, s, c]), |q| q == p)?;
        // And its queue of keys held at a cap, from the held letters it brought.
        tables.rebuild_capped(|t, s, c| how.of([t, s, c]), |q| q == p)?;
        let checkpoints = txn.open_table(Some("checkpoint"))?;
        let key = how.checkpoint_key(p);
        if header.checkpoint == 0 {
            txn.del(&checkpoints, key.as_bytes(), None)?;
        } else {
            let seq = header.checkpoint.to_be_bytes();
            txn.put(&checkpoints, key.as_bytes(), seq, WriteFlags::UPSERT)?;
        }
        txn.commit()?;
        self.note_unlogged();
        Ok(header)
    }
}

/// Calls `f` with every row of `table`, in key order.
fn scan<K: TransactionKind>(
    txn: &Transaction<'_, K, NoWriteMap>,
    table: &str,
    mut f: impl FnMut(&[u8], &[u8]) -> Result<(), SnapshotError>,
) -> Result<(), SnapshotError> {
    let t = txn.open_table(Some(table))?;
    let mut cur = txn.cursor(&t)?;
    for item in cur.iter_start::<Vec<u8>, Vec<u8>>() {
        let (k, v) = item?;
        f(&k, &v)?;
    }
    Ok(())
}

/// Writes the snapshot's rows (the partition's own rows are already gone) and moves the
/// store's counters above the imported outbox sequences and dead-letter ids.
fn write_rows(
    txn: &Transaction<'_, RW, NoWriteMap>,
    rows: &[Row<'_>],
) -> Result<(), SnapshotError> {
    let tables = Tables::open(txn)?;
    let meta = txn.open_table(Some("meta"))?;
    let counter = |name: &str| -> Result<u64, SnapshotError> {
        let v: Option<Vec<u8>> = txn.get(&meta, name.as_bytes())?;
        Ok(v.map(|b| u64_of(&b, name)).transpose()?.unwrap_or(0))
    };
    let raise = |name: &str, to: u64| -> Result<(), SnapshotError> {
        if to > counter(name)? {
            txn.put(&meta, name.as_bytes(), to.to_be_bytes(), WriteFlags::UPSERT)?;
        }
        Ok(())
    };
    let mut letters = Vec::new();
    let mut parked = Vec::new();
    let mut last_outbox = 0;
    for r in rows {
        match r.table {
            "deadletter" => letters.push(dead_letter(r.value)?),
            "parked" => parked.push(r),
            table => {
                if table == "outbox" {
                    last_outbox = last_outbox.max(u64_of(&r.key[2..], "outbox key")?);
                }
                let t = txn.open_table(Some(table))?;
                txn.put(&t, r.key, r.value, WriteFlags::UPSERT)?;
            }
        }
    }
    raise(OUTBOX_SEQ, last_outbox)?;
    // Dead letters keep their ids unless one is taken here; then all move, in order.
    letters.sort_by_key(|d| d.id);
    let mut taken = false;
    for d in &letters {
        taken |= tables.dead_letter(&d.tenant, d.id)?.is_some();
    }
    let mut renamed = Vec::new();
    for d in letters {
        let old = d.id;
        let new = if taken {
            tables.push_dead_letter(d)?.id
        } else {
            raise(DEADLETTER_ID, d.id)?;
            tables.put_dead_letter(&d)?;
            d.id
        };
        renamed.push((old, new));
    }
    for r in parked {
        let Some([tenant, saga, corr]) = parts::<3>(r.key) else {
            continue;
        };
        let old = u64_of(r.value, "parked")?;
        let new = renamed
            .iter()
            .find(|(o, _)| *o == old)
            .map_or(old, |(_, n)| *n);
        tables.park(tenant, saga, corr, new)?;
    }
    Ok(())
}

/// Splits `key` at its 0x00 separators into exactly `N` UTF-8 parts.
fn parts<const N: usize>(key: &[u8]) -> Option<[&str; N]> {
    let mut out = [""; N];
    let mut it = key.split(|b| *b == 0);
    for slot in &mut out {
        *slot = std::str::from_utf8(it.next()?).ok()?;
    }
    it.next().is_none().then_some(out)
}

/// The instance of a `saga` (or legacy `history`) row: the instance itself
/// (`t 0 saga 0 corr`) or one slot of its history ring (`t 0 saga 0 corr 0 slot:u64`).
fn instance_of_row(key: &[u8]) -> Option<[&str; 3]> {
    parts::<3>(key).or_else(|| {
        let stem = key.len().checked_sub(9)?;
        (key[stem] == 0).then(|| parts::<3>(&key[..stem]))?
    })
}

fn dead_letter(value: &[u8]) -> Result<DeadLetter, SnapshotError> {
    serde_json::from_slice(value).map_err(|e| corrupt(format!("dead letter: {e}")))
}

fn corrupt(why: String) -> SnapshotError {
    SnapshotError::Corrupt(why)
}

/// Checks the digest and reads the header and rows of a snapshot.
fn decode(bytes: &[u8]) -> Result<(SnapshotHeader, Vec<Row<'_>>), SnapshotError> {
    let Some(split) = bytes.len().checked_sub(DIGEST_LEN).filter(|n| *n > 0) else {
        return Err(corrupt(format!("{} bytes is too short", bytes.len())));
    };
    let (body, digest) = bytes.split_at(split);
    if Sha256::digest(body).as_slice() != digest {
        return Err(corrupt("SHA-256 digest does not match".into()));
    }
    let format = body[0];
    let Some(mut r) =
        Reader::open(body, FORMAT, "snapshot").or_else(|| Reader::open(body, FORMAT_1, "snapshot"))
    else {
        return Err(SnapshotError::Format(format));
    };
    let from_codec = |e: StorageError| match e {
        StorageError::Corrupt(why) => SnapshotError::Corrupt(why),
        other => SnapshotError::Storage(other),
    };
    if r.str().map_err(from_codec)? != MAGIC {
        return Err(corrupt("not a partition snapshot".into()));
    }
    let small = |n: u64| u32::try_from(n).map_err(|_| corrupt(format!("{n} is not a partition")));
    let header = SnapshotHeader {
        format,
        partition: small(r.u64().map_err(from_codec)?)?,
        partitions: small(r.u64().map_err(from_codec)?)?,
        checkpoint: r.u64().map_err(from_codec)?,
    };
    let mut rows = Vec::new();
    while !r.is_done() {
        let table = std::str::from_utf8(r.bytes().map_err(from_codec)?)
            .map_err(|_| corrupt("table name is not UTF-8".into()))?;
        let key = r.bytes().map_err(from_codec)?;
        let value = r.bytes().map_err(from_codec)?;
        if table == "outbox" && key.len() != 10 {
            return Err(corrupt("outbox key is not 10 bytes".into()));
        }
        if table == "dedupe" && format == FORMAT_1 {
            return Err(corrupt(
                "a format 1 snapshot holds no dedupe markers".into(),
            ));
        }
        rows.push(Row { table, key, value });
    }
    Ok((header, rows))
}

#[cfg(test)]
mod tests;
