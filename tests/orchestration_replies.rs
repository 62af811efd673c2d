//! An orchestration's command step is answered by an aggregate event correlated by the
//! `metadata.correlation_id` the command carried. An event of the step's result types
//! without it (an aggregate that does not echo `metadata`, or the same event type published
//! for something the saga never asked for) answers no command of any instance: it is
//! dead-lettered as `unanswered_result` naming the missing field, no key is parked, the
//! instance waits on untouched, and its genuine result completes the step. Single-active and
//! partitioned. Real binary, real nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const MANIFEST: &str = r#"
format: 1
sagas:
  - name: hold
    version: 1
    triggers:
      - { subject: aggregate.Booking.*, event_type: Requested, correlation: event.aggregate_id, start: true }
    steps:
      - name: seat
        command: { aggregate_type: Seat, command: Hold, aggregate_id: "s-1", payload: { for: "${ saga.correlation_id }" } }
        success: [SeatHeld]
        failure: [SeatBusy]
        timeout_ms: 600000
"#;

fn inspect(data_dir: &str) -> Value {
    let (code, out) = run_to_exit(
        &[
            "inspect",
            "--data-dir",
            data_dir,
            "--tenant",
            "acme",
            "--saga",
            "hold",
            "--id",
            "b-1",
        ],
        &[],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(0), "{out}");
    serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap()
}

async fn an_uncorrelated_result_parks_nothing(env: &[(&str, &str)]) {
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("hold.yaml"), MANIFEST).unwrap();
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifests.path().to_str().unwrap(),
        env,
    );
    let data_dir = runner.data_dir.path().to_str().unwrap().to_string();
    let js = jetstream(&nats.url()).await;
    let now = runner::clock::now_ms();
    let start = aggregate_event("acme", "Booking", "b-1", "Requested", now, json!({}));
    publish_json(&js, "tenant.acme.aggregate.Booking.b-1", &start).await;
    let commands = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.command.Seat.*",
        1,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(commands[0].body["metadata"]["correlation_id"], "b-1");

    // The seat aggregate answers without echoing the command's metadata.
    let bare = aggregate_event("acme", "Seat", "s-1", "SeatHeld", now + 1, json!({}));
    publish_json(&js, "tenant.acme.aggregate.Seat.s-1", &bare).await;
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.>",
        1,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        dead[0].subject, "tenant.acme.deadletter.unanswered_result",
        "{}",
        dead[0].body
    );
    let reason = dead[0].body["reason"].as_str().unwrap();
    assert!(reason.contains("metadata.correlation_id"), "{reason}");
    assert!(reason.contains("`hold`"), "{reason}");
    assert_eq!(dead[0].body["saga"], Value::Null, "names no instance");
    let view = inspect(&data_dir);
    assert_eq!(view["instance"]["state"], "step:seat", "{view}");
    assert_eq!(view["parked_by"], Value::Null, "not parked: {view}");

    // The instance's next input is applied, not held behind the dead letter.
    let mut held = aggregate_event("acme", "Seat", "s-1", "SeatHeld", now + 2, json!({}));
    held["metadata"] = json!({"correlation_id": "b-1"});
    publish_json(&js, "tenant.acme.aggregate.Seat.s-1", &held).await;
    let ended = wait_for_messages(
        &js,
        "WORKFLOW_EVENTS",
        "tenant.acme.workflow_event.hold.b-1",
        1,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        ended[0].body["event_type"], "SagaCompleted",
        "{}",
        ended[0].body
    );
    let view = inspect(&data_dir);
    assert_eq!(view["instance"]["status"], "completed", "{view}");
    let dead = read_stream(&js, "RUNNER_DLQ", "tenant.acme.deadletter.>").await;
    assert_eq!(dead.len(), 1, "nothing else dead-lettered or held");
    drop(runner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_step_result_without_a_correlation_id_parks_nothing() {
    an_uncorrelated_result_parks_nothing(&[
        ("RUNNER__PARTITIONS__COUNT", "4"),
        ("RUNNER__PARTITIONS__LEASE_TTL", "3s"),
    ])
    .await;
}
