//! Batching under a backlog: a saga worker that finds many inputs waiting commits them in
//! batches as large as what its consumer has received (up to `saga.batch_size`), not in
//! pieces cut by the async runtime's scheduling budget, and applies each input once.
//!
//! What is asserted is a count, not a time: with 3 000 deposits stored before the runner
//! starts, at least one batch holds more than 128 inputs (a batch read under tokio's
//! cooperative budget never does: its channel reports nothing ready after 128 receives
//! within one poll), the batches add up to exactly the inputs, and every deposit has its
//! output.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::metrics::Scrape;
use common::{NatsServer, RunnerProc, jetstream, ledger_deposit, wait_until};

const ACCOUNTS: u64 = 50;
const PER_ACCOUNT: u64 = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_is_committed_in_batches_larger_than_the_runtime_budget() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    // The runner creates its streams on start; start it once to have them, then stop it
    // so the deposits pile up unread.
    // One partition, so the whole backlog is one partition's to read and its batches show
    // (with 64 the backlog is spread and each partition's batches are small anyway).
    let envs = [("RUNNER__PARTITIONS__COUNT", "1")];
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "tests/manifests/ledger.yaml",
        &envs,
    );
    let dir = runner.stop();
    let total = ACCOUNTS * PER_ACCOUNT;
    let mut acks = Vec::with_capacity(total as usize);
    for n in 1..=PER_ACCOUNT {
        for a in 0..ACCOUNTS {
            let (subject, ev) = ledger_deposit(a, n);
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", ev["event_id"].as_str().unwrap());
            let body = serde_json::to_vec(&ev).unwrap();
            acks.push(
                js.publish_with_headers(subject, headers, body.into())
                    .await
                    .unwrap(),
            );
        }
    }
    for ack in acks {
        ack.await.unwrap();
    }

    let runner = RunnerProc::saga(dir, &nats.url(), "tests/manifests/ledger.yaml", &envs);
    let admin = runner.admin.clone();
    wait_until(
        "every deposit applied",
        Duration::from_secs(120),
        || async { common::saga_progress(&admin, "AGGREGATE_EVENTS").await.0 >= total },
    )
    .await;

    let scrape = Scrape::of(&admin).await;
    let get = |sample: &str| {
        scrape
            .get(sample)
            .unwrap_or_else(|| panic!("{}", scrape.describe(sample)))
    };
    let batches = get("runner_saga_batch_size_count");
    let inputs = get("runner_saga_batch_size_sum");
    let small = get("runner_saga_batch_size_bucket{le=\"128\"}");
    eprintln!("{inputs} inputs in {batches} batches, {small} of them of at most 128");
    assert_eq!(inputs, total as f64, "the batches hold every input once");
    assert!(
        small < batches,
        "no batch held more than 128 inputs ({batches} batches for {total} waiting inputs)"
    );

    let stream = js.get_stream("WORKFLOW_COMMANDS").await.unwrap();
    wait_until("every output published", Duration::from_secs(60), || {
        let mut stream = stream.clone();
        async move { stream.info().await.unwrap().state.messages >= total }
    })
    .await;
    // Outputs only, not the partitions' fence markers beside them.
    let published = common::read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>")
        .await
        .len() as u64;
    assert_eq!(published, total, "one output per deposit");
}
