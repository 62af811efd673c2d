//! The emitter: what one application of an input produces, and the variables its
//! templates are rendered with.
//!
//! Guarantee: every id is derived, never drawn. The emitter numbers the work items and timers
//! of one application in emission order and derives each id from (tenant, saga, correlation
//! id, input event id, input time, index) through [`ids`], so replaying the same
//! input on the same instance emits the same messages with the same ids, which JetStream's
//! deduplication then drops. Envelopes are written as JSON text with ordered keys
//! (`body.rs`), byte for byte the same on every run.

use serde_json::Value as Json;

use super::body::ObjectWriter;
use super::ids;
use super::types::{
    ENVELOPE_VERSION, Input, Instance, Parsed, ScheduledTimer, StepError, TimerCancel, TimerSet,
    WorkItem, WorkKind,
};
use crate::expr::{ExprError, Needs, Vars};
use crate::manifest::Catalog;
use crate::manifest::catalog::{Emit, Saga};
use crate::manifest::model::RetryPolicy;

/// A token of a subject Runner builds (a correlation id): the one subject check
/// ([`crate::subject::check`]) without its length bound — a correlation id longer than
/// [`crate::subject::MAX_ID_BYTES`] is refused as `too_large` when the instance key is
/// checked (`worker::admission::check_key`), before anything is published with it.
pub(super) fn valid_token(s: &str) -> bool {
    let rule = crate::subject::Rule {
        max_bytes: usize::MAX,
        ..crate::subject::Rule::ID
    };
    crate::subject::check(s, rule).is_ok()
}

/// The `event` variable: the input's envelope plus its `subject` and event `name`,
/// borrowed rather than copied.
pub(crate) struct Ev<'a> {
    pub(crate) body: &'a Json,
    fields: [(&'static str, &'a str); 2],
}

impl<'a> Ev<'a> {
    pub(super) fn new(input: &'a Input, name: &'a str) -> Self {
        Self {
            body: &input.body,
            fields: [("subject", &input.subject), ("name", name)],
        }
    }

    pub(crate) fn vars<'v>(
        &'v self,
        state: &'v Json,
        saga: &'v Json,
        needs: &'v Needs,
    ) -> Vars<'v> {
        Vars::pruned(self.body, &self.fields, state, saga, needs)
    }
}

pub(super) fn saga_json(
    saga: &str,
    tenant: &str,
    correlation_id: &str,
    version: u32,
    state: &str,
) -> Json {
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

/// Accumulates what one application emits, numbering ids in emission order.
pub(crate) struct Emitter<'a> {
    pub(crate) catalog: &'a Catalog,
    pub(crate) p: &'a Parsed<'a>,
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
            tenant: self.p.tenant,
            saga: &self.saga.name,
            correlation_id: self.correlation_id,
            input_event_id: self.p.event_id,
            timestamp_ms: self.p.timestamp_ms,
        };
        let id = ids::derive(&seed, self.index);
        self.index += 1;
        id.to_string()
    }

    /// Writes the `metadata` object every output carries.
    fn metadata(&self, w: &mut ObjectWriter, retry: Option<&RetryPolicy>) {
        w.open("metadata");
        w.str("causation_id", self.p.event_id);
        w.str("correlation_id", self.correlation_id);
        if let Some(r) = retry {
            w.open("retry");
            match r.base_backoff {
                Some(b) => w.uint("base_backoff", b),
                None => w.null("base_backoff"),
            }
            w.bool("enable_jitter", r.enable_jitter);
            w.uint("max_backoff", r.max_backoff);
            w.uint("retry_limit", u64::from(r.retry_limit));
            w.close();
        }
        w.str("saga", &self.saga.name);
        w.uint("saga_version", u64::from(self.saga.version));
        if let Some(t) = &self.p.trace_id {
            w.str("trace_id", t);
        }
        w.close();
    }

    /// Renders and records one work item; returns its id.
    pub(crate) fn emit(&mut self, e: &Emit, vars: &Vars<'_>) -> Result<String, StepError> {
        let fail = |what: &str, err: ExprError| StepError::poison(format!("{what}: {err}"));
        let id = self.next_id();
        let v = u64::from(ENVELOPE_VERSION);
        let item = match e {
            Emit::Effect {
                name,
                payload,
                retry,
            } => {
                let effect = self.catalog.effect(name);
                let retry = retry.or_else(|| effect.and_then(|e| e.retry));
                let mut w = ObjectWriter::new();
                w.str("command_id", &id);
                w.str("effect_name", name);
                self.metadata(&mut w, retry.as_ref());
                w.template("payload", payload, vars)
                    .map_err(|x| fail("effect payload", x))?;
                w.str("tenant_id", self.p.tenant);
                if let Some(t) = effect.and_then(|e| e.timeout_ms) {
                    w.uint("timeout_ms", t);
                }
                w.uint("v", v);
                WorkItem {
                    kind: WorkKind::EffectCommand,
                    subject: format!("effect.{name}.{id}"),
                    msg_id: id.clone(),
                    body: w.finish(),
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
                // It becomes a token of the command's subject.
                if let Err(e) =
                    crate::subject::check(&agg_id, crate::subject::Rule::ID.named("aggregate id"))
                {
                    let shown = if agg_id.len() <= 80 {
                        agg_id.as_str()
                    } else {
                        "…"
                    };
                    return Err(StepError::poison(format!(
                        "aggregate id `{shown}` is not a valid subject token: {e}"
                    )));
                }
                let mut w = ObjectWriter::new();
                w.str("aggregate_id", &agg_id);
                w.str("aggregate_type", aggregate_type);
                w.str("command_id", &id);
                w.str("command_type", command);
                self.metadata(&mut w, None);
                w.template("payload", payload, vars)
                    .map_err(|x| fail("command payload", x))?;
                w.str("tenant_id", self.p.tenant);
                w.uint("v", v);
                WorkItem {
                    kind: WorkKind::AggregateCommand,
                    subject: format!("command.{aggregate_type}.{agg_id}"),
                    msg_id: id.clone(),
                    body: w.finish(),
                }
            }
            Emit::Event {
                event_type,
                payload,
            } => {
                let mut w = self.workflow_event(&id, event_type);
                w.template("payload", payload, vars)
                    .map_err(|x| fail("event payload", x))?;
                self.end_workflow_event(&mut w);
                WorkItem {
                    kind: WorkKind::WorkflowEvent,
                    subject: format!("workflow_event.{}.{}", self.saga.name, self.correlation_id),
                    msg_id: id.clone(),
                    body: w.finish(),
                }
            }
        };
        self.work.push(item);
        Ok(id)
    }

    /// A workflow event's fields up to its `payload`, which the caller writes next.
    fn workflow_event(&self, id: &str, event_type: &str) -> ObjectWriter {
        let mut w = ObjectWriter::new();
        w.str("correlation_id", self.correlation_id);
        w.str("event_id", id);
        w.str("event_type", event_type);
        self.metadata(&mut w, None);
        w
    }

    /// A workflow event's fields after its `payload`.
    fn end_workflow_event(&self, w: &mut ObjectWriter) {
        w.str("saga", &self.saga.name);
        w.str("tenant_id", self.p.tenant);
        w.uint("timestamp_ms", self.p.timestamp_ms);
        w.uint("v", u64::from(ENVELOPE_VERSION));
    }

    /// The workflow event announcing that `inst` has just ended (or stopped for an
    /// operator): `SagaCompleted`, `SagaFailed`, `SagaCompensated` or `SagaNeedsOperator`
    /// on `workflow_event.<saga>.<correlation_id>`, with the final state, the status and
    /// how long the instance ran (input times, so a replay says the same). Its id comes
    /// after every other output of the input. `None` while the instance runs.
    pub(crate) fn terminal_event(&mut self, inst: &Instance) -> Option<WorkItem> {
        use super::types::Status;
        use super::types::TERMINAL_EVENTS;
        let event_type = match inst.status {
            Status::Running => return None,
            Status::Completed => TERMINAL_EVENTS[0],
            Status::Failed => TERMINAL_EVENTS[1],
            Status::Compensated => TERMINAL_EVENTS[2],
            Status::NeedsOperator => TERMINAL_EVENTS[3],
        };
        let id = self.next_id();
        let finished = self.p.timestamp_ms;
        let mut w = self.workflow_event(&id, event_type);
        w.open("payload");
        w.uint("duration_ms", finished.saturating_sub(inst.started_ms));
        w.uint("finished_ms", finished);
        w.uint("inputs_applied", inst.applied + 1);
        w.uint("saga_version", u64::from(inst.version));
        w.uint("started_ms", inst.started_ms);
        w.str("state", &inst.state);
        w.value("status", &inst.status);
        w.close();
        self.end_workflow_event(&mut w);
        Some(WorkItem {
            kind: WorkKind::WorkflowEvent,
            subject: format!("workflow_event.{}.{}", self.saga.name, self.correlation_id),
            msg_id: id,
            body: w.finish(),
        })
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
