//! The snapshots this replica takes of the partitions it holds (DESIGN §8.6): one on each
//! hand-over, and a round every `partitions.snapshot_interval` over every partition held.
//!
//! **What a round costs.** Exporting a partition reads every row of the store's snapshot
//! tables (rows are keyed by instance, not by partition), so a round exports the partitions
//! that are due together, in one pass over the tables per group, rather than one pass per
//! partition: with P partitions held that is P times fewer rows read. Likewise the old
//! snapshots are pruned from one listing of the bucket per round, not one per partition. A group holds
//! partitions whose last snapshots add up to at most [`GROUP_BYTES`] (a partition not yet
//! snapshotted here counts as its even part of the store's file, at least [`UNKNOWN_BYTES`]),
//! so a round's memory stays bounded however large the store.
//!
//! **What is due.** A partition is skipped when its newest snapshot is still exactly what it
//! holds for a successor: its checkpoint has not moved since that snapshot was exported, and
//! no write a successor could not redo has committed since (the store's count of unlogged
//! writes, `storage/write.rs`, is what it was just before that export). Writes that do not
//! count (outbox records deleted under the fence watermark, rows expired by age) leave rows
//! that a successor restoring the snapshot deletes itself. A skipped partition's snapshot
//! time (`runner_snapshot_last_timestamp_seconds`) is set as if it had been taken: a restore
//! from it replays nothing, so the alert on its age has nothing to warn of.
//!
//! **How often.** A round starts `partitions.snapshot_interval` after the last one started,
//! or later when rounds are dear: the next waits at least [`SPACING`] times as long as the
//! last one took ([`next_round_after`]), so rounds take at most a tenth of the node's time
//! whatever the store's size. On a small store that changes nothing; on one of a million
//! instances under steady load, where a round reads the whole store once per group and
//! uploads most of it, back-to-back rounds had cost a third of the node's throughput, and
//! spacing them lengthens the replay of a take-over instead (each round's length is
//! `runner_snapshot_round_seconds`).
//!
//! **Guarantees.** A partition is never skipped on a guess: the unlogged count is read
//! before the export's read transaction begins and counted after each commit, so any write
//! the export may have missed is counted above the value recorded with it, and the checkpoint
//! recorded is the one the snapshot itself holds. A failed upload records nothing (the
//! partition is due again next round). A hand-over always exports and uploads.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_nats::jetstream::object_store::ObjectStore;

use super::snapshot;
use crate::runtime::AppState;
use crate::storage::snapshot::{Partitioning, SnapshotHeader};

/// How many times as long as a round took the next one waits, at least, after its end: so
/// rounds take at most `1 / (1 + SPACING)` of the node's time, a tenth.
pub(super) const SPACING: u32 = 9;

/// When the round after one that took `took` may start, counted from that round's start:
/// `interval`, or [`SPACING`] times `took` past its end when that is later.
pub(super) fn next_round_after(interval: Duration, took: Duration) -> Duration {
    interval.max(took.saturating_add(took.saturating_mul(SPACING)))
}

/// Most snapshot bytes (estimated from each partition's last snapshot) one pass exports.
pub(super) const GROUP_BYTES: usize = 64 << 20;
/// The least a partition with no snapshot taken here yet is assumed to weigh.
pub(super) const UNKNOWN_BYTES: usize = 1 << 20;

/// The snapshots bucket, how partitions are cut, and what was last uploaded of each.
pub(super) struct Snap {
    pub(super) bucket: ObjectStore,
    pub(super) how: Partitioning,
    pub(super) keep: usize,
    uploaded: Mutex<Uploads>,
}

/// What was last uploaded of each partition held.
#[derive(Debug, Default)]
struct Uploads(HashMap<u32, Uploaded>);

/// The newest snapshot this replica uploaded of a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Uploaded {
    /// The checkpoint it holds.
    checkpoint: u64,
    /// The store's unlogged writes just before it was exported.
    unlogged: u64,
    /// Its size.
    bytes: usize,
}

impl Snap {
    pub(super) fn new(bucket: ObjectStore, how: Partitioning, keep: usize) -> Self {
        Self {
            bucket,
            how,
            keep,
            uploaded: Mutex::default(),
        }
    }

    /// Uploads a snapshot of partition `p` as it is committed now; failures are logged (the
    /// previous snapshot stays, and the heir replays a little more).
    pub(super) async fn upload(&self, state: &AppState, p: u32) -> Option<u64> {
        let stored = self.export_and_store(state, vec![p]).await.pop().flatten();
        if stored.is_some()
            && let Err(e) = snapshot::prune(&self.bucket, p, self.keep).await
        {
            tracing::warn!(message = "Old snapshots not pruned.", partition = p, error = %e);
        }
        stored
    }

    /// One round over `held` (exports and uploads each partition that is due, in groups);
    /// returns how long the next round waits from this one's start ([`next_round_after`]).
    pub(super) async fn round(&self, state: &AppState, held: &[u32]) -> Duration {
        let started = Instant::now();
        self.round_over(state, held).await;
        let took = started.elapsed();
        state
            .metrics
            .snapshot_round_seconds
            .observe(took.as_secs_f64());
        let next = next_round_after(state.config.partitions.snapshot_interval.get(), took);
        if next > state.config.partitions.snapshot_interval.get() {
            tracing::debug!(
                message = "Snapshot rounds spaced out: the last one was long.",
                took_ms = took.as_millis() as u64,
                next_in_ms = next.as_millis() as u64
            );
        }
        next
    }

    /// The work of [`Snap::round`].
    async fn round_over(&self, state: &AppState, held: &[u32]) {
        self.lock().0.retain(|p, _| held.contains(p));
        let unlogged = state.store.unlogged_writes();
        let how = self.how.clone();
        let ps = held.to_vec();
        let checkpoints = state
            .store
            .read(move |t| {
                ps.iter()
                    .map(|&p| t.checkpoint(&how.checkpoint_key(p)))
                    .collect::<crate::storage::Result<Vec<u64>>>()
            })
            .await;
        let checkpoints = match checkpoints {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(message = "Snapshot round skipped: the store could not be read.", error = %e);
                return;
            }
        };
        let (due, current) = self.lock().due(held, &checkpoints, unlogged);
        for p in current {
            note_current(state, p);
        }
        let file = std::fs::metadata(state.store.path().join("mdbx.dat")).map_or(0, |m| m.len());
        let share =
            usize::try_from(file / u64::from(self.how.partitions().max(1))).unwrap_or(usize::MAX);
        let groups = self.lock().groups(&due, share.max(UNKNOWN_BYTES));
        let mut stored = Vec::new();
        for group in groups {
            let out = self.export_and_store(state, group.clone()).await;
            stored.extend(group.into_iter().zip(out).filter_map(|(p, c)| c.map(|_| p)));
        }
        self.prune(&stored).await;
    }

    /// Deletes all but the newest `keep` snapshots of each of `ps`, from one listing of the
    /// bucket taken after their new snapshots were stored.
    async fn prune(&self, ps: &[u32]) {
        if ps.is_empty() {
            return;
        }
        let listed = match snapshot::listing(&self.bucket).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(message = "Old snapshots not pruned.", error = %e);
                return;
            }
        };
        for p in ps {
            let Some(checkpoints) = listed.get(p) else {
                continue;
            };
            if let Err(e) = snapshot::prune_listed(&self.bucket, *p, checkpoints, self.keep).await {
                tracing::warn!(message = "Old snapshots not pruned.", partition = p, error = %e);
            }
        }
    }

    /// Exports `ps` in one pass and stores each (no pruning); answers each one's checkpoint,
    /// or `None` where it failed (logged).
    async fn export_and_store(&self, state: &AppState, ps: Vec<u32>) -> Vec<Option<u64>> {
        let unlogged = state.store.unlogged_writes();
        let (store, how, asked) = (state.store.clone(), self.how.clone(), ps.clone());
        let exported = tokio::task::spawn_blocking(move || store.export_partitions(&how, &asked))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        let snaps = match exported {
            Ok(s) => s,
            Err(e) => {
                for p in &ps {
                    tracing::warn!(message = "Snapshot upload failed.", partition = p, error = %e);
                }
                return vec![None; ps.len()];
            }
        };
        let mut out = Vec::with_capacity(ps.len());
        for (p, bytes) in ps.into_iter().zip(snaps) {
            out.push(self.store(state, p, &bytes, unlogged).await);
        }
        out
    }

    /// Uploads one exported snapshot and records it.
    async fn store(&self, state: &AppState, p: u32, bytes: &[u8], unlogged: u64) -> Option<u64> {
        match snapshot::put(&self.bucket, bytes, &state.seal).await {
            Ok(SnapshotHeader { checkpoint, .. }) => {
                state.metrics.snapshots.inc();
                note_current(state, p);
                let up = Uploaded {
                    checkpoint,
                    unlogged,
                    bytes: bytes.len(),
                };
                self.lock().0.insert(p, up);
                tracing::debug!(message = "Snapshot uploaded.", partition = p, checkpoint);
                Some(checkpoint)
            }
            Err(e) => {
                self.lock().0.remove(&p);
                tracing::warn!(message = "Snapshot upload failed.", partition = p, error = %e);
                None
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Uploads> {
        self.uploaded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Uploads {
    /// Splits `held` into the partitions due for a snapshot and those whose last one is
    /// current.
    fn due(&self, held: &[u32], checkpoints: &[u64], unlogged: u64) -> (Vec<u32>, Vec<u32>) {
        let uploaded = &self.0;
        let (mut due, mut current) = (Vec::new(), Vec::new());
        for (&p, &checkpoint) in held.iter().zip(checkpoints) {
            let unchanged = uploaded
                .get(&p)
                .is_some_and(|u| u.checkpoint == checkpoint && u.unlogged == unlogged);
            if unchanged { &mut current } else { &mut due }.push(p);
        }
        (due, current)
    }

    /// `due` cut into groups of at most [`GROUP_BYTES`] by their last snapshots' sizes (`unknown`
    /// for a partition not snapshotted here yet).
    fn groups(&self, due: &[u32], unknown: usize) -> Vec<Vec<u32>> {
        let uploaded = &self.0;
        let mut groups: Vec<Vec<u32>> = Vec::new();
        let mut weight = 0;
        for &p in due {
            let w = uploaded.get(&p).map_or(unknown, |u| u.bytes);
            match groups.last_mut() {
                Some(g) if weight + w <= GROUP_BYTES => g.push(p),
                _ => {
                    groups.push(vec![p]);
                    weight = 0;
                }
            }
            weight += w;
        }
        groups
    }
}

/// Records that partition `p`'s newest snapshot holds what it holds now.
fn note_current(state: &AppState, p: u32) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    state
        .metrics
        .snapshot_last_timestamp
        .with_label_values(&[&p.to_string()])
        .set(now);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(checkpoint: u64, unlogged: u64, bytes: usize) -> Uploaded {
        Uploaded {
            checkpoint,
            unlogged,
            bytes,
        }
    }

    #[test]
    fn a_long_round_spaces_out_the_next_so_rounds_take_a_tenth_of_the_time() {
        let interval = Duration::from_secs(30);
        // Short rounds: the interval.
        assert_eq!(next_round_after(interval, Duration::ZERO), interval);
        assert_eq!(next_round_after(interval, Duration::from_secs(3)), interval);
        // A round of 12 s: the next starts 120 s after it started, 108 s after it ended.
        let next = next_round_after(interval, Duration::from_secs(12));
        assert_eq!(next, Duration::from_secs(120));
        // Whatever the round's length, it is a tenth of the time to the next start.
        for ms in [3_001u64, 7_777, 60_000, 3_600_000] {
            let took = Duration::from_millis(ms);
            let next = next_round_after(interval, took);
            assert_eq!(next, took * 10, "{ms} ms");
        }
        // An absurd length saturates rather than wrapping around to "at once".
        assert_eq!(next_round_after(interval, Duration::MAX), Duration::MAX);
    }

    #[test]
    fn a_partition_is_due_unless_neither_its_checkpoint_nor_an_unlogged_write_moved() {
        let u = Uploads(HashMap::from([(1, up(10, 3, 5)), (2, up(20, 3, 5))]));
        // 1 unchanged; 2's checkpoint moved; 3 never uploaded here.
        let (due, current) = u.due(&[1, 2, 3], &[10, 21, 0], 3);
        assert_eq!((due, current), (vec![2, 3], vec![1]));
        // An unlogged write since makes every partition due, moved or not.
        let (due, current) = u.due(&[1, 2], &[10, 20], 4);
        assert_eq!((due, current), (vec![1, 2], vec![]));
    }

    #[test]
    fn due_partitions_are_exported_together_up_to_the_byte_bound() {
        let u = Uploads(HashMap::from([
            (1, up(1, 0, GROUP_BYTES / 2)),
            (2, up(1, 0, GROUP_BYTES / 2)),
            (3, up(1, 0, GROUP_BYTES / 2)),
            (4, up(1, 0, GROUP_BYTES * 2)),
        ]));
        let unknown = UNKNOWN_BYTES;
        assert_eq!(
            u.groups(&[1, 2, 3, 4], unknown),
            vec![vec![1, 2], vec![3], vec![4]]
        );
        // Partitions never snapshotted here: one pass holds GROUP_BYTES / unknown of them.
        let many: Vec<u32> = (100..100 + 2 * (GROUP_BYTES / unknown) as u32).collect();
        let g = Uploads::default().groups(&many, unknown);
        assert_eq!(g.len(), 2);
        assert_eq!(g.concat(), many, "every partition once, in order");
        let big = Uploads::default().groups(&many, GROUP_BYTES / 4);
        assert_eq!(big.len(), many.len() / 4, "a large store: four per pass");
        assert!(Uploads::default().groups(&[], unknown).is_empty());
    }
}
