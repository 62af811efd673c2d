//! Sage's retry backoff, made deterministic.
//!
//! Interpretation of `min(max_backoff, (base_backoff * 2) ^ attempt)`: `attempt` counts
//! retries from 1 (the first retry waits `(2·base)^1`), `^` is exponentiation, all values
//! are milliseconds, and the power saturates instead of overflowing. So base 10 ms, max
//! 30 000 ms gives 20, 400, 8 000, 30 000, 30 000 for attempts 1–5. Without `base_backoff`
//! there is no wait. With `enable_jitter` the wait is drawn from `[0, backoff]` — not by a
//! random generator but from a SHA-256 of the instance (tenant, saga, correlation id), the
//! step and the attempt, so replaying the same input schedules the same retry.

use super::ids::hash64;
use crate::manifest::model::RetryPolicy;

/// The backoff before retry `attempt` (1-based), without jitter.
pub fn backoff_ms(policy: &RetryPolicy, attempt: u32) -> u64 {
    let Some(base) = policy.base_backoff else {
        return 0;
    };
    let doubled = base.saturating_mul(2);
    let raw = doubled.checked_pow(attempt).unwrap_or(u64::MAX);
    raw.min(policy.max_backoff)
}

/// Identifies what is being retried, for deterministic jitter.
#[derive(Debug, Clone, Copy)]
pub struct JitterKey<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Saga name.
    pub saga: &'a str,
    /// Correlation id.
    pub correlation_id: &'a str,
    /// Step (or compensation) being retried.
    pub step: &'a str,
}

/// The wait before retry `attempt`: [`backoff_ms`], or with jitter a deterministic value in
/// `[0, backoff_ms]`.
pub fn delay_ms(policy: &RetryPolicy, attempt: u32, key: &JitterKey<'_>) -> u64 {
    let max = backoff_ms(policy, attempt);
    if !policy.enable_jitter || max == 0 {
        return max;
    }
    let h = hash64(&[
        key.tenant.as_bytes(),
        key.saga.as_bytes(),
        key.correlation_id.as_bytes(),
        key.step.as_bytes(),
        &attempt.to_be_bytes(),
    ]);
    match max.checked_add(1) {
        Some(m) => h % m,
        None => h,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(jitter: bool) -> RetryPolicy {
        RetryPolicy {
            retry_limit: 5,
            base_backoff: Some(10),
            max_backoff: 30_000,
            enable_jitter: jitter,
        }
    }

    #[test]
    fn sage_table() {
        let got: Vec<u64> = (1..=5).map(|a| backoff_ms(&policy(false), a)).collect();
        assert_eq!(got, vec![20, 400, 8_000, 30_000, 30_000]);
    }

    #[test]
    fn no_base_means_no_wait_and_huge_attempts_saturate() {
        let p = RetryPolicy {
            base_backoff: None,
            ..policy(false)
        };
        assert_eq!(backoff_ms(&p, 3), 0);
        assert_eq!(backoff_ms(&policy(false), 1_000), 30_000);
    }

    #[test]
    fn jitter_is_bounded_and_deterministic() {
        let key = JitterKey {
            tenant: "t",
            saga: "s",
            correlation_id: "c",
            step: "x",
        };
        for attempt in 1..=5 {
            let a = delay_ms(&policy(true), attempt, &key);
            assert!(a <= backoff_ms(&policy(true), attempt));
            assert_eq!(a, delay_ms(&policy(true), attempt, &key));
        }
        assert_eq!(delay_ms(&policy(false), 2, &key), 400);
    }
}
