//! What a `grpc` call answered, as the attempt's outcome: a reply becomes the result, a
//! status an [`EffectError`].
//!
//! Owns the reply's JSON form (every field, defaults included, by the protobuf JSON
//! mapping), the `success_when` check and the `result` template on it, and the reading of
//! a failed call: a reply refused for its size, a cancellation at the deadline, or a status
//! the upstream sent ([`super::status::classify`]).
//!
//! Guarantees: a reply over the result limit fails the command for good and is named as
//! too large, never as a status the upstream sent; the channel cancelling the call at the
//! deadline it sent is a timeout, like `DEADLINE_EXCEEDED`.

use std::time::{Duration, Instant};

use prost_reflect::{DynamicMessage, SerializeOptions};
use serde_json::{Value as Json, json};
use tonic::{Code, Status};

use super::super::error::EffectError;
use super::super::input::render;
use super::GrpcSpec;
use super::status::classify;
use crate::expr::Vars;

/// How close to the deadline a cancellation counts as the deadline's.
const DEADLINE_SLACK: Duration = Duration::from_millis(20);

/// Whether `status` is the client's own refusal of a reply over its decoding limit (tonic
/// answers it as OUT_OF_RANGE, with this message), not a status the upstream sent.
fn reply_too_large(status: &Status) -> bool {
    status.code() == Code::OutOfRange
        && status
            .message()
            .starts_with("Error, decoded message length too large")
}

impl GrpcSpec {
    /// What the failed call started at `started` means for the command.
    pub(super) fn failure(
        &self,
        effect: &str,
        status: &Status,
        started: Instant,
        env: &super::super::CallEnv<'_>,
    ) -> EffectError {
        let timeout = env.timeout;
        if reply_too_large(status) {
            return EffectError::Fatal {
                reason: format!(
                    "effect `{effect}`: the reply is larger than the {} bytes a result may have; it was not read",
                    env.max_answer_bytes
                ),
                details: json!({}),
            };
        }
        // The channel enforces the deadline it sends: when it expires first, tonic
        // answers CANCELLED ("Timeout expired"). At the deadline that is a timeout.
        let at_deadline = started.elapsed() + DEADLINE_SLACK >= timeout;
        if at_deadline && status.code() == Code::Cancelled {
            EffectError::TimedOut(timeout)
        } else {
            classify(effect, status, &self.also_retry)
        }
    }

    /// The result of a reply: its JSON form as `state.body`, checked by `success_when` and
    /// shaped by `result` (the body itself without one).
    pub(super) fn answer(
        &self,
        effect: &str,
        reply: DynamicMessage,
        command: &Json,
        saga: &Json,
    ) -> Result<Json, EffectError> {
        let body = reply
            .serialize_with_options(
                serde_json::value::Serializer,
                &SerializeOptions::new().skip_default_fields(false),
            )
            .map_err(|e| EffectError::Fatal {
                reason: format!("effect `{effect}`: the reply has no JSON form: {e}"),
                details: json!({}),
            })?;
        let response = json!({ "code": 0, "status": "OK", "body": body });
        let after = Vars::new(command, &response, saga);
        if let Some(cond) = &self.success_when {
            let ok = cond.eval_bool(&after).map_err(|e| EffectError::Fatal {
                reason: format!("effect `{effect}`: success_when: {e}"),
                details: response.clone(),
            })?;
            if !ok {
                return Err(EffectError::Fatal {
                    reason: format!("effect `{effect}`: success_when is false for the reply"),
                    details: response.clone(),
                });
            }
        }
        match &self.result {
            Some(t) => render(t, &after, "result"),
            None => Ok(response["body"].clone()),
        }
    }
}
