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

/// The default of `saga.max_clock_skew` ([`TimeBound::skew_ms`]), in ms: 5 minutes. `runner
/// test` bounds its inputs' times with it.
pub const DEFAULT_MAX_CLOCK_SKEW_MS: u64 = 300_000;

/// An input: the subject it arrived on (relative to the tenant), its JSON envelope, and the
/// bound its time is applied within.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Input {
    /// Subject without the `tenant.<t>.` prefix, e.g. `aggregate.Order.o-1`.
    pub subject: String,
    /// The envelope (`v`, `event_id`, `tenant_id`, `timestamp_ms`, ...; unknown fields ignored).
    pub body: Json,
    /// The window the envelope's `timestamp_ms` (the producer's clock) is applied within:
    /// set by the worker from the time the broker stored the input. `None` applies the
    /// timestamp as it is (a timer firing, whose time is Runner's own; engine tests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound: Option<TimeBound>,
}

/// Where an input's time may lie: within `skew_ms` of `stored_ms`, the time the broker
/// stored it (the JetStream message's own timestamp, fixed per stream sequence, so a
/// re-read after a crash gets the same bound). A producer's `timestamp_ms` outside it is
/// moved to its nearest edge ([`TimeBound::clamp`]): a producer clock at 0 cannot make a
/// 15-minute timer fire at once, nor one at `u64::MAX` keep it from ever firing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeBound {
    /// When the broker stored the input, ms since the epoch.
    pub stored_ms: u64,
    /// How far the producer's `timestamp_ms` may lie from `stored_ms`, either way
    /// (`saga.max_clock_skew`).
    pub skew_ms: u64,
}

impl TimeBound {
    /// `timestamp_ms` moved into `[stored_ms - skew_ms, stored_ms + skew_ms]` (saturating at
    /// 0 and `u64::MAX`); a timestamp inside is returned as it is.
    pub fn clamp(&self, timestamp_ms: u64) -> u64 {
        timestamp_ms.clamp(
            self.stored_ms.saturating_sub(self.skew_ms),
            self.stored_ms.saturating_add(self.skew_ms),
        )
    }
}

impl Input {
    /// An input from a subject and an envelope, its timestamp applied as it is.
    pub fn new(subject: impl Into<String>, body: Json) -> Self {
        Self {
            subject: subject.into(),
            body,
            bound: None,
        }
    }

    /// This input with its time bounded by `bound` (see [`TimeBound`]).
    pub fn with_bound(mut self, bound: Option<TimeBound>) -> Self {
        self.bound = bound;
        self
    }

    /// The input as the engine applies it: when its `timestamp_ms` lies outside its bound,
    /// a copy whose `timestamp_ms` is the nearest edge, so everything the engine derives from
    /// the input's time (timer due times, ids, `started_ms`/`updated_ms`, the timestamps of
    /// the outputs, and `event.timestamp_ms` in expressions) sees the bounded time. Otherwise
    /// the input itself (no copy).
    pub(crate) fn bounded(&self) -> Cow<'_, Input> {
        let Some(bound) = self.bound else {
            return Cow::Borrowed(self);
        };
        match self.body.get("timestamp_ms").and_then(Json::as_u64) {
            Some(ts) if bound.clamp(ts) != ts => {
                let mut body = self.body.clone();
                body["timestamp_ms"] = Json::from(bound.clamp(ts));
                Cow::Owned(Input {
                    subject: self.subject.clone(),
                    body,
                    bound: self.bound,
                })
            }
            _ => Cow::Borrowed(self),
        }
    }

    /// The input delivered when a timer falls due. `timer_id` is the id the engine gave the
    /// timer when it set it ([`TimerSet::timer_id`]); it becomes the input's event id. Its
    /// time is its due time, which the engine itself computed: it has no [`TimeBound`].
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
            bound: None,
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
        let timestamp_ms = self.bound.map_or(timestamp_ms, |t| t.clamp(timestamp_ms));
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
    /// An input that matches only result triggers Runner added for an orchestration's steps
    /// (`effect_result.<effect>.*`, or a command step's `aggregate.<Type>.*` result event)
    /// but carries no `metadata.correlation_id`: every command Runner sends carries one and
    /// an answer echoes it, so this input answers no command of any instance. Returned by
    /// [`route`](super::route) only when no saga at all takes the input; dead-letter it
    /// without parking any key (it names none), so it can neither move nor stop an instance.
    #[error(
        "`{event}` matches the result triggers of saga `{saga}`'s steps but has no \
         `metadata.correlation_id`, so it answers no command of an instance (an aggregate \
         answering a command step must echo the command's `metadata`)"
    )]
    UncorrelatedReply {
        /// The (first) saga whose step result triggers it matched.
        saga: String,
        /// The input's event name.
        event: String,
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

#[cfg(test)]
mod tests {
    use super::*;

    const STORED: u64 = 1_800_000_000_000;
    const SKEW: u64 = 300_000;
    const BOUND: TimeBound = TimeBound {
        stored_ms: STORED,
        skew_ms: SKEW,
    };

    #[test]
    fn a_timestamp_outside_the_bound_is_moved_to_its_nearest_edge() {
        assert_eq!(BOUND.clamp(0), STORED - SKEW);
        assert_eq!(BOUND.clamp(u64::MAX), STORED + SKEW);
        assert_eq!(BOUND.clamp(STORED - SKEW - 1), STORED - SKEW);
        assert_eq!(BOUND.clamp(STORED + SKEW + 1), STORED + SKEW);
        for inside in [STORED - SKEW, STORED - 1, STORED, STORED + 1, STORED + SKEW] {
            assert_eq!(BOUND.clamp(inside), inside, "{inside}");
        }
        // Near the ends of the range the window saturates instead of wrapping.
        let early = TimeBound {
            stored_ms: 10,
            skew_ms: SKEW,
        };
        assert_eq!((early.clamp(0), early.clamp(u64::MAX)), (0, 10 + SKEW));
        let late = TimeBound {
            stored_ms: u64::MAX - 10,
            skew_ms: SKEW,
        };
        assert_eq!(
            (late.clamp(0), late.clamp(u64::MAX)),
            (u64::MAX - 10 - SKEW, u64::MAX)
        );
        // A skew of 0: always the broker's time.
        let exact = TimeBound {
            stored_ms: STORED,
            skew_ms: 0,
        };
        assert_eq!((exact.clamp(0), exact.clamp(u64::MAX)), (STORED, STORED));
    }

    fn event(ts: Json) -> Input {
        Input::new(
            "aggregate.Order.o-1",
            json!({"v": 1, "event_id": "e-1", "tenant_id": "acme", "event_type": "OrderPlaced",
                   "timestamp_ms": ts}),
        )
    }

    #[test]
    fn the_engine_reads_the_bounded_time_and_the_body_says_it_too() {
        for (ts, want) in [
            (json!(0), STORED - SKEW),
            (json!(u64::MAX), STORED + SKEW),
            (json!(STORED + 7), STORED + 7),
        ] {
            let input = event(ts.clone()).with_bound(Some(BOUND));
            assert_eq!(input.parse().map(|p| p.timestamp_ms), Ok(want), "{ts}");
            let applied = input.bounded();
            assert_eq!(applied.body["timestamp_ms"], json!(want), "{ts}");
            assert_eq!(applied.parse().map(|p| p.timestamp_ms), Ok(want));
            // Only a timestamp that moves costs a copy; the rest of the input is kept.
            assert_eq!(
                matches!(applied, Cow::Borrowed(_)),
                ts == json!(want),
                "{ts}"
            );
            assert_eq!(applied.body["event_id"], "e-1");
        }
        // Without a bound (a timer firing, Runner's own time) the timestamp is as given.
        let unbounded = event(json!(0));
        assert_eq!(unbounded.parse().map(|p| p.timestamp_ms), Ok(0));
        assert!(matches!(unbounded.bounded(), Cow::Borrowed(_)));
        // A missing or malformed timestamp stays poison, bound or not.
        let bad = event(json!("soon")).with_bound(Some(BOUND));
        assert!(matches!(bad.parse(), Err(StepError::Poison { .. })));
        assert!(matches!(bad.bounded(), Cow::Borrowed(_)));
    }
}
