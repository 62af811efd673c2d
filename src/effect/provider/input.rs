//! What one attempt sees: the variables its templates are rendered over, its secrets, and
//! its idempotency key.
//!
//! Before the call, templates see `event` = the command envelope and `saga` = `{tenant,
//! name, correlation_id, secrets}` (`saga_vars`); after it, `state` = the response.
//! Secrets are read here, once per attempt, from the sources declared in the settings.
//!
//! Guarantees: a secret's value never appears in an error (only its name and where it was
//! looked for); every attempt of a command, by every executor, carries the same
//! idempotency key — the command id — under [`IDEMPOTENCY_KEY_HEADER`] where the transport
//! has headers.

use serde_json::{Value as Json, json};

use super::error::EffectError;
use super::settings::SecretSource;
use crate::expr::{Template, Vars};

/// Header carrying the idempotency key on every HTTP attempt and NATS message.
pub const IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

/// Reads the declared secrets into `{name: value}`.
pub(super) fn load_secrets(secrets: &[(String, SecretSource)]) -> Result<Json, EffectError> {
    let mut m = serde_json::Map::new();
    for (name, src) in secrets {
        let v = match src {
            SecretSource::Env(var) => std::env::var(var).map_err(|_| EffectError::Fatal {
                reason: format!("secret `{name}`: environment variable {var} is not set"),
                details: json!({}),
            })?,
            SecretSource::File(p) => std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .map_err(|e| EffectError::Fatal {
                    reason: format!("secret `{name}`: cannot read {}: {}", p.display(), e.kind()),
                    details: json!({}),
                })?,
        };
        m.insert(name.clone(), Json::String(v));
    }
    Ok(Json::Object(m))
}

/// The `saga` variable of a command: its tenant, saga name, correlation id and secrets.
pub(super) fn saga_vars(command: &Json, secrets: Json) -> Json {
    json!({
        "tenant": command.get("tenant_id").cloned().unwrap_or(Json::Null),
        "name": command.pointer("/metadata/saga").cloned().unwrap_or(Json::Null),
        "correlation_id": command.pointer("/metadata/correlation_id").cloned().unwrap_or(Json::Null),
        "secrets": secrets,
    })
}

/// Renders a template; a failure is fatal (the same command renders the same way again).
pub(super) fn render(t: &Template, vars: &Vars<'_>, what: &str) -> Result<Json, EffectError> {
    t.render(vars).map_err(|e| EffectError::Fatal {
        reason: format!("template `{what}`: {e}"),
        details: json!({}),
    })
}

/// A rendered value as text: strings as they are, anything else as JSON.
pub(super) fn as_text(v: Json) -> String {
    match v {
        Json::String(s) => s,
        other => other.to_string(),
    }
}
