//! Shutdown through signals, against the real binary: SIGINT drains and exits 0; a second
//! signal during a drain exits 130 at once; a drain that outlasts `runner.drain_timeout`
//! exits 1 and leaves what it could not publish in the outbox for the next start.
//!
//! A drain is made slow for real, not by timing: the command stream accepts one message and
//! refuses the rest, so the relay cannot flush the outbox until the test lifts the limit.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, RunnerProc, aggregate_event, jetstream, read_stream, wait_until};
use serde_json::json;

const LEDGER: &str = "tests/manifests/ledger.yaml";
/// Deposits applied to the ledger instance, and the outbox depth, in the store at `dir`.
fn applied_and_depth(dir: &std::path::Path) -> (u64, u64) {
    let store = common::open_store(dir);
    store
        .read_blocking(|t| {
            let count = t
                .instance("bank", "ledger", "a-1")?
                .map_or(0, |i| i.data["count"].as_u64().unwrap_or(0));
            Ok((count, t.outbox_depth()?))
        })
        .unwrap()
}

/// Deposits 1..=n on account `a-1`, all sent before any acknowledgement is awaited; each
/// makes the ledger saga emit one command.
async fn deposit(js: &async_nats::jetstream::Context, n: u64) {
    let mut acks = Vec::new();
    for i in 1..=n {
        let ev = aggregate_event(
            "bank",
            "Account",
            "a-1",
            "Deposited",
            1_800_000_000_000 + i,
            json!({"n": i, "amount": i}),
        );
        let mut h = async_nats::HeaderMap::new();
        h.insert(
            async_nats::header::NATS_MESSAGE_ID,
            ev["event_id"].as_str().unwrap(),
        );
        let body = serde_json::to_vec(&ev).unwrap().into();
        let subject = "tenant.bank.aggregate.Account.a-1";
        acks.push(js.publish_with_headers(subject, h, body).await.unwrap());
    }
    for a in acks {
        a.await.unwrap();
    }
}

/// A runner whose outputs cannot be published: `inputs` deposits applied, their outputs
/// held in the outbox while the relay retries (the command stream takes no new message).
async fn runner_with_unpublishable_outputs(
    nats: &NatsServer,
    inputs: u64,
    envs: &[(&str, &str)],
) -> RunnerProc {
    let js = jetstream(&nats.url()).await;
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), LEDGER, envs);
    let admin = runner.admin.clone();
    common::refuse_new_commands(&js, &admin, 64).await;
    deposit(&js, inputs).await;
    wait_until(
        "all inputs applied and the relay refused",
        Duration::from_secs(30),
        || async {
            common::saga_progress(&admin, "AGGREGATE_EVENTS").await.0 == inputs
                && common::metrics::metric(&admin, "runner_relay_errors_total").await >= 1.0
        },
    )
    .await;
    assert!(
        read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>")
            .await
            .is_empty(),
        "no output published"
    );
    let (_, depth) = common::saga_progress(&admin, "AGGREGATE_EVENTS").await;
    assert_eq!(depth, inputs, "they wait in the outbox");
    runner
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_drains_work_in_flight_and_exits_zero() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let one_per_batch = [("RUNNER__SAGA__BATCH_SIZE", "1")];
    // A first start creates the streams; the deposits then wait as a backlog, so the runner
    // (one input per commit) is still working through them when the signal comes.
    let data = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        LEDGER,
        &one_per_batch,
    )
    .stop();
    let total = 300;
    deposit(&js, total).await;
    let mut runner = RunnerProc::saga(data, &nats.url(), LEDGER, &one_per_batch);
    let admin = runner.admin.clone();
    wait_until(
        "the runner applies inputs",
        Duration::from_secs(30),
        || async { common::inputs_applied(&admin).await > 0 },
    )
    .await;
    runner.signal("INT");
    assert_eq!(runner.wait_exit(Duration::from_secs(60)), Some(0));
    assert!(
        runner
            .log
            .iter()
            .any(|l| l.contains("Drain started") && l.contains("SIGINT")),
        "{}",
        runner.log.join("\n")
    );
    assert!(runner.logged("\"message\":\"Drained.\""));
    // What was applied before the drain is all published; the outbox is empty.
    let (checkpoint, depth) = applied_and_depth(runner.data_dir.path());
    eprintln!("drained at checkpoint {checkpoint} of {total}; outbox depth {depth}");
    // The drain came mid-run: after the first input, before the last.
    assert!(
        0 < checkpoint && checkpoint < total,
        "the drain did not come mid-run: {checkpoint} of {total} applied"
    );
    assert_eq!(depth, 0);
    let published = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>").await;
    assert_eq!(published.len() as u64, checkpoint);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_the_drain_exits_130() {
    let nats = NatsServer::start();
    let mut runner =
        runner_with_unpublishable_outputs(&nats, 5, &[("RUNNER__RUNNER__DRAIN_TIMEOUT", "10m")])
            .await;
    let admin = runner.admin.clone();
    runner.signal("INT");
    // The drain is under way and cannot end: the workers have stopped, the relay cannot
    // publish the outbox, and the process still runs and reports draining.
    runner.wait_for_log("Consumer stopped for the drain", Duration::from_secs(30));
    wait_until(
        "/metrics reports draining",
        Duration::from_secs(30),
        || async { common::metrics::metric(&admin, "runner_draining").await == 1.0 },
    )
    .await;
    assert_eq!(runner.exited(), None, "{}", runner.log.join("\n"));
    assert!(!runner.logged("\"message\":\"Drained.\""));
    runner.signal("TERM");
    assert_eq!(runner.wait_exit(Duration::from_secs(30)), Some(130));
    assert!(runner.logged("Second signal"), "{}", runner.log.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_past_drain_timeout_exits_1_and_the_next_start_publishes_the_rest() {
    let nats = NatsServer::start();
    let inputs = 5;
    let mut runner = runner_with_unpublishable_outputs(
        &nats,
        inputs,
        &[("RUNNER__RUNNER__DRAIN_TIMEOUT", "1s")],
    )
    .await;
    runner.signal("TERM");
    assert_eq!(runner.wait_exit(Duration::from_secs(60)), Some(1));
    assert!(
        runner.logged("Drain timed out"),
        "{}",
        runner.log.join("\n")
    );
    assert!(!runner.logged("\"message\":\"Drained.\""));
    let dir = runner.kill();
    let (checkpoint, depth) = applied_and_depth(dir.path());
    assert_eq!(checkpoint, inputs);
    assert_eq!(depth, inputs, "unpublished outputs stay in the outbox");

    // Once the stream accepts them, the next start publishes them, once each and in order.
    let js = jetstream(&nats.url()).await;
    common::uncap_stream(&js, "WORKFLOW_COMMANDS").await;
    let runner = RunnerProc::saga(dir, &nats.url(), LEDGER, &[]);
    let admin = runner.admin.clone();
    wait_until("the outbox is empty", Duration::from_secs(30), || async {
        common::saga_progress(&admin, "AGGREGATE_EVENTS").await == (inputs, 0)
    })
    .await;
    let ns = common::command_numbers(&js).await;
    assert_eq!(ns, (1..=inputs).map(|n| json!(n)).collect::<Vec<_>>());
    runner.stop();
}
