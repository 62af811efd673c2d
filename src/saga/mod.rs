//! The saga engine: a pure function from (catalog, instance or none, input) to a result.
//!
//! ```text
//!   Input ──route()──▶ [(saga, correlation id)] ──apply()──▶ Applied { instance', work[], timers }
//!                                                    └─────▶ StepError (typed outcome)
//! ```
//!
//! [`route`] tells which sagas an input concerns and under which correlation id (the router
//! runs it); [`apply`] advances one instance (the partition owner runs it, then commits the
//! new instance, the work items and the timers in one storage transaction).
//!
//! Guarantees:
//! - **Pure.** No I/O, no clock, no randomness. Time inside a saga is the input's
//!   `timestamp_ms`: a timer's due time is that plus its delay.
//! - **Deterministic.** The same catalog, instance and input give byte-identical results
//!   (objects are ordered maps, ids are derived, see [`ids`]), so replaying an input after a
//!   crash reproduces the same outputs with the same ids.
//! - **Typed outcomes.** Everything that is not a transition is a [`StepError`] variant the
//!   caller acts on: ignore ([`StepError::NotStarting`], [`StepError::NoTransition`],
//!   [`StepError::Finished`], [`StepError::StaleTimer`]) or dead-letter and park the key
//!   ([`StepError::Poison`], [`StepError::VersionNotLoaded`], [`StepError::UnknownSaga`]).
//!
//! Event names: transitions are keyed by the input's *event name* — the `event_type` of an
//! aggregate or workflow event, `<effect>.<result_type>` of an effect result
//! (`charge_card.Succeeded`), `timer.<name>` of a timer firing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};

use crate::expr::{ExprError, Needs, Vars};
use crate::manifest::Catalog;
use crate::manifest::catalog::{Emit, Saga, SagaKind, TimerWhen, subject_matches};
use crate::manifest::model::{Outcome, RetryPolicy};

pub mod ids;
pub mod migrate;
mod orchestrate;
pub mod retry;
pub mod scenario;

/// Envelope version of everything the engine emits.
pub const ENVELOPE_VERSION: u32 = 1;

/// An input: the subject it arrived on (relative to the tenant) and its JSON envelope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Input {
    /// Subject without the `tenant.<t>.` prefix, e.g. `aggregate.Order.o-1`.
    pub subject: String,
    /// The envelope (`v`, `event_id`, `tenant_id`, `timestamp_ms`, ...; unknown fields ignored).
    pub body: Json,
}

impl Input {
    /// An input from a subject and an envelope.
    pub fn new(subject: impl Into<String>, body: Json) -> Self {
        Self {
            subject: subject.into(),
            body,
        }
    }

    /// The input delivered when a timer falls due. `timer_id` is the id the engine gave the
    /// timer when it set it ([`TimerSet::timer_id`]); it becomes the input's event id.
    pub fn timer(
        tenant: &str,
        saga: &str,
        correlation_id: &str,
        name: &str,
        timer_id: &str,
        due_ms: u64,
    ) -> Self {
        Self {
            subject: format!("timer.{name}"),
            body: json!({
                "v": ENVELOPE_VERSION,
                "event_id": timer_id,
                "tenant_id": tenant,
                "timestamp_ms": due_ms,
                "saga": saga,
                "correlation_id": correlation_id,
                "timer": name,
            }),
        }
    }
}

/// What kind of input, from the first token of its subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputKind {
    /// `aggregate.<Type>.<id>`.
    Aggregate,
    /// `effect_result.<effect>.<command_id>`.
    EffectResult,
    /// `workflow_event.<saga>.<correlation_id>`.
    WorkflowEvent,
    /// `timer.<name>`.
    Timer,
}

/// The fields of an input the engine relies on.
#[derive(Debug, Clone)]
pub(crate) struct Parsed {
    pub(crate) kind: InputKind,
    pub(crate) event_id: String,
    pub(crate) tenant: String,
    pub(crate) timestamp_ms: u64,
    pub(crate) name: String,
    pub(crate) command_id: Option<String>,
    pub(crate) trace_id: Option<String>,
}

fn str_field<'a>(body: &'a Json, key: &str) -> Result<&'a str, StepError> {
    body.get(key)
        .and_then(Json::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| StepError::poison(format!("input has no `{key}` string")))
}

impl Input {
    pub(crate) fn parse(&self) -> Result<Parsed, StepError> {
        let first = self.subject.split('.').next().unwrap_or_default();
        let kind = match first {
            "aggregate" => InputKind::Aggregate,
            "effect_result" => InputKind::EffectResult,
            "workflow_event" => InputKind::WorkflowEvent,
            "timer" => InputKind::Timer,
            other => return Err(StepError::poison(format!("unknown subject kind `{other}`"))),
        };
        let b = &self.body;
        if b.get("v").and_then(Json::as_u64) != Some(u64::from(ENVELOPE_VERSION)) {
            return Err(StepError::poison(format!(
                "envelope `v` is not {ENVELOPE_VERSION}"
            )));
        }
        let timestamp_ms = b
            .get("timestamp_ms")
            .and_then(Json::as_u64)
            .ok_or_else(|| StepError::poison("input has no `timestamp_ms` integer"))?;
        let name = match kind {
            InputKind::Aggregate | InputKind::WorkflowEvent => {
                str_field(b, "event_type")?.to_owned()
            }
            InputKind::EffectResult => {
                format!(
                    "{}.{}",
                    str_field(b, "effect_name")?,
                    str_field(b, "result_type")?
                )
            }
            InputKind::Timer => format!("timer.{}", str_field(b, "timer")?),
        };
        Ok(Parsed {
            kind,
            event_id: str_field(b, "event_id")?.to_owned(),
            tenant: str_field(b, "tenant_id")?.to_owned(),
            timestamp_ms,
            name,
            command_id: b
                .get("command_id")
                .and_then(Json::as_str)
                .map(str::to_owned),
            trace_id: b
                .pointer("/metadata/trace_id")
                .and_then(Json::as_str)
                .map(str::to_owned),
        })
    }
}

/// Lifecycle of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Waiting for its next input.
    Running,
    /// Ended in a terminal state with outcome `completed`.
    Completed,
    /// Ended with outcome `failed`.
    Failed,
    /// Ended after undoing its work.
    Compensated,
    /// A compensation failed after its retries: parked until an operator acts.
    NeedsOperator,
}

impl Status {
    /// Whether the instance accepts no more inputs.
    pub fn is_final(self) -> bool {
        !matches!(self, Status::Running)
    }
}

impl From<Outcome> for Status {
    fn from(o: Outcome) -> Self {
        match o {
            Outcome::Completed => Status::Completed,
            Outcome::Failed => Status::Failed,
            Outcome::Compensated => Status::Compensated,
        }
    }
}

/// A timer an instance has pending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledTimer {
    /// The timer's id (its firing input's event id).
    pub timer_id: String,
    /// When it falls due, ms since the epoch.
    pub due_ms: u64,
}

/// A saga instance: everything the engine needs to continue it. Stored as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    /// Tenant.
    pub tenant: String,
    /// Saga name.
    pub saga: String,
    /// The saga version this instance runs on (fixed at start; changed only by migration).
    pub version: u32,
    /// Correlation id.
    pub correlation_id: String,
    /// Current state name.
    pub state: String,
    /// Lifecycle.
    pub status: Status,
    /// The saga's data (`state` in expressions).
    pub data: Json,
    /// Pending timers by name.
    #[serde(default)]
    pub timers: BTreeMap<String, ScheduledTimer>,
    /// Orchestration bookkeeping (steps style only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<orchestrate::Progress>,
    /// Timestamp of the starting input.
    pub started_ms: u64,
    /// Timestamp of the last applied input.
    pub updated_ms: u64,
    /// Number of inputs applied.
    pub applied: u64,
}

/// Which kind of work item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkKind {
    /// To `effect.<effect>.<command_id>`.
    EffectCommand,
    /// To `command.<AggregateType>.<aggregate_id>`.
    AggregateCommand,
    /// To `workflow_event.<saga>.<correlation_id>`.
    WorkflowEvent,
}

/// A message to publish (through the outbox). The service prefixes `tenant.<t>.`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkItem {
    /// Kind.
    pub kind: WorkKind,
    /// Subject relative to the tenant.
    pub subject: String,
    /// Deterministic id, used as `Nats-Msg-Id` (also the body's command or event id).
    pub msg_id: String,
    /// Envelope.
    pub body: Json,
}

/// A timer to schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerSet {
    /// Timer name.
    pub name: String,
    /// Deterministic id; the firing input carries it as its event id.
    pub timer_id: String,
    /// Due time, ms since the epoch.
    pub due_ms: u64,
}

/// A timer to unschedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimerCancel {
    /// Timer name.
    pub name: String,
    /// Its id.
    pub timer_id: String,
    /// Its due time (part of the schedule key).
    pub due_ms: u64,
}

/// A successful application of one input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    /// The instance after the transition (store it).
    pub instance: Instance,
    /// Whether this input created the instance.
    pub started: bool,
    /// The event name that was handled.
    pub event: String,
    /// Work to publish, in order.
    pub work: Vec<WorkItem>,
    /// Timers to schedule.
    pub timers_set: Vec<TimerSet>,
    /// Timers to unschedule.
    pub timers_cancelled: Vec<TimerCancel>,
}

/// Every outcome of [`apply`] other than a transition.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    /// No such saga in the catalog.
    #[error("saga `{0}` is not loaded")]
    UnknownSaga(String),
    /// There is no instance and the input is not a starting trigger: ignore it.
    #[error("no instance, and the input is not a starting trigger")]
    NotStarting,
    /// The instance's current state has no transition for this event (or no guard held).
    #[error("no transition for `{event}` in state `{state}`")]
    NoTransition {
        /// Current state.
        state: String,
        /// Event name.
        event: String,
    },
    /// The instance has ended; further inputs are ignored.
    #[error("instance has ended with status {0:?}")]
    Finished(Status),
    /// A timer fired that was cancelled or replaced since: ignore it.
    #[error("timer `{0}` is no longer pending")]
    StaleTimer(String),
    /// The instance's version is not loaded (and must be migrated or the version reloaded).
    #[error("saga `{saga}` version {version} is not loaded")]
    VersionNotLoaded {
        /// Saga.
        saga: String,
        /// Version.
        version: u32,
    },
    /// The input cannot be applied (malformed, expression failed): dead-letter it.
    #[error("poison: {reason}")]
    Poison {
        /// Why.
        reason: String,
    },
}

impl StepError {
    pub(crate) fn poison(reason: impl Into<String>) -> Self {
        StepError::Poison {
            reason: reason.into(),
        }
    }
}

/// One saga instance an input concerns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    /// Saga name.
    pub saga: String,
    /// Correlation id (the instance key).
    pub correlation_id: String,
}

fn valid_token(s: &str) -> bool {
    !s.is_empty() && !s.contains(['.', '*', '>']) && !s.chars().any(char::is_whitespace)
}

/// The `event` variable: the input's envelope plus its `subject` and event `name`,
/// borrowed rather than copied.
pub(crate) struct Ev<'a> {
    pub(crate) body: &'a Json,
    fields: [(&'static str, &'a str); 2],
}

impl<'a> Ev<'a> {
    fn new(input: &'a Input, name: &'a str) -> Self {
        Self {
            body: &input.body,
            fields: [("subject", &input.subject), ("name", name)],
        }
    }

    pub(crate) fn vars<'v>(&'v self, state: &'v Json, saga: &'v Json, needs: &Needs) -> Vars<'v> {
        Vars::pruned(self.body, &self.fields, state, saga, needs)
    }
}

fn saga_json(saga: &str, tenant: &str, correlation_id: &str, version: u32, state: &str) -> Json {
    obj([
        ("name", text(saga)),
        ("tenant", text(tenant)),
        ("correlation_id", text(correlation_id)),
        ("version", Json::from(version)),
        ("state", text(state)),
    ])
}

/// A JSON object from owned values (`json!` would re-serialize each value).
fn obj<const N: usize>(fields: [(&str, Json); N]) -> Json {
    Json::Object(fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

fn text(s: &str) -> Json {
    Json::String(s.to_owned())
}

fn retry_json(r: &RetryPolicy) -> Json {
    obj([
        ("retry_limit", Json::from(r.retry_limit)),
        (
            "base_backoff",
            r.base_backoff.map_or(Json::Null, Json::from),
        ),
        ("max_backoff", Json::from(r.max_backoff)),
        ("enable_jitter", Json::Bool(r.enable_jitter)),
    ])
}

/// Which saga instances an input concerns. A timer input names its instance; any other
/// input is matched against every loaded version's triggers (newest first) and the first
/// matching trigger's correlation expression gives the instance key.
pub fn route(catalog: &Catalog, input: &Input) -> Result<Vec<Route>, StepError> {
    let p = input.parse()?;
    if p.kind == InputKind::Timer {
        return Ok(vec![Route {
            saga: str_field(&input.body, "saga")?.to_owned(),
            correlation_id: str_field(&input.body, "correlation_id")?.to_owned(),
        }]);
    }
    let event = Ev::new(input, &p.name);
    let state = json!({});
    // An effect result names the saga that sent the command: only that saga gets it, so two
    // sagas sharing an effect and a correlation id never see each other's results.
    let sender = (p.kind == InputKind::EffectResult)
        .then(|| input.body.pointer("/metadata/saga").and_then(Json::as_str))
        .flatten();
    let mut out = Vec::new();
    for name in catalog.saga_names() {
        if sender.is_some_and(|s| s != name) {
            continue;
        }
        let found = catalog.versions(name).rev().find_map(|s| {
            s.triggers
                .iter()
                .find(|t| trigger_matches(t, &input.subject, &p.name))
                .map(|t| (s, t))
        });
        let Some((saga, trigger)) = found else {
            continue;
        };
        let sj = saga_json(name, &p.tenant, "", saga.version, "");
        let vars = event.vars(&state, &sj, trigger.correlation.needs());
        let corr = trigger
            .correlation
            .eval_string(&vars)
            .map_err(|e| StepError::poison(format!("correlation of saga `{name}`: {e}")))?;
        if !valid_token(&corr) {
            return Err(StepError::poison(format!(
                "correlation id `{corr}` of saga `{name}` is not a valid subject token"
            )));
        }
        out.push(Route {
            saga: name.to_owned(),
            correlation_id: corr,
        });
    }
    Ok(out)
}

fn trigger_matches(t: &crate::manifest::catalog::Trigger, subject: &str, name: &str) -> bool {
    subject_matches(&t.pattern, subject) && t.event_type.as_deref().is_none_or(|e| e == name)
}

/// Accumulates what one application emits, numbering ids in emission order.
pub(crate) struct Emitter<'a> {
    pub(crate) catalog: &'a Catalog,
    pub(crate) p: &'a Parsed,
    pub(crate) saga: &'a Saga,
    pub(crate) correlation_id: &'a str,
    pub(crate) index: u32,
    pub(crate) work: Vec<WorkItem>,
    pub(crate) timers_set: Vec<TimerSet>,
    pub(crate) timers_cancelled: Vec<TimerCancel>,
}

impl Emitter<'_> {
    pub(crate) fn next_id(&mut self) -> String {
        let seed = ids::IdSeed {
            tenant: &self.p.tenant,
            saga: &self.saga.name,
            correlation_id: self.correlation_id,
            input_event_id: &self.p.event_id,
            timestamp_ms: self.p.timestamp_ms,
        };
        let id = ids::derive(&seed, self.index);
        self.index += 1;
        id.to_string()
    }

    fn metadata(&self, extra: Option<&RetryPolicy>) -> Json {
        let mut m = serde_json::Map::new();
        m.insert(
            "correlation_id".into(),
            Json::String(self.correlation_id.to_owned()),
        );
        m.insert("saga".into(), Json::String(self.saga.name.clone()));
        m.insert("saga_version".into(), Json::from(self.saga.version));
        m.insert("causation_id".into(), Json::String(self.p.event_id.clone()));
        if let Some(t) = &self.p.trace_id {
            m.insert("trace_id".into(), Json::String(t.clone()));
        }
        if let Some(r) = extra {
            m.insert("retry".into(), retry_json(r));
        }
        Json::Object(m)
    }

    /// Renders and records one work item; returns its id.
    pub(crate) fn emit(&mut self, e: &Emit, vars: &Vars<'_>) -> Result<String, StepError> {
        let fail = |what: &str, err: ExprError| StepError::poison(format!("{what}: {err}"));
        let id = self.next_id();
        let item = match e {
            Emit::Effect {
                name,
                payload,
                retry,
            } => {
                let payload = payload
                    .render(vars)
                    .map_err(|x| fail("effect payload", x))?;
                let effect = self.catalog.effect(name);
                let retry = retry.or_else(|| effect.and_then(|e| e.retry));
                let mut body = obj([
                    ("v", Json::from(ENVELOPE_VERSION)),
                    ("tenant_id", text(&self.p.tenant)),
                    ("command_id", text(&id)),
                    ("effect_name", text(name)),
                    ("payload", payload),
                    ("metadata", self.metadata(retry.as_ref())),
                ]);
                if let (Some(t), Json::Object(m)) = (effect.and_then(|e| e.timeout_ms), &mut body) {
                    m.insert("timeout_ms".into(), Json::from(t));
                }
                WorkItem {
                    kind: WorkKind::EffectCommand,
                    subject: format!("effect.{name}.{id}"),
                    msg_id: id.clone(),
                    body,
                }
            }
            Emit::Command {
                aggregate_type,
                command,
                aggregate_id,
                payload,
            } => {
                let agg_id = match aggregate_id
                    .render(vars)
                    .map_err(|x| fail("aggregate id", x))?
                {
                    Json::String(s) => s,
                    Json::Number(n) => n.to_string(),
                    other => {
                        return Err(StepError::poison(format!(
                            "aggregate id must be a string, got {}",
                            crate::expr::type_name(&other)
                        )));
                    }
                };
                if !valid_token(&agg_id) {
                    return Err(StepError::poison(format!(
                        "aggregate id `{agg_id}` is not a valid subject token"
                    )));
                }
                let payload = payload
                    .render(vars)
                    .map_err(|x| fail("command payload", x))?;
                WorkItem {
                    kind: WorkKind::AggregateCommand,
                    subject: format!("command.{aggregate_type}.{agg_id}"),
                    msg_id: id.clone(),
                    body: obj([
                        ("v", Json::from(ENVELOPE_VERSION)),
                        ("tenant_id", text(&self.p.tenant)),
                        ("command_id", text(&id)),
                        ("command_type", text(command)),
                        ("aggregate_type", text(aggregate_type)),
                        ("aggregate_id", Json::String(agg_id)),
                        ("payload", payload),
                        ("metadata", self.metadata(None)),
                    ]),
                }
            }
            Emit::Event {
                event_type,
                payload,
            } => {
                let payload = payload.render(vars).map_err(|x| fail("event payload", x))?;
                WorkItem {
                    kind: WorkKind::WorkflowEvent,
                    subject: format!("workflow_event.{}.{}", self.saga.name, self.correlation_id),
                    msg_id: id.clone(),
                    body: obj([
                        ("v", Json::from(ENVELOPE_VERSION)),
                        ("event_id", text(&id)),
                        ("tenant_id", text(&self.p.tenant)),
                        ("event_type", text(event_type)),
                        ("saga", text(&self.saga.name)),
                        ("correlation_id", text(self.correlation_id)),
                        ("timestamp_ms", Json::from(self.p.timestamp_ms)),
                        ("payload", payload),
                        ("metadata", self.metadata(None)),
                    ]),
                }
            }
        };
        self.work.push(item);
        Ok(id)
    }

    /// Sets (or replaces) a timer on the instance.
    pub(crate) fn set_timer(&mut self, inst: &mut Instance, name: &str, due_ms: u64) {
        self.cancel_timer(inst, name);
        let timer_id = self.next_id();
        inst.timers.insert(
            name.to_owned(),
            ScheduledTimer {
                timer_id: timer_id.clone(),
                due_ms,
            },
        );
        self.timers_set.push(TimerSet {
            name: name.to_owned(),
            timer_id,
            due_ms,
        });
    }

    /// Cancels a pending timer; nothing happens when it is not pending.
    pub(crate) fn cancel_timer(&mut self, inst: &mut Instance, name: &str) {
        if let Some(t) = inst.timers.remove(name) {
            self.timers_set.retain(|s| s.timer_id != t.timer_id);
            self.timers_cancelled.push(TimerCancel {
                name: name.to_owned(),
                timer_id: t.timer_id,
                due_ms: t.due_ms,
            });
        }
    }

    pub(crate) fn cancel_all_timers(&mut self, inst: &mut Instance) {
        let names: Vec<String> = inst.timers.keys().cloned().collect();
        for n in names {
            self.cancel_timer(inst, &n);
        }
    }
}

/// Applies one input to one saga instance (or starts one). Pure and deterministic.
///
/// `instance` is the stored instance for (`saga`, `correlation_id`), or `None`. The result
/// is the new instance with what to publish and schedule, or a typed [`StepError`].
pub fn apply(
    catalog: &Catalog,
    saga: &str,
    correlation_id: &str,
    instance: Option<&Instance>,
    input: &Input,
) -> Result<Applied, StepError> {
    apply_owned(catalog, saga, correlation_id, instance.cloned(), input)
}

/// [`apply`] taking the stored instance by value (as decoded from storage), which spares
/// copying it. Same results, byte for byte.
pub fn apply_owned(
    catalog: &Catalog,
    saga: &str,
    correlation_id: &str,
    instance: Option<Instance>,
    input: &Input,
) -> Result<Applied, StepError> {
    let p = input.parse()?;
    let (def, mut inst, started) = match instance {
        Some(i) => {
            let def = catalog
                .saga(saga, i.version)
                .ok_or_else(|| StepError::VersionNotLoaded {
                    saga: saga.to_owned(),
                    version: i.version,
                })?;
            if i.saga != saga || i.correlation_id != correlation_id {
                return Err(StepError::poison(format!(
                    "instance is ({}, {}), not ({saga}, {correlation_id})",
                    i.saga, i.correlation_id
                )));
            }
            if i.status.is_final() {
                return Err(StepError::Finished(i.status));
            }
            (def, i, false)
        }
        None => {
            let def = catalog
                .newest(saga)
                .ok_or_else(|| StepError::UnknownSaga(saga.to_owned()))?;
            if p.kind == InputKind::Timer
                || !def
                    .triggers
                    .iter()
                    .any(|t| t.start && trigger_matches(t, &input.subject, &p.name))
            {
                return Err(StepError::NotStarting);
            }
            let inst = Instance {
                tenant: p.tenant.clone(),
                saga: saga.to_owned(),
                version: def.version,
                correlation_id: correlation_id.to_owned(),
                state: String::new(),
                status: Status::Running,
                data: json!({}),
                timers: BTreeMap::new(),
                progress: None,
                started_ms: p.timestamp_ms,
                updated_ms: p.timestamp_ms,
                applied: 0,
            };
            (def, inst, true)
        }
    };
    if p.tenant != inst.tenant {
        return Err(StepError::poison(format!(
            "input tenant `{}` differs from the instance's `{}`",
            p.tenant, inst.tenant
        )));
    }
    if p.kind == InputKind::Timer {
        let name = p.name.trim_start_matches("timer.");
        match inst.timers.get(name) {
            Some(t) if t.timer_id == p.event_id => {
                inst.timers.remove(name);
            }
            _ => return Err(StepError::StaleTimer(name.to_owned())),
        }
    }
    let event = Ev::new(input, &p.name);
    let mut em = Emitter {
        catalog,
        p: &p,
        saga: def,
        correlation_id,
        index: 0,
        work: Vec::new(),
        timers_set: Vec::new(),
        timers_cancelled: Vec::new(),
    };
    if started && let Some(t) = &def.data {
        let sj = saga_json(saga, &p.tenant, correlation_id, def.version, "");
        let empty = json!({});
        let vars = event.vars(&empty, &sj, &def.needs);
        inst.data = t
            .render(&vars)
            .map_err(|e| StepError::poison(format!("initial data: {e}")))?;
    }
    match &def.kind {
        SagaKind::Machine(m) => {
            if started {
                inst.state = m.initial.clone();
            }
            machine_step(m, &mut inst, &event, &p, &mut em, &def.needs)?;
        }
        SagaKind::Steps(o) => orchestrate::step(o, &mut inst, &event, &p, &mut em, started)?,
    }
    if inst.status.is_final() {
        em.cancel_all_timers(&mut inst);
    }
    inst.updated_ms = p.timestamp_ms;
    inst.applied += 1;
    Ok(Applied {
        instance: inst,
        started,
        event: p.name.clone(),
        work: em.work,
        timers_set: em.timers_set,
        timers_cancelled: em.timers_cancelled,
    })
}

fn machine_step(
    m: &crate::manifest::catalog::Machine,
    inst: &mut Instance,
    event: &Ev<'_>,
    p: &Parsed,
    em: &mut Emitter<'_>,
    needs: &Needs,
) -> Result<(), StepError> {
    let no_transition = || StepError::NoTransition {
        state: inst.state.clone(),
        event: p.name.clone(),
    };
    let state = m.states.get(&inst.state).ok_or_else(|| {
        StepError::poison(format!(
            "instance is in state `{}`, which this version lacks",
            inst.state
        ))
    })?;
    let candidates = state.on.get(&p.name).ok_or_else(no_transition)?;
    let sj = saga_json(
        &inst.saga,
        &inst.tenant,
        &inst.correlation_id,
        inst.version,
        &inst.state,
    );
    let chosen = {
        // Guards and updates read only what this event's transitions can read.
        let vars = event.vars(
            &inst.data,
            &sj,
            state.on_needs.get(&p.name).unwrap_or(needs),
        );
        let mut chosen = None;
        for t in candidates {
            let pass = match &t.when {
                Some(g) => g.eval_bool(&vars).map_err(|e| {
                    StepError::poison(format!(
                        "guard on `{}` in state `{}`: {e}",
                        p.name, inst.state
                    ))
                })?,
                None => true,
            };
            if pass {
                chosen = Some(t);
                break;
            }
        }
        let Some(t) = chosen else {
            return Err(no_transition());
        };
        // State updates see the state before the transition.
        let mut updates = Vec::with_capacity(t.set.len());
        for (k, tpl) in &t.set {
            let v = tpl
                .render(&vars)
                .map_err(|e| StepError::poison(format!("update of `{k}`: {e}")))?;
            updates.push((k.clone(), v));
        }
        (t, updates)
    };
    let (t, updates) = chosen;
    if !updates.is_empty() {
        if !inst.data.is_object() {
            inst.data = json!({});
        }
        if let Json::Object(map) = &mut inst.data {
            for (k, v) in updates {
                map.insert(k, v);
            }
        }
    }
    if let Some(next) = &t.goto {
        inst.state = next.clone();
    }
    // Work and timers see the updated state and the new state name.
    let mut dues = Vec::with_capacity(t.timers.len());
    let uses_vars =
        !t.emit.is_empty() || t.timers.iter().any(|x| matches!(x.when, TimerWhen::At(_)));
    let sj = if uses_vars {
        saga_json(
            &inst.saga,
            &inst.tenant,
            &inst.correlation_id,
            inst.version,
            &inst.state,
        )
    } else {
        Json::Null
    };
    {
        let vars = uses_vars.then(|| event.vars(&inst.data, &sj, &t.needs));
        for e in &t.emit {
            if let Some(vars) = &vars {
                em.emit(e, vars)?;
            }
        }
        for timer in &t.timers {
            let due = match (&timer.when, &vars) {
                (TimerWhen::Delay(ms), _) => p.timestamp_ms.saturating_add(*ms),
                (TimerWhen::At(e), Some(vars)) => e.eval_u64(vars).map_err(|x| {
                    StepError::poison(format!("time of timer `{}`: {x}", timer.name))
                })?,
                (TimerWhen::At(_), None) => p.timestamp_ms,
            };
            dues.push((timer.name.as_str(), due));
        }
    }
    for name in &t.cancel_timers {
        em.cancel_timer(inst, name);
    }
    for (name, due) in dues {
        em.set_timer(inst, name, due);
    }
    if let Some(outcome) = m.states.get(&inst.state).and_then(|s| s.terminal) {
        inst.status = outcome.into();
    }
    Ok(())
}
