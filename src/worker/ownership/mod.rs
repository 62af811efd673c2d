//! Partition ownership (partitioned mode, DESIGN §8.3–§8.7): the sticky assignment (over
//! the members `members.rs` sees), one lease per owned partition, and the start and stop of each owned
//! partition's consumer loop and fenced relay.
//!
//! **The bucket** (`partitions.leases_bucket`, `max_age` = `partitions.lease_ttl`) holds
//! `m.<node>` — a member's heartbeat, written every TTL/3, gone TTL after the last one —
//! and `p.<partition>` — a partition's lease ([`lease`]). Every replica watches the
//! whole bucket (`members.rs`), so it sees members come and go and leases expire at once (limit markers).
//!
//! **Renewals run beside the task**, never in it: each held lease has its keeper
//! ([`keeper`]) and the heartbeat a task of its own, so a slow step here (a
//! hand-over's flush, a snapshot's upload or download) cannot let the other leases lapse.
//!
//! **Each tick** (a twentieth of the TTL, and on every bucket change) the task stops what
//! it no longer holds, computes the target ([`assign::assign`]) from the live members and
//! holders, takes every free partition assigned to it, and hands over at most one partition
//! it holds beyond its share (stop reading, flush the outbox, snapshot, hand the lease over
//! naming the snapshot; the heir sees the key freed, takes it, and waits for that snapshot
//! to be listed before restoring).
//!
//! **Guarantees.**
//! - **Stop before the deadline.** A partition whose lease is lost (renewal refused) or
//!   whose monotonic deadline passed is stopped at once — reading and publishing both —
//!   without waiting for anything.
//! - **Fenced before work.** A partition starts reading only after this owner raised its
//!   fence in every stream it publishes to ([`crate::broker::fence`]); its relay publishes only
//!   under those fences, so once an heir raised its own, nothing of this owner reaches a
//!   stream, however long it was paused.
//! - **In-flight batch on loss.** A batch being committed when the lease is lost still
//!   commits locally (harmless: a deterministic prefix of the partition's log); its outbox
//!   records are never published by this owner. The heir replays the inputs its copy lacks
//!   and publishes only what the fence watermark shows is missing.
//! - **Drain.** On cancellation every partition stops reading at once, then each is handed
//!   over the same way as a rebalance (flush, snapshot, hand over), one after the other with
//!   every lease still renewed, then the heartbeat is deleted. A hand-over whose flush completed leaves a
//!   snapshot covering everything applied and names it in the lease: the heir restores that
//!   one (waiting, up to half a TTL, for a bucket listing that lags the upload) and replays
//!   nothing.
//!
//! | file | owns |
//! |---|---|
//! | [`assign`] | sticky, balanced (±1) assignment of partitions to members |
//! | `members.rs` | this replica's heartbeat and the watched view of members and holders |
//! | [`lease`] | ownership leases in a KV bucket: acquire, renew, release, monotonic deadline |
//! | [`keeper`] | a held lease renewed by its own task, whatever its holder is busy with |
//! | [`snapshot`] | partition snapshots in an Object Store: upload, prune, restore |
//! | [`router`] | one router per source stream: leased, fenced, exact progress in its fence marker |
//! | [`upgrade`] | taking over what a single-active release left: its lease, outbox and positions |

pub mod assign;
pub mod keeper;
pub mod lease;
mod members;
pub mod router;
pub mod snapshot;
pub mod upgrade;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::commit::{Committer, Scoped};
use super::consume::{self, Input};
use crate::broker::fence::Fence;
use crate::broker::stream_specs;
use crate::clock::now_ms;
use crate::relay::RelayHandle;
use crate::relay::fenced::{Fenced, PartitionRelay};
use crate::runtime::AppState;
use crate::storage::snapshot::{Partitioning, partition_checkpoint_key};
use assign::assign;
use async_nats::jetstream::object_store::ObjectStore;
use keeper::Kept;
use lease::Lease;
use members::{View, fresh_view, heartbeat, member_key};
use snapshot::partitioning;

/// Partitions started at the same time by one replica.
const STARTS_AT_ONCE: usize = 16;

/// The lease key of partition `p`.
pub fn partition_key(p: u32) -> String {
    format!("p.{p}")
}

/// The checkpoint key of partition `p`: the last inbox sequence applied to it.
pub fn partition_checkpoint(state: &AppState, p: u32) -> String {
    partition_checkpoint_key(
        &state.config.consumers.saga,
        &state.config.streams.saga_inbox,
        p,
    )
}

/// What the ownership task works with.
pub(crate) struct Ctx {
    /// The shared context.
    pub state: Arc<AppState>,
    /// The leases bucket.
    pub leases: kv::Store,
    /// The snapshots bucket.
    pub snapshots: ObjectStore,
    /// The group commit.
    pub committer: Committer,
}

/// A partition this replica works on.
struct Running {
    /// Counts this partition's outbox in the node's depth while it is owned.
    _registered: crate::relay::Registered,
    lease: Kept,
    consume_stop: CancellationToken,
    consume: JoinHandle<()>,
    relay_stop: CancellationToken,
    relay: JoinHandle<Result<(), Fenced>>,
}

/// Runs partition ownership until `cancel` fires and every partition is handed over.
pub(crate) async fn run(ctx: Ctx, cancel: CancellationToken) {
    let Ctx {
        state,
        leases,
        snapshots,
        committer,
    } = ctx;
    let how = partitioning(&state.config, state.config.partitions.count);
    let store_ctx = Snap {
        bucket: snapshots,
        how,
        keep: state.config.partitions.snapshot_keep,
    };
    let mut snapshot_at = Instant::now();
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
        if snapshot_at.elapsed() >= state.config.partitions.snapshot_interval.get() {
            snapshot_at = Instant::now();
            for &p in running.keys() {
                store_ctx.upload(&state, p).await;
            }
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

/// Raises the fences of a newly won partition and starts its consumer loop and relay.
async fn start(
    state: &Arc<AppState>,
    snap: &Snap,
    p: u32,
    lease: Kept,
    committer: &Committer,
) -> Option<Running> {
    let started = Instant::now();
    let js = state.broker.jetstream();
    let mut fences = std::collections::HashMap::new();
    for spec in stream_specs(&state.config.streams) {
        if !spec.fenced || spec.name == state.config.streams.saga_inbox {
            continue;
        }
        match Fence::raise(js, &spec.name, p, lease.epoch(), &state.node_id).await {
            Ok(f) => {
                fences.insert(spec.name.clone(), f);
            }
            Err(e) => {
                // Counted as a stall (`/health`), logged once per episode.
                if state.metrics.stalls.failed(&stage(p), &e) {
                    if crate::relay::election::is_election(&e.to_string()) {
                        tracing::warn!(message = "Cannot raise a partition fence: the stream is electing a leader (or unreachable); giving the lease back (logged once until it starts).", partition = p, stream = %spec.name, error = %e);
                    } else {
                        tracing::warn!(message = "Cannot raise a partition fence; giving the lease back (logged once until it starts).", partition = p, stream = %spec.name, error = %e);
                    }
                }
                give_back(lease).await;
                return None;
            }
        }
    }
    // What earlier owners applied: at least every input their outputs came from.
    let replay_until = fences
        .values()
        .filter_map(|f| f.through().map(|t| t.seq))
        .max()
        .unwrap_or(0);
    // A hand-over names its snapshot: wait for the listing to show it (half a TTL at most).
    let restored = match snapshot::restore_handed_over(
        &state.store,
        &snap.bucket,
        &snap.how,
        p,
        lease.handed_over_at().unwrap_or(0),
        lease.ttl() / 2,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            if state.metrics.stalls.failed(&stage(p), &e) {
                tracing::warn!(message = "Cannot restore a partition; giving the lease back (logged once until it starts).", partition = p, error = %e);
            }
            give_back(lease).await;
            return None;
        }
    };
    state
        .metrics
        .partition_restores
        .with_label_values(&[if restored.downloaded {
            "snapshot"
        } else {
            "local"
        }])
        .inc();
    let inbox = &state.config.streams.saga_inbox;
    if restored.checkpoint < replay_until
        && let Ok(true) = snapshot::retention_gap(js, inbox, restored.checkpoint).await
    {
        state.metrics.retention_gaps.inc();
        tracing::error!(message = "Inputs this partition needs are gone from the inbox: its state cannot be rebuilt exactly. Keep the inbox longer than snapshot age plus the longest outage.", partition = p, checkpoint = restored.checkpoint, stream = %inbox);
    }
    let handle = RelayHandle::new();
    // The partition's stored records (restored, or left by an earlier owner on this node)
    // are published first: counted from the start.
    match state.store.read(move |t| t.outbox_len(p as u16)).await {
        Ok(n) => handle.note_stored(n),
        Err(e) => {
            tracing::warn!(message = "Cannot count the partition's stored outbox.", partition = p, error = %e)
        }
    }
    let handle_for_depth = handle.clone();
    // Built once: the relay looks the stream of every record up in it.
    let specs = stream_specs(&state.config.streams);
    let relay = PartitionRelay {
        js: js.clone(),
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
    state.metrics.stalls.progressed(&stage(p));
    state.placement.took(p, lease.epoch(), now_ms());
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
    Some(Running {
        _registered: state.relays.register(handle_for_depth),
        lease,
        consume_stop,
        consume,
        relay_stop,
        relay,
    })
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

/// Hands partition `p` over: stops reading (the batch in hand is committed), flushes its
/// outbox, snapshots, releases the lease. The lease is renewed meanwhile by its keeper;
/// the flush is given up once the lease's deadline passes (renewals failing) or after one
/// TTL, so a relay that cannot publish never holds the ownership task.
async fn hand_over(state: &AppState, snap: &Snap, running: &mut BTreeMap<u32, Running>, p: u32) {
    let Some(mut r) = running.remove(&p) else {
        return;
    };
    let stopping = Instant::now();
    let mut handed = None;
    r.consume_stop.cancel();
    let _ = (&mut r.consume).await;
    r.relay_stop.cancel();
    let flushed = tokio::select! {
        done = &mut r.relay => Ok(done),
        () = r.lease.expired() => Err(()),
        () = tokio::time::sleep(r.lease.ttl()) => Err(()),
    };
    match flushed {
        // Flushed: the snapshot holds everything applied, so the heir replays nothing.
        Ok(Ok(Ok(()))) => handed = snap.upload(state, p).await,
        Ok(_) => {
            tracing::warn!(
                message = "Hand-over after the partition was fenced off.",
                partition = p
            )
        }
        Err(()) => {
            r.relay.abort();
            tracing::warn!(
                message = "Hand-over without a full flush: the lease deadline or the flush limit came first.",
                partition = p
            );
        }
    }
    state
        .metrics
        .partition_handoff_seconds
        .observe(stopping.elapsed().as_secs_f64());
    forget(state, p);
    let epoch = r.lease.epoch();
    // With the snapshot named in the lease, the heir waits for it rather than restoring an
    // older one its first listing may show.
    let released = match handed {
        Some(checkpoint) => r.lease.hand_over(checkpoint).await,
        None => r.lease.release().await,
    };
    match released {
        Ok(()) => {
            state
                .metrics
                .lease_events
                .with_label_values(&["released"])
                .inc();
            tracing::info!(message = "Partition handed over.", partition = p, epoch, snapshot = ?handed);
        }
        Err(e) => {
            tracing::warn!(message = "Partition release failed; it expires on its own.", partition = p, error = %e)
        }
    }
}

/// The snapshots bucket and how partitions are cut.
struct Snap {
    bucket: ObjectStore,
    how: Partitioning,
    keep: usize,
}

impl Snap {
    /// Uploads a snapshot of partition `p` as it is committed now; failures are logged (the
    /// previous snapshot stays, and the heir replays a little more).
    async fn upload(&self, state: &AppState, p: u32) -> Option<u64> {
        match snapshot::snapshot(&state.store, &self.bucket, &self.how, p, self.keep).await {
            Ok(checkpoint) => {
                state.metrics.snapshots.inc();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
                state
                    .metrics
                    .snapshot_last_timestamp
                    .with_label_values(&[&p.to_string()])
                    .set(now);
                tracing::debug!(message = "Snapshot uploaded.", partition = p, checkpoint);
                Some(checkpoint)
            }
            Err(e) => {
                tracing::warn!(message = "Snapshot upload failed.", partition = p, error = %e);
                None
            }
        }
    }
}

/// Records that partition `p` is no longer held here: placement and its gauges.
fn forget(state: &AppState, p: u32) {
    state.placement.gave_up(p);
    let label = p.to_string();
    // Its snapshots are the new owner's business now (and no alert of ours should age).
    let _ = state
        .metrics
        .snapshot_last_timestamp
        .remove_label_values(&[&label]);
    state
        .metrics
        .partition_epoch
        .with_label_values(&[&label])
        .set(0);
    state
        .metrics
        .partition_lag
        .with_label_values(&[&label])
        .set(0);
    // Another node owns it now: its checkpoint is no longer this node's to report.
    let _ = state
        .metrics
        .partition_checkpoint
        .remove_label_values(&[&label]);
}
