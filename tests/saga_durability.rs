//! Timers across restarts, cancelled timers, and a NATS outage mid-run.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    NatsServer, RunnerProc, aggregate_event, effect_result, jetstream, publish_json, read_stream,
    wait_for_messages,
};
use serde_json::json;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn placed(id: &str, ts: u64) -> (String, serde_json::Value) {
    let ev = aggregate_event(
        "acme",
        "Order",
        id,
        "OrderPlaced",
        ts,
        json!({
            "customer_id": "c", "amount_cents": 500, "items": [{"sku": "s", "qty": 1}],
        }),
    );
    (format!("tenant.acme.aggregate.Order.{id}"), ev)
}

fn start(dir: tempfile::TempDir, url: &str) -> RunnerProc {
    RunnerProc::saga(dir, url, "manifests", &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timers_survive_a_restart_and_cancelled_ones_never_fire() {
    let nats = NatsServer::start();
    let url = nats.url();
    let runner = start(tempfile::tempdir().unwrap(), &url);
    let js = jetstream(&url).await;

    // The payment timeout is 15 minutes after the order's own timestamp: place the orders
    // 15 minutes minus 6 seconds ago so the timers fall due in about 6 seconds.
    let ts = now_ms() - 900_000 + 6_000;
    for id in ["o-late", "o-paid"] {
        let (s, b) = placed(id, ts);
        publish_json(&js, &s, &b).await;
    }
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        2,
        Duration::from_secs(30),
    )
    .await;
    let paid = charges
        .iter()
        .find(|c| c.body["payload"]["order_id"] == "o-paid")
        .unwrap();
    let (s, b) = effect_result(
        &paid.body,
        "Succeeded",
        ts + 1_000,
        json!({"payment_id": "p-1"}),
    );
    publish_json(&js, &s, &b).await;
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.reserve_stock.*",
        1,
        Duration::from_secs(30),
    )
    .await;

    // Restart before the timers are due: they are in libmdbx, not in memory.
    let dir = runner.kill();
    let pending = {
        let store = common::open_store(dir.path());
        store.read_blocking(|t| t.timers_pending()).unwrap()
    };
    assert_eq!(
        pending, 1,
        "o-late's timer pending; o-paid's was cancelled by the payment"
    );
    let runner = start(dir, &url);

    let cancels = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.command.Order.*",
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(cancels[0].subject, "tenant.acme.command.Order.o-late");
    assert_eq!(cancels[0].body["payload"]["reason"], "payment_timeout");
    // Well past both due times, o-paid's cancelled timer has still not fired.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let commands = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.acme.command.Order.*").await;
    assert_eq!(commands.len(), 1, "{commands:?}");

    let metrics = common::get_text(&format!("{}/metrics", runner.admin)).await;
    assert!(metrics.contains("runner_timers_fired_total 1"), "{metrics}");
    assert!(metrics.contains("runner_timer_fire_lag_seconds_count 1"));
    assert!(metrics.contains("runner_timers_pending 0"));
    let dir = runner.stop();

    // inspect shows the instance with its transitions.
    let (code, out) = common::run_to_exit(
        &[
            "inspect",
            "--tenant",
            "acme",
            "--saga",
            "order",
            "--id",
            "o-late",
            "--data-dir",
            dir.path().to_str().unwrap(),
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    let view: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(view["instance"]["state"], "cancelled");
    assert_eq!(view["instance"]["version"], 1);
    let events: Vec<_> = view["recent_transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["OrderPlaced", "timer.payment_timeout"]);
    assert_eq!(view["timers"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_outage_mid_run_loses_and_duplicates_nothing() {
    let mut nats = NatsServer::start();
    let url = nats.url();
    let runner = start(tempfile::tempdir().unwrap(), &url);
    let total = 600;
    {
        let js = jetstream(&url).await;
        for i in 0..total / 2 {
            let (s, b) = placed(&format!("o-{i}"), 1_800_000_000_000 + i);
            publish_json(&js, &s, &b).await;
        }
    }
    // Stop NATS while the first half is in flight, then bring it back.
    nats.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    nats.start_again();
    let js = jetstream(&url).await;
    for i in total / 2..total {
        let (s, b) = placed(&format!("o-{i}"), 1_800_000_000_000 + i);
        publish_json(&js, &s, &b).await;
    }
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        total as usize,
        Duration::from_secs(60),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let charges_after = read_stream(&js, "WORKFLOW_COMMANDS", ">").await;
    assert_eq!(charges.len(), total as usize);
    assert_eq!(charges_after.len(), total as usize, "duplicates appeared");
    let mut ids: Vec<_> = charges_after
        .iter()
        .map(|c| c.body["payload"]["order_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), total as usize);
    runner.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_mid_run_flushes_the_outbox_and_a_restart_finishes_the_rest() {
    let nats = NatsServer::start();
    let url = nats.url();
    let js = jetstream(&url).await;
    let total = 3000u64;
    // A first start creates the streams; then a backlog is published while no runner runs,
    // so the next start is in the middle of it when the drain comes.
    let dir = start(tempfile::tempdir().unwrap(), &url).stop();
    let mut pending = Vec::new();
    for i in 0..total {
        let (s, b) = placed(&format!("o-{i}"), 1_800_000_000_000 + i);
        let mut h = async_nats::HeaderMap::new();
        h.insert(
            async_nats::header::NATS_MESSAGE_ID,
            b["event_id"].as_str().unwrap(),
        );
        pending.push(
            js.publish_with_headers(s, h, serde_json::to_vec(&b).unwrap().into())
                .await
                .unwrap(),
        );
    }
    for p in pending {
        p.await.unwrap();
    }
    let runner = start(dir, &url);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let dir = runner.stop();
    let (checkpoint, depth) = {
        let store = common::open_store(dir.path());
        store
            .read_blocking(|t| {
                Ok((
                    t.checkpoint("runner-saga:AGGREGATE_EVENTS")?,
                    t.outbox_depth()?,
                ))
            })
            .unwrap()
    };
    let published = read_stream(&js, "WORKFLOW_COMMANDS", ">").await.len() as u64;
    eprintln!(
        "drained at checkpoint {checkpoint} of {total}; depth {depth}; published {published}"
    );
    assert_eq!(depth, 0, "the drain flushed the outbox");
    // Everything applied before the drain is on the stream already.
    assert_eq!(published, checkpoint);
    // The restart takes up exactly where the drain stopped.
    let runner = start(dir, &url);
    let all = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        ">",
        total as usize,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(all.len() as u64, total);
    runner.stop();
}
