//! Partition snapshots against real libmdbx stores in temporary directories.

use std::collections::BTreeMap;

use super::*;
use crate::config::StorageConfig;
use crate::saga::{Instance, Status};
use crate::storage::tables::{Counted, HistoryEntry, OutboxRecord, TenantCounts, TimerEntry};

/// Places `o-<n>` in partition `n mod partitions` (readable in tests; the deployment's
/// function is the server's FNV hash, which lives above the storage layer).
fn by_last_digit(_tenant: &str, _saga: &str, corr: &str, partitions: u32) -> u32 {
    corr.bytes()
        .last()
        .map_or(0, |b| u32::from(b.wrapping_sub(b'0')))
        % partitions
}

fn how(partitions: u32) -> Partitioning {
    Partitioning::new("saga", "SAGA_INBOX", partitions, by_last_digit)
}

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = StorageConfig {
        data_dir: dir.path().to_path_buf(),
        ..StorageConfig::default()
    };
    let store = Store::open(&cfg).expect("opens");
    (dir, store)
}

/// Writes instance `corr` in state `state` with three history entries, a timer, an outbox
/// record in its partition, a dedupe marker that records its partition (`<corr>-e1`) and one
/// as older versions wrote them (`<corr>-old`); `dead` also dead-letters and parks it.
fn fill(store: &Store, corr: &str, state: &str, dead: bool) {
    let p = by_last_digit("acme", "order", corr, 4) as u16;
    store
        .write_blocking(|t| {
            let before = t.instance("acme", "order", corr)?.map(|i| i.state);
            t.put_instance(
                &Instance {
                    tenant: "acme".into(),
                    saga: "order".into(),
                    version: 1,
                    correlation_id: corr.into(),
                    state: state.into(),
                    status: Status::Running,
                    data: serde_json::json!({ "corr": corr }),
                    timers: BTreeMap::new(),
                    progress: None,
                    started_ms: 1,
                    updated_ms: 2,
                    applied: 3,
                    awaiting: None,
                },
                before.as_deref(),
            )?;
            for n in 1..=3 {
                let e = HistoryEntry {
                    n,
                    event: format!("{state}{n}"),
                    event_id: format!("{corr}-e{n}"),
                    from: String::new(),
                    to: state.into(),
                    at_ms: n,
                    source: format!("SAGA_INBOX:{n}"),
                    emitted: 1,
                };
                t.push_history("acme", "order", corr, &e)?;
            }
            t.put_timer(&TimerEntry {
                tenant: "acme".into(),
                saga: "order".into(),
                correlation_id: corr.into(),
                name: format!("{state}-timeout"),
                timer_id: format!("{corr}-t"),
                due_ms: 1000,
            })?;
            t.push_outbox(
                p,
                &OutboxRecord {
                    subject: format!("tenant.acme.effect.charge.{corr}"),
                    msg_id: format!("{corr}:{state}"),
                    tenant: "acme".into(),
                    traceparent: None,
                    body: "{}".into(),
                    cause: (7, 1),
                },
            )?;
            let place = crate::storage::tables::dedupe::MarkerPlace {
                partition: u32::from(p),
                partitions: 4,
            };
            t.mark_applied_to("acme", "order", &format!("{corr}-e1"), corr, 10, place)?;
            t.mark_applied("acme", "order", &format!("{corr}-old"), 10)?;
            if dead {
                let dl = t.push_dead_letter(DeadLetter::sample(Some(corr), "expression"))?;
                t.park("acme", "order", corr, dl.id)?;
            }
            Ok(())
        })
        .expect("fill");
}

fn set_checkpoint(store: &Store, p: u32, seq: u64) {
    store
        .write_blocking(|t| t.set_checkpoint(&how(4).checkpoint_key(p), seq))
        .expect("checkpoint");
}

/// A store with instances o-0 … o-7 (two per partition of 4), o-1 dead-lettered, a dead
/// letter that names no instance, and checkpoints for partitions 1 and 2.
fn source() -> (tempfile::TempDir, Store) {
    let (dir, a) = store();
    for n in 0..8 {
        fill(&a, &format!("o-{n}"), "paid", n == 1);
    }
    a.write_blocking(|t| {
        t.push_dead_letter(DeadLetter::sample(None, "undecodable"))
            .map(drop)
    })
    .expect("dl");
    set_checkpoint(&a, 1, 42);
    set_checkpoint(&a, 2, 7);
    (dir, a)
}

#[test]
fn export_then_import_reproduces_the_partition() {
    let (_a_dir, a) = source();
    let snap = a.export_partition(&how(4), 1).expect("export");
    let header = SnapshotHeader::read(&snap).expect("header");
    assert_eq!(
        header,
        SnapshotHeader {
            format: FORMAT,
            partition: 1,
            partitions: 4,
            checkpoint: 42
        }
    );
    let (_b_dir, b) = store();
    assert_eq!(
        b.import_partition(&how(4), 1, &snap).expect("import"),
        header
    );
    // Exports are deterministic: the same bytes mean the same rows.
    assert_eq!(b.export_partition(&how(4), 1).expect("re-export"), snap);
    assert_eq!(b.partition_checkpoint(&how(4), 1).expect("cp"), 42);
    assert_eq!(b.partition_checkpoint(&how(4), 2).expect("cp"), 0);
    b.read_blocking(|t| {
        let corrs: Vec<String> = t
            .instances()?
            .into_iter()
            .map(|i| i.correlation_id)
            .collect();
        assert_eq!(corrs, ["o-1", "o-5"]);
        assert_eq!(
            t.history("acme", "order", "o-5")?,
            a.read_blocking(|ta| ta.history("acme", "order", "o-5"))?
        );
        assert_eq!(t.history("acme", "order", "o-5")?.len(), 3);
        assert_eq!(t.timers_of("acme", "order", "o-1")?.len(), 1);
        assert_eq!(t.timers_pending()?, 2);
        assert_eq!(
            t.outbox_batch(1, 0, 100)?,
            a.read_blocking(|ta| ta.outbox_batch(1, 0, 100))?
        );
        assert_eq!(t.outbox_depth()?, 2);
        let dls = t.dead_letters()?;
        assert_eq!(dls.len(), 1, "only the dead letter of an instance in p1");
        assert_eq!(dls[0].correlation_id.as_deref(), Some("o-1"));
        assert_eq!(t.parked_by("acme", "order", "o-1")?, Some(dls[0].id));
        // The partition's dedupe markers travel with it: an event applied before the
        // checkpoint and published again after it is still seen as applied.
        assert!(t.is_applied("acme", "order", "o-1-e1")?);
        assert!(t.is_applied("acme", "order", "o-5-e1")?);
        assert!(
            !t.is_applied("acme", "order", "o-2-e1")?,
            "p2's markers stay"
        );
        // Markers that do not record their partition stay where they were written.
        assert!(!t.is_applied("acme", "order", "o-1-old")?);
        Ok(())
    })
    .expect("read");
    // The same pass exports several partitions, each as it would alone.
    let both = a.export_partitions(&how(4), &[2, 1]).expect("two");
    assert_eq!(both[1], snap);
    assert_eq!(both[0], a.export_partition(&how(4), 2).expect("p2"));
}

#[test]
fn import_replaces_a_stale_copy_and_leaves_other_partitions_alone() {
    let (_a_dir, a) = source();
    let snap = a.export_partition(&how(4), 1).expect("export");
    let (_b_dir, b) = store();
    // A stale copy of p1: o-1 in an older state, o-9 that p1 no longer has, its own dead
    // letter, timers, outbox records and a checkpoint; and partitions 2 and 3.
    fill(&b, "o-1", "new", false);
    fill(&b, "o-9", "new", true);
    fill(&b, "o-2", "other", false);
    fill(&b, "o-3", "other", false);
    set_checkpoint(&b, 1, 99);
    set_checkpoint(&b, 2, 5);
    let others = b.export_partitions(&how(4), &[0, 2, 3]).expect("others");
    b.import_partition(&how(4), 1, &snap).expect("import");
    assert_eq!(b.export_partition(&how(4), 1).expect("p1"), snap);
    assert_eq!(
        b.export_partitions(&how(4), &[0, 2, 3]).expect("others"),
        others
    );
    b.read_blocking(|t| {
        assert!(t.instance("acme", "order", "o-9")?.is_none());
        assert!(t.history("acme", "order", "o-9")?.is_empty());
        assert!(t.timers_of("acme", "order", "o-9")?.is_empty());
        assert_eq!(t.parked_by("acme", "order", "o-9")?, None);
        assert_eq!(
            t.instance("acme", "order", "o-1")?
                .map(|i| i.state)
                .as_deref(),
            Some("paid")
        );
        assert_eq!(t.timers_of("acme", "order", "o-1")?[0].name, "paid-timeout");
        // The instance index follows the import: p1 as imported, the other partitions as
        // they were.
        let list = |state: Option<&str>| -> crate::storage::error::Result<Vec<String>> {
            let q = crate::storage::tables::InstanceQuery {
                tenant: "acme".into(),
                saga: "order".into(),
                state: state.map(str::to_string),
                started_before_ms: None,
                after: None,
                limit: 100,
            };
            Ok(t.list_instances(&q)?
                .items
                .into_iter()
                .map(|i| i.correlation_id)
                .collect())
        };
        assert_eq!(
            list(Some("new"))?,
            Vec::<String>::new(),
            "stale p1 states are gone"
        );
        assert_eq!(list(Some("paid"))?, ["o-1", "o-5"]);
        assert_eq!(list(Some("other"))?, ["o-2", "o-3"]);
        assert_eq!(list(None)?.len(), 4);
        // p1's markers are the snapshot's: the stale copy's are gone with its state (o-9's
        // event would otherwise count as applied to an instance this store no longer has).
        assert!(!t.is_applied("acme", "order", "o-9-e1")?);
        assert!(t.is_applied("acme", "order", "o-5-e1")?);
        // Markers of other partitions, and markers that record no partition, stay.
        assert!(t.is_applied("acme", "order", "o-2-e1")?);
        assert!(t.is_applied("acme", "order", "o-9-old")?);
        Ok(())
    })
    .expect("read");
    assert_eq!(b.partition_checkpoint(&how(4), 1).expect("cp"), 42);
    assert_eq!(b.partition_checkpoint(&how(4), 2).expect("cp"), 5);
    // The outbox counter moved above every imported sequence.
    let imported = b
        .read_blocking(|t| t.outbox_batch(1, 0, 100))
        .expect("outbox");
    let last = imported.iter().map(|(s, _)| *s).max().expect("some");
    let rec = imported[0].1.clone();
    let next = b.write_blocking(|t| t.push_outbox(1, &rec)).expect("push");
    assert!(next > last, "{next} > {last}");
}

#[test]
fn colliding_dead_letter_ids_are_renumbered_in_order() {
    let (_a_dir, a) = store();
    fill(&a, "o-1", "paid", true);
    a.write_blocking(|t| {
        t.push_dead_letter(DeadLetter::sample(Some("o-1"), "parked"))
            .map(drop)
    })
    .expect("held");
    let snap = a.export_partition(&how(4), 1).expect("export");
    let (_b_dir, b) = store();
    fill(&b, "o-2", "other", true);
    b.import_partition(&how(4), 1, &snap).expect("import");
    b.read_blocking(|t| {
        let dls = t.dead_letters()?;
        let ids: Vec<(Option<&str>, &str, u64)> = dls
            .iter()
            .map(|d| (d.correlation_id.as_deref(), d.kind.as_str(), d.id))
            .collect();
        assert_eq!(
            ids,
            [
                (Some("o-2"), "expression", 1),
                (Some("o-1"), "expression", 2),
                (Some("o-1"), "parked", 3)
            ]
        );
        assert_eq!(t.parked_by("acme", "order", "o-1")?, Some(2));
        assert_eq!(t.parked_by("acme", "order", "o-2")?, Some(1));
        Ok(())
    })
    .expect("read");
    let next = b
        .write_blocking(|t| t.push_dead_letter(DeadLetter::sample(None, "undecodable")))
        .expect("push");
    assert_eq!(next.id, 4);
}

#[test]
fn foreign_or_damaged_snapshots_are_refused_and_change_nothing() {
    let (_a_dir, a) = source();
    let snap = a.export_partition(&how(4), 1).expect("export");
    let (_b_dir, b) = store();
    fill(&b, "o-5", "mine", false);
    let before = b.export_partition(&how(4), 1).expect("before");
    let refused = |p: u32, how: &Partitioning, bytes: &[u8]| {
        b.import_partition(how, p, bytes).expect_err("refused")
    };
    assert!(matches!(
        refused(1, &how(8), &snap),
        SnapshotError::PartitionCount {
            snapshot: 4,
            local: 8
        }
    ));
    assert!(matches!(
        refused(2, &how(4), &snap),
        SnapshotError::WrongPartition {
            snapshot: 1,
            wanted: 2
        }
    ));
    assert!(matches!(
        refused(4, &how(4), &snap),
        SnapshotError::OutOfRange {
            partition: 4,
            partitions: 4
        }
    ));
    let mut flipped = snap.clone();
    flipped[snap.len() / 2] ^= 0x40;
    assert!(matches!(
        refused(1, &how(4), &flipped),
        SnapshotError::Corrupt(_)
    ));
    assert!(matches!(
        refused(1, &how(4), &snap[..snap.len() - 1]),
        SnapshotError::Corrupt(_)
    ));
    assert!(matches!(
        refused(1, &how(4), b""),
        SnapshotError::Corrupt(_)
    ));
    // A later format, intact: named as such, not as damage.
    let mut later = snap[..snap.len() - DIGEST_LEN].to_vec();
    later[0] = FORMAT + 1;
    let digest = Sha256::digest(&later);
    later.extend_from_slice(&digest);
    assert!(matches!(
        refused(1, &how(4), &later),
        SnapshotError::Format(f) if f == FORMAT + 1
    ));
    // Rows placed by another partition function do not belong to partition 1 here.
    let reversed = |t: &str, s: &str, c: &str, n: u32| n - 1 - by_last_digit(t, s, c, n);
    let elsewhere = Partitioning::new("saga", "SAGA_INBOX", 4, reversed);
    let foreign = a.export_partition(&elsewhere, 1).expect("foreign");
    assert!(matches!(
        refused(1, &how(4), &foreign),
        SnapshotError::Corrupt(_)
    ));
    assert_eq!(b.export_partition(&how(4), 1).expect("after"), before);
}

#[test]
fn rows_are_placed_by_their_instance_key() {
    let ring = {
        let mut k = b"acme\0order\0o-1\0".to_vec();
        k.extend_from_slice(&7u64.to_be_bytes());
        k
    };
    assert_eq!(
        instance_of_row(b"acme\0order\0o-1"),
        Some(["acme", "order", "o-1"])
    );
    assert_eq!(instance_of_row(&ring), Some(["acme", "order", "o-1"]));
    assert_eq!(instance_of_row(b"acme\0order"), None);
    assert_eq!(instance_of_row(b"x"), None);
    assert_eq!(parts::<3>(b"a\0b\0c\0d"), None);
    assert_eq!(
        partition_checkpoint_key("saga", "SAGA_INBOX", 17),
        "saga:SAGA_INBOX:17"
    );
}

#[test]
fn a_format_1_snapshot_is_still_read_and_may_not_hold_markers() {
    let body = |rows: &[(&str, &[u8], &[u8])]| {
        let mut w = Writer::new(FORMAT_1, 256);
        w.str(MAGIC).u64(1).u64(4).u64(9);
        for (table, key, value) in rows {
            w.str(table).bytes(key).bytes(value);
        }
        let mut bytes = w.finish();
        let digest = Sha256::digest(&bytes);
        bytes.extend_from_slice(&digest);
        bytes
    };
    let (_dir, s) = store();
    let header = s
        .import_partition(&how(4), 1, &body(&[]))
        .expect("format 1 reads");
    assert_eq!((header.format, header.checkpoint), (1, 9));
    assert_eq!(s.partition_checkpoint(&how(4), 1).expect("cp"), 9);
    // A marker row in a format 1 snapshot is not something that version wrote.
    let mut marker = [0u8; 24];
    marker[16..20].copy_from_slice(&1u32.to_be_bytes());
    marker[20..].copy_from_slice(&4u32.to_be_bytes());
    let forged = body(&[("dedupe", b"acme\0order\0e1", &marker)]);
    assert!(matches!(
        s.import_partition(&how(4), 1, &forged),
        Err(SnapshotError::Corrupt(_))
    ));
}

#[test]
fn writes_a_successor_could_not_redo_are_counted_and_the_others_are_not() {
    let (_a_dir, a) = source();
    let snap = a.export_partition(&how(4), 1).expect("export");
    let (_b_dir, b) = store();
    let counted = |s: &Store| s.unlogged_writes();
    let start = counted(&b);
    // Applying a partition's log (it moves the checkpoint) is not counted.
    b.write_logged_blocking(|t| t.set_checkpoint("p", 1))
        .expect("logged");
    assert_eq!(counted(&b), start);
    // Any other write is, once committed; a failed one is not.
    b.write_blocking(|t| t.set_checkpoint("x", 1))
        .expect("unlogged");
    assert_eq!(counted(&b), start + 1);
    let failed: crate::storage::Result<()> =
        b.write_blocking(|_| Err(StorageError::Task("no".into())));
    assert!(failed.is_err());
    assert_eq!(counted(&b), start + 1);
    // An import replaces a partition whole.
    b.import_partition(&how(4), 1, &snap).expect("import");
    assert_eq!(counted(&b), start + 2);
}

#[test]
fn running_instances_and_timers_are_counted_once_and_again_for_an_imported_partition() {
    // `fill` writes instances as an older store did, without counting them.
    let (_a_dir, a) = source();
    let of = |t: &str, s: &str, c: &str| by_last_digit(t, s, c, 4);
    let counted = a
        .write_blocking(|t| t.count_if_missing(4, of))
        .expect("count");
    assert_eq!(counted, Some(8), "o-0 … o-7 run");
    assert_eq!(
        a.write_blocking(|t| t.count_if_missing(4, of))
            .expect("again"),
        None,
        "counted once for four partitions"
    );
    // A partition's pending timers, as its schedule rows show them.
    let rows = |t: &Tables<'_, _>, p: u32| -> crate::storage::Result<u64> {
        Ok(t.due_timers(u64::MAX, usize::MAX)?
            .iter()
            .filter(|e| of(&e.tenant, &e.saga, &e.correlation_id) == p)
            .count() as u64)
    };
    a.read_blocking(|t| {
        for p in 0..4 {
            assert_eq!(t.live("acme", p)?, 2, "two per partition");
            let timers = t.counted("acme", p, Counted::Timers)?;
            assert!(timers > 0, "fill sets timers, which are counted");
            assert_eq!(timers, rows(t, p)?, "p{p}'s timers");
        }
        assert_eq!(t.live("other", 0)?, 0);
        Ok(())
    })
    .expect("read");
    // o-5 completes (the saga worker moves the count with the write), then p1 is exported.
    a.write_blocking(|t| {
        let mut i = t.instance("acme", "order", "o-5")?.expect("o-5");
        let before = i.status;
        i.status = Status::Completed;
        t.put_instance(&i, Some(i.state.as_str()))?;
        t.count_live("acme", 1, Some(before), i.status)
    })
    .expect("complete");
    assert_eq!(a.read_blocking(|t| t.live("acme", 1)).expect("p1"), 1);
    let snap = a.export_partition(&how(4), 1).expect("export");
    // A stale copy of p1 with three running instances, and p2's own count, on the importer.
    let (_b_dir, b) = store();
    for corr in ["o-1", "o-9", "o-2"] {
        fill(&b, corr, "new", false);
    }
    b.write_blocking(|t| t.count_if_missing(4, of))
        .expect("count");
    assert_eq!(b.read_blocking(|t| t.live("acme", 1)).expect("p1"), 2);
    b.import_partition(&how(4), 1, &snap).expect("import");
    b.read_blocking(|t| {
        assert_eq!(t.live("acme", 1)?, 1, "o-1 runs, o-5 completed, o-9 gone");
        assert_eq!(t.live("acme", 2)?, 1, "p2 untouched");
        for p in [1, 2] {
            assert_eq!(
                t.counted("acme", p, Counted::Timers)?,
                rows(t, p)?,
                "p{p}'s timers"
            );
        }
        let timers = rows(t, 1)? + rows(t, 2)?;
        assert_eq!(
            t.counts_by_tenant(|p| p == 1 || p == 2)?,
            BTreeMap::from([("acme".to_string(), TenantCounts { live: 2, timers })])
        );
        Ok(())
    })
    .expect("read");
}

#[test]
fn a_partitions_queue_of_keys_held_at_a_cap_is_remade_where_it_is_imported() {
    let (_a_dir, a) = store();
    // o-1 and o-5 (partition 1) held at a cap, o-5 with a second input behind it; o-2
    // (partition 2) too.
    let mut held = BTreeMap::new();
    a.write_blocking(|t| {
        for corr in ["o-5", "o-1", "o-5", "o-2"] {
            let mut d = DeadLetter::sample(Some(corr), "tenant_capped");
            d.live_cap = Some(3);
            let id = t.push_dead_letter(d)?.id;
            let p = by_last_digit("acme", "order", corr, 4);
            match t.parked_by("acme", "order", corr)? {
                None => {
                    t.park("acme", "order", corr, id)?;
                    t.push_capped("acme", p, id)?;
                    held.insert(corr, id);
                }
                Some(first) => {
                    t.behind_capped("acme", p, first, id)?;
                }
            }
        }
        Ok(())
    })
    .expect("hold");
    let first = a
        .read_blocking(|t| t.oldest_capped("acme", 1))
        .expect("read")
        .expect("o-5's key");
    assert_eq!(first.first, held["o-5"]);
    assert_eq!(first.behind.len(), 1);
    let snap = a.export_partition(&how(4), 1).expect("export");
    let (_b_dir, b) = store();
    // The importer holds letters of its own, so the imported ones are renumbered.
    b.write_blocking(|t| {
        for _ in 0..5 {
            t.push_dead_letter(DeadLetter::sample(None, "undecodable"))?;
        }
        Ok(())
    })
    .expect("own letters");
    b.import_partition(&how(4), 1, &snap).expect("import");
    b.read_blocking(|t| {
        let k = t.oldest_capped("acme", 1)?.expect("o-5's key, first held");
        let d = t.dead_letter("acme", k.first)?.expect("its letter");
        assert_eq!(d.correlation_id.as_deref(), Some("o-5"));
        assert_eq!(d.live_cap, Some(3));
        assert_eq!(t.parked_by("acme", "order", "o-5")?, Some(k.first));
        assert_eq!(k.behind.len(), 1);
        let behind = t.dead_letter("acme", k.behind[0])?.expect("held behind");
        assert_eq!(behind.correlation_id.as_deref(), Some("o-5"));
        assert!(t.oldest_capped("acme", 2)?.is_none(), "p2 was not imported");
        let held = t.capped_by_tenant(|p| p == 1)?;
        assert_eq!(held.len(), 1);
        assert_eq!(held["acme"].inputs, 3, "o-5, the input behind it, and o-1");
        assert_eq!(held["acme"].oldest, k.first);
        Ok(())
    })
    .expect("read");
}
