//! The `nats_request` and `nats_publish` providers: one core NATS message per attempt.
//!
//! Settings: `subject` (required), `body` (default `${ event.payload }`), `result`
//! (template over `state` = `{body}`; `nats_request` only; default the reply body).
//! `nats_request` waits for a service's reply; `nats_publish` publishes and succeeds.
//!
//! Classification: a request that outlasts the attempt's timeout is `TimedOut`; any other
//! request or publish failure, and a reply with a status of 400 or more, is retryable; a
//! template that cannot be rendered is fatal.
//!
//! Guarantee: every message carries `Idempotency-Key: <command_id>`, so a service that
//! honours it applies a command once however many attempts reach it.

use std::time::Duration;

use serde_json::{Value as Json, json};

use super::error::{EffectError, SettingsError, ToEffectResult};
use super::input::{IDEMPOTENCY_KEY_HEADER, as_text, load_secrets, render, saga_vars};
use super::settings::{SecretSource, Settings};
use crate::expr::{Template, Vars};

/// Compiled NATS settings.
#[derive(Debug, Clone)]
pub struct NatsSpec {
    subject: Template,
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
        Ok(Self {
            subject: c
                .template("subject")?
                .ok_or_else(|| c.err("subject", "is required"))?,
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
