//! From parsed manifest files to a [`Catalog`]: every check `runner validate` makes.
//!
//! The compiler never stops at the first problem: it records a [`Diagnostic`] (file, line,
//! column, reason) and carries on, so one run shows everything that is wrong. The catalog
//! it builds is only handed out when no diagnostic is an error.
//!
//! Inside: `mod.rs` drives the run (files, effects, each saga version and what every style
//! shares: name, triggers, initial data, migration); `machine.rs` and `orchestration.rs`
//! compile the two saga styles (mirroring `saga/machine.rs` and `saga/orchestrate.rs`);
//! `parts.rs` compiles expressions, templates and emit calls; `diags.rs` records problems.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::catalog::{Declared, Effect, Migration, Saga, SagaKind, Trigger};
use super::model::{ManifestFile, SagaDecl, Sp, SpannedMap, TemplateNode};
use super::{Catalog, Diagnostic, FORMAT_VERSION, Severity};
use crate::expr::Needs;

mod diags;
mod machine;
mod orchestration;
mod parts;
mod secrets;

use diags::{Diags, at};
use parts::SagaCompiler;

pub use orchestration::DEFAULT_STEP_TIMEOUT_MS;

/// Providers the effect worker knows.
pub const PROVIDERS: [&str; 8] = [
    "noop",
    "log",
    "http",
    "grpc",
    "nats_request",
    "nats_publish",
    "smtp",
    "postgres",
];

/// Where a setting is written: `path` is dotted (`request.payment.amount`, list items by
/// index); the deepest part found is the answer, so a key the file lacks points at its
/// parent.
fn setting_location(
    settings: &SpannedMap<Sp<TemplateNode>>,
    path: &str,
) -> Option<serde_saphyr::Location> {
    let mut parts = path.split('.');
    let first = parts.next()?;
    let (key, node) = settings.0.iter().find(|(k, _)| k.value == first)?;
    let mut node: &Sp<TemplateNode> = node;
    let mut here = at(key);
    for part in parts {
        let next = match &node.value {
            TemplateNode::Map(fields) => fields
                .iter()
                .find(|(k, _)| k.value == part)
                .map(|(k, v)| (at(k), v)),
            TemplateNode::List(items) => part
                .parse::<usize>()
                .ok()
                .and_then(|i| items.get(i))
                .map(|v| (at(v), v)),
            _ => None,
        };
        let Some((loc, child)) = next else { break };
        here = loc;
        node = child;
    }
    Some(here)
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
            if e.name.value.is_empty() || e.name.value.contains(['.', '*', '>', ' ']) {
                d.error(
                    at(&e.name),
                    format!(
                        "effect name `{}` is not a valid subject token",
                        e.name.value
                    ),
                );
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
                    settings: e
                        .settings
                        .0
                        .iter()
                        .map(|(k, v)| (k.value.clone(), v.value.to_json()))
                        .collect(),
                    timeout_ms: e.timeout_ms,
                    retry: e.retry,
                    circuit_breaker: e.circuit_breaker,
                    declared: Declared {
                        file: path.clone(),
                        line: at(&e.name).line(),
                        column: at(&e.name).column(),
                    },
                }),
            );
            secrets::check_references(&mut d, e);
            if let Some(check) = super::settings_check()
                && PROVIDERS.contains(&e.provider.value.as_str())
            {
                let effect = &catalog.effects[&e.name.value];
                if let Err((setting, message)) = check(effect) {
                    d.error(
                        setting_location(&e.settings, &setting).unwrap_or(at(&e.name)),
                        format!("effect `{}`: setting `{setting}`: {message}", e.name.value),
                    );
                }
            }
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

impl SagaCompiler<'_, '_> {
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
                    reply: false,
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
            starts_effects: kind.starts_effects(),
            kind,
            migration,
            needs,
        })
    }
}
