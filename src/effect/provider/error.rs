//! How an effect attempt can fail, in words every provider shares.
//!
//! Owns [`EffectError`] and its classification, which the attempt loop acts on:
//! `Retryable` (transient upstream trouble; may carry the upstream's `Retry-After`) and
//! `TimedOut` are tried again within the command's retry policy and count against the
//! upstream's circuit breaker; `Fatal` ends the command at once; `CircuitOpen` means no call
//! went out. Each provider file maps its own failures onto these variants and nothing else,
//! so one retry policy covers them all. Also owns [`SettingsError`], the one error a
//! provider's settings can raise when they are compiled.
//!
//! Guarantee: a failure's payload ([`EffectError::to_payload`]) holds only what the provider
//! put in `reason` and `details`; providers keep URLs, headers and secrets out of both.

use std::time::Duration;

use serde_json::{Value as Json, json};

/// Why one attempt failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EffectError {
    /// Worth retrying (transient upstream trouble).
    #[error("retryable: {reason}")]
    Retryable {
        /// What went wrong.
        reason: String,
        /// Upstream's `Retry-After`, when it sent one.
        retry_after: Option<Duration>,
        /// Details for the result payload (status, body).
        details: Json,
    },
    /// Retrying cannot help.
    #[error("fatal: {reason}")]
    Fatal {
        /// What went wrong.
        reason: String,
        /// Details for the result payload (status, body).
        details: Json,
    },
    /// The attempt outlasted its timeout.
    #[error("timed out after {0:?}")]
    TimedOut(Duration),
    /// The upstream itself answered that a deadline passed (gRPC `DEADLINE_EXCEEDED`
    /// before ours): a timeout for the command, in the upstream's words.
    #[error("timed out upstream: {reason}")]
    UpstreamTimedOut {
        /// What the upstream said.
        reason: String,
        /// Details for the result payload (status, message).
        details: Json,
    },
    /// The circuit breaker of the upstream is open: no call was made.
    #[error("circuit open for {0}")]
    CircuitOpen(String),
}

impl EffectError {
    /// Whether another attempt may succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, EffectError::Fatal { .. })
    }

    /// Whether this failure says something about the upstream's health.
    pub fn counts_for_breaker(&self) -> bool {
        matches!(self, EffectError::Retryable { .. }) || self.is_timeout()
    }

    /// Whether the command timed out (ours or the upstream's deadline): a `TimedOut` result
    /// once retries are spent.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            EffectError::TimedOut(_) | EffectError::UpstreamTimedOut { .. }
        )
    }

    /// The result payload describing this failure.
    pub fn to_payload(&self) -> Json {
        let mut p = match self {
            EffectError::Retryable { details, .. }
            | EffectError::Fatal { details, .. }
            | EffectError::UpstreamTimedOut { details, .. } => details.clone(),
            _ => json!({}),
        };
        if let Json::Object(m) = &mut p {
            m.insert("error".into(), Json::String(self.to_string()));
        } else {
            p = json!({ "error": self.to_string() });
        }
        p
    }
}

/// Marks an error retryable or fatal in one word.
pub trait ToEffectResult<T> {
    /// Maps the error to [`EffectError::Retryable`].
    fn retryable(self) -> Result<T, EffectError>;
    /// Maps the error to [`EffectError::Fatal`].
    fn fatal(self) -> Result<T, EffectError>;
}

impl<T, E: std::fmt::Display> ToEffectResult<T> for Result<T, E> {
    fn retryable(self) -> Result<T, EffectError> {
        self.map_err(|e| EffectError::Retryable {
            reason: e.to_string(),
            retry_after: None,
            details: json!({}),
        })
    }
    fn fatal(self) -> Result<T, EffectError> {
        self.map_err(|e| EffectError::Fatal {
            reason: e.to_string(),
            details: json!({}),
        })
    }
}

/// A provider's settings could not be understood.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("effect `{effect}`: setting `{setting}`: {message}")]
pub struct SettingsError {
    /// Effect name.
    pub effect: String,
    /// The setting.
    pub setting: String,
    /// What is wrong.
    pub message: String,
}
