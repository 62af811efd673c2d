//! Engine scenarios: events in, state and actions out — orchestration compensation order,
//! abort, command retries, compensation failure, timers, poison, version pinning, migration.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use runner::manifest::{self, Catalog};
use runner::saga::migrate::{MigrateError, migrate};
use runner::saga::{Applied, Input, Instance, Status, StepError, WorkKind, apply, route};
use serde_json::{Value, json};

const T0: u64 = 1_700_000_000_000;

fn catalog(files: &[(&str, &str)]) -> Catalog {
    let report = manifest::load_str(files);
    let msgs: Vec<String> = report.diagnostics.iter().map(ToString::to_string).collect();
    report
        .catalog
        .unwrap_or_else(|| panic!("manifest errors: {msgs:#?}"))
}

fn agg(ty: &str, id: &str, event_type: &str, n: u64, payload: Value) -> Input {
    Input::new(
        format!("aggregate.{ty}.{id}"),
        json!({"v": 1, "event_id": format!("ev-{n}"), "tenant_id": "acme", "event_type": event_type,
               "aggregate_type": ty, "aggregate_id": id, "timestamp_ms": T0 + n * 1000,
               "payload": payload, "metadata": {"correlation_id": id, "trace_id": "tr-1"}}),
    )
}

/// An aggregate event answering a command sent by instance `corr` (metadata echoed).
fn reply(ty: &str, id: &str, event_type: &str, n: u64, corr: &str) -> Input {
    let mut i = agg(ty, id, event_type, n, json!({}));
    i.body["metadata"]["correlation_id"] = json!(corr);
    i
}

fn effect_result(cmd: &Value, result: &str, n: u64, payload: Value) -> Input {
    let effect = cmd["effect_name"].as_str().unwrap();
    let id = cmd["command_id"].as_str().unwrap();
    Input::new(
        format!("effect_result.{effect}.{id}"),
        json!({"v": 1, "event_id": format!("ev-{n}"), "tenant_id": "acme", "command_id": id,
               "effect_name": effect, "result_type": result, "payload": payload, "attempts": 1,
               "timestamp_ms": T0 + n * 1000, "metadata": cmd["metadata"].clone()}),
    )
}

/// Routes and applies for one saga, returning the result.
fn step(
    c: &Catalog,
    saga: &str,
    inst: Option<&Instance>,
    input: &Input,
) -> Result<Applied, StepError> {
    let routes = route(c, input)?;
    let r = routes
        .iter()
        .find(|r| r.saga == saga)
        .ok_or(StepError::NotStarting)?;
    apply(c, saga, &r.correlation_id, inst, input)
}

fn fire(inst: &Instance, name: &str) -> Input {
    let t = &inst.timers[name];
    Input::timer(
        &inst.tenant,
        &inst.saga,
        &inst.correlation_id,
        name,
        &t.timer_id,
        t.due_ms,
    )
}

fn subjects(a: &Applied) -> Vec<String> {
    a.work
        .iter()
        .map(|w| w.subject.split('.').take(2).collect::<Vec<_>>().join("."))
        .collect()
}

const ORCH: &str = r#"
format: 1
effects:
  - { name: book_a, provider: noop }
  - { name: undo_a, provider: noop }
  - { name: book_b, provider: noop }
  - { name: undo_b, provider: noop }
  - { name: book_c, provider: noop }
  - { name: undo_c, provider: noop }
sagas:
  - name: chain
    version: 1
    triggers: [{ subject: aggregate.Trip.*, event_type: Go, correlation: event.aggregate_id, start: true }]
    steps:
      - name: a
        effect: { name: book_a }
        retry: { retry_limit: 4, base_backoff: 5, max_backoff: 100, enable_jitter: false }
        compensation: { effect: { name: undo_a }, retry: { retry_limit: 9, max_backoff: 100 } }
      - { name: b, effect: { name: book_b }, compensation: { effect: { name: undo_b } } }
      - { name: c, effect: { name: book_c }, compensation: { effect: { name: undo_c } } }
  - name: cmd
    version: 1
    triggers: [{ subject: aggregate.Trip.*, event_type: Start, correlation: event.aggregate_id, start: true }]
    steps:
      - name: pay
        effect: { name: book_a }
        compensation:
          command: { aggregate_type: Wallet, command: Refund, aggregate_id: "${ state.wallet }" }
          success: [Refunded]
          failure: [RefundFailed]
          retry: { retry_limit: 1, base_backoff: 10, max_backoff: 30000, enable_jitter: false }
          timeout_ms: 5000
      - name: seat
        command: { aggregate_type: Seat, command: Hold, aggregate_id: "${ state.seat }", payload: { for: "${ saga.correlation_id }" } }
        success: [SeatHeld]
        failure: [SeatBusy]
        abort: [SeatClosed]
        retry: { retry_limit: 3, base_backoff: 10, max_backoff: 30000, enable_jitter: false }
        timeout_ms: 2000
    data: { wallet: "${ event.payload.wallet }", seat: "${ event.payload.seat }" }
"#;

#[test]
fn failed_step_compensates_completed_steps_in_reverse() {
    let c = catalog(&[("o.yaml", ORCH)]);
    let a0 = step(&c, "chain", None, &agg("Trip", "t1", "Go", 0, json!({}))).unwrap();
    assert!(a0.started);
    assert_eq!(subjects(&a0), ["effect.book_a"]);
    // The step's retry policy travels in the effect command: the effect worker retries.
    assert_eq!(a0.work[0].body["metadata"]["retry"]["retry_limit"], 4);
    let a1 = step(
        &c,
        "chain",
        Some(&a0.instance),
        &effect_result(&a0.work[0].body, "Succeeded", 1, json!({"ref": "A"})),
    )
    .unwrap();
    assert_eq!(subjects(&a1), ["effect.book_b"]);
    let a2 = step(
        &c,
        "chain",
        Some(&a1.instance),
        &effect_result(&a1.work[0].body, "Succeeded", 2, json!({})),
    )
    .unwrap();
    assert_eq!(a2.instance.state, "step:c");
    let a3 = step(
        &c,
        "chain",
        Some(&a2.instance),
        &effect_result(&a2.work[0].body, "Failed", 3, json!({})),
    )
    .unwrap();
    assert_eq!(subjects(&a3), ["effect.undo_b"]);
    assert_eq!(a3.instance.state, "compensating:b");
    let a4 = step(
        &c,
        "chain",
        Some(&a3.instance),
        &effect_result(&a3.work[0].body, "Succeeded", 4, json!({})),
    )
    .unwrap();
    assert_eq!(subjects(&a4), ["effect.undo_a"]);
    assert_eq!(a4.work[0].body["metadata"]["retry"]["retry_limit"], 9);
    let a5 = step(
        &c,
        "chain",
        Some(&a4.instance),
        &effect_result(&a4.work[0].body, "Succeeded", 5, json!({})),
    )
    .unwrap();
    assert!(a5.work.is_empty());
    assert_eq!(
        (a5.instance.state.as_str(), a5.instance.status),
        ("compensated", Status::Compensated)
    );
    // A result for an old command id is not for this step.
    let stale = step(
        &c,
        "chain",
        Some(&a1.instance),
        &effect_result(&a0.work[0].body, "Succeeded", 6, json!({})),
    );
    assert!(
        matches!(stale, Err(StepError::NoTransition { .. })),
        "{stale:?}"
    );
}

fn start_cmd(c: &Catalog) -> (Applied, Applied) {
    let a0 = step(
        c,
        "cmd",
        None,
        &agg(
            "Trip",
            "t9",
            "Start",
            0,
            json!({"wallet": "w1", "seat": "s7"}),
        ),
    )
    .unwrap();
    let a1 = step(
        c,
        "cmd",
        Some(&a0.instance),
        &effect_result(&a0.work[0].body, "Succeeded", 1, json!({})),
    )
    .unwrap();
    (a0, a1)
}

#[test]
fn command_step_waits_under_a_timeout_and_retries_with_backoff() {
    let c = catalog(&[("o.yaml", ORCH)]);
    let (_, a1) = start_cmd(&c);
    assert_eq!(a1.work.len(), 1);
    let w = &a1.work[0];
    assert_eq!(w.kind, WorkKind::AggregateCommand);
    assert_eq!(w.subject, "command.Seat.s7");
    assert_eq!(w.body["command_type"], "Hold");
    assert_eq!(w.body["payload"], json!({"for": "t9"}));
    assert_eq!(a1.timers_set.len(), 1);
    assert_eq!(a1.timers_set[0].name, "seat.timeout");
    assert_eq!(a1.timers_set[0].due_ms, T0 + 1000 + 2000);
    // Failure: retry in (10*2)^1 = 20 ms through a timer; the timeout is cancelled.
    let a2 = step(
        &c,
        "cmd",
        Some(&a1.instance),
        &reply("Seat", "s7", "SeatBusy", 2, "t9"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(a2.work.is_empty());
    assert_eq!(a2.timers_cancelled[0].name, "seat.timeout");
    assert_eq!(a2.timers_set[0].name, "seat.retry");
    assert_eq!(a2.timers_set[0].due_ms, T0 + 2000 + 20);
    let a3 = apply(
        &c,
        "cmd",
        "t9",
        Some(&a2.instance),
        &fire(&a2.instance, "seat.retry"),
    )
    .unwrap();
    assert_eq!(subjects(&a3), ["command.Seat"]);
    assert_ne!(
        a3.work[0].msg_id, a1.work[0].msg_id,
        "a re-send is a new command"
    );
    // No answer: the timeout counts as a failure; the second retry waits 20^2 = 400 ms.
    let a4 = apply(
        &c,
        "cmd",
        "t9",
        Some(&a3.instance),
        &fire(&a3.instance, "seat.timeout"),
    )
    .unwrap();
    assert_eq!(a4.timers_set[0].name, "seat.retry");
    assert_eq!(
        a4.timers_set[0].due_ms,
        a3.instance.timers["seat.timeout"].due_ms + 400
    );
    // Replaying the old timeout is stale.
    let stale = apply(
        &c,
        "cmd",
        "t9",
        Some(&a4.instance),
        &fire(&a3.instance, "seat.timeout"),
    );
    assert!(matches!(stale, Err(StepError::StaleTimer(_))), "{stale:?}");
}

#[test]
fn abort_compensates_without_retrying() {
    let c = catalog(&[("o.yaml", ORCH)]);
    let (_, a1) = start_cmd(&c);
    let a2 = step(
        &c,
        "cmd",
        Some(&a1.instance),
        &reply("Seat", "s7", "SeatClosed", 2, "t9"),
    )
    .unwrap();
    // No retry timer: straight to the compensation of `pay`, a command to the wallet.
    assert!(a2.timers_set.iter().all(|t| t.name != "seat.retry"));
    assert_eq!(a2.instance.state, "compensating:pay");
    assert_eq!(a2.work.len(), 1);
    assert_eq!(a2.work[0].subject, "command.Wallet.w1");
    assert_eq!(a2.work[0].body["command_type"], "Refund");
    let a3 = step(
        &c,
        "cmd",
        Some(&a2.instance),
        &reply("Wallet", "w1", "Refunded", 3, "t9"),
    )
    .unwrap();
    assert_eq!(a3.instance.status, Status::Compensated);
    assert!(a3.instance.timers.is_empty());
}

#[test]
fn failing_compensation_spends_its_budget_then_needs_an_operator() {
    let c = catalog(&[("o.yaml", ORCH)]);
    let (_, a1) = start_cmd(&c);
    let a2 = step(
        &c,
        "cmd",
        Some(&a1.instance),
        &reply("Seat", "s7", "SeatClosed", 2, "t9"),
    )
    .unwrap();
    let a3 = step(
        &c,
        "cmd",
        Some(&a2.instance),
        &reply("Wallet", "w1", "RefundFailed", 3, "t9"),
    )
    .unwrap();
    assert_eq!(a3.instance.status, Status::Running);
    assert_eq!(a3.timers_set[0].name, "pay.compensation_retry");
    let a4 = apply(
        &c,
        "cmd",
        "t9",
        Some(&a3.instance),
        &fire(&a3.instance, "pay.compensation_retry"),
    )
    .unwrap();
    assert_eq!(subjects(&a4), ["command.Wallet"]);
    let a5 = apply(
        &c,
        "cmd",
        "t9",
        Some(&a4.instance),
        &fire(&a4.instance, "pay.compensation_timeout"),
    )
    .unwrap();
    assert_eq!(
        (a5.instance.state.as_str(), a5.instance.status),
        ("needs_operator", Status::NeedsOperator)
    );
    assert!(a5.instance.timers.is_empty());
    let after = step(
        &c,
        "cmd",
        Some(&a5.instance),
        &reply("Wallet", "w1", "Refunded", 6, "t9"),
    );
    assert!(matches!(
        after,
        Err(StepError::Finished(Status::NeedsOperator))
    ));
}

const MACHINE_V1: &str = r#"
format: 1
effects: [{ name: notify, provider: noop }]
sagas:
  - name: doc
    version: 1
    triggers: [{ subject: aggregate.Doc.*, correlation: event.aggregate_id, start: true }]
    data: { n: 0 }
    initial_state: draft
    states:
      draft:
        on:
          Created: { set: { n: "${ state.n + 1 }" }, goto: review, timers: [{ name: nudge, delay_ms: 60000 }] }
      review:
        on:
          Approved:
            - when: event.payload.score >= 3
              set: { n: "${ state.n + 1 }" }
              cancel_timers: [nudge]
              emit: [{ effect: { name: notify, payload: { n: "${ state.n }" } } }]
              goto: done
            - goto: rejected
          timer.nudge:
            timers: [{ name: nudge, at: "event.timestamp_ms + 60000" }]
      done: { terminal: true }
      rejected: { terminal: true, outcome: failed }
"#;

const MACHINE_V2: &str = r#"
format: 1
sagas:
  - name: doc
    version: 2
    triggers: [{ subject: aggregate.Doc.*, correlation: event.aggregate_id, start: true }]
    initial_state: drafting
    states:
      drafting:
        on:
          Created: { goto: in_review }
      in_review:
        on:
          Approved: { goto: finished }
      finished: { terminal: true }
    migration:
      from: 1
      data: "{'count': state.n, 'migrated': true}"
      states: { draft: drafting, review: in_review, done: finished }
"#;

#[test]
fn guards_updates_timers_and_terminal_status() {
    let c = catalog(&[("v1.yaml", MACHINE_V1)]);
    let a0 = step(&c, "doc", None, &agg("Doc", "d1", "Created", 0, json!({}))).unwrap();
    assert_eq!(
        (a0.instance.state.as_str(), a0.instance.data.clone()),
        ("review", json!({"n": 1}))
    );
    assert_eq!(a0.timers_set[0].due_ms, T0 + 60_000);
    // The nudge re-arms itself at an absolute time computed from the timer input.
    let a1 = apply(
        &c,
        "doc",
        "d1",
        Some(&a0.instance),
        &fire(&a0.instance, "nudge"),
    )
    .unwrap();
    assert_eq!(a1.timers_set[0].due_ms, T0 + 120_000);
    assert_eq!(a1.instance.state, "review");
    // First guard fails -> the second transition is taken.
    let low = step(
        &c,
        "doc",
        Some(&a1.instance),
        &agg("Doc", "d1", "Approved", 2, json!({"score": 1})),
    )
    .unwrap();
    assert_eq!(
        (low.instance.state.as_str(), low.instance.status),
        ("rejected", Status::Failed)
    );
    assert_eq!(
        low.timers_cancelled.len(),
        1,
        "a finished instance keeps no timers"
    );
    let high = step(
        &c,
        "doc",
        Some(&a1.instance),
        &agg("Doc", "d1", "Approved", 2, json!({"score": 5})),
    )
    .unwrap();
    assert_eq!(high.instance.status, Status::Completed);
    // Work sees the updated state.
    assert_eq!(high.work[0].body["payload"], json!({"n": 2}));
    assert_eq!(high.timers_cancelled[0].name, "nudge");
    // An event this state does not handle, and a guard that cannot be evaluated.
    let none = step(
        &c,
        "doc",
        Some(&a0.instance),
        &agg("Doc", "d1", "Deleted", 3, json!({})),
    );
    assert!(matches!(none, Err(StepError::NoTransition { .. })));
    let poison = step(
        &c,
        "doc",
        Some(&a0.instance),
        &agg("Doc", "d1", "Approved", 3, json!({})),
    );
    assert!(
        matches!(poison, Err(StepError::Poison { .. })),
        "{poison:?}"
    );
    // Without an instance, a non-starting input is ignored; a malformed one is poison.
    let bad = Input::new("aggregate.Doc.d2", json!({"v": 1, "event_type": "Created"}));
    assert!(matches!(route(&c, &bad), Err(StepError::Poison { .. })));
}

#[test]
fn emitted_ids_are_uuid_v7_from_the_input_time() {
    let c = catalog(&[("v1.yaml", MACHINE_V1)]);
    let a0 = step(&c, "doc", None, &agg("Doc", "d1", "Created", 0, json!({}))).unwrap();
    let a1 = step(
        &c,
        "doc",
        Some(&a0.instance),
        &agg("Doc", "d1", "Approved", 1, json!({"score": 5})),
    )
    .unwrap();
    let w = &a1.work[0];
    let id = uuid::Uuid::parse_str(&w.msg_id).unwrap();
    assert_eq!(id.get_version_num(), 7);
    let (secs, nanos) = id.get_timestamp().unwrap().to_unix();
    assert_eq!(secs * 1000 + u64::from(nanos / 1_000_000), T0 + 1000);
    assert_eq!(w.body["command_id"], json!(w.msg_id));
    assert_eq!(w.subject, format!("effect.notify.{}", w.msg_id));
    assert_eq!(w.body["metadata"]["trace_id"], "tr-1");
    assert_eq!(w.body["metadata"]["causation_id"], "ev-1");
}

#[test]
fn instances_stay_on_their_version_and_new_ones_use_the_newest() {
    let v1_only = catalog(&[("v1.yaml", MACHINE_V1)]);
    let old = step(
        &v1_only,
        "doc",
        None,
        &agg("Doc", "d1", "Created", 0, json!({})),
    )
    .unwrap();
    assert_eq!(old.instance.version, 1);
    let both = catalog(&[("v1.yaml", MACHINE_V1), ("v2.yaml", MACHINE_V2)]);
    // The in-flight instance continues on version 1's states.
    let cont = step(
        &both,
        "doc",
        Some(&old.instance),
        &agg("Doc", "d1", "Approved", 1, json!({"score": 4})),
    )
    .unwrap();
    assert_eq!(
        (cont.instance.version, cont.instance.state.as_str()),
        (1, "done")
    );
    // A new instance starts on version 2.
    let new = step(
        &both,
        "doc",
        None,
        &agg("Doc", "d2", "Created", 2, json!({})),
    )
    .unwrap();
    assert_eq!(
        (new.instance.version, new.instance.state.as_str()),
        (2, "in_review")
    );
    // With version 1 gone, the old instance cannot run: a typed outcome, not a guess.
    let v2_only = catalog(&[("v2.yaml", MACHINE_V2)]);
    let err = step(
        &v2_only,
        "doc",
        Some(&old.instance),
        &agg("Doc", "d1", "Approved", 1, json!({})),
    );
    assert_eq!(
        err.unwrap_err(),
        StepError::VersionNotLoaded {
            saga: "doc".into(),
            version: 1
        }
    );
}

#[test]
fn migration_is_explicit_and_maps_data_and_state() {
    let v1_only = catalog(&[("v1.yaml", MACHINE_V1)]);
    let old = step(
        &v1_only,
        "doc",
        None,
        &agg("Doc", "d1", "Created", 0, json!({})),
    )
    .unwrap()
    .instance;
    let v2_only = catalog(&[("v2.yaml", MACHINE_V2)]);
    let m = migrate(&v2_only, &old).unwrap();
    assert_eq!((m.version, m.state.as_str()), (2, "in_review"));
    assert_eq!(m.data, json!({"count": 1, "migrated": true}));
    let done = step(
        &v2_only,
        "doc",
        Some(&m),
        &agg("Doc", "d1", "Approved", 1, json!({})),
    )
    .unwrap();
    assert_eq!(done.instance.status, Status::Completed);
    // No version 3 declares a migration from 2.
    assert!(matches!(
        migrate(&v2_only, &m),
        Err(MigrateError::NoMigration { from: 2, to: 3, .. })
    ));
}

#[test]
fn stranded_versions_are_reported() {
    let in_use = vec![
        ("doc".to_string(), 1),
        ("doc".to_string(), 2),
        ("gone".to_string(), 4),
    ];
    let both = catalog(&[("v1.yaml", MACHINE_V1), ("v2.yaml", MACHINE_V2)]);
    let stranded = both.stranded(&in_use);
    assert_eq!(stranded.len(), 1);
    assert_eq!(
        (stranded[0].saga.as_str(), stranded[0].version),
        ("gone", 4)
    );
    // Dropping v1 is fine: v2 declares a migration from it.
    let v2_only = catalog(&[("v2.yaml", MACHINE_V2)]);
    assert_eq!(v2_only.stranded(&in_use).len(), 1);
    // Dropping v2 strands its instances: nothing loaded can run or migrate them.
    let v1_only = catalog(&[("v1.yaml", MACHINE_V1)]);
    let s = v1_only.stranded(&in_use);
    assert!(s.iter().any(|x| x.saga == "doc" && x.version == 2), "{s:?}");
    assert!(s[0].to_string().contains("not loaded"));
}

#[test]
fn tenant_mismatch_is_poison() {
    let c = catalog(&[("v1.yaml", MACHINE_V1)]);
    let a0 = step(&c, "doc", None, &agg("Doc", "d1", "Created", 0, json!({}))).unwrap();
    let mut other = agg("Doc", "d1", "Approved", 1, json!({"score": 5}));
    other.body["tenant_id"] = json!("globex");
    let err = apply(&c, "doc", "d1", Some(&a0.instance), &other);
    assert!(matches!(err, Err(StepError::Poison { .. })));
    // An instance handed over under another key is refused too.
    let input = agg("Doc", "d2", "Approved", 1, json!({"score": 5}));
    let err = apply(&c, "doc", "d2", Some(&a0.instance), &input);
    assert!(matches!(err, Err(StepError::Poison { .. })));
}

#[test]
fn effect_results_go_only_to_the_saga_that_sent_the_command() {
    let shared = r#"
format: 1
effects: [{ name: ping, provider: noop }]
sagas:
  - name: alpha
    version: 1
    triggers:
      - { subject: aggregate.X.*, correlation: event.aggregate_id, start: true }
      - { subject: effect_result.ping.*, correlation: event.metadata.correlation_id }
    initial_state: a
    states:
      a: { on: { Go: { emit: [{ effect: { name: ping } }], goto: b } } }
      b: { on: { ping.Succeeded: { goto: c } } }
      c: { terminal: true }
  - name: beta
    version: 1
    triggers:
      - { subject: aggregate.X.*, correlation: event.aggregate_id, start: true }
      - { subject: effect_result.ping.*, correlation: event.metadata.correlation_id }
    initial_state: a
    states:
      a: { on: { Go: { emit: [{ effect: { name: ping } }], goto: b } } }
      b: { on: { ping.Succeeded: { goto: c } } }
      c: { terminal: true }
"#;
    let c = catalog(&[("s.yaml", shared)]);
    let go = agg("X", "k1", "Go", 0, json!({}));
    let routes = route(&c, &go).unwrap();
    assert_eq!(routes.len(), 2, "both sagas start on Go");
    let a = apply(&c, "alpha", "k1", None, &go).unwrap();
    let result = effect_result(&a.work[0].body, "Succeeded", 1, json!({}));
    let routes = route(&c, &result).unwrap();
    assert_eq!(routes.len(), 1);
    assert_eq!(routes[0].saga, "alpha");
}
