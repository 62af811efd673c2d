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
//! Guarantees: a control input is idempotent — a second copy (a republish, a replay) finds
//! nothing pending and does nothing; only the partition that holds the key acts on it; an
//! unknown control input is logged and skipped, never dead-lettered.

use std::sync::Arc;

use libmdbx::RW;
use serde_json::Value as Json;

use super::admission::RawInput;
use super::partition::partition;
use super::pause;
use super::process::Processor;
use crate::broker::{BrokerError, headers};
use crate::deadletter;
use crate::runtime::AppState;
use crate::storage::{Result, Tables};

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
    let body = body.to_string();
    let inbox = &state.config.streams.saga_inbox;
    let err = |e: &dyn std::fmt::Display| BrokerError::JetStream {
        op: "publish",
        stream: inbox.clone(),
        reason: e.to_string(),
    };
    for p in partitions {
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

impl Processor<'_> {
    /// Applies a control input from a partition's inbox, at this point of its log:
    /// `{"resume": tenant}` releases what this partition holds for the tenant;
    /// `{"redrive": {tenant, saga, correlation_id}}` redrives the letter that parks that key
    /// (and what is held behind it), as `runner dlq redrive` does in single-active mode.
    pub fn control(&mut self, tx: &Tables<'_, RW>, raw: &RawInput) -> Result<()> {
        let body: Json = serde_json::from_slice(&raw.body).unwrap_or(Json::Null);
        if let Some(key) = body.get("redrive") {
            let field = |k: &str| key.get(k).and_then(Json::as_str).unwrap_or_default();
            let (tenant, saga, corr) = (field("tenant"), field("saga"), field("correlation_id"));
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
            |saga, corr| {
                scope.is_none_or(|s| partition(tenant, saga, corr, s.count) == s.partition)
            },
            self,
        )?;
        tracing::info!(
            message = "Held inputs released.",
            tenant,
            keys = released.keys,
            inputs = released.inputs,
            kept = released.kept
        );
        Ok(())
    }
}
