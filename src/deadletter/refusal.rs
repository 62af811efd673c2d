//! A refusal and the letter kept for it: what was refused and why ([`Refused`]), and the
//! bounded dead letter it becomes, an excerpt of the body and a reason cut to a bounded
//! length, so a dead letter always fits in a message whatever the input was.

use super::{DeadLetter, DeadLetterStatus};

/// The most of an input's body a dead letter keeps. A dead letter must always fit in a
/// message (it goes out on the dead-letter stream like any output), whatever the input: it
/// keeps this excerpt plus the input's source stream and sequence, where the whole input
/// stays as long as the stream retains it. Escaped as JSON, an excerpt is at most six
/// times this size.
pub const EXCERPT_BYTES: usize = 4096;

/// The longest reason kept (reasons quote parts of the input, such as ids).
const REASON_BYTES: usize = 1024;

/// The excerpt of `body` a dead letter keeps, with the original size when it is cut.
pub fn excerpt(body: &[u8]) -> (String, Option<u64>) {
    if body.len() <= EXCERPT_BYTES {
        return (String::from_utf8_lossy(body).into_owned(), None);
    }
    let text = String::from_utf8_lossy(&body[..EXCERPT_BYTES]).into_owned();
    (text, Some(body.len() as u64))
}

/// `reason` cut to [`REASON_BYTES`] at a character boundary.
pub(super) fn bounded_reason(reason: &str) -> String {
    if reason.len() <= REASON_BYTES {
        return reason.to_string();
    }
    let mut end = REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &reason[..end])
}

/// The stored dead letter of a refusal (id assigned when pushed): bounded body and reason.
pub fn letter_of(p: Refused<'_>) -> DeadLetter {
    let (body, body_bytes) = excerpt(p.body);
    DeadLetter {
        id: 0,
        tenant: p.tenant.to_string(),
        kind: p.kind.to_string(),
        reason: bounded_reason(p.reason),
        subject: p.subject.to_string(),
        source: p.source.to_string(),
        body,
        body_bytes,
        traceparent: None,
        saga: None,
        correlation_id: None,
        attempts: 1,
        at_ms: p.at_ms,
        status: DeadLetterStatus::Pending,
        stored_ms: None,
        live_cap: None,
        timer_cap: None,
    }
}

/// An input that can never be processed (a saga input or an effect command): where it came
/// from, what it was, and why it was refused.
#[derive(Debug, Clone, Copy)]
pub struct Refused<'a> {
    /// Tenant (from the subject; when it has none, `_` on the saga side and the default
    /// tenant on the effect side).
    pub tenant: &'a str,
    /// Reason class, one of [`kind`](super::kind).
    pub kind: &'static str,
    /// What went wrong, for a person.
    pub reason: &'a str,
    /// The original subject.
    pub subject: &'a str,
    /// The input's `stream:seq` (or `timer`, or `redrive:<id>`).
    pub source: &'a str,
    /// The original body.
    pub body: &'a [u8],
    /// Wall-clock time of the refusal, ms since the epoch.
    pub at_ms: u64,
}
