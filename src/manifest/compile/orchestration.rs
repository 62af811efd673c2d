//! The orchestration compiler: `steps` into a runnable [`Orchestration`] (the engine's
//! `saga/orchestrate.rs` runs it).
//!
//! Guarantee: every step has exactly one action, result event names for success and failure
//! (an effect's default to `<effect>.Succeeded` / `.Failed` / `.TimedOut`) and a timeout;
//! groups are consecutive, so stages are well defined. The triggers that bring
//! the steps' results back to the instance are added here, so an orchestration only declares
//! how it starts.

use std::collections::BTreeSet;

use serde_saphyr::Location;

use super::diags::at;
use super::parts::SagaCompiler;
use crate::expr::{Expr, ExprError};
use crate::manifest::catalog::{Compensation, Emit, Orchestration, Step, Trigger};
use crate::manifest::model::{CommandCall, EffectCall, RetryPolicy, SagaDecl, Sp, StepDecl};

/// Default result timeout of command steps and compensations, in milliseconds.
pub const DEFAULT_STEP_TIMEOUT_MS: u64 = 30_000;

impl SagaCompiler<'_, '_> {
    pub(super) fn orchestration(
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
        // A result trigger the saga declares itself (same subject and event type) is kept
        // instead, with its own correlation: that is how a command step whose aggregate
        // does not echo `metadata` is correlated (by `event.aggregate_id`, say).
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
                    reply: true,
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
