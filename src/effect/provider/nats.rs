//! The `nats_request` and `nats_publish` providers: one core NATS message per attempt.
//!
//! Settings: `subject` (required), `body` (default `${ event.payload }`), `result`
//! (template over `state` = `{body}`; `nats_request` only; default the reply body),
//! `tenant_scoped` (default `true`, see below).
//! `nats_request` waits for a service's reply; `nats_publish` publishes and succeeds.
//!
//! **Subjects.** The rendered subject is checked before anything is sent, with the one
//! subject check ([`crate::subject::check`], [`Rule::PUBLISH`]): not empty, no empty
//! token, no whitespace or control character, no wildcard, at most
//! [`crate::subject::MAX_SUBJECT_BYTES`]. Unchecked, an over-long token from an input would
//! make nats-server close the worker's only connection (its `max_control_line`). And with
//! `tenant_scoped` (the default) it must start with `tenant.<the command's tenant>.`, so
//! an effect publishes inside its tenant's subject space like everything else Runner
//! writes; `tenant_scoped: false` opts an effect out, for a subject shared by all tenants.
//! A subject whose literal start can never be `tenant.` is refused when the manifest is
//! loaded (`tenant_scoped` left on).
//!
//! Classification: a request that outlasts the attempt's timeout is `TimedOut`; any other
//! request or publish failure, and a reply with a status of 400 or more, is retryable; a
//! template that cannot be rendered and a rendered subject that breaks the rules above are
//! fatal (the same command renders the same subject again), with a reason naming the effect
//! and the rule, never the subject (it may hold a secret).
//!
//! Guarantee: every message carries `Idempotency-Key: <command_id>`, so a service that
//! honours it applies a command once however many attempts reach it; nothing is sent on a
//! subject that breaks the rules above.

use std::time::Duration;

use serde_json::{Value as Json, json};

use super::error::{EffectError, SettingsError, ToEffectResult};
use super::input::{IDEMPOTENCY_KEY_HEADER, as_text, load_secrets, render, saga_vars};
use super::settings::{SecretSource, Settings};
use crate::expr::{Piece, Template, Vars};
use crate::subject::{self, Rule};

/// Compiled NATS settings.
#[derive(Debug, Clone)]
pub struct NatsSpec {
    /// The effect's name, for errors.
    effect: String,
    subject: Template,
    /// The subject must start with `tenant.<the command's tenant>.`.
    tenant_scoped: bool,
    body: Template,
    result: Option<Template>,
    secrets: Vec<(String, SecretSource)>,
}

/// One attempt's message, ready to send.
struct Prepared {
    subject: String,
    headers: async_nats::HeaderMap,
    body: Vec<u8>,
    /// The `saga` variable, for the `result` template.
    saga: Json,
}

impl NatsSpec {
    /// Reads and checks the settings.
    pub(super) fn compile(c: &Settings<'_>) -> Result<Self, SettingsError> {
        let subject = c
            .template("subject")?
            .ok_or_else(|| c.err("subject", "is required"))?;
        let tenant_scoped = match c.get("tenant_scoped") {
            None => true,
            Some(Json::Bool(b)) => *b,
            Some(_) => return Err(c.err("tenant_scoped", "must be true or false")),
        };
        check_literal_start(&subject, tenant_scoped).map_err(|e| c.err("subject", e))?;
        Ok(Self {
            effect: c.effect.to_string(),
            subject,
            tenant_scoped,
            body: c.body_or_payload()?,
            result: c.template("result")?,
            secrets: c.secrets()?,
        })
    }

    fn prepare(&self, command: &Json, command_id: &str) -> Result<Prepared, EffectError> {
        let secrets = load_secrets(&self.secrets)?;
        let saga = saga_vars(command, secrets);
        let (subject, body) = {
            let empty = json!({});
            let vars = Vars::new(command, &empty, &saga);
            let subject = as_text(render(&self.subject, &vars, "subject")?);
            self.check_subject(&subject, command)?;
            let body = serde_json::to_vec(&render(&self.body, &vars, "body")?).fatal()?;
            (subject, body)
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY_HEADER, command_id);
        Ok(Prepared {
            subject,
            headers,
            body,
            saga,
        })
    }

    /// Refuses a rendered subject that breaks a rule of the module doc: fatal, naming the
    /// effect and the rule (not the subject, which may hold a secret or be huge).
    fn check_subject(&self, subject: &str, command: &Json) -> Result<(), EffectError> {
        let fatal = |why: String| EffectError::Fatal {
            reason: format!("effect `{}`: rendered subject refused: {why}", self.effect),
            details: json!({ "subject_bytes": subject.len() }),
        };
        subject::check(subject, Rule::PUBLISH).map_err(|e| fatal(e.to_string()))?;
        if self.tenant_scoped {
            // The effect worker admitted the tenant as a token before any attempt.
            let tenant = command
                .get("tenant_id")
                .and_then(Json::as_str)
                .unwrap_or_default();
            if tenant.is_empty() || !in_tenant(subject, tenant) {
                return Err(fatal(format!(
                    "subject is outside tenant `{tenant}`: it must start with `tenant.{tenant}.` \
                     (set `tenant_scoped: false` on the effect to publish on a shared subject)"
                )));
            }
        }
        Ok(())
    }

    /// `nats_publish`: publishes the message for `command` (the whole envelope).
    pub(super) async fn publish(
        &self,
        command: &Json,
        command_id: &str,
        nats: &async_nats::Client,
    ) -> Result<Json, EffectError> {
        let m = self.prepare(command, command_id)?;
        nats.publish_with_headers(m.subject, m.headers, m.body.into())
            .await
            .retryable()?;
        Ok(json!({}))
    }

    /// `nats_request`: sends the request for `command` and reads the reply; `timeout` is
    /// the attempt's, named in the error when the request times out.
    pub(super) async fn request(
        &self,
        command: &Json,
        command_id: &str,
        nats: &async_nats::Client,
        timeout: Duration,
    ) -> Result<Json, EffectError> {
        let m = self.prepare(command, command_id)?;
        let reply = nats
            .request_with_headers(m.subject, m.headers, m.body.into())
            .await
            .map_err(|e| match e.kind() {
                async_nats::RequestErrorKind::TimedOut => EffectError::TimedOut(timeout),
                _ => EffectError::Retryable {
                    reason: format!("request failed: {e}"),
                    retry_after: None,
                    details: json!({}),
                },
            })?;
        let body: Json = serde_json::from_slice(&reply.payload)
            .unwrap_or_else(|_| Json::String(String::from_utf8_lossy(&reply.payload).into()));
        let status = reply.status.map(|s| s.as_u16());
        if let Some(s) = status.filter(|s| *s >= 400) {
            return Err(EffectError::Retryable {
                reason: format!("service answered status {s}"),
                retry_after: None,
                details: json!({ "status": s, "body": body }),
            });
        }
        let response = json!({ "body": body });
        match &self.result {
            Some(t) => render(t, &Vars::new(command, &response, &m.saga), "result"),
            None => Ok(response["body"].clone()),
        }
    }
}

/// Whether `subject` lies inside `tenant`'s subject space (`tenant.<tenant>.…`).
fn in_tenant(subject: &str, tenant: &str) -> bool {
    subject
        .strip_prefix("tenant.")
        .and_then(|rest| rest.strip_prefix(tenant))
        .is_some_and(|rest| rest.starts_with('.'))
}

/// Load-time checks of the subject template: a literal subject must pass the subject
/// rules, and with `tenant_scoped` a subject whose literal start can never be `tenant.`
/// is refused now rather than on every command.
fn check_literal_start(subject: &Template, tenant_scoped: bool) -> Result<(), String> {
    let start = match subject {
        Template::Literal(Json::String(s)) => {
            subject::check(s, Rule::PUBLISH).map_err(|e| e.to_string())?;
            s.as_str()
        }
        Template::Interpolate(pieces) => match pieces.first() {
            Some(Piece::Text(t)) => t.as_str(),
            _ => return Ok(()),
        },
        _ => return Ok(()),
    };
    const PREFIX: &str = "tenant.";
    if tenant_scoped && !start.starts_with(PREFIX) && !PREFIX.starts_with(start) {
        return Err(
            "must start with `tenant.${ saga.tenant }.`: an effect publishes inside its \
             command's tenant (set `tenant_scoped: false` to publish on a shared subject)"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec(subject: &str, scoped: Option<bool>) -> Result<NatsSpec, SettingsError> {
        let mut m = std::collections::BTreeMap::new();
        m.insert("subject".to_string(), json!(subject));
        if let Some(b) = scoped {
            m.insert("tenant_scoped".to_string(), json!(b));
        }
        NatsSpec::compile(&Settings {
            effect: "notify",
            settings: &m,
            base: None,
        })
    }

    fn command(tenant: &str, token: &str) -> Json {
        json!({ "tenant_id": tenant, "command_id": "c1", "payload": { "token": token } })
    }

    fn reason(r: Result<Prepared, EffectError>) -> String {
        match r {
            Err(EffectError::Fatal { reason, .. }) => reason,
            Err(e) => panic!("not fatal: {e}"),
            Ok(p) => panic!("sent on {:?}", p.subject),
        }
    }

    #[test]
    fn a_subject_in_the_tenant_is_sent() {
        let s = spec(
            "tenant.${ saga.tenant }.notify.${ event.payload.token }",
            None,
        )
        .unwrap();
        let m = s.prepare(&command("acme", "x1"), "c1").unwrap();
        assert_eq!(m.subject, "tenant.acme.notify.x1");
    }

    #[test]
    fn an_over_long_or_malformed_token_is_fatal_naming_effect_and_rule() {
        let s = spec(
            "tenant.${ saga.tenant }.notify.${ event.payload.token }",
            None,
        )
        .unwrap();
        let r = reason(s.prepare(&command("acme", &"k".repeat(5000)), "c1"));
        assert!(
            r.starts_with("effect `notify`: rendered subject refused: subject is"),
            "{r}"
        );
        assert!(r.contains("the limit is 1024"), "{r}");
        assert!(!r.contains("kkkk"), "the subject is not echoed: {r}");
        for (token, rule) in [
            ("a b", "whitespace"),
            ("a\r\nPUB x 1", "whitespace or a control character"),
            ("", "empty token"),
            ("a..b", "empty token"),
            ("*", "wildcard `*`"),
            (">", "wildcard `>`"),
        ] {
            let r = reason(s.prepare(&command("acme", token), "c1"));
            assert!(r.contains(rule), "{token:?}: {r}");
        }
    }

    #[test]
    fn a_subject_outside_the_tenant_is_refused_unless_opted_out() {
        // Rendered outside: another tenant, or no tenant prefix at all.
        let s = spec("${ event.payload.token }", None).unwrap();
        for token in [
            "tenant.other.x",
            "tenant.acmeX.x",
            "notify.acme",
            "tenant.acme",
        ] {
            let r = reason(s.prepare(&command("acme", token), "c1"));
            assert!(
                r.contains("outside tenant `acme`: it must start with `tenant.acme.`")
                    && r.contains("tenant_scoped: false"),
                "{token:?}: {r}"
            );
        }
        assert_eq!(
            s.prepare(&command("acme", "tenant.acme.x"), "c1")
                .unwrap()
                .subject,
            "tenant.acme.x"
        );
        let shared = spec("${ event.payload.token }", Some(false)).unwrap();
        assert_eq!(
            shared
                .prepare(&command("acme", "notify.acme"), "c1")
                .unwrap()
                .subject,
            "notify.acme"
        );
        // The opt-out lifts the tenant rule only, never the subject rules.
        let r = reason(shared.prepare(&command("acme", &"k".repeat(5000)), "c1"));
        assert!(r.contains("the limit is 1024"), "{r}");
    }

    #[test]
    fn a_literal_start_outside_any_tenant_is_refused_at_load() {
        let e = spec("notifications.${ event.payload.channel }", None).unwrap_err();
        assert_eq!(e.setting, "subject");
        assert!(e.message.contains("tenant_scoped: false"), "{e}");
        assert!(spec("fixed.subject", None).is_err());
        assert!(spec("notifications.${ event.payload.channel }", Some(false)).is_ok());
        assert!(spec("tenant.${ saga.tenant }.n", None).is_ok());
        assert!(spec("ten${ event.payload.rest }", None).is_ok());
        assert!(spec("${ event.payload.subject }", None).is_ok());
        let e = spec("fixed subject", Some(false)).unwrap_err();
        assert!(e.message.contains("whitespace"), "{e}");
        let e = NatsSpec::compile(&Settings {
            effect: "notify",
            settings: &[
                ("subject".to_string(), json!("tenant.${ saga.tenant }.n")),
                ("tenant_scoped".to_string(), json!("no")),
            ]
            .into_iter()
            .collect(),
            base: None,
        })
        .unwrap_err();
        assert_eq!(e.setting, "tenant_scoped");
    }
}
