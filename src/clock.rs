//! The wall clock, read in one place.
//!
//! Runner reads wall time for bookkeeping (lease expiries in effect claims, dedupe and
//! dead-letter timestamps, deciding which timers are due) and to stamp the effect result
//! events it creates (their `timestamp_ms`, which becomes the time of the saga step that
//! consumes them). The saga engine itself never reads it: a saga's time is its input's
//! `timestamp_ms`, so replaying a stored input gives the same result whatever this clock
//! says.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch by the wall clock (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
