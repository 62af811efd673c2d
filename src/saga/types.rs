//! The engine's vocabulary: what goes in ([`Input`]), what is stored ([`Instance`], with
//! its timers and orchestration [`Progress`]), what comes out ([`Applied`]: work items and
//! timer changes) and every outcome that is not a transition ([`StepError`]).
//!
//! Guarantee: these are plain data with a stable serde form. An [`Instance`] is stored as
//! JSON; its optional fields (`timers`, `progress`) carry a serde default, so a record
//! written without them still decodes. Every input is checked here ([`Input::parse`])
//! before the engine relies on it: a malformed one is a [`StepError::Poison`], never a panic.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};

use super::body::Body;
use crate::manifest::model::Outcome;

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

/// The fields of an input the engine relies on, borrowed from it.
#[derive(Debug, Clone)]
pub(crate) struct Parsed<'a> {
    pub(crate) kind: InputKind,
    pub(crate) event_id: &'a str,
    pub(crate) tenant: &'a str,
    pub(crate) timestamp_ms: u64,
    /// The event name (`event_type`, `<effect>.<result_type>` or `timer.<name>`).
    pub(crate) name: Cow<'a, str>,
    pub(crate) command_id: Option<&'a str>,
    pub(crate) trace_id: Option<&'a str>,
}

pub(super) fn str_field<'a>(body: &'a Json, key: &str) -> Result<&'a str, StepError> {
    body.get(key)
        .and_then(Json::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| StepError::poison(format!("input has no `{key}` string")))
}

impl Input {
    pub(crate) fn parse(&self) -> Result<Parsed<'_>, StepError> {
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
                Cow::Borrowed(str_field(b, "event_type")?)
            }
            InputKind::EffectResult => Cow::Owned(format!(
                "{}.{}",
                str_field(b, "effect_name")?,
                str_field(b, "result_type")?
            )),
            InputKind::Timer => Cow::Owned(format!("timer.{}", str_field(b, "timer")?)),
        };
        Ok(Parsed {
            kind,
            event_id: str_field(b, "event_id")?,
            tenant: str_field(b, "tenant_id")?,
            timestamp_ms,
            name,
            command_id: b.get("command_id").and_then(Json::as_str),
            trace_id: b.pointer("/metadata/trace_id").and_then(Json::as_str),
        })
    }
}

/// The event types of the workflow events Runner publishes when an instance ends (or stops
/// for an operator), in the order of [`Status`]'s final variants: completed, failed,
/// compensated, needs operator.
pub const TERMINAL_EVENTS: [&str; 4] = [
    "SagaCompleted",
    "SagaFailed",
    "SagaCompensated",
    "SagaNeedsOperator",
];

/// Whether `body` is one of the workflow events Runner publishes when an instance ends.
pub fn is_terminal_event(subject: &str, body: &Json) -> bool {
    subject.contains(".workflow_event.")
        && body
            .get("event_type")
            .and_then(Json::as_str)
            .is_some_and(|t| TERMINAL_EVENTS.contains(&t))
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
    pub progress: Option<Progress>,
    /// Timestamp of the starting input.
    pub started_ms: u64,
    /// Timestamp of the last applied input.
    pub updated_ms: u64,
    /// Number of inputs applied.
    pub applied: u64,
    /// The effect commands this instance issued and has had no result for: command id →
    /// effect name. An effect result is accepted only for one of them (see
    /// [`StepError::UnansweredCommand`]). `None` for instances stored before commands were
    /// recorded: those accept any result of the right effect, as they did then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awaiting: Option<BTreeMap<String, String>>,
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
    /// Envelope, as the JSON text published.
    pub body: Body,
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
    /// Work to publish, in order: what the manifest emitted.
    pub work: Vec<WorkItem>,
    /// The terminal workflow event when this input ended the instance (or stopped it for
    /// an operator), published after `work` through the same outbox.
    pub finished: Option<WorkItem>,
    /// Timers to schedule.
    pub timers_set: Vec<TimerSet>,
    /// Timers to unschedule.
    pub timers_cancelled: Vec<TimerCancel>,
}

/// Every outcome of [`apply`](super::apply) other than a transition.
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
    /// An effect result that answers no command this instance issued and is still waiting
    /// for (a made-up or another instance's command id, or a second answer): dead-letter it
    /// without parking the key, so a forger can neither move nor stop the saga.
    #[error(
        "effect result for command `{command_id}` answers no command this instance is waiting for"
    )]
    UnansweredCommand {
        /// The command id the result names (empty when it names none).
        command_id: String,
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

/// Where an orchestration stands.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Current stage (index into the stages).
    pub stage: usize,
    /// Whether compensations are running.
    pub compensating: bool,
    /// Whether an abort was received (no more retries).
    pub aborted: bool,
    /// Per step.
    pub steps: BTreeMap<String, StepProgress>,
    /// Steps that succeeded, in completion order.
    pub completed: Vec<String>,
    /// Compensations still to run; the first is running.
    pub to_compensate: Vec<String>,
}

/// One step's bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepProgress {
    /// Where the step is.
    pub status: StepStatus,
    /// Sends so far of the current action (step or compensation), from 1.
    pub attempt: u32,
    /// Id of the last command sent (effect results must carry it).
    pub command_id: String,
}

/// A step's lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    /// Sent; waiting for a result.
    Running,
    /// Failed; waiting for the retry timer.
    RetryWait,
    /// Done.
    Succeeded,
    /// Failed for good.
    Failed,
    /// Compensation sent; waiting for its result.
    Compensating,
    /// Compensation failed; waiting for its retry timer.
    CompensationRetryWait,
    /// Undone.
    Compensated,
}
