//! From parsed manifest files to a [`Catalog`]: every check `runner validate` makes.
//!
//! The compiler never stops at the first problem: it records a [`Diagnostic`] (file, line,
//! column, reason) and carries on, so one run shows everything that is wrong. The catalog
//! it builds is only handed out when no diagnostic is an error.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_saphyr::Location;

use super::catalog::{
    Compensation, Effect, Emit, Machine, Migration, Orchestration, Saga, SagaKind, State, Step,
    TimerSpec, TimerWhen, Transition, Trigger,
};
use super::model::{
    CommandCall, EffectCall, EmitDecl, EventCall, ManifestFile, RetryPolicy, SagaDecl, Sp,
    StepDecl, TemplateNode,
};
use super::{Catalog, Diagnostic, FORMAT_VERSION, Severity};
use crate::expr::{Expr, ExprError, Needs, Template};

/// Providers the effect worker knows.
pub const PROVIDERS: [&str; 7] = [
    "noop",
    "log",
    "http",
    "nats_request",
    "nats_publish",
    "smtp",
    "postgres",
];

/// Default result timeout of command steps and compensations, in milliseconds.
pub const DEFAULT_STEP_TIMEOUT_MS: u64 = 30_000;

/// Collects diagnostics for one file.
pub(crate) struct Diags<'a> {
    file: &'a Path,
    out: &'a mut Vec<Diagnostic>,
}

impl Diags<'_> {
    fn push(&mut self, severity: Severity, at: Location, message: String) {
        self.out.push(Diagnostic {
            file: self.file.to_path_buf(),
            line: at.line(),
            column: at.column(),
            severity,
            message,
        });
    }
    fn error(&mut self, at: Location, message: impl Into<String>) {
        self.push(Severity::Error, at, message.into());
    }
    fn warn(&mut self, at: Location, message: impl Into<String>) {
        self.push(Severity::Warning, at, message.into());
    }
}

fn at<T>(s: &Sp<T>) -> Location {
    s.referenced
}

/// Parses one file's text; a YAML or shape error becomes a diagnostic with its location.
pub(crate) fn parse(file: &Path, text: &str, out: &mut Vec<Diagnostic>) -> Option<ManifestFile> {
    match serde_saphyr::from_str::<ManifestFile>(text) {
        Ok(m) => Some(m),
        Err(e) => {
            let (line, column) = e
                .location()
                .map(|l| (l.line(), l.column()))
                .unwrap_or((0, 0));
            let message = super::yaml_message(&e);
            out.push(Diagnostic {
                file: file.to_path_buf(),
                line,
                column,
                severity: Severity::Error,
                message: format!("invalid manifest: {message}"),
            });
            None
        }
    }
}

/// Compiles parsed files into a catalog, appending every problem to `out`.
pub(crate) fn compile(files: Vec<(PathBuf, ManifestFile)>, out: &mut Vec<Diagnostic>) -> Catalog {
    let mut catalog = Catalog {
        files: files.iter().map(|(p, _)| p.clone()).collect(),
        ..Catalog::default()
    };
    // Effects first: sagas in any file may use effects from any file.
    for (path, file) in &files {
        let mut d = Diags { file: path, out };
        if file.format.value != FORMAT_VERSION {
            d.error(
                at(&file.format),
                format!(
                    "format {} is not supported (this build reads format {FORMAT_VERSION})",
                    file.format.value
                ),
            );
        }
        for e in &file.effects {
            if catalog.effects.contains_key(&e.name.value) {
                d.error(
                    at(&e.name),
                    format!("effect `{}` is declared twice", e.name.value),
                );
                continue;
            }
            if !PROVIDERS.contains(&e.provider.value.as_str()) {
                d.error(
                    at(&e.provider),
                    format!(
                        "unknown provider `{}` (known: {})",
                        e.provider.value,
                        PROVIDERS.join(", ")
                    ),
                );
            }
            catalog.effects.insert(
                e.name.value.clone(),
                Arc::new(Effect {
                    name: e.name.value.clone(),
                    provider: e.provider.value.clone(),
                    settings: e.settings.clone(),
                    timeout_ms: e.timeout_ms,
                    retry: e.retry,
                    circuit_breaker: e.circuit_breaker,
                }),
            );
        }
    }
    let mut declared: BTreeSet<(String, u32)> = BTreeSet::new();
    for (path, file) in &files {
        let mut d = Diags { file: path, out };
        for s in &file.sagas {
            let versions = catalog.sagas.entry(s.name.value.clone()).or_default();
            if !declared.insert((s.name.value.clone(), s.version.value)) {
                d.error(
                    at(&s.name),
                    format!(
                        "saga `{}` version {} is declared twice",
                        s.name.value, s.version.value
                    ),
                );
                continue;
            }
            let effects: BTreeSet<&str> = catalog.effects.keys().map(String::as_str).collect();
            let compiled = SagaCompiler {
                d: &mut d,
                effects: &effects,
            }
            .saga(s);
            if let Some(saga) = compiled {
                versions.insert(s.version.value, Arc::new(saga));
            }
        }
    }
    catalog.sagas.retain(|_, v| !v.is_empty());
    catalog
}

struct SagaCompiler<'a, 'b> {
    d: &'a mut Diags<'b>,
    effects: &'a BTreeSet<&'a str>,
}

impl SagaCompiler<'_, '_> {
    fn expr(&mut self, src: &Sp<String>, what: &str) -> Option<Expr> {
        match Expr::compile(&src.value) {
            Ok(e) => Some(e),
            Err(err) => {
                let loc = at(src);
                let mut column = loc.column();
                // Point into the expression when the YAML scalar is on one line: plain
                // (its span is the text itself) or quoted (one more character before it).
                if let ExprError::Syntax {
                    line: 1, column: c, ..
                } = &err
                {
                    let text_len = src.value.chars().count() as u64;
                    let span_len = loc.span().len();
                    if span_len == text_len {
                        column += u64::from(*c) - 1;
                    } else if span_len == text_len + 2 {
                        column += u64::from(*c);
                    }
                }
                let message = format!("{what}: {err}");
                self.d.out.push(Diagnostic {
                    file: self.d.file.to_path_buf(),
                    line: loc.line(),
                    column,
                    severity: Severity::Error,
                    message,
                });
                None
            }
        }
    }

    fn template(&mut self, node: &Sp<TemplateNode>, what: &str) -> Option<Template> {
        let mut ok = true;
        let t = self.template_inner(node, what, &mut ok);
        ok.then_some(t)
    }

    fn template_inner(&mut self, node: &Sp<TemplateNode>, what: &str, ok: &mut bool) -> Template {
        match &node.value {
            TemplateNode::Scalar(v) => Template::Literal(v.clone()),
            TemplateNode::Str(s) => match Template::compile_str(s) {
                Ok(t) => t,
                Err(err) => {
                    self.d.error(at(node), format!("{what}: {err}"));
                    *ok = false;
                    Template::Literal(serde_json::Value::Null)
                }
            },
            TemplateNode::List(items) => {
                let items: Vec<Template> = items
                    .iter()
                    .map(|i| self.template_inner(i, what, ok))
                    .collect();
                if items.iter().all(Template::is_literal) {
                    Template::Literal(serde_json::Value::Array(
                        items.into_iter().filter_map(literal).collect(),
                    ))
                } else {
                    Template::List(items)
                }
            }
            TemplateNode::Map(fields) => {
                let fields: Vec<(String, Template)> = fields
                    .iter()
                    .map(|(k, v)| (k.clone(), self.template_inner(v, what, ok)))
                    .collect();
                if fields.iter().all(|(_, t)| t.is_literal()) {
                    Template::Literal(serde_json::Value::Object(
                        fields
                            .into_iter()
                            .filter_map(|(k, t)| literal(t).map(|v| (k, v)))
                            .collect(),
                    ))
                } else {
                    Template::Object(fields)
                }
            }
        }
    }

    fn opt_template(&mut self, node: &Option<Sp<TemplateNode>>, what: &str) -> Option<Template> {
        match node {
            Some(n) => self.template(n, what),
            None => Some(Template::Literal(serde_json::Value::Null)),
        }
    }

    fn effect_call(&mut self, e: &EffectCall) -> Option<Emit> {
        if !self.effects.contains(e.name.value.as_str()) {
            self.d
                .error(at(&e.name), format!("unknown effect `{}`", e.name.value));
        }
        let payload = self.opt_template(&e.payload, "effect payload")?;
        Some(Emit::Effect {
            name: e.name.value.clone(),
            payload,
            retry: e.retry,
        })
    }

    fn command_call(&mut self, c: &CommandCall) -> Option<Emit> {
        for (v, what) in [
            (&c.aggregate_type, "aggregate type"),
            (&c.command, "command"),
        ] {
            if v.value.is_empty() || v.value.contains(['.', '*', '>', ' ']) {
                self.d.error(
                    at(v),
                    format!("{what} `{}` is not a valid subject token", v.value),
                );
            }
        }
        let id = self.template(&c.aggregate_id, "aggregate id");
        let payload = self.opt_template(&c.payload, "command payload");
        Some(Emit::Command {
            aggregate_type: c.aggregate_type.value.clone(),
            command: c.command.value.clone(),
            aggregate_id: id?,
            payload: payload?,
        })
    }

    fn event_call(&mut self, e: &EventCall) -> Option<Emit> {
        let payload = self.opt_template(&e.payload, "event payload")?;
        Some(Emit::Event {
            event_type: e.event_type.value.clone(),
            payload,
        })
    }

    fn saga(&mut self, s: &SagaDecl) -> Option<Saga> {
        let mut ok = true;
        let name_at = at(&s.name);
        if s.name.value.is_empty() || s.name.value.contains(['.', '*', '>', ' ']) {
            self.d.error(
                name_at,
                format!("saga name `{}` is not a valid subject token", s.name.value),
            );
            ok = false;
        }
        let mut triggers = Vec::new();
        for t in &s.triggers {
            let pattern: Vec<String> = t.subject.value.split('.').map(str::to_owned).collect();
            let bad = pattern.iter().enumerate().any(|(i, tok)| {
                tok.is_empty() || (tok == ">" && i + 1 != pattern.len()) || tok.contains(' ')
            });
            if bad {
                self.d.error(
                    at(&t.subject),
                    format!("invalid subject pattern `{}`", t.subject.value),
                );
                ok = false;
            }
            let Some(corr) = &t.correlation else {
                self.d.error(
                    at(&t.subject),
                    format!(
                        "trigger `{}` has no correlation expression",
                        t.subject.value
                    ),
                );
                ok = false;
                continue;
            };
            match self.expr(corr, "correlation") {
                Some(correlation) => triggers.push(Trigger {
                    pattern,
                    event_type: t.event_type.clone(),
                    correlation,
                    start: t.start,
                }),
                None => ok = false,
            }
        }
        if !s.triggers.iter().any(|t| t.start) {
            self.d.error(
                name_at,
                format!("saga `{}` has no trigger with `start: true`", s.name.value),
            );
            ok = false;
        }
        let data = match &s.data {
            Some(n) => {
                let t = self.template(n, "initial data");
                ok &= t.is_some();
                t
            }
            None => None,
        };
        let is_machine = s.initial_state.is_some() || !s.states.0.is_empty();
        let kind = match (is_machine, s.steps.is_empty()) {
            (true, false) => {
                self.d
                    .error(name_at, "a saga has either `states` or `steps`, not both");
                None
            }
            (false, true) => {
                self.d.error(
                    name_at,
                    "a saga needs `initial_state` and `states`, or `steps`",
                );
                None
            }
            (true, true) => self.machine(s, &triggers).map(SagaKind::Machine),
            (false, false) => self.orchestration(s, &mut triggers).map(SagaKind::Steps),
        };
        let migration = s.migration.as_ref().and_then(|m| {
            if m.from.value.checked_add(1) != Some(s.version.value) {
                self.d.error(
                    at(&m.from),
                    format!(
                        "a migration goes from version {} to {}: `from` must be {}",
                        s.version.value.saturating_sub(1),
                        s.version.value,
                        s.version.value.saturating_sub(1)
                    ),
                );
                return None;
            }
            let data = match &m.data {
                Some(e) => Some(self.expr(e, "migration data")?),
                None => None,
            };
            if let SagaKind::Machine(machine) = kind.as_ref()? {
                for to in m.states.values() {
                    if !machine.states.contains_key(to) {
                        self.d.error(
                            at(&m.from),
                            format!("migration maps to unknown state `{to}`"),
                        );
                        return None;
                    }
                }
            }
            Some(Migration {
                from: m.from.value,
                data,
                states: m.states.clone(),
            })
        });
        if s.migration.is_some() && migration.is_none() {
            ok = false;
        }
        let kind = kind?;
        let mut needs = Needs::default();
        triggers
            .iter()
            .for_each(|t| needs.merge(t.correlation.needs()));
        if let Some(d) = &data {
            d.add_needs(&mut needs);
        }
        kind.add_needs(&mut needs);
        if let Some(e) = migration.as_ref().and_then(|m| m.data.as_ref()) {
            needs.merge(e.needs());
        }
        ok.then(|| Saga {
            name: s.name.value.clone(),
            version: s.version.value,
            triggers,
            data,
            kind,
            migration,
            needs,
        })
    }

    fn machine(&mut self, s: &SagaDecl, triggers: &[Trigger]) -> Option<Machine> {
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
                    .then(|| decl.outcome.unwrap_or(super::model::Outcome::Completed)),
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

    fn orchestration(
        &mut self,
        s: &SagaDecl,
        triggers: &mut Vec<Trigger>,
    ) -> Option<Orchestration> {
        let mut ok = true;
        let mut steps = Vec::new();
        let mut names = BTreeSet::new();
        for st in &s.steps {
            if !names.insert(st.name.value.clone()) {
                self.d.error(
                    at(&st.name),
                    format!("step `{}` is declared twice", st.name.value),
                );
                ok = false;
            }
            match self.step(st) {
                Some(step) => steps.push(step),
                None => ok = false,
            }
        }
        if !ok {
            return None;
        }
        // Stages: consecutive steps of one group run together.
        let mut stages: Vec<Vec<usize>> = Vec::new();
        let mut groups_seen = BTreeSet::new();
        let mut last_group: Option<&str> = None;
        for (i, st) in s.steps.iter().enumerate() {
            match (&st.group, last_group) {
                (Some(g), Some(l)) if g == l => {
                    if let Some(stage) = stages.last_mut() {
                        stage.push(i);
                    }
                }
                (Some(g), _) => {
                    if !groups_seen.insert(g.clone()) {
                        self.d.error(
                            at(&st.name),
                            format!("steps of group `{g}` must be consecutive"),
                        );
                        ok = false;
                    }
                    stages.push(vec![i]);
                }
                (None, _) => stages.push(vec![i]),
            }
            last_group = st.group.as_deref();
        }
        // Result events of effects arrive with the correlation id the saga put in the
        // command's metadata: add those triggers so an orchestration only declares its start.
        let mut wanted: BTreeSet<(String, Option<String>)> = BTreeSet::new();
        for step in &steps {
            let comp = step
                .compensation
                .as_ref()
                .map(|c| (&c.action, &c.success, &c.failure));
            for (action, succ, fail, abort) in
                std::iter::once((&step.action, &step.success, &step.failure, &step.abort))
                    .chain(comp.map(|(a, s, f)| (a, s, f, f)))
            {
                match action {
                    Emit::Effect { name, .. } => {
                        wanted.insert((format!("effect_result.{name}.*"), None));
                    }
                    Emit::Command { aggregate_type, .. } => {
                        for ev in succ.iter().chain(fail).chain(abort) {
                            wanted.insert((
                                format!("aggregate.{aggregate_type}.*"),
                                Some(ev.clone()),
                            ));
                        }
                    }
                    Emit::Event { .. } => {}
                }
            }
        }
        for (subject, event_type) in wanted {
            let pattern: Vec<String> = subject.split('.').map(str::to_owned).collect();
            let exists = triggers
                .iter()
                .any(|t| t.pattern == pattern && t.event_type == event_type);
            if !exists {
                let correlation = Expr::compile("event.metadata.correlation_id")
                    .map_err(|e: ExprError| self.d.error(at(&s.name), e.to_string()))
                    .ok()?;
                triggers.push(Trigger {
                    pattern,
                    event_type,
                    correlation,
                    start: false,
                });
            }
        }
        ok.then_some(Orchestration { steps, stages })
    }

    fn step(&mut self, st: &StepDecl) -> Option<Step> {
        let action = with_retry(
            self.action(&st.effect, &st.command, at(&st.name), &st.name.value)?,
            st.retry,
        );
        let (success, failure) =
            self.result_names(&action, &st.success, &st.failure, at(&st.name))?;
        let compensation = match &st.compensation {
            Some(c) => {
                let a = with_retry(
                    self.action(
                        &c.effect,
                        &c.command,
                        at(&st.name),
                        &format!("{} compensation", st.name.value),
                    )?,
                    c.retry,
                );
                let (s, f) = self.result_names(&a, &c.success, &c.failure, at(&st.name))?;
                Some(Compensation {
                    action: a,
                    success: s,
                    failure: f,
                    retry: c.retry,
                    timeout_ms: c.timeout_ms.unwrap_or(DEFAULT_STEP_TIMEOUT_MS),
                })
            }
            None => None,
        };
        Some(Step {
            name: st.name.value.clone(),
            action,
            success,
            failure,
            abort: st.abort.iter().map(|a| a.value.clone()).collect(),
            retry: st.retry,
            timeout_ms: st.timeout_ms.unwrap_or(DEFAULT_STEP_TIMEOUT_MS),
            compensation,
        })
    }

    fn action(
        &mut self,
        effect: &Option<EffectCall>,
        command: &Option<CommandCall>,
        loc: Location,
        what: &str,
    ) -> Option<Emit> {
        match (effect, command) {
            (Some(e), None) => self.effect_call(e),
            (None, Some(c)) => self.command_call(c),
            _ => {
                self.d.error(
                    loc,
                    format!("`{what}` needs exactly one of `effect` and `command`"),
                );
                None
            }
        }
    }

    fn result_names(
        &mut self,
        action: &Emit,
        success: &[Sp<String>],
        failure: &[Sp<String>],
        loc: Location,
    ) -> Option<(Vec<String>, Vec<String>)> {
        let s: Vec<String> = success.iter().map(|x| x.value.clone()).collect();
        let f: Vec<String> = failure.iter().map(|x| x.value.clone()).collect();
        match action {
            Emit::Effect { name, .. } => Some((
                if s.is_empty() {
                    vec![format!("{name}.Succeeded")]
                } else {
                    s
                },
                if f.is_empty() {
                    vec![format!("{name}.Failed"), format!("{name}.TimedOut")]
                } else {
                    f
                },
            )),
            _ if s.is_empty() || f.is_empty() => {
                self.d
                    .error(loc, "a command needs `success` and `failure` event types");
                None
            }
            _ => Some((s, f)),
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

/// A step's (or compensation's) retry policy is what its effect command carries, unless the
/// call itself names one: the effect worker applies it, the saga does not retry effects.
fn with_retry(action: Emit, retry: Option<RetryPolicy>) -> Emit {
    match action {
        Emit::Effect {
            name,
            payload,
            retry: None,
        } => Emit::Effect {
            name,
            payload,
            retry,
        },
        other => other,
    }
}

fn literal(t: Template) -> Option<serde_json::Value> {
    match t {
        Template::Literal(v) => Some(v),
        _ => None,
    }
}
