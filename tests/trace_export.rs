//! Span export end to end: a runner in combined mode exports one span per hop to a real
//! OTLP/HTTP receiver, and the spans of one input form one trace — input → route →
//! transition → outbox publication → effect execution → each upstream call (whose
//! `traceparent` header the upstream really received) → result (straight into the
//! partition's inbox, no route hop) → next transition → its publication — each the child of
//! the one before, with the messages on the broker naming the spans. An input without trace
//! context starts a trace of its own, rooted at its route.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::otlp::{Received, Receiver};
use common::upstream::{Reply, Upstream};
use common::{NatsServer, RunnerProc, Seen, aggregate_event, jetstream, wait_for_messages};
use serde_json::json;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const INPUT_SPAN: &str = "00f067aa0ba902b7";

/// A saga that calls an HTTP effect and, on its result, sends a command.
fn manifest(upstream: &str) -> String {
    format!(
        r#"format: 1
effects:
  - name: ping
    provider: http
    settings:
      url: {upstream}/ping
      method: POST
    retry: {{ retry_limit: 2, base_backoff: 10, max_backoff: 50 }}
sagas:
  - name: traced
    version: 1
    triggers:
      - subject: aggregate.Job.*
        event_type: JobStarted
        correlation: event.aggregate_id
        start: true
      - subject: effect_result.ping.*
        correlation: event.metadata.correlation_id
    data:
      job: ${{ event.aggregate_id }}
    initial_state: new
    states:
      new:
        on:
          JobStarted:
            emit:
              - effect:
                  name: ping
                  payload: {{ job: "${{ state.job }}" }}
            goto: pinging
      pinging:
        on:
          ping.Succeeded:
            emit:
              - command:
                  aggregate_type: Job
                  command: Finish
                  aggregate_id: ${{ state.job }}
                  payload: {{}}
            goto: done
      done:
        terminal: true
"#
    )
}

/// The one span named `name` whose parent is `parent` (and which `also` accepts).
fn child<'a>(
    spans: &'a [Received],
    name: &str,
    parent: &str,
    also: impl Fn(&Received) -> bool,
) -> &'a Received {
    let found: Vec<_> = spans
        .iter()
        .filter(|s| s.name == name && s.parent == parent && also(s))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{name} under {parent}: {found:#?}\nall spans: {spans:#?}"
    );
    found[0]
}

fn tp(trace: &str, span: &str) -> String {
    format!("00-{trace}-{span}-01")
}

async fn publish_job(js: &async_nats::jetstream::Context, job: &str, traceparent: Option<&str>) {
    let ev = aggregate_event("t", "Job", job, "JobStarted", 1_800_000_000_000, json!({}));
    let subject = format!("tenant.t.aggregate.Job.{job}");
    common::publish_traced(js, &subject, &ev, traceparent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_follows_an_input_through_every_hop() {
    let nats = NatsServer::start();
    let receiver = Receiver::start().await;
    // The first call of each command fails (503), the second succeeds: two attempts.
    let upstream = Upstream::start(Arc::new(|_, _, nth| {
        if nth == 1 {
            Reply::status(503)
        } else {
            Reply::ok(json!({ "pong": true }))
        }
    }))
    .await;
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(
        manifests.path().join("traced.yaml"),
        manifest(&upstream.base),
    )
    .unwrap();
    let env = [
        ("RUNNER__TRACING__OTLP_ENDPOINT", receiver.endpoint.as_str()),
        ("RUNNER__TRACING__EXPORT_INTERVAL", "100ms"),
        ("RUNNER__TRACING__SERVICE_NAME", "runner-under-test"),
        ("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync"),
        ("RUNNER__PARTITIONS__COUNT", "4"),
    ];
    let runner = RunnerProc::combined(&nats.url(), manifests.path().to_str().unwrap(), &env);
    let js = jetstream(&nats.url()).await;
    publish_job(&js, "j-traced", Some(&tp(TRACE, INPUT_SPAN))).await;
    publish_job(&js, "j-plain", None).await;
    let finishes = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.t.command.Job.*",
        2,
        Duration::from_secs(60),
    )
    .await;

    // Every hop of the traced job has been exported (the last one is the Finish command's
    // publication, a child of the second transition).
    let complete = common::eventually(Duration::from_secs(30), || async {
        let spans = receiver.trace(TRACE);
        spans
            .iter()
            .filter(|s| s.name == "outbox.publish")
            .any(|s| s.attr("messaging.destination.name") == Some("tenant.t.command.Job.j-traced"))
    })
    .await;
    let spans = receiver.trace(TRACE);
    assert!(complete, "the trace never completed: {spans:#?}");
    for s in &spans {
        assert_eq!(s.service, "runner-under-test", "{s:?}");
    }

    // input → route → transition
    let route = child(&spans, "saga.route", INPUT_SPAN, |_| true);
    assert_eq!(route.kind, 4, "route is a producer span");
    let first = child(&spans, "saga.transition", &route.span_id, |_| true);
    assert_eq!(first.attr("runner.state.from"), Some(""));
    assert_eq!(first.attr("runner.state.to"), Some("pinging"));
    assert_eq!(first.attr("runner.saga"), Some("traced"));
    assert_eq!(first.kind, 5, "transition is a consumer span");
    // → publication of the effect command
    let sent = child(&spans, "outbox.publish", &first.span_id, |s| {
        s.attr("messaging.destination.name")
            .is_some_and(|d| d.starts_with("tenant.t.effect.ping."))
    });
    let commands = common::read_stream(&js, "WORKFLOW_COMMANDS", "tenant.t.effect.ping.*").await;
    let command: &Seen = commands
        .iter()
        .find(|c| c.traceparent.as_deref().is_some_and(|t| t.contains(TRACE)))
        .unwrap();
    assert_eq!(command.traceparent, Some(tp(TRACE, &sent.span_id)));
    // → execution, with one call per attempt; the upstream saw each call's context
    let exec = child(&spans, "effect.execute", &sent.span_id, |_| true);
    assert_eq!(exec.attr("runner.effect"), Some("ping"));
    assert_eq!(exec.attr("runner.attempts"), Some("2"));
    assert!(!exec.failed);
    let mut calls: Vec<&Received> = spans
        .iter()
        .filter(|s| s.name == "effect.call" && s.parent == exec.span_id)
        .collect();
    calls.sort_by_key(|s| s.attr("runner.attempt").unwrap().to_string());
    assert_eq!(calls.len(), 2, "{calls:#?}");
    assert!(calls[0].failed && calls[0].attr("runner.outcome") == Some("retryable"));
    assert!(!calls[1].failed && calls[1].attr("runner.outcome") == Some("succeeded"));
    assert!(calls.iter().all(|c| c.kind == 3), "calls are client spans");
    let command_id = command.body["command_id"].as_str().unwrap();
    let heard: Vec<Option<String>> = upstream
        .hits()
        .into_iter()
        .filter(|h| h.key.as_deref() == Some(command_id))
        .map(|h| h.traceparent)
        .collect();
    assert_eq!(
        heard,
        vec![
            Some(tp(TRACE, &calls[0].span_id)),
            Some(tp(TRACE, &calls[1].span_id))
        ]
    );
    // → result event
    let result = child(&spans, "effect.result", &exec.span_id, |_| true);
    // The result goes straight into its partition's inbox.
    let results = common::read_stream(&js, "SAGA_INBOX", "runner.inbox.*.result").await;
    let result_msg = results
        .iter()
        .find(|r| r.body["command_id"] == command_id)
        .unwrap();
    assert_eq!(result_msg.traceparent, Some(tp(TRACE, &result.span_id)));
    // → next transition (no router hop: a result is published into its partition's inbox)
    let second = child(&spans, "saga.transition", &result.span_id, |_| true);
    assert_eq!(second.attr("runner.state.to"), Some("done"));
    let finish_hop = child(&spans, "outbox.publish", &second.span_id, |s| {
        s.attr("messaging.destination.name") == Some("tenant.t.command.Job.j-traced")
    });
    let finish = finishes
        .iter()
        .find(|f| f.subject.ends_with("j-traced"))
        .unwrap();
    assert_eq!(finish.traceparent, Some(tp(TRACE, &finish_hop.span_id)));

    // The job without trace context got a trace of its own, rooted at its transition.
    let plain = finishes
        .iter()
        .find(|f| f.subject.ends_with("j-plain"))
        .unwrap();
    let plain_trace = plain
        .traceparent
        .as_deref()
        .unwrap()
        .split('-')
        .nth(1)
        .unwrap();
    assert_ne!(plain_trace, TRACE);
    let rooted = common::eventually(Duration::from_secs(30), || async {
        receiver
            .trace(plain_trace)
            .iter()
            .any(|s| s.parent.is_empty())
    })
    .await;
    let own = receiver.trace(plain_trace);
    assert!(rooted, "no root span for the untraced job: {own:#?}");
    let root: Vec<_> = own
        .iter()
        .filter(|s| s.parent.is_empty())
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(root, vec!["saga.route"], "{own:#?}");
    runner.stop();
}
