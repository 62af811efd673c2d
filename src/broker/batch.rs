//! Atomic batch publishing (nats-server 2.12+, stream flag `allow_atomic`): every message of
//! a batch is stored, in order and with consecutive stream sequences, or none is.
//!
//! async-nats has no builder for it, so this file builds the headers itself: each message
//! carries `Nats-Batch-Id` and `Nats-Batch-Sequence` (1, 2, …); all but the last go out as
//! plain core publishes, and the last one also carries `Nats-Batch-Commit: 1` and is sent as
//! a request whose reply is the stream's answer for the whole batch.
//!
//! **Guarantees.**
//! - All or nothing, inside one stream: a refused message (a stale expected sequence on any
//!   of them, a gap, a duplicate `Nats-Msg-Id`) refuses the whole batch and stores nothing.
//! - Consecutive sequences: a stored batch of `n` messages occupies `last − n + 1 ..= last`,
//!   so the caller can tell the sequence of each message from the one answer
//!   ([`Stored::sequence_of`]).
//! - An answer is classified, never guessed: [`BatchError::WrongLastSequence`] (10071),
//!   [`BatchError::DuplicateId`] (10201 — the batch holds an id the stream already has;
//!   nothing of this batch was stored, but that does **not** prove an earlier copy of this
//!   batch was stored: the caller must find out from its own markers), [`BatchError::Refused`]
//!   (any other error code: too large, too many messages, no `allow_atomic`, …) and
//!   [`BatchError::Unknown`] (no answer: the batch may or may not be stored).
//!
//! Limits: at most [`MAX_MESSAGES`] messages per batch (the caller cuts); a batch not
//! committed within about 10 s is abandoned by the server; nats-server accepts 50 batches in
//! flight per stream, so [`publish`] lets at most [`MAX_IN_FLIGHT`] of this process's batches
//! be in flight at once (waiting for a slot otherwise): four replicas stay under the limit.

use std::time::Duration;

use async_nats::header::{
    NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE,
};
use async_nats::{Client, HeaderMap};
use bytes::Bytes;
use serde::Deserialize;

/// Most messages nats-server accepts in one atomic batch.
pub const MAX_MESSAGES: usize = 1000;

/// Most batches one process has in flight at once (nats-server takes 50 per stream).
pub const MAX_IN_FLIGHT: usize = 12;

/// The process's batch slots.
static SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_IN_FLIGHT);

/// JetStream error code: wrong last sequence (an expected-sequence header did not hold).
const WRONG_LAST_SEQUENCE: u64 = 10071;
/// JetStream error code: the atomic batch holds a message id the stream already has.
const DUPLICATE_ID: u64 = 10201;

/// One message of a batch.
#[derive(Debug, Clone)]
pub struct BatchMessage {
    /// Subject (captured by the batch's stream).
    pub subject: String,
    /// Headers of the caller (`Nats-Msg-Id`, expected sequences, …); the batch headers are
    /// added.
    pub headers: HeaderMap,
    /// Body.
    pub payload: Bytes,
}

/// A stored batch, as the stream answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// Stream sequence of the last message.
    pub last: u64,
    /// Messages stored.
    pub count: u64,
}

impl Stored {
    /// The stream sequence of the message at `index` (0-based) of the batch.
    pub fn sequence_of(&self, index: usize) -> u64 {
        self.last + 1 + index as u64 - self.count
    }
}

/// Why a batch was not (known to be) stored.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// 10071: an expected last (subject) sequence did not hold. Nothing was stored.
    #[error("batch refused, wrong last sequence: {0}")]
    WrongLastSequence(String),
    /// 10201: a message id of the batch is already in the stream's de-duplication window.
    /// Nothing of this batch was stored.
    #[error("batch refused, duplicate message id: {0}")]
    DuplicateId(String),
    /// Another refusal (code and description). Nothing was stored.
    #[error("batch refused ({code}): {description}")]
    Refused {
        /// JetStream error code.
        code: u64,
        /// The server's description.
        description: String,
    },
    /// No answer, or a failure before the commit was sent: the outcome is unknown.
    #[error("batch outcome unknown: {0}")]
    Unknown(String),
}

#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    error: Option<ApiError>,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    count: Option<u64>,
}

#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

/// Publishes `messages` (1 ..= [`MAX_MESSAGES`]) as one atomic batch named `batch_id`
/// (at most 64 characters, unique per publisher and attempt) and waits up to `timeout` for
/// the stream's answer.
pub async fn publish(
    client: &Client,
    batch_id: &str,
    messages: Vec<BatchMessage>,
    timeout: Duration,
) -> Result<Stored, BatchError> {
    let n = messages.len();
    if n == 0 || n > MAX_MESSAGES {
        return Err(BatchError::Refused {
            code: 0,
            description: format!("a batch holds 1 to {MAX_MESSAGES} messages, not {n}"),
        });
    }
    // The semaphore is never closed, so acquiring only waits.
    let _slot = SLOTS.acquire().await.ok();
    let mut reply = None;
    for (i, m) in messages.into_iter().enumerate() {
        let mut headers = m.headers;
        headers.insert(NATS_BATCH_ID, batch_id);
        headers.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
        if i + 1 < n {
            client
                .publish_with_headers(m.subject, headers, m.payload)
                .await
                .map_err(|e| BatchError::Unknown(format!("send: {e}")))?;
        } else {
            headers.insert(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL);
            let request = async_nats::Request::new()
                .headers(headers)
                .payload(m.payload)
                .timeout(Some(timeout));
            reply = Some(
                client
                    .send_request(m.subject, request)
                    .await
                    .map_err(|e| BatchError::Unknown(format!("commit: {e}")))?,
            );
        }
    }
    let reply = reply.ok_or_else(|| BatchError::Unknown("no commit sent".into()))?;
    let answer: Answer = serde_json::from_slice(&reply.payload)
        .map_err(|e| BatchError::Unknown(format!("unreadable answer: {e}")))?;
    match answer.error {
        None => Ok(Stored {
            last: answer.seq,
            count: answer.count.unwrap_or(n as u64),
        }),
        Some(e) if e.err_code == WRONG_LAST_SEQUENCE => {
            Err(BatchError::WrongLastSequence(e.description))
        }
        Some(e) if e.err_code == DUPLICATE_ID => Err(BatchError::DuplicateId(e.description)),
        Some(e) => Err(BatchError::Refused {
            code: e.err_code,
            description: e.description,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_are_consecutive_and_end_at_last() {
        let s = Stored { last: 7, count: 5 };
        assert_eq!(s.sequence_of(0), 3);
        assert_eq!(s.sequence_of(2), 5);
        assert_eq!(s.sequence_of(4), 7);
    }

    #[test]
    fn answers_are_classified() {
        let a: Answer = serde_json::from_str(
            r#"{"error":{"code":400,"err_code":10201,"description":"dup"},"stream":"S","seq":0}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.error.map(|e| e.err_code), Some(DUPLICATE_ID));
        let a: Answer = serde_json::from_str(r#"{"stream":"S","seq":7,"batch":"b1","count":5}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(a.error.is_none());
        assert_eq!((a.seq, a.count), (7, Some(5)));
    }
}
