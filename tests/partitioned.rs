//! The saga pipeline on one nats-server: the real binary with its default configuration,
//! inputs routed into the saga inbox, partitions owned under leases, outputs published
//! through fenced batches. Multi-replica and cluster behaviour is in `tests/scaleout.rs`.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{
    NatsServer, RunnerProc, aggregate_event, effect_result, jetstream, publish_json, read_stream,
    wait_for_messages,
};
use runner::worker::ownership::router::share::share_of;
use serde_json::json;

const TS: u64 = 1_800_000_000_000;

/// Environment of a partitioned runner with the default 64 partitions and a short lease.
const PARTITIONED: [(&str, &str); 2] = [
    ("RUNNER__PARTITIONS__COUNT", "64"),
    ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
];

fn assert_unique_ids(seen: &[common::Seen]) {
    let mut ids = HashMap::new();
    for s in seen {
        let id = s.msg_id.clone().expect("every output carries Nats-Msg-Id");
        if let Some(prev) = ids.insert(id.clone(), s.subject.clone()) {
            panic!("duplicate output {id} on {prev} and {}", s.subject);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_partitioned_replica_runs_orders_to_their_states_and_emits_once() {
    let nats = NatsServer::start();
    let mut runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &PARTITIONED,
    );
    let js = jetstream(&nats.url()).await;
    let total = 40usize;
    for i in 0..total as u64 {
        let id = format!("o-{i}");
        let ev = aggregate_event(
            "acme",
            "Order",
            &id,
            "OrderPlaced",
            TS + i,
            json!({"customer_id": "c", "amount_cents": 1000 + i, "items": [{"sku": "book", "qty": 1}]}),
        );
        publish_json(&js, &format!("tenant.acme.aggregate.Order.{id}"), &ev).await;
    }
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.effect.charge_card.*",
        total,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(charges.len(), total);
    assert_unique_ids(&charges);
    for c in &charges {
        let order: u64 = c.body["payload"]["order_id"].as_str().unwrap()[2..]
            .parse()
            .unwrap();
        let (subject, body) = if order.is_multiple_of(2) {
            effect_result(
                &c.body,
                "Succeeded",
                TS + 10_000,
                json!({"payment_id": "p"}),
            )
        } else {
            effect_result(&c.body, "Failed", TS + 10_000, json!({"error": "declined"}))
        };
        publish_json(&js, &subject, &body).await;
    }
    let reserves = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.effect.reserve_stock.*",
        total / 2,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(reserves.len(), total / 2);
    let cancels = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.command.Order.*",
        total / 2,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(cancels.len(), total / 2);
    let all = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.>").await;
    assert_eq!(all.len(), total * 2, "an output appeared more than once");
    assert_unique_ids(&all);
    // Every partition is owned by this replica, and its fence carries the watermark.
    let metrics = common::get_text(&format!("{}/metrics", runner.admin)).await;
    assert!(
        metrics.contains("runner_partitions_owned 64"),
        "owned partitions: {}",
        metrics
            .lines()
            .filter(|l| l.contains("partition"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let fences = read_stream(&js, "WORKFLOW_COMMANDS", "runner.fence.>").await;
    assert!(!fences.is_empty());
    runner.signal("TERM");
    assert_eq!(runner.wait_exit(Duration::from_secs(30)), Some(0));
    let store = common::open_store(runner.data_dir.path());
    let inst = store.read_blocking(|t| t.instances()).unwrap();
    assert_eq!(inst.len(), total);
    for i in inst {
        let n: u64 = i.correlation_id[2..].parse().unwrap();
        let want = if n.is_multiple_of(2) {
            "reserving_stock"
        } else {
            "cancelled"
        };
        assert_eq!(i.state, want, "{}", i.correlation_id);
    }
}

#[test]
fn a_data_directory_redrive_points_to_the_partitions_owner() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out) = common::run_to_exit(
        &[
            "dlq",
            "redrive",
            "--tenant",
            "acme",
            "1",
            "--data-dir",
            dir.path().to_str().unwrap(),
            "--manifest",
            "manifests",
        ],
        &[],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(1), "output:\n{out}");
    assert!(
        out.contains("redriven by its partition's owner") && out.contains("--admin"),
        "output:\n{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_once_by_one_partition_and_the_rest_flows() {
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &PARTITIONED,
    );
    let js = jetstream(&nats.url()).await;
    // An undecodable input among good orders.
    js.publish("tenant.acme.aggregate.Order.bad", "{not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    for i in 0..10u64 {
        let id = format!("o-{i}");
        let ev = aggregate_event(
            "acme",
            "Order",
            &id,
            "OrderPlaced",
            TS + i,
            json!({"customer_id": "c", "amount_cents": 1000 + i, "items": [{"sku": "book", "qty": 1}]}),
        );
        publish_json(&js, &format!("tenant.acme.aggregate.Order.{id}"), &ev).await;
    }
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        10,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(charges.len(), 10);
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.*.deadletter.>",
        1,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(dead.len(), 1, "dead-lettered once, by one partition");
    assert!(
        dead[0].subject.ends_with(".undecodable"),
        "{}",
        dead[0].subject
    );
    runner.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_cuts_its_batches_of_copies_at_the_byte_limit_and_loses_nothing() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let envs = [
        PARTITIONED[0],
        PARTITIONED[1],
        ("RUNNER__SAGA__MAX_BATCH_BYTES", "64KiB"),
    ];
    // A first run sets the streams up; the deposits then wait in the source, so the
    // second run's router reads them all at once and must cut its batches by bytes.
    let first = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "tests/manifests/ledger.yaml",
        &envs,
    );
    let dir = first.stop();
    let (accounts, k) = (4u64, 10u64);
    let pad = "x".repeat(20 * 1024);
    for n in 1..=k {
        for a in 0..accounts {
            let (subject, mut ev) = common::ledger_deposit(a, n);
            ev["payload"]["pad"] = json!(pad);
            publish_json(&js, &subject, &ev).await;
        }
    }
    let runner = RunnerProc::saga(dir, &nats.url(), "tests/manifests/ledger.yaml", &envs);
    let total = (accounts * k) as usize;
    let acks = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.bank.command.Account.*",
        total,
        Duration::from_secs(60),
    )
    .await;
    // Every deposit applied once, in order, per account.
    let mut per: HashMap<String, Vec<u64>> = HashMap::new();
    for a in &acks {
        let n = &a.body["payload"]["n"];
        let n = n
            .as_u64()
            .or_else(|| n.as_str().and_then(|v| v.parse().ok()))
            .unwrap();
        per.entry(a.subject.clone()).or_default().push(n);
    }
    assert_eq!(per.len(), accounts as usize);
    for (subject, ns) in &per {
        assert_eq!(ns, &(1..=k).collect::<Vec<_>>(), "{subject}");
    }
    // Each share's batch ends with a marker on the share's fence: walk the inbox in order
    // and count the copies of each share since its last marker. Each copy is ~20 KiB, so
    // a 64 KiB batch holds three at most.
    let subjects: HashMap<u64, String> = read_stream(&js, "AGGREGATE_EVENTS", ">")
        .await
        .into_iter()
        .map(|m| (m.seq, m.subject))
        .collect();
    let inbox = read_stream(&js, "SAGA_INBOX", ">").await;
    let fence = "runner.fence.SAGA_INBOX.AGGREGATE_EVENTS/";
    let mut open: HashMap<u32, usize> = HashMap::new();
    let (mut copies, mut batches) = (0, 0);
    for m in &inbox {
        if let Some(share) = m.subject.strip_prefix(fence) {
            let n = open.remove(&share.parse().unwrap()).unwrap_or(0);
            assert!(
                n <= 3,
                "{n} copies of ~20 KiB in one batch under a 64 KiB limit"
            );
            batches += usize::from(n > 0);
        } else if m.subject.starts_with("runner.inbox.") {
            let id = m.msg_id.as_deref().unwrap();
            let seq: u64 = id.split(':').nth(1).unwrap().parse().unwrap();
            *open.entry(share_of(&subjects[&seq])).or_default() += 1;
            copies += 1;
        }
    }
    assert!(
        open.values().all(|n| *n == 0),
        "copies no marker covers: {open:?}"
    );
    assert_eq!(copies, total, "each deposit copied once");
    println!("{total} copies of ~20 KiB in {batches} batches under a 64 KiB limit");
    runner.stop();
}

/// Publishes an OrderPlaced for order `id` of tenant acme.
async fn place(js: &async_nats::jetstream::Context, id: &str, at: u64) {
    let ev = aggregate_event(
        "acme",
        "Order",
        id,
        "OrderPlaced",
        at,
        json!({"customer_id": "c", "amount_cents": 1000, "items": [{"sku": "book", "qty": 1}]}),
    );
    publish_json(js, &format!("tenant.acme.aggregate.Order.{id}"), &ev).await;
}

/// How many charge_card commands are stored, once there are `n` (or a minute passed).
async fn charged(js: &async_nats::jetstream::Context, n: usize) -> usize {
    let charges = "tenant.acme.effect.charge_card.*";
    let timeout = Duration::from_secs(60);
    wait_for_messages(js, "WORKFLOW_COMMANDS", charges, n, timeout)
        .await
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_rounds_take_only_the_partitions_that_changed() {
    let nats = NatsServer::start();
    let env = [
        PARTITIONED[0],
        PARTITIONED[1],
        ("RUNNER__PARTITIONS__SNAPSHOT_INTERVAL", "1s"),
    ];
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &env);
    let js = jetstream(&nats.url()).await;
    for i in 0..8 {
        place(&js, &format!("o-{i}"), TS + i).await;
    }
    assert_eq!(charged(&js, 8).await, 8);
    let taken = || common::metrics::metric(&runner.admin, "runner_snapshots_total");
    let age = || {
        common::metrics::metric(
            &runner.admin,
            "runner_snapshot_last_timestamp_seconds{partition=\"0\"}",
        )
    };
    // Rounds run every second: wait until a 3 s window (three rounds) takes nothing.
    let mut before = taken().await;
    let mut settled = false;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let now = taken().await;
        if now == before {
            settled = true;
            break;
        }
        before = now;
    }
    assert!(settled, "snapshot uploads never stopped on an idle node");
    let idle = before;
    assert!(idle >= 64.0, "every partition was snapshotted once: {idle}");
    // An idle partition's snapshot is still current: its time moves without an upload.
    let t0 = age().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        age().await > t0,
        "the skipped partition's snapshot time moves on"
    );
    assert_eq!(
        taken().await,
        idle,
        "nothing uploaded while nothing changed"
    );
    // One new input changes one partition: that one is taken again, and only it.
    place(&js, "o-new", TS + 100).await;
    assert_eq!(charged(&js, 9).await, 9);
    common::wait_until(
        "the changed partition snapshotted",
        Duration::from_secs(30),
        || async { taken().await > idle },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(taken().await, idle + 1.0, "only the changed partition");
    // Four more changes to that partition, a round apart: the round prunes it to the newest
    // three (`partitions.snapshot_keep`), from one listing, and leaves the others' one alone.
    for i in 0..4 {
        place(&js, "o-new", TS + 200 + i).await;
        let want = idle + 2.0 + i as f64;
        common::wait_until(
            "the partition snapshotted again",
            Duration::from_secs(30),
            || async { taken().await >= want },
        )
        .await;
    }
    let bucket = js.get_object_store("RUNNER_SNAPSHOTS").await.unwrap();
    let listed = runner::worker::ownership::snapshot::listing(&bucket)
        .await
        .unwrap();
    let mut kept: Vec<usize> = listed.values().map(Vec::len).collect();
    kept.sort_unstable();
    assert_eq!(kept.len(), 64, "{listed:?}");
    assert_eq!(kept[..63], [1; 63], "{listed:?}");
    assert_eq!(
        kept[63], 3,
        "the changed partition pruned to three: {listed:?}"
    );
    runner.stop();
}
