//! Naming leader elections in the relay's log (issue 14 finding 19).
//!
//! While a cluster elects a stream leader, a publish is answered by nobody, and the client
//! reports that as "no stream found for given subject" (or a 503, or a timeout) although
//! the stream exists. Those are one condition, not many failures: [`publish_failed`] tells
//! them apart from other errors and logs them as a leader election, at most one line per
//! [`ELECTION_LOG_EVERY`] with the number of failures since the last line. Other errors are
//! logged as they come. Logging only; what the relay does next (retry from the acknowledged
//! prefix) does not depend on it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Least time between two election log lines.
pub(crate) const ELECTION_LOG_EVERY: Duration = Duration::from_secs(5);

/// When the last election line was written, and failures since.
static LAST: Mutex<Option<(Instant, u64)>> = Mutex::new(None);

/// Whether a publish error looks like a stream without a leader for the moment (no
/// responders, "no stream found", 503, a timeout) rather than a refusal.
pub(crate) fn is_election(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    [
        "no stream found",
        "no responders",
        "503",
        "timed out",
        "timeout",
        "leader",
    ]
    .iter()
    .any(|needle| e.contains(needle))
}

/// Logs a failed publish (`what` says which step): elections rate-limited as one
/// condition, anything else as a warning each time.
pub(crate) fn publish_failed(what: &'static str, error: &dyn std::fmt::Display) {
    let text = error.to_string();
    if !is_election(&text) {
        tracing::warn!(message = "Publish failed; retrying.", step = what, error = %text);
        return;
    }
    let mut last = match LAST.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    let now = Instant::now();
    match last.as_mut() {
        Some((at, n)) if now.duration_since(*at) < ELECTION_LOG_EVERY => *n += 1,
        _ => {
            let suppressed = last.map_or(0, |(_, n)| n);
            tracing::warn!(
                message = "Publish not answered: the stream is electing a leader (it exists); retrying.",
                step = what,
                error = %text,
                similar_since_last_line = suppressed,
            );
            *last = Some((now, 0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elections_are_told_apart() {
        assert!(is_election("no stream found for given subject"));
        assert!(is_election("timed out: didn't receive ack in time"));
        assert!(is_election("JetStream error: 503 no responders"));
        assert!(!is_election("wrong last sequence: 5"));
        assert!(!is_election("maximum payload exceeded"));
    }
}
