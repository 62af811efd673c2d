//! Operator tools on the local store: `runner inspect`, `runner instances list` (also served
//! by the admin API) and `runner migrate` ([`migrate`]: run by a partition's owner through
//! the admin API, or as a dry run on a store). A redrive is the owner's too: it travels
//! through the partition's inbox (`worker/control.rs`; the protocol is
//! [`crate::deadletter`]'s).
//!
//! They open the same libmdbx environment as a running `runner` (libmdbx allows several
//! processes), so the readers work on a live node.

pub mod migrate;
pub mod replay;

use serde::Serialize;

use crate::clock::now_ms;
use crate::storage::tables::{HistoryEntry, TimerEntry};
use crate::storage::{StorageError, Store};

/// Errors of the operator tools.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A listing's arguments are wrong.
    #[error("{0}")]
    BadQuery(String),
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

/// One instance in a listing.
#[derive(Debug, Serialize)]
pub struct InstanceSummary {
    /// Correlation id (the instance's key within its saga).
    pub correlation_id: String,
    /// State name.
    pub state: String,
    /// Lifecycle status.
    pub status: crate::saga::Status,
    /// The saga version it runs on.
    pub version: u32,
    /// When it started (its first input's time), ms since the epoch.
    pub started_ms: u64,
    /// Its last input's time.
    pub updated_ms: u64,
    /// Inputs applied.
    pub inputs_applied: u64,
}

/// A page of `runner instances list`.
#[derive(Debug, Serialize)]
pub struct InstanceListing {
    /// Tenant.
    pub tenant: String,
    /// Saga.
    pub saga: String,
    /// The instances, oldest first.
    pub items: Vec<InstanceSummary>,
    /// Entries of this page left out because their partition belongs to another node (in
    /// partitioned mode a node's store may keep a stale copy of a partition it gave up).
    #[serde(skip_serializing_if = "is_zero")]
    pub elsewhere: usize,
    /// Pass as `after` for the next page; absent on the last one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// What to list: one tenant's instances of one saga, optionally in one state and started at
/// least `older_than_ms` ago, `limit` of them after `after`.
#[derive(Debug, Clone, Copy)]
pub struct Listing<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Saga.
    pub saga: &'a str,
    /// Only this state.
    pub state: Option<&'a str>,
    /// Only instances started at least this long ago (ms).
    pub older_than_ms: Option<u64>,
    /// The previous page's `next`.
    pub after: Option<&'a str>,
    /// Page size.
    pub limit: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Lists one page of a tenant's instances of a saga, optionally in one state and older
/// than `older_than_ms` (started that long ago or more), from the index: the cost is the
/// page, not the number of instances. The tenant and saga are required, so a listing
/// never reaches another tenant's instances. Only instances `here` accepts are returned
/// (the admin API passes the partitions the node owns); the page's continuation is the
/// same either way.
pub fn list_instances(
    store: &Store,
    l: &Listing<'_>,
    here: &dyn Fn(&crate::saga::Instance) -> bool,
) -> Result<InstanceListing, OpsError> {
    let Listing {
        tenant,
        saga,
        state,
        older_than_ms,
        after,
        limit,
    } = *l;
    use crate::storage::tables::{InstanceQuery, MAX_PAGE, is_continuation};
    for (what, v) in [("tenant", tenant), ("saga", saga)] {
        if v.is_empty() || v.contains(['\0', '.', '*', '>']) {
            return Err(OpsError::BadQuery(format!("`{what}` must be a name")));
        }
    }
    if state.is_some_and(|s| s.is_empty() || s.contains('\0')) {
        return Err(OpsError::BadQuery("`state` must be a state name".into()));
    }
    if after.is_some_and(|a| !is_continuation(a)) {
        return Err(OpsError::BadQuery(
            "`after` is not the `next` of an earlier page".into(),
        ));
    }
    if limit == 0 || limit > MAX_PAGE {
        return Err(OpsError::BadQuery(format!(
            "`limit` must be 1 to {MAX_PAGE}"
        )));
    }
    let q = InstanceQuery {
        tenant: tenant.to_string(),
        saga: saga.to_string(),
        state: state.map(str::to_string),
        started_before_ms: older_than_ms.map(|d| now_ms().saturating_sub(d)),
        after: after.map(str::to_string),
        limit,
    };
    let page = store.read_blocking(|t| t.list_instances(&q))?;
    let read = page.items.len();
    let items: Vec<_> = page.items.into_iter().filter(|i| here(i)).collect();
    Ok(InstanceListing {
        tenant: tenant.to_string(),
        saga: saga.to_string(),
        elsewhere: read - items.len(),
        items: items
            .into_iter()
            .map(|i| InstanceSummary {
                correlation_id: i.correlation_id,
                state: i.state,
                status: i.status,
                version: i.version,
                started_ms: i.started_ms,
                updated_ms: i.updated_ms,
                inputs_applied: i.applied,
            })
            .collect(),
        next: page.next,
    })
}
