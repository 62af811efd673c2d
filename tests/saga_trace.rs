//! `traceparent` end to end in combined mode: an input's trace context is copied unchanged
//! onto the effect command it causes, the effect's result, and the command that result
//! causes; an input without one causes outputs without one.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, RunnerProc, Seen, aggregate_event, jetstream, wait_for_messages};
use serde_json::json;

/// A saga that asks a `noop` effect for one thing and, on its result, emits a command.
const MANIFEST: &str = r#"format: 1
effects:
  - name: ping
    provider: noop
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
      job: ${ event.aggregate_id }
    initial_state: new
    states:
      new:
        on:
          JobStarted:
            emit:
              - effect:
                  name: ping
                  payload: { job: "${ state.job }" }
            goto: pinging
      pinging:
        on:
          ping.Succeeded:
            emit:
              - command:
                  aggregate_type: Job
                  command: Finish
                  aggregate_id: ${ state.job }
                  payload: {}
            goto: done
      done:
        terminal: true
"#;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The one message in `seen` about job `job`.
fn about<'a>(seen: &'a [Seen], job: &str, what: &str) -> &'a Seen {
    let found: Vec<_> = seen
        .iter()
        .filter(|s| s.subject.contains(job) || s.body["payload"]["job"] == job)
        .collect();
    assert_eq!(found.len(), 1, "{what} of {job}: {seen:?}");
    found[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traceparent_is_carried_from_input_to_effect_result_and_the_next_command() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("traced.yaml"), MANIFEST).unwrap();
    let runner = RunnerProc::start(
        &[
            "--mode",
            "combined",
            "--nats-url",
            &nats.url(),
            "--manifest",
            manifests.path().to_str().unwrap(),
        ],
        &[],
    );
    let js = jetstream(&nats.url()).await;
    for (job, tp) in [("j-traced", Some(TRACEPARENT)), ("j-plain", None)] {
        let ev = aggregate_event("t", "Job", job, "JobStarted", 1_800_000_000_000, json!({}));
        common::publish_traced(&js, &format!("tenant.t.aggregate.Job.{job}"), &ev, tp).await;
    }
    let finishes = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.t.command.Job.*",
        2,
        Duration::from_secs(60),
    )
    .await;
    let commands = common::read_stream(&js, "WORKFLOW_COMMANDS", "tenant.t.effect.ping.*").await;
    // The executor publishes a result straight into the waiting partition's inbox.
    let results = common::read_stream(&js, "SAGA_INBOX", "runner.inbox.*.result").await;
    assert_eq!(commands.len(), 2, "{commands:?}");
    assert_eq!(results.len(), 2, "{results:?}");

    let command = about(&commands, "j-traced", "effect command");
    let result = results
        .iter()
        .find(|r| r.body["command_id"] == command.body["command_id"])
        .unwrap();
    let finish = about(&finishes, "j-traced", "Finish command");
    assert_eq!(command.traceparent.as_deref(), Some(TRACEPARENT));
    assert_eq!(result.traceparent.as_deref(), Some(TRACEPARENT));
    assert_eq!(finish.traceparent.as_deref(), Some(TRACEPARENT));

    let command = about(&commands, "j-plain", "effect command");
    let result = results
        .iter()
        .find(|r| r.body["command_id"] == command.body["command_id"])
        .unwrap();
    let finish = about(&finishes, "j-plain", "Finish command");
    for s in [command, result, finish] {
        assert_eq!(s.traceparent, None, "{s:?}");
    }
    runner.stop();
}
