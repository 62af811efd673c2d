//! The effect command envelope and its result event.
//!
//! Owns how a command on `tenant.<t>.effect.<name>.<command_id>` is decoded and checked
//! ([`Command::decode`]: the subject and the body must name the same tenant, effect and
//! command id), and how its outcome becomes a result event ([`Command::result`]) on
//! `tenant.<t>.effect_result.<name>.<command_id>`.
//!
//! Guarantee: the result event's id (and its `Nats-Msg-Id`) is derived from the command id
//! alone, so every executor and every replay of a command publishes the same id, and
//! JetStream and the saga side each drop all copies after the first.

use serde::Serialize;
use serde_json::{Value as Json, json};

use super::claim::StoredResult;
use crate::clock::now_ms;
use crate::manifest::model::RetryPolicy;

/// Room a result leaves, under the broker's record limit, for the claim record that stores
/// it (owner, attempt, lease, subject, ids).
const CLAIM_ALLOWANCE: usize = 1024;

/// Final result types of an effect command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultType {
    /// The upstream did it.
    Succeeded,
    /// A fatal failure, or retries spent.
    Failed,
    /// The last attempt timed out, retries spent.
    TimedOut,
}

impl ResultType {
    /// Name in the result envelope.
    pub fn as_str(self) -> &'static str {
        match self {
            ResultType::Succeeded => "Succeeded",
            ResultType::Failed => "Failed",
            ResultType::TimedOut => "TimedOut",
        }
    }
}

/// An effect command, decoded.
#[derive(Debug, Clone)]
pub struct Command {
    /// Tenant.
    pub tenant: String,
    /// Command id (the idempotency key).
    pub command_id: String,
    /// Effect name.
    pub effect: String,
    /// The whole envelope.
    pub body: Json,
    /// `traceparent` header.
    pub traceparent: Option<String>,
    /// The saga inbox partition its result goes straight into (header `Runner-Partition`,
    /// set by a partition's relay); `None`: the result goes to its `effect_result` subject.
    pub reply_partition: Option<u32>,
}

/// Why a command was refused before any execution.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// Not JSON, or a required field is missing.
    #[error("undecodable effect command on {subject}: {reason}")]
    Undecodable {
        /// Subject.
        subject: String,
        /// Why.
        reason: String,
    },
    /// The subject and the body name different tenants, effects or ids.
    #[error(
        "effect command on {subject}: subject says {field} {in_subject:?}, body says {in_body:?}"
    )]
    Mismatch {
        /// Subject.
        subject: String,
        /// Which field.
        field: &'static str,
        /// Value in the subject.
        in_subject: String,
        /// Value in the body.
        in_body: String,
    },
}

impl Command {
    /// Decodes `tenant.<t>.effect.<name>.<command_id>` and its body.
    pub fn decode(
        subject: &str,
        payload: &[u8],
        traceparent: Option<String>,
    ) -> Result<Self, CommandError> {
        let undecodable = |reason: String| CommandError::Undecodable {
            subject: subject.to_string(),
            reason,
        };
        let parts: Vec<&str> = subject.split('.').collect();
        let [_, t, _, name, id] = parts.as_slice() else {
            return Err(undecodable(
                "subject is not tenant.<t>.effect.<name>.<id>".into(),
            ));
        };
        let body: Json =
            serde_json::from_slice(payload).map_err(|e| undecodable(format!("not JSON: {e}")))?;
        let field = |k: &str| {
            body.get(k)
                .and_then(Json::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| undecodable(format!("no `{k}` string")))
        };
        let tenant = field("tenant_id")?;
        let effect = field("effect_name")?;
        let command_id = field("command_id")?;
        for (name, sub, b) in [
            ("tenant", *t, &tenant),
            ("effect", *name, &effect),
            ("command id", *id, &command_id),
        ] {
            if sub != b {
                return Err(CommandError::Mismatch {
                    subject: subject.to_string(),
                    field: name,
                    in_subject: sub.to_string(),
                    in_body: b.clone(),
                });
            }
        }
        Ok(Self {
            tenant,
            command_id,
            effect,
            body,
            traceparent,
            reply_partition: None,
        })
    }

    /// The retry policy carried in `metadata.retry`, if any.
    pub(super) fn retry(&self) -> Option<RetryPolicy> {
        self.body
            .pointer("/metadata/retry")
            .and_then(|r| serde_json::from_value(r.clone()).ok())
    }

    /// The id of this command's result event: a UUID v7 derived from the command id alone,
    /// with the command id's own time bits, so every executor and every replay agrees.
    pub fn result_id(&self) -> String {
        let ts = uuid::Uuid::parse_str(&self.command_id)
            .ok()
            .and_then(|u| u.get_timestamp())
            .map(|t| {
                let (s, n) = t.to_unix();
                s * 1000 + u64::from(n) / 1_000_000
            })
            .unwrap_or(0);
        let seed = crate::saga::ids::IdSeed {
            tenant: &self.tenant,
            saga: "effect_result",
            correlation_id: &self.effect,
            input_event_id: &self.command_id,
            timestamp_ms: ts,
        };
        crate::saga::ids::derive(&seed, 0).to_string()
    }

    /// The result event for an outcome, kept within `limit` bytes of body (0: no limit
    /// known). An outcome whose payload would make it larger — an upstream answering
    /// megabytes — cannot be published or stored in the claim, so it becomes a `Failed`
    /// result saying so (`error`, the outcome it replaces as `result_type`, its size and
    /// the limit); the second value is that size when this happened. The call is never
    /// made again for it: the command completes with the small result.
    pub fn result_within(
        &self,
        rt: ResultType,
        payload: Json,
        attempts: u32,
        limit: usize,
    ) -> (StoredResult, Option<usize>) {
        let limit = limit.saturating_sub(CLAIM_ALLOWANCE);
        let full = self.result(rt, &payload, attempts);
        let size = full.body.get().len();
        if limit == 0 || size <= limit {
            return (full, None);
        }
        let payload = json!({
            "error": format!(
                "the {} result is {size} bytes, more than the {limit} bytes a result may have",
                rt.as_str()
            ),
            "result_type": rt.as_str(),
            "bytes": size,
            "limit": limit,
        });
        (
            self.result(ResultType::Failed, &payload, attempts),
            Some(size),
        )
    }

    /// The result event for an outcome.
    pub fn result(&self, rt: ResultType, payload: &Json, attempts: u32) -> StoredResult {
        let id = self.result_id();
        let empty = Json::Object(serde_json::Map::new());
        let envelope = ResultEnvelope {
            attempts,
            command_id: &self.command_id,
            effect_name: &self.effect,
            event_id: &id,
            metadata: self.body.get("metadata").unwrap_or(&empty),
            payload,
            result_type: rt.as_str(),
            tenant_id: &self.tenant,
            timestamp_ms: now_ms(),
            v: 1,
        };
        // Serializing borrowed strings and JSON values cannot fail.
        let body = serde_json::value::to_raw_value(&envelope).unwrap_or_default();
        StoredResult {
            subject: format!(
                "tenant.{}.effect_result.{}.{}",
                self.tenant, self.effect, self.command_id
            ),
            msg_id: id,
            traceparent: self.traceparent.clone(),
            body,
            inbox: self
                .reply_partition
                .map(crate::broker::headers::inbox_result_subject),
        }
    }
}

/// A result event as published: fields in the keys' byte order, so the text is what a JSON
/// object with the same fields serializes to.
#[derive(Serialize)]
struct ResultEnvelope<'a> {
    attempts: u32,
    command_id: &'a str,
    effect_name: &'a str,
    event_id: &'a str,
    metadata: &'a Json,
    payload: &'a Json,
    result_type: &'a str,
    tenant_id: &'a str,
    timestamp_ms: u64,
    v: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_result_becomes_a_small_failed_one() {
        let body = json!({"v":1,"tenant_id":"acme","command_id":"c1","effect_name":"pay","payload":{},"metadata":{"saga":"order"}});
        let bytes = serde_json::to_vec(&body).expect("json");
        let c = Command::decode("tenant.acme.effect.pay.c1", &bytes, None).expect("decodes");
        let big = json!({ "blob": "x".repeat(10_000) });
        let (r, over) = c.result_within(ResultType::Succeeded, big.clone(), 1, 0);
        assert_eq!(
            (r.body_json()["result_type"].as_str(), over),
            (Some("Succeeded"), None)
        );
        let (r, over) = c.result_within(ResultType::Succeeded, big.clone(), 1, 50_000);
        assert_eq!(
            (r.body_json()["result_type"].as_str(), over),
            (Some("Succeeded"), None)
        );
        let (r, over) = c.result_within(ResultType::Succeeded, big, 2, 5_000);
        assert!(over.is_some_and(|n| n > 10_000));
        let b = r.body_json();
        assert_eq!(b["result_type"], "Failed");
        assert_eq!(b["payload"]["result_type"], "Succeeded");
        assert_eq!(b["payload"]["limit"], 5_000 - 1_024);
        assert_eq!(b["attempts"], 2);
        assert!(r.body.get().len() < 4_000);
    }

    #[test]
    fn decode_checks_subject_against_body() {
        let body = json!({"v":1,"tenant_id":"acme","command_id":"c1","effect_name":"pay","payload":{},"metadata":{"saga":"order"}});
        let bytes = serde_json::to_vec(&body).expect("json");
        let c = Command::decode("tenant.acme.effect.pay.c1", &bytes, None).expect("decodes");
        assert_eq!(c.effect, "pay");
        assert!(matches!(
            Command::decode("tenant.other.effect.pay.c1", &bytes, None),
            Err(CommandError::Mismatch {
                field: "tenant",
                ..
            })
        ));
        assert!(matches!(
            Command::decode("tenant.acme.effect.pay.c1", b"nope", None),
            Err(CommandError::Undecodable { .. })
        ));
    }

    #[test]
    fn result_echoes_metadata_and_has_a_stable_id() {
        let id = uuid::Uuid::now_v7().to_string();
        let body = json!({"v":1,"tenant_id":"_","command_id":id,"effect_name":"pay","payload":{},"metadata":{"saga":"order","correlation_id":"o1"}});
        let bytes = serde_json::to_vec(&body).expect("json");
        let c = Command::decode(
            &format!("tenant._.effect.pay.{id}"),
            &bytes,
            Some("tp".into()),
        )
        .expect("decodes");
        let a = c.result(ResultType::Succeeded, &json!({"x":1}), 1);
        let b = c.result(ResultType::Failed, &json!({}), 3);
        assert_eq!(a.msg_id, b.msg_id);
        let body = a.body_json();
        assert_eq!(body["event_id"], json!(a.msg_id));
        assert_eq!(body["metadata"]["saga"], json!("order"));
        // The text is what the same object serializes to (keys in order).
        assert_eq!(a.body.get(), body.to_string());
        assert_eq!(body["payload"], json!({"x": 1}));
        assert_eq!(a.subject, format!("tenant._.effect_result.pay.{id}"));
        assert_eq!(a.traceparent.as_deref(), Some("tp"));
        assert_eq!(
            uuid::Uuid::parse_str(&a.msg_id)
                .expect("uuid")
                .get_version_num(),
            7
        );
    }
}
