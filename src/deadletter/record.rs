//! Recording a saga-side dead letter inside the caller's write transaction: storing the
//! letter, parking its key and queueing its announcement in the outbox, so a dead letter is
//! durable exactly when the batch that met it is.

use libmdbx::RW;

use crate::saga::Route;
use crate::storage::tables::OutboxRecord;
use crate::storage::{StorageError, Tables};

use super::message::message;
use super::refusal::{Refused, letter_of};

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
/// in the outbox. Returns that message's outbox sequence and record. Nothing is durable
/// until the caller commits `tx`.
pub fn record(
    tx: &Tables<'_, RW>,
    poison: Poison<'_>,
) -> Result<(u64, OutboxRecord), StorageError> {
    let record = store(tx, poison)?;
    Ok((tx.push_outbox(poison.outbox.0, &record)?, record))
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
