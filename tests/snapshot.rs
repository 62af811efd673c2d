//! `runner::worker::ownership::snapshot` against a real nats-server: partition snapshots taken from a
//! libmdbx store, kept in a JetStream Object Store, restored into another store.
//!
//! What it must keep: a store restored from a snapshot holds exactly the partition it was
//! taken of (it exports the same bytes) and nothing of other partitions; only the newest
//! few snapshots of a partition stay, never without the newest, and other partitions'
//! snapshots are untouched; a local copy at least as new as the newest snapshot is kept; a
//! heir handed a partition at a snapshot waits until the listing shows it; a
//! damaged newest snapshot gives way to the next older one; the retention check reports a
//! gap exactly when the input after the checkpoint has left the stream.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::object_store::ObjectStore;
use async_nats::jetstream::stream;
use common::{NatsServer, jetstream};
use runner::config::{Config, StreamsConfig};
use runner::saga::{Instance, Status};
use runner::seal::Seal;
use runner::storage::Store;
use runner::storage::snapshot::{Partitioning, SnapshotHeader};
use runner::storage::tables::{HistoryEntry, OutboxRecord, TimerEntry};
use runner::worker::ownership::snapshot::{
    Restored, TransferError, Trust, checkpoints, download, ensure_bucket, latest, object_name,
    partitioning, restore, restore_handed_over, retention_gap, snapshot, upload,
};
use runner::worker::partition::partition;

const P: u32 = 8;

fn how() -> Partitioning {
    partitioning(&Config::default(), P)
}

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = common::open_store(dir.path());
    (dir, store)
}

async fn bucket(server: &NatsServer) -> ObjectStore {
    let js = jetstream(&server.url()).await;
    ensure_bucket(&js, "SNAPS", &StreamsConfig::default())
        .await
        .unwrap()
}

/// Writes instances `o-0` … `o-<n-1>` in state `state`, each with history, a timer and an
/// outbox record in its partition.
fn fill(store: &Store, n: usize, state: &str) {
    let state = state.to_string();
    store
        .write_blocking(|t| {
            for i in 0..n {
                let corr = format!("o-{i}");
                let p = partition("acme", "order", &corr, P) as u16;
                t.put_instance(
                    &Instance {
                        tenant: "acme".into(),
                        saga: "order".into(),
                        version: 1,
                        correlation_id: corr.clone(),
                        state: state.clone(),
                        status: Status::Running,
                        data: serde_json::json!({ "i": i }),
                        timers: BTreeMap::new(),
                        progress: None,
                        started_ms: 1,
                        updated_ms: 2,
                        applied: 1,
                        awaiting: None,
                    },
                    None,
                )?;
                let entry = HistoryEntry {
                    n: 1,
                    event: "OrderPlaced".into(),
                    event_id: format!("{corr}-e1"),
                    from: String::new(),
                    to: state.clone(),
                    at_ms: 2,
                    source: "SAGA_INBOX:1".into(),
                    emitted: 1,
                };
                t.push_history("acme", "order", &corr, &entry)?;
                t.put_timer(&TimerEntry {
                    tenant: "acme".into(),
                    saga: "order".into(),
                    correlation_id: corr.clone(),
                    name: "expire".into(),
                    timer_id: format!("{corr}-t"),
                    due_ms: 10_000 + i as u64,
                })?;
                t.push_outbox(
                    p,
                    &OutboxRecord {
                        subject: format!("tenant.acme.effect.charge.{corr}"),
                        msg_id: format!("{p}:{i}:0"),
                        tenant: "acme".into(),
                        traceparent: None,
                        body: format!("{{\"i\":{i}}}"),
                        cause: (1, 1),
                    },
                )?;
            }
            Ok(())
        })
        .unwrap();
}

fn set_checkpoint(store: &Store, p: u32, seq: u64) {
    store
        .write_blocking(|t| t.set_checkpoint(&how().checkpoint_key(p), seq))
        .unwrap();
}

/// A snapshot of `p` at `checkpoint` from a store holding 40 instances.
fn snapshot_bytes(p: u32, checkpoint: u64) -> Vec<u8> {
    let (_dir, a) = store();
    fill(&a, 40, "paid");
    set_checkpoint(&a, p, checkpoint);
    a.export_partition(&how(), p).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_store_holds_exactly_the_snapshotted_partition() {
    let server = NatsServer::start();
    let bucket = bucket(&server).await;
    let (_a_dir, a) = store();
    fill(&a, 40, "paid");
    let p = partition("acme", "order", "o-0", P);
    set_checkpoint(&a, p, 1234);
    set_checkpoint(&a, (p + 1) % P, 99);
    assert_eq!(
        snapshot(&a, &bucket, &how(), p, 3, &Seal::none())
            .await
            .unwrap(),
        1234
    );
    let original = a.export_partition(&how(), p).unwrap();
    let (seq, bytes) = latest(&bucket, p, &Seal::none()).await.unwrap().unwrap();
    assert_eq!((seq, &bytes), (1234, &original));

    let (_b_dir, b) = store();
    let restored = restore(&b, &bucket, &how(), p, &Trust::any())
        .await
        .unwrap();
    assert_eq!(
        restored,
        Restored {
            checkpoint: 1234,
            downloaded: true,
            refused: 0,
        }
    );
    assert_eq!(b.export_partition(&how(), p).unwrap(), original);
    assert_eq!(b.partition_checkpoint(&how(), p).unwrap(), 1234);
    let (_e_dir, empty) = store();
    for q in (0..P).filter(|q| *q != p) {
        assert_eq!(
            b.export_partition(&how(), q).unwrap(),
            empty.export_partition(&how(), q).unwrap(),
            "partition {q} must stay empty"
        );
    }
    let mine: Vec<String> = (0..40)
        .map(|i| format!("o-{i}"))
        .filter(|c| partition("acme", "order", c, P) == p)
        .collect();
    assert!(mine.len() > 1, "the test needs several instances in {p}");
    let held: Vec<String> = b
        .read_blocking(|t| t.instances())
        .unwrap()
        .into_iter()
        .map(|i| i.correlation_id)
        .collect();
    let mut sorted = mine.clone();
    sorted.sort();
    assert_eq!(held, sorted);
    for corr in &mine {
        let (want, got) = (
            a.read_blocking(|t| t.history("acme", "order", corr))
                .unwrap(),
            b.read_blocking(|t| t.history("acme", "order", corr))
                .unwrap(),
        );
        assert_eq!(got, want, "history of {corr}");
        assert_eq!(
            b.read_blocking(|t| t.timers_of("acme", "order", corr))
                .unwrap()
                .len(),
            1
        );
    }
    assert_eq!(
        b.read_blocking(|t| t.outbox_batch(p as u16, 0, 1000))
            .unwrap(),
        a.read_blocking(|t| t.outbox_batch(p as u16, 0, 1000))
            .unwrap()
    );
    // Restoring again finds the local copy current and downloads nothing.
    assert_eq!(
        restore(&b, &bucket, &how(), p, &Trust::any())
            .await
            .unwrap(),
        Restored {
            checkpoint: 1234,
            downloaded: false,
            refused: 0,
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_newest_snapshots_are_kept_per_partition() {
    let server = NatsServer::start();
    let bucket = bucket(&server).await;
    upload(&bucket, &snapshot_bytes(5, 7), 3, &Seal::none())
        .await
        .unwrap();
    for seq in 1..=5 {
        let header = upload(&bucket, &snapshot_bytes(2, seq * 10), 3, &Seal::none())
            .await
            .unwrap();
        assert_eq!((header.partition, header.checkpoint), (2, seq * 10));
    }
    assert_eq!(checkpoints(&bucket, 2).await.unwrap(), [30, 40, 50]);
    assert_eq!(checkpoints(&bucket, 5).await.unwrap(), [7]);
    // An upload older than what is kept does not displace the newest.
    upload(&bucket, &snapshot_bytes(2, 15), 3, &Seal::none())
        .await
        .unwrap();
    assert_eq!(checkpoints(&bucket, 2).await.unwrap(), [30, 40, 50]);
    // `keep` 0 still keeps the newest.
    upload(&bucket, &snapshot_bytes(2, 60), 0, &Seal::none())
        .await
        .unwrap();
    assert_eq!(checkpoints(&bucket, 2).await.unwrap(), [60]);
    assert_eq!(checkpoints(&bucket, 5).await.unwrap(), [7]);
    let bytes = download(&bucket, 2, 60, &Seal::none()).await.unwrap();
    assert_eq!(SnapshotHeader::read(&bytes).unwrap().checkpoint, 60);
    assert!(latest(&bucket, 3, &Seal::none()).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_copy_at_least_as_new_as_the_snapshot_is_kept() {
    let server = NatsServer::start();
    let bucket = bucket(&server).await;
    let p = partition("acme", "order", "o-0", P);
    upload(&bucket, &snapshot_bytes(p, 42), 3, &Seal::none())
        .await
        .unwrap();
    let (_b_dir, b) = store();
    fill(&b, 40, "local");
    for local in [50, 42] {
        set_checkpoint(&b, p, local);
        let before = b.export_partition(&how(), p).unwrap();
        assert_eq!(
            restore(&b, &bucket, &how(), p, &Trust::any())
                .await
                .unwrap(),
            Restored {
                checkpoint: local,
                downloaded: false,
                refused: 0,
            }
        );
        assert_eq!(b.export_partition(&how(), p).unwrap(), before);
    }
    // One behind: the snapshot replaces the local copy whole.
    set_checkpoint(&b, p, 41);
    let restored = restore(&b, &bucket, &how(), p, &Trust::any())
        .await
        .unwrap();
    assert!(restored.downloaded);
    assert_eq!(
        b.export_partition(&how(), p).unwrap(),
        snapshot_bytes(p, 42)
    );
    let state = b
        .read_blocking(|t| t.instance("acme", "order", "o-0"))
        .unwrap()
        .unwrap()
        .state;
    assert_eq!(state, "paid");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_partition_waits_for_its_snapshot_to_be_listed() {
    let server = NatsServer::start();
    let bucket = bucket(&server).await;
    let p = partition("acme", "order", "o-0", P);
    upload(&bucket, &snapshot_bytes(p, 10), 3, &Seal::none())
        .await
        .unwrap();
    // The hand-over snapshot shows up in the listing only after the heir first looks, as
    // from a bucket replica that lags the write.
    let late = bucket.clone();
    let uploader = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        upload(&late, &snapshot_bytes(p, 42), 3, &Seal::none())
            .await
            .unwrap();
    });
    let (_b_dir, b) = store();
    let restored = restore_handed_over(
        &b,
        &bucket,
        &how(),
        p,
        42,
        Duration::from_secs(30),
        &Trust::any(),
    )
    .await
    .unwrap();
    uploader.await.unwrap();
    assert_eq!(
        restored,
        Restored {
            checkpoint: 42,
            downloaded: true,
            refused: 0,
        },
        "the heir restores the snapshot it was handed, not the older one listed first"
    );
    // A local copy already past the hand-over needs no listing of it.
    set_checkpoint(&b, p, 50);
    assert_eq!(
        restore_handed_over(
            &b,
            &bucket,
            &how(),
            p,
            45,
            Duration::from_secs(30),
            &Trust::any()
        )
        .await
        .unwrap(),
        Restored {
            checkpoint: 50,
            downloaded: false,
            refused: 0,
        }
    );
    // A hand-over snapshot that never appears: after the wait, the newest listed serves.
    let (_c_dir, c) = store();
    let restored = restore_handed_over(
        &c,
        &bucket,
        &how(),
        p,
        99,
        Duration::from_millis(300),
        &Trust::any(),
    )
    .await
    .unwrap();
    assert_eq!(restored.checkpoint, 42);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_newest_snapshot_gives_way_to_an_older_one() {
    let server = NatsServer::start();
    let bucket = bucket(&server).await;
    let p = 4;
    upload(&bucket, &snapshot_bytes(p, 42), 3, &Seal::none())
        .await
        .unwrap();
    // Written around the checks: a name that promises checkpoint 90, bytes that are not a
    // snapshot.
    let mut junk: &[u8] = b"not a snapshot at all, and long enough to have a digest";
    bucket
        .put(object_name(p, 90).as_str(), &mut junk)
        .await
        .unwrap();
    let (_b_dir, b) = store();
    let restored = restore(&b, &bucket, &how(), p, &Trust::any())
        .await
        .unwrap();
    assert_eq!(
        restored,
        Restored {
            checkpoint: 42,
            downloaded: true,
            refused: 0,
        }
    );
    assert_eq!(
        b.export_partition(&how(), p).unwrap(),
        snapshot_bytes(p, 42)
    );
    assert!(download(&bucket, p, 90, &Seal::none()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retention_check_sees_inputs_that_left_the_stream() {
    let server = NatsServer::start();
    let js = jetstream(&server.url()).await;
    js.create_stream(stream::Config {
        name: "INBOX".into(),
        subjects: vec!["runner.inbox.>".into()],
        max_messages: 5,
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(
        !retention_gap(&js, "INBOX", 0).await.unwrap(),
        "empty stream"
    );
    for i in 0..10 {
        js.publish(format!("runner.inbox.{}.x", i % 3), "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    // Sequences 6..=10 remain: replay from checkpoint 5 (needs 6) is possible, from 4 not.
    assert!(!retention_gap(&js, "INBOX", 5).await.unwrap());
    assert!(!retention_gap(&js, "INBOX", 10).await.unwrap());
    assert!(retention_gap(&js, "INBOX", 4).await.unwrap());
    assert!(retention_gap(&js, "INBOX", 0).await.unwrap());
    assert!(retention_gap(&js, "MISSING", 0).await.is_err());
}

/// With a deployment key a snapshot is imported only when sealed with it, and never when its
/// checkpoint lies past the inbox's last sequence: a snapshot sealed by another deployment,
/// an unsealed one and one claiming inputs the inbox never held are each refused and
/// counted, and the newest genuine one is imported. Without a key the seal is not asked
/// for, but the checkpoint bound still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_is_imported_only_when_sealed_by_the_deployment_and_within_the_inbox() {
    let server = NatsServer::start();
    let bucket = bucket(&server).await;
    let key = Seal::with_keys(&["the-deployment-key-0123"]);
    let foreign = Seal::with_keys(&["another-deployment-key-0123"]);
    let p = partition("acme", "order", "o-0", P);
    let keep = 10;
    upload(&bucket, &snapshot_bytes(p, 10), keep, &key)
        .await
        .unwrap();
    upload(&bucket, &snapshot_bytes(p, 20), keep, &foreign)
        .await
        .unwrap();
    upload(&bucket, &snapshot_bytes(p, 30), keep, &Seal::none())
        .await
        .unwrap();
    upload(&bucket, &snapshot_bytes(p, 1_000_000), keep, &key)
        .await
        .unwrap();

    let sealed = Trust {
        seal: key.clone(),
        inbox_last: 500,
    };
    let (_b_dir, b) = store();
    assert_eq!(
        restore(&b, &bucket, &how(), p, &sealed).await.unwrap(),
        Restored {
            checkpoint: 10,
            downloaded: true,
            refused: 3,
        },
        "only the snapshot sealed with the key and within the inbox is imported"
    );
    for (checkpoint, why) in [
        (20, "not made with this deployment's key"),
        (30, "carries no seal"),
    ] {
        match download(&bucket, p, checkpoint, &key).await {
            Err(e @ TransferError::Refused { .. }) => {
                assert!(e.to_string().contains(why), "{e}")
            }
            other => panic!("snapshot at {checkpoint}: {other:?}"),
        }
    }

    let unsealed = Trust {
        seal: Seal::none(),
        inbox_last: 500,
    };
    let (_c_dir, c) = store();
    assert_eq!(
        restore(&c, &bucket, &how(), p, &unsealed).await.unwrap(),
        Restored {
            checkpoint: 30,
            downloaded: true,
            refused: 1,
        },
        "without a key any intact snapshot serves, but never one past the inbox"
    );
}
