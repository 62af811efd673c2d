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
//! it afterwards ([`Paused`]); a node that set or cleared the key itself acts at once.
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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};

use async_nats::jetstream::kv;
use futures::StreamExt;
use libmdbx::RW;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::admission::RawInput;
use crate::backoff::Backoff;
use crate::broker::BrokerError;
use crate::deadletter::{self, DeadLetterError, Reapply, kind};
use crate::runtime::AppState;
use crate::saga::Route;
use crate::storage::tables::{DeadLetter, DeadLetterStatus};
use crate::storage::{StorageError, Tables};

/// The bucket key of a paused tenant.
fn key(tenant: &str) -> String {
    format!("paused.{tenant}")
}

/// The tenants paused now, as this node knows them; cheap to read per batch.
#[derive(Debug, Default)]
pub struct Paused(RwLock<Arc<BTreeSet<String>>>);

impl Paused {
    /// The current set.
    pub fn get(&self) -> Arc<BTreeSet<String>> {
        match self.0.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut BTreeSet<String>)) {
        let mut g = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(Arc::make_mut(&mut g));
    }

    /// Marks `tenant` paused here.
    pub fn insert(&self, tenant: &str) {
        self.update(|s| {
            s.insert(tenant.to_string());
        });
    }

    /// Marks `tenant` resumed here.
    pub fn remove(&self, tenant: &str) {
        self.update(|s| {
            s.remove(tenant);
        });
    }
}

/// Holds `raw`, an input of a paused tenant routed to `route`: stores it whole as a
/// `tenant_paused` letter and parks its key when nothing parks it yet.
pub fn hold(
    tx: &Tables<'_, RW>,
    raw: &RawInput,
    tenant: &str,
    route: &Route,
    at_ms: u64,
) -> Result<(), StorageError> {
    let letter = tx.push_dead_letter(DeadLetter {
        id: 0,
        tenant: tenant.to_string(),
        kind: kind::TENANT_PAUSED.to_string(),
        reason: format!("tenant `{tenant}` is paused; held until it is resumed"),
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
    })?;
    if tx
        .parked_by(tenant, &route.saga, &route.correlation_id)?
        .is_none()
    {
        tx.park(tenant, &route.saga, &route.correlation_id, letter.id)?;
    }
    Ok(())
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

/// Why a pause or resume failed.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    /// The tenant is not a name.
    #[error("`{0}` is not a tenant name")]
    BadTenant(String),
    /// The bucket or the inbox could not be written.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The store failed (single-active release).
    #[error(transparent)]
    Storage(#[from] StorageError),
}

fn kv_err(bucket: &str, op: &'static str, e: impl std::fmt::Display) -> BrokerError {
    BrokerError::JetStream {
        op,
        stream: format!("KV_{bucket}"),
        reason: e.to_string(),
    }
}

/// Opens the control bucket, creating it when missing (`history 1`, replicated like the
/// streams).
pub async fn bucket(state: &AppState) -> Result<kv::Store, BrokerError> {
    let c = &state.config;
    let name = &c.saga.control_bucket;
    let js = state.broker.jetstream();
    if let Ok(s) = js.get_key_value(name).await {
        return Ok(s);
    }
    let created = js
        .create_key_value(kv::Config {
            bucket: name.clone(),
            description: "Runner operator controls: paused tenants".into(),
            history: 1,
            num_replicas: c.streams.replicas,
            storage: match c.streams.storage {
                crate::config::StreamStorage::File => {
                    async_nats::jetstream::stream::StorageType::File
                }
                crate::config::StreamStorage::Memory => {
                    async_nats::jetstream::stream::StorageType::Memory
                }
            },
            ..Default::default()
        })
        .await;
    match created {
        Ok(s) => Ok(s),
        // Another node may have created it meanwhile.
        Err(e) => js
            .get_key_value(name)
            .await
            .map_err(|_| kv_err(name, "create bucket", e)),
    }
}

/// Loads the paused tenants into `state.paused` and returns a watch of later changes, so
/// no change between the load and the watch is missed (the watch starts first).
pub async fn load(state: &AppState) -> Result<kv::Watch, BrokerError> {
    let name = &state.config.saga.control_bucket;
    let kv = bucket(state).await?;
    let watch = kv
        .watch("paused.*")
        .await
        .map_err(|e| kv_err(name, "watch", e))?;
    let mut keys = kv.keys().await.map_err(|e| kv_err(name, "keys", e))?;
    while let Some(k) = keys.next().await {
        let k = k.map_err(|e| kv_err(name, "keys", e))?;
        if let Some(t) = k.strip_prefix("paused.") {
            state.paused.insert(t);
        }
    }
    let paused = state.paused.get();
    if !paused.is_empty() {
        tracing::warn!(message = "Tenants are paused: their inputs are held until resumed.", tenants = ?paused);
    }
    Ok(watch)
}

/// Keeps `state.paused` in step with the bucket until `cancel`; reopens the watch (after
/// reloading) when it ends or fails.
pub async fn watch(state: Arc<AppState>, mut w: kv::Watch, cancel: CancellationToken) {
    let mut backoff = Backoff::new(
        std::time::Duration::from_millis(200),
        std::time::Duration::from_secs(5),
    );
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            next = w.next() => match next {
                Some(Ok(e)) => {
                    let Some(t) = e.key.strip_prefix("paused.") else { continue };
                    match e.operation {
                        kv::Operation::Put => state.paused.insert(t),
                        kv::Operation::Delete | kv::Operation::Purge => state.paused.remove(t),
                    }
                    continue;
                }
                Some(Err(e)) => tracing::warn!(message = "The control bucket watch failed; reopening.", error = %e),
                None => tracing::warn!(message = "The control bucket watch ended; reopening."),
            },
        }
        loop {
            backoff.sleep(&cancel).await;
            if cancel.is_cancelled() {
                return;
            }
            match load(&state).await {
                Ok(fresh) => {
                    w = fresh;
                    break;
                }
                Err(e) => {
                    tracing::warn!(message = "Cannot reopen the control bucket watch.", error = %e)
                }
            }
        }
    }
}

/// Pauses `tenant` on every node.
pub async fn pause(state: &AppState, tenant: &str) -> Result<(), PauseError> {
    if !crate::config::is_subject_token(tenant) {
        return Err(PauseError::BadTenant(tenant.to_string()));
    }
    let kv = bucket(state).await?;
    let at = crate::clock::now_ms().to_string();
    kv.put(key(tenant), at.into_bytes().into())
        .await
        .map_err(|e| kv_err(&state.config.saga.control_bucket, "put", e))?;
    state.paused.insert(tenant);
    tracing::warn!(message = "Tenant paused: its inputs are held until it is resumed.", tenant = %tenant);
    Ok(())
}

/// What a resume did.
#[derive(Debug, Clone, Serialize)]
pub struct Resumed {
    /// The tenant.
    pub tenant: String,
    /// Single-active mode: what was released, in this node's store.
    pub released: Option<Released>,
    /// Partitioned mode: the partitions whose inboxes carry the resume (each owner
    /// releases its keys when it reads it).
    pub partitions: Option<u32>,
}

/// Resumes `tenant` on every node and releases what was held for it.
pub async fn resume(state: &Arc<AppState>, tenant: &str) -> Result<Resumed, PauseError> {
    if !crate::config::is_subject_token(tenant) {
        return Err(PauseError::BadTenant(tenant.to_string()));
    }
    let kv = bucket(state).await?;
    kv.delete(key(tenant))
        .await
        .map_err(|e| kv_err(&state.config.saga.control_bucket, "delete", e))?;
    state.paused.remove(tenant);
    tracing::info!(message = "Tenant resumed; releasing what was held.", tenant = %tenant);
    if state.config.partitions.enabled {
        let count = state.config.partitions.count;
        let body = serde_json::json!({ "resume": tenant });
        super::control::send(state, tenant, &body, 0..count).await?;
        return Ok(Resumed {
            tenant: tenant.to_string(),
            released: None,
            partitions: Some(count),
        });
    }
    let st = state.clone();
    let t = tenant.to_string();
    let released = state
        .store
        .run(move |s| {
            s.write_blocking(|tx| {
                let catalog = st.catalog();
                let limits = super::admission::Limits::from_config(&st.config)
                    .with_max_record_bytes(st.broker.max_record_bytes());
                let mut p =
                    super::process::Processor::new(&catalog, &limits, crate::clock::now_ms());
                release(tx, &t, |_, _| true, &mut p)
            })
        })
        .await?;
    Ok(Resumed {
        tenant: tenant.to_string(),
        released: Some(released),
        partitions: None,
    })
}
