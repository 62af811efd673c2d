//! Partition snapshots in a JetStream Object Store: upload, keep the newest few, download,
//! restore (DESIGN §8.6). The owner of a partition (`worker/ownership/`) calls [`snapshot`]
//! every `partitions.snapshot_interval` and on hand-over; a new owner calls [`restore`] and
//! then replays SAGA_INBOX from the checkpoint it returns + 1, after checking
//! [`retention_gap`].
//!
//! **Objects.** The snapshot of partition `p` at checkpoint `N` (the bytes of
//! [`crate::storage::snapshot`]) is the object `p<p>/<N>` with `N` zero-padded to 20 digits,
//! so names sort as checkpoints do ([`object_name`]); its metadata repeats partition,
//! partition count, checkpoint and format for people. The bucket (default
//! [`DEFAULT_BUCKET`]) is a file-backed object store with `streams.replicas` replicas
//! ([`ensure_bucket`]).
//!
//! **Guarantees.**
//! - An uploaded snapshot is whole or absent: the object store publishes the chunks, then
//!   the object's meta with its SHA-256 digest, and the reader checks that digest; the
//!   snapshot carries its own digest too, checked again before anything is imported.
//! - [`upload`] keeps the newest [`DEFAULT_KEEP`] (or `keep`) snapshots of a partition and
//!   deletes older ones only after the new one is stored; the newest is never deleted.
//!   Older ones are the fall-back when the newest cannot be read.
//! - [`restore`] never moves a partition backwards: when the local checkpoint is at least
//!   the newest snapshot's, the local copy is kept (no download); otherwise the newest
//!   readable snapshot replaces the local copy whole, in one write transaction.
//! - Any holder may upload, even one that lost its lease meanwhile: a snapshot is a
//!   committed state of the partition's deterministic log at its checkpoint, so it is
//!   correct whoever took it.
//!
//! **What it costs.** A restore from a snapshot at checkpoint `N` replays every input of the
//! partition after `N`; those must still be in SAGA_INBOX. [`retention_gap`] says when they
//! may not be.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::{
    self,
    context::CreateKeyValueErrorKind,
    object_store::{self, ObjectMetadata, ObjectStore},
    stream::StorageType,
};
use futures::StreamExt;
use tokio::io::AsyncReadExt;

use crate::broker::BrokerError;
use crate::config::{Config, StreamStorage, StreamsConfig};
use crate::seal::Seal;
use crate::storage::Store;
use crate::storage::snapshot::{Partitioning, SnapshotError, SnapshotHeader};
use crate::worker::partition::partition;

pub use crate::storage::snapshot::partition_checkpoint_key;

/// The bucket name to use until configuration names one (`partitions.snapshot_bucket`).
pub const DEFAULT_BUCKET: &str = "RUNNER_SNAPSHOTS";
/// Snapshots kept per partition.
pub const DEFAULT_KEEP: usize = 3;

/// The deployment's partitioning: `partitions` partitions, instances placed by
/// [`partition`], checkpoints named from `consumers.saga` and `streams.saga_inbox`.
pub fn partitioning(config: &Config, partitions: u32) -> Partitioning {
    Partitioning::new(
        &config.consumers.saga,
        &config.streams.saga_inbox,
        partitions,
        partition,
    )
}

/// The object name of partition `p`'s snapshot at `checkpoint`: `p<p>/<checkpoint:020>`.
pub fn object_name(p: u32, checkpoint: u64) -> String {
    format!("p{p}/{checkpoint:020}")
}

/// The partition and checkpoint of an object name written by [`object_name`].
pub fn parse_object_name(name: &str) -> Option<(u32, u64)> {
    let (p, seq) = name.strip_prefix('p')?.split_once('/')?;
    let valid = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !valid(p) || seq.len() != 20 || !valid(seq) {
        return None;
    }
    Some((p.parse().ok()?, seq.parse().ok()?))
}

/// Errors moving snapshots between the store and the bucket.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The object store did not answer or failed; whether a write happened is unknown.
    #[error("snapshot bucket: {op} {object} failed: {reason}")]
    Bucket {
        /// What was tried.
        op: &'static str,
        /// The object (or partition prefix) concerned.
        object: String,
        /// Why.
        reason: String,
    },
    /// The snapshot could not be made, read or imported.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The blocking export or import task panicked or was cancelled.
    #[error("snapshot task failed: {0}")]
    Task(String),
    /// The snapshot cannot be genuine: its seal does not check against the deployment key,
    /// or its checkpoint lies past the inbox (`claims.rs`).
    #[error("snapshot {object} refused: {why}")]
    Refused {
        /// The object.
        object: String,
        /// Why.
        why: String,
    },
}

/// What a snapshot must pass before it is imported: a seal made with the deployment key
/// (when one is configured) and a checkpoint no further than the inbox's last sequence.
#[derive(Debug, Clone)]
pub struct Trust {
    /// The deployment key's seals.
    pub seal: Seal,
    /// The inbox's last sequence: a genuine checkpoint is never past it.
    pub inbox_last: u64,
}

impl Trust {
    /// Every snapshot that reads back intact (no key, no bound): tools and tests.
    pub fn any() -> Self {
        Self {
            seal: Seal::none(),
            inbox_last: u64::MAX,
        }
    }
}

/// The fields a snapshot's seal covers: its bytes, which name partition and checkpoint.
fn sealed_fields(bytes: &[u8]) -> [&[u8]; 2] {
    [b"runner-snapshot", bytes]
}

/// The object metadata key holding a snapshot's seal.
const SEAL_KEY: &str = "seal";

impl TransferError {
    /// Whether the snapshot's bytes are bad (an older snapshot may still serve).
    fn is_damage(&self) -> bool {
        matches!(
            self,
            Self::Snapshot(SnapshotError::Corrupt(_) | SnapshotError::Format(_))
        )
    }
}

fn bucket_error(op: &'static str, object: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Bucket {
        op,
        object: object.to_string(),
        reason: e.to_string(),
    }
}

/// Opens the snapshot bucket `bucket`, creating it when missing with the storage and the
/// replica count of `streams` (like the leases bucket, whatever `streams.create` says: it
/// is Runner's own). An existing bucket is used as it is.
pub async fn ensure_bucket(
    js: &jetstream::Context,
    bucket: &str,
    streams: &StreamsConfig,
) -> Result<ObjectStore, BrokerError> {
    if let Ok(store) = js.get_object_store(bucket).await {
        return Ok(store);
    }
    let config = object_store::Config {
        bucket: bucket.to_string(),
        description: Some("Runner partition snapshots: p<partition>/<checkpoint>".into()),
        storage: match streams.storage {
            StreamStorage::File => StorageType::File,
            StreamStorage::Memory => StorageType::Memory,
        },
        num_replicas: streams.replicas,
        ..Default::default()
    };
    let stream = format!("OBJ_{bucket}");
    match js.create_object_store(config).await {
        Ok(store) => {
            tracing::info!(message = "Created snapshot bucket.", bucket = %bucket);
            Ok(store)
        }
        Err(e) if e.kind() == CreateKeyValueErrorKind::InvalidStoreName => {
            Err(BrokerError::Refused {
                op: "create bucket",
                stream,
                reason: e.to_string(),
            })
        }
        // Another replica may have created it meanwhile.
        Err(e) => js
            .get_object_store(bucket)
            .await
            .map_err(|_| BrokerError::JetStream {
                op: "create bucket",
                stream,
                reason: e.to_string(),
            }),
    }
}

/// The checkpoints of partition `p`'s stored snapshots, oldest first.
pub async fn checkpoints(bucket: &ObjectStore, p: u32) -> Result<Vec<u64>, TransferError> {
    Ok(listing(bucket).await?.remove(&p).unwrap_or_default())
}

/// The checkpoints of every partition's stored snapshots, oldest first, from one listing of
/// the bucket.
pub async fn listing(bucket: &ObjectStore) -> Result<HashMap<u32, Vec<u64>>, TransferError> {
    let mut list = bucket
        .list()
        .await
        .map_err(|e| bucket_error("list", "p*/", e))?;
    let mut out: HashMap<u32, Vec<u64>> = HashMap::new();
    while let Some(info) = list.next().await {
        let info = info.map_err(|e| bucket_error("list", "p*/", e))?;
        if let Some((q, checkpoint)) = parse_object_name(&info.name) {
            out.entry(q).or_default().push(checkpoint);
        }
    }
    for c in out.values_mut() {
        c.sort_unstable();
    }
    Ok(out)
}

/// Stores the snapshot `bytes` under the name its header gives, sealed with `seal` (in its
/// metadata, when a key is configured), then deletes all but the newest `keep` (at least 1)
/// snapshots of its partition. Returns the header.
pub async fn upload(
    bucket: &ObjectStore,
    bytes: &[u8],
    keep: usize,
    seal: &Seal,
) -> Result<SnapshotHeader, TransferError> {
    let header = put(bucket, bytes, seal).await?;
    prune(bucket, header.partition, keep).await?;
    Ok(header)
}

/// [`upload`] without the pruning: the caller prunes, from one listing for many partitions
/// ([`listing`], [`prune_listed`]).
pub async fn put(
    bucket: &ObjectStore,
    bytes: &[u8],
    seal: &Seal,
) -> Result<SnapshotHeader, TransferError> {
    let header = SnapshotHeader::read(bytes)?;
    let name = object_name(header.partition, header.checkpoint);
    let mut metadata = HashMap::from([
        ("partition".to_string(), header.partition.to_string()),
        ("partitions".to_string(), header.partitions.to_string()),
        ("checkpoint".to_string(), header.checkpoint.to_string()),
        ("format".to_string(), header.format.to_string()),
    ]);
    if let Some(tag) = seal.seal(&sealed_fields(bytes)) {
        metadata.insert(SEAL_KEY.to_string(), tag);
    }
    let meta = ObjectMetadata {
        name: name.clone(),
        description: Some(format!(
            "Runner snapshot of partition {} at checkpoint {}",
            header.partition, header.checkpoint
        )),
        metadata,
        ..Default::default()
    };
    let mut reader = bytes;
    bucket
        .put(meta, &mut reader)
        .await
        .map_err(|e| bucket_error("put", &name, e))?;
    Ok(header)
}

/// Deletes all but the newest `keep` (at least 1) snapshots of partition `p`; returns how
/// many it deleted.
pub async fn prune(bucket: &ObjectStore, p: u32, keep: usize) -> Result<usize, TransferError> {
    prune_listed(bucket, p, &checkpoints(bucket, p).await?, keep).await
}

/// [`prune`] from `listed`, partition `p`'s checkpoints as a listing taken after its newest
/// snapshot was stored (oldest first).
pub async fn prune_listed(
    bucket: &ObjectStore,
    p: u32,
    listed: &[u64],
    keep: usize,
) -> Result<usize, TransferError> {
    let all = listed;
    let doomed = all.len().saturating_sub(keep.max(1));
    for &checkpoint in &all[..doomed] {
        let name = object_name(p, checkpoint);
        bucket
            .delete(&name)
            .await
            .map_err(|e| bucket_error("delete", &name, e))?;
    }
    Ok(doomed)
}

/// The snapshot of partition `p` at `checkpoint`, read whole and checked: the object
/// store's digest, the snapshot's own digest, that its header matches the name, and its
/// seal under `seal` ([`TransferError::Refused`] when a key is configured and the seal is
/// missing or wrong).
pub async fn download(
    bucket: &ObjectStore,
    p: u32,
    checkpoint: u64,
    seal: &Seal,
) -> Result<Vec<u8>, TransferError> {
    let name = object_name(p, checkpoint);
    let mut object = bucket
        .get(&name)
        .await
        .map_err(|e| bucket_error("get", &name, e))?;
    let mut bytes = Vec::with_capacity(object.info().size);
    if let Err(e) = object.read_to_end(&mut bytes).await {
        return Err(match e.kind() {
            std::io::ErrorKind::InvalidData => {
                SnapshotError::Corrupt(format!("{name}: {e}")).into()
            }
            _ => bucket_error("read", &name, e),
        });
    }
    let header = SnapshotHeader::read(&bytes)?;
    if (header.partition, header.checkpoint) != (p, checkpoint) {
        return Err(SnapshotError::Corrupt(format!(
            "{name} holds partition {} at checkpoint {}",
            header.partition, header.checkpoint
        ))
        .into());
    }
    let tag = object.info().metadata.get(SEAL_KEY).map(String::as_str);
    if let Err(e) = seal.check(&sealed_fields(&bytes), tag) {
        return Err(TransferError::Refused {
            object: name,
            why: e.to_string(),
        });
    }
    Ok(bytes)
}

/// The newest snapshot of partition `p`, as its checkpoint and bytes; `None` when there is
/// none.
pub async fn latest(
    bucket: &ObjectStore,
    p: u32,
    seal: &Seal,
) -> Result<Option<(u64, Vec<u8>)>, TransferError> {
    let Some(&newest) = checkpoints(bucket, p).await?.last() else {
        return Ok(None);
    };
    Ok(Some((newest, download(bucket, p, newest, seal).await?)))
}

/// Exports partition `p` from `store` (one read transaction, on a blocking thread) and
/// uploads it sealed with `seal`, keeping the newest `keep`. Returns the snapshot's
/// checkpoint.
pub async fn snapshot(
    store: &Store,
    bucket: &ObjectStore,
    how: &Partitioning,
    p: u32,
    keep: usize,
    seal: &Seal,
) -> Result<u64, TransferError> {
    let (store, how) = (store.clone(), how.clone());
    let bytes = tokio::task::spawn_blocking(move || store.export_partition(&how, p))
        .await
        .map_err(|e| TransferError::Task(e.to_string()))??;
    Ok(upload(bucket, &bytes, keep, seal).await?.checkpoint)
}

/// What [`restore`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restored {
    /// The partition's checkpoint now: replay SAGA_INBOX from this + 1.
    pub checkpoint: u64,
    /// Whether a snapshot was downloaded and imported (false: the local copy was kept).
    pub downloaded: bool,
    /// Snapshots newer than the local copy refused as not genuine ([`Trust`]), each logged.
    pub refused: u32,
}

/// Brings partition `p` of `store` up to the newest snapshot when the local copy is older:
/// keeps the local copy when its checkpoint is at least the newest snapshot's, otherwise
/// imports the newest snapshot that reads back intact (a damaged one is skipped, with a
/// warning, for the next older one that is still newer than the local copy; when none is,
/// the local copy is kept). A snapshot that fails `trust` is refused the same way, with an
/// error line, and counted in [`Restored::refused`]. Bucket failures are returned; nothing
/// is imported then.
pub async fn restore(
    store: &Store,
    bucket: &ObjectStore,
    how: &Partitioning,
    p: u32,
    trust: &Trust,
) -> Result<Restored, TransferError> {
    restore_handed_over(store, bucket, how, p, 0, Duration::ZERO, trust).await
}

/// [`restore`] for a partition handed over with the snapshot at `handed`: when the local
/// copy is older, the listing is read again (every 50 ms, for up to `within`) until it shows
/// a snapshot at `handed` or newer. A listing may come from a bucket replica that has not
/// applied the newest write yet; trusting the first one would restore an older snapshot and
/// replay what the hand-over meant to spare. Past `within` it restores what is listed, with
/// a warning.
pub async fn restore_handed_over(
    store: &Store,
    bucket: &ObjectStore,
    how: &Partitioning,
    p: u32,
    handed: u64,
    within: Duration,
    trust: &Trust,
) -> Result<Restored, TransferError> {
    let (s, h) = (store.clone(), how.clone());
    let local = tokio::task::spawn_blocking(move || s.partition_checkpoint(&h, p))
        .await
        .map_err(|e| TransferError::Task(e.to_string()))?
        .map_err(SnapshotError::from)?;
    let mut kept = Restored {
        checkpoint: local,
        downloaded: false,
        refused: 0,
    };
    let until = Instant::now() + within;
    let mut listed = checkpoints(bucket, p).await?;
    let mut reads = 1u32;
    while handed > local && listed.last().is_none_or(|&newest| newest < handed) {
        if Instant::now() >= until {
            tracing::warn!(message = "The hand-over snapshot is not listed; restoring an older one, inputs after it will be replayed.", partition = p, handed, newest = ?listed.last());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        listed = checkpoints(bucket, p).await?;
        reads += 1;
    }
    if reads > 1 {
        tracing::info!(
            message = "Snapshot listing read again until it showed the hand-over.",
            partition = p,
            handed,
            reads
        );
    }
    for checkpoint in listed.into_iter().rev() {
        if checkpoint <= local {
            break;
        }
        if checkpoint > trust.inbox_last {
            kept.refused += 1;
            tracing::error!(
                message = "Snapshot refused: its checkpoint lies past the inbox's last sequence, so it is forged or from another deployment. Trying an older one.",
                partition = p,
                checkpoint,
                inbox_last = trust.inbox_last
            );
            continue;
        }
        let imported = match download(bucket, p, checkpoint, &trust.seal).await {
            Ok(bytes) => {
                let (s, h) = (store.clone(), how.clone());
                tokio::task::spawn_blocking(move || s.import_partition(&h, p, &bytes))
                    .await
                    .map_err(|e| TransferError::Task(e.to_string()))?
                    .map_err(TransferError::from)
            }
            Err(e) => Err(e),
        };
        match imported {
            Ok(header) => {
                return Ok(Restored {
                    checkpoint: header.checkpoint,
                    downloaded: true,
                    refused: kept.refused,
                });
            }
            Err(e @ TransferError::Refused { .. }) => {
                kept.refused += 1;
                tracing::error!(message = "Snapshot refused, trying an older one.", partition = p, checkpoint, error = %e);
            }
            Err(e) if e.is_damage() => {
                tracing::warn!(message = "Snapshot unreadable, trying an older one.", partition = p, checkpoint, error = %e);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(kept)
}

/// Whether inputs needed to replay from `from_seq` + 1 may be gone from `stream`: true when
/// the stream's first sequence is past `from_seq + 1`. Conservative: the stream holds every
/// partition, so a partition that stayed idle while others' traffic aged out older messages
/// reads as a gap although none of its own inputs were lost.
pub async fn retention_gap(
    js: &jetstream::Context,
    stream: &str,
    from_seq: u64,
) -> Result<bool, BrokerError> {
    let s = stream_info(js, stream).await?;
    Ok(s.cached_info().state.first_sequence > from_seq.saturating_add(1))
}

/// `stream` as the server describes it now.
async fn stream_info(
    js: &jetstream::Context,
    stream: &str,
) -> Result<jetstream::stream::Stream, BrokerError> {
    js.get_stream(stream)
        .await
        .map_err(|e| BrokerError::JetStream {
            op: "stream info",
            stream: stream.to_string(),
            reason: e.to_string(),
        })
}

/// How long `stream` keeps messages (its `max_age`; zero: no age limit).
pub async fn retention_of(
    js: &jetstream::Context,
    stream: &str,
) -> Result<std::time::Duration, BrokerError> {
    let s = stream_info(js, stream).await?;
    Ok(s.cached_info().config.max_age)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names_sort_as_checkpoints_and_parse_back() {
        assert_eq!(object_name(3, 42), "p3/00000000000000000042");
        let mut names: Vec<String> = [1000, 9, 42, u64::MAX]
            .iter()
            .map(|c| object_name(7, *c))
            .collect();
        names.sort();
        let back: Vec<(u32, u64)> = names.iter().filter_map(|n| parse_object_name(n)).collect();
        assert_eq!(back, [(7, 9), (7, 42), (7, 1000), (7, u64::MAX)]);
        for bad in [
            "p3/42",
            "3/00000000000000000042",
            "p/00000000000000000042",
            "px/00000000000000000042",
            "p3/0000000000000000004x",
            "p3",
        ] {
            assert_eq!(parse_object_name(bad), None, "{bad}");
        }
    }
}
