//! Routers read only what the loaded triggers can want. A source's router asks nats-server
//! for the one filter that covers the triggers on that source, so messages no saga names
//! (another aggregate type, workflow events nobody reacts to) are skipped by the server.
//! They are not delivered to each share and dropped there.
//!
//! What the server skipped is still covered by the share's fence watermark once the router
//! is idle. So a reload that adds a trigger routes what arrives after it, not the source's
//! history since the last input that was wanted.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, RunnerProc, get_text, jetstream, post_json, publish_json, saga_progress};
use serde_json::json;

/// A workflow event on `tenant.bank.workflow_event.audit.<id>`, which no saga in
/// `order.yaml` names.
fn audit_event(id: &str) -> (String, serde_json::Value) {
    (
        format!("tenant.bank.workflow_event.audit.{id}"),
        json!({
            "v": 1,
            "event_id": format!("audit-{id}"),
            "event_type": "Noted",
            "tenant_id": "bank",
            "correlation_id": id,
            "timestamp_ms": 1_800_000_000_000u64,
            "payload": {},
        }),
    )
}

/// An aggregate event of a type no loaded saga names.
fn customer_event(id: &str) -> (String, serde_json::Value) {
    let ev = common::aggregate_event(
        "bank",
        "Customer",
        id,
        "Renamed",
        1_800_000_000_000,
        json!({}),
    );
    (format!("tenant.bank.aggregate.Customer.{id}"), ev)
}

/// A saga that answers each `Noted` audit event with one `Audit.Record` command.
const AUDIT: &str = r#"format: 1
sagas:
  - name: audit
    version: 1
    triggers:
      - subject: workflow_event.audit.*
        event_type: Noted
        correlation: event.event_id
        start: true
    initial_state: open
    states:
      open:
        on:
          Noted:
            - emit:
                - command:
                    aggregate_type: Audit
                    command: Record
                    aggregate_id: ${ event.event_id }
                    payload: {}
              goto: done
      done:
        terminal: true
        outcome: completed
"#;

/// A server and a saga node whose manifest directory holds `order.yaml`: its triggers name
/// `aggregate.Order.*` on the aggregate stream and effect results on the workflow-events
/// stream. The directory is returned so that a test can add a manifest and reload.
async fn start() -> (
    NatsServer,
    tempfile::TempDir,
    RunnerProc,
    async_nats::jetstream::Context,
) {
    let nats = NatsServer::start();
    let dir = common::manifest_copy(&["order.yaml"]);
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        dir.path().to_str().unwrap(),
        &[],
    );
    let js = jetstream(&nats.url()).await;
    (nats, dir, runner, js)
}

async fn last_sequence(js: &async_nats::jetstream::Context, stream: &str) -> u64 {
    let mut s = js.get_stream(stream).await.unwrap();
    s.info().await.unwrap().state.last_sequence
}

/// Waits until the node has routed `stream` through its last sequence, which is what its
/// routers' watermarks say once everything in it is covered.
async fn wait_covered(admin: &str, js: &async_nats::jetstream::Context, stream: &str) {
    let last = last_sequence(js, stream).await;
    common::wait_until(
        &format!("{stream} routed through its last sequence {last}"),
        Duration::from_secs(30),
        || async { saga_progress(admin, stream).await.0 >= last },
    )
    .await;
}

/// Places order `o-1` and waits for its charge command: proof that the aggregate stream
/// is routed.
async fn order_and_wait(js: &async_nats::jetstream::Context) {
    let ev = common::aggregate_event(
        "bank",
        "Order",
        "o-1",
        "OrderPlaced",
        1_800_000_000_000,
        json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "a", "qty": 1}]}),
    );
    publish_json(js, "tenant.bank.aggregate.Order.o-1", &ev).await;
    common::wait_for_messages(
        js,
        "WORKFLOW_COMMANDS",
        "tenant.bank.effect.charge_card.>",
        1,
        Duration::from_secs(30),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_no_trigger_names_are_not_delivered_and_are_still_covered() {
    let (_nats, _dir, runner, js) = start().await;
    let admin = runner.admin.clone();
    for i in 0..200 {
        let (s, b) = customer_event(&format!("c{i}"));
        publish_json(&js, &s, &b).await;
        let (s, b) = audit_event(&format!("w{i}"));
        publish_json(&js, &s, &b).await;
    }
    order_and_wait(&js).await;
    // Both sources are covered through their ends, including the 400 messages no saga
    // names, which the routers never read: none of them was counted as read and unrouted.
    wait_covered(&admin, &js, "AGGREGATE_EVENTS").await;
    wait_covered(&admin, &js, "WORKFLOW_EVENTS").await;
    let metrics = get_text(&format!("{admin}/metrics")).await;
    assert_eq!(
        common::scaleout::metric(&metrics, "runner_saga_unrouted_total"),
        0.0,
        "the server skipped what no trigger names"
    );
    assert_eq!(
        common::scaleout::metric(&metrics, "runner_saga_inputs_total"),
        1.0,
        "one order applied, nothing else"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_adds_a_trigger_routes_what_comes_after_it_not_the_history() {
    let (_nats, dir, mut runner, js) = start().await;
    let admin = runner.admin.clone();
    for i in 0..50 {
        let (s, b) = audit_event(&format!("old{i}"));
        publish_json(&js, &s, &b).await;
    }
    order_and_wait(&js).await;
    wait_covered(&admin, &js, "WORKFLOW_EVENTS").await;

    // A saga that reacts to audit events is added and the manifests reloaded.
    std::fs::write(dir.path().join("audit.yaml"), AUDIT).unwrap();
    let (status, body) = post_json(&format!("{admin}/admin/reload"), &json!({})).await;
    assert_eq!(status, 200, "reload: {body}");
    // Published at once: a share that has not yet seen the reload must not cover them.
    for i in 0..5 {
        let (s, b) = audit_event(&format!("new{i}"));
        publish_json(&js, &s, &b).await;
    }
    runner.wait_for_log("want other inputs of this source", Duration::from_secs(30));
    common::wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.bank.command.Audit.>",
        5,
        Duration::from_secs(30),
    )
    .await;
    // Routing settles: the new events are applied and nothing older follows them.
    wait_covered(&admin, &js, "WORKFLOW_EVENTS").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut ids = common::read_stream(&js, "WORKFLOW_COMMANDS", "tenant.bank.command.Audit.>")
        .await
        .into_iter()
        .map(|m| {
            m.body["aggregate_id"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect::<Vec<_>>();
    ids.sort();
    assert_eq!(
        ids,
        (0..5).map(|i| format!("audit-new{i}")).collect::<Vec<_>>(),
        "only the audit events published after the reload reach the new saga"
    );
}
