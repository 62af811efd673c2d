//! The state-machine compiler: `initial_state` and `states` into a runnable [`Machine`].
//!
//! Guarantee: a machine the engine receives is closed. Its initial state and every `goto`
//! name a declared state, every timer it sets is handled by some state, every guard, update
//! and timer time compiled; and each transition knows which parts of the variables it reads.
//! What is legal but probably unintended (an unreachable state, an event no trigger
//! delivers, a timer cancelled but never set, no terminal state) is a warning.

use crate::expr::Yields;
use std::collections::{BTreeMap, BTreeSet};

use serde_saphyr::Location;

use super::diags::at;
use super::parts::SagaCompiler;
use crate::expr::Needs;
use crate::manifest::catalog::{Machine, State, TimerSpec, TimerWhen, Transition, Trigger};
use crate::manifest::model::{
    EmitDecl, Outcome, SagaDecl, Sp, StateDecl, TimerDecl, TransitionDecl,
};

/// What compiling the states gathers as it goes, for the checks made across the whole
/// machine once every state is compiled.
#[derive(Default)]
struct Gathered {
    /// Every timer some transition sets, with where.
    timers_set: Vec<(String, Location)>,
    /// Every timer some transition cancels, with where.
    timers_cancelled: Vec<(String, Location)>,
    /// Every event name some state handles.
    handled: BTreeSet<String>,
    /// The `goto` edges: from a state to the states its transitions lead to.
    edges: BTreeMap<String, Vec<String>>,
}

impl SagaCompiler<'_, '_> {
    /// Compiles a state-machine saga: its state names and initial state, each state with
    /// its transitions, then the checks across the machine (timers set and handled,
    /// reachability, some terminal state). `None` when any of it is an error.
    pub(super) fn machine(&mut self, s: &SagaDecl, triggers: &[Trigger]) -> Option<Machine> {
        let (state_at, mut ok) = self.state_names(s);
        let initial = self.initial_state(s, &state_at)?;
        let mut gathered = Gathered::default();
        let mut states = BTreeMap::new();
        for (name, decl) in &s.states.0 {
            let state = self.state(name, decl, triggers, &state_at, &mut gathered, &mut ok);
            states.insert(name.value.clone(), state);
        }
        if !self.check_timers(s, &gathered) {
            ok = false;
        }
        self.check_reachable(s, &initial, &gathered.edges);
        if !states.values().any(|s| s.terminal.is_some()) {
            self.d.warn(
                at(&s.name),
                format!("saga `{}` has no terminal state", s.name.value),
            );
        }
        ok.then_some(Machine { initial, states })
    }

    /// Where each state is declared, by name; a name declared twice is an error (the
    /// `bool` is false then).
    fn state_names(&mut self, s: &SagaDecl) -> (BTreeMap<String, Location>, bool) {
        let mut ok = true;
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
        (state_at, ok)
    }

    /// The initial state, which must be given and declared.
    fn initial_state(
        &mut self,
        s: &SagaDecl,
        state_at: &BTreeMap<String, Location>,
    ) -> Option<String> {
        match &s.initial_state {
            Some(i) if state_at.contains_key(&i.value) => Some(i.value.clone()),
            Some(i) => {
                self.d
                    .error(at(i), format!("unknown initial state `{}`", i.value));
                None
            }
            None => {
                self.d
                    .error(at(&s.name), "a state-machine saga needs `initial_state`");
                None
            }
        }
    }

    /// One state: its terminal outcome, and per event the transitions in order with what
    /// parts of the variables they read. An event listed twice is an error (`ok` is
    /// cleared), one no trigger delivers a warning.
    fn state(
        &mut self,
        name: &Sp<String>,
        decl: &StateDecl,
        triggers: &[Trigger],
        state_at: &BTreeMap<String, Location>,
        gathered: &mut Gathered,
        ok: &mut bool,
    ) -> State {
        let mut state = State {
            terminal: decl
                .terminal
                .then(|| decl.outcome.unwrap_or(Outcome::Completed)),
            ..State::default()
        };
        self.state_shape_warnings(name, decl);
        for (event, list) in &decl.on.0 {
            gathered.handled.insert(event.value.clone());
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
                *ok = false;
                continue;
            }
            let mut compiled = Vec::new();
            for t in &list.0 {
                compiled.push(self.transition(name, t, state_at, gathered, ok));
            }
            let mut on_needs = Needs::default();
            for tr in &mut compiled {
                tr.needs = tr.compute_needs();
                on_needs.merge(&tr.needs);
            }
            state.on_needs.insert(event.value.clone(), on_needs);
            state.on.insert(event.value.clone(), compiled);
        }
        state
    }

    /// Warnings about a state's shape: an outcome on a state that is not terminal,
    /// transitions out of a terminal state, a state neither terminal nor left.
    fn state_shape_warnings(&mut self, name: &Sp<String>, decl: &StateDecl) {
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
    }

    /// One transition out of state `from`: its guard, updates, emits, timers set and
    /// cancelled, and `goto` (which must name a declared state). What fails to compile
    /// clears `ok`; timers and edges are noted in `gathered`.
    fn transition(
        &mut self,
        from: &Sp<String>,
        t: &TransitionDecl,
        state_at: &BTreeMap<String, Location>,
        gathered: &mut Gathered,
        ok: &mut bool,
    ) -> Transition {
        let mut tr = Transition::default();
        if let Some(w) = &t.when {
            match self.expr(w, "guard") {
                Some(e) => {
                    match e.yields() {
                        Yields::Bool => {}
                        Yields::NotBool(what) => {
                            self.d.error(
                                at(w),
                                format!(
                                    "guard `{}` gives {what}, never true or false: a guard is a \
                                     condition (compare the value, e.g. `… == …`, `… > 0`, `has(…)`)",
                                    w.value
                                ),
                            );
                            *ok = false;
                        }
                        Yields::Unknown => self.d.warn(
                            at(w),
                            format!(
                                "guard `{}` is true or false only if the data makes it so: \
                                 an input for which it is anything else is dead-lettered \
                                 (`expression`); say what you mean with a comparison, e.g. \
                                 `{} == true`",
                                w.value, w.value
                            ),
                        ),
                    }
                    tr.when = Some(e);
                }
                None => *ok = false,
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
                None => *ok = false,
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
                None => *ok = false,
            }
        }
        for timer in &t.timers {
            gathered
                .timers_set
                .push((timer.name.value.clone(), at(&timer.name)));
            match self.timer(timer) {
                Some(spec) => tr.timers.push(spec),
                None => *ok = false,
            }
        }
        for c in &t.cancel_timers {
            gathered.timers_cancelled.push((c.value.clone(), at(c)));
            tr.cancel_timers.push(c.value.clone());
        }
        if let Some(g) = &t.goto {
            if !state_at.contains_key(&g.value) {
                self.d.error(at(g), format!("unknown state `{}`", g.value));
                *ok = false;
            }
            gathered
                .edges
                .entry(from.value.clone())
                .or_default()
                .push(g.value.clone());
            tr.goto = Some(g.value.clone());
        }
        tr
    }

    /// A timer a transition sets: exactly one of a delay and a time (compiled).
    fn timer(&mut self, timer: &TimerDecl) -> Option<TimerSpec> {
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
        when.map(|when| TimerSpec {
            name: timer.name.value.clone(),
            when,
        })
    }

    /// Timers across the machine: one set but handled by no state is an error (answers
    /// false); one cancelled but never set, or handled but never set, a warning.
    fn check_timers(&mut self, s: &SagaDecl, gathered: &Gathered) -> bool {
        let mut ok = true;
        for (timer, loc) in &gathered.timers_set {
            if !gathered.handled.contains(&format!("timer.{timer}")) {
                self.d.error(
                    *loc,
                    format!("timer `{timer}` is set but no state handles `timer.{timer}`"),
                );
                ok = false;
            }
        }
        let set_names: BTreeSet<&str> = gathered
            .timers_set
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        for (timer, loc) in &gathered.timers_cancelled {
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
        ok
    }

    /// Reachability from the initial state along the `goto` edges: a state never reached
    /// is a warning.
    fn check_reachable(
        &mut self,
        s: &SagaDecl,
        initial: &str,
        edges: &BTreeMap<String, Vec<String>>,
    ) {
        let mut seen = BTreeSet::from([initial.to_string()]);
        let mut todo = vec![initial.to_string()];
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
