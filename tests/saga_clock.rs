//! A saga's time is its input's `timestamp_ms`, which the producer sets: the worker applies it
//! within `saga.max_clock_skew` (5 minutes by default) of the time the broker stored the
//! input. An order whose producer's clock says 0 does not have its 15-minute payment timer
//! fire at once (it is due about 10 minutes after the order was stored), and one whose clock
//! says `u64::MAX` gets a due time about 20 minutes out instead of never; single-active and
//! partitioned (where the router carries the source message's stored time to the inbox
//! copy); `runner test` takes a step's time as the stored time. Real binary, real
//! nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// The order saga's payment timeout (manifests/order.yaml).
const PAYMENT_TIMEOUT_MS: u64 = 900_000;
/// The default `saga.max_clock_skew`.
const SKEW_MS: u64 = 300_000;

fn inspect(data_dir: &str, id: &str) -> Value {
    let (code, out) = run_to_exit(
        &[
            "inspect",
            "--data-dir",
            data_dir,
            "--tenant",
            "acme",
            "--saga",
            "order",
            "--id",
            id,
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap()
}

async fn producer_clocks_far_off_are_bounded_by_the_stored_time(env: &[(&str, &str)]) {
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", env);
    let data_dir = runner.data_dir.path().to_str().unwrap().to_string();
    let js = jetstream(&nats.url()).await;
    // (order, the producer's timestamp, where in the window it lands: -1, 0 or +1 skew)
    let orders: [(&str, u64, i8); 3] = [("o-zero", 0, -1), ("o-max", u64::MAX, 1), ("o-now", 0, 0)];
    let mut stored = Vec::new();
    for (id, ts, _) in orders {
        let before = runner::clock::now_ms();
        let ts = if id == "o-now" { before } else { ts };
        let ev = aggregate_event(
            "acme",
            "Order",
            id,
            "OrderPlaced",
            ts,
            json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
        );
        publish_json(&js, &format!("tenant.acme.aggregate.Order.{id}"), &ev).await;
        stored.push((before, runner::clock::now_ms()));
    }
    wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.charge_card.*",
        orders.len(),
        Duration::from_secs(60),
    )
    .await;
    // Long enough for the timer loop (every 200 ms) to fire any timer already due.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let cancels = read_stream(&js, "WORKFLOW_COMMANDS", "tenant.acme.command.Order.*").await;
    assert!(
        cancels.is_empty(),
        "no payment timer fired: {:?}",
        cancels.iter().map(|c| &c.body).collect::<Vec<_>>()
    );
    for ((id, _, edge), (before, after)) in orders.into_iter().zip(stored) {
        let view = inspect(&data_dir, id);
        assert_eq!(
            view["instance"]["state"], "awaiting_payment",
            "{id}: {view}"
        );
        assert_eq!(view["parked_by"], Value::Null, "{id}: {view}");
        let due = view["instance"]["timers"]["payment_timeout"]["due_ms"]
            .as_u64()
            .unwrap_or_else(|| panic!("{id}: no payment timer: {view}"));
        let shift = |t: u64| match edge {
            -1 => t - SKEW_MS,
            1 => t + SKEW_MS,
            _ => t,
        };
        // The broker stored the order between `before` and `after` (same host clock).
        let (lo, hi) = (
            shift(before) + PAYMENT_TIMEOUT_MS,
            shift(after) + PAYMENT_TIMEOUT_MS,
        );
        assert!(
            (lo..=hi).contains(&due),
            "{id}: payment timer due at {due}, expected within {lo}..={hi}"
        );
        let started = view["instance"]["started_ms"].as_u64().unwrap();
        assert_eq!(
            started + PAYMENT_TIMEOUT_MS,
            due,
            "{id}: the instance's clock is the bounded time too"
        );
    }
    drop(runner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_clock_at_zero_or_at_the_end_of_time_is_bounded() {
    producer_clocks_far_off_are_bounded_by_the_stored_time(&[
        ("RUNNER__PARTITIONS__COUNT", "4"),
        ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
    ])
    .await;
}

/// The bound is configured by `saga.max_clock_skew`: a wider one lets a producer backdate
/// further (and a timer then fires as soon as it is due).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_skew_is_configurable() {
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &[("RUNNER__SAGA__MAX_CLOCK_SKEW", "1h")],
    );
    let js = jetstream(&nats.url()).await;
    let ev = aggregate_event(
        "acme",
        "Order",
        "o-old",
        "OrderPlaced",
        runner::clock::now_ms() - PAYMENT_TIMEOUT_MS - 60_000,
        json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
    );
    publish_json(&js, "tenant.acme.aggregate.Order.o-old", &ev).await;
    let cancels = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.command.Order.*",
        1,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(cancels[0].body["payload"]["reason"], "payment_timeout");
    drop(runner);
}

/// `runner test` plays the broker's part: a step's time (`at_ms`, or a second after the
/// previous step) is the stored time, and an event's own `timestamp_ms` is applied within the
/// default skew of it — what an expression reading `event.timestamp_ms` sees, too.
#[test]
fn runner_test_bounds_an_event_s_own_timestamp_by_the_step_time() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("t.yaml"),
        "format: 1
sagas:
  - name: t
    version: 1
    triggers: [{ subject: aggregate.T.*, correlation: event.aggregate_id, start: true }]
    initial_state: s
    states:
      s:
        on:
          Go: { set: { at: \"${ event.timestamp_ms }\" } }
",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("t.tests.yaml"),
        "format: 1
tests:
  - name: a producer clock far off is applied at the edge of the window
    steps:
      - event: { subject: aggregate.T.a, event_type: Go, timestamp_ms: 0 }
        expect: { data: { at: 1699999700000 } }
      - event: { subject: aggregate.T.a, event_type: Go, timestamp_ms: 18446744073709551615 }
        expect: { data: { at: 1700000301000 } }
      - event: { subject: aggregate.T.a, event_type: Go, timestamp_ms: 1700000001234 }
        expect: { data: { at: 1700000001234 } }
      - at_ms: 1800000000000
        event: { subject: aggregate.T.a, event_type: Go }
        expect: { data: { at: 1800000000000 } }
",
    )
    .unwrap();
    let (code, out) = run_to_exit(
        &["test", dir.path().to_str().unwrap()],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.trim_end().ends_with("1 passed, 0 failed"), "{out}");
}
