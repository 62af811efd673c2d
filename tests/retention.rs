//! Nothing grows without bound: stream limits on every stream Runner creates, dead-letter
//! retention and `runner dlq purge`, and removal of finished instances with their dedupe
//! markers kept. Real nats-server, real libmdbx, real binary.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use async_nats::jetstream::stream::DiscardPolicy;
use common::*;
use runner::deadletter::{self, Purge, kind};
use runner::manifest::load_str;
use runner::worker::process::{Limits, Processor, RawInput, Scope};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_runner_creates_have_limits() {
    let nats = NatsServer::start();
    let _runner = RunnerProc::start(
        &["--nats-url", &nats.url(), "--manifest", "manifests"],
        &[
            ("RUNNER__STREAMS__MAX_AGE", "2h"),
            ("RUNNER__STREAMS__MAX_BYTES", "64MiB"),
        ],
    );
    let js = jetstream(&nats.url()).await;
    for name in [
        "AGGREGATE_EVENTS",
        "WORKFLOW_COMMANDS",
        "WORKFLOW_EVENTS",
        "SAGA_INBOX",
    ] {
        let c = js
            .get_stream(name)
            .await
            .unwrap()
            .cached_info()
            .config
            .clone();
        assert_eq!(c.max_age, Duration::from_secs(7200), "{name}");
        assert_eq!(c.max_bytes, 64 * 1024 * 1024, "{name}");
        assert_eq!(
            c.discard,
            DiscardPolicy::New,
            "{name}: never drop what is not consumed"
        );
    }
    let dlq = js
        .get_stream("RUNNER_DLQ")
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    assert_eq!(dlq.max_age, Duration::from_secs(30 * 24 * 3600));
    assert_eq!(dlq.max_bytes, 256 * 1024 * 1024);
    assert_eq!(
        dlq.discard,
        DiscardPolicy::Old,
        "dead letters never block the outputs"
    );
}

fn order(tenant: &str, id: &str, items: serde_json::Value, seq: u64) -> RawInput {
    let mut body = json!({
        "v": 1, "event_id": format!("ev-{id}"), "tenant_id": tenant,
        "event_type": "OrderPlaced", "aggregate_type": "Order", "aggregate_id": id,
        "timestamp_ms": 1_700_000_000_000u64, "metadata": {},
        "payload": {"customer_id": "c", "amount_cents": 100, "items": items},
    });
    if items.is_null() {
        // No items at all: the order's guard fails to evaluate (an expression error).
        body["payload"].as_object_mut().unwrap().remove("items");
    }
    RawInput {
        subject: format!("tenant.{tenant}.aggregate.Order.{id}"),
        body: serde_json::to_vec(&body).unwrap().into(),
        traceparent: None,
        header_bytes: 0,
        refused: None,
        live_cap: None,
        timer_cap: None,
        source: format!("AGGREGATE_EVENTS:{seq}"),
        stored_ms: None,
    }
}

#[test]
fn finished_instances_and_old_dead_letters_go_and_what_must_stay_stays() {
    let catalog = load_str(&[("order.yaml", include_str!("../manifests/order.yaml"))])
        .catalog
        .unwrap();
    let limits = Limits {
        allowed_tenants: Vec::new(),
        max_message_bytes: 1 << 20,
        max_payload: 1 << 20,
        max_output_bytes: usize::MAX,
        max_clock_skew_ms: runner::saga::DEFAULT_MAX_CLOCK_SKEW_MS,
        seal: runner::seal::Seal::none(),
    };
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let now = runner::clock::now_ms();
    let apply = |inputs: Vec<RawInput>| {
        store
            .write_blocking(|t| {
                let mut p = Processor::new(&catalog, &limits, now, Scope::whole());
                for r in &inputs {
                    p.input(t, r)?;
                }
                Ok(())
            })
            .unwrap();
    };
    let line = json!([{"sku": "s", "qty": 1}]);
    apply(vec![
        order("acme", "done", json!([]), 1), // rejected at once: finished (failed)
        order("acme", "open", line, 2),      // waits for its payment: running
        order("acme", "bad", json!({}), 3),  // finished (rejected); parked below
        RawInput {
            subject: "tenant.acme.aggregate.Order.x".into(),
            body: b"not json".to_vec().into(),
            traceparent: None,
            header_bytes: 0,
            refused: None,
            live_cap: None,
            timer_cap: None,
            source: "AGGREGATE_EVENTS:4".into(),
            stored_ms: None,
        },
    ]);
    // A poison input of an instance `bad`, which parks its key.
    store
        .write_blocking(|t| {
            let route = runner::saga::Route {
                saga: "order".into(),
                correlation_id: "bad".into(),
            };
            deadletter::record(
                t,
                deadletter::Poison {
                    refused: deadletter::Refused {
                        tenant: "acme",
                        kind: kind::EXPRESSION,
                        reason: "a guard failed",
                        subject: "tenant.acme.aggregate.Order.bad",
                        source: "AGGREGATE_EVENTS:3",
                        body: b"{}",
                        at_ms: now,
                    },
                    traceparent: None,
                    route: Some(&route),
                    outbox: (runner::storage::tables::DEFAULT_PARTITION, (0, 0)),
                    stored_ms: None,
                },
            )
        })
        .unwrap();
    let kinds: Vec<String> = deadletter::list(&store, None, true)
        .unwrap()
        .into_iter()
        .map(|d| d.kind)
        .collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");

    // The instance sweep removes only the finished instance, with its history.
    let (removed, next) = store
        .write_blocking(|t| t.sweep_finished(now + 1, &[], 10_000))
        .unwrap();
    assert_eq!((removed, next), (1, None), "only `done`");
    let left: Vec<String> = store
        .read_blocking(|t| t.instances())
        .unwrap()
        .into_iter()
        .map(|i| i.correlation_id)
        .collect();
    // `bad` finished too (rejected), but its key is parked behind a dead letter: kept.
    assert_eq!(left, ["bad", "open"]);
    assert!(
        store
            .read_blocking(|t| t.history("acme", "order", "done"))
            .unwrap()
            .is_empty()
    );
    // Its dedupe marker stays: the same event again is a duplicate, not a new order.
    apply(vec![order("acme", "done", json!([]), 5)]);
    assert!(
        store
            .read_blocking(|t| t.instance("acme", "order", "done"))
            .unwrap()
            .is_none()
    );

    // Retention: the undecodable entry goes, the one parking `bad` stays.
    let gone = deadletter::purge(
        &store,
        &Purge {
            before_ms: Some(now + 1),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(gone.len(), 1);
    assert_eq!(gone[0].kind, kind::UNDECODABLE);
    let kept = deadletter::list(&store, None, true).unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].correlation_id.as_deref(), Some("bad"));
    drop(store);

    // The operator's command: a dry run lists it, --force removes it and unparks the key.
    let data = dir.path().to_str().unwrap();
    let (code, out) = run_to_exit(
        &["dlq", "purge", "--data-dir", data, "--force", "--dry-run"],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("1 dead letter(s) would be removed"), "{out}");
    let (code, out) = run_to_exit(
        &["dlq", "purge", "--data-dir", data, "--tenant", "acme"],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("0 dead letter(s) removed"),
        "a parking entry needs --force: {out}"
    );
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "purge",
            "--data-dir",
            data,
            "--force",
            "--older-than",
            "1m",
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("0 dead letter(s) removed"),
        "it is younger than a minute: {out}"
    );
    let (code, out) = run_to_exit(
        &["dlq", "purge", "--data-dir", data, "--force"],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("1 dead letter(s) removed"), "{out}");
    let store = open_store(dir.path());
    assert!(
        store
            .read_blocking(|t| t.parked_by("acme", "order", "bad"))
            .unwrap()
            .is_none()
    );
}
