//! Membership in partition ownership (DESIGN §8.3): this replica's heartbeat and the view
//! of the leases bucket every replica keeps (who is a member, who holds which partition).
//!
//! **Guarantees.**
//! - **The heartbeat never waits for ownership work.** It runs on a task of its own and is
//!   written every TTL/3 while the node's mode owns partitions, so a long hand-over or start
//!   never makes the others rebalance around a member that is still here. When the mode
//!   stops owning partitions the key is deleted at once. A failing heartbeat is logged once
//!   per episode (named as a leader election when it looks like one), and again when it is
//!   stored.
//! - **A rebuilt view is never half-filled.** [`fresh_view`] returns only after the watch
//!   delivered the bucket's history (or after a second for an empty bucket).
//! - The view is advice: leases, not the view, decide who holds a partition (a stale view
//!   at worst delays a take or proposes a take the bucket refuses).
//! - **Outbox bytes travel with the heartbeat.** Each beat carries the bytes waiting in the
//!   node's outboxes of every tenant with a cap on them (`tenancy.outbox_byte_caps`); the
//!   view hands the other members' to the node's routers (`Relays::set_others`), so a cap
//!   counts the whole deployment, each other node's part at most one beat old.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::{self, Operation};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::clock::now_ms;
use crate::runtime::AppState;

/// The heartbeat key of member `node`.
pub(crate) fn member_key(node: &str) -> String {
    format!("m.{node}")
}

/// The bucket as watched: live members and partition holders.
#[derive(Default)]
pub(crate) struct View {
    pub(crate) members: BTreeMap<String, String>,
    pub(crate) holders: BTreeMap<u32, String>,
    /// Per member node, the bytes its heartbeat said wait in its outboxes, per tenant with
    /// a cap on them (`tenancy.outbox_byte_caps`).
    outbox: BTreeMap<String, BTreeMap<String, u64>>,
}

impl View {
    pub(crate) fn apply(&mut self, e: &kv::Entry) {
        let live = e.operation == Operation::Put;
        if let Some(node) = e.key.strip_prefix("m.") {
            if live {
                self.members.insert(e.key.clone(), node.to_string());
                let outbox = serde_json::from_slice::<serde_json::Value>(&e.value)
                    .ok()
                    .and_then(|v| serde_json::from_value(v.get("outbox")?.clone()).ok())
                    .unwrap_or_default();
                self.outbox.insert(node.to_string(), outbox);
            } else {
                self.members.remove(&e.key);
                self.outbox.remove(node);
            }
        } else if let Some(p) = e.key.strip_prefix("p.").and_then(|p| p.parse().ok()) {
            // A handed-over lease is free (`ownership/lease.rs`).
            let owner = serde_json::from_slice::<serde_json::Value>(&e.value)
                .ok()
                .filter(|v| v.get("handoff").is_none())
                .and_then(|v| v.get("owner").and_then(|o| o.as_str()).map(str::to_string));
            match (live, owner) {
                (true, Some(o)) => {
                    self.holders.insert(p, o);
                }
                _ => {
                    self.holders.remove(&p);
                }
            }
        }
    }
}

impl View {
    /// What every member but `me` said waits in its outboxes.
    pub(crate) fn outbox_of_others(&self, me: &str) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.outbox
            .iter()
            .filter(|(node, _)| node.as_str() != me)
            .map(|(n, m)| (n.clone(), m.clone()))
            .collect()
    }
}

/// The bytes waiting in this node's outboxes of each tenant with a cap on them, as its
/// heartbeat carries them (bounded by the tenants the config names).
fn capped_outbox(state: &AppState) -> BTreeMap<String, u64> {
    let caps = state.limits.get();
    if caps.outbox_byte_caps.is_empty() {
        return BTreeMap::new();
    }
    state
        .relays
        .bytes_by_tenant()
        .into_iter()
        .filter(|(t, n)| *n > 0 && caps.outbox_byte_caps.contains_key(t))
        .collect()
}

/// Writes this member's heartbeat every TTL/3 while the node's mode owns partitions (and
/// deletes it when the mode stops owning them), until `stop`; `joined` holds when the
/// current membership's first heartbeat was stored.
pub(crate) async fn heartbeat(
    state: Arc<AppState>,
    leases: kv::Store,
    joined: tokio::sync::watch::Sender<Option<Instant>>,
    stop: CancellationToken,
) {
    let every = state.config.partitions.lease_ttl.get() / 3;
    let key = member_key(&state.node_id);
    let mut mode = state.placement.watch_mode();
    let mut beating = false;
    // Failures since the last stored heartbeat: logged once per episode (finding 19).
    let mut failing: Option<(Instant, u32)> = None;
    loop {
        let mut wait = every;
        if state.placement.mode().owns_partitions() {
            let beat = serde_json::json!({
                "node": state.node_id,
                "at_ms": now_ms(),
                "outbox": capped_outbox(&state),
            });
            match leases.put(&key, beat.to_string().into()).await {
                Ok(_) => {
                    if let Some((since, tries)) = failing.take() {
                        tracing::info!(
                            message = "Heartbeat stored again.",
                            failed_attempts = tries,
                            seconds = since.elapsed().as_secs()
                        );
                    }
                    beating = true;
                    joined.send_if_modified(|j| {
                        let first = j.is_none();
                        j.get_or_insert_with(Instant::now);
                        first
                    });
                }
                Err(e) => {
                    wait = every / 4;
                    match &mut failing {
                        Some((_, tries)) => *tries += 1,
                        None => {
                            failing = Some((Instant::now(), 1));
                            if crate::relay::election::is_election(&e.to_string()) {
                                tracing::warn!(message = "Heartbeat not answered: the leases bucket is electing a leader (or unreachable); retrying, logged again when it succeeds.", error = %e);
                            } else {
                                tracing::warn!(message = "Heartbeat failed; retrying, logged again when it succeeds.", error = %e);
                            }
                        }
                    }
                }
            }
        } else if beating {
            beating = false;
            joined.send_replace(None);
            let _ = leases.delete(&key).await;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = mode.changed() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// A new watch of the whole bucket and the view it gives once its history is delivered
/// (or after a second, for an empty bucket), so a rebuilt view is never seen half-filled.
pub(crate) async fn fresh_view(leases: &kv::Store) -> Result<(kv::Watch, View), kv::WatchError> {
    let mut w = leases.watch_with_history(">").await?;
    let mut view = View::default();
    let until = tokio::time::Instant::now() + Duration::from_secs(1);
    while let Ok(Some(Ok(entry))) = tokio::time::timeout_at(until, w.next()).await {
        view.apply(&entry);
        if entry.delta == 0 {
            break;
        }
    }
    Ok((w, view))
}
