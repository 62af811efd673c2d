//! The ownership task: one per replica, it keeps the watched view of the leases bucket
//! fresh, and on each tick stops what it no longer holds ([`reap`]), takes what the
//! assignment gives it and hands over one partition held beyond its share ([`balance`]),
//! then, on cancellation, drains: every partition stops reading at once and each is handed
//! over in turn before the heartbeat is deleted.
//!
//! Guarantees kept here: a partition whose lease is gone is stopped on the next tick
//! without waiting for anything; nothing new is taken once a drain began; the view is
//! rebuilt from a fresh watch at least once a TTL, so a watch that silently stopped never
//! freezes it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::assign::assign;
use super::hand::hand_over;
use super::keeper::Kept;
use super::lease::Lease;
use super::members::{View, fresh_view, heartbeat, member_key};
use super::snapshot::{self, partitioning};
use super::take::start;
use super::{Ctx, Running, Snap, forget, partition_key};
use crate::runtime::AppState;
use crate::worker::commit::Committer;

/// Partitions started at the same time by one replica.
const STARTS_AT_ONCE: usize = 16;

/// Runs partition ownership until `cancel` fires and every partition is handed over.
pub(crate) async fn run(ctx: Ctx, cancel: CancellationToken) {
    let Ctx {
        state,
        leases,
        snapshots,
        committer,
    } = ctx;
    count_live(&state).await;
    let how = partitioning(&state.config, state.config.partitions.count);
    let store_ctx = Snap::new(snapshots, how, state.config.partitions.snapshot_keep);
    let mut snapshot_at = Instant::now();
    // Until the first round, the configured interval; then as the last round says.
    let mut snapshot_every = state.config.partitions.snapshot_interval.get();
    // For the "inbox retention shorter than snapshot age" alert: what the inbox keeps.
    let inbox = &state.config.streams.saga_inbox;
    match snapshot::retention_of(state.broker.jetstream(), inbox).await {
        Ok(age) => state
            .metrics
            .inbox_retention
            .set(i64::try_from(age.as_secs()).unwrap_or(i64::MAX)),
        Err(e) => {
            tracing::warn!(message = "Cannot read the inbox's retention.", stream = %inbox, error = %e)
        }
    }
    let ttl = state.config.partitions.lease_ttl.get();
    let tick = ttl / 20;
    let me = state.node_id.clone();
    // The heartbeat has a task of its own too, so a long hand-over or start never lets it
    // lapse (which would make the others rebalance around a member that is still here).
    let beat_stop = CancellationToken::new();
    let (joined_tx, joined) = tokio::sync::watch::channel(None);
    let beat = tokio::spawn(heartbeat(
        state.clone(),
        leases.clone(),
        joined_tx,
        beat_stop.clone(),
    ));
    let mut running: BTreeMap<u32, Running> = BTreeMap::new();
    let mut view = View::default();
    let mut watch = None;
    let mut watched_at = Instant::now();
    let mut mode = state.placement.watch_mode();
    while !cancel.is_cancelled() {
        // The view is rebuilt from a fresh watch every TTL as well as after a failure: a
        // watch that silently stopped (its server died) must not freeze the view.
        if watch.is_none() || watched_at.elapsed() >= ttl {
            match fresh_view(&leases).await {
                Ok((w, v)) => {
                    view = v;
                    watch = Some(w);
                    watched_at = Instant::now();
                }
                Err(e) => {
                    watch = None;
                    tracing::warn!(message = "Cannot watch the leases bucket.", error = %e);
                }
            }
        }
        state.placement.set_members(view.members.len());
        // The other nodes' outbox bytes of tenants with a cap on them (the routers' door).
        state
            .relays
            .set_others(view.outbox_of_others(&state.node_id));
        let member = state.placement.mode().owns_partitions();
        // Replicas started together first see each other for a moment before taking
        // anything, so they do not all take everything and then hand most of it back.
        let settled = joined
            .borrow()
            .is_some_and(|j: Instant| j.elapsed() >= ttl / 5);
        reap(&state, &mut running);
        if !member {
            if let Some(&p) = running.keys().next() {
                hand_over(&state, &store_ctx, &mut running, p).await;
            }
        } else if watch.as_ref().is_some() && settled {
            balance(&state, &store_ctx, &leases, &mut running, &view, &committer).await;
        }
        if snapshot_at.elapsed() >= snapshot_every {
            snapshot_at = Instant::now();
            let held: Vec<u32> = running.keys().copied().collect();
            snapshot_every = store_ctx.round(&state, &held).await;
        }
        let event = async {
            match watch.as_mut() {
                Some(w) => w.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = mode.changed() => {}
            _ = tokio::time::sleep(tick) => {}
            e = event => match e {
                Some(Ok(entry)) => view.apply(&entry),
                Some(Err(err)) => {
                    tracing::warn!(message = "Leases watch failed; reopening.", error = %err);
                    watch = None;
                }
                None => watch = None,
            },
        }
        // Drain the rest of what the watch has ready before acting on the view (outside
        // tokio's cooperative budget, which would stop the drain after 128 entries and
        // leave the view partial for a tick: a burst of lease changes over hundreds of
        // partitions is larger than that).
        if let Some(w) = watch.as_mut() {
            while let Some(Some(Ok(entry))) =
                futures::FutureExt::now_or_never(tokio::task::unconstrained(w.next()))
            {
                view.apply(&entry);
            }
        }
    }
    // Every partition stops reading at once; then each is handed over in turn (flush,
    // snapshot, lease), so the drain takes no input after it began.
    for r in running.values() {
        r.consume_stop.cancel();
    }
    let owned: Vec<u32> = running.keys().copied().collect();
    for p in owned {
        hand_over(&state, &store_ctx, &mut running, p).await;
    }
    beat_stop.cancel();
    let _ = beat.await;
    let _ = leases.delete(member_key(&me)).await;
    tracing::info!(message = "Partitions handed over.");
}

/// Counts each tenant's running instances per partition, once, in a store written before
/// those counts were kept (`storage/tables/live.rs`); a failure is logged and the count is
/// tried again at the next start.
async fn count_live(state: &AppState) {
    let count = state.config.partitions.count;
    let counted = state
        .store
        .write(move |t| {
            t.count_if_missing(count, |tenant, saga, corr| {
                crate::worker::partition::partition(tenant, saga, corr, count)
            })
        })
        .await;
    match counted {
        Ok(Some(n)) => {
            tracing::info!(
                message = "Counted each tenant's running instances.",
                instances = n
            )
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(message = "Cannot count each tenant's running instances.", error = %e)
        }
    }
}

/// Stops partitions whose lease is gone (its keeper renews it; see [`Kept`]) or whose relay
/// was fenced off or ended. Never waits.
fn reap(state: &AppState, running: &mut BTreeMap<u32, Running>) {
    let mut dead = Vec::new();
    for (p, r) in running.iter() {
        if r.relay.is_finished() {
            dead.push((*p, "fenced"));
            continue;
        }
        if !r.lease.is_valid() {
            dead.push((*p, "lost"));
        }
    }
    for (p, why) in dead {
        if let Some(r) = running.remove(&p) {
            r.consume_stop.cancel();
            r.relay_stop.cancel();
            r.consume.abort();
            r.relay.abort();
            forget(state, p);
            state.metrics.lease_events.with_label_values(&[why]).inc();
            tracing::warn!(
                message = "Partition stopped: no longer ours.",
                partition = p,
                reason = why,
                epoch = r.lease.epoch()
            );
        }
    }
    state.metrics.partitions_owned.set(running.len() as i64);
}

/// Takes free partitions assigned here; hands over one held beyond the share.
async fn balance(
    state: &Arc<AppState>,
    snap: &Snap,
    leases: &kv::Store,
    running: &mut BTreeMap<u32, Running>,
    view: &View,
    committer: &Committer,
) {
    let me = &state.node_id;
    let count = state.config.partitions.count;
    let members: Vec<String> = view.members.values().cloned().collect();
    if !members.contains(me) {
        return; // our own heartbeat is not visible yet
    }
    // What this replica holds it knows better than the watch, which may lag a write.
    let mut holders = view.holders.clone();
    holders.retain(|p, owner| owner != me || running.contains_key(p));
    for p in running.keys() {
        holders.insert(*p, me.clone());
    }
    let target = assign(count, &members, &holders);
    // The free partitions assigned here are taken side by side, a few at a time: each
    // start waits on the broker (a lease, a fence per stream, a snapshot listing), and one
    // after the other they made a fresh replica on a cluster take tens of seconds.
    let free: Vec<u32> = (0..count)
        .filter(|p| target[*p as usize].as_deref() == Some(me.as_str()))
        .filter(|p| !running.contains_key(p) && !holders.contains_key(p))
        .collect();
    let started: Vec<(u32, Option<Running>)> = futures::stream::iter(free)
        .map(|p| async move {
            if state.lifecycle.is_draining() {
                return (p, None); // nothing new is taken once a drain began
            }
            let ttl = state.config.partitions.lease_ttl.get();
            let key = partition_key(p);
            let store = Some(state.store_id.as_str());
            match Lease::reclaim_or_acquire(leases, &key, me, store, ttl).await {
                Ok(Some(lease)) => {
                    // Renewed from now on by its own task, however long the start takes.
                    let renewed = state.metrics.lease_events.with_label_values(&["renewed"]);
                    let lease = Kept::keep(lease, Some(renewed));
                    (p, start(state, snap, p, lease, committer).await)
                }
                Ok(None) => (p, None),
                Err(e) => {
                    tracing::warn!(message = "Cannot acquire a partition lease.", partition = p, error = %e);
                    (p, None)
                }
            }
        })
        .buffer_unordered(STARTS_AT_ONCE)
        .collect()
        .await;
    for (p, r) in started {
        if let Some(r) = r {
            running.insert(p, r);
        }
    }
    let surplus = running
        .keys()
        .copied()
        .find(|p| target[*p as usize].as_deref() != Some(me.as_str()));
    if let Some(p) = surplus {
        hand_over(state, snap, running, p).await;
    }
    state.metrics.partitions_owned.set(running.len() as i64);
}
