//! Redriving a dead letter: applying its input again, then every input held behind it on
//! the same key, oldest first, in one write transaction that unparks the key and marks
//! each entry redriven, so no entry is processed twice and a held entry never overtakes
//! the one that parked its key.

use libmdbx::RW;

use super::{DeadLetter, DeadLetterError, DeadLetterStatus, kind};
use crate::storage::{StorageError, Store, Tables};

/// Whether a dead letter is an effect command an effect worker parked in its local store
/// (`tenant.<t>.effect.<name>.<id>`), not a saga input.
pub fn is_effect_command(dl: &DeadLetter) -> bool {
    let mut parts = dl.subject.split('.');
    parts.next() == Some("tenant") && parts.nth(1) == Some("effect") && parts.count() == 2
}

/// What a redrive needs from the saga worker: applying one dead-lettered input again.
pub trait Reapply {
    /// Applies the input kept in `letter` again, inside `tx`. With `hold`, an earlier input
    /// of this redrive parked its key again (it failed again, or was held at its tenant's
    /// cap), so this one must be held behind it (dead-lettered as [`kind::PARKED`], or held
    /// whole when it was held whole) rather than applied. Returns whether its key is parked
    /// again after it (for a letter that names no instance: whether it was dead-lettered
    /// again).
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
        && (d.kind == kind::PARKED
            || d.kind == kind::TENANT_PAUSED
            || d.kind == kind::TENANT_CAPPED)
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
        // Once the key is parked again in this replay, later held inputs are held again.
        failed |= worker.reapply(t, &e, failed)?;
        e.status = DeadLetterStatus::Redriven;
        e.attempts += 1;
        t.put_dead_letter(&e)?;
        processed.push(e.id);
    }
    Ok(Ok(processed))
}
