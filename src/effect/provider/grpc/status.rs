//! The `grpc` provider's reading of a failed call's status: what it means for the command,
//! and the payload a failure carries.
//!
//! Owns [`classify`] (the classification stated in [`super`]), the canonical status names
//! ([`status_name`] and back), the failure payload `{code, status, message}`, and the
//! `retryable_codes` setting that widens the retried statuses.
//!
//! Guarantees: `DEADLINE_EXCEEDED` is always a timeout (in the upstream's words when the
//! server sent it, not ours); only `UNAVAILABLE`,
//! `RESOURCE_EXHAUSTED`, `ABORTED` and the statuses listed in `retryable_codes` are retried,
//! and a negative `grpc-retry-pushback-ms` makes even those fatal; a failure's payload holds
//! only the status and the server's message.

use std::time::Duration;

use serde_json::{Value as Json, json};
use tonic::{Code, Status};

use super::super::error::{EffectError, SettingsError};
use super::super::settings::Settings;

/// The `retryable_codes` setting: status names added to the retryable ones.
pub(super) fn retryable_codes(c: &Settings<'_>) -> Result<Vec<Code>, SettingsError> {
    let list = match c.get("retryable_codes") {
        None => return Ok(Vec::new()),
        Some(Json::Array(a)) => a,
        Some(_) => return Err(c.err("retryable_codes", "must be a list of status names")),
    };
    list.iter()
        .map(|v| {
            let name = v.as_str().unwrap_or_default();
            code_named(name)
                .filter(|code| *code != Code::Ok)
                .ok_or_else(|| {
                    c.err(
                        "retryable_codes",
                        format!("{v} is not a gRPC status name (e.g. INTERNAL, UNKNOWN)"),
                    )
                })
        })
        .collect()
}

/// The status codes retried whatever the settings.
const RETRYABLE: [Code; 3] = [Code::Unavailable, Code::ResourceExhausted, Code::Aborted];

/// The metadata key of the server's retry pushback.
const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// What a failed call means for the command: a timeout, worth retrying, or fatal.
pub(crate) fn classify(effect: &str, status: &Status, also_retry: &[Code]) -> EffectError {
    let code = status.code();
    let details = status_details(status);
    if code == Code::DeadlineExceeded {
        // Sent back by the server (its own deadline, or one further down), not ours: ours
        // expiring is read before this (`answer.rs`).
        return EffectError::UpstreamTimedOut {
            reason: format!(
                "effect `{effect}`: upstream answered status DEADLINE_EXCEEDED: {}",
                status.message()
            ),
            details,
        };
    }
    // A status the client made up from a transport failure carries that failure as its
    // source: nothing answered (a refused or dropped connection, a failed TLS handshake).
    let reason = match std::error::Error::source(status) {
        None => format!(
            "effect `{effect}`: upstream answered status {}",
            status_name(code)
        ),
        Some(cause) => format!(
            "effect `{effect}`: no answer from upstream ({}: {cause})",
            status_name(code)
        ),
    };
    if !(RETRYABLE.contains(&code) || also_retry.contains(&code)) {
        return EffectError::Fatal { reason, details };
    }
    let pushback = status
        .metadata()
        .get(PUSHBACK)
        .map(|v| v.to_str().ok().and_then(|s| s.trim().parse::<i64>().ok()));
    match pushback {
        None => EffectError::Retryable {
            reason,
            retry_after: None,
            details,
        },
        Some(Some(ms)) if ms >= 0 => EffectError::Retryable {
            reason,
            retry_after: Some(Duration::from_millis(ms.unsigned_abs())),
            details,
        },
        Some(_) => EffectError::Fatal {
            reason: format!("{reason}; the server asked not to retry ({PUSHBACK})"),
            details,
        },
    }
}

/// A status as a failure payload: `{code, status, message}`.
pub(super) fn status_details(status: &Status) -> Json {
    json!({
        "code": status.code() as i32,
        "status": status_name(status.code()),
        "message": status.message(),
    })
}

/// The canonical name of a status code (`DEADLINE_EXCEEDED`).
pub fn status_name(code: Code) -> String {
    let mut out = String::new();
    for (i, ch) in format!("{code:?}").chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

/// The code of a canonical status name.
fn code_named(name: &str) -> Option<Code> {
    (0..=16)
        .map(Code::from_i32)
        .find(|c| status_name(*c) == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_canonical_name_and_back() {
        assert_eq!(status_name(Code::DeadlineExceeded), "DEADLINE_EXCEEDED");
        assert_eq!(status_name(Code::Ok), "OK");
        for i in 0..=16 {
            let c = Code::from_i32(i);
            assert_eq!(code_named(&status_name(c)), Some(c), "{c:?}");
        }
        assert_eq!(code_named("NOPE"), None);
    }

    #[test]
    fn statuses_are_classified_as_documented() {
        let class = |code: Code, also: &[Code]| match classify("e", &Status::new(code, "m"), also) {
            EffectError::Retryable { .. } => "retry",
            EffectError::TimedOut(_) | EffectError::UpstreamTimedOut { .. } => "timeout",
            EffectError::Fatal { .. } => "fatal",
            EffectError::CircuitOpen(_) => "open",
        };
        for c in [Code::Unavailable, Code::ResourceExhausted, Code::Aborted] {
            assert_eq!(class(c, &[]), "retry", "{c:?}");
        }
        assert_eq!(class(Code::DeadlineExceeded, &[]), "timeout");
        for c in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::FailedPrecondition,
            Code::Unimplemented,
            Code::Internal,
            Code::Unknown,
            Code::Cancelled,
            Code::OutOfRange,
            Code::DataLoss,
        ] {
            assert_eq!(class(c, &[]), "fatal", "{c:?}");
        }
        assert_eq!(class(Code::Internal, &[Code::Internal]), "retry");
    }

    #[test]
    fn pushback_is_a_wait_or_a_refusal() {
        let with = |v: &str| {
            let mut s = Status::new(Code::Unavailable, "busy");
            s.metadata_mut()
                .insert(PUSHBACK, v.parse().expect("ascii value"));
            classify("e", &s, &[])
        };
        match with("250") {
            EffectError::Retryable { retry_after, .. } => {
                assert_eq!(retry_after, Some(Duration::from_millis(250)))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(with("-1"), EffectError::Fatal { .. }));
        assert!(matches!(with("soon"), EffectError::Fatal { .. }));
        let payload = with("5").to_payload();
        assert_eq!(payload["code"], 14);
        assert_eq!(payload["status"], "UNAVAILABLE");
        assert_eq!(payload["message"], "busy");
    }
}
