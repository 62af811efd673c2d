//! The compiled, runnable form of the manifests: what the saga engine executes.
//!
//! A [`Catalog`](super::Catalog) holds these behind `Arc`s, immutable once built: every
//! expression is already compiled, every name already resolved and checked. A reload
//! builds a whole new catalog; nothing here changes in place.

use std::collections::BTreeMap;

use serde::Serialize;

use super::model::{CircuitBreaker, Outcome, RetryPolicy};
use crate::expr::{Expr, Needs, Template};

/// A declared effect.
#[derive(Debug, Clone)]
pub struct Effect {
    /// Effect name.
    pub name: String,
    /// Provider (`noop`, `http`, `nats_publish`).
    pub provider: String,
    /// Provider settings.
    pub settings: BTreeMap<String, serde_json::Value>,
    /// Per-attempt timeout in milliseconds.
    pub timeout_ms: Option<u64>,
    /// Default retry policy (applied by the effect worker).
    pub retry: Option<RetryPolicy>,
    /// Circuit breaker settings.
    pub circuit_breaker: Option<CircuitBreaker>,
    /// Where it is declared (its name), for diagnostics about its settings.
    pub declared: Declared,
}

/// Where a declaration is written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Declared {
    /// The manifest file.
    pub file: std::path::PathBuf,
    /// 1-based line.
    pub line: u64,
    /// 1-based column.
    pub column: u64,
}

/// One loaded version of a saga.
#[derive(Debug)]
pub struct Saga {
    /// Saga name.
    pub name: String,
    /// Version.
    pub version: u32,
    /// Events this version reacts to.
    pub triggers: Vec<Trigger>,
    /// Initial data template (rendered over the starting event); `{}` when absent.
    pub data: Option<Template>,
    /// State machine or orchestration.
    pub kind: SagaKind,
    /// Migration from `version - 1`, when declared.
    pub migration: Option<Migration>,
    /// What all of this version's expressions can read (bound for each evaluation).
    pub needs: Needs,
    /// Whether it can emit an effect command ([`SagaKind::starts_effects`], computed once).
    pub starts_effects: bool,
}

/// How a saga is written.
#[derive(Debug)]
pub enum SagaKind {
    /// Explicit states and transitions.
    Machine(Machine),
    /// A list of steps with compensations.
    Steps(Orchestration),
}

/// A trigger: which inputs concern the saga and how they map to an instance.
#[derive(Debug)]
pub struct Trigger {
    /// Subject pattern tokens (`*` one token, `>` the rest).
    pub pattern: Vec<String>,
    /// Required event type, when given.
    pub event_type: Option<String>,
    /// Correlation id expression.
    pub correlation: Expr,
    /// Whether this input may start an instance.
    pub start: bool,
    /// Added by Runner for an orchestration's step results (correlated by
    /// `event.metadata.correlation_id`, which every command Runner sends carries and its
    /// answer echoes). An input it matches that has no `metadata.correlation_id` answers no
    /// command: the saga is skipped, not poisoned (see `StepError::UncorrelatedReply`).
    pub reply: bool,
}

impl Trigger {
    /// Whether a subject (relative to the tenant) matches the pattern.
    pub fn matches_subject(&self, subject: &str) -> bool {
        subject_matches(&self.pattern, subject)
    }
}

/// NATS-style subject matching: `*` matches one token, a final `>` one or more.
pub fn subject_matches(pattern: &[String], subject: &str) -> bool {
    let mut tokens = subject.split('.');
    for (i, p) in pattern.iter().enumerate() {
        if p == ">" {
            return i == pattern.len() - 1 && tokens.next().is_some();
        }
        match tokens.next() {
            Some(t) if p == "*" || p == t => {}
            _ => return false,
        }
    }
    tokens.next().is_none()
}

/// A state machine.
#[derive(Debug)]
pub struct Machine {
    /// Where new instances start.
    pub initial: String,
    /// States by name.
    pub states: BTreeMap<String, State>,
}

/// One state.
#[derive(Debug, Default)]
pub struct State {
    /// Transitions by event name, tried in order.
    pub on: BTreeMap<String, Vec<Transition>>,
    /// `Some` for a terminal state: the status an instance ends with.
    pub terminal: Option<Outcome>,
    /// Per event: what the guards and updates of its transitions can read.
    pub on_needs: BTreeMap<String, Needs>,
}

/// One transition.
#[derive(Debug, Default)]
pub struct Transition {
    /// Guard.
    pub when: Option<Expr>,
    /// Top-level state keys to replace.
    pub set: Vec<(String, Template)>,
    /// Work to emit.
    pub emit: Vec<Emit>,
    /// Timers to set.
    pub timers: Vec<TimerSpec>,
    /// Timers to cancel.
    pub cancel_timers: Vec<String>,
    /// Next state (`None`: stay).
    pub goto: Option<String>,
    /// What this transition's expressions can read.
    pub needs: Needs,
}

impl Transition {
    /// Computes what this transition's expressions can read.
    pub fn compute_needs(&self) -> Needs {
        let mut needs = Needs::default();
        if let Some(w) = &self.when {
            needs.merge(w.needs());
        }
        self.set
            .iter()
            .for_each(|(_, tpl)| tpl.add_needs(&mut needs));
        self.emit.iter().for_each(|e| e.add_needs(&mut needs));
        for timer in &self.timers {
            if let TimerWhen::At(e) = &timer.when {
                needs.merge(e.needs());
            }
        }
        needs
    }
}

/// Work to emit.
#[derive(Debug)]
pub enum Emit {
    /// An effect command.
    Effect {
        /// Effect name (declared).
        name: String,
        /// Payload.
        payload: Template,
        /// Retry policy carried in the command (the effect's default when absent).
        retry: Option<RetryPolicy>,
    },
    /// An aggregate command.
    Command {
        /// Aggregate type.
        aggregate_type: String,
        /// Command type.
        command: String,
        /// Aggregate id.
        aggregate_id: Template,
        /// Payload.
        payload: Template,
    },
    /// A workflow event.
    Event {
        /// Event type.
        event_type: String,
        /// Payload.
        payload: Template,
    },
}

/// When a timer fires.
#[derive(Debug)]
pub enum TimerWhen {
    /// Input event time plus this many milliseconds.
    Delay(u64),
    /// An absolute time in ms since the epoch.
    At(Expr),
}

/// A timer to set.
#[derive(Debug)]
pub struct TimerSpec {
    /// Timer name.
    pub name: String,
    /// Due time.
    pub when: TimerWhen,
}

/// An orchestration: steps grouped into stages that run one after the other.
#[derive(Debug)]
pub struct Orchestration {
    /// Steps in declaration order.
    pub steps: Vec<Step>,
    /// Stages: indexes into `steps`; the steps of one stage run in parallel.
    pub stages: Vec<Vec<usize>>,
}

/// A step.
#[derive(Debug)]
pub struct Step {
    /// Step name.
    pub name: String,
    /// What the step does.
    pub action: Emit,
    /// Event names meaning success.
    pub success: Vec<String>,
    /// Event names meaning failure.
    pub failure: Vec<String>,
    /// Event names meaning abort.
    pub abort: Vec<String>,
    /// Retry policy.
    pub retry: Option<RetryPolicy>,
    /// Result timeout for command steps.
    pub timeout_ms: u64,
    /// How to undo it.
    pub compensation: Option<Compensation>,
}

/// A compensation.
#[derive(Debug)]
pub struct Compensation {
    /// What undoes the step.
    pub action: Emit,
    /// Event names meaning success.
    pub success: Vec<String>,
    /// Event names meaning failure.
    pub failure: Vec<String>,
    /// Retry budget.
    pub retry: Option<RetryPolicy>,
    /// Result timeout for command compensations.
    pub timeout_ms: u64,
}

/// A migration from `from` to the saga's version.
#[derive(Debug)]
pub struct Migration {
    /// Version migrated from.
    pub from: u32,
    /// New data expression.
    pub data: Option<Expr>,
    /// State renames.
    pub states: BTreeMap<String, String>,
}

impl Emit {
    /// Adds what this item's templates read to `needs`.
    pub fn add_needs(&self, needs: &mut Needs) {
        match self {
            Emit::Effect { payload, .. } | Emit::Event { payload, .. } => payload.add_needs(needs),
            Emit::Command {
                aggregate_id,
                payload,
                ..
            } => {
                aggregate_id.add_needs(needs);
                payload.add_needs(needs);
            }
        }
    }
}

impl SagaKind {
    /// Whether any transition, step or compensation of it emits an effect command (a saga
    /// that emits none never queues work for an effect worker).
    pub fn starts_effects(&self) -> bool {
        let effect = |e: &Emit| matches!(e, Emit::Effect { .. });
        match self {
            SagaKind::Machine(m) => m
                .states
                .values()
                .flat_map(|s| s.on.values())
                .flatten()
                .any(|t| t.emit.iter().any(effect)),
            SagaKind::Steps(o) => o.steps.iter().any(|s| {
                effect(&s.action) || s.compensation.as_ref().is_some_and(|c| effect(&c.action))
            }),
        }
    }

    /// Adds what every expression of the machine or orchestration reads to `needs`.
    pub fn add_needs(&self, needs: &mut Needs) {
        match self {
            SagaKind::Machine(m) => {
                for t in m.states.values().flat_map(|s| s.on.values()).flatten() {
                    needs.merge(&t.compute_needs());
                }
            }
            SagaKind::Steps(o) => {
                for step in &o.steps {
                    step.action.add_needs(needs);
                    if let Some(c) = &step.compensation {
                        c.action.add_needs(needs);
                    }
                }
            }
        }
    }
}

/// Style of a saga, for summaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Style {
    /// State machine.
    StateMachine,
    /// Orchestration.
    Orchestration,
}

impl Saga {
    /// The saga's style.
    pub fn style(&self) -> Style {
        match self.kind {
            SagaKind::Machine(_) => Style::StateMachine,
            SagaKind::Steps(_) => Style::Orchestration,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Vec<String> {
        s.split('.').map(str::to_owned).collect()
    }

    #[test]
    fn subject_patterns() {
        assert!(subject_matches(
            &p("aggregate.Order.*"),
            "aggregate.Order.o-1"
        ));
        assert!(!subject_matches(
            &p("aggregate.Order.*"),
            "aggregate.Order.o-1.x"
        ));
        assert!(!subject_matches(
            &p("aggregate.Order.*"),
            "aggregate.Payment.p"
        ));
        assert!(subject_matches(
            &p("effect_result.>"),
            "effect_result.charge.c1"
        ));
        assert!(!subject_matches(&p("effect_result.>"), "effect_result"));
    }
}
