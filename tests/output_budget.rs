//! No single message can stop the outputs (finding: one oversized record made the relay
//! retry forever, across restarts). Real binary, real nats-server, real libmdbx.
//!
//! - a 400 KB undecodable body of control bytes, and an 8 MB body on a server whose
//!   `max_payload` is 8 MB: each is dead-lettered with a bounded excerpt and its source;
//! - a valid order whose `charge_card` command would be larger than the broker takes: it
//!   is dead-lettered at commit (`too_large`) and nothing is charged;
//! - a record already in the outbox that the broker can never take (written before the
//!   commit check existed): the relay parks it, dead-letters it, `/health` says degraded,
//!   and everything behind it is published.
//!
//! After each, later orders are charged, also after a restart.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn order(id: &str, customer: &str) -> (String, serde_json::Value) {
    let ev = aggregate_event(
        "acme",
        "Order",
        id,
        "OrderPlaced",
        runner::clock::now_ms(),
        json!({"customer_id": customer, "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
    );
    (format!("tenant.acme.aggregate.Order.{id}"), ev)
}

async fn publish_raw(js: &async_nats::jetstream::Context, subject: &str, body: Vec<u8>) {
    js.publish(subject.to_string(), body.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

async fn charges(js: &async_nats::jetstream::Context, n: usize) -> Vec<Seen> {
    wait_for_messages(
        js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        n,
        Duration::from_secs(60),
    )
    .await
}

async fn good_orders(js: &async_nats::jetstream::Context, ids: std::ops::Range<u32>) {
    for i in ids {
        let (s, b) = order(&format!("g-{i}"), "c");
        publish_json(js, &s, &b).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_inputs_and_outputs_are_dead_lettered_and_the_rest_flows() {
    let nats = NatsServer::start_with("max_payload: 8MB\n");
    let js = jetstream(&nats.url()).await;
    // Default limits: bodies up to 1 MiB.
    let mut runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);

    // 400 KB of control bytes: undecodable; its dead letter once escaped would be 2.4 MB.
    publish_raw(&js, "tenant.acme.aggregate.Order.cc", vec![1u8; 400_000]).await;
    // 8 MB of JSON on a server that takes 8 MB messages: too large for the saga worker.
    let mut big = order("big", "c").1;
    big["payload"]["blob"] = json!("x".repeat(8_000_000));
    publish_raw(
        &js,
        "tenant.acme.aggregate.Order.big",
        serde_json::to_vec(&big).unwrap(),
    )
    .await;
    good_orders(&js, 0..5).await;
    charges(&js, 5).await;

    // Restarted on the same store with bodies up to the server's limit: a valid order whose
    // charge command (it copies the customer id) would be larger than the broker takes.
    runner.signal("TERM");
    assert_eq!(runner.wait_exit(Duration::from_secs(30)), Some(0));
    let env = [("RUNNER__SAGA__MAX_MESSAGE_BYTES", "8MiB")];
    let _runner = RunnerProc::saga(runner.kill(), &nats.url(), "manifests", &env);
    let (s, b) = order("huge", &"c".repeat(8 * 1024 * 1024 - 1_500));
    publish_raw(&js, &s, serde_json::to_vec(&b).unwrap()).await;
    good_orders(&js, 5..10).await;

    let got = charges(&js, 10).await;
    let charged: Vec<&str> = got
        .iter()
        .map(|m| m.body["payload"]["order_id"].as_str().unwrap())
        .collect();
    assert!(
        charged.iter().all(|id| id.starts_with("g-")),
        "only the good orders were charged: {charged:?}"
    );
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.>",
        3,
        Duration::from_secs(30),
    )
    .await;
    for d in &dead {
        let len = serde_json::to_vec(&d.body).unwrap().len();
        assert!(
            len < 64 * 1024,
            "dead letter of {} is {len} bytes",
            d.subject
        );
        let source = d.body["source"].as_str().unwrap();
        assert!(source.starts_with("AGGREGATE_EVENTS:"), "{source}");
    }
    let by_id = |id: &str| {
        dead.iter()
            .find(|d| d.body["subject"] == format!("tenant.acme.aggregate.Order.{id}"))
            .unwrap_or_else(|| panic!("no dead letter for {id}"))
    };
    let cc = by_id("cc");
    assert_eq!(cc.body["kind"], "undecodable");
    assert_eq!(cc.body["body_bytes"], 400_000);
    let big = by_id("big");
    assert_eq!(big.body["kind"], "too_large");
    // Refused by its router: the letter keeps the start of the body and names the size;
    // the whole input stays in the source stream, at `source`.
    let why = big.body["reason"].as_str().unwrap();
    let size: u64 = why
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .max()
        .unwrap_or(0);
    assert!(size > 8_000_000, "{why}");
    assert!(
        !big.body["body"].as_str().unwrap_or("").is_empty(),
        "{}",
        big.body
    );
    let huge = by_id("huge");
    assert_eq!(huge.body["kind"], "too_large");
    assert_eq!(huge.body["correlation_id"], "huge");
    let reason = huge.body["reason"].as_str().unwrap();
    assert!(reason.contains("effect.charge_card"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_record_the_broker_can_never_take_is_parked_and_the_relay_goes_on() {
    use runner::storage::tables::{DEFAULT_PARTITION, OutboxRecord};
    let nats = NatsServer::start(); // max_payload 1 MB
    let js = jetstream(&nats.url()).await;
    let dir = tempfile::tempdir().unwrap();
    {
        // Written as a build without the commit-time check could have written it.
        let store = open_store(dir.path());
        store
            .write_blocking(|t| {
                t.push_outbox(
                    DEFAULT_PARTITION,
                    &OutboxRecord {
                        subject: "tenant.acme.effect.charge_card.stuck".into(),
                        msg_id: "stuck".into(),
                        tenant: "acme".into(),
                        traceparent: None,
                        body: format!("{{\"blob\":\"{}\"}}", "x".repeat(2_000_000)),
                        cause: (0, 0),
                    },
                )
            })
            .unwrap();
    }
    let runner = RunnerProc::saga(dir, &nats.url(), "manifests", &[]);
    good_orders(&js, 0..5).await;
    charges(&js, 5).await;
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.unpublishable",
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        dead[0].body["subject"],
        "tenant.acme.effect.charge_card.stuck"
    );
    assert_eq!(dead[0].body["body_bytes"], 2_000_011);
    let health = get_json(&format!("{}/health", runner.admin)).await;
    assert_eq!(health["status"], "degraded", "{health}");
    assert_eq!(health["relay"]["parked_outputs"], 1, "{health}");

    // Still degraded after a restart: the parked output is pending until handled.
    let runner = RunnerProc::saga(runner.stop(), &nats.url(), "manifests", &[]);
    let health = get_json(&format!("{}/health", runner.admin)).await;
    assert_eq!(health["status"], "degraded", "{health}");
    good_orders(&js, 5..7).await;
    charges(&js, 7).await;
}
