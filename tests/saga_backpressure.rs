//! Backpressure: the saga worker stops fetching while the outbox holds more than
//! `saga.max_outbox_depth` unpublished records, and resumes once the relay catches up.
//!
//! The relay is held back for real: once the partitions raised their fences, the command
//! stream is closed to new messages until the test lifts its limit.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, RunnerProc, aggregate_event, jetstream, read_stream, wait_until};
use serde_json::json;

const MAX_DEPTH: u64 = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetching_pauses_past_max_outbox_depth_and_resumes_when_the_relay_catches_up() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    // One input per batch, so the limit is checked before every input.
    let depth = MAX_DEPTH.to_string();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "tests/manifests/ledger.yaml",
        &[
            ("RUNNER__SAGA__MAX_OUTBOX_DEPTH", &depth),
            ("RUNNER__SAGA__BATCH_SIZE", "1"),
        ],
    );
    let admin = runner.admin.clone();
    common::refuse_new_commands(&js, &admin, 64).await;
    let total = 50u64;
    for n in 1..=total {
        let ev = aggregate_event(
            "bank",
            "Account",
            "a-1",
            "Deposited",
            1_800_000_000_000 + n,
            json!({"n": n, "amount": n}),
        );
        common::publish_json(&js, "tenant.bank.aggregate.Account.a-1", &ev).await;
    }
    let applied = || async {
        common::metrics::metric(&admin, "runner_saga_inputs_total{stream=\"SAGA_INBOX\"}").await
    };

    // Each deposit makes one output and none can be published. Fetching goes on while at
    // most MAX_DEPTH outputs wait, so it stops after MAX_DEPTH + 1 inputs (+ 2 when a
    // commit lands between the check and the read). The worker sets
    // the depth gauge as it checks the limit, so a reading above the limit means it waits.
    wait_until(
        "the worker waits at the limit",
        Duration::from_secs(30),
        || async {
            common::metrics::metric(&admin, "runner_outbox_depth").await > MAX_DEPTH as f64
        },
    )
    .await;
    let errors = common::metrics::metric(&admin, "runner_relay_errors_total").await;
    wait_until("more refused windows", Duration::from_secs(60), || async {
        common::metrics::metric(&admin, "runner_relay_errors_total").await >= errors + 1.0
    })
    .await;
    let paused_at = applied().await;
    // Time passes with the relay failing again and again; the worker takes nothing more.
    wait_until(
        "three more refused windows",
        Duration::from_secs(60),
        || async {
            common::metrics::metric(&admin, "runner_relay_errors_total").await >= errors + 4.0
        },
    )
    .await;
    let still = applied().await;
    eprintln!("paused at {paused_at}, then {still}, of {total}");
    assert_eq!(still, paused_at, "fetching went on past the limit");
    assert!(
        ((MAX_DEPTH + 1) as f64..=(MAX_DEPTH + 2) as f64).contains(&still),
        "paused after {still} inputs"
    );
    assert!(
        read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>")
            .await
            .is_empty()
    );

    // The stream takes writes again: the relay drains the outbox and fetching resumes.
    common::uncap_stream(&js, "WORKFLOW_COMMANDS").await;
    wait_until(
        "everything applied and published",
        Duration::from_secs(60),
        || async { common::saga_progress(&admin, "AGGREGATE_EVENTS").await == (total, 0) },
    )
    .await;
    let ns = common::command_numbers(&js).await;
    assert_eq!(ns, (1..=total).map(|n| json!(n)).collect::<Vec<_>>());
    let dir = runner.stop();
    let inst = common::open_store(dir.path())
        .read_blocking(|t| t.instance("bank", "ledger", "a-1"))
        .unwrap()
        .unwrap();
    assert_eq!(inst.state, "open");
    assert_eq!(inst.data["count"], json!(total));
}

/// `saga.max_outbox_depth` holds for the node, not per partition (finding: a
/// node owning P partitions held P times the bound, and each partition overwrote the depth
/// gauge with its own). The command stream is closed to new writes once every partition
/// has raised its fence there, so no output can be published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_bound_holds_for_the_node_over_its_partitions() {
    const P: u64 = 8;
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let depth = MAX_DEPTH.to_string();
    let partitions = P.to_string();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "tests/manifests/ledger.yaml",
        &[
            ("RUNNER__PARTITIONS__COUNT", &partitions),
            ("RUNNER__SAGA__MAX_OUTBOX_DEPTH", &depth),
            ("RUNNER__SAGA__BATCH_SIZE", "1"),
        ],
    );
    let admin = runner.admin.clone();
    wait_until("every partition owned", Duration::from_secs(30), || async {
        common::metrics::metric(&admin, "runner_partitions_owned").await == P as f64
    })
    .await;
    // Full from now on: every publication of an output is refused.
    let mut stream = js.get_stream("WORKFLOW_COMMANDS").await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_messages = stream.info().await.unwrap().state.messages as i64;
    config.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    js.update_stream(config).await.unwrap();

    // One deposit each for 40 accounts: spread over the partitions.
    let total = 40u64;
    for a in 0..total {
        let ev = aggregate_event(
            "bank",
            "Account",
            &format!("a-{a}"),
            "Deposited",
            1_800_000_000_000 + a,
            json!({"n": 1, "amount": 1}),
        );
        common::publish_json(&js, &format!("tenant.bank.aggregate.Account.a-{a}"), &ev).await;
    }
    let applied = || async {
        common::metrics::metric(&admin, "runner_saga_inputs_total{stream=\"SAGA_INBOX\"}").await
    };
    wait_until(
        "the node waits at the limit",
        Duration::from_secs(30),
        || async {
            common::metrics::metric(&admin, "runner_outbox_depth").await > MAX_DEPTH as f64
        },
    )
    .await;
    let errors = common::metrics::metric(&admin, "runner_relay_errors_total").await;
    wait_until("more refused batches", Duration::from_secs(60), || async {
        common::metrics::metric(&admin, "runner_relay_errors_total").await >= errors + 3.0
    })
    .await;
    let first = applied().await;
    wait_until(
        "still more refused batches",
        Duration::from_secs(60),
        || async {
            common::metrics::metric(&admin, "runner_relay_errors_total").await >= errors + 6.0
        },
    )
    .await;
    let still = applied().await;
    assert_eq!(still, first, "fetching went on past the limit");
    // Each partition's loop may pass the check once before the others' commits land.
    assert!(
        still <= (MAX_DEPTH + P + 1) as f64,
        "{still} inputs applied with at most {MAX_DEPTH} outputs waiting on the node"
    );
    let gauge = common::metrics::metric(&admin, "runner_outbox_depth").await;
    assert_eq!(gauge, still, "the gauge counts every partition's outbox");
}
