//! Whatever the configuration, a second saga replica never applies an input a first one owns
//! (finding: two replicas with the default configuration each applied every input; a lagging
//! one later cancelled 89 shipped orders). Real binary, real nats-server.
//!
//! - a second default (single-active) replica on other storage is refused at start, naming
//!   the first, and every order is applied once;
//! - a partitioned replica beside a single-active one is refused, and the other way round;
//! - a killed replica restarted on its own data directory takes its lease back at once;
//! - a drained replica releases it: a replica on other storage may start then.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn order(id: &str) -> (String, serde_json::Value) {
    let ev = aggregate_event(
        "acme",
        "Order",
        id,
        "OrderPlaced",
        runner::clock::now_ms(),
        json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
    );
    (format!("tenant.acme.aggregate.Order.{id}"), ev)
}

async fn orders(js: &async_nats::jetstream::Context, ids: std::ops::Range<u32>) {
    for i in ids {
        let (s, b) = order(&format!("o-{i}"));
        publish_json(js, &s, &b).await;
    }
}

/// `runner run --mode saga` on a fresh data directory, expected to stop at start; returns
/// its exit code and the line that says why.
fn refused(url: &str, envs: &[(&str, &str)]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = run_to_exit(
        &[
            "run",
            "--mode",
            "saga",
            "--nats-url",
            url,
            "--manifest",
            "manifests",
            "--admin-addr",
            "127.0.0.1:0",
            "--data-dir",
            dir.path().to_str().unwrap(),
        ],
        envs,
        Duration::from_secs(60),
    );
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with("runner: "))
        .unwrap_or_else(|| panic!("no failure line in:\n{out}"))
        .to_string();
    (code, line)
}

const PARTITIONED: [(&str, &str); 2] = [
    ("RUNNER__PARTITIONS__ENABLED", "true"),
    ("RUNNER__PARTITIONS__COUNT", "8"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_default_replica_is_refused_and_every_order_is_applied_once() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let env = [("RUNNER__NODE__ID", "first")];
    let first = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &env);
    orders(&js, 0..10).await;

    let (code, line) = refused(&nats.url(), &[("RUNNER__NODE__ID", "second")]);
    assert_eq!(code, Some(1), "{line}");
    assert!(line.contains("`first@"), "names the holder: {line}");
    assert!(
        line.contains("partitions.enabled = true"),
        "says how: {line}"
    );
    // A partitioned replica may not join a single-active one either.
    let (code, line) = refused(&nats.url(), &PARTITIONED);
    assert_eq!(code, Some(1), "{line}");
    assert!(line.contains("`first@"), "{line}");

    orders(&js, 10..20).await;
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        20,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(charges.len(), 20, "each order charged once");
    let metrics = reqwest::get(format!("{}/metrics", first.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("runner_saga_inputs_total{stream=\"AGGREGATE_EVENTS\"} 20"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("saga_inputs"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Drained, it lets go: a replica on other storage may start now.
    first.stop();
    let second = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &[("RUNNER__NODE__ID", "second")],
    );
    let health = get_json(&format!("{}/health", second.admin)).await;
    assert_eq!(health["status"], "ok", "{health}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_takes_its_lease_back_and_a_single_active_one_stays_out_of_partitions() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);
    orders(&js, 0..5).await;
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        5,
        Duration::from_secs(60),
    )
    .await;
    // Killed: its lease is still alive for a TTL, but it was this data directory's.
    let dir = runner.kill();
    let runner = RunnerProc::saga(dir, &nats.url(), "manifests", &[]);
    assert!(
        runner
            .log
            .iter()
            .any(|l| l.contains("Taking over the single-active lease")),
        "{}",
        runner.log.join("\n")
    );
    orders(&js, 5..8).await;
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        8,
        Duration::from_secs(60),
    )
    .await;
    runner.stop();

    // Partitioned replicas now; a single-active one may not join them.
    let part = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &PARTITIONED,
    );
    let (code, line) = refused(&nats.url(), &[]);
    assert_eq!(code, Some(1), "{line}");
    assert!(line.contains("partitioned replicas ("), "{line}");
    assert!(line.contains("partitions.enabled = true"), "{line}");
    drop(part);
}
