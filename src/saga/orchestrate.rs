//! Orchestration-style sagas: steps with compensations, run by the same engine.
//!
//! An orchestration is a fixed state machine over its steps: stages (a step, or a group of
//! consecutive steps run in parallel) run one after the other; state names are
//! `step:<name>` (or `step:<a>+<b>` for a group), `compensating:<name>`, `completed`,
//! `compensated` and `needs_operator`. It goes through [`super::apply`] like any saga, so it
//! shares the id derivation, timers and determinism guarantees; its bookkeeping lives in
//! [`Progress`] inside the instance.
//!
//! Semantics (after Sage):
//! - A step succeeds or fails on the event names it declares. Its result is stored in
//!   `state.results.<step>` (the event payload), visible to later templates.
//! - Who retries: an **effect** step's retry policy travels in the effect command and the
//!   effect worker applies it, so a failure result is final for the saga. A **command** step
//!   waits for its result events under a durable timeout timer (`<step>.timeout`); on failure
//!   or timeout it is re-sent after the backoff through a timer (`<step>.retry`), until its
//!   `retry_limit` is spent.
//! - When a step has failed for good, the stage's other steps are awaited, then the
//!   compensations of the completed steps run one at a time in reverse completion order.
//! - An `abort` event fails the step at once and cancels every pending retry: compensate
//!   without retrying.
//! - A compensation has its own retry budget (same rules as its step kind); when it is spent
//!   the instance parks in `needs_operator` with its pending timers cancelled — never dropped.

use serde_json::{Value as Json, json};

use super::emitter::{Emitter, Ev, saga_json};
use super::retry::{JitterKey, delay_ms};
use super::types::{
    InputKind, Instance, Parsed, Progress, Status, StepError, StepProgress, StepStatus,
};
use crate::manifest::catalog::{Emit, Orchestration, Step};

struct Run<'a, 'b> {
    o: &'a Orchestration,
    inst: &'a mut Instance,
    pr: Progress,
    event: &'a Ev<'a>,
    p: &'a Parsed<'a>,
    em: &'a mut Emitter<'b>,
}

pub(crate) fn step(
    o: &Orchestration,
    inst: &mut Instance,
    event: &Ev<'_>,
    p: &Parsed,
    em: &mut Emitter<'_>,
    started: bool,
) -> Result<(), StepError> {
    let pr = if started {
        Progress::default()
    } else {
        inst.progress
            .take()
            .ok_or_else(|| StepError::poison("orchestration progress is missing"))?
    };
    let mut run = Run {
        o,
        inst,
        pr,
        event,
        p,
        em,
    };
    let res = if started {
        run.start_stage(0)
    } else {
        run.handle()
    };
    let Run { pr, inst, .. } = run;
    inst.progress = Some(pr);
    res
}

impl<'a> Run<'a, '_> {
    fn step_def(&self, name: &str) -> Result<&'a Step, StepError> {
        let o: &'a Orchestration = self.o;
        o.steps
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| StepError::poison(format!("step `{name}` is not in this version")))
    }

    fn send(&mut self, action: &Emit) -> Result<String, StepError> {
        let sj = saga_json(
            &self.inst.saga,
            &self.inst.tenant,
            &self.inst.correlation_id,
            self.inst.version,
            &self.inst.state,
        );
        let vars = self.event.vars(&self.inst.data, &sj, &self.em.saga.needs);
        self.em.emit(action, &vars)
    }

    fn due(&self, delay: u64) -> u64 {
        self.p.timestamp_ms.saturating_add(delay)
    }

    fn start_stage(&mut self, idx: usize) -> Result<(), StepError> {
        self.pr.stage = idx;
        let Some(stage) = self.o.stages.get(idx) else {
            self.inst.state = "completed".into();
            self.inst.status = Status::Completed;
            return Ok(());
        };
        let names: Vec<&str> = stage
            .iter()
            .map(|&i| self.o.steps[i].name.as_str())
            .collect();
        self.inst.state = format!("step:{}", names.join("+"));
        for &i in stage {
            let step = &self.o.steps[i];
            self.send_step(step, 1)?;
        }
        Ok(())
    }

    fn send_step(&mut self, step: &Step, attempt: u32) -> Result<(), StepError> {
        let id = self.send(&step.action)?;
        self.pr.steps.insert(
            step.name.clone(),
            StepProgress {
                status: StepStatus::Running,
                attempt,
                command_id: id,
            },
        );
        if matches!(step.action, Emit::Command { .. }) {
            let due = self.due(step.timeout_ms);
            self.em
                .set_timer(self.inst, &format!("{}.timeout", step.name), due);
        }
        Ok(())
    }

    fn send_compensation(&mut self, step: &Step, attempt: u32) -> Result<(), StepError> {
        let Some(c) = &step.compensation else {
            return Ok(());
        };
        self.inst.state = format!("compensating:{}", step.name);
        let id = self.send(&c.action)?;
        self.pr.steps.insert(
            step.name.clone(),
            StepProgress {
                status: StepStatus::Compensating,
                attempt,
                command_id: id,
            },
        );
        if matches!(c.action, Emit::Command { .. }) {
            let due = self.due(c.timeout_ms);
            self.em.set_timer(
                self.inst,
                &format!("{}.compensation_timeout", step.name),
                due,
            );
        }
        Ok(())
    }

    fn no_transition(&self) -> StepError {
        StepError::NoTransition {
            state: self.inst.state.clone(),
            event: self.p.name.to_string(),
        }
    }

    fn status_of(&self, name: &str) -> Option<StepStatus> {
        self.pr.steps.get(name).map(|s| s.status)
    }

    fn handle(&mut self) -> Result<(), StepError> {
        let o = self.o;
        let name = self.p.name.to_string();
        if let Some(timer) = name.strip_prefix("timer.") {
            return self.handle_timer(timer);
        }
        let is_effect_result = self.p.kind == InputKind::EffectResult;
        let matches_command = |s: &Step, pr: &Progress| {
            !is_effect_result
                || pr.steps.get(&s.name).map(|x| Some(x.command_id.as_str()))
                    == Some(self.p.command_id)
        };
        if self.pr.compensating {
            let current = self
                .pr
                .to_compensate
                .first()
                .cloned()
                .ok_or_else(|| self.no_transition())?;
            let step = self.step_def(&current)?;
            let Some(c) = &step.compensation else {
                return Err(self.no_transition());
            };
            if self.status_of(&current) != Some(StepStatus::Compensating)
                || !matches_command(step, &self.pr)
            {
                return Err(self.no_transition());
            }
            if c.success.contains(&name) {
                self.em
                    .cancel_timer(self.inst, &format!("{current}.compensation_timeout"));
                self.set_status(&current, StepStatus::Compensated);
                self.pr.to_compensate.remove(0);
                return self.next_compensation();
            }
            if c.failure.contains(&name) {
                return self.compensation_failed(step);
            }
            return Err(self.no_transition());
        }
        let stage = o.stages.get(self.pr.stage).cloned().unwrap_or_default();
        let found = stage.iter().map(|&i| &o.steps[i]).find(|s| {
            self.status_of(&s.name) == Some(StepStatus::Running)
                && (s.success.contains(&name)
                    || s.failure.contains(&name)
                    || s.abort.contains(&name))
                && matches_command(s, &self.pr)
        });
        let Some(step) = found else {
            return Err(self.no_transition());
        };
        self.em
            .cancel_timer(self.inst, &format!("{}.timeout", step.name));
        if step.success.contains(&name) {
            self.set_status(&step.name, StepStatus::Succeeded);
            self.pr.completed.push(step.name.clone());
            let payload = self
                .event
                .body
                .get("payload")
                .cloned()
                .unwrap_or(Json::Null);
            if !self.inst.data.is_object() {
                self.inst.data = json!({});
            }
            if let Json::Object(m) = &mut self.inst.data {
                let results = m.entry("results").or_insert_with(|| json!({}));
                if let Json::Object(r) = results {
                    r.insert(step.name.clone(), payload);
                }
            }
        } else if step.abort.contains(&name) {
            self.abort(step);
        } else {
            self.step_failed(step);
        }
        self.settle()
    }

    fn handle_timer(&mut self, timer: &str) -> Result<(), StepError> {
        let (step_name, what) = timer.rsplit_once('.').ok_or_else(|| self.no_transition())?;
        let step = self.step_def(step_name)?;
        match (what, self.status_of(step_name)) {
            ("timeout", Some(StepStatus::Running)) if !self.pr.compensating => {
                self.step_failed(step);
                self.settle()
            }
            ("retry", Some(StepStatus::RetryWait)) if !self.pr.compensating => {
                let attempt = self.pr.steps.get(step_name).map_or(1, |s| s.attempt) + 1;
                self.send_step(step, attempt)
            }
            ("compensation_timeout", Some(StepStatus::Compensating)) => {
                self.compensation_failed(step)
            }
            ("compensation_retry", Some(StepStatus::CompensationRetryWait)) => {
                let attempt = self.pr.steps.get(step_name).map_or(1, |s| s.attempt) + 1;
                self.send_compensation(step, attempt)
            }
            _ => Err(self.no_transition()),
        }
    }

    fn set_status(&mut self, name: &str, status: StepStatus) {
        if let Some(s) = self.pr.steps.get_mut(name) {
            s.status = status;
        }
    }

    fn jitter_key<'k>(&'k self, step: &'k str) -> JitterKey<'k> {
        JitterKey {
            tenant: &self.inst.tenant,
            saga: &self.inst.saga,
            correlation_id: &self.inst.correlation_id,
            step,
        }
    }

    /// A forward step failed (result or timeout): retry a command step, else fail it.
    fn step_failed(&mut self, step: &Step) {
        let attempt = self.pr.steps.get(&step.name).map_or(1, |s| s.attempt);
        let retry = match (&step.action, &step.retry) {
            (Emit::Command { .. }, Some(policy))
                if !self.pr.aborted && attempt <= policy.retry_limit =>
            {
                Some(delay_ms(policy, attempt, &self.jitter_key(&step.name)))
            }
            _ => None,
        };
        match retry {
            Some(delay) => {
                self.set_status(&step.name, StepStatus::RetryWait);
                let due = self.due(delay);
                self.em
                    .set_timer(self.inst, &format!("{}.retry", step.name), due);
            }
            None => self.set_status(&step.name, StepStatus::Failed),
        }
    }

    fn abort(&mut self, step: &Step) {
        self.pr.aborted = true;
        self.set_status(&step.name, StepStatus::Failed);
        let waiting: Vec<String> = self
            .pr
            .steps
            .iter()
            .filter(|(_, s)| s.status == StepStatus::RetryWait)
            .map(|(n, _)| n.clone())
            .collect();
        for n in waiting {
            self.em.cancel_timer(self.inst, &format!("{n}.retry"));
            self.set_status(&n, StepStatus::Failed);
        }
    }

    /// After a result: move on when the stage has settled.
    fn settle(&mut self) -> Result<(), StepError> {
        let stage = self
            .o
            .stages
            .get(self.pr.stage)
            .cloned()
            .unwrap_or_default();
        let statuses: Vec<Option<StepStatus>> = stage
            .iter()
            .map(|&i| self.status_of(&self.o.steps[i].name))
            .collect();
        if statuses
            .iter()
            .any(|s| matches!(s, Some(StepStatus::Running | StepStatus::RetryWait)))
        {
            return Ok(());
        }
        if statuses.contains(&Some(StepStatus::Failed)) {
            self.pr.compensating = true;
            let o = self.o;
            self.pr.to_compensate = self
                .pr
                .completed
                .iter()
                .rev()
                .filter(|n| {
                    o.steps
                        .iter()
                        .any(|s| &s.name == *n && s.compensation.is_some())
                })
                .cloned()
                .collect();
            return self.next_compensation();
        }
        self.start_stage(self.pr.stage + 1)
    }

    fn next_compensation(&mut self) -> Result<(), StepError> {
        match self.pr.to_compensate.first().cloned() {
            None => {
                self.inst.state = "compensated".into();
                self.inst.status = Status::Compensated;
                Ok(())
            }
            Some(name) => {
                let step = self.step_def(&name)?;
                self.send_compensation(step, 1)
            }
        }
    }

    fn compensation_failed(&mut self, step: &Step) -> Result<(), StepError> {
        self.em
            .cancel_timer(self.inst, &format!("{}.compensation_timeout", step.name));
        let attempt = self.pr.steps.get(&step.name).map_or(1, |s| s.attempt);
        let retry = step
            .compensation
            .as_ref()
            .and_then(|c| match (&c.action, &c.retry) {
                (Emit::Command { .. }, Some(policy)) if attempt <= policy.retry_limit => {
                    Some(delay_ms(policy, attempt, &self.jitter_key(&step.name)))
                }
                _ => None,
            });
        match retry {
            Some(delay) => {
                self.set_status(&step.name, StepStatus::CompensationRetryWait);
                let due = self.due(delay);
                self.em
                    .set_timer(self.inst, &format!("{}.compensation_retry", step.name), due);
            }
            None => {
                self.inst.state = "needs_operator".into();
                self.inst.status = Status::NeedsOperator;
            }
        }
        Ok(())
    }
}
