//! Control inputs: operator actions that travel through a partition's inbox
//! (`runner.inbox.<p>.control`, routed subject [`CONTROL_SUBJECT`]) so the partition's owner
//! applies them in log order, inside its own commit and fences — and a new owner replaying
//! the partition applies them at the same point.
//!
//! | body | what the owner does |
//! |---|---|
//! | `{"resume": tenant}` | releases what the partition holds for the paused tenant (`pause.rs`) |
//! | `{"redrive": {tenant, saga, correlation_id}}` | redrives the letter that parks that key, then what is held behind it |
//!
//! Pausing and resuming a tenant starts here too ([`pause`] / [`resume`]): the pause is key
//! `paused.<tenant>` of the KV bucket `saga.control_bucket`, which every saga node loads
//! before its worker starts ([`load`]) and watches ([`watch`]); what a pause holds and how a
//! release applies it is `pause.rs`.
//!
//! Guarantees: a control input is idempotent — a second copy (a republish, a replay) finds
//! nothing pending and does nothing; only the partition that holds the key acts on it; an
//! unknown control input is logged and skipped, never dead-lettered.

use std::sync::Arc;

use async_nats::jetstream::kv;
use futures::StreamExt;
use libmdbx::RW;
use serde::Serialize;
use serde_json::Value as Json;
use tokio_util::sync::CancellationToken;

use super::admission::RawInput;
use super::partition::partition;
use super::pause;
use super::process::Processor;
use crate::backoff::Backoff;
use crate::broker::{BrokerError, headers};
use crate::deadletter;
use crate::deadletter::kind;
use crate::runtime::AppState;
use crate::saga::Route;
use crate::seal::Seal;
use crate::storage::{Result, StorageError, Tables};

/// The subject of a control input in a partition's inbox (never a tenant's subject).
pub const CONTROL_SUBJECT: &str = "runner.control";

/// Publishes control input `body` into the inbox of each partition in `partitions`.
pub async fn send(
    state: &AppState,
    tenant: &str,
    body: &Json,
    partitions: impl IntoIterator<Item = u32>,
) -> std::result::Result<(), BrokerError> {
    let js = state.broker.jetstream();
    let id = uuid::Uuid::now_v7();
    let issued_ms = crate::clock::now_ms();
    let inbox = &state.config.streams.saga_inbox;
    let err = |e: &dyn std::fmt::Display| BrokerError::JetStream {
        op: "publish",
        stream: inbox.clone(),
        reason: e.to_string(),
    };
    for p in partitions {
        let body = sealed(&state.seal, body, p, issued_ms).to_string();
        let mut h = headers::outgoing(&format!("control:{id}:{p}"), Some(tenant), None);
        h.insert(headers::ROUTED_SUBJECT, CONTROL_SUBJECT);
        h.insert(headers::ROUTED_SOURCE, "control");
        js.publish_with_headers(format!("runner.inbox.{p}.control"), h, body.clone().into())
            .await
            .map_err(|e| err(&e))?
            .await
            .map_err(|e| err(&e))?;
    }
    Ok(())
}

/// `body` with the time it is issued and, with a deployment key, its seal over what decides
/// what it does in partition `p` ([`decisive`]).
fn sealed(seal: &Seal, body: &Json, p: u32, issued_ms: u64) -> Json {
    let mut body = body.clone();
    if let Some(map) = body.as_object_mut() {
        map.insert("issued_ms".into(), issued_ms.into());
    }
    if let Some(tag) = seal.seal(&decisive(&body, p).as_fields())
        && let Some(map) = body.as_object_mut()
    {
        map.insert("seal".into(), tag.into());
    }
    body
}

/// What decides what a control input does, in a fixed order: the action and its key, the
/// partition it is for and when it was issued. This is what a seal covers.
struct Decisive {
    fields: Vec<String>,
}

impl Decisive {
    fn as_fields(&self) -> Vec<&[u8]> {
        self.fields.iter().map(|f| f.as_bytes()).collect()
    }
}

fn decisive(body: &Json, p: u32) -> Decisive {
    let text = |v: Option<&Json>| v.and_then(Json::as_str).unwrap_or_default().to_string();
    let mut fields = vec!["runner-control".to_string(), p.to_string()];
    fields.push(
        body.get("issued_ms")
            .and_then(Json::as_u64)
            .map_or(String::new(), |t| t.to_string()),
    );
    if let Some(key) = body.get("redrive") {
        fields.push("redrive".into());
        for k in ["tenant", "saga", "correlation_id"] {
            fields.push(text(key.get(k)));
        }
    } else {
        fields.push("resume".into());
        fields.push(text(body.get("resume")));
    }
    Decisive { fields }
}

/// Why a control input is refused: its seal does not check, or (with a key) it was stored
/// further from when it was issued than `saga.max_clock_skew` allows — a sealed input
/// published again later. `None`: apply it.
fn refusal(
    limits: &super::admission::Limits,
    body: &Json,
    p: u32,
    stored_ms: Option<u64>,
) -> Option<String> {
    let tag = body.get("seal").and_then(Json::as_str);
    if let Err(e) = limits.seal.check(&decisive(body, p).as_fields(), tag) {
        return Some(format!("control input refused: {e}"));
    }
    if !limits.seal.enabled() {
        return None;
    }
    let issued = body.get("issued_ms").and_then(Json::as_u64)?;
    let stored = stored_ms?;
    (stored.abs_diff(issued) > limits.max_clock_skew_ms).then(|| {
        format!(
            "control input refused: issued at {issued} ms but stored at {stored} ms, further \
             apart than saga.max_clock_skew allows (a sealed control input published again)"
        )
    })
}

impl Processor<'_> {
    /// Applies a control input from a partition's inbox, at this point of its log:
    /// `{"resume": tenant}` releases what this partition holds for the tenant;
    /// `{"redrive": {tenant, saga, correlation_id}}` redrives the letter that parks that key
    /// (and what is held behind it), in the partition's log order.
    pub fn control(&mut self, tx: &Tables<'_, RW>, raw: &RawInput) -> Result<()> {
        let body: Json = serde_json::from_slice(&raw.body).unwrap_or(Json::Null);
        if let Some(reason) = refusal(self.limits, &body, self.scope.partition, raw.stored_ms) {
            let claimed = body
                .get("resume")
                .or_else(|| body.get("redrive").and_then(|r| r.get("tenant")))
                .and_then(Json::as_str)
                .filter(|t| crate::worker::admission::is_tenant(t))
                .unwrap_or("_")
                .to_string();
            tracing::warn!(message = "Control input refused.", source = %raw.source, reason = %reason);
            return self.dead_letter(tx, raw, &claimed, kind::UNSEALED_CONTROL, reason, None);
        }
        if let Some(key) = body.get("redrive") {
            let field = |k: &str| key.get(k).and_then(Json::as_str).unwrap_or_default();
            let (tenant, saga, corr) = (field("tenant"), field("saga"), field("correlation_id"));
            let route = Route {
                saga: saga.to_string(),
                correlation_id: corr.to_string(),
            };
            if !self.scope.owns(tenant, &route) {
                // Another partition's key (the store is shared by the node's partitions):
                // redriven here, its inputs would be applied outside its own log.
                tracing::warn!(
                    message = "Redrive of a key of another partition ignored.",
                    tenant,
                    saga,
                    correlation_id = corr,
                    partition = self.scope.partition
                );
                return Ok(());
            }
            let Some(first) = tx.parked_by(tenant, saga, corr)? else {
                tracing::info!(
                    message = "Redrive of a key that is not parked (any more): nothing to do.",
                    tenant,
                    saga,
                    correlation_id = corr
                );
                return Ok(());
            };
            match deadletter::redrive_in(tx, tenant, first, self)? {
                Ok(ids) => tracing::info!(
                    message = "Dead letter redriven.",
                    tenant,
                    id = first,
                    processed = ids.len()
                ),
                Err(e) => {
                    tracing::warn!(message = "Redrive refused.", tenant, id = first, error = %e)
                }
            }
            return Ok(());
        }
        let Some(tenant) = body.get("resume").and_then(Json::as_str) else {
            tracing::warn!(message = "Unknown control input ignored.", source = %raw.source);
            return Ok(());
        };
        Arc::make_mut(&mut self.paused).remove(tenant);
        self.tally.resumed.push(tenant.to_string());
        let scope = self.scope;
        let released = pause::release(
            tx,
            tenant,
            |saga, corr| partition(tenant, saga, corr, scope.count) == scope.partition,
            self,
        )?;
        tracing::info!(
            message = "Held inputs released.",
            tenant,
            keys = released.keys,
            inputs = released.inputs,
            kept = released.kept
        );
        // What ended while the tenant was paused let no key held at its cap go: now it may.
        self.freed(tenant);
        Ok(())
    }
}

/// The bucket key of a paused tenant.
fn key(tenant: &str) -> String {
    format!("paused.{tenant}")
}

/// Which tenants can be paused, in words (see [`pausable`]).
pub const PAUSE_RULE: &str = "a paused tenant is a key of the control bucket: 1 to 128 bytes \
     of ASCII letters, digits, `-`, `_`, `=` and `/`";

/// Whether `tenant` can be paused: a tenant ([`is_tenant`]) that is also a NATS KV key
/// token, so [`key`] is a key the bucket takes (a tenant the bucket refuses would otherwise
/// fail at the put, as if the broker were down).
///
/// [`is_tenant`]: crate::worker::admission::is_tenant
pub fn pausable(tenant: &str) -> bool {
    crate::worker::admission::is_tenant(tenant)
        && tenant
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_=/".contains(&b))
}

/// Why a pause or resume failed.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    /// The tenant cannot be paused ([`pausable`]).
    #[error(
        "tenant `{}` cannot be paused or resumed: {PAUSE_RULE}",
        crate::worker::admission::shown_tenant(.0)
    )]
    BadTenant(String),
    /// The bucket or the inbox could not be written.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The store failed.
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
pub async fn bucket(state: &AppState) -> std::result::Result<kv::Store, BrokerError> {
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
pub async fn load(state: &AppState) -> std::result::Result<kv::Watch, BrokerError> {
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
pub async fn pause(state: &AppState, tenant: &str) -> std::result::Result<(), PauseError> {
    if !pausable(tenant) {
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
    /// The partitions whose inboxes carry the resume (each owner releases its keys when it
    /// reads it).
    pub partitions: u32,
}

/// Resumes `tenant` on every node and releases what was held for it.
pub async fn resume(
    state: &Arc<AppState>,
    tenant: &str,
) -> std::result::Result<Resumed, PauseError> {
    if !pausable(tenant) {
        return Err(PauseError::BadTenant(tenant.to_string()));
    }
    let kv = bucket(state).await?;
    kv.delete(key(tenant))
        .await
        .map_err(|e| kv_err(&state.config.saga.control_bucket, "delete", e))?;
    state.paused.remove(tenant);
    tracing::info!(message = "Tenant resumed; releasing what was held.", tenant = %tenant);
    let count = state.config.partitions.count;
    let body = serde_json::json!({ "resume": tenant });
    send(state, tenant, &body, 0..count).await?;
    Ok(Resumed {
        tenant: tenant.to_string(),
        partitions: count,
    })
}
