//! Reading the dead-letter stream (`streams.dead_letter`, `tenant.<t>.deadletter.<kind>`)
//! for operators: the letters stages publish there instead of keeping them in a node's
//! store — above all effect commands an effect worker refused — newest first.
//!
//! Guarantees: a listing reads at most [`SCAN_FACTOR`] × `limit` messages back from the end
//! of the stream, whatever its size, and a tenant's listing returns only messages on that
//! tenant's subjects. [`redrive`] puts a refused effect command back on its subject once:
//! the command is published with a message id derived from the letter (so a second redrive
//! of the same letter inside the duplicate window is dropped by JetStream) and the letter is
//! then deleted from the stream (so after it a second redrive finds nothing). Only the
//! letter's own tenant can redrive it, and only a letter that holds the whole command; the
//! tenant and the subject the command goes back to pass the one subject check
//! ([`crate::subject::check`]) first.

use async_nats::jetstream;
use serde::Serialize;
use serde_json::Value as Json;

use super::BrokerError;
use super::headers;

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

/// What [`redrive`] did.
#[derive(Debug, Clone, Serialize)]
pub struct Redriven {
    /// The letter's sequence in the dead-letter stream (now deleted).
    pub seq: u64,
    /// The subject the command went back to.
    pub subject: String,
    /// Its sequence in the commands stream.
    pub published_seq: u64,
    /// JetStream had it already (an earlier redrive of the same letter).
    pub duplicate: bool,
}

/// Why a stream letter was not redriven.
#[derive(Debug, thiserror::Error)]
pub enum RedriveError {
    /// No letter of this tenant at that sequence (never, deleted, or redriven already).
    #[error("no dead letter of tenant `{tenant}` at sequence {seq} of the dead-letter stream")]
    NotFound {
        /// Tenant.
        tenant: String,
        /// Sequence.
        seq: u64,
    },
    /// The letter is not a refused effect command (saga-side letters live in a node's
    /// store and are redriven there, by id).
    #[error("letter {seq} is not a refused effect command: {why}")]
    NotACommand {
        /// Sequence.
        seq: u64,
        /// What it is instead.
        why: String,
    },
    /// The letter holds only an excerpt of the command.
    #[error(
        "letter {seq} keeps only an excerpt of its {bytes}-byte command (from {origin}); \
         republish the command from its source instead"
    )]
    Excerpt {
        /// Sequence.
        seq: u64,
        /// The command's size.
        bytes: u64,
        /// Where it came from.
        origin: String,
    },
    /// The tenant cannot be a tenant token.
    #[error("`tenant` must be a name: {0}")]
    BadTenant(#[from] crate::subject::SubjectError),
    /// JetStream failed.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// Republishes the effect command kept in letter `seq` of `stream` (tenant `tenant`'s) to
/// its original subject, then deletes the letter.
pub async fn redrive(
    js: &jetstream::Context,
    stream: &str,
    tenant: &str,
    seq: u64,
) -> Result<Redriven, RedriveError> {
    let err = |op: &'static str, e: &dyn std::fmt::Display| BrokerError::JetStream {
        op,
        stream: stream.to_string(),
        reason: e.to_string(),
    };
    // The tenant and the letter's subject are checked with the one subject check before
    // either reaches the broker (`crate::subject`).
    crate::subject::check(tenant, crate::subject::Rule::TENANT)?;
    let not_found = || RedriveError::NotFound {
        tenant: tenant.to_string(),
        seq,
    };
    let s = js
        .get_stream(stream)
        .await
        .map_err(|e| err("stream info", &e))?;
    let m = s.get_raw_message(seq).await.map_err(|_| not_found())?;
    if !m
        .subject
        .as_str()
        .starts_with(&format!("tenant.{tenant}.deadletter."))
    {
        return Err(not_found());
    }
    let letter: Json =
        serde_json::from_slice(&m.payload).map_err(|e| RedriveError::NotACommand {
            seq,
            why: format!("its body is not a letter: {e}"),
        })?;
    let not_command = |why: &str| RedriveError::NotACommand {
        seq,
        why: why.to_string(),
    };
    if letter.get("id").is_some() {
        return Err(not_command(
            "it announces a saga-side dead letter; redrive that on its node by id",
        ));
    }
    let subject = letter["subject"].as_str().unwrap_or_default();
    if !subject.starts_with(&format!("tenant.{tenant}.effect.")) {
        return Err(not_command(&format!(
            "its subject {subject:?} is not one of this tenant's effect commands"
        )));
    }
    if let Err(e) = crate::subject::check(subject, crate::subject::Rule::PUBLISH) {
        return Err(not_command(&format!("its {e}")));
    }
    if let Some(bytes) = letter["body_bytes"].as_u64() {
        return Err(RedriveError::Excerpt {
            seq,
            bytes,
            origin: letter["source"].as_str().unwrap_or("?").to_string(),
        });
    }
    let Some(body) = letter["body"].as_str() else {
        return Err(not_command("it keeps no command body"));
    };
    if body.contains('\u{FFFD}') {
        return Err(not_command(
            "its command was not UTF-8 text and is kept only approximately",
        ));
    }
    let traceparent = headers::traceparent(Some(&m.headers));
    let msg_id = format!("redrive:{stream}:{seq}");
    let h = headers::outgoing(&msg_id, Some(tenant), traceparent.as_deref());
    let ack = js
        .publish_with_headers(subject.to_string(), h, body.to_string().into())
        .await
        .map_err(|e| err("publish", &e))?
        .await
        .map_err(|e| err("publish", &e))?;
    s.delete_message(seq)
        .await
        .map_err(|e| err("delete message", &e))?;
    Ok(Redriven {
        seq,
        subject: subject.to_string(),
        published_seq: ack.sequence,
        duplicate: ack.duplicate,
    })
}
