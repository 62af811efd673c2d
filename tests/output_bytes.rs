//! A transaction is bounded by the bytes of outputs it writes, not only by the bytes of
//! inputs it reads (finding: a manifest whose 200 emits echo the input turned 10 inputs of
//! 900 KB into 1.7 GB of outputs in one batch, peak 3.35 GiB). Real binary, real
//! nats-server, real libmdbx.
//!
//! - inputs whose outputs together pass `saga.max_batch_bytes` are applied over several
//!   transactions (some inputs deferred to the next one), each exactly once and in order;
//! - an input whose outputs alone pass it is dead-lettered `too_large`, and the rest flows.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::metrics::Scrape;
use common::*;
use serde_json::json;

/// Every `Echoed` event repeats the input's payload; `copies` says how many.
const ECHO: &str = r#"format: 1
sagas:
  - name: echo
    version: 1
    triggers:
      - subject: aggregate.Blob.*
        event_type: Posted
        correlation: event.aggregate_id
        start: true
    initial_state: open
    states:
      open:
        on:
          Posted:
            - when: event.payload.copies == 5
              emit:
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
              goto: done
            - emit:
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
                - event: { event_type: Echoed, payload: "${ event.payload }" }
              goto: done
      done:
        terminal: true
        outcome: completed
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_past_the_batch_bytes_wait_for_the_next_transaction_and_none_is_lost() {
    let nats = NatsServer::start();
    let js = jetstream(&nats.url()).await;
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("echo.yaml");
    std::fs::write(&manifest, ECHO).unwrap();
    // 256 KiB of outputs a transaction; each input below echoes 5 × 40 KB = 200 KB. One
    // partition, so the inputs arrive in the same batches and the bound is what splits them.
    let env = [
        ("RUNNER__SAGA__MAX_BATCH_BYTES", "256KiB"),
        ("RUNNER__PARTITIONS__COUNT", "1"),
    ];
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifest.to_str().unwrap(),
        &env,
    );
    let blob = "b".repeat(40_000);
    let post = |id: &str, copies: u32| {
        aggregate_event(
            "acme",
            "Blob",
            id,
            "Posted",
            runner::clock::now_ms(),
            json!({"copies": copies, "blob": blob}),
        )
    };
    // Published before anything is applied would still be one pull; that they arrive
    // together is not needed: the bound holds for any transaction.
    for i in 0..12 {
        let id = format!("b-{i}");
        publish_json(
            &js,
            &format!("tenant.acme.aggregate.Blob.{id}"),
            &post(&id, 5),
        )
        .await;
    }
    // 12 × 40 KB = 480 KB of outputs from one input: more than a transaction takes.
    publish_json(&js, "tenant.acme.aggregate.Blob.huge", &post("huge", 12)).await;
    publish_json(&js, "tenant.acme.aggregate.Blob.after", &post("after", 5)).await;

    // Counted by `Echoed` events alone: each finished instance also publishes its
    // `SagaCompleted` on the same subjects, which must not stand in for a late `Echoed`.
    let echoed = |seen: &[Seen]| {
        let mut per: std::collections::BTreeMap<String, usize> = Default::default();
        for e in seen.iter().filter(|e| e.body["event_type"] == "Echoed") {
            *per.entry(e.subject.clone()).or_default() += 1;
        }
        per
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let per = loop {
        let seen = read_stream(&js, "WORKFLOW_EVENTS", "tenant.acme.workflow_event.echo.*").await;
        let per = echoed(&seen);
        if per.values().sum::<usize>() >= 13 * 5 || std::time::Instant::now() > deadline {
            break per;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(per.len(), 13, "{per:?}");
    assert!(
        per.values().all(|n| *n == 5),
        "each input's outputs once: {per:?}"
    );
    assert!(!per.contains_key("tenant.acme.workflow_event.echo.huge"));
    let dead = wait_for_messages(
        &js,
        "RUNNER_DLQ",
        "tenant.acme.deadletter.too_large",
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(dead[0].body["subject"], "tenant.acme.aggregate.Blob.huge");
    let reason = dead[0].body["reason"].as_str().unwrap();
    assert!(reason.contains("saga.max_batch_bytes"), "{reason}");
    let scrape = Scrape::of(&runner.admin).await;
    let name = "runner_saga_deferred_inputs_total";
    let deferred = scrape
        .get(name)
        .unwrap_or_else(|| panic!("{}", scrape.describe(name)));
    assert!(
        deferred >= 1.0,
        "some input waited for the next transaction: {deferred}"
    );
}
