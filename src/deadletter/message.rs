//! The message announcing a dead letter on the dead-letter stream: its subject
//! (`tenant.<t>.deadletter.<kind>`), its `Nats-Msg-Id` (derived from where the input came
//! from, so a republished announcement is de-duplicated) and its JSON body. Saga-side and
//! effect-side messages share the subject scheme and the body's common fields.

use serde_json::{Value as Json, json};

use super::DeadLetter;
use super::refusal::{Refused, bounded_reason, excerpt};

/// A message for the dead-letter stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// `tenant.<t>.deadletter.<kind>`.
    pub subject: String,
    /// Its `Nats-Msg-Id`, derived from where the input came from, so a republished dead
    /// letter is dropped by JetStream's de-duplication.
    pub msg_id: String,
    /// The JSON body.
    pub body: Json,
}

/// The dead-letter stream's subject for `tenant` and `kind`.
pub fn subject(tenant: &str, kind: &str) -> String {
    format!("tenant.{tenant}.deadletter.{kind}")
}

/// The message that announces a stored saga-side dead letter.
pub fn message(dl: &DeadLetter) -> Message {
    Message {
        subject: subject(&dl.tenant, &dl.kind),
        msg_id: format!(
            "dl:{}:{}:{}",
            dl.source,
            dl.saga.as_deref().unwrap_or("-"),
            dl.id
        ),
        body: json!({
            "v": 1,
            "id": dl.id,
            "tenant_id": dl.tenant,
            "kind": dl.kind,
            "reason": dl.reason,
            "subject": dl.subject,
            "source": dl.source,
            "saga": dl.saga,
            "correlation_id": dl.correlation_id,
            "body": dl.body,
            "body_bytes": dl.body_bytes,
            "at_ms": dl.at_ms,
        }),
    }
}

/// The message for an effect command that can never run (the effect worker keeps no local
/// store: this message is the whole record).
pub fn refused_command(p: Refused<'_>) -> Message {
    let (body, body_bytes) = excerpt(p.body);
    Message {
        subject: subject(p.tenant, p.kind),
        msg_id: format!("dl:{}:effect", p.source),
        body: json!({
            "v": 1,
            "tenant_id": p.tenant,
            "kind": p.kind,
            "reason": bounded_reason(p.reason),
            "subject": p.subject,
            "source": p.source,
            "body": body,
            "body_bytes": body_bytes,
            "at_ms": p.at_ms,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deadletter::{DeadLetterStatus, kind};

    #[test]
    fn saga_and_effect_messages_share_subject_and_fields() {
        let refused = Refused {
            tenant: "acme",
            kind: kind::UNDECODABLE,
            reason: "body is not JSON",
            subject: "tenant.acme.aggregate.Order.o-1",
            source: "AGGREGATE_EVENTS:7",
            body: b"\xff{",
            at_ms: 42,
        };
        let effect = refused_command(refused);
        assert_eq!(effect.msg_id, "dl:AGGREGATE_EVENTS:7:effect");
        assert_eq!(effect.subject, "tenant.acme.deadletter.undecodable");
        assert_eq!(effect.body["body"], Json::from("\u{fffd}{"));
        let saga = message(&DeadLetter {
            id: 3,
            tenant: refused.tenant.into(),
            kind: refused.kind.into(),
            reason: refused.reason.into(),
            subject: refused.subject.into(),
            source: refused.source.into(),
            body: String::from_utf8_lossy(refused.body).into_owned(),
            body_bytes: None,
            traceparent: None,
            saga: Some("order".into()),
            correlation_id: Some("o-1".into()),
            attempts: 1,
            at_ms: refused.at_ms,
            status: DeadLetterStatus::Pending,
            stored_ms: None,
            live_cap: None,
            timer_cap: None,
        });
        assert_eq!(saga.subject, effect.subject);
        assert_eq!(saga.msg_id, "dl:AGGREGATE_EVENTS:7:order:3");
        for field in [
            "tenant_id",
            "kind",
            "reason",
            "subject",
            "source",
            "body",
            "at_ms",
        ] {
            assert!(effect.body.get(field).is_some(), "{field} missing");
            assert_eq!(saga.body[field], effect.body[field], "{field} differs");
        }
    }
}
