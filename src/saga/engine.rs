//! The engine's two entry points: [`route`] (which instances an input concerns) and
//! [`apply`] (one input's effect on one instance).
//!
//! Guarantee: both are pure and deterministic. They read only the catalog, the stored
//! instance and the input (time is the input's `timestamp_ms`, within the input's
//! [`TimeBound`](super::types::TimeBound) when it has one), and return either the new
//! instance with its work and timer changes, or a typed [`StepError`] and nothing else: the
//! caller commits the result, or acts on the error, as one unit. [`apply`] checks what every
//! saga style shares (version, key, tenant, finished instance, stale timer, initial data) and
//! hands the transition to the style's own file: `machine.rs` or `orchestrate.rs`.

use std::collections::BTreeMap;

use serde_json::{Value as Json, json};

use super::emitter::{Emitter, Ev, saga_json, valid_token};
use super::types::{
    Applied, Input, InputKind, Instance, Parsed, Route, Status, StepError, WorkKind, str_field,
};
use super::{machine, orchestrate};
use crate::manifest::Catalog;
use crate::manifest::catalog::{SagaKind, Trigger, subject_matches};

/// Which saga instances an input concerns. A timer input names its instance; any other
/// input is matched against every loaded version's triggers (newest first) and the first
/// matching trigger's correlation expression gives the instance key.
///
/// A saga whose only matching trigger is one Runner added for its steps' results
/// ([`Trigger::reply`]) is skipped when the input has no `metadata.correlation_id`: such an
/// input answers no command, so it concerns no instance of that saga, and the other sagas
/// still get it. When no saga takes it at all, the result is
/// [`StepError::UncorrelatedReply`] (dead-lettered without parking a key), not poison.
pub fn route(catalog: &Catalog, input: &Input) -> Result<Vec<Route>, StepError> {
    let input = &*input.bounded();
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
    let uncorrelated = input
        .body
        .pointer("/metadata/correlation_id")
        .is_none_or(Json::is_null);
    let mut skipped: Option<&str> = None;
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
        if trigger.reply && uncorrelated {
            skipped.get_or_insert(name);
            continue;
        }
        let sj = saga_json(name, p.tenant, "", saga.version, "");
        let vars = event.vars(&state, &sj, trigger.correlation.needs());
        let corr = trigger
            .correlation
            .eval_string(&vars)
            .map_err(|e| StepError::poison(format!("correlation of saga `{name}`: {e}")))?;
        if !valid_token(&corr) {
            // Shown escaped and cut: it came from the input.
            let mut shown: String = corr.chars().take(80).collect();
            if shown.len() < corr.len() {
                shown.push('…');
            }
            return Err(StepError::poison(format!(
                "correlation id `{}` of saga `{name}` is not a valid subject token (no \
                 whitespace, control character, `.`, `*` or `>`)",
                shown.escape_debug()
            )));
        }
        out.push(Route {
            saga: name.to_owned(),
            correlation_id: corr,
        });
    }
    match skipped {
        Some(saga) if out.is_empty() => Err(StepError::UncorrelatedReply {
            saga: saga.to_owned(),
            event: p.name.to_string(),
        }),
        _ => Ok(out),
    }
}

/// The one rule for effect results, for every saga style: a result is accepted only when it
/// answers a command this instance issued and is still waiting for, of the same effect; the
/// command is then answered (a second result for it is refused the same way). Instances
/// stored before commands were recorded (`awaiting` is `None`) accept any result.
fn answer_command(inst: &mut Instance, p: &Parsed) -> Result<(), StepError> {
    let Some(awaiting) = &mut inst.awaiting else {
        return Ok(());
    };
    let command_id = p.command_id.unwrap_or_default();
    let effect = p.name.rsplit_once('.').map_or("", |(e, _)| e);
    match awaiting.get(command_id) {
        Some(issued) if issued == effect => {
            awaiting.remove(command_id);
            Ok(())
        }
        _ => Err(StepError::UnansweredCommand {
            command_id: command_id.to_owned(),
        }),
    }
}

fn trigger_matches(t: &Trigger, subject: &str, name: &str) -> bool {
    subject_matches(&t.pattern, subject) && t.event_type.as_deref().is_none_or(|e| e == name)
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
    let input = &*input.bounded();
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
                tenant: p.tenant.to_owned(),
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
                awaiting: Some(BTreeMap::new()),
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
    if p.kind == InputKind::EffectResult {
        answer_command(&mut inst, &p)?;
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
        let sj = saga_json(saga, p.tenant, correlation_id, def.version, "");
        let empty = json!({});
        let vars = event.vars(&empty, &sj, &def.needs);
        inst.data = initial_data(t, &vars)?;
    }
    match &def.kind {
        SagaKind::Machine(m) => {
            if started {
                inst.state = m.initial.clone();
            }
            machine::step(m, &mut inst, &event, &p, &mut em, &def.needs)?;
        }
        SagaKind::Steps(o) => orchestrate::step(o, &mut inst, &event, &p, &mut em, started)?,
    }
    if let Some(awaiting) = &mut inst.awaiting {
        for w in em.work.iter().filter(|w| w.kind == WorkKind::EffectCommand) {
            // `effect.<name>.<command id>`: names and ids are single tokens.
            let effect = w.subject.split('.').nth(1).unwrap_or_default();
            awaiting.insert(w.msg_id.clone(), effect.to_owned());
        }
    }
    let finished = em.terminal_event(&inst);
    if inst.status.is_final() {
        em.cancel_all_timers(&mut inst);
        // Results for a finished instance are ignored whatever they answer.
        if let Some(awaiting) = &mut inst.awaiting {
            awaiting.clear();
        }
    }
    inst.updated_ms = p.timestamp_ms;
    inst.applied += 1;
    Ok(Applied {
        instance: inst,
        started,
        event: p.name.to_string(),
        work: em.work,
        finished,
        timers_set: em.timers_set,
        timers_cancelled: em.timers_cancelled,
    })
}

/// A new instance's data: each field rendered on its own. A field that reads something the
/// starting input lacks is `null`, so the input reaches the guards, which see the input and
/// decide (the loan saga rejects a request without an amount); any other failure of a field
/// poisons the input, naming the field.
fn initial_data(
    t: &crate::expr::Template,
    vars: &crate::expr::Vars<'_>,
) -> Result<Json, StepError> {
    use crate::expr::{ExprError, Template};
    let field = |name: &str, t: &Template| match t.render(vars) {
        Ok(v) => Ok(v),
        Err(ExprError::Missing(_)) => Ok(Json::Null),
        Err(e) => Err(StepError::poison(format!("initial data `{name}`: {e}"))),
    };
    match t {
        Template::Object(fields) => fields
            .iter()
            .map(|(k, t)| field(k, t).map(|v| (k.clone(), v)))
            .collect::<Result<serde_json::Map<_, _>, _>>()
            .map(Json::Object),
        other => field("data", other),
    }
}
