//! Listing and showing dead letters for an operator. A listing reads one bounded page at
//! a time (never more than [`SCAN_ENTRIES`] letters or [`SCAN_BYTES`] bytes from the store)
//! and shows each letter cut ([`Listed`]), so its answer stays under [`ANSWER_BYTES`]
//! whatever the table holds; [`show`] gives one letter whole.

use serde::{Deserialize, Serialize};

use super::refusal::EXCERPT_BYTES;
use super::{DeadLetter, DeadLetterError, DeadLetterStatus};
use crate::storage::{StorageError, Store};

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
