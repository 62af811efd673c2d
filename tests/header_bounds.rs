//! Every bound counts the whole message, headers included (finding: one order with a 60 KB
//! `traceparent` made every output 144 B over `max_payload`; the relay retried forever and
//! `/health` said "ok"; in partitioned mode an input within a few hundred bytes of
//! `max_payload` made the router's copy too large and stopped routing for every tenant).
//! Real binary, real nats-server, real libmdbx.
//!
//! - a valid order with a 60 KB `traceparent`, one with a 60 KB header of another name, and
//!   one with a valid trace context: all charged, the oversized trace context dropped, the
//!   valid one passed on; every later order charged; `/health` ok with nothing stalled;
//! - an order whose headers alone pass `saga.max_message_bytes`: dead-lettered `too_large`
//!   naming the header bytes, and the rest flows;
//! - partitioned: an order whose routed copy the inbox could not take: dead-lettered
//!   `too_large` with its source, and routing goes on.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

const VALID_TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

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

/// Publishes order `id` with the extra header `name: value`.
async fn publish_with(js: &async_nats::jetstream::Context, id: &str, name: &str, value: &str) {
    let (subject, body) = order(id);
    let mut h = async_nats::HeaderMap::new();
    h.insert(name, value);
    js.publish_with_headers(subject, h, serde_json::to_vec(&body).unwrap().into())
        .await
        .unwrap()
        .await
        .unwrap();
}

async fn good_orders(js: &async_nats::jetstream::Context, ids: std::ops::Range<u32>) {
    for i in ids {
        let (s, b) = order(&format!("g-{i}"));
        publish_json(js, &s, &b).await;
    }
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

fn charge_of<'a>(seen: &'a [Seen], id: &str) -> &'a Seen {
    seen.iter()
        .find(|m| m.body["payload"]["order_id"] == id)
        .unwrap_or_else(|| panic!("no charge for {id}"))
}

async fn assert_healthy(admin: &str) {
    let health = get_json(&format!("{admin}/health")).await;
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(health["stalled"], json!([]), "{health}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_foreign_headers_never_reach_an_output_and_every_order_flows() {
    // As in the finding: a 60 KB trace context fits the server's 64 KB max_payload with the
    // order, and would not with Runner's own headers on every output.
    let nats = NatsServer::start_with("max_payload: 65536\n");
    let js = jetstream(&nats.url()).await;
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);

    let huge_tp = format!("{VALID_TP}{}", "0".repeat(60_000));
    publish_with(&js, "tp", "traceparent", &huge_tp).await;
    publish_with(&js, "junk", "x-junk", &"j".repeat(60_000)).await;
    publish_with(&js, "traced", "traceparent", VALID_TP).await;
    good_orders(&js, 0..20).await;

    let got = charges(&js, 23).await;
    assert_eq!(charge_of(&got, "tp").traceparent, None);
    assert_eq!(charge_of(&got, "junk").traceparent, None);
    assert_eq!(
        charge_of(&got, "traced").traceparent.as_deref(),
        Some(VALID_TP)
    );
    for c in &got {
        let tp = c.traceparent.as_deref().unwrap_or_default();
        assert!(
            tp.len() <= 55,
            "{} carries {} bytes of trace context",
            c.subject,
            tp.len()
        );
    }
    let dead = read_stream(&js, "RUNNER_DLQ", "tenant.acme.deadletter.>").await;
    assert!(dead.is_empty(), "nothing is dead-lettered: {dead:?}");
    assert_healthy(&runner.admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_whose_headers_pass_the_limit_is_dead_lettered_and_the_rest_flows() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let env = [("RUNNER__SAGA__MAX_MESSAGE_BYTES", "32KiB")];
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &env);

    // A small body under 40 KB of headers: 40 KB more than a body-only bound would see.
    publish_with(&js, "heavy", "x-junk", &"j".repeat(40_000)).await;
    good_orders(&js, 0..5).await;
    let got = charges(&js, 5).await;
    assert!(
        got.iter().all(|c| c.body["payload"]["order_id"] != "heavy"),
        "the oversized order is not charged"
    );
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.too_large",
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(dead[0].body["subject"], "tenant.acme.aggregate.Order.heavy");
    let reason = dead[0].body["reason"].as_str().unwrap();
    assert!(reason.contains("of headers"), "{reason}");
    assert!(reason.contains("32768"), "{reason}");
    assert_healthy(&runner.admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_a_copy_the_inbox_cannot_take_is_dead_lettered_and_routing_goes_on() {
    let nats = NatsServer::start(); // max_payload 1 MB: the default saga.max_message_bytes
    let js = jetstream(&nats.url()).await;
    let env = [
        ("RUNNER__PARTITIONS__COUNT", "8"),
        ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
    ];
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &env);

    // Within 300 bytes of max_payload: admitted as published, but its copy into the inbox
    // (routing, trace and batch headers) would pass max_payload.
    let (subject, mut body) = order("edge");
    let max = js.client().server_info().max_payload;
    let bare = serde_json::to_vec(&body).unwrap().len();
    body["payload"]["pad"] = json!("p".repeat(max - 300 - bare - 10));
    let bytes = serde_json::to_vec(&body).unwrap();
    assert!(
        bytes.len() > max - 320 && bytes.len() <= max - 290,
        "{}",
        bytes.len()
    );
    js.publish(subject, bytes.into())
        .await
        .unwrap()
        .await
        .unwrap();
    good_orders(&js, 0..10).await;

    let got = charges(&js, 10).await;
    assert!(got.iter().all(|c| c.body["payload"]["order_id"] != "edge"));
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.too_large",
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(dead[0].body["subject"], "tenant.acme.aggregate.Order.edge");
    let reason = dead[0].body["reason"].as_str().unwrap();
    assert!(reason.contains("copy into the saga inbox"), "{reason}");
    let source = dead[0].body["source"].as_str().unwrap();
    assert!(source.starts_with("AGGREGATE_EVENTS:"), "{source}");
    assert_healthy(&runner.admin).await;
}

/// A relay that fails on every attempt (here the commands stream was sealed under it, so
/// every publish is refused) is reported: `/health` degraded with the stage and its last
/// error, and `runner_pipeline_stalled_stages` counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_refused_on_every_attempt_makes_health_degraded() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);
    good_orders(&js, 0..1).await;
    charges(&js, 1).await;
    assert_healthy(&runner.admin).await;
    // Every partition raised its fence in the stream before it is sealed.
    wait_until("every partition owned", Duration::from_secs(30), || async {
        common::metrics::metric(&runner.admin, "runner_partitions_owned").await == 64.0
    })
    .await;

    let mut stream = js.get_stream("WORKFLOW_COMMANDS").await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.sealed = true;
    js.update_stream(config).await.unwrap();
    good_orders(&js, 1..2).await;

    let health = wait_until_json(&format!("{}/health", runner.admin), |h| {
        h["status"] == "degraded"
    })
    .await;
    assert!(
        health["stalled"][0]["stage"]
            .as_str()
            .is_some_and(|s| s.starts_with("relay.p")),
        "a partition's relay: {health}"
    );
    assert!(
        health["stalled"][0]["seconds"].as_u64().unwrap() >= 30,
        "{health}"
    );
    assert!(
        !health["stalled"][0]["last_error"]
            .as_str()
            .unwrap()
            .is_empty(),
        "{health}"
    );
    let metrics = reqwest::get(format!("{}/metrics", runner.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("runner_pipeline_stalled_stages 1"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("stalled"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Polls `url` until `done` holds for its JSON (90 s at most).
async fn wait_until_json(
    url: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let v = get_json(url).await;
        if done(&v) {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "never: {v}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
