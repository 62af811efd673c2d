//! Migrations that really run: instances on version 1 of a saga, a reload that would drop
//! version 1 refused, versions 1 and 2 side by side, `runner migrate --dry-run` (nothing
//! written), `POST /admin/migrate` (committed, idempotent), timers, pending commands and
//! history kept, version 1 dropped, and the instances finishing on version 2.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    NatsServer, RunnerProc, aggregate_event, effect_result, jetstream, publish_json, run_to_exit,
    wait_for_messages,
};
use serde_json::{Value as Json, json};

const TOKEN: &str = "migrate-test-token";

const EFFECTS: &str = "format: 1\neffects: [{ name: notify, provider: noop }]\n";

const V1: &str = r#"format: 1
sagas:
  - name: doc
    version: 1
    triggers:
      - { subject: aggregate.Doc.*, correlation: event.aggregate_id, start: true }
      - { subject: effect_result.notify.*, correlation: event.metadata.correlation_id }
    data: { n: 0 }
    initial_state: draft
    states:
      draft:
        on:
          Created:
            set: { n: "${ state.n + 1 }" }
            emit: [{ effect: { name: notify, payload: { n: "${ state.n }" } } }]
            timers: [{ name: nudge, delay_ms: 3600000 }]
            goto: review
      review:
        on:
          notify.Succeeded: { set: { notified: true } }
          Approved: { cancel_timers: [nudge], goto: done }
          timer.nudge: {}
      done: { terminal: true }
"#;

const V2: &str = r#"format: 1
sagas:
  - name: doc
    version: 2
    triggers:
      - { subject: aggregate.Doc.*, correlation: event.aggregate_id, start: true }
      - { subject: effect_result.notify.*, correlation: event.metadata.correlation_id }
    data: { count: 0, migrated: false }
    initial_state: drafting
    states:
      drafting:
        on:
          Created: { goto: in_review }
      in_review:
        on:
          notify.Succeeded: { set: { notified: true } }
          Approved: { cancel_timers: [nudge], goto: finished }
          timer.nudge: {}
      finished: { terminal: true }
    migration:
      from: 1
      data: "{'count': state.n, 'migrated': true}"
      states: { draft: drafting, review: in_review, done: finished }
"#;

async fn post(base: &str, path: &str, body: Json) -> (u16, Json) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Json::Null))
}

fn cli(args: &[&str]) -> (Option<i32>, String) {
    run_to_exit(args, &[], Duration::from_secs(60))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_instances_are_migrated_explicitly_and_finish_on_v2() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path();
    std::fs::write(m.join("effects.yaml"), EFFECTS).unwrap();
    std::fs::write(m.join("v1.yaml"), V1).unwrap();
    let mdir = m.to_str().unwrap().to_string();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        &mdir,
        &[("RUNNER__ADMIN__TOKEN", TOKEN)],
    );
    let base = runner.admin.clone();
    let data = runner.data_dir.path().to_str().unwrap().to_string();
    let js = jetstream(&nats.url()).await;
    let now = runner::clock::now_ms();
    for i in 0..5 {
        let ev = aggregate_event(
            "acme",
            "Doc",
            &format!("d-{i}"),
            "Created",
            now + i,
            json!({}),
        );
        publish_json(&js, &format!("tenant.acme.aggregate.Doc.d-{i}"), &ev).await;
    }
    let notifies = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.acme.effect.notify.*",
        5,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(notifies.len(), 5);

    // Dropping version 1 while its instances run is refused, and the answer says how.
    std::fs::remove_file(m.join("v1.yaml")).unwrap();
    std::fs::write(m.join("v2.yaml"), V2).unwrap();
    let (status, body) = post(&base, "/admin/reload", json!({})).await;
    assert_eq!(status, 422, "{body}");
    assert!(
        body.to_string()
            .contains("runner migrate --saga doc --from 1"),
        "{body}"
    );
    // Both versions side by side: accepted.
    std::fs::write(m.join("v1.yaml"), V1).unwrap();
    let (status, body) = post(&base, "/admin/reload", json!({})).await;
    assert_eq!(status, 200, "{body}");

    // A dry run shows before and after and writes nothing.
    let (code, out) = cli(&[
        "migrate",
        "--data-dir",
        &data,
        "--manifest",
        &mdir,
        "--tenant",
        "acme",
        "--saga",
        "doc",
        "--from",
        "1",
        "--dry-run",
    ]);
    assert_eq!(code, Some(0), "{out}");
    let dry: Json = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (dry["dry_run"].as_bool(), dry["migrated"].as_u64()),
        (Some(true), Some(5))
    );
    assert_eq!(dry["batches"], 0);
    let s = &dry["sample"][0];
    assert_eq!(s["correlation_id"], "d-0");
    assert_eq!(
        s["before"],
        json!({ "version": 1, "state": "review", "data": { "n": 1 } })
    );
    assert_eq!(
        s["after"],
        json!({ "version": 2, "state": "in_review", "data": { "count": 1, "migrated": true } })
    );
    let (code, out) = cli(&[
        "instances",
        "list",
        "--data-dir",
        &data,
        "--tenant",
        "acme",
        "--saga",
        "doc",
        "--output",
        "json",
    ]);
    assert_eq!(code, Some(0), "{out}");
    let listed: Json = serde_json::from_str(&out).unwrap();
    assert!(
        listed["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["version"] == 1),
        "a dry run wrote something: {listed}"
    );

    // The real thing, through the node; a second pass finds nothing left to do.
    let (status, report) = post(
        &base,
        "/admin/migrate",
        json!({ "tenant": "acme", "saga": "doc", "from": 1 }),
    )
    .await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(
        (report["migrated"].as_u64(), report["batches"].as_u64()),
        (Some(5), Some(1))
    );
    assert_eq!(report["failed"], json!([]));
    let (_, again) = post(
        &base,
        "/admin/migrate",
        json!({ "tenant": "acme", "saga": "doc", "from": 1 }),
    )
    .await;
    assert_eq!(
        (again["migrated"].as_u64(), again["other_versions"].as_u64()),
        (Some(0), Some(5))
    );
    let (status, bad) = post(
        &base,
        "/admin/migrate",
        json!({ "tenant": "acme", "saga": "doc", "from": 2 }),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        bad["error"]
            .as_str()
            .unwrap()
            .contains("version 3 is not loaded"),
        "{bad}"
    );

    // Timers, the pending command and the history came along.
    let (code, out) = cli(&[
        "inspect",
        "--data-dir",
        &data,
        "--tenant",
        "acme",
        "--saga",
        "doc",
        "--id",
        "d-2",
    ]);
    assert_eq!(code, Some(0), "{out}");
    let view: Json = serde_json::from_str(&out).unwrap();
    assert_eq!(view["instance"]["version"], 2);
    assert_eq!(view["instance"]["state"], "in_review");
    assert!(view["instance"]["timers"].get("nudge").is_some(), "{view}");
    assert_eq!(view["timers"].as_array().unwrap().len(), 1, "{view}");
    assert_eq!(
        view["instance"]["awaiting"].as_object().unwrap().len(),
        1,
        "{view}"
    );
    assert_eq!(
        view["recent_transitions"].as_array().unwrap().len(),
        1,
        "{view}"
    );

    // Version 1 can go now; the instances finish on version 2.
    std::fs::remove_file(m.join("v1.yaml")).unwrap();
    let (status, body) = post(&base, "/admin/reload", json!({})).await;
    assert_eq!(status, 200, "{body}");
    for n in &notifies {
        let (subject, body) = effect_result(&n.body, "Succeeded", now + 100, json!({}));
        publish_json(&js, &subject, &body).await;
    }
    // The results and the approvals travel on two streams, which nothing orders against
    // each other: the approvals go once the results are applied (else a result landing
    // after its instance finished is ignored).
    common::metrics::wait_metric(
        &base,
        "runner_saga_transitions_total{outcome=\"applied\",saga=\"doc\"}",
        |v| v >= 10.0,
        Duration::from_secs(30),
    )
    .await;
    for i in 0..5 {
        let ev = aggregate_event(
            "acme",
            "Doc",
            &format!("d-{i}"),
            "Approved",
            now + 200 + i,
            json!({}),
        );
        publish_json(&js, &format!("tenant.acme.aggregate.Doc.d-{i}"), &ev).await;
    }
    let ended = wait_for_messages(
        &js,
        "WORKFLOW_EVENTS",
        "tenant.acme.workflow_event.doc.*",
        5,
        Duration::from_secs(60),
    )
    .await;
    for e in &ended {
        assert_eq!(e.body["event_type"], "SagaCompleted", "{}", e.body);
        assert_eq!(e.body["payload"]["saga_version"], 2);
        assert_eq!(e.body["payload"]["state"], "finished");
    }
    let (_, out) = cli(&[
        "inspect",
        "--data-dir",
        &data,
        "--tenant",
        "acme",
        "--saga",
        "doc",
        "--id",
        "d-2",
    ]);
    let view: Json = serde_json::from_str(&out).unwrap();
    assert_eq!(
        view["instance"]["data"],
        json!({ "count": 1, "migrated": true, "notified": true })
    );
    assert!(view["timers"].as_array().unwrap().is_empty());
    // Absent until a first dead letter of the saga: zero.
    let dead = common::metrics::metric_or_zero(
        &base,
        "runner_saga_transitions_total{outcome=\"dead_lettered\",saga=\"doc\"}",
    )
    .await;
    assert_eq!(dead, 0.0, "nothing was dead-lettered");
    // A loop counts its transitions right after its commit, and the relay may publish what
    // another loop's batch in the same commit produced a moment before that loop counts:
    // wait for the count rather than read it once.
    let applied = common::metrics::wait_metric(
        &base,
        "runner_saga_transitions_total{outcome=\"applied\",saga=\"doc\"}",
        |v| v >= 15.0,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(applied, 15.0, "5 starts, 5 results, 5 approvals");
}
