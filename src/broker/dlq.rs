//! Reading the dead-letter stream (`streams.dead_letter`, `tenant.<t>.deadletter.<kind>`)
//! for operators: the letters stages publish there instead of keeping them in a node's
//! store — above all effect commands an effect worker refused — newest first.
//!
//! Guarantees: a listing reads at most [`SCAN_FACTOR`] × `limit` messages and
//! [`SCAN_BYTES`] of payload back from the end of the stream (or from its `after`), whatever
//! the stream's size, answers at most [`crate::deadletter::ANSWER_BYTES`] with each letter
//! cut for showing ([`StreamLetter`]), and gives `next` when older letters remain; a
//! tenant's listing returns only messages on that tenant's subjects. [`redrive`] puts a
//! refused effect command back on its subject once: the command is published with a message
//! id derived from the letter (so a second redrive of the same letter inside the duplicate
//! window is dropped by JetStream) and the letter is then deleted from the stream (so after
//! it a second redrive finds nothing). Only the letter's own tenant can redrive it, and only
//! a letter that holds the whole command; the tenant and the subject the command goes back
//! to pass the one subject check ([`crate::subject::check`]) first.

use async_nats::jetstream;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use super::BrokerError;
use super::headers;

/// How many messages a listing may read per letter it returns.
pub const SCAN_FACTOR: usize = 20;

/// The most payload bytes one page reads from the stream (checked before each message: one
/// message, at most the server's `max_payload`, may pass it).
pub const SCAN_BYTES: usize = crate::deadletter::SCAN_BYTES;

/// The largest payload parsed as JSON to show its fields; a larger one (no letter Runner
/// writes comes near it) is shown as a text excerpt.
const PARSE_BYTES: usize = 256 << 10;

/// The fields of a letter (saga-side announcement or refused effect command) a listing shows.
const LETTER_FIELDS: [&str; 12] = [
    "v",
    "id",
    "tenant_id",
    "kind",
    "reason",
    "subject",
    "source",
    "saga",
    "correlation_id",
    "body",
    "body_bytes",
    "at_ms",
];

/// One message of the dead-letter stream, as a listing shows it.
#[derive(Debug, Clone, Serialize)]
pub struct StreamLetter {
    /// Its sequence in the stream.
    pub seq: u64,
    /// Its subject (`tenant.<t>.deadletter.<kind>`).
    pub subject: String,
    /// The size of its payload.
    pub bytes: u64,
    /// The letter (tenant, kind, reason, the refused message's subject and source, its
    /// body or an excerpt of it), cut for showing: its body to
    /// [`crate::deadletter::SHOWN_BODY_BYTES`], its other fields to
    /// [`crate::deadletter::SHOWN_FIELD_BYTES`], fields a letter does not have left out; a
    /// payload that is not a JSON object is shown as text, its first
    /// [`crate::deadletter::SHOWN_BODY_BYTES`].
    pub letter: Json,
    /// Set when `letter` shows less than the message holds.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cut: bool,
}

/// `v` shown in at most `max` bytes of text; whether it was cut.
fn shown_value(v: Json, max: usize) -> (Json, bool) {
    use crate::deadletter::cut_text;
    match v {
        Json::String(mut s) => {
            let cut = cut_text(&mut s, max);
            (Json::String(s), cut)
        }
        v @ (Json::Null | Json::Bool(_) | Json::Number(_)) => (v, false),
        other => {
            let mut text = other.to_string();
            if cut_text(&mut text, max) {
                (Json::String(text), true)
            } else {
                (other, false)
            }
        }
    }
}

/// The fields of a letter, read from a payload too large to parse into a tree: text and
/// numbers only (a payload whose fields have other types is shown as text).
#[derive(Deserialize, Serialize)]
struct LetterFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    v: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tenant_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    subject: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    saga: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    correlation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    at_ms: Option<u64>,
}

impl StreamLetter {
    /// The message at `seq` on `subject` with `payload`, cut for showing.
    pub fn of(seq: u64, subject: String, payload: &[u8]) -> Self {
        use crate::deadletter::{SHOWN_BODY_BYTES, SHOWN_FIELD_BYTES, cut_text};
        let shown = if payload.len() <= PARSE_BYTES {
            match serde_json::from_slice::<Json>(payload) {
                Ok(Json::Object(map)) => {
                    let mut shown = serde_json::Map::new();
                    let mut cut = false;
                    for (k, v) in map {
                        if !LETTER_FIELDS.contains(&k.as_str()) {
                            cut = true;
                            continue;
                        }
                        let max = if k == "body" {
                            SHOWN_BODY_BYTES
                        } else {
                            SHOWN_FIELD_BYTES
                        };
                        let (v, c) = shown_value(v, max);
                        cut |= c;
                        shown.insert(k, v);
                    }
                    Some((Json::Object(shown), cut))
                }
                _ => None,
            }
        } else {
            // Larger than any letter Runner writes: read its fields without building a
            // tree of it (it cannot be shown whole, so it is cut whatever it holds).
            serde_json::from_slice::<LetterFields>(payload)
                .ok()
                .map(|mut f| {
                    f.body
                        .iter_mut()
                        .for_each(|b| _ = cut_text(b, SHOWN_BODY_BYTES));
                    for t in [
                        &mut f.tenant_id,
                        &mut f.kind,
                        &mut f.reason,
                        &mut f.subject,
                        &mut f.source,
                        &mut f.saga,
                        &mut f.correlation_id,
                    ]
                    .into_iter()
                    .flatten()
                    {
                        cut_text(t, SHOWN_FIELD_BYTES);
                    }
                    (serde_json::to_value(f).unwrap_or(Json::Null), true)
                })
        };
        let (letter, cut) = shown.unwrap_or_else(|| {
            let head = &payload[..payload.len().min(SHOWN_BODY_BYTES)];
            let mut text = String::from_utf8_lossy(head).into_owned();
            cut_text(&mut text, SHOWN_BODY_BYTES);
            (Json::String(text), payload.len() > SHOWN_BODY_BYTES)
        });
        Self {
            seq,
            subject,
            bytes: payload.len() as u64,
            letter,
            cut,
        }
    }
}

/// One page of the dead-letter stream, newest first.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StreamPage {
    /// The stream's name.
    pub stream: String,
    /// The letters.
    pub items: Vec<StreamLetter>,
    /// Pass as `after` for the next (older) page; absent on the last one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// Messages this page read, of the tenant or not.
    pub scanned: usize,
    /// Their payload bytes.
    pub scanned_bytes: u64,
    /// Why the page holds fewer than `limit` items though more may follow: `answer_bytes`
    /// or `scan_limit` (as [`crate::deadletter::stopped`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<&'static str>,
}

/// Whether `s` can be the `after` of a stream listing (a `next` it gave).
pub fn parse_after(s: &str) -> Option<u64> {
    s.parse().ok()
}

/// One page of `stream`'s letters, of `tenant` when given, newest first, older than the
/// sequence `after` when given (a page's `next`), at most `limit` of them. Reads at most
/// [`SCAN_FACTOR`] × `limit` messages and [`SCAN_BYTES`] of payload; each letter is cut for
/// showing ([`StreamLetter`]) and the items stop before they pass
/// [`crate::deadletter::ITEMS_BYTES`] serialized.
pub async fn recent(
    js: &jetstream::Context,
    stream: &str,
    tenant: Option<&str>,
    after: Option<u64>,
    limit: usize,
) -> Result<StreamPage, BrokerError> {
    use crate::deadletter::{ITEMS_BYTES, stopped};
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
    let first = state.first_sequence.max(1);
    let mut seq = match after {
        Some(a) => a.saturating_sub(1).min(state.last_sequence),
        None => state.last_sequence,
    };
    let max_read = limit.saturating_mul(SCAN_FACTOR);
    let mut page = StreamPage {
        stream: stream.to_string(),
        ..StreamPage::default()
    };
    let mut bytes = 0usize;
    let mut last = None;
    while seq >= first {
        if page.items.len() == limit {
            break;
        }
        if page.scanned == max_read || page.scanned_bytes >= SCAN_BYTES as u64 {
            page.stopped_at = Some(stopped::SCAN_LIMIT);
            break;
        }
        if let Ok(m) = s.get_raw_message(seq).await {
            let subject = m.subject.to_string();
            if prefix.as_deref().is_none_or(|p| subject.starts_with(p)) {
                let item = StreamLetter::of(seq, subject, &m.payload);
                let size = serde_json::to_vec(&item).map_or(0, |v| v.len()) + 1;
                if !page.items.is_empty() && bytes + size > ITEMS_BYTES {
                    page.stopped_at = Some(stopped::ANSWER_BYTES);
                    break;
                }
                bytes += size;
                page.items.push(item);
            }
            page.scanned_bytes += m.payload.len() as u64;
        }
        page.scanned += 1;
        last = Some(seq);
        seq -= 1;
    }
    if seq >= first {
        page.next = last.map(|l| l.to_string());
    } else {
        page.stopped_at = None;
    }
    Ok(page)
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
