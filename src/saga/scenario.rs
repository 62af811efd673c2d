//! `runner test`: scenario files kept beside the manifests, run against the pure engine.
//!
//! A scenario file (`<name>.tests.yaml`) lists tests; each test feeds inputs one after the
//! other through [`super::route`] and [`super::apply`] exactly as the service would (with an
//! in-memory map of instances) and compares what happened with what the test expects:
//!
//! ```yaml
//! format: 1
//! tenant: acme                      # default `_`
//! tests:
//!   - name: a payment timer cancelled by the charge is ignored when it fires
//!     saga: order                   # whose instance the expectations look at
//!     steps:
//!       - event:                    # any input: subject + envelope fields
//!           subject: aggregate.Order.o-1
//!           event_type: OrderPlaced
//!           payload: { customer_id: c-1, amount_cents: 40, items: [{ sku: a, qty: 1 }] }
//!         expect:
//!           state: awaiting_payment
//!           timers_set: [payment_timeout]
//!           work: [ { kind: effect_command, subject: "effect.charge_card.*" } ]
//!       - effect_result:          # answers the last command of that effect
//!           { effect: charge_card, result: Succeeded, payload: { payment_id: p-1 } }
//!         expect: { state: reserving_stock, timers_cancelled: [payment_timeout] }
//!       - fire_timer: payment_timeout   # pending, or the last one set (here: cancelled)
//!         expect: { outcome: stale_timer, state: reserving_stock }
//! ```
//!
//! `fire_timer` fires the instance's pending timer of that name at its due time; when none
//! is pending it fires the last timer of that name the test set (cancelled by a transition
//! or by the end of the instance), as a late firing would arrive in the service, so a test
//! can show that it is ignored (`stale_timer`, or `finished` once the instance has ended).
//! A timer name the test never set is an error of the test.
//!
//! Envelope defaults: `v: 1`, `tenant_id`, a deterministic `event_id`, and `timestamp_ms`
//! one second after the previous input (the first at 1 700 000 000 000) unless `at_ms` is given.
//! That step time plays the broker's stored time: an event that gives its own `timestamp_ms`
//! is applied within the default `saga.max_clock_skew` (5 minutes) of it, as in the service,
//! and does not move the test's clock; a timer firing moves the clock to its due time (or
//! `at_ms`).
//! Expectations are partial: `data` and work `body` match when every field given is equal
//! (objects may have more fields; lists must have the same length); a work `subject` may end
//! in `*`; `work` (when given) must list every item emitted, in order. The comparisons
//! live in `check.rs`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::{Value as Json, json};
use serde_saphyr::Spanned;

mod check;

use check::{check_expect, check_outcome};

use super::engine::{apply, route};
use super::ids;
use super::types::{
    Applied, DEFAULT_MAX_CLOCK_SKEW_MS, Input, Instance, Status, StepError, TimeBound, WorkKind,
};
use crate::manifest::{Catalog, Diagnostic, Severity};

/// First input time when a test gives none.
pub const DEFAULT_START_MS: u64 = 1_700_000_000_000;

/// A scenario file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioFile {
    /// Format version, `1`.
    pub format: u32,
    /// Tenant of every input (default `_`).
    #[serde(default)]
    pub tenant: Option<String>,
    /// The tests.
    pub tests: Vec<Scenario>,
}

/// One test.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Test name.
    pub name: Spanned<String>,
    /// Saga whose instance is checked (default: the only saga an input routes to).
    #[serde(default)]
    pub saga: Option<String>,
    /// Inputs with expectations.
    pub steps: Vec<ScenarioStep>,
}

/// One input and what should follow.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioStep {
    /// A raw input: `subject` plus envelope fields.
    #[serde(default)]
    pub event: Option<BTreeMap<String, Json>>,
    /// A result for the last effect command of that effect.
    #[serde(default)]
    pub effect_result: Option<EffectReply>,
    /// Fire the instance's timer of that name at its due time: the pending one, else the
    /// last one set (since cancelled), which the engine ignores.
    #[serde(default)]
    pub fire_timer: Option<String>,
    /// Input time (ms), instead of the default: the time the broker stored the input.
    #[serde(default)]
    pub at_ms: Option<u64>,
    /// Expectations.
    #[serde(default)]
    pub expect: Expect,
}

/// A reply to an effect command.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EffectReply {
    /// Effect name.
    pub effect: String,
    /// `Succeeded`, `Failed` or `TimedOut` (anything else is refused when the file is read,
    /// naming its line).
    pub result: ReplyKind,
    /// Result payload.
    #[serde(default)]
    pub payload: Json,
}

/// A timer a step expects to be set.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ExpectTimer {
    /// Only its name.
    Name(String),
    /// Its name and when it is due.
    Due(TimerDue),
}

/// A timer expected due `after_ms` after the input's time.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimerDue {
    /// Timer name.
    pub name: String,
    /// Milliseconds from the input's time (its `timestamp_ms` as applied) to the due time.
    pub after_ms: u64,
}

impl ExpectTimer {
    /// The timer's name.
    pub fn name(&self) -> &str {
        match self {
            ExpectTimer::Name(n) => n,
            ExpectTimer::Due(d) => &d.name,
        }
    }
}

/// The kind of an effect result a test step sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ReplyKind {
    /// The effect did its work.
    Succeeded,
    /// It failed for good.
    Failed,
    /// No answer in time.
    TimedOut,
}

impl ReplyKind {
    /// As a result event's `result_type`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplyKind::Succeeded => "Succeeded",
            ReplyKind::Failed => "Failed",
            ReplyKind::TimedOut => "TimedOut",
        }
    }
}

/// What a step expects; every field is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// `applied` (default), `not_starting`, `no_transition`, `finished`, `stale_timer`,
    /// `unanswered_command` (an effect result for no command the instance waits for),
    /// `uncorrelated_reply` (a step result without `metadata.correlation_id`), `poison`,
    /// `not_routed`.
    #[serde(default)]
    pub outcome: Option<String>,
    /// State name after the step.
    #[serde(default)]
    pub state: Option<String>,
    /// Status after the step.
    #[serde(default)]
    pub status: Option<Status>,
    /// Partial match of the instance data.
    #[serde(default)]
    pub data: Option<Json>,
    /// Every work item emitted, in order (partial match of each).
    #[serde(default)]
    pub work: Option<Vec<ExpectWork>>,
    /// Timers set, in order: a name, or `{name, after_ms}` to also check when it is due
    /// (milliseconds after the input's time).
    #[serde(default)]
    pub timers_set: Option<Vec<ExpectTimer>>,
    /// Names of timers cancelled.
    #[serde(default)]
    pub timers_cancelled: Option<Vec<String>>,
    /// The terminal workflow event the step published (`SagaCompleted`, `SagaFailed`,
    /// `SagaCompensated`, `SagaNeedsOperator`), partial match; `null` expects none. It is
    /// not part of `work`, which lists what the manifest emitted.
    #[serde(default, deserialize_with = "some_or_null")]
    pub finished_event: Option<Option<ExpectWork>>,
}

/// Tells a field given as `null` (`Some(None)`) from one not given (`None`).
fn some_or_null<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// An expected work item.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectWork {
    /// Kind.
    #[serde(default)]
    pub kind: Option<WorkKind>,
    /// Subject; a trailing `*` matches any rest.
    #[serde(default)]
    pub subject: Option<String>,
    /// Partial match of the body.
    #[serde(default)]
    pub body: Option<Json>,
}

/// The result of one test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestResult {
    /// File.
    pub file: String,
    /// Test name.
    pub name: String,
    /// Line of the test's name.
    pub line: u64,
    /// Empty when passed; otherwise readable differences.
    pub failures: Vec<String>,
}

impl TestResult {
    /// Whether the test passed.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Parses a scenario file; a YAML error becomes a located diagnostic.
pub fn parse(file: &Path, text: &str) -> Result<ScenarioFile, Diagnostic> {
    serde_saphyr::from_str::<ScenarioFile>(text).map_err(|e| {
        let (line, column) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        Diagnostic {
            file: file.to_path_buf(),
            line,
            column,
            severity: Severity::Error,
            message: format!("invalid test file: {}", crate::manifest::yaml_message(&e)),
        }
    })
}

/// Runs every test of a parsed file.
pub fn run_file(catalog: &Catalog, file: &Path, f: &ScenarioFile) -> Vec<TestResult> {
    let tenant = f.tenant.clone().unwrap_or_else(|| "_".to_owned());
    f.tests
        .iter()
        .map(|t| TestResult {
            file: file.display().to_string(),
            name: t.name.value.clone(),
            line: t.name.referenced.line(),
            failures: run_one(catalog, &tenant, t),
        })
        .collect()
}

fn outcome_name(r: &Result<Applied, StepError>) -> &'static str {
    match r {
        Ok(_) => "applied",
        Err(StepError::NotStarting) => "not_starting",
        Err(StepError::NoTransition { .. }) => "no_transition",
        Err(StepError::Finished(_)) => "finished",
        Err(StepError::StaleTimer(_)) => "stale_timer",
        Err(StepError::Poison { .. }) => "poison",
        Err(StepError::UnknownSaga(_)) => "unknown_saga",
        Err(StepError::VersionNotLoaded { .. }) => "version_not_loaded",
        Err(StepError::UnansweredCommand { .. }) => "unanswered_command",
        Err(StepError::UncorrelatedReply { .. }) => "uncorrelated_reply",
    }
}

fn run_one(catalog: &Catalog, tenant: &str, t: &Scenario) -> Vec<String> {
    let mut failures = Vec::new();
    let mut instances: BTreeMap<(String, String), Instance> = BTreeMap::new();
    let mut sent: Vec<(String, Json)> = Vec::new(); // (effect, command body) emitted so far
    let mut now = DEFAULT_START_MS;
    let mut target: Option<(String, String)> = None;
    let mut timers_seen = TimersSeen::new();
    for (i, step) in t.steps.iter().enumerate() {
        let label = format!("step {}", i + 1);
        let event_id = ids::derive(
            &ids::IdSeed {
                tenant,
                saga: "runner-test",
                correlation_id: &t.name.value,
                input_event_id: "",
                timestamp_ms: now,
            },
            i as u32,
        )
        .to_string();
        now = step.at_ms.unwrap_or(if i == 0 { now } else { now + 1_000 });
        let ctx = InputCtx {
            tenant,
            event_id: &event_id,
            now,
            sent: &sent,
            instances: &instances,
            target: &target,
            timers_seen: &timers_seen,
        };
        let input = match build_input(step, &ctx, t) {
            Ok(input) => input,
            Err(e) => {
                failures.push(format!("{label}: {e}"));
                break;
            }
        };
        if input.bound.is_none()
            && let Some(ts) = input.body.get("timestamp_ms").and_then(Json::as_u64)
        {
            // A timer firing: the clock moves to its time, as the service's would.
            now = ts;
        }
        let routes = match route(catalog, &input) {
            Ok(r) => r,
            Err(e) => {
                let outcome = outcome_name(&Err(e.clone()));
                check_outcome(&mut failures, &label, &step.expect, outcome, &e.to_string());
                continue;
            }
        };
        let mut observed: Option<(String, Result<Applied, StepError>)> = None;
        for r in routes {
            let key = (r.saga.clone(), r.correlation_id.clone());
            let res = apply(
                catalog,
                &r.saga,
                &r.correlation_id,
                instances.get(&key),
                &input,
            );
            if let Ok(a) = &res {
                for ts in &a.timers_set {
                    timers_seen.insert(
                        (key.0.clone(), key.1.clone(), ts.name.clone()),
                        (ts.timer_id.clone(), ts.due_ms),
                    );
                }
                for w in &a.work {
                    if w.kind == WorkKind::EffectCommand {
                        let effect = w
                            .body
                            .get("effect_name")
                            .and_then(Json::as_str)
                            .unwrap_or_default();
                        sent.push((effect.to_owned(), w.body.json().clone()));
                    }
                }
                instances.insert(key.clone(), a.instance.clone());
            }
            let wanted = t.saga.as_deref().is_none_or(|s| s == r.saga);
            if wanted && observed.is_none() {
                target = Some(key);
                observed = Some((r.saga, res));
            }
        }
        let Some((_, res)) = observed else {
            check_outcome(
                &mut failures,
                &label,
                &step.expect,
                "not_routed",
                "no saga wants this input",
            );
            continue;
        };
        let detail = match &res {
            Err(e) => e.to_string(),
            Ok(_) => String::new(),
        };
        check_outcome(
            &mut failures,
            &label,
            &step.expect,
            outcome_name(&res),
            &detail,
        );
        let inst = target.as_ref().and_then(|k| instances.get(k));
        let input_ms = input
            .body
            .get("timestamp_ms")
            .and_then(Json::as_u64)
            .unwrap_or(now);
        let input_ms = input.bound.map_or(input_ms, |b| b.clamp(input_ms));
        check_expect(
            &mut failures,
            &label,
            &step.expect,
            (inst, res.as_ref().ok()),
            input_ms,
        );
    }
    failures
}

/// The bound of an event or effect result read at the step's time `now`: the step's time
/// plays the broker's stored time, so an event's own `timestamp_ms` is applied within
/// [`DEFAULT_MAX_CLOCK_SKEW_MS`] of it, as the service (with the default
/// `saga.max_clock_skew`) would.
fn step_bound(now: u64) -> TimeBound {
    TimeBound {
        stored_ms: now,
        skew_ms: DEFAULT_MAX_CLOCK_SKEW_MS,
    }
}

/// The last timer of each name a test set: (saga, correlation id, name) → (id, due ms).
type TimersSeen = BTreeMap<(String, String, String), (String, u64)>;

/// What a step's input is built from.
#[derive(Clone, Copy)]
struct InputCtx<'a> {
    tenant: &'a str,
    event_id: &'a str,
    now: u64,
    sent: &'a [(String, Json)],
    instances: &'a BTreeMap<(String, String), Instance>,
    target: &'a Option<(String, String)>,
    timers_seen: &'a TimersSeen,
}

fn build_input(step: &ScenarioStep, ctx: &InputCtx<'_>, t: &Scenario) -> Result<Input, String> {
    let InputCtx {
        tenant,
        event_id,
        now,
        sent,
        instances,
        target,
        timers_seen,
    } = *ctx;
    let given = usize::from(step.event.is_some())
        + usize::from(step.effect_result.is_some())
        + usize::from(step.fire_timer.is_some());
    if given != 1 {
        return Err("give exactly one of `event`, `effect_result`, `fire_timer`".into());
    }
    if let Some(ev) = &step.event {
        let mut body: serde_json::Map<String, Json> = ev.clone().into_iter().collect();
        let subject = match body.remove("subject") {
            Some(Json::String(s)) => s,
            _ => return Err("an `event` needs a `subject` string".into()),
        };
        body.entry("v").or_insert(json!(1));
        body.entry("tenant_id").or_insert(json!(tenant));
        body.entry("event_id").or_insert(json!(event_id));
        body.entry("timestamp_ms").or_insert(json!(now));
        if subject.starts_with("aggregate.") {
            let mut parts = subject.splitn(3, '.').skip(1);
            if let (Some(ty), Some(id)) = (parts.next(), parts.next()) {
                body.entry("aggregate_type").or_insert(json!(ty));
                body.entry("aggregate_id").or_insert(json!(id));
            }
        }
        body.entry("payload").or_insert(json!({}));
        body.entry("metadata").or_insert(json!({}));
        return Ok(Input::new(subject, Json::Object(body)).with_bound(Some(step_bound(now))));
    }
    if let Some(reply) = &step.effect_result {
        let (_, cmd) = sent
            .iter()
            .rev()
            .find(|(e, _)| *e == reply.effect)
            .ok_or_else(|| format!("no effect command for `{}` was emitted", reply.effect))?;
        let command_id = cmd
            .get("command_id")
            .and_then(Json::as_str)
            .unwrap_or_default();
        return Ok(Input::new(
            format!("effect_result.{}.{command_id}", reply.effect),
            json!({
                "v": 1,
                "event_id": event_id,
                "tenant_id": tenant,
                "command_id": command_id,
                "effect_name": reply.effect,
                "result_type": reply.result.as_str(),
                "payload": reply.payload,
                "attempts": 1,
                "timestamp_ms": now,
                "metadata": cmd.get("metadata").cloned().unwrap_or(Json::Null),
            }),
        )
        .with_bound(Some(step_bound(now))));
    }
    let name = step.fire_timer.as_deref().unwrap_or_default();
    let key = target
        .clone()
        .or_else(|| {
            instances
                .keys()
                .find(|(s, _)| t.saga.as_deref().is_none_or(|x| x == s))
                .cloned()
        })
        .ok_or("no instance to fire a timer on")?;
    let inst = instances
        .get(&key)
        .ok_or("no instance to fire a timer on")?;
    // The pending timer of that name; else the last one the test set (since cancelled),
    // fired late as the service would see it.
    let (timer_id, due_ms) = match inst.timers.get(name) {
        Some(timer) => (timer.timer_id.clone(), timer.due_ms),
        None => timers_seen
            .get(&(key.0.clone(), key.1.clone(), name.to_owned()))
            .cloned()
            .ok_or_else(|| {
                format!(
                    "timer `{name}` was never set on this instance (pending: {:?})",
                    inst.timers.keys().collect::<Vec<_>>()
                )
            })?,
    };
    let due = step.at_ms.unwrap_or(due_ms);
    Ok(Input::timer(
        &inst.tenant,
        &key.0,
        &key.1,
        name,
        &timer_id,
        due,
    ))
}
