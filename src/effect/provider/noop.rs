//! The `noop` provider: calls nothing, and answers from its settings.
//!
//! It exists for demos, tests and benchmarks, which need a stand-in service without running
//! one. Settings (both optional): `result` (template over `event` and `saga`; the success
//! payload, default `{}`) and `fail_when` (CEL over `event` and `saga`; when true the
//! attempt fails fatally — no retry — so the result type is `Failed`). For example
//! `result: { booking_ref: "car-${ event.command_id }" }` with
//! `fail_when: has(event.payload.fail_car) && event.payload.fail_car`.
//!
//! Guarantee: the outcome depends on the command alone, so every attempt and every replay
//! of a command gets the same one; a condition that cannot be evaluated is a fatal failure.

use serde_json::{Value as Json, json};

use super::error::{EffectError, SettingsError};
use super::input::{render, saga_vars};
use super::settings::Settings;
use crate::expr::{Expr, Needs, Template, Vars};

/// Compiled noop settings.
#[derive(Debug, Clone, Default)]
pub struct NoopSpec {
    result: Option<Template>,
    fail_when: Option<Expr>,
    /// What the two can read: only that is bound for an attempt.
    needs: Needs,
}

impl NoopSpec {
    /// Reads `fail_when` and `result`.
    pub(super) fn compile(s: &Settings<'_>) -> Result<Self, SettingsError> {
        let fail_when = s.condition("fail_when")?;
        let result = s.template("result")?;
        let mut needs = Needs::default();
        if let Some(e) = &fail_when {
            needs.merge(e.needs());
        }
        if let Some(t) = &result {
            t.add_needs(&mut needs);
        }
        Ok(Self {
            result,
            fail_when,
            needs,
        })
    }

    /// The outcome of one attempt for `command` (the whole envelope).
    pub(super) fn call(&self, effect: &str, command: &Json) -> Result<Json, EffectError> {
        if self.result.is_none() && self.fail_when.is_none() {
            return Ok(json!({}));
        }
        let saga = saga_vars(command, json!({}));
        let empty = json!({});
        let vars = Vars::pruned(command, &[], &empty, &saga, &self.needs);
        if let Some(cond) = &self.fail_when {
            let fail = cond.eval_bool(&vars).map_err(|e| EffectError::Fatal {
                reason: format!("effect `{effect}`: fail_when: {e}"),
                details: json!({}),
            })?;
            if fail {
                return Err(EffectError::Fatal {
                    reason: format!("effect `{effect}`: fail_when is true for the command"),
                    details: json!({}),
                });
            }
        }
        match &self.result {
            Some(t) => render(t, &vars, "result"),
            None => Ok(json!({})),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::effect::provider::Provider;
    use crate::manifest::catalog::Effect;

    fn noop(settings: Json) -> Result<Provider, SettingsError> {
        let settings = match settings {
            Json::Object(m) => m.into_iter().collect(),
            _ => BTreeMap::new(),
        };
        Provider::compile(&Effect {
            name: "reserve_car".into(),
            provider: "noop".into(),
            settings,
            timeout_ms: None,
            retry: None,
            circuit_breaker: None,
            declared: Default::default(),
        })
    }

    fn outcome(p: &Provider, command: &Json) -> Result<Json, EffectError> {
        let Provider::Noop(spec) = p else {
            panic!("not a noop provider: {p:?}")
        };
        spec.call("reserve_car", command)
    }

    #[test]
    fn noop_settings_shape_the_outcome() {
        let cmd = |fail: bool| {
            json!({
                "command_id": "c1",
                "tenant_id": "acme",
                "payload": {"trip_id": "t7", "fail_car": fail},
                "metadata": {"saga": "travel", "correlation_id": "t7"},
            })
        };
        // No settings: an empty object, as before.
        let plain = noop(json!({})).expect("compiles");
        assert_eq!(outcome(&plain, &cmd(true)), Ok(json!({})));

        let p = noop(json!({
            "result": {"booking_ref": "car-${ event.payload.trip_id }", "by": "${ saga.name }"},
            "fail_when": "event.payload.fail_car",
        }))
        .expect("compiles");
        assert_eq!(
            outcome(&p, &cmd(false)),
            Ok(json!({"booking_ref": "car-t7", "by": "travel"}))
        );
        let err = outcome(&p, &cmd(true)).expect_err("fails when asked to");
        assert!(!err.is_retryable(), "a noop failure is final: {err}");

        // A condition that cannot be evaluated fails the attempt, fatally.
        let broken = noop(json!({"fail_when": "event.payload.missing.deeper"})).expect("compiles");
        assert!(
            !outcome(&broken, &cmd(false))
                .expect_err("fails")
                .is_retryable()
        );
    }

    #[test]
    fn noop_settings_are_checked() {
        let e = noop(json!({"fail_when": true})).expect_err("not a string");
        assert_eq!(e.setting, "fail_when");
        let e = noop(json!({"fail_when": "event.payload.("})).expect_err("not CEL");
        assert_eq!(e.setting, "fail_when");
        let e = noop(json!({"result": "${ event.( }"})).expect_err("bad template");
        assert_eq!(e.setting, "result");
    }
}
