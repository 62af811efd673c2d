//! Pausing a tenant's sagas, and resuming them (`runner tenants pause|resume`,
//! `POST /admin/tenants/{tenant}/pause|resume`).
//!
//! While a tenant is paused the saga worker applies none of its inputs — events, effect
//! results, timer firings — and stops nothing else: other tenants flow, effect commands
//! already sent still run. Each input of the tenant is *held*: kept whole in the store as a
//! letter of kind `tenant_paused` that parks its key (as a poison input does), while the
//! stream position moves on. Resuming applies each key's held inputs in the order they
//! arrived, then lets the key's later inputs through.
//!
//! Where the pause lives: key `paused.<tenant>` of the KV bucket `saga.control_bucket`,
//! shared by every saga node. A node reads the bucket before its worker starts and watches
//! it afterwards (`control.rs`, into [`crate::asked::Paused`]); a node that set or cleared
//! the key itself acts at once. This file is the store side: holding and releasing.
//!
//! Guarantees:
//! - **Nothing lost, nothing twice.** A held input is kept whole (it passed admission, so it
//!   is at most `saga.max_message_bytes`), is not swept by retention, and is released once:
//!   it is marked redriven in the transaction that applies it.
//! - **Per-key order.** From a key's first held input on, every later input of the key is
//!   held behind it — also one that arrives after the resume but before the release — and
//!   the release applies them oldest first.
//! - **Partitioned mode.** A resume travels as a control input through every partition's
//!   inbox, so each partition's owner releases the held inputs of its own keys in log
//!   order, inside its own commit and fences; a new owner replaying the partition does the
//!   same at the same point. Single-active mode releases in one write transaction.
//! - Held inputs are not failures: they are not announced on the dead-letter stream nor
//!   counted in `runner_deadletters_total`; `runner_saga_transitions_total{outcome="held"}`
//!   counts them.

use std::collections::BTreeMap;

use libmdbx::RW;
use serde::Serialize;

use super::admission::{Caps, RawInput};
use crate::deadletter::{self, DeadLetterError, Reapply, kind};
use crate::saga::Route;
use crate::storage::tables::{DeadLetter, DeadLetterStatus};
use crate::storage::{StorageError, Tables};

/// Holds `raw`, an input of a paused tenant routed to `route`: stores it whole as a
/// `tenant_paused` letter and parks its key when nothing parks it yet.
pub fn hold(
    tx: &Tables<'_, RW>,
    raw: &RawInput,
    tenant: &str,
    route: &Route,
    at_ms: u64,
) -> Result<(), StorageError> {
    let why = Held {
        kind: kind::TENANT_PAUSED,
        reason: format!("tenant `{tenant}` is paused; held until it is resumed"),
        caps: Caps::default(),
    };
    hold_as(tx, raw, tenant, route, at_ms, why).map(drop)
}

/// Why an input is held whole: its letter's kind and reason, and for an input held at a
/// cap on running instances, that cap (`worker/cap.rs`).
pub struct Held {
    /// `tenant_paused` or `tenant_capped`.
    pub kind: &'static str,
    /// For a person.
    pub reason: String,
    /// The caps it came with, when held at one.
    pub caps: Caps,
}

/// Holds `raw`, routed to `route`, whole as a letter of `why`'s kind, and parks its key
/// when nothing parks it yet; returns the letter's id.
pub fn hold_as(
    tx: &Tables<'_, RW>,
    raw: &RawInput,
    tenant: &str,
    route: &Route,
    at_ms: u64,
    why: Held,
) -> Result<u64, StorageError> {
    let letter = tx.push_dead_letter(DeadLetter {
        id: 0,
        tenant: tenant.to_string(),
        kind: why.kind.to_string(),
        reason: why.reason,
        subject: raw.subject.clone(),
        source: raw.source.clone(),
        body: String::from_utf8_lossy(&raw.body).into_owned(),
        body_bytes: None,
        traceparent: raw.traceparent.clone(),
        saga: Some(route.saga.clone()),
        correlation_id: Some(route.correlation_id.clone()),
        attempts: 0,
        at_ms,
        status: DeadLetterStatus::Pending,
        // Released later, it is applied within the time bound it arrived with.
        stored_ms: raw.stored_ms,
        // The cap it came with, so it is measured by it when applied later (`cap.rs`).
        live_cap: why.caps.live.or(raw.live_cap),
        timer_cap: why.caps.timers.or(raw.timer_cap),
    })?;
    if tx
        .parked_by(tenant, &route.saga, &route.correlation_id)?
        .is_none()
    {
        tx.park(tenant, &route.saga, &route.correlation_id, letter.id)?;
    }
    Ok(letter.id)
}

/// Holds again, whole, a held input whose release came behind an input of its key that
/// failed again (it now waits for that one's redrive).
pub fn hold_again(
    tx: &Tables<'_, RW>,
    dl: &DeadLetter,
    route: &Route,
    at_ms: u64,
) -> Result<(), StorageError> {
    let raw = RawInput {
        subject: dl.subject.clone(),
        body: dl.body.clone().into_bytes().into(),
        traceparent: dl.traceparent.clone(),
        header_bytes: 0,
        refused: None,
        live_cap: dl.live_cap,
        timer_cap: dl.timer_cap,
        source: dl.source.clone(),
        stored_ms: dl.stored_ms,
    };
    hold(tx, &raw, &dl.tenant, route, at_ms)
}

/// Whether the letter `first` that parks a key of `tenant` is a held input of a pause
/// (so a later input of the key is held whole behind it).
pub fn parked_by_pause(
    tx: &Tables<'_, RW>,
    tenant: &str,
    first: u64,
) -> Result<bool, StorageError> {
    Ok(tx
        .dead_letter(tenant, first)?
        .is_some_and(|d| d.kind == kind::TENANT_PAUSED && d.status == DeadLetterStatus::Pending))
}

/// What a release did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Released {
    /// Keys whose held inputs were applied.
    pub keys: usize,
    /// Inputs applied (or held again behind one that failed).
    pub inputs: usize,
    /// Keys left parked because an input behind their held ones keeps only an excerpt
    /// (an operator redrives or purges it).
    pub kept: usize,
}

/// Applies, inside `t`, the held inputs of `tenant` on every key `mine` accepts (saga,
/// correlation id): per key, the held inputs and what is parked behind them, oldest first.
pub fn release(
    t: &Tables<'_, RW>,
    tenant: &str,
    mine: impl Fn(&str, &str) -> bool,
    worker: &mut impl Reapply,
) -> Result<Released, StorageError> {
    let mut keys: BTreeMap<(String, String), Vec<DeadLetter>> = BTreeMap::new();
    for d in t.dead_letters()? {
        if d.tenant != tenant || !deadletter::held_behind(&d) {
            continue;
        }
        if let (Some(saga), Some(corr)) = (&d.saga, &d.correlation_id)
            && mine(saga, corr)
        {
            keys.entry((saga.clone(), corr.clone()))
                .or_default()
                .push(d);
        }
    }
    let mut done = Released::default();
    for ((saga, corr), mut letters) in keys {
        let Some(first) = t.parked_by(tenant, &saga, &corr)? else {
            continue;
        };
        // Only keys a pause parks: a key parked by a failure waits for its operator.
        if !letters
            .iter()
            .any(|d| d.id == first && d.kind == kind::TENANT_PAUSED)
        {
            continue;
        }
        letters.retain(|d| d.id >= first);
        letters.sort_by_key(|d| d.id);
        match deadletter::replay_key(t, letters, worker)? {
            Ok(ids) => {
                done.keys += 1;
                done.inputs += ids.len();
            }
            Err(DeadLetterError::ExcerptOnly { .. }) => done.kept += 1,
            Err(DeadLetterError::Storage(e)) => return Err(e),
            Err(_) => done.kept += 1,
        }
    }
    Ok(done)
}
