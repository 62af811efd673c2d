//! The outbox relay on its own: `runner::relay::Relay` against a real nats-server and a real
//! libmdbx store, with JetStream refusing some publications.
//!
//! What it must keep: only a gap-free prefix of the outbox counts as published, whatever the
//! server acknowledged after a refusal; publishing resumes after that prefix; every record
//! ends on the stream exactly once (repeats carry the same `Nats-Msg-Id` and are dropped by
//! JetStream's de-duplication); and a stop flushes and deletes what was published.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use async_nats::jetstream::stream::{Config, DiscardPolicy};
use common::{COMMAND_SUBJECTS, NatsServer, jetstream, read_stream, wait_until};
use runner::relay::{Relay, RelayHandle};
use runner::storage::Store;
use runner::storage::tables::{DEFAULT_PARTITION, OutboxRecord};
use runner::telemetry::Metrics;
use tokio_util::sync::CancellationToken;

/// Records per window: small, so a run spans many overlapping windows.
const WINDOW: usize = 4;

/// Record `i` of a test outbox: its own subject unless `subject_of` says otherwise.
fn record(i: u64, subject_of: u64) -> OutboxRecord {
    OutboxRecord {
        subject: format!("tenant.t.command.Account.a-{subject_of}"),
        msg_id: format!("rec-{i}"),
        tenant: "t".into(),
        traceparent: None,
        cause: (0, 0),
        body: format!("{{\"i\":{i}}}"),
    }
}

/// Writes `records` to the outbox in one transaction, tells `handle`, returns their sequences.
fn write_outbox(store: &Store, handle: &RelayHandle, records: Vec<OutboxRecord>) -> Vec<u64> {
    let seqs = store
        .write_blocking(|t| {
            records
                .iter()
                .map(|r| t.push_outbox(DEFAULT_PARTITION, r))
                .collect::<runner::storage::Result<Vec<_>>>()
        })
        .unwrap();
    handle.note_written(*seqs.last().unwrap(), seqs.len() as u64);
    handle.wake();
    seqs
}

/// A relay over `store`, running until the returned token is cancelled.
fn spawn_relay(
    js: &async_nats::jetstream::Context,
    store: &Store,
    handle: &RelayHandle,
    metrics: &Metrics,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let relay = Relay {
        js: js.clone(),
        store: store.clone(),
        metrics: metrics.clone(),
        handle: handle.clone(),
        window: WINDOW,
        poll: Duration::from_millis(50),
        refused: Default::default(),
        relays: None,
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    (stop, task)
}

/// Message ids on the command stream, in stream order.
async fn published_ids(js: &async_nats::jetstream::Context) -> Vec<String> {
    read_stream(js, "WORKFLOW_COMMANDS", ">")
        .await
        .into_iter()
        .map(|s| s.msg_id.unwrap())
        .collect()
}

fn ids(range: impl IntoIterator<Item = u64>) -> Vec<String> {
    range.into_iter().map(|i| format!("rec-{i}")).collect()
}

/// Cancels the relay, waits for it to return, and checks it deleted what it published.
async fn stop_and_check_flushed(
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    store: &Store,
) {
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the relay returns once the outbox is published")
        .unwrap();
    assert_eq!(store.read_blocking(|t| t.outbox_depth()).unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_holds_the_acknowledged_prefix_and_publishing_resumes_in_order() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    // The stream takes 10 messages and refuses the rest until its limit is lifted.
    common::create_capped_commands_stream(&js, 10).await;
    let dir = tempfile::tempdir().unwrap();
    let store = common::open_store(dir.path());
    let handle = RelayHandle::new();
    let metrics = Metrics::new("test", "test", "saga").unwrap();
    let total = 50u64;
    let seqs = write_outbox(&store, &handle, (1..=total).map(|i| record(i, i)).collect());
    let (stop, task) = spawn_relay(&js, &store, &handle, &metrics);

    // Refused: the prefix stops at the 10th record and the relay keeps trying.
    wait_until("two refused windows", Duration::from_secs(30), || async {
        metrics.relay_errors.get() >= 2
    })
    .await;
    assert_eq!(published_ids(&js).await, ids(1..=10));
    assert_eq!(handle.unpublished(), total - 10);
    let kept = store
        .read_blocking(|t| t.outbox_batch(DEFAULT_PARTITION, 0, 1000))
        .unwrap();
    assert!(
        kept.iter().any(|(s, _)| *s == seqs[10]),
        "the first refused record is still in the outbox"
    );

    // Accepted again: the rest goes out after the prefix, in outbox order, once each.
    common::uncap_stream(&js, "WORKFLOW_COMMANDS").await;
    wait_until(
        "everything acknowledged",
        Duration::from_secs(30),
        || async { handle.unpublished() == 0 },
    )
    .await;
    assert_eq!(published_ids(&js).await, ids(1..=total));
    stop_and_check_flushed(stop, task, &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hole_keeps_later_acknowledgements_from_counting_and_is_filled_without_repeats() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    // One message per subject: record 7 reuses record 1's subject and is refused, while the
    // records after it are accepted — a hole with acknowledged records behind it.
    js.create_stream(Config {
        name: "WORKFLOW_COMMANDS".into(),
        subjects: COMMAND_SUBJECTS.iter().map(|s| s.to_string()).collect(),
        duplicate_window: Duration::from_secs(120),
        max_messages_per_subject: 1,
        discard: DiscardPolicy::New,
        discard_new_per_subject: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = common::open_store(dir.path());
    let handle = RelayHandle::new();
    let metrics = Metrics::new("test", "test", "saga").unwrap();
    let total = 30u64;
    let hole = 7u64;
    let records = (1..=total)
        .map(|i| record(i, if i == hole { 1 } else { i }))
        .collect();
    write_outbox(&store, &handle, records);
    let (stop, task) = spawn_relay(&js, &store, &handle, &metrics);

    wait_until(
        "the relay retrying past the hole",
        Duration::from_secs(30),
        || async { metrics.relay_errors.get() >= 3 },
    )
    .await;
    // The server stored the prefix and, sent in the windows that overlapped the refused one,
    // some records behind the hole: each once, though every retry sent them again.
    let stored = published_ids(&js).await;
    let behind = stored.len() as u64 - (hole - 1);
    assert!(
        behind >= 1,
        "no record behind the hole was stored: {stored:?}"
    );
    assert_eq!(
        stored,
        ids((1..hole).chain(hole + 1..=hole + behind)),
        "the prefix, then records after the hole, each once"
    );
    // Yet only the prefix before the hole counts as published.
    assert_eq!(handle.unpublished(), total - (hole - 1));

    // The subject accepts a second message: the hole is filled, nothing else repeats.
    let mut config = js
        .get_stream("WORKFLOW_COMMANDS")
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_messages_per_subject = -1;
    config.discard_new_per_subject = false;
    js.update_stream(config).await.unwrap();
    wait_until(
        "everything acknowledged",
        Duration::from_secs(30),
        || async { handle.unpublished() == 0 },
    )
    .await;
    // The hole, then what follows the records already stored; no record twice.
    assert_eq!(
        published_ids(&js).await,
        ids((1..hole)
            .chain(hole + 1..=hole + behind)
            .chain([hole])
            .chain(hole + behind + 1..=total))
    );
    stop_and_check_flushed(stop, task, &store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_outage_mid_relay_loses_and_repeats_nothing() {
    let mut nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    common::create_capped_commands_stream(&js, -1).await;
    let dir = tempfile::tempdir().unwrap();
    let store = common::open_store(dir.path());
    let handle = RelayHandle::new();
    let metrics = Metrics::new("test", "test", "saga").unwrap();
    let (stop, task) = spawn_relay(&js, &store, &handle, &metrics);

    // A first part goes out; the server dies with the second part in the outbox.
    let first = 200u64;
    let total = 400u64;
    write_outbox(&store, &handle, (1..=first).map(|i| record(i, i)).collect());
    wait_until(
        "the first part acknowledged",
        Duration::from_secs(30),
        || async { handle.unpublished() == 0 },
    )
    .await;
    nats.stop();
    write_outbox(
        &store,
        &handle,
        (first + 1..=total).map(|i| record(i, i)).collect(),
    );
    wait_until(
        "the relay fails to publish",
        Duration::from_secs(30),
        || async { metrics.relay_errors.get() >= 1 },
    )
    .await;
    assert_eq!(
        handle.unpublished(),
        total - first,
        "nothing counts while down"
    );
    nats.start_again();
    wait_until(
        "everything acknowledged",
        Duration::from_secs(60),
        || async { handle.unpublished() == 0 },
    )
    .await;
    let mut seen = published_ids(&jetstream(&nats.url()).await).await;
    assert_eq!(seen.len() as u64, total, "a record is missing or repeated");
    seen.sort_by_key(|id| id[4..].parse::<u64>().unwrap());
    assert_eq!(seen, ids(1..=total));
    stop_and_check_flushed(stop, task, &store).await;
}
