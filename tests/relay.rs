//! A partition's relay on its own: `runner::relay::fenced::PartitionRelay` against a real
//! nats-server and a real libmdbx store, with JetStream refusing some publications.
//!
//! What it must keep: only a gap-free prefix of the outbox counts as published, whatever the
//! server acknowledged after a refusal; publishing resumes after that prefix; every record
//! ends on the stream exactly once (repeats carry the same `Nats-Msg-Id` and are dropped by
//! JetStream's de-duplication, or are below the fence watermark); and a stop flushes and
//! deletes what was published — whether the writer hands its records over in memory, as
//! the saga worker's commit does, or only notes them and leaves the relay to read the store.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, read_stream, wait_until};
use runner::broker::fence::Fence;
use runner::broker::fenced_batch::Transport;
use runner::relay::RelayHandle;
use runner::relay::fenced::PartitionRelay;
use runner::storage::Store;
use runner::storage::tables::OutboxRecord;
use runner::telemetry::Metrics;
use tokio_util::sync::CancellationToken;

/// The partition the relay publishes for.
const P: u16 = 3;

/// Records per window: small, so a run spans many overlapping windows.
const WINDOW: usize = 4;

/// Record `i` of a test outbox: its own subject unless `subject_of` says otherwise.
fn record(i: u64, subject_of: u64) -> OutboxRecord {
    OutboxRecord {
        subject: format!("tenant.t.command.Account.a-{subject_of}"),
        msg_id: format!("rec-{i}"),
        tenant: "t".into(),
        traceparent: None,
        cause: (i, 1),
        body: format!("{{\"i\":{i}}}"),
    }
}

/// How a writer tells the relay about what it committed.
#[derive(Clone, Copy, Debug)]
enum Writer {
    /// As the saga worker's commit does: the records themselves, handed over in memory.
    HandsOver,
    /// Only the highest sequence and the count: the relay must read the store.
    Notes,
}

/// Writes `records` to the outbox in one transaction, tells `handle`, returns their sequences.
fn write_outbox(store: &Store, handle: &RelayHandle, records: Vec<OutboxRecord>) -> Vec<u64> {
    write_as(Writer::Notes, store, handle, records)
}

/// [`write_outbox`], telling the relay as `writer` does.
fn write_as(
    writer: Writer,
    store: &Store,
    handle: &RelayHandle,
    records: Vec<OutboxRecord>,
) -> Vec<u64> {
    let seqs = store
        .write_blocking(|t| {
            records
                .iter()
                .map(|r| t.push_outbox(P, r))
                .collect::<runner::storage::Result<Vec<_>>>()
        })
        .unwrap();
    match writer {
        Writer::HandsOver => {
            let bytes = vec![(
                "t".to_string(),
                records.iter().map(OutboxRecord::size).sum(),
            )];
            handle.hand_over(seqs.iter().copied().zip(records).collect(), bytes)
        }
        Writer::Notes => handle.note_written(*seqs.last().unwrap(), seqs.len() as u64),
    }
    handle.wake();
    seqs
}

/// A relay over `store`, running until the returned token is cancelled.
async fn spawn_relay(
    client: &async_nats::Client,
    store: &Store,
    handle: &RelayHandle,
    metrics: &Metrics,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), runner::relay::fenced::Fenced>>,
) {
    let js = async_nats::jetstream::new(client.clone());
    let fence = Fence::raise(&js, "WORKFLOW_COMMANDS", P, 1, "test")
        .await
        .unwrap();
    let relay = PartitionRelay {
        js,
        client: client.clone(),
        store: store.clone(),
        metrics: metrics.clone(),
        partition: u32::from(P),
        handle: handle.clone(),
        fences: [("WORKFLOW_COMMANDS".to_string(), fence)].into(),
        stream_of: Box::new(|_| Some("WORKFLOW_COMMANDS".to_string())),
        window: WINDOW,
        poll: Duration::from_millis(50),
        timeout: Duration::from_secs(5),
        shared: Default::default(),
        transport: Transport::Round,
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    (stop, task)
}

/// Message ids of the records on the command stream (not the fence markers), in stream
/// order.
async fn published_ids(js: &async_nats::jetstream::Context) -> Vec<String> {
    read_stream(js, "WORKFLOW_COMMANDS", "tenant.>")
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
    task: tokio::task::JoinHandle<Result<(), runner::relay::fenced::Fenced>>,
    store: &Store,
) {
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the relay returns once the outbox is published")
        .unwrap()
        .expect("not fenced off");
    assert_eq!(store.read_blocking(|t| t.outbox_depth()).unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_holds_the_acknowledged_prefix_and_publishing_resumes_in_order() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    // The stream takes 16 messages (records and fence markers) and refuses the rest until
    // its limit is lifted.
    common::create_capped_commands_stream(&js, 16).await;
    let dir = tempfile::tempdir().unwrap();
    let store = common::open_store(dir.path());
    let handle = RelayHandle::new();
    let metrics = Metrics::new("test", "test", "saga").unwrap();
    let total = 50u64;
    let seqs = write_outbox(&store, &handle, (1..=total).map(|i| record(i, i)).collect());
    let (stop, task) = spawn_relay(&client, &store, &handle, &metrics).await;

    // Refused: what counts as published is a prefix of what was stored, and the relay
    // keeps trying.
    wait_until("two refused windows", Duration::from_secs(30), || async {
        metrics.relay_errors.get() >= 2
    })
    .await;
    let stored = published_ids(&js).await;
    assert!(
        !stored.is_empty() && (stored.len() as u64) < total,
        "{stored:?}"
    );
    assert_eq!(
        stored,
        ids(1..=stored.len() as u64),
        "a gap-free prefix, in order"
    );
    let counted = total - handle.unpublished();
    assert!(
        counted <= stored.len() as u64,
        "counted {counted} of {stored:?}"
    );
    let kept = store.read_blocking(|t| t.outbox_batch(P, 0, 1000)).unwrap();
    assert!(
        kept.iter().any(|(s, _)| *s == seqs[counted as usize]),
        "the first record not counted is still in the outbox"
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
async fn a_server_outage_mid_relay_loses_and_repeats_nothing() {
    outage(Writer::Notes).await;
}

/// The records of the failed windows were taken out of the relay's memory: it must read
/// them back from the store, not skip to what was handed over later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_handed_over_in_memory_survive_an_outage_once_each() {
    outage(Writer::HandsOver).await;
}

async fn outage(writer: Writer) {
    let mut nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    common::create_capped_commands_stream(&js, -1).await;
    let dir = tempfile::tempdir().unwrap();
    let store = common::open_store(dir.path());
    let handle = RelayHandle::new();
    let metrics = Metrics::new("test", "test", "saga").unwrap();
    let (stop, task) = spawn_relay(&client, &store, &handle, &metrics).await;

    // A first part goes out; the server dies with the second part in the outbox.
    let first = 200u64;
    let total = 400u64;
    write_as(
        writer,
        &store,
        &handle,
        (1..=first).map(|i| record(i, i)).collect(),
    );
    wait_until(
        "the first part acknowledged",
        Duration::from_secs(30),
        || async { handle.unpublished() == 0 },
    )
    .await;
    nats.stop();
    // In two commits: the relay's memory is complete when the first lands.
    let middle = (first + total) / 2;
    for range in [first + 1..=middle, middle + 1..=total] {
        write_as(
            writer,
            &store,
            &handle,
            range.map(|i| record(i, i)).collect(),
        );
    }
    // Each failed try waits out its acknowledgements and a read of the fence (seconds).
    wait_until(
        "the relay fails to publish",
        Duration::from_secs(90),
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
    assert!(
        handle.bytes_by_tenant().is_empty(),
        "no bytes left counted: {:?}",
        handle.bytes_by_tenant()
    );
    let mut seen = published_ids(&common::jetstream(&nats.url()).await).await;
    assert_eq!(seen.len() as u64, total, "a record is missing or repeated");
    seen.sort_by_key(|id| id[4..].parse::<u64>().unwrap());
    assert_eq!(seen, ids(1..=total));
    stop_and_check_flushed(stop, task, &store).await;
}
