//! Engine scenarios: events in, state and actions out — orchestration compensation order,
//! abort, command retries, compensation failure, timers, poison, version pinning, migration.
//!
//! Each test drives one instance through a [`Scenario`], which routes and applies every
//! input as the worker does and keeps the instance between inputs; what a test asserts is the
//! [`Applied`] that comes back (new state, work, timer changes) or the typed [`StepError`].
#![allow(clippy::unwrap_used, clippy::expect_used)]

use runner::manifest::{self, Catalog};
use runner::saga::migrate::{MigrateError, migrate};
use runner::saga::{
    Applied, Input, Instance, Status, StepError, TimeBound, WorkKind, apply, route,
};
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

/// One saga instance driven input by input, as the worker drives it: each input is routed,
/// then applied to the current instance. A success replaces the instance; an error leaves it
/// as it was (the worker commits nothing for it). Clone it to branch a scenario.
#[derive(Clone)]
struct Scenario<'c> {
    catalog: &'c Catalog,
    saga: String,
    instance: Option<Instance>,
}

impl<'c> Scenario<'c> {
    /// No instance yet: the first input must start one.
    fn new(catalog: &'c Catalog, saga: &str) -> Self {
        Self {
            catalog,
            saga: saga.to_owned(),
            instance: None,
        }
    }

    /// Continues a stored instance (for example one just migrated).
    fn resume(catalog: &'c Catalog, instance: Instance) -> Self {
        Self {
            catalog,
            saga: instance.saga.clone(),
            instance: Some(instance),
        }
    }

    /// Swaps the catalog, as a reload does; the instance stays as stored.
    fn reload(&mut self, catalog: &'c Catalog) {
        self.catalog = catalog;
    }

    /// The current instance.
    fn instance(&self) -> &Instance {
        self.instance.as_ref().expect("no instance yet")
    }

    /// Routes `input` to this saga and applies it to the current instance.
    fn try_send(&mut self, input: Input) -> Result<Applied, StepError> {
        let routes = route(self.catalog, &input)?;
        let r = routes
            .iter()
            .find(|r| r.saga == self.saga)
            .ok_or(StepError::NotStarting)?;
        let applied = apply(
            self.catalog,
            &self.saga,
            &r.correlation_id,
            self.instance.as_ref(),
            &input,
        )?;
        assert_eq!(
            applied.started,
            self.instance.is_none(),
            "an input starts an instance exactly when there is none"
        );
        assert_eq!(
            applied.instance.applied,
            self.instance.as_ref().map_or(0, |i| i.applied) + 1,
            "every applied input is counted once"
        );
        self.instance = Some(applied.instance.clone());
        Ok(applied)
    }

    /// [`Scenario::try_send`] for an input that must be applied.
    fn send(&mut self, input: Input) -> Applied {
        let shown = format!("{} {}", input.subject, input.body);
        self.try_send(input)
            .unwrap_or_else(|e| panic!("{shown} was not applied: {e:?}"))
    }

    /// Fires one of the instance's pending timers, at its due time.
    fn fire(&mut self, timer: &str) -> Applied {
        let input = fire(self.instance(), timer);
        self.send(input)
    }
}

/// The input of a timer the instance has pending.
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
    let mut s = Scenario::new(&c, "chain");
    let a0 = s.send(agg("Trip", "t1", "Go", 0, json!({})));
    assert!(a0.started);
    assert_eq!(subjects(&a0), ["effect.book_a"]);
    // The step's retry policy travels in the effect command: the effect worker retries.
    assert_eq!(a0.work[0].body["metadata"]["retry"]["retry_limit"], 4);
    let a1 = s.send(effect_result(
        &a0.work[0].body,
        "Succeeded",
        1,
        json!({"ref": "A"}),
    ));
    assert_eq!(subjects(&a1), ["effect.book_b"]);
    // Keep the instance as it waits for step b, to hand it a late result below.
    let mut waiting_for_b = s.clone();
    let a2 = s.send(effect_result(&a1.work[0].body, "Succeeded", 2, json!({})));
    assert_eq!(a2.instance.state, "step:c");
    let a3 = s.send(effect_result(&a2.work[0].body, "Failed", 3, json!({})));
    assert_eq!(subjects(&a3), ["effect.undo_b"]);
    assert_eq!(a3.instance.state, "compensating:b");
    let a4 = s.send(effect_result(&a3.work[0].body, "Succeeded", 4, json!({})));
    assert_eq!(subjects(&a4), ["effect.undo_a"]);
    assert_eq!(a4.work[0].body["metadata"]["retry"]["retry_limit"], 9);
    let a5 = s.send(effect_result(&a4.work[0].body, "Succeeded", 5, json!({})));
    assert!(a5.work.is_empty());
    assert_eq!(
        (a5.instance.state.as_str(), a5.instance.status),
        ("compensated", Status::Compensated)
    );
    // A second result for a command already answered is refused like a forged one.
    let stale = waiting_for_b.try_send(effect_result(&a0.work[0].body, "Succeeded", 6, json!({})));
    assert!(
        matches!(stale, Err(StepError::UnansweredCommand { .. })),
        "{stale:?}"
    );
}

/// The `cmd` saga past its first step: the seat command is out.
fn start_cmd(c: &Catalog) -> (Scenario<'_>, Applied) {
    let mut s = Scenario::new(c, "cmd");
    let a0 = s.send(agg(
        "Trip",
        "t9",
        "Start",
        0,
        json!({"wallet": "w1", "seat": "s7"}),
    ));
    let a1 = s.send(effect_result(&a0.work[0].body, "Succeeded", 1, json!({})));
    (s, a1)
}

#[test]
fn command_step_waits_under_a_timeout_and_retries_with_backoff() {
    let c = catalog(&[("o.yaml", ORCH)]);
    let (mut s, a1) = start_cmd(&c);
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
    let a2 = s.send(reply("Seat", "s7", "SeatBusy", 2, "t9"));
    assert!(a2.work.is_empty());
    assert_eq!(a2.timers_cancelled[0].name, "seat.timeout");
    assert_eq!(a2.timers_set[0].name, "seat.retry");
    assert_eq!(a2.timers_set[0].due_ms, T0 + 2000 + 20);
    let a3 = s.fire("seat.retry");
    assert_eq!(subjects(&a3), ["command.Seat"]);
    assert_ne!(
        a3.work[0].msg_id, a1.work[0].msg_id,
        "a re-send is a new command"
    );
    // No answer: the timeout counts as a failure; the second retry waits 20^2 = 400 ms.
    let a4 = s.fire("seat.timeout");
    assert_eq!(a4.timers_set[0].name, "seat.retry");
    assert_eq!(
        a4.timers_set[0].due_ms,
        a3.instance.timers["seat.timeout"].due_ms + 400
    );
    // Replaying the old timeout is stale.
    let stale = s.try_send(fire(&a3.instance, "seat.timeout"));
    assert!(matches!(stale, Err(StepError::StaleTimer(_))), "{stale:?}");
}

#[test]
fn abort_compensates_without_retrying() {
    let c = catalog(&[("o.yaml", ORCH)]);
    let (mut s, _) = start_cmd(&c);
    let a2 = s.send(reply("Seat", "s7", "SeatClosed", 2, "t9"));
    // No retry timer: straight to the compensation of `pay`, a command to the wallet.
    assert!(a2.timers_set.iter().all(|t| t.name != "seat.retry"));
    assert_eq!(a2.instance.state, "compensating:pay");
    assert_eq!(a2.work.len(), 1);
    assert_eq!(a2.work[0].subject, "command.Wallet.w1");
    assert_eq!(a2.work[0].body["command_type"], "Refund");
    let a3 = s.send(reply("Wallet", "w1", "Refunded", 3, "t9"));
    assert_eq!(a3.instance.status, Status::Compensated);
    assert!(a3.instance.timers.is_empty());
}

#[test]
fn failing_compensation_spends_its_budget_then_needs_an_operator() {
    let c = catalog(&[("o.yaml", ORCH)]);
    let (mut s, _) = start_cmd(&c);
    s.send(reply("Seat", "s7", "SeatClosed", 2, "t9"));
    let a3 = s.send(reply("Wallet", "w1", "RefundFailed", 3, "t9"));
    assert_eq!(a3.instance.status, Status::Running);
    assert_eq!(a3.timers_set[0].name, "pay.compensation_retry");
    let a4 = s.fire("pay.compensation_retry");
    assert_eq!(subjects(&a4), ["command.Wallet"]);
    let a5 = s.fire("pay.compensation_timeout");
    assert_eq!(
        (a5.instance.state.as_str(), a5.instance.status),
        ("needs_operator", Status::NeedsOperator)
    );
    assert!(a5.instance.timers.is_empty());
    let after = s.try_send(reply("Wallet", "w1", "Refunded", 6, "t9"));
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
    let mut s = Scenario::new(&c, "doc");
    let a0 = s.send(agg("Doc", "d1", "Created", 0, json!({})));
    assert_eq!(
        (a0.instance.state.as_str(), a0.instance.data.clone()),
        ("review", json!({"n": 1}))
    );
    assert_eq!(a0.timers_set[0].due_ms, T0 + 60_000);
    // Branch points: before the nudge, and after it (for the second approval).
    let mut in_review = s.clone();
    // The nudge re-arms itself at an absolute time computed from the timer input.
    let a1 = s.fire("nudge");
    assert_eq!(a1.timers_set[0].due_ms, T0 + 120_000);
    assert_eq!(a1.instance.state, "review");
    let mut nudged = s.clone();
    // First guard fails -> the second transition is taken.
    let low = s.send(agg("Doc", "d1", "Approved", 2, json!({"score": 1})));
    assert_eq!(
        (low.instance.state.as_str(), low.instance.status),
        ("rejected", Status::Failed)
    );
    assert_eq!(
        low.timers_cancelled.len(),
        1,
        "a finished instance keeps no timers"
    );
    let high = nudged.send(agg("Doc", "d1", "Approved", 2, json!({"score": 5})));
    assert_eq!(high.instance.status, Status::Completed);
    // Work sees the updated state.
    assert_eq!(high.work[0].body["payload"], json!({"n": 2}));
    assert_eq!(high.timers_cancelled[0].name, "nudge");
    // An event this state does not handle, and a guard that cannot be evaluated.
    let none = in_review.try_send(agg("Doc", "d1", "Deleted", 3, json!({})));
    assert!(matches!(none, Err(StepError::NoTransition { .. })));
    let poison = in_review.try_send(agg("Doc", "d1", "Approved", 3, json!({})));
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
    let mut s = Scenario::new(&c, "doc");
    s.send(agg("Doc", "d1", "Created", 0, json!({})));
    let a1 = s.send(agg("Doc", "d1", "Approved", 1, json!({"score": 5})));
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
    let mut s = Scenario::new(&v1_only, "doc");
    let old = s.send(agg("Doc", "d1", "Created", 0, json!({})));
    assert_eq!(old.instance.version, 1);
    let both = catalog(&[("v1.yaml", MACHINE_V1), ("v2.yaml", MACHINE_V2)]);
    // The in-flight instance continues on version 1's states.
    s.reload(&both);
    let cont = s.send(agg("Doc", "d1", "Approved", 1, json!({"score": 4})));
    assert_eq!(
        (cont.instance.version, cont.instance.state.as_str()),
        (1, "done")
    );
    // A new instance starts on version 2.
    let new = Scenario::new(&both, "doc").send(agg("Doc", "d2", "Created", 2, json!({})));
    assert_eq!(
        (new.instance.version, new.instance.state.as_str()),
        (2, "in_review")
    );
    // With version 1 gone, the old instance cannot run: a typed outcome, not a guess.
    let v2_only = catalog(&[("v2.yaml", MACHINE_V2)]);
    let err = Scenario::resume(&v2_only, old.instance).try_send(agg(
        "Doc",
        "d1",
        "Approved",
        1,
        json!({}),
    ));
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
    let old = Scenario::new(&v1_only, "doc")
        .send(agg("Doc", "d1", "Created", 0, json!({})))
        .instance;
    let v2_only = catalog(&[("v2.yaml", MACHINE_V2)]);
    let m = migrate(&v2_only, &old).unwrap();
    assert_eq!((m.version, m.state.as_str()), (2, "in_review"));
    assert_eq!(m.data, json!({"count": 1, "migrated": true}));
    let done =
        Scenario::resume(&v2_only, m.clone()).send(agg("Doc", "d1", "Approved", 1, json!({})));
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
    // Dropping v1 while instances still run on it is refused even though v2 declares a
    // migration from it: nothing migrates them implicitly. The answer says how.
    let v2_only = catalog(&[("v2.yaml", MACHINE_V2)]);
    let s = v2_only.stranded(&in_use);
    assert_eq!(s.len(), 2, "{s:?}");
    let v1 = s.iter().find(|x| x.version == 1).expect("v1 stranded");
    assert!(v1.migratable);
    assert!(
        v1.to_string()
            .contains("runner migrate --saga doc --from 1"),
        "{v1}"
    );
    // Dropping v2 strands its instances: nothing loaded can run or migrate them.
    let v1_only = catalog(&[("v1.yaml", MACHINE_V1)]);
    let s = v1_only.stranded(&in_use);
    assert!(s.iter().any(|x| x.saga == "doc" && x.version == 2), "{s:?}");
    assert!(s[0].to_string().contains("not loaded"));
}

#[test]
fn tenant_mismatch_is_poison() {
    let c = catalog(&[("v1.yaml", MACHINE_V1)]);
    let mut s = Scenario::new(&c, "doc");
    s.send(agg("Doc", "d1", "Created", 0, json!({})));
    let mut other = agg("Doc", "d1", "Approved", 1, json!({"score": 5}));
    other.body["tenant_id"] = json!("globex");
    let err = s.try_send(other);
    assert!(matches!(err, Err(StepError::Poison { .. })));
    // An instance handed over under another key is refused too.
    let input = agg("Doc", "d2", "Approved", 1, json!({"score": 5}));
    let err = apply(&c, "doc", "d2", Some(s.instance()), &input);
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

/// The order example (a state machine) takes a result only for a command it issued and
/// still waits for, of the same effect: a made-up command id, another instance's command,
/// the wrong effect and a second answer are all refused, without changing the instance.
#[test]
fn state_machine_sagas_accept_only_results_for_commands_they_issued() {
    let c = catalog(&[("order.yaml", include_str!("../manifests/order.yaml"))]);
    let placed = |id: &str, n| {
        agg(
            "Order",
            id,
            "OrderPlaced",
            n,
            json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
        )
    };
    let mut victim = Scenario::new(&c, "order");
    let start = victim.send(placed("o-1", 0));
    let charge = start.work[0].body.json().clone();
    assert_eq!(charge["effect_name"], "charge_card");
    let mut other = Scenario::new(&c, "order");
    let other_charge = other.send(placed("o-2", 1)).work[0].body.json().clone();

    let before = victim.instance().clone();
    let mut forged = charge.clone();
    forged["command_id"] = json!("0190a3c5-0000-7000-8000-000000000000");
    let mut theirs = other_charge;
    theirs["metadata"] = charge["metadata"].clone(); // aimed at o-1
    let mut wrong_effect = charge.clone();
    wrong_effect["effect_name"] = json!("refund_card");
    for (what, cmd) in [
        ("a made-up command id", forged),
        ("another instance's command", theirs),
        ("the wrong effect", wrong_effect),
    ] {
        let r = victim.try_send(effect_result(
            &cmd,
            "Succeeded",
            2,
            json!({"payment_id": "x"}),
        ));
        assert!(
            matches!(r, Err(StepError::UnansweredCommand { .. })),
            "{what}: {r:?}"
        );
        assert_eq!(victim.instance(), &before, "{what} changed the instance");
    }

    let paid = victim.send(effect_result(
        &charge,
        "Succeeded",
        3,
        json!({"payment_id": "p"}),
    ));
    assert_eq!(paid.instance.state, "reserving_stock");
    assert_eq!(paid.instance.data["payment_id"], "p");
    let again = victim.try_send(effect_result(
        &charge,
        "Succeeded",
        4,
        json!({"payment_id": "q"}),
    ));
    assert!(
        matches!(again, Err(StepError::UnansweredCommand { .. })),
        "a second answer: {again:?}"
    );

    // A genuine result that arrives after a timer moved the saga on is ignored, not refused.
    let mut late = Scenario::new(&c, "order");
    let late_charge = late.send(placed("o-3", 5)).work[0].body.clone();
    late.fire("payment_timeout");
    assert_eq!(late.instance().state, "cancelled");
    let r = late.try_send(effect_result(
        &late_charge,
        "Succeeded",
        6,
        json!({"payment_id": "p"}),
    ));
    assert!(matches!(r, Err(StepError::Finished(_))), "{r:?}");
}

/// Instances stored before commands were recorded carry no `awaiting` list: they keep
/// accepting results as they did, so an upgrade strands nothing.
#[test]
fn instances_stored_before_commands_were_recorded_still_take_their_results() {
    let c = catalog(&[("order.yaml", include_str!("../manifests/order.yaml"))]);
    let mut s = Scenario::new(&c, "order");
    let start = s.send(agg(
        "Order",
        "o-1",
        "OrderPlaced",
        0,
        json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
    ));
    let mut legacy = start.instance.clone();
    legacy.awaiting = None;
    let stored: Instance = serde_json::from_value(serde_json::to_value(&legacy).unwrap()).unwrap();
    assert_eq!(stored.awaiting, None, "no field, no list");
    let mut s = Scenario::resume(&c, stored);
    let paid = s.send(effect_result(
        &start.work[0].body,
        "Succeeded",
        1,
        json!({"payment_id": "p"}),
    ));
    assert_eq!(paid.instance.state, "reserving_stock");
}

/// A saga's time is its input's `timestamp_ms`, the producer's clock: the worker passes the
/// broker's stored time in with the input and the engine applies the timestamp within
/// `saga.max_clock_skew` of it. The order saga's 15-minute payment timer is then due
/// 10 to 20 minutes after the order was stored, whatever the producer's clock said — never
/// in 1970 (fired at once) nor at `u64::MAX` (never).
#[test]
fn a_producer_clock_far_off_is_applied_at_the_edge_of_the_stored_time_window() {
    const STORED: u64 = 1_800_000_000_000;
    const SKEW: u64 = 300_000;
    const PAYMENT_TIMEOUT: u64 = 900_000;
    let c = catalog(&[("order.yaml", include_str!("../manifests/order.yaml"))]);
    let bound = Some(TimeBound {
        stored_ms: STORED,
        skew_ms: SKEW,
    });
    let placed = |ts: Value| {
        let mut i = agg(
            "Order",
            "o-1",
            "OrderPlaced",
            0,
            json!({"customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}]}),
        );
        i.body["timestamp_ms"] = ts;
        i
    };
    for (ts, applied_at) in [
        (json!(0), STORED - SKEW),
        (json!(u64::MAX), STORED + SKEW),
        (json!(STORED - SKEW - 1), STORED - SKEW),
        (json!(STORED + 42), STORED + 42),
    ] {
        let input = placed(ts.clone()).with_bound(bound);
        let mut s = Scenario::new(&c, "order");
        let a = s.send(input.clone());
        assert_eq!(a.timers_set.len(), 1, "{ts}");
        assert_eq!(a.timers_set[0].name, "payment_timeout");
        assert_eq!(a.timers_set[0].due_ms, applied_at + PAYMENT_TIMEOUT, "{ts}");
        // Everything the engine derives from the input's time uses the bounded time: the
        // instance's clock and the outputs' (time-ordered) ids.
        assert_eq!(
            (a.instance.started_ms, a.instance.updated_ms),
            (applied_at, applied_at)
        );
        let charge = &a.work[0];
        let id = uuid::Uuid::parse_str(&charge.msg_id).unwrap();
        let (secs, nanos) = id.get_timestamp().unwrap().to_unix();
        assert_eq!(secs * 1000 + u64::from(nanos / 1_000_000), applied_at);
        // Deterministic: the same input with the same stored time (a re-read after a
        // crash) gives byte-identical results.
        let again = apply(&c, "order", "o-1", None, &input).unwrap();
        assert_eq!(again, a, "{ts}");
        // The same as an unbounded input that had said the bounded time itself.
        let honest = apply(&c, "order", "o-1", None, &placed(json!(applied_at))).unwrap();
        assert_eq!(honest, a, "{ts}");
    }
    // An input without a bound (a timer firing: Runner's own time) is applied as it says.
    let unbounded = apply(&c, "order", "o-1", None, &placed(json!(0))).unwrap();
    assert_eq!(unbounded.timers_set[0].due_ms, PAYMENT_TIMEOUT);
}

/// A command step's result is correlated by the `metadata.correlation_id` the command
/// carried (the aggregate echoes it). An event matching a step's result trigger without it
/// answers no command: it concerns no instance of the orchestration, is refused as
/// `UncorrelatedReply` (dead-lettered without parking any key) when no saga takes it, and
/// still reaches every other saga that wants it. The instance waits on, untouched, and its
/// later inputs apply.
#[test]
fn a_command_step_result_without_a_correlation_id_answers_no_instance() {
    let other = r#"
format: 1
sagas:
  - name: seat_log
    version: 1
    triggers: [{ subject: aggregate.Seat.*, event_type: SeatHeld, correlation: event.aggregate_id, start: true }]
    initial_state: open
    states:
      open: { on: { SeatHeld: { goto: logged } } }
      logged: { terminal: true }
"#;
    let c = catalog(&[("o.yaml", ORCH)]);
    let (mut s, a1) = start_cmd(&c);
    assert_eq!(a1.instance.state, "step:seat");
    let mut bare = reply("Seat", "s7", "SeatHeld", 2, "t9");
    bare.body["metadata"] = json!({});
    let refused = s.try_send(bare.clone());
    match &refused {
        Err(e @ StepError::UncorrelatedReply { saga, event }) => {
            assert_eq!((saga.as_str(), event.as_str()), ("cmd", "SeatHeld"));
            assert!(e.to_string().contains("metadata.correlation_id"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    for no_id in [json!(null), json!({"correlation_id": null})] {
        let mut i = bare.clone();
        i.body["metadata"] = no_id;
        assert!(matches!(
            route(&c, &i),
            Err(StepError::UncorrelatedReply { .. })
        ));
    }
    assert_eq!(s.instance().state, "step:seat", "nothing moved");
    // The instance's later inputs apply: its genuine result completes the step.
    let done = s.send(reply("Seat", "s7", "SeatHeld", 3, "t9"));
    assert_eq!(done.instance.status, Status::Completed);

    // Another saga that wants the event by its own correlation still gets it: the
    // orchestration is skipped, not the input.
    let both = catalog(&[("o.yaml", ORCH), ("l.yaml", other)]);
    let routes = route(&both, &bare).unwrap();
    assert_eq!(routes.len(), 1, "{routes:?}");
    assert_eq!(
        (routes[0].saga.as_str(), routes[0].correlation_id.as_str()),
        ("seat_log", "s7")
    );
}

/// A command step whose aggregate does not echo `metadata` is correlated by a result
/// trigger the saga declares itself: it replaces the one Runner would add.
#[test]
fn a_declared_result_trigger_correlates_a_command_step_by_another_field() {
    let own = r#"
format: 1
sagas:
  - name: hold
    version: 1
    triggers:
      - { subject: aggregate.Booking.*, event_type: Requested, correlation: event.aggregate_id, start: true }
      - { subject: aggregate.Seat.*, event_type: SeatHeld, correlation: event.aggregate_id }
      - { subject: aggregate.Seat.*, event_type: SeatBusy, correlation: event.aggregate_id }
    steps:
      - name: seat
        command: { aggregate_type: Seat, command: Hold, aggregate_id: "${ saga.correlation_id }" }
        success: [SeatHeld]
        failure: [SeatBusy]
"#;
    let c = catalog(&[("h.yaml", own)]);
    let mut s = Scenario::new(&c, "hold");
    let a0 = s.send(agg("Booking", "b1", "Requested", 0, json!({})));
    assert_eq!(a0.work[0].subject, "command.Seat.b1");
    let mut bare = agg("Seat", "b1", "SeatHeld", 1, json!({}));
    bare.body["metadata"] = json!({});
    let done = s.send(bare);
    assert_eq!(done.instance.status, Status::Completed);
}
