//! Dead letters: every input Runner cannot process, kept with its reason until an operator
//! acts on it. This file owns the reason kinds, the recording of saga-side dead letters,
//! the message published for each one on the dead-letter stream (saga and effect side
//! alike), and listing, showing and redriving them.
//!
//! Guarantees:
//! - **Nothing is dropped silently.** A saga-side dead letter is written in the same write
//!   transaction as the batch that met it, with the original subject, body, trace context,
//!   source (`stream:seq`) and a reason for a person; the same transaction queues its
//!   message for the dead-letter stream (`tenant.<t>.deadletter.<kind>`) through the outbox.
//!   An effect command that can never run is published there too before it is terminated.
//! - **Order per key survives poison.** When the saga instance is known, the first dead
//!   letter parks its key: later inputs for the key are held as dead letters of kind
//!   [`kind::PARKED`], in arrival order, while every other key keeps flowing.
//! - **A redrive replays a key once, in order.** [`redrive`] runs in one write transaction:
//!   it unparks the key, re-applies the dead-lettered input and then every input held behind
//!   it, oldest first, and marks each entry redriven, so no entry is processed twice. If an
//!   input fails again it is dead-lettered anew and the rest of the key is held again behind
//!   it. A held entry cannot be redriven ahead of the entry that parked its key.
//! - **A listing costs its page.** [`page`] reads the stored letters in key order from a
//!   cursor, at most `limit` + 1 of them and never more than [`SCAN_ENTRIES`] letters or
//!   [`SCAN_BYTES`] bytes, applying its filters as it reads; it shows each letter cut
//!   ([`Listed`]: a body of at most [`SHOWN_BODY_BYTES`]) and stops before its answer passes
//!   [`ANSWER_BYTES`], answering `next` whenever more may follow.

use libmdbx::RW;
use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};

use crate::saga::Route;
use crate::storage::tables::OutboxRecord;
use crate::storage::{StorageError, Store, Tables};

pub use crate::storage::tables::{DeadLetter, DeadLetterStatus};

/// Dead-letter reason classes (bounded: they label a metric).
pub mod kind {
    /// Body is not JSON, or lacks the envelope fields.
    pub const UNDECODABLE: &str = "undecodable";
    /// Subject tenant and body tenant differ.
    pub const TENANT_MISMATCH: &str = "tenant_mismatch";
    /// Tenant not in `tenancy.allowed`.
    pub const UNKNOWN_TENANT: &str = "unknown_tenant";
    /// Body larger than `saga.max_message_bytes`, or a tenant, correlation id or event id
    /// longer than the key limits.
    pub const TOO_LARGE: &str = "too_large";
    /// An expression failed (guard, correlation, template) or the engine refused the input.
    pub const EXPRESSION: &str = "expression";
    /// The instance's saga version is no longer loaded.
    pub const VERSION_NOT_LOADED: &str = "version_not_loaded";
    /// Held behind an earlier dead letter of the same key.
    pub const PARKED: &str = "parked";
    /// The engine panicked on this input (a bug; the input is kept for a redrive).
    pub const ENGINE_PANIC: &str = "engine_panic";
    /// An effect result that answers no command the instance issued and waits for (forged,
    /// another instance's, or a second answer), or an event of an orchestration step's
    /// result types without `metadata.correlation_id` (it answers no command of any
    /// instance). Its key is not parked.
    pub const UNANSWERED_RESULT: &str = "unanswered_result";

    /// An effect command delivered `effect.max_deliver` times without completing.
    pub const REDELIVERY_LIMIT: &str = "redelivery_limit";
    /// An output in the outbox the broker can never take (larger than its `max_payload`):
    /// the relay parked it and went on.
    pub const UNPUBLISHABLE: &str = "unpublishable";

    /// An input whose event id was already applied to another instance of the saga (a
    /// producer reused it): not a redelivery, so not dropped as one. Its key is not parked.
    pub const DUPLICATE_EVENT_ID: &str = "duplicate_event_id";

    /// An input of a paused tenant, held whole until the tenant is resumed
    /// (`worker/pause.rs`). Not a failure: it is neither announced on the dead-letter
    /// stream nor counted as a dead letter.
    pub const TENANT_PAUSED: &str = "tenant_paused";

    /// Every kind counted as a dead letter, so their metric series exist (at 0) from the
    /// start.
    pub const ALL: [&str; 12] = [
        UNDECODABLE,
        TENANT_MISMATCH,
        UNKNOWN_TENANT,
        TOO_LARGE,
        EXPRESSION,
        VERSION_NOT_LOADED,
        PARKED,
        ENGINE_PANIC,
        UNANSWERED_RESULT,
        REDELIVERY_LIMIT,
        UNPUBLISHABLE,
        DUPLICATE_EVENT_ID,
    ];
}

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
fn bounded_reason(reason: &str) -> String {
    if reason.len() <= REASON_BYTES {
        return reason.to_string();
    }
    let mut end = REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &reason[..end])
}

/// An input that cannot be processed, as the saga worker met it: what was refused and why,
/// plus what only a saga input has.
#[derive(Debug, Clone, Copy)]
pub struct Poison<'a> {
    /// The input, its tenant (`_` when none could be read) and the reason.
    pub refused: Refused<'a>,
    /// The original `traceparent`.
    pub traceparent: Option<&'a str>,
    /// The saga instance it concerns, when known: its key is parked.
    pub route: Option<&'a Route>,
    /// Outbox partition and cause of its message (see [`OutboxRecord::cause`]).
    pub outbox: (u16, (u64, u32)),
    /// When the broker stored the input, when known: kept, so a redrive applies the input
    /// within the same time bound ([`DeadLetter::stored_ms`]).
    pub stored_ms: Option<u64>,
}

/// Records a saga-side dead letter in `tx`: stores the entry, parks its key when the
/// instance is known and not parked yet, and queues its message for the dead-letter stream
/// in the outbox. Returns that message's outbox sequence. Nothing is durable until the
/// caller commits `tx`.
pub fn record(tx: &Tables<'_, RW>, poison: Poison<'_>) -> Result<u64, StorageError> {
    let record = store(tx, poison)?;
    tx.push_outbox(poison.outbox.0, &record)
}

/// Stores a saga-side dead letter in `tx` and parks its key (as [`record`] does) and
/// returns the outbox record of its message, for the caller to place in the outbox.
pub fn store(tx: &Tables<'_, RW>, poison: Poison<'_>) -> Result<OutboxRecord, StorageError> {
    let p = poison.refused;
    let mut letter = letter_of(p);
    letter.traceparent = poison.traceparent.map(str::to_string);
    letter.stored_ms = poison.stored_ms;
    letter.saga = poison.route.map(|r| r.saga.clone());
    letter.correlation_id = poison.route.map(|r| r.correlation_id.clone());
    let letter = tx.push_dead_letter(letter)?;
    if let Some(r) = poison.route
        && tx
            .parked_by(p.tenant, &r.saga, &r.correlation_id)?
            .is_none()
    {
        tx.park(p.tenant, &r.saga, &r.correlation_id, letter.id)?;
    }
    let message = message(&letter);
    tracing::warn!(message = "Input dead-lettered.", tenant = p.tenant, kind = p.kind, reason = %letter.reason, source = %letter.source, saga = ?letter.saga, correlation_id = ?letter.correlation_id, id = letter.id);
    Ok(OutboxRecord {
        subject: message.subject,
        msg_id: message.msg_id,
        tenant: p.tenant.to_string(),
        traceparent: letter.traceparent,
        body: message.body.to_string(),
        cause: poison.outbox.1,
    })
}

/// A message for the dead-letter stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// `tenant.<t>.deadletter.<kind>`.
    pub subject: String,
    /// Its `Nats-Msg-Id`, derived from where the input came from, so a republished dead
    /// letter is dropped by JetStream's de-duplication.
    pub msg_id: String,
    /// The JSON body.
    pub body: Json,
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
    }
}

/// The dead-letter stream's subject for `tenant` and `kind`.
pub fn subject(tenant: &str, kind: &str) -> String {
    format!("tenant.{tenant}.deadletter.{kind}")
}

/// The message that announces a stored saga-side dead letter.
pub fn message(dl: &DeadLetter) -> Message {
    Message {
        subject: subject(&dl.tenant, &dl.kind),
        msg_id: format!(
            "dl:{}:{}:{}",
            dl.source,
            dl.saga.as_deref().unwrap_or("-"),
            dl.id
        ),
        body: json!({
            "v": 1,
            "id": dl.id,
            "tenant_id": dl.tenant,
            "kind": dl.kind,
            "reason": dl.reason,
            "subject": dl.subject,
            "source": dl.source,
            "saga": dl.saga,
            "correlation_id": dl.correlation_id,
            "body": dl.body,
            "body_bytes": dl.body_bytes,
            "at_ms": dl.at_ms,
        }),
    }
}

/// An input that can never be processed (a saga input or an effect command): where it came
/// from, what it was, and why it was refused.
#[derive(Debug, Clone, Copy)]
pub struct Refused<'a> {
    /// Tenant (from the subject; when it has none, `_` on the saga side and the default
    /// tenant on the effect side).
    pub tenant: &'a str,
    /// Reason class, one of [`kind`].
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

/// The message for an effect command that can never run (the effect worker keeps no local
/// store: this message is the whole record).
pub fn refused_command(p: Refused<'_>) -> Message {
    let (body, body_bytes) = excerpt(p.body);
    Message {
        subject: subject(p.tenant, p.kind),
        msg_id: format!("dl:{}:effect", p.source),
        body: json!({
            "v": 1,
            "tenant_id": p.tenant,
            "kind": p.kind,
            "reason": bounded_reason(p.reason),
            "subject": p.subject,
            "source": p.source,
            "body": body,
            "body_bytes": body_bytes,
            "at_ms": p.at_ms,
        }),
    }
}

/// Why a dead-letter operation was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeadLetterError {
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A listing's arguments are wrong.
    #[error("{0}")]
    BadQuery(String),
    /// No such dead letter.
    #[error("no dead letter {id} for tenant `{tenant}`")]
    NotFound {
        /// Tenant.
        tenant: String,
        /// Id.
        id: u64,
    },
    /// The entry was redriven already.
    #[error("dead letter {0} was already redriven")]
    AlreadyRedriven(u64),
    /// The entry keeps only an excerpt of its input: it cannot be applied again from here.
    #[error(
        "dead letter {id} keeps only an excerpt of its {bytes}-byte input; the input is at \
         {from} while that stream retains it: fix and republish it there instead"
    )]
    ExcerptOnly {
        /// The entry.
        id: u64,
        /// Where the whole input is (`stream:seq`).
        from: String,
        /// Its size.
        bytes: u64,
    },
    /// The entry is an effect command parked by an effect worker: it is not a saga input.
    #[error(
        "dead letter {0} is an effect command an effect worker could not run; a saga redrive \
         cannot apply it: republish the command once its cause is fixed"
    )]
    EffectCommand(u64),
    /// The entry is held behind another one; that one must be redriven first.
    #[error("dead letter {id} is held behind dead letter {first}; redrive {first} instead")]
    HeldBehind {
        /// This entry.
        id: u64,
        /// The entry that parked the key.
        first: u64,
    },
}

/// Whether a dead letter is an effect command an effect worker parked in its local store
/// (`tenant.<t>.effect.<name>.<id>`), not a saga input.
pub fn is_effect_command(dl: &DeadLetter) -> bool {
    let mut parts = dl.subject.split('.');
    parts.next() == Some("tenant") && parts.nth(1) == Some("effect") && parts.count() == 2
}

/// Which dead letters a purge removes.
#[derive(Debug, Clone, Default)]
pub struct Purge {
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only those recorded before this time (ms since the epoch).
    pub before_ms: Option<u64>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Also remove pending entries that park their key (the key is unparked; inputs held
    /// behind it stay as pending entries of their own).
    pub force: bool,
    /// Report what would go, remove nothing.
    pub dry_run: bool,
}

/// Removes the dead letters `p` selects, in one write transaction, and returns them. A
/// pending entry its key is parked behind is kept unless `force`: removing it would leave
/// the key parked with nothing to redrive. The retention sweep uses this too, with
/// `saga.dead_letter_retention`.
pub fn purge(store: &Store, p: &Purge) -> Result<Vec<DeadLetter>, DeadLetterError> {
    let p = p.clone();
    Ok(store.write_blocking(move |t| {
        let mut removed = Vec::new();
        for d in t.dead_letters()? {
            let selected = p.tenant.as_ref().is_none_or(|x| *x == d.tenant)
                && p.before_ms.is_none_or(|b| d.at_ms < b)
                && p.kind.as_ref().is_none_or(|k| *k == d.kind);
            if !selected {
                continue;
            }
            let parks = t.parks_its_key(&d)?;
            // A pending input held behind its key's first letter (parked, or held while its
            // tenant is paused) is as needed as the first: it is applied when that is.
            let held = d.status == DeadLetterStatus::Pending
                && match (&d.saga, &d.correlation_id) {
                    (Some(saga), Some(corr)) => t.parked_by(&d.tenant, saga, corr)?.is_some(),
                    _ => false,
                };
            if (parks || held) && !p.force {
                continue;
            }
            if !p.dry_run {
                if parks && let (Some(saga), Some(corr)) = (&d.saga, &d.correlation_id) {
                    t.unpark(&d.tenant, saga, corr)?;
                }
                t.delete_dead_letter(&d.tenant, d.id)?;
            }
            removed.push(d);
        }
        Ok(removed)
    })?)
}

/// The most of a letter's body a listing shows (the rest: `dlq show`).
pub const SHOWN_BODY_BYTES: usize = EXCERPT_BYTES;

/// The most of each other text field of a letter a listing shows (its tenant aside: it is
/// part of the letter's key, and needed to fetch the letter whole).
pub const SHOWN_FIELD_BYTES: usize = 1024;

/// The most bytes a listing's answer takes (its items serialized as JSON, with the page's
/// own fields): a page is cut short of `limit` items rather than pass it.
pub const ANSWER_BYTES: usize = 4 << 20;

/// What a page's own fields (`next`, `scanned`, …) may take of [`ANSWER_BYTES`]; its items
/// get the rest.
const ENVELOPE_BYTES: usize = 16 << 10;

/// The items' share of [`ANSWER_BYTES`].
pub const ITEMS_BYTES: usize = ANSWER_BYTES - ENVELOPE_BYTES;

/// The most stored letters one page reads, matching its filters or not.
pub const SCAN_ENTRIES: usize = 10_000;

/// The most stored bytes one page reads (checked before each letter: one letter may pass it).
pub const SCAN_BYTES: usize = 16 << 20;

/// The most letters one page holds.
pub const MAX_PAGE: usize = 1000;

/// Why a page holds fewer than `limit` items though more may follow (its `stopped_at`).
pub mod stopped {
    /// The answer reached [`super::ANSWER_BYTES`].
    pub const ANSWER_BYTES: &str = "answer_bytes";
    /// The page read [`super::SCAN_ENTRIES`] letters or [`super::SCAN_BYTES`] bytes.
    pub const SCAN_LIMIT: &str = "scan_limit";
}

/// Cuts `s` to at most `max` bytes at a character boundary; whether it was cut.
pub fn cut_text(s: &mut String, max: usize) -> bool {
    if s.len() <= max {
        return false;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    true
}

/// A dead letter as a listing shows it: every field of the stored letter, the body cut to
/// [`SHOWN_BODY_BYTES`] and the other text (reason, subject, source, saga, key, trace
/// context, kind) to [`SHOWN_FIELD_BYTES`] each. `dlq show` gives it whole.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Listed {
    /// The letter, cut.
    #[serde(flatten)]
    pub letter: DeadLetter,
    /// The size of the body the store keeps, given when `body` shows only its start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_stored_bytes: Option<u64>,
    /// Set when any field shows less than is stored.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cut: bool,
}

impl Listed {
    /// `letter` cut for a listing.
    pub fn of(mut letter: DeadLetter) -> Self {
        let stored = letter.body.len() as u64;
        let body_cut = cut_text(&mut letter.body, SHOWN_BODY_BYTES);
        let mut cut = body_cut;
        for f in [
            &mut letter.kind,
            &mut letter.reason,
            &mut letter.subject,
            &mut letter.source,
        ] {
            cut |= cut_text(f, SHOWN_FIELD_BYTES);
        }
        for f in [
            &mut letter.traceparent,
            &mut letter.saga,
            &mut letter.correlation_id,
        ]
        .into_iter()
        .flatten()
        {
            cut |= cut_text(f, SHOWN_FIELD_BYTES);
        }
        Self {
            letter,
            body_stored_bytes: body_cut.then_some(stored),
            cut,
        }
    }
}

/// What a dead-letter listing asks for: a tenant's letters or every tenant's, pending ones
/// only unless `all`, `limit` of them after `after`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Listing<'a> {
    /// Only this tenant's.
    pub tenant: Option<&'a str>,
    /// Redriven ones too.
    pub all: bool,
    /// The `next` of the previous page.
    pub after: Option<&'a str>,
    /// Page size, 1 to [`MAX_PAGE`].
    pub limit: usize,
}

/// One page of a dead-letter listing (`GET /admin/dlq`, `runner dlq list`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page {
    /// The letters, in key order: a tenant's oldest first, tenants by name.
    pub items: Vec<Listed>,
    /// Pass as `after` for the next page; absent on the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// How many letters the listing holds, given only when this one page is all of it (no
    /// `after`, no `next`); otherwise walk the pages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<usize>,
    /// Stored letters this page read, matching the filters or not.
    pub scanned: usize,
    /// Why the page holds fewer than `limit` items though more may follow:
    /// [`stopped::ANSWER_BYTES`] or [`stopped::SCAN_LIMIT`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<String>,
}

/// The status of a stored letter, read without keeping the rest.
#[derive(Deserialize)]
struct Head {
    status: DeadLetterStatus,
}

/// One page of dead letters, read from the store in key order from `after`: at most
/// `limit` + 1 letters (the one more says whether a next page exists), [`SCAN_ENTRIES`]
/// letters or [`SCAN_BYTES`] bytes, whichever comes first — filters are applied while
/// reading, so a filter that matches nothing still ends its page there, with a `next`.
/// Each letter is cut for showing ([`Listed`]), and the items stop before they pass
/// [`ITEMS_BYTES`] serialized (the first always fits: a shown letter is far smaller).
/// The cost is the page, never the table.
pub fn page(store: &Store, l: &Listing<'_>) -> Result<Page, DeadLetterError> {
    use crate::storage::tables::{decode_after, encode_after};
    if l.limit == 0 || l.limit > MAX_PAGE {
        return Err(DeadLetterError::BadQuery(format!(
            "`limit` must be 1 to {MAX_PAGE}"
        )));
    }
    let after = match l.after {
        None => None,
        Some(a) => Some(decode_after(a).ok_or_else(|| {
            DeadLetterError::BadQuery("`after` is not the `next` of an earlier page".into())
        })?),
    };
    let (limit, all) = (l.limit, l.all);
    Ok(store.read_blocking(|t| {
        let mut items: Vec<Listed> = Vec::new();
        let (mut scanned, mut scanned_bytes, mut bytes) = (0usize, 0usize, 0usize);
        let mut stopped_at = None;
        let mut last: Option<Vec<u8>> = None;
        let ended = t.walk_dead_letters(l.tenant, after.as_deref(), |position, raw| {
            if items.len() == limit {
                return Ok(false);
            }
            if scanned == SCAN_ENTRIES || scanned_bytes >= SCAN_BYTES {
                stopped_at = Some(stopped::SCAN_LIMIT);
                return Ok(false);
            }
            let head: Head = serde_json::from_slice(raw)
                .map_err(|e| StorageError::Corrupt(format!("dead letter: {e}")))?;
            if all || head.status == DeadLetterStatus::Pending {
                let letter: DeadLetter = serde_json::from_slice(raw)
                    .map_err(|e| StorageError::Corrupt(format!("dead letter: {e}")))?;
                let shown = Listed::of(letter);
                let size = serde_json::to_vec(&shown)
                    .map_err(|e| StorageError::Corrupt(format!("dead letter: {e}")))?
                    .len()
                    + 1;
                if !items.is_empty() && bytes + size > ITEMS_BYTES {
                    stopped_at = Some(stopped::ANSWER_BYTES);
                    return Ok(false);
                }
                bytes += size;
                items.push(shown);
            }
            scanned += 1;
            scanned_bytes += raw.len();
            last = Some(position.to_vec());
            Ok(true)
        })?;
        let next = if ended {
            None
        } else {
            last.as_deref().map(encode_after)
        };
        Ok(Page {
            total: (l.after.is_none() && next.is_none()).then_some(items.len()),
            items,
            next,
            scanned,
            stopped_at: stopped_at.map(str::to_string),
        })
    })?)
}

/// Every dead letter, optionally of one tenant, pending ones only unless `all`: the whole
/// table in memory. For tools and tests that need them all; the operator's listings
/// (`GET /admin/dlq`, `runner dlq list`) read one bounded [`page`] at a time.
pub fn list(
    store: &Store,
    tenant: Option<&str>,
    all: bool,
) -> Result<Vec<DeadLetter>, DeadLetterError> {
    Ok(store
        .read_blocking(|t| t.dead_letters())?
        .into_iter()
        .filter(|d| {
            tenant.is_none_or(|x| x == d.tenant) && (all || d.status == DeadLetterStatus::Pending)
        })
        .collect())
}

/// One dead letter.
pub fn show(store: &Store, tenant: &str, id: u64) -> Result<DeadLetter, DeadLetterError> {
    store
        .read_blocking(|t| t.dead_letter(tenant, id))?
        .ok_or_else(|| DeadLetterError::NotFound {
            tenant: tenant.into(),
            id,
        })
}

/// What a redrive needs from the saga worker: applying one dead-lettered input again.
pub trait Reapply {
    /// Applies the input kept in `letter` again, inside `tx`. With `hold`, an earlier input
    /// of this redrive failed again, so this one must be held behind it (dead-lettered as
    /// [`kind::PARKED`]) rather than applied. Returns whether the input was dead-lettered
    /// again.
    fn reapply(
        &mut self,
        tx: &Tables<'_, RW>,
        letter: &DeadLetter,
        hold: bool,
    ) -> Result<bool, StorageError>;
}

/// Redrives dead letter `id` of `tenant` and the inputs held behind it, in one write
/// transaction, through `worker`. Returns the ids processed, in order.
pub fn redrive(
    store: &Store,
    tenant: &str,
    id: u64,
    worker: &mut impl Reapply,
) -> Result<Vec<u64>, DeadLetterError> {
    store.write_blocking(|t| redrive_in(t, tenant, id, worker))?
}

/// [`redrive`] inside the caller's write transaction (a partition owner's commit).
pub fn redrive_in(
    t: &Tables<'_, RW>,
    tenant: &str,
    id: u64,
    worker: &mut impl Reapply,
) -> Result<Result<Vec<u64>, DeadLetterError>, StorageError> {
    {
        let Some(dl) = t.dead_letter(tenant, id)? else {
            return Ok(Err(DeadLetterError::NotFound {
                tenant: tenant.into(),
                id,
            }));
        };
        if dl.status != DeadLetterStatus::Pending {
            return Ok(Err(DeadLetterError::AlreadyRedriven(id)));
        }
        if let (Some(saga), Some(corr)) = (&dl.saga, &dl.correlation_id)
            && let Some(first) = t.parked_by(tenant, saga, corr)?
            && first != id
            && dl.kind == kind::PARKED
        {
            return Ok(Err(DeadLetterError::HeldBehind { id, first }));
        }
        if is_effect_command(&dl) {
            return Ok(Err(DeadLetterError::EffectCommand(id)));
        }
        let mut entries = vec![dl.clone()];
        if let (Some(saga), Some(corr)) = (&dl.saga, &dl.correlation_id) {
            entries.extend(t.dead_letters()?.into_iter().filter(|d| {
                d.tenant == tenant
                    && d.id > id
                    && held_behind(d)
                    && d.saga.as_deref() == Some(saga)
                    && d.correlation_id.as_deref() == Some(corr)
            }));
        }
        replay_key(t, entries, worker)
    }
}

/// Whether `d` is a pending input held behind its key's first letter (rather than a
/// failure of its own).
pub fn held_behind(d: &DeadLetter) -> bool {
    d.status == DeadLetterStatus::Pending
        && (d.kind == kind::PARKED || d.kind == kind::TENANT_PAUSED)
}

/// Applies again, in order, the letters of one key — its first letter, then the inputs
/// held behind it — unparking the key first and marking each redriven in `t`. Refused,
/// with nothing done, when any of them keeps only an excerpt. Returns the ids processed.
pub fn replay_key(
    t: &Tables<'_, RW>,
    entries: Vec<DeadLetter>,
    worker: &mut impl Reapply,
) -> Result<Result<Vec<u64>, DeadLetterError>, StorageError> {
    // Only whole inputs are applied again: an excerpt would be a different input.
    if let Some(e) = entries.iter().find(|e| e.body_bytes.is_some()) {
        return Ok(Err(DeadLetterError::ExcerptOnly {
            id: e.id,
            from: e.source.clone(),
            bytes: e.body_bytes.unwrap_or_default(),
        }));
    }
    if let Some(first) = entries.first()
        && let (Some(saga), Some(corr)) = (&first.saga, &first.correlation_id)
    {
        t.unpark(&first.tenant, saga, corr)?;
    }
    let mut processed = Vec::with_capacity(entries.len());
    let mut failed = false;
    for mut e in entries {
        // After a failure in this replay, later held inputs are held again.
        failed |= worker.reapply(t, &e, failed)?;
        e.status = DeadLetterStatus::Redriven;
        e.attempts += 1;
        t.put_dead_letter(&e)?;
        processed.push(e.id);
    }
    Ok(Ok(processed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saga_and_effect_messages_share_subject_and_fields() {
        let refused = Refused {
            tenant: "acme",
            kind: kind::UNDECODABLE,
            reason: "body is not JSON",
            subject: "tenant.acme.aggregate.Order.o-1",
            source: "AGGREGATE_EVENTS:7",
            body: b"\xff{",
            at_ms: 42,
        };
        let effect = refused_command(refused);
        assert_eq!(effect.msg_id, "dl:AGGREGATE_EVENTS:7:effect");
        assert_eq!(effect.subject, "tenant.acme.deadletter.undecodable");
        assert_eq!(effect.body["body"], Json::from("\u{fffd}{"));
        let saga = message(&DeadLetter {
            id: 3,
            tenant: refused.tenant.into(),
            kind: refused.kind.into(),
            reason: refused.reason.into(),
            subject: refused.subject.into(),
            source: refused.source.into(),
            body: String::from_utf8_lossy(refused.body).into_owned(),
            body_bytes: None,
            traceparent: None,
            saga: Some("order".into()),
            correlation_id: Some("o-1".into()),
            attempts: 1,
            at_ms: refused.at_ms,
            status: DeadLetterStatus::Pending,
            stored_ms: None,
        });
        assert_eq!(saga.subject, effect.subject);
        assert_eq!(saga.msg_id, "dl:AGGREGATE_EVENTS:7:order:3");
        for field in [
            "tenant_id",
            "kind",
            "reason",
            "subject",
            "source",
            "body",
            "at_ms",
        ] {
            assert!(effect.body.get(field).is_some(), "{field} missing");
            assert_eq!(saga.body[field], effect.body[field], "{field} differs");
        }
    }
}
