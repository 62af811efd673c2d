//! The router of one share of a source stream (DESIGN §8.2; the shares are `share.rs`):
//! copies each of the share's inputs into the saga inbox partition of every saga instance it
//! reaches.
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
//! - **One router per share.** It runs only while holding the share's lease
//!   `r.<source>/<share>` in the leases bucket, renewed by a task of its own
//!   ([`super::keeper`]) so a slow batch never lets it lapse; past its monotonic deadline it
//!   stops before the next batch. A replica takes shares up to its quota and gives back the
//!   surplus (`share.rs`), so routing is spread over the replicas.
//! - **Fenced, atomic, exact progress.** Copies go out as atomic batches into the inbox,
//!   fenced on `runner.fence.<inbox>.<source>/<share>`, each ending with a marker that
//!   records the source sequence through which everything is covered (other shares'
//!   messages read before it included) and, per tenant, the last input copied beyond it
//!   (tenants go in turns, [`crate::fair`]). So a batch and its progress are stored
//!   together or not at all; a router that was paused and replaced cannot store anything
//!   (the new router raised the fence); and a new router resumes exactly after the last
//!   marker, skipping what its lanes show copied. No input is copied twice or skipped,
//!   whatever the de-duplication window.
//! - **Only what a trigger can want is read** ([`crate::worker::Source::filters_under`]);
//!   what the server skips is covered once idle, and a reload's new triggers see what
//!   arrives after it, never the history (`source.rs`).
//! - **Per-subject order.** One batch in flight per share; the next starts after the
//!   answer. Inputs wait in one first-in first-out lane per tenant, so the inbox holds
//!   each tenant's inputs of a share — every input of one subject — in source order;
//!   between tenants the order is their turns. (The source is read ahead while a batch is
//!   in flight, [`ReadAhead`], and while admission holds new triggers, up to
//!   `tenancy.read_ahead` inputs waiting.)
//! - **Bounded bytes.** A pull of the source asks for as many messages as fit in the
//!   router's part of the node's read-ahead budget (`saga.max_pull_bytes` over the input
//!   consumers open, [`crate::readahead`]) at the sizes seen ([`crate::worker::pull`]), and
//!   reads ahead no more than that part while a batch is in flight; inputs waiting in the
//!   lanes for admission are held to `saga.max_pull_bytes` per share (the window in which
//!   one tenant's inputs pass another's). A batch of copies is cut
//!   before it would pass `saga.max_batch_bytes` (one input's copies stay together, so only
//!   an input whose copies alone pass it makes a larger batch). Copies share the source
//!   message's body rather than each holding its own.
//!
//! - **Work under way first, tenants in turns.** The aggregate stream's routers copy only
//!   as many inputs as fit under `saga.max_queued_work` (each share its part, through the
//!   node's one gate) and hold the rest while effect commands are queued at the bound
//!   (`admit.rs`), except a tenant under its weighted share of the bound; a tenant over its
//!   rate limit (`tenancy.rate_limits`) passes its turn. Held inputs wait in the lanes, in
//!   order, and nothing is dropped. The results routers never wait, so inbox partitions do
//!   not fill with new triggers ahead of them.
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
//! This file holds the lease and reads the source; opening the source consumer, its filter
//! and telling when it must be reopened is `source.rs`; how a chunk read joins the lanes is
//! `waiting.rs`; the copies and the fenced batches that carry them are `copies.rs`.

mod copies;
mod door;
mod hold;
mod raise;
pub mod share;
mod source;
mod waiting;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull::{Ordered, OrderedError};
use async_nats::jetstream::kv;
use futures::stream::ReadyChunks;
use tokio_util::sync::CancellationToken;

use super::keeper::Kept;
use super::lease::Lease;
use crate::backoff::Backoff;
use crate::broker::fence::Fence;
use crate::broker::liveness::Liveness;
use crate::fair::Lanes;
use crate::manifest::Catalog;
use crate::runtime::AppState;
use crate::worker::admit::{Gate, POLL};
use crate::worker::consume::Source;
use crate::worker::pull::{PullSize, ReadAhead};
use copies::{Stop, mark};
use raise::{legacy_router, raise};

use share::{SKIPPED_MARK_EVERY, Share};
use waiting::Waiting;

pub use copies::destinations;

/// Most source messages in one chunk read from the consumer.
const INPUTS_PER_BATCH: usize = 200;

/// Most source messages read ahead while a batch is in flight, handed to the lanes at once:
/// reading keeps well ahead of copying, so a tenant's input behind another tenant's
/// backlog reaches the lanes soon (the lanes bound what waits).
const READ_AHEAD: usize = 5000;

/// How long reading pauses before other shares' messages read past the marker are marked.
const IDLE_MARK: Duration = Duration::from_millis(100);

/// How long a consumer narrowed to the triggers delivers nothing before what the server
/// skipped is covered by a marker (`Routing::advance` (`source.rs`)).
const IDLE_ADVANCE: Duration = Duration::from_secs(1);

/// The lease key of a source's single router in earlier releases (one router per source,
/// before [`share`]s); the in-place upgrade still writes that router's marker.
pub fn router_key(source: &str) -> String {
    format!("r.{source}")
}

/// Routes `share` while this replica holds its lease, contending again after losing it (and
/// only while it routes fewer shares than its quota), until `cancel` fires.
pub(crate) async fn run(
    state: Arc<AppState>,
    leases: kv::Store,
    share: Share,
    admission: Option<Gate>,
    cancel: CancellationToken,
) {
    let ttl = state.config.partitions.lease_ttl.get();
    let key = share.lease_key();
    let sources = crate::worker::sources(&state).len();
    let mut backoff = Backoff::new(Duration::from_millis(200), ttl / 3).with_jitter();
    let mut wait = Duration::ZERO;
    // Whether the wait for an earlier release's router was logged (once per wait).
    let mut waiting_for_legacy = false;
    while !cancel.is_cancelled() {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = ttl / 3;
        if !state.placement.mode().routes() || !share::may_take(&state.placement, sources) {
            // Not this replica's to route now: a failure it saw is no longer its own.
            state.metrics.stalls.gone(&stage(&share));
            wait = ttl / 10;
            continue;
        }
        if let Some(owner) = legacy_router(&state, &leases, &share).await {
            if !waiting_for_legacy {
                tracing::warn!(message = "A replica of an earlier release routes this source with a single router; this share waits until it stops.", share = %share, owner = %owner);
            }
            waiting_for_legacy = true;
            continue;
        }
        waiting_for_legacy = false;
        let store = Some(state.store_id.as_str());
        let lease = match Lease::reclaim_or_acquire(&leases, &key, &state.node_id, store, ttl).await
        {
            Ok(Some(l)) => l,
            // Someone routes it; look again in a while (it may die).
            Ok(None) => {
                state.metrics.stalls.gone(&stage(&share));
                continue;
            }
            Err(e) => {
                if crate::relay::election::is_election(&e.to_string()) {
                    tracing::warn!(message = "Cannot contend for the router lease: the leases bucket is electing a leader (or unreachable); retrying.", share = %share, error = %e);
                } else {
                    tracing::warn!(message = "Cannot contend for the router lease.", share = %share, error = %e);
                }
                backoff.sleep(&cancel).await;
                wait = Duration::ZERO;
                continue;
            }
        };
        tracing::info!(message = "Routing.", share = %share, epoch = lease.epoch());
        let name = share.to_string();
        state.placement.set_routing(&name, Some(lease.epoch()));
        // Renewed by its own task: a slow batch never lets it lapse.
        let lease = Kept::keep(lease, None);
        match route_while_held(&state, &share, admission.clone(), lease, &cancel).await {
            Ok(why) => {
                state.metrics.stalls.gone(&stage(&share));
                tracing::info!(message = "Stopped routing.", share = %share, reason = %why);
            }
            // Stays a stalled stage (`/health`) until a raise succeeds; logged once.
            Err(why) => {
                if state.metrics.stalls.failed(&stage(&share), &why) {
                    tracing::error!(message = "Share not routed: its fence cannot be raised.", share = %share, reason = %why);
                }
            }
        }
        state.placement.set_routing(&name, None);
        backoff.sleep(&cancel).await;
        wait = Duration::ZERO;
    }
}

/// Routes until the lease or the fence is lost, or `cancel` fires; returns why it stopped,
/// as an error when the fence could not be raised (nothing was routed).
async fn route_while_held(
    state: &AppState,
    share: &Share,
    admission: Option<Gate>,
    lease: Kept,
    cancel: &CancellationToken,
) -> Result<String, String> {
    let fence = match raise(state, share, lease.epoch()).await {
        Ok(f) => f,
        Err(e) => return Err(format!("cannot raise the fence: {e}")),
    };
    let stopped = Routing::new(state, share, admission, &lease, fence, cancel)
        .route()
        .await;
    // Nothing waits here any more.
    let label = format!("router:{share}");
    state
        .tenants
        .report(&label, Vec::new(), &state.limits.get(), &state.metrics);
    if stopped.release {
        let _ = lease.release().await;
    }
    Ok(stopped.why)
}

/// The read-ahead reader of one opened consumer of the source, in chunks of at most
/// [`INPUTS_PER_BATCH`] messages, or of what was read ahead ([`READ_AHEAD`]).
type Reader = ReadAhead<ReadyChunks<Ordered>, Result<async_nats::jetstream::Message, OrderedError>>;

/// What waiting on the consumer gave.
enum Next {
    /// A chunk of messages.
    Chunk(Vec<Result<async_nats::jetstream::Message, OrderedError>>),
    /// The consumer ended.
    Ended,
    /// Nothing yet; inputs wait in the lanes, to be looked at again.
    Tick,
}

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

/// One router's hold on its share: from the fence it raised until it stops routing.
struct Routing<'a> {
    state: &'a AppState,
    share: &'a Share,
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
    /// New triggers wait behind work under way (admit.rs); results are never held.
    admission: Option<Gate>,
    /// The last source sequence read (this share's messages and the others'), or found to
    /// hold nothing the filters take in: the fence's marker may trail it by messages that
    /// are not this share's inputs, written when idle.
    read_through: u64,
    /// The manifests the consumer's filters were taken from: another set in force (a
    /// reload) reopens the consumer under the filters it gives.
    catalog: Arc<Catalog>,
    /// What the consumer asks the server for ([`Source::filters_under`]).
    filters: Vec<String>,
    /// Sources routed in shares (what the quota divides).
    sources: usize,
    /// This share's inputs read but not yet copied, by tenant ([`crate::fair`]).
    lanes: Lanes<Waiting>,
    /// Whether the last look at the lanes sent a batch (the next look comes at once).
    pressing: bool,
    /// Since when admission has let nothing of the lanes in (observed as the admission
    /// wait when something goes).
    held_since: Option<Instant>,
    /// When the lanes were last reported ([`Routing::report`]).
    reported_at: Instant,
}

impl<'a> Routing<'a> {
    fn new(
        state: &'a AppState,
        share: &'a Share,
        admission: Option<Gate>,
        lease: &'a Kept,
        fence: Fence,
        cancel: &'a CancellationToken,
    ) -> Self {
        let max_pull_bytes = state.config.saga.max_pull_bytes.get();
        let source = &share.source;
        let catalog = state.catalog();
        let filters = source.filters_under(&catalog);
        Self {
            state,
            share,
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
            label: format!("router:{share}"),
            pull: PullSize::new(state.readahead.part()),
            admission,
            read_through: 0,
            catalog,
            filters,
            sources: crate::worker::sources(state).len(),
            lanes: Lanes::new(
                state.config.tenancy.read_ahead,
                usize::try_from(max_pull_bytes).unwrap_or(usize::MAX),
            ),
            pressing: false,
            held_since: None,
            reported_at: Instant::now(),
        }
    }

    /// Opens a consumer at the fence's watermark and routes what it reads, reopening it
    /// whenever reading it ends, until routing stops.
    async fn route(mut self) -> Stopped {
        // The lag's series exists while this replica routes the share, read or not.
        self.lag().set(0);
        loop {
            // What waited in the lanes is read again from the fence's watermark, and
            // nothing past it counts as read: a marker covers only what this consumer
            // delivers (what an earlier one read ahead and did not copy would be skipped).
            self.lanes.reset(self.fence.lanes());
            self.read_through = self.marked();
            // A reload not yet looked at (a consumer that ended, an open that failed) is
            // taken before opening: it would reopen at the first chunk otherwise.
            self.filters_changed();
            self.report(true);
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

    /// Routes what one consumer delivers, chunk after chunk, until it must be reopened or
    /// routing stops: each chunk's inputs of this share join their tenants' lanes, and the
    /// lanes are copied as far as admission lets them ([`Routing::drain`]).
    async fn read(&mut self, mut reader: Reader) -> Ended {
        // Since when the consumer has delivered nothing (liveness, see broker/liveness.rs).
        let mut idle_since = Instant::now();
        loop {
            let next = match self.next_chunk(&mut reader, &mut idle_since).await {
                Ok(next) => next,
                Err(ended) => return ended,
            };
            let failed = match next {
                // A look at the lanes, nothing read.
                Next::Tick => false,
                Next::Ended => return Ended::Reopen,
                Next::Chunk(chunk) => {
                    idle_since = Instant::now();
                    match self.take_ready(chunk, &mut reader) {
                        Ok(failed) => failed,
                        Err(ended) => return ended,
                    }
                }
            };
            let copied = if self.lanes.is_empty() {
                // Only other shares' messages waiting to be covered: marked when idle or
                // far behind.
                self.mark_if(SKIPPED_MARK_EVERY).await.map(|()| false)
            } else {
                self.copy_once(&mut reader).await
            };
            match copied {
                Ok(sent) => self.pressing = sent,
                Err(ended) => return ended,
            }
            if self.lanes.is_empty() && self.pull.should_reopen() {
                // Everything read is routed and covered by the fence's watermark, where
                // the consumer reopens: nothing is lost (other shares' messages past it
                // are read again and skipped again).
                return Ended::Reopen;
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
    ) -> Result<Next, Ended> {
        loop {
            if !self.lease.is_valid() {
                return Err(Ended::Stop(Stopped::lost()));
            }
            if !self.state.placement.mode().routes() {
                return Err(Ended::Stop(Stopped::not_routing()));
            }
            if share::give_back(&self.state.placement, self.sources, self.share) {
                return Err(Ended::Stop(Stopped::released("above this replica's quota")));
            }
            if self.filters_changed() {
                return Err(Ended::Reopen);
            }
            // Other shares' messages read past the marker are marked once reading pauses.
            let unmarked = self.lanes.is_empty() && self.read_through > self.marked();
            // What the server skips for a narrowed consumer is covered once it has been
            // quiet a while (see `advance`).
            let narrowed =
                self.lanes.is_empty() && !unmarked && self.filters != self.source.filters;
            // Inputs waiting in the lanes are looked at again, read or not; full lanes
            // read nothing more until some are copied.
            let waiting = !self.lanes.is_empty();
            let full = self.lanes.full();
            // After a batch went, what was read meanwhile joins the lanes first, then the
            // next batch goes at once; after a refusal, the lanes are looked at again in a
            // while.
            let look_again = if self.pressing { Duration::ZERO } else { POLL };
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Err(Ended::Stop(Stopped::drain())),
                c = reader.next(), if !full => {
                    return Ok(c.map_or(Next::Ended, Next::Chunk));
                }
                _ = tokio::time::sleep(IDLE_MARK), if unmarked => {
                    self.mark_if(1).await?;
                }
                _ = tokio::time::sleep(IDLE_ADVANCE), if narrowed => {
                    self.advance().await?;
                }
                _ = tokio::time::sleep(look_again), if waiting => return Ok(Next::Tick),
                _ = tokio::time::sleep(self.lease.ttl() / 6) => {
                    if idle_since.elapsed() >= self.liveness.stall_check() {
                        *idle_since = Instant::now();
                        if self.stalled().await {
                            return Err(Ended::Reopen);
                        }
                    }
                }
            }
        }
    }

    /// The source sequence the fence's marker covers (0: none yet).
    fn marked(&self) -> u64 {
        self.fence.through().map_or(0, |p| p.seq)
    }

    /// Stores a marker covering what was read, when it is at least `gap` sequences past the
    /// fence's marker (only other shares' messages lie between).
    async fn mark_if(&mut self, gap: u64) -> Result<(), Ended> {
        if self.read_through < self.marked().saturating_add(gap) {
            return Ok(());
        }
        let progress = self.lanes.progress(self.read_through);
        match mark(self.state, self.share, &mut self.fence, progress).await {
            Ok(()) => Ok(()),
            Err(Stop::Fenced) => Err(Ended::Stop(Stopped::kept("fenced off by a newer router"))),
            Err(Stop::Retry) => {
                self.backoff.sleep(self.cancel).await;
                Err(Ended::Reopen)
            }
        }
    }
}

/// A share's name among the stalled stages ([`crate::telemetry::stall`]).
fn stage(share: &Share) -> String {
    format!("router.{share}")
}
