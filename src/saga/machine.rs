//! State-machine sagas: one input's transition in the instance's current state.
//!
//! The first transition listed for the event whose guard holds is taken; its state updates
//! are rendered against the data as it was before the transition, its work and timers
//! against the updated data and the new state name. Reaching a terminal state sets the
//! instance's final status.
//!
//! Guarantee: nothing is half-applied. The transition works on the engine's own copy of the
//! instance, and every failure (a state this version lacks, a guard or template that cannot
//! be evaluated) is a [`StepError`]: the caller keeps the instance as stored and ignores or
//! dead-letters the input as the variant says.

use serde_json::{Value as Json, json};

use super::emitter::{Emitter, Ev, saga_json};
use super::types::{Instance, Parsed, StepError};
use crate::expr::Needs;
use crate::manifest::catalog::{Machine, TimerWhen};

/// Applies the event to a state-machine instance: picks the transition, updates the data
/// and state, emits work and sets or cancels timers through `em`.
pub(super) fn step(
    m: &Machine,
    inst: &mut Instance,
    event: &Ev<'_>,
    p: &Parsed,
    em: &mut Emitter<'_>,
    needs: &Needs,
) -> Result<(), StepError> {
    let no_transition = || StepError::NoTransition {
        state: inst.state.clone(),
        event: p.name.to_string(),
    };
    let state = m.states.get(&inst.state).ok_or_else(|| {
        StepError::poison(format!(
            "instance is in state `{}`, which this version lacks",
            inst.state
        ))
    })?;
    let candidates = state.on.get(p.name.as_ref()).ok_or_else(no_transition)?;
    // Guards and updates read only what this event's transitions can read; the `saga`
    // variable is only built when one of them reads it.
    let on_needs = state.on_needs.get(p.name.as_ref()).unwrap_or(needs);
    let sj = saga_var(inst, on_needs);
    let chosen = {
        let vars = event.vars(&inst.data, &sj, on_needs);
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
        saga_var(inst, &t.needs)
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

/// The `saga` variable for the instance as it is now, or `null` when `needs` never reads it
/// (an expression that does not name `saga` cannot tell the difference).
fn saga_var(inst: &Instance, needs: &Needs) -> Json {
    if !needs.reads_saga() {
        return Json::Null;
    }
    saga_json(
        &inst.saga,
        &inst.tenant,
        &inst.correlation_id,
        inst.version,
        &inst.state,
    )
}
