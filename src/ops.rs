//! Operator tools on the local store: `runner inspect` and `runner dlq list|show|redrive`.
//!
//! They open the same libmdbx environment as a running `runner` (libmdbx allows several
//! processes), so they work on a live node. A redrive runs in one write transaction: it
//! unparks the key, applies the dead-lettered input and then the inputs held behind it in
//! their original order, writes the outputs to the outbox (the running node's relay
//! publishes them within `saga.relay_poll`; a stopped node publishes them at its next
//! start) and marks each entry redriven, so an entry is processed at most once. If the
//! input fails again it is dead-lettered anew and the key parked again.

use serde::Serialize;
use serde_json::Value as Json;

use crate::manifest::Catalog;
use crate::saga::{Input, Route};
use crate::storage::tables::{DeadLetter, DeadLetterStatus, HistoryEntry, TimerEntry};
use crate::storage::{StorageError, Store};
use crate::worker::now_ms;
use crate::worker::process::{Limits, Processor, RawInput, kind, split_subject};

/// Errors of the operator tools.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// No such instance.
    #[error("no instance of saga `{saga}` with id `{id}` for tenant `{tenant}`")]
    NoInstance {
        /// Tenant.
        tenant: String,
        /// Saga.
        saga: String,
        /// Correlation id.
        id: String,
    },
    /// No such dead letter.
    #[error("no dead letter {id} for tenant `{tenant}`")]
    NoDeadLetter {
        /// Tenant.
        tenant: String,
        /// Id.
        id: u64,
    },
    /// The entry was redriven already.
    #[error("dead letter {0} was already redriven")]
    AlreadyRedriven(u64),
    /// The entry is held behind another one; that one must be redriven first.
    #[error("dead letter {id} is held behind dead letter {first}; redrive {first} instead")]
    HeldBehind {
        /// This entry.
        id: u64,
        /// The entry that parked the key.
        first: u64,
    },
}

/// What `runner inspect` shows.
#[derive(Debug, Serialize)]
pub struct InstanceView {
    /// The stored instance.
    pub instance: crate::saga::Instance,
    /// Pending timers.
    pub timers: Vec<TimerEntry>,
    /// Recent transitions, oldest first.
    pub recent_transitions: Vec<HistoryEntry>,
    /// The dead letter parking this key, if parked.
    pub parked_by: Option<u64>,
}

/// Reads one instance with its timers and recent transitions.
pub fn inspect(
    store: &Store,
    tenant: &str,
    saga: &str,
    id: &str,
) -> Result<InstanceView, OpsError> {
    store
        .read_blocking(|t| {
            let Some(instance) = t.instance(tenant, saga, id)? else {
                return Ok(None);
            };
            Ok(Some(InstanceView {
                instance,
                timers: t.timers_of(tenant, saga, id)?,
                recent_transitions: t.history(tenant, saga, id)?,
                parked_by: t.parked_by(tenant, saga, id)?,
            }))
        })?
        .ok_or_else(|| OpsError::NoInstance {
            tenant: tenant.into(),
            saga: saga.into(),
            id: id.into(),
        })
}

/// Lists dead letters, optionally of one tenant, pending ones only unless `all`.
pub fn list(store: &Store, tenant: Option<&str>, all: bool) -> Result<Vec<DeadLetter>, OpsError> {
    Ok(store
        .read_blocking(|t| t.dead_letters())?
        .into_iter()
        .filter(|d| {
            tenant.is_none_or(|x| x == d.tenant) && (all || d.status == DeadLetterStatus::Pending)
        })
        .collect())
}

/// One dead letter.
pub fn show(store: &Store, tenant: &str, id: u64) -> Result<DeadLetter, OpsError> {
    store
        .read_blocking(|t| t.dead_letter(tenant, id))?
        .ok_or_else(|| OpsError::NoDeadLetter {
            tenant: tenant.into(),
            id,
        })
}

/// What a redrive did.
#[derive(Debug, Serialize)]
pub struct RedriveReport {
    /// Entries processed, in order (the redriven one, then those held behind it).
    pub processed: Vec<u64>,
    /// Transitions applied.
    pub applied: usize,
    /// New dead letters written (the input failed again).
    pub dead_lettered: usize,
    /// Outbox records written.
    pub outbox: u64,
}

/// Redrives dead letter `id` of `tenant` (and the inputs held behind it).
pub fn redrive(
    store: &Store,
    catalog: &Catalog,
    limits: &Limits,
    tenant: &str,
    id: u64,
) -> Result<RedriveReport, OpsError> {
    store.write_blocking(|t| {
        let Some(dl) = t.dead_letter(tenant, id)? else {
            return Ok(Err(OpsError::NoDeadLetter {
                tenant: tenant.into(),
                id,
            }));
        };
        if dl.status != DeadLetterStatus::Pending {
            return Ok(Err(OpsError::AlreadyRedriven(id)));
        }
        if let (Some(saga), Some(corr)) = (&dl.saga, &dl.correlation_id)
            && let Some(first) = t.parked_by(tenant, saga, corr)?
            && first != id
            && dl.kind == kind::PARKED
        {
            return Ok(Err(OpsError::HeldBehind { id, first }));
        }
        let mut p = Processor::new(catalog, limits, now_ms());
        let mut processed = Vec::new();
        let mut entries = vec![dl.clone()];
        if let (Some(saga), Some(corr)) = (&dl.saga, &dl.correlation_id) {
            t.unpark(tenant, saga, corr)?;
            entries.extend(t.dead_letters()?.into_iter().filter(|d| {
                d.tenant == tenant
                    && d.id > id
                    && d.status == DeadLetterStatus::Pending
                    && d.kind == kind::PARKED
                    && d.saga.as_deref() == Some(saga)
                    && d.correlation_id.as_deref() == Some(corr)
            }));
        }
        for mut e in entries {
            let raw = RawInput {
                subject: e.subject.clone(),
                body: e.body.clone().into_bytes(),
                traceparent: e.traceparent.clone(),
                source: format!("redrive:{}", e.id),
            };
            let failed_before = p.tally.dead_letters.len();
            match (&e.saga, &e.correlation_id, split_subject(&e.subject)) {
                (Some(saga), Some(corr), Some((_, rel))) => {
                    let body: Json = serde_json::from_str(&e.body).unwrap_or(Json::Null);
                    let input = Input::new(rel, body);
                    let route = Route {
                        saga: saga.clone(),
                        correlation_id: corr.clone(),
                    };
                    // After a failure in this redrive, later held inputs are held again.
                    let still_parked = failed_before > 0;
                    p.route(t, &raw, tenant, &input, &route, !still_parked)?;
                }
                _ => p.input(t, &raw)?,
            }
            e.status = DeadLetterStatus::Redriven;
            e.attempts += 1;
            t.put_dead_letter(&e)?;
            processed.push(e.id);
        }
        let applied = p.tally.count("applied") as usize;
        Ok(Ok(RedriveReport {
            processed,
            applied,
            dead_lettered: p.tally.dead_letters.len(),
            outbox: p.tally.outbox,
        }))
    })?
}
