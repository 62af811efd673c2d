//! Saga replicas with the default configuration share the work: whatever they are started
//! with, a second replica never applies an input a first one owns (finding: two default
//! replicas each applied every input; a lagging one later cancelled 89 shipped orders).
//! Real binary, real nats-server.
//!
//! - two default replicas on their own data directories divide the partitions between
//!   them, and every order is applied once, its command published once;
//! - a replica of the old single-active release (its lease held in the leases bucket) keeps
//!   new replicas out, naming it; a lease this data directory's own previous process left
//!   is void and the start goes on.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
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

/// Charge commands stored per order id.
async fn charges_per_order(js: &async_nats::jetstream::Context) -> BTreeMap<String, usize> {
    let charges = read_stream(js, "WORKFLOW_COMMANDS", "tenant.acme.effect.charge_card.*").await;
    let mut per_order: BTreeMap<String, usize> = BTreeMap::new();
    for c in &charges {
        *per_order
            .entry(c.subject.rsplit('.').next().unwrap().to_string())
            .or_insert(0) += 1;
    }
    per_order
}

/// Partitions owned by the replica at `admin`.
async fn owned(admin: &str) -> u64 {
    get_json(&format!("{admin}/info")).await["saga_progress"]["partitions_owned"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_default_replicas_divide_the_partitions_and_apply_every_order_once() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let first = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &[("RUNNER__NODE__ID", "first")],
    );
    orders(&js, 0..100).await;
    let second = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &[("RUNNER__NODE__ID", "second")],
    );
    orders(&js, 100..200).await;
    // They settle on half each (a replica hands over one partition at a time).
    wait_until(
        "the partitions divided",
        Duration::from_secs(90),
        || async {
            let (a, b) = (owned(&first.admin).await, owned(&second.admin).await);
            a + b == 64 && a.abs_diff(b) <= 1
        },
    )
    .await;
    orders(&js, 200..300).await;

    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        300,
        Duration::from_secs(90),
    )
    .await;
    // A moment for anything applied twice to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_order = charges_per_order(&js).await;
    assert_eq!(per_order.len(), 300, "every order charged");
    assert!(
        per_order.values().all(|n| *n == 1),
        "an order charged twice: {:?}",
        per_order
            .iter()
            .filter(|(_, n)| **n > 1)
            .collect::<Vec<_>>()
    );
    // Each order was applied by one replica: the transitions of both add up to one per
    // order, beside what a new owner replayed on top of a snapshot (counted apart).
    let admins = [first.admin.as_str(), second.admin.as_str()];
    let applied: f64 = metrics::metric_across(
        &admins,
        "runner_saga_transitions_total{outcome=\"applied\",saga=\"order\"}",
    )
    .await
    .iter()
    .sum();
    let replayed: f64 = metrics::metric_across(&admins, "runner_partition_replayed_inputs_total")
        .await
        .iter()
        .sum();
    assert_eq!(
        applied - replayed,
        300.0,
        "applied {applied}, replayed {replayed}"
    );
}

/// The owner string an old release wrote into its lease: `<node id>@<store id>`.
async fn hold_old_lease(url: &str, owner: &str) -> async_nats::jetstream::kv::Store {
    let js = jetstream(url).await;
    let kv = runner::broker::ensure_leases_bucket(
        &js,
        "RUNNER_LEASES",
        Duration::from_secs(10),
        1,
        runner::config::StreamStorage::File,
    )
    .await
    .unwrap();
    let lease = runner::worker::ownership::lease::Lease::acquire(
        &kv,
        runner::worker::ownership::upgrade::OLD_LEASE,
        owner,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert!(lease.is_some(), "the old lease is taken");
    std::mem::forget(lease);
    kv
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_of_the_single_active_release_keeps_new_ones_out() {
    let nats = NatsServer::start();
    hold_old_lease(&nats.url(), "old-node@old-store").await;

    // A replica on other storage is refused, naming the old one.
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = run_to_exit(
        &[
            "run",
            "--mode",
            "saga",
            "--nats-url",
            &nats.url(),
            "--manifest",
            "manifests",
            "--admin-addr",
            "127.0.0.1:0",
            "--data-dir",
            dir.path().to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(1), "{out}");
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with("runner: "))
        .unwrap_or_else(|| panic!("no failure line in:\n{out}"));
    assert!(
        line.contains("`old-node@old-store`"),
        "names the holder: {line}"
    );
    assert!(line.contains("older release"), "says why: {line}");

    // The same lease on this data directory's own store id: its previous process, dead.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("runner.id"), "old-store").unwrap();
    let mut runner = RunnerProc::saga(dir, &nats.url(), "manifests", &[]);
    runner.wait_for_log(
        "Deleting the single-active lease this data directory's previous run left",
        Duration::from_secs(10),
    );
    let js = jetstream(&nats.url()).await;
    orders(&js, 0..3).await;
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        3,
        Duration::from_secs(60),
    )
    .await;
}

/// A replica that joins while the owner's relay cannot publish still takes its partitions
/// with nothing replayed: the owner hands each over after one lease TTL without a flush,
/// and the snapshot it names carries the records its relay had left. Each order is then
/// charged once, by the heir's relay or the owner's, never twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_the_relay_cannot_flush_carries_the_outbox_and_replays_nothing() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let env = [
        ("RUNNER__PARTITIONS__COUNT", "4"),
        ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
    ];
    let with = |id: &'static str| {
        let mut e = env.to_vec();
        e.push(("RUNNER__NODE__ID", id));
        e
    };
    let mut first = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &with("first"),
    );
    refuse_new_commands(&js, &first.admin, 4).await;
    orders(&js, 0..40).await;
    wait_until("every order applied", Duration::from_secs(60), || async {
        inputs_applied(&first.admin).await >= 40
    })
    .await;
    let depth = get_json(&format!("{}/info", first.admin)).await["saga_progress"]["outbox_depth"]
        .as_u64()
        .unwrap();
    assert!(depth >= 40, "the commands wait in the outbox: {depth}");

    let second = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &with("second"),
    );
    // The owner gives up two partitions although their outboxes cannot be flushed.
    wait_until(
        "two partitions handed over",
        Duration::from_secs(90),
        || async { owned(&first.admin).await == 2 },
    )
    .await;
    assert!(
        first.logged("Hand-over before the outbox was flushed"),
        "the hand-over said it did not wait for the flush"
    );
    uncap_stream(&js, "WORKFLOW_COMMANDS").await;
    wait_until(
        "the heir holds its two",
        Duration::from_secs(90),
        || async { owned(&second.admin).await == 2 },
    )
    .await;

    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        40,
        Duration::from_secs(90),
    )
    .await;
    // A moment for anything published twice to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_order = charges_per_order(&js).await;
    assert_eq!(per_order.len(), 40, "every order charged");
    assert!(per_order.values().all(|n| *n == 1), "{per_order:?}");
    // The heir started both partitions from the snapshots handed to it and replayed nothing.
    assert_eq!(
        metrics::metric(
            &second.admin,
            "runner_partition_restores_total{source=\"snapshot\"}"
        )
        .await,
        2.0
    );
    assert_eq!(
        metrics::metric(&second.admin, "runner_partition_replayed_inputs_total").await,
        0.0
    );
}
