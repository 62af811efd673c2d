//! Operator tools on the local store: `runner inspect`, and the saga worker's side of
//! `runner dlq redrive` (listing, showing and the redrive protocol are
//! [`crate::deadletter`]'s).
//!
//! They open the same libmdbx environment as a running `runner` (libmdbx allows several
//! processes), so they work on a live node. A redrive writes its outputs to the outbox: the
//! running node's relay publishes them within `saga.relay_poll`, a stopped node at its next
//! start.

use serde::Serialize;

use crate::clock::now_ms;
use crate::deadletter::{self, DeadLetterError};
use crate::manifest::Catalog;
use crate::storage::tables::{HistoryEntry, TimerEntry};
use crate::storage::{StorageError, Store};
use crate::worker::admission::Limits;
use crate::worker::process::Processor;

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

/// Redrives dead letter `id` of `tenant` and the inputs held behind it (the protocol is
/// [`deadletter::redrive`]), applying them with the saga worker's processor.
pub fn redrive(
    store: &Store,
    catalog: &Catalog,
    limits: &Limits,
    tenant: &str,
    id: u64,
) -> Result<RedriveReport, DeadLetterError> {
    let mut p = Processor::new(catalog, limits, now_ms());
    let processed = deadletter::redrive(store, tenant, id, &mut p)?;
    Ok(RedriveReport {
        processed,
        applied: p.tally.count("applied") as usize,
        dead_lettered: p.tally.dead_letters.len(),
        outbox: p.tally.outbox,
    })
}
