//! The router of one source stream (partitioned mode, DESIGN §8.2): copies each input of
//! the source into the saga inbox partition of every saga instance it reaches.
//!
//! A routed copy goes to `runner.inbox.<p>.<source>` with headers `Runner-Subject` (where
//! it was published), `Runner-Source` (`<source>:<seq>`), `Runner-Source-Time` (when the
//! broker stored the source message, which bounds the input's time), its `traceparent`, and
//! `Nats-Msg-Id` `<source>:<seq>:<p>`. An input that reaches several instances in one
//! partition is copied there once (the partition's owner applies it to each); an input
//! that cannot be routed (undecodable, a failing correlation expression, an engine panic)
//! goes to partition `seq mod P`, whose owner dead-letters it with the reason; an input no
//! saga wants is not copied (`runner_saga_unrouted_total` counts it).
//!
//! **Guarantees.**
//! - **One router per source.** It runs only while holding the lease `r.<source>` in the
//!   leases bucket, renewed by a task of its own ([`super::keeper`]) so a slow batch never
//!   lets it lapse; past its monotonic deadline it stops before the next batch.
//! - **Fenced, atomic, exact progress.** Copies go out as atomic batches into the inbox,
//!   fenced on `runner.fence.<inbox>.<source>`, each ending with a marker that records the
//!   last source sequence it covers. So a batch and its progress are stored together or not
//!   at all; a router that was paused and replaced cannot store anything (the new router
//!   raised the fence); and a new router resumes exactly after the last marker. No input
//!   is copied twice or skipped, whatever the de-duplication window.
//! - **Per-source order.** One batch in flight; the next starts after the answer, so the
//!   inbox holds every partition's inputs in source order. (The next chunk of the source
//!   is read while a batch is in flight, [`ReadAhead`], but sent only after the answer.)
//! - **Bounded bytes.** A pull of the source asks for as many messages as fit in
//!   `saga.max_pull_bytes` at the sizes seen ([`crate::worker::pull`]), and a batch of copies is cut
//!   before it would pass `saga.max_batch_bytes` (one input's copies stay together, so only
//!   an input whose copies alone pass it makes a larger batch). Copies share the source
//!   message's body rather than each holding its own.
//!
//! - **Work under way first.** The aggregate stream's router copies only as many inputs as
//!   fit under `saga.max_queued_work` and holds the rest while effect commands are queued
//!   at the bound (`admit.rs`); the results router never waits, so inbox partitions do not
//!   fill with new triggers ahead of them.
//!
//! **What each failure costs.** A refused or unanswered batch is checked against the fence
//! ([`Fence::recheck`]): landed (carry on), not landed (send it again), or fenced off (stop
//! routing; contend for the lease again).
//!
//! **Sizes.** An input is counted whole, its header block with its body: one larger than
//! `saga.max_message_bytes`, or whose copy (with the headers above and those of the fenced
//! batch) the inbox could not take under the broker's `max_payload`, is sent to its poison
//! partition as a copy with only the start of its body (what a dead letter keeps), carrying
//! `Runner-Refused` with the reason; its owner
//! dead-letters it as `too_large`, and routing goes on.
//!
//! This file holds the lease and reads the source; the copies and the fenced batches that
//! carry them are `copies.rs`.

mod copies;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull::{Ordered, OrderedError};
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use async_nats::jetstream::kv;
use futures::StreamExt;
use futures::stream::ReadyChunks;
use tokio_util::sync::CancellationToken;

use super::keeper::Kept;
use super::lease::Lease;
use crate::backoff::Backoff;
use crate::broker::fence::Fence;
use crate::broker::liveness::{Liveness, Probe};
use crate::runtime::AppState;
use crate::worker::admit::{Admission, POLL};
use crate::worker::consume::{ORDERED_PULL_EXPIRY, Source, server_filters};
use crate::worker::pull::{PullSize, ReadAhead};
use copies::{Stop, send};

pub use copies::destinations;

/// Most source inputs in one batch (each may add a few copies; the batch limit is 1000).
const INPUTS_PER_BATCH: usize = 200;

/// The lease key of a source's router.
pub fn router_key(source: &str) -> String {
    format!("r.{source}")
}

/// Routes `source` while this replica holds its lease, contending again after losing it,
/// until `cancel` fires.
pub(crate) async fn run(
    state: Arc<AppState>,
    leases: kv::Store,
    source: Source,
    cancel: CancellationToken,
) {
    let ttl = state.config.partitions.lease_ttl.get();
    let key = router_key(&source.stream);
    let mut backoff = Backoff::new(Duration::from_millis(200), ttl / 3).with_jitter();
    while !cancel.is_cancelled() {
        if !state.placement.mode().routes() {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(ttl / 10) => continue,
            }
        }
        let store = Some(state.store_id.as_str());
        let lease = match Lease::reclaim_or_acquire(&leases, &key, &state.node_id, store, ttl).await
        {
            Ok(Some(l)) => l,
            Ok(None) => {
                // Someone routes it; look again in a while (it may die).
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(ttl / 3) => continue,
                }
            }
            Err(e) => {
                tracing::warn!(message = "Cannot contend for the router lease.", source = %source.stream, error = %e);
                backoff.sleep(&cancel).await;
                continue;
            }
        };
        tracing::info!(message = "Routing.", source = %source.stream, epoch = lease.epoch());
        state
            .placement
            .set_routing(&source.stream, Some(lease.epoch()));
        // Renewed by its own task: a slow batch never lets it lapse.
        let lease = Kept::keep(lease, None);
        let why = route_while_held(&state, &source, lease, &cancel).await;
        state.metrics.stalls.gone(&stage(&source.stream));
        state.placement.set_routing(&source.stream, None);
        tracing::info!(message = "Stopped routing.", source = %source.stream, reason = %why);
        backoff.sleep(&cancel).await;
    }
}

/// Routes until the lease or the fence is lost, or `cancel` fires; returns why it stopped.
async fn route_while_held(
    state: &AppState,
    source: &Source,
    lease: Kept,
    cancel: &CancellationToken,
) -> String {
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let fence = match Fence::raise(js, inbox, &source.stream, lease.epoch(), &state.node_id).await {
        Ok(f) => f,
        Err(e) => return format!("cannot raise the fence: {e}"),
    };
    let stopped = Routing::new(state, source, &lease, fence, cancel)
        .route()
        .await;
    if stopped.release {
        let _ = lease.release().await;
    }
    stopped.why
}

/// The read-ahead reader of one opened consumer of the source, in chunks of at most
/// [`INPUTS_PER_BATCH`] inputs.
type Reader = ReadAhead<ReadyChunks<Ordered>, Result<async_nats::jetstream::Message, OrderedError>>;

/// Why reading one consumer of the source ended.
enum Ended {
    /// Reopen the consumer at the fence's watermark and read on.
    Reopen,
    /// Stop routing.
    Stop(Stopped),
}

/// Why a router stopped routing, and whether it gives its lease back.
struct Stopped {
    why: String,
    /// Released when this router chose to stop (a drain, a mode that no longer routes);
    /// a lease that lapsed or a fence taken by a newer router has nothing to release, and
    /// a lease not released ages out after one TTL.
    release: bool,
}

impl Stopped {
    fn lost() -> Self {
        Self::kept("the lease expired or was lost")
    }
    fn not_routing() -> Self {
        Self::released("node mode excludes routing")
    }
    fn drain() -> Self {
        Self::released("drain")
    }
    fn kept(why: &str) -> Self {
        Self {
            why: why.into(),
            release: false,
        }
    }
    fn released(why: &str) -> Self {
        Self {
            why: why.into(),
            release: true,
        }
    }
}

/// One router's hold on its source: from the fence it raised until it stops routing.
struct Routing<'a> {
    state: &'a AppState,
    source: &'a Source,
    lease: &'a Kept,
    cancel: &'a CancellationToken,
    /// The router's fence in the inbox; its watermark is the exact progress.
    fence: Fence,
    backoff: Backoff,
    liveness: Liveness,
    /// The router's name in liveness logs.
    label: String,
    /// Bytes bounded on both sides: the pull's count follows the sizes read, and a batch of
    /// copies is cut at `saga.max_batch_bytes` (see `send`).
    pull: PullSize,
    max_pull_bytes: u64,
    /// New triggers wait behind work under way (admit.rs); results are never held.
    admission: Option<Admission>,
}

impl<'a> Routing<'a> {
    fn new(
        state: &'a AppState,
        source: &'a Source,
        lease: &'a Kept,
        fence: Fence,
        cancel: &'a CancellationToken,
    ) -> Self {
        let max_pull_bytes = state.config.saga.max_pull_bytes.get();
        Self {
            state,
            source,
            lease,
            cancel,
            fence,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).with_jitter(),
            liveness: Liveness::new(
                state.broker.jetstream(),
                &state.metrics.registry,
                state.config.consumers.stall_check.get(),
                state.config.consumers.reopen_timeout.get(),
            ),
            label: format!("router:{}", source.stream),
            pull: PullSize::new(max_pull_bytes),
            max_pull_bytes,
            admission: (source.stream == state.config.streams.aggregate_events)
                .then(Admission::router),
        }
    }

    /// Opens a consumer at the fence's watermark and routes what it reads, reopening it
    /// whenever reading it ends, until routing stops.
    async fn route(mut self) -> Stopped {
        loop {
            let reader = match self.open().await {
                Ok(reader) => reader,
                Err(e) => {
                    tracing::warn!(message = "Router cannot open its consumer; retrying.", source = %self.source.stream, error = %e);
                    self.backoff.sleep(self.cancel).await;
                    if self.cancel.is_cancelled() {
                        return Stopped::kept("drain");
                    }
                    continue;
                }
            };
            match self.read(reader).await {
                Ended::Reopen => {}
                Ended::Stop(stopped) => return stopped,
            }
        }
    }

    /// An ordered consumer of the source starting just after the fence's watermark.
    async fn open(&mut self) -> Result<Reader, async_nats::Error> {
        let from = self.fence.through().map_or(1, |p| p.seq + 1);
        let stream = self
            .liveness
            .context()
            .get_stream(&self.source.stream)
            .await?;
        let c = stream
            .create_consumer(OrderedConfig {
                filter_subjects: server_filters(&self.source.filters),
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                // Short pulls: a consumer lost with its server (a stream leader that
                // died) is noticed by missed heartbeats within seconds, not after the
                // default 30 s pull expiry.
                max_expires: ORDERED_PULL_EXPIRY,
                max_batch: self.pull.open(),
                ..OrderedConfig::default()
            })
            .await?;
        Ok(ReadAhead::new(
            c.messages().await?.ready_chunks(INPUTS_PER_BATCH),
            INPUTS_PER_BATCH,
            self.max_pull_bytes,
        ))
    }

    /// Routes what one consumer delivers, chunk after chunk, until it must be reopened or
    /// routing stops.
    async fn read(&mut self, mut reader: Reader) -> Ended {
        // Since when the consumer has delivered nothing (liveness, see broker/liveness.rs).
        let mut idle_since = Instant::now();
        loop {
            let next = match self.next_chunk(&mut reader, &mut idle_since).await {
                Ok(next) => next,
                Err(ended) => return ended,
            };
            idle_since = Instant::now();
            let Some(chunk) = next else {
                return Ended::Reopen;
            };
            let (inputs, failed) = self.messages(chunk);
            if self.rewound(&inputs) {
                return Ended::Reopen;
            }
            if !inputs.is_empty() {
                self.pull.observe(inputs.iter().map(|m| m.payload.len()));
                if let Err(ended) = self.route_inputs(&mut reader, inputs).await {
                    return ended;
                }
                if self.pull.should_reopen() {
                    // Everything read is routed and covered by the fence's watermark,
                    // where the consumer reopens: nothing is lost.
                    return Ended::Reopen;
                }
            }
            if failed {
                self.backoff.sleep(self.cancel).await;
                return Ended::Reopen;
            }
        }
    }

    /// Waits for the consumer's next chunk (`None`: it ended) while the lease holds and the
    /// node routes; every sixth of a TTL without one, probes whether the consumer stalled.
    async fn next_chunk(
        &mut self,
        reader: &mut Reader,
        idle_since: &mut Instant,
    ) -> Result<Option<Vec<Result<async_nats::jetstream::Message, OrderedError>>>, Ended> {
        loop {
            if !self.lease.is_valid() {
                return Err(Ended::Stop(Stopped::lost()));
            }
            if !self.state.placement.mode().routes() {
                return Err(Ended::Stop(Stopped::not_routing()));
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return Err(Ended::Stop(Stopped::drain())),
                _ = tokio::time::sleep(self.lease.ttl() / 6) => {
                    if idle_since.elapsed() >= self.liveness.stall_check() {
                        *idle_since = Instant::now();
                        if self.stalled().await {
                            return Err(Ended::Reopen);
                        }
                    }
                }
                c = reader.next() => return Ok(c),
            }
        }
    }

    /// Whether the source holds a message for this router past the fence's watermark that
    /// the consumer has not delivered (logged as a stall to recreate it).
    async fn stalled(&self) -> bool {
        let after = self.fence.through().map_or(0, |p| p.seq);
        let probe = self
            .liveness
            .probe(&self.source.stream, &self.source.filters, after)
            .await;
        if let Probe::Pending(seq) = probe {
            let detail = format!("message {seq} waits past sequence {after}");
            self.liveness.recreating(&self.label, "stalled", &detail);
            return true;
        }
        false
    }

    /// The messages of a chunk up to its first error; `true` beside them when there was
    /// one (the consumer is then reopened once they are routed).
    fn messages(
        &self,
        chunk: Vec<Result<async_nats::jetstream::Message, OrderedError>>,
    ) -> (Vec<async_nats::jetstream::Message>, bool) {
        let mut inputs = Vec::with_capacity(chunk.len());
        for item in chunk {
            match item {
                Ok(msg) => inputs.push(msg),
                Err(e) => {
                    tracing::warn!(message = "Router consumer error; reopening.", source = %self.source.stream, error = %e);
                    return (inputs, true);
                }
            }
        }
        (inputs, false)
    }

    /// Whether the consumer went back to the stream's start (see `Liveness::rewound`): it
    /// would have everything read again, so it is reopened at the fence's watermark.
    fn rewound(&self, inputs: &[async_nats::jetstream::Message]) -> bool {
        let first = inputs
            .first()
            .and_then(|m| m.info().ok())
            .map(|i| i.stream_sequence);
        if let (Some(first), Some(through)) = (first, self.fence.through())
            && first <= through.seq
        {
            let detail = format!("delivered {first} after {}", through.seq);
            self.liveness.rewound(&self.label, &detail);
            return true;
        }
        false
    }

    /// Copies `inputs` into the inbox in order, as many at a time as admission lets in,
    /// reading the next chunk meanwhile.
    async fn route_inputs(
        &mut self,
        reader: &mut Reader,
        inputs: Vec<async_nats::jetstream::Message>,
    ) -> Result<(), Ended> {
        let mut rest = inputs;
        while !rest.is_empty() {
            // New triggers only as far as the bound has room (`admit.rs`).
            let room = self.room(rest.len()).await.map_err(Ended::Stop)?;
            let split = room < rest.len();
            let later = rest.split_off(room.clamp(1, rest.len()));
            let batch = std::mem::replace(&mut rest, later);
            // At the bound, what goes in counts until the broker shows it.
            if let Some(a) = self.admission.as_mut().filter(|_| split) {
                a.admitted(batch.len() as u64);
            }
            // The next chunk is read while this one is routed (see `ReadAhead`).
            let sent = reader
                .during(send(self.state, self.source, &mut self.fence, batch))
                .await;
            match sent {
                Ok(()) => self.backoff.reset(),
                Err(Stop::Fenced) => {
                    return Err(Ended::Stop(Stopped::kept("fenced off by a newer router")));
                }
                Err(Stop::Retry) => {
                    self.backoff.sleep(self.cancel).await;
                    return Err(Ended::Reopen);
                }
            }
        }
        Ok(())
    }

    /// How many of the `waiting` inputs may go in now: all of them for a router without
    /// admission, else as many as the bound has room for, once it has any.
    async fn room(&mut self, waiting: usize) -> Result<usize, Stopped> {
        let Some(a) = self.admission.as_mut() else {
            return Ok(waiting);
        };
        match hold(self.state, a, self.lease, self.cancel).await {
            Ok((held, room)) => {
                if !held.is_zero() {
                    self.state
                        .metrics
                        .admission_wait
                        .observe(held.as_secs_f64());
                }
                Ok(room)
            }
            Err(Unheld::Lost) => Err(Stopped::lost()),
            Err(Unheld::NotRouting) => Err(Stopped::not_routing()),
            Err(Unheld::Drain) => Err(Stopped::drain()),
        }
    }
}

/// Why holding new triggers ended before the queue drained.
enum Unheld {
    /// The lease lapsed: another router may hold the source by now.
    Lost,
    /// The node's mode no longer routes.
    NotRouting,
    /// The replica drains.
    Drain,
}

/// Holds the next batch of new triggers while the work under way is queued at or above
/// `saga.max_queued_work` (see `admit.rs`); returns how long it held and how many inputs
/// fit now (every one when the bound is off). Nothing is read or written meanwhile: the batch waits in hand, read but not yet copied, and a router that
/// stops here drops it and leaves it to the next one, which resumes at the fence's
/// watermark.
async fn hold(
    state: &AppState,
    admission: &mut Admission,
    lease: &Kept,
    cancel: &CancellationToken,
) -> Result<(Duration, usize), Unheld> {
    let started = Instant::now();
    loop {
        let room = match admission.room(state).await {
            None => usize::MAX,
            Some(0) => 0,
            Some(r) => usize::try_from(r).unwrap_or(usize::MAX),
        };
        if room > 0 {
            return Ok((started.elapsed(), room));
        }
        if !lease.is_valid() {
            return Err(Unheld::Lost);
        }
        if !state.placement.mode().routes() {
            return Err(Unheld::NotRouting);
        }
        tokio::select! {
            _ = cancel.cancelled() => return Err(Unheld::Drain),
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// The router of `source`'s name among the stalled stages ([`crate::telemetry::stall`]).
fn stage(source: &str) -> String {
    format!("router.{source}")
}
