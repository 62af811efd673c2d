//! The take-over of one partition whose lease this replica just won: raise its fences,
//! restore its state, then start its fenced relay and its consumer loop.
//!
//! Guarantees kept here:
//! - **Fenced before work.** The consumer loop and the relay start only after every fence
//!   the partition publishes under was raised at this lease's epoch; a fence that cannot be
//!   raised gives the lease back and starts nothing.
//! - **Restored before work.** A lease handed over names its snapshot, and that snapshot
//!   (or a newer local copy) is in place before the first input is read; a restore that
//!   fails gives the lease back and starts nothing.
//! - **Stored records first.** What the partition's outbox already holds (restored, or left
//!   by an earlier owner on this node) is counted in its relay handle before anything new is
//!   written, so the relay publishes it first and backpressure sees it.
//! - **A lease given back keeps its snapshot.** A lease inherited from a hand-over and given
//!   back unused names the same snapshot again, so the next taker waits for it too.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::claims;
use super::keeper::Kept;
use super::snapshot::{self, Restored};
use super::{Running, Snap, partition_checkpoint};
use crate::broker::fence::Fence;
use crate::broker::stream_specs;
use crate::clock::now_ms;
use crate::relay::RelayHandle;
use crate::relay::fenced::{Fenced, PartitionRelay};
use crate::runtime::AppState;
use crate::worker::commit::{Committer, Scoped};
use crate::worker::consume::{self, Input};

/// Raises the fences of a newly won partition and starts its consumer loop and relay.
pub(super) async fn start(
    state: &Arc<AppState>,
    snap: &Snap,
    p: u32,
    lease: Kept,
    committer: &Committer,
) -> Option<Running> {
    let started = Instant::now();
    let Some(fences) = raise_fences(state, p, &lease).await else {
        give_back(lease).await;
        return None;
    };
    // What earlier owners applied: at least every input their outputs came from.
    let replay_until = fences
        .values()
        .filter_map(|f| f.through().map(|t| t.seq))
        .max()
        .unwrap_or(0);
    let Some(restored) = restore(state, snap, p, &lease, replay_until).await else {
        give_back(lease).await;
        return None;
    };
    let Some(handle) = stored_outbox(state, p).await else {
        give_back(lease).await;
        return None;
    };
    let handle_for_depth = handle.clone();
    let (relay_stop, relay) = spawn_relay(state, p, fences, &handle);
    let input = Input {
        stream: state.config.streams.saga_inbox.clone(),
        filters: vec![format!("runner.inbox.{p}.>")],
        checkpoint: partition_checkpoint(state, p),
        scope: Scoped {
            partition: p,
            count: state.config.partitions.count,
            relay: handle.clone(),
            replay_until,
        },
    };
    let consume_stop = CancellationToken::new();
    let consume = tokio::spawn(consume::run(
        state.clone(),
        input,
        handle,
        committer.clone(),
        consume_stop.clone(),
    ));
    note_taken(state, p, &lease, started, &restored, replay_until);
    Some(Running {
        _registered: state.relays.register(handle_for_depth),
        lease,
        consume_stop,
        consume,
        relay_stop,
        relay,
    })
}

/// How an operator clears a partition's refused marker.
const RESET: &str =
    "the partition is not taken until an operator resets it (POST /admin/partition-fence)";

/// Raises partition `p`'s fence at the lease's epoch in every fenced stream it publishes
/// to (the inbox it reads is not one of them). A marker whose claims cannot be genuine
/// (`claims.rs`: an epoch past the leases bucket, a watermark past the inbox) is refused,
/// not obeyed. `None`, logged once per episode and counted as a stall, when one cannot be
/// raised: the caller gives the lease back.
async fn raise_fences(state: &AppState, p: u32, lease: &Kept) -> Option<HashMap<String, Fence>> {
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let mut fences = HashMap::new();
    for spec in stream_specs(&state.config.streams) {
        if !spec.fenced || spec.name == state.config.streams.saga_inbox {
            continue;
        }
        let raised = match Fence::observe(js, &spec.name, p).await {
            Ok(seen) => match claims::marker(state, &seen, inbox, RESET).await {
                Ok(()) => seen
                    .raise(js, lease.epoch(), &state.node_id)
                    .await
                    .map_err(|e| e.to_string()),
                // Not checked (a broker fault): like any failure to raise, retried.
                Err(claims::Unaccepted::Unchecked(why)) => Err(why),
                Err(claims::Unaccepted::Refused(refused)) => {
                    if state.metrics.stalls.failed(&stage(p), &refused) {
                        tracing::error!(message = "Partition not taken: a fence marker is refused.", partition = p, stream = %spec.name, reason = %refused);
                    }
                    return None;
                }
            },
            Err(e) => Err(e.to_string()),
        };
        match raised {
            Ok(f) => {
                fences.insert(spec.name.clone(), f);
            }
            Err(e) => {
                // Counted as a stall (`/health`), logged once per episode.
                if state.metrics.stalls.failed(&stage(p), &e) {
                    if crate::relay::election::is_election(&e) {
                        tracing::warn!(message = "Cannot raise a partition fence: the stream is electing a leader (or unreachable); giving the lease back (logged once until it starts).", partition = p, stream = %spec.name, error = %e);
                    } else {
                        tracing::warn!(message = "Cannot raise a partition fence; giving the lease back (logged once until it starts).", partition = p, stream = %spec.name, error = %e);
                    }
                }
                return None;
            }
        }
    }
    Some(fences)
}

/// Puts partition `p`'s state in place: the snapshot a hand-over named (waiting half a TTL
/// at most for the listing to show it), else the newest one or the local copy. Counts where
/// the state came from, and reports inputs the inbox no longer keeps when the restored
/// checkpoint lies before what earlier owners applied (`replay_until`). `None`, logged once
/// per episode, when the restore fails: the caller gives the lease back.
async fn restore(
    state: &AppState,
    snap: &Snap,
    p: u32,
    lease: &Kept,
    replay_until: u64,
) -> Option<Restored> {
    let inbox = &state.config.streams.saga_inbox;
    let restored = match claims::last_sequence(state, inbox).await {
        Ok(inbox_last) => {
            let trust = snapshot::Trust {
                seal: state.seal.clone(),
                inbox_last,
            };
            snapshot::restore_handed_over(
                &state.store,
                &snap.bucket,
                &snap.how,
                p,
                lease.handed_over_at().unwrap_or(0),
                lease.ttl() / 2,
                &trust,
            )
            .await
            .map_err(|e| e.to_string())
        }
        Err(e) => Err(format!("cannot read the inbox {inbox}: {e}")),
    };
    let restored = match restored {
        Ok(r) => r,
        Err(e) => {
            if state.metrics.stalls.failed(&stage(p), &e) {
                tracing::warn!(message = "Cannot restore a partition; giving the lease back (logged once until it starts).", partition = p, error = %e);
            }
            return None;
        }
    };
    if restored.refused > 0 {
        state
            .metrics
            .refused_objects
            .with_label_values(&[crate::telemetry::names::REFUSED_OBJECTS[0]])
            .inc_by(u64::from(restored.refused));
    }
    state
        .metrics
        .partition_restores
        .with_label_values(&[if restored.downloaded {
            "snapshot"
        } else {
            "local"
        }])
        .inc();
    if restored.checkpoint < replay_until
        && let Ok(true) =
            snapshot::retention_gap(state.broker.jetstream(), inbox, restored.checkpoint).await
    {
        state.metrics.retention_gaps.inc();
        tracing::error!(message = "Inputs this partition needs are gone from the inbox: its state cannot be rebuilt exactly. Keep the inbox longer than snapshot age plus the longest outage.", partition = p, checkpoint = restored.checkpoint, stream = %inbox);
    }
    Some(restored)
}

/// A new relay handle for partition `p`, counting the records its outbox already stores;
/// `None` when they cannot be counted (the take is given up and tried again: a relay
/// publishing records nobody counted would leave the node's outbox depth short of them).
async fn stored_outbox(state: &AppState, p: u32) -> Option<RelayHandle> {
    let handle = state.relays.handle_for(p);
    // The partition's stored records (restored, or left by an earlier owner on this node)
    // are published first: counted from the start.
    let stored = state
        .store
        .read(move |t| Ok((t.outbox_len(p as u16)?, t.outbox_bytes_by_tenant(p as u16)?)))
        .await;
    match stored {
        Ok((n, bytes)) => {
            handle.note_stored(n);
            handle.note_bytes(bytes);
            Some(handle)
        }
        Err(e) => {
            tracing::warn!(message = "Cannot count the partition's stored outbox; the partition is not taken now.", partition = p, error = %e);
            None
        }
    }
}

/// Spawns partition `p`'s fenced relay, publishing only under `fences`; returns its stop
/// token and its task.
fn spawn_relay(
    state: &AppState,
    p: u32,
    fences: HashMap<String, Fence>,
    handle: &RelayHandle,
) -> (CancellationToken, JoinHandle<Result<(), Fenced>>) {
    // Built once: the relay looks the stream of every record up in it.
    let specs = stream_specs(&state.config.streams);
    let relay = PartitionRelay {
        js: state.broker.jetstream().clone(),
        client: state.broker.client().clone(),
        store: state.store.clone(),
        metrics: state.metrics.clone(),
        partition: p,
        handle: handle.clone(),
        fences,
        stream_of: Box::new(move |subject| {
            crate::broker::stream_for(&specs, subject).map(|s| s.name.clone())
        }),
        window: state.config.saga.relay_window,
        poll: state.config.saga.relay_poll.get(),
        timeout: state.config.nats.request_timeout.get(),
        shared: state.shared_batches.clone(),
        transport: crate::broker::fenced_batch::Transport::for_replicas(
            state.config.streams.replicas,
        ),
    };
    let relay_stop = CancellationToken::new();
    let relay = tokio::spawn(relay.run(relay_stop.clone()));
    (relay_stop, relay)
}

/// Records that partition `p` was taken: its stall cleared, placement, the lease metrics,
/// how long the start took, and one log line.
fn note_taken(
    state: &AppState,
    p: u32,
    lease: &Kept,
    started: Instant,
    restored: &Restored,
    replay_until: u64,
) {
    state.metrics.stalls.progressed(&stage(p));
    state.placement.took(p, lease.epoch(), now_ms());
    // The partition's lag exists from the take (0 until its loop reports one).
    state
        .metrics
        .partition_lag
        .with_label_values(&[&p.to_string()]);
    state
        .metrics
        .lease_events
        .with_label_values(&["acquired"])
        .inc();
    if lease.handed_over_at().is_some() {
        state
            .metrics
            .lease_events
            .with_label_values(&["inherited"])
            .inc();
    }
    state
        .metrics
        .partition_epoch
        .with_label_values(&[&p.to_string()])
        .set(lease.epoch() as i64);
    state
        .metrics
        .partition_start_seconds
        .observe(started.elapsed().as_secs_f64());
    tracing::info!(
        message = "Partition taken.",
        partition = p,
        epoch = lease.epoch(),
        checkpoint = restored.checkpoint,
        replay_until,
        from_snapshot = restored.downloaded,
        handed_over_at = ?lease.handed_over_at()
    );
}

/// Partition `p`'s start among the stalled stages ([`crate::telemetry::stall`]).
fn stage(p: u32) -> String {
    format!("partition.p{p}")
}

/// Gives back a lease whose partition could not be started. Nothing was applied under it,
/// so a lease inherited from a hand-over is handed over again with the same snapshot: the
/// next taker still knows which one to wait for.
async fn give_back(lease: Kept) {
    let _ = match lease.handed_over_at() {
        Some(checkpoint) => lease.hand_over(checkpoint).await,
        None => lease.release().await,
    };
}
