//! The state-machine compiler: `initial_state` and `states` into a runnable [`Machine`].
//!
//! Guarantee: a machine the engine receives is closed. Its initial state and every `goto`
//! name a declared state, every timer it sets is handled by some state, every guard, update
//! and timer time compiled; and each transition knows which parts of the variables it reads.
//! What is legal but probably unintended (an unreachable state, an event no trigger
//! delivers, a timer cancelled but never set, no terminal state) is a warning.

use std::collections::{BTreeMap, BTreeSet};

use serde_saphyr::Location;

use super::diags::at;
use super::parts::SagaCompiler;
use crate::expr::Needs;
use crate::manifest::catalog::{Machine, State, TimerSpec, TimerWhen, Transition, Trigger};
use crate::manifest::model::{EmitDecl, Outcome, SagaDecl, Sp};

impl SagaCompiler<'_, '_> {
    pub(super) fn machine(&mut self, s: &SagaDecl, triggers: &[Trigger]) -> Option<Machine> {
        let mut ok = true;
        let mut states = BTreeMap::new();
        let mut state_at = BTreeMap::new();
        for (name, _) in &s.states.0 {
            if state_at.insert(name.value.clone(), at(name)).is_some() {
                self.d.error(
                    at(name),
                    format!("state `{}` is declared twice", name.value),
                );
                ok = false;
            }
        }
        let initial = match &s.initial_state {
            Some(i) if state_at.contains_key(&i.value) => i.value.clone(),
            Some(i) => {
                self.d
                    .error(at(i), format!("unknown initial state `{}`", i.value));
                return None;
            }
            None => {
                self.d
                    .error(at(&s.name), "a state-machine saga needs `initial_state`");
                return None;
            }
        };
        // Timers: which are set, which are handled, for the cross-check below.
        let mut timers_set: Vec<(String, Location)> = Vec::new();
        let mut timers_cancelled: Vec<(String, Location)> = Vec::new();
        let mut handled: BTreeSet<String> = BTreeSet::new();
        let mut edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, decl) in &s.states.0 {
            let mut state = State {
                terminal: decl
                    .terminal
                    .then(|| decl.outcome.unwrap_or(Outcome::Completed)),
                ..State::default()
            };
            if decl.outcome.is_some() && !decl.terminal {
                self.d.warn(
                    at(name),
                    format!("state `{}` has an outcome but is not terminal", name.value),
                );
            }
            if decl.terminal && !decl.on.0.is_empty() {
                self.d.warn(
                    at(name),
                    format!(
                        "terminal state `{}` has transitions; they are never taken",
                        name.value
                    ),
                );
            }
            if !decl.terminal && decl.on.0.is_empty() {
                self.d.warn(
                    at(name),
                    format!(
                        "state `{}` is not terminal and has no transitions",
                        name.value
                    ),
                );
            }
            for (event, list) in &decl.on.0 {
                handled.insert(event.value.clone());
                if !deliverable(triggers, &event.value, self.effects) {
                    self.d.warn(
                        at(event),
                        format!("no trigger of this saga delivers `{}`", event.value),
                    );
                }
                if state.on.contains_key(&event.value) {
                    self.d.error(
                        at(event),
                        format!(
                            "event `{}` is listed twice in state `{}`",
                            event.value, name.value
                        ),
                    );
                    ok = false;
                    continue;
                }
                let mut compiled = Vec::new();
                for t in &list.0 {
                    let mut tr = Transition::default();
                    if let Some(w) = &t.when {
                        match self.expr(w, "guard") {
                            Some(e) => tr.when = Some(e),
                            None => ok = false,
                        }
                    }
                    for (key, node) in &t.set.0 {
                        let node = Sp {
                            value: node.clone(),
                            referenced: at(key),
                            defined: at(key),
                        };
                        match self.template(&node, "state update") {
                            Some(tpl) => tr.set.push((key.value.clone(), tpl)),
                            None => ok = false,
                        }
                    }
                    for e in &t.emit {
                        let emitted = match e {
                            EmitDecl::Effect(c) => self.effect_call(c),
                            EmitDecl::Command(c) => self.command_call(c),
                            EmitDecl::Event(c) => self.event_call(c),
                        };
                        match emitted {
                            Some(x) => tr.emit.push(x),
                            None => ok = false,
                        }
                    }
                    for timer in &t.timers {
                        timers_set.push((timer.name.value.clone(), at(&timer.name)));
                        let when = match (&timer.delay_ms, &timer.at) {
                            (Some(ms), None) => Some(TimerWhen::Delay(*ms)),
                            (None, Some(e)) => self.expr(e, "timer time").map(TimerWhen::At),
                            _ => {
                                self.d.error(
                                    at(&timer.name),
                                    format!(
                                        "timer `{}` needs exactly one of `delay_ms` and `at`",
                                        timer.name.value
                                    ),
                                );
                                None
                            }
                        };
                        match when {
                            Some(when) => tr.timers.push(TimerSpec {
                                name: timer.name.value.clone(),
                                when,
                            }),
                            None => ok = false,
                        }
                    }
                    for c in &t.cancel_timers {
                        timers_cancelled.push((c.value.clone(), at(c)));
                        tr.cancel_timers.push(c.value.clone());
                    }
                    if let Some(g) = &t.goto {
                        if !state_at.contains_key(&g.value) {
                            self.d.error(at(g), format!("unknown state `{}`", g.value));
                            ok = false;
                        }
                        edges
                            .entry(name.value.clone())
                            .or_default()
                            .push(g.value.clone());
                        tr.goto = Some(g.value.clone());
                    }
                    compiled.push(tr);
                }
                let mut on_needs = Needs::default();
                for tr in &mut compiled {
                    tr.needs = tr.compute_needs();
                    on_needs.merge(&tr.needs);
                }
                state.on_needs.insert(event.value.clone(), on_needs);
                state.on.insert(event.value.clone(), compiled);
            }
            states.insert(name.value.clone(), state);
        }
        for (timer, loc) in &timers_set {
            if !handled.contains(&format!("timer.{timer}")) {
                self.d.error(
                    *loc,
                    format!("timer `{timer}` is set but no state handles `timer.{timer}`"),
                );
                ok = false;
            }
        }
        let set_names: BTreeSet<&str> = timers_set.iter().map(|(n, _)| n.as_str()).collect();
        for (timer, loc) in &timers_cancelled {
            if !set_names.contains(timer.as_str()) {
                self.d
                    .warn(*loc, format!("timer `{timer}` is cancelled but never set"));
            }
        }
        for (_, decl) in &s.states.0 {
            for (event, _) in &decl.on.0 {
                if let Some(t) = event.value.strip_prefix("timer.")
                    && !set_names.contains(t)
                {
                    self.d.warn(
                        at(event),
                        format!("`{}` is handled but timer `{t}` is never set", event.value),
                    );
                }
            }
        }
        // Reachability from the initial state.
        let mut seen = BTreeSet::from([initial.clone()]);
        let mut todo = vec![initial.clone()];
        while let Some(st) = todo.pop() {
            for next in edges.get(&st).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        for (name, _) in &s.states.0 {
            if !seen.contains(&name.value) {
                self.d.warn(
                    at(name),
                    format!("state `{}` is unreachable from `{initial}`", name.value),
                );
            }
        }
        if !states.values().any(|s| s.terminal.is_some()) {
            self.d.warn(
                at(&s.name),
                format!("saga `{}` has no terminal state", s.name.value),
            );
        }
        ok.then_some(Machine { initial, states })
    }
}

/// Whether some trigger can deliver an input whose event name is `name`: timers always
/// arrive; `<effect>.<result>` needs a trigger on that effect's results; anything else a
/// trigger on aggregate or workflow events of that type (or of any type).
fn deliverable(triggers: &[Trigger], name: &str, effects: &BTreeSet<&str>) -> bool {
    if name.starts_with("timer.") {
        return true;
    }
    let ok = |subject: &str| {
        triggers.iter().any(|t| {
            t.matches_subject(subject) && t.event_type.as_deref().is_none_or(|e| e == name)
        })
    };
    if let Some((effect, _)) = name.split_once('.')
        && effects.contains(effect)
    {
        return ok(&format!("effect_result.{effect}.x"));
    }
    triggers.iter().any(|t| {
        let first = t.pattern.first().map(String::as_str);
        matches!(first, Some("aggregate" | "workflow_event" | "*" | ">"))
            && t.event_type.as_deref().is_none_or(|e| e == name)
    })
}
