//! Reading the dead-letter stream (`streams.dead_letter`, `tenant.<t>.deadletter.<kind>`)
//! for operators: the letters stages publish there instead of keeping them in a node's
//! store — above all effect commands an effect worker refused — newest first.
//!
//! Guarantee: a listing reads at most [`SCAN_FACTOR`] × `limit` messages back from the end
//! of the stream, whatever its size, and a tenant's listing returns only messages on that
//! tenant's subjects.

use async_nats::jetstream;
use serde::Serialize;
use serde_json::Value as Json;

use super::BrokerError;

/// How many messages a listing may read per letter it returns.
pub const SCAN_FACTOR: usize = 20;

/// One message of the dead-letter stream.
#[derive(Debug, Clone, Serialize)]
pub struct StreamLetter {
    /// Its sequence in the stream.
    pub seq: u64,
    /// Its subject (`tenant.<t>.deadletter.<kind>`).
    pub subject: String,
    /// The letter (tenant, kind, reason, the refused message's subject and source, its
    /// body or an excerpt of it); a body that is not JSON is kept as text.
    pub letter: Json,
}

/// The newest letters of `stream`, of `tenant` when given, at most `limit`.
pub async fn recent(
    js: &jetstream::Context,
    stream: &str,
    tenant: Option<&str>,
    limit: usize,
) -> Result<Vec<StreamLetter>, BrokerError> {
    let err = |op: &'static str, e: &dyn std::fmt::Display| BrokerError::JetStream {
        op,
        stream: stream.to_string(),
        reason: e.to_string(),
    };
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| err("stream info", &e))?;
    let state = s
        .info()
        .await
        .map_err(|e| err("stream info", &e))?
        .state
        .clone();
    let prefix = tenant.map(|t| format!("tenant.{t}.deadletter."));
    let mut out = Vec::new();
    let mut seq = state.last_sequence;
    let mut read = 0usize;
    while seq >= state.first_sequence.max(1) && out.len() < limit && read < limit * SCAN_FACTOR {
        read += 1;
        if let Ok(m) = s.get_raw_message(seq).await {
            let subject = m.subject.to_string();
            if prefix.as_deref().is_none_or(|p| subject.starts_with(p)) {
                let letter = serde_json::from_slice(&m.payload).unwrap_or_else(|_| {
                    Json::String(String::from_utf8_lossy(&m.payload).into_owned())
                });
                out.push(StreamLetter {
                    seq,
                    subject,
                    letter,
                });
            }
        }
        seq -= 1;
    }
    Ok(out)
}
