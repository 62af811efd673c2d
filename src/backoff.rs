//! One doubling backoff for every retry loop that waits on infrastructure (NATS reconnects,
//! consumer re-creation, relay publishes, claim bookkeeping).
//!
//! [`Backoff::next_wait`] returns the wait before the next try and doubles the following one, up
//! to `max`; [`Backoff::reset`] goes back to `initial` after a success. With jitter the
//! wait is drawn from `[wait/2, wait]`, so replicas that failed together do not retry in
//! lock-step. The waits are never longer than without jitter.
//!
//! This is not the retry policy of effects (that one is data from the manifest, deterministic
//! per command: see [`crate::saga::retry`]).

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// A capped doubling wait.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
    jitter: bool,
}

impl Backoff {
    /// Starts at `initial`, doubling up to `max`, without jitter.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            current: initial,
            jitter: false,
        }
    }

    /// The same, with each wait drawn from `[wait/2, wait]`.
    pub fn with_jitter(mut self) -> Self {
        self.jitter = true;
        self
    }

    /// The wait before the next try; the one after it doubles (up to `max`).
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.current;
        self.current = (self.current * 2).min(self.max);
        if self.jitter {
            let half = wait / 2;
            let span = (wait - half).as_nanos() as u64;
            let r = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            half + Duration::from_nanos(if span == 0 { 0 } else { r % (span + 1) })
        } else {
            wait
        }
    }

    /// The wait [`next_wait`](Self::next_wait) would return next, without jitter.
    pub fn peek(&self) -> Duration {
        self.current
    }

    /// Back to `initial`, after a success.
    pub fn reset(&mut self) {
        self.current = self.initial;
    }

    /// Sleeps [`next_wait`](Self::next_wait), or returns false at once when `cancel` fires first.
    pub async fn sleep(&mut self, cancel: &tokio_util::sync::CancellationToken) -> bool {
        let wait = self.next_wait();
        tokio::select! {
            _ = cancel.cancelled() => false,
            _ = tokio::time::sleep(wait) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let waits: Vec<u128> = (0..5).map(|_| b.next_wait().as_millis()).collect();
        assert_eq!(waits, vec![100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_wait(), Duration::from_millis(100));
    }

    #[test]
    fn jitter_stays_within_half_and_full() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).with_jitter();
        for _ in 0..200 {
            let expected = b.peek();
            let got = b.next_wait();
            assert!(
                got >= expected / 2 && got <= expected,
                "{got:?} vs {expected:?}"
            );
            if b.peek() == Duration::from_secs(1) {
                b.reset();
            }
        }
    }
}
