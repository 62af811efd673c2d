//! The `log` provider: writes one log line for the command and succeeds with `{}`.
//!
//! It takes no settings. The line carries the payload's size, never its content (a payload
//! may hold personal data), with the effect and the command id as fields of its own: the
//! line is this provider's output, read on its own, so it does not rely on the command's
//! span to say which command it is about.
//!
//! Guarantee: it never fails, so a command routed to it always ends `Succeeded`.

use serde_json::{Value as Json, json};

use super::error::EffectError;

/// Logs one attempt of `command` (the whole envelope).
pub(super) fn call(effect: &str, command: &Json, command_id: &str) -> Result<Json, EffectError> {
    tracing::info!(
        message = "Effect command (log provider).",
        effect,
        command_id,
        payload_bytes = command
            .get("payload")
            .map(|p| p.to_string().len())
            .unwrap_or(0)
    );
    Ok(json!({}))
}
