//! Tests of the named tables, through a store opened in a temporary directory.

use super::*;
use crate::config::StorageConfig;

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

#[test]
fn a_held_key_keeps_the_letters_behind_it_in_order_one_row_each() {
    let (_dir, s) = temp_store();
    s.write_blocking(|t| {
        t.push_capped("acme", 1, 10)?;
        t.push_capped("acme", 1, 12)?;
        for id in [11, 13, 14] {
            let first = if id == 11 { 10 } else { 12 };
            assert!(t.behind_capped("acme", 1, first, id)?);
        }
        assert!(!t.behind_capped("acme", 1, 99, 100)?, "no such key queued");
        t.push_capped("acme", 2, 5)?;
        Ok(())
    })
    .expect("queue");
    s.read_blocking(|t| {
        let k = t.oldest_capped("acme", 1)?.expect("key 10");
        assert_eq!((k.first, k.behind), (10, vec![11]));
        let held = t.capped_by_tenant(|p| p == 1)?;
        assert_eq!(held["acme"].inputs, 5);
        assert_eq!(held["acme"].oldest, 10);
        Ok(())
    })
    .expect("read");
    s.write_blocking(|t| t.drop_capped("acme", 1, 10))
        .expect("drop");
    s.read_blocking(|t| {
        let k = t.oldest_capped("acme", 1)?.expect("key 12");
        assert_eq!((k.first, k.behind), (12, vec![13, 14]));
        assert_eq!(t.oldest_capped("acme", 2)?.map(|k| k.first), Some(5));
        assert!(t.oldest_capped("acme", 3)?.is_none());
        Ok(())
    })
    .expect("read");
}
