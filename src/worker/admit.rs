//! Work under way goes first: new triggers wait while the work already started is queued
//! deep.
//!
//! What counts as queued: effect commands not yet finished (pending and unacknowledged on
//! every effect consumer, read from the broker) and, in single-active mode, effect results
//! not yet applied (the results loop's lag) and outputs committed but not yet published
//! (the relay's count: work the broker does not show yet). While that is above
//! `saga.max_queued_work`, new triggers are held, polling every [`POLL`]:
//! - **Single-active**: the aggregate-events loop takes no new batch to the commit, and
//!   of a batch read it takes only as many triggers as there is room for under the bound
//!   ([`Admission::admit`]; at least one), the rest once there is room again.
//!   A batch read under a backlog holds up to `saga.batch_size` inputs: taken whole after
//!   one look it would put far more work in the queue than the bound allows.
//! - **Partitioned**: the router of the aggregate stream copies no new batch into the
//!   saga inbox ([`super::router`]), so the inbox partitions, which also carry the effect
//!   results, do not fill with new triggers ahead of them. The results router is never
//!   held. The results not yet applied are not counted here: they sit in partitions other
//!   replicas may own, whose progress this router does not see.
//!
//! Either way the results are never held, so completions go on and the queue drains; the
//! backlog of an overload stays in the aggregate stream, as new triggers.
//!
//! Guarantees:
//! - New triggers are never starved by work the runner can drain: they are held only while
//!   the queue is above the bound, and the queue is made of work that completes without
//!   them. (Effect commands that no effect worker consumes do not drain: with no effect
//!   worker running, triggers wait until one is, or set the bound to 0.)
//! - The count is read from the broker (consumer state), so it covers every effect worker
//!   and holds across restarts; a failed read counts as nothing queued, so an API error
//!   never holds new triggers.
//! - Holding moves no checkpoint and writes nothing: a held batch is taken as it is once
//!   the queue drains, and a router that stops while holding (drain, lost lease) leaves it
//!   to the next router, which resumes at its fence's watermark. A single-active loop
//!   drained while holding commits none of the held batch and stops: the next start (this
//!   node's or its heir's) reads it again from the checkpoint.
//! - `saga.max_queued_work = 0` turns it off.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::effect::consumers::{consumer_name, has_own_consumer};
use crate::relay::RelayHandle;
use crate::runtime::AppState;

/// How often a held loop looks again.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// How long a read of the effect consumers is reused.
const FRESH: Duration = Duration::from_millis(50);

/// The gate of new triggers, with its last reading of the effect consumers.
pub(crate) struct Admission {
    /// Whether the results loop's lag counts (single-active mode only).
    results: bool,
    /// The relay whose unpublished outputs count (single-active mode only).
    relay: Option<RelayHandle>,
    commands: u64,
    read_at: Option<Instant>,
}

impl Admission {
    /// The gate of the single-active aggregate loop: counts results not yet applied and
    /// outputs not yet published too.
    pub(crate) fn single_active(relay: RelayHandle) -> Self {
        Self {
            results: true,
            relay: Some(relay),
            commands: 0,
            read_at: None,
        }
    }

    /// The gate of the aggregate stream's router (partitioned mode): effect commands only.
    pub(crate) fn router() -> Self {
        Self {
            results: false,
            relay: None,
            commands: 0,
            read_at: None,
        }
    }

    /// Admits `batch` (single-active): waits while the queued work is above the bound,
    /// then splits off the inputs beyond the room left under it (at least one stays), to be
    /// admitted next — after a fresh reading of the broker. Returns how long it held and
    /// the inputs split off; a batch that fits, and any batch when the bound is 0, are
    /// left whole. `None` when `cancel` (the drain) comes while it holds: the caller
    /// commits none of the batch, so the drain neither waits for the queue nor lets the
    /// held triggers in, and they stay past the checkpoint for the next start to read.
    pub(crate) async fn admit<T>(
        &mut self,
        state: &AppState,
        cancel: &CancellationToken,
        batch: &mut Vec<T>,
    ) -> Option<(Duration, Vec<T>)> {
        let started = Instant::now();
        let limit = state.config.saga.max_queued_work;
        if limit == 0 {
            return Some((Duration::ZERO, Vec::new()));
        }
        let queued = loop {
            let queued = self.queued(state).await;
            if queued <= limit {
                break queued;
            }
            if cancel.is_cancelled() {
                return None;
            }
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(POLL) => {}
            }
        };
        let held = started.elapsed();
        let room = usize::try_from((limit - queued).max(1)).unwrap_or(usize::MAX);
        if batch.len() <= room {
            return Some((held, Vec::new()));
        }
        self.read_at = None;
        Some((held, batch.split_off(room)))
    }

    /// Whether the queued work is above `saga.max_queued_work` now (never when it is 0).
    pub(crate) async fn over(&mut self, state: &AppState) -> bool {
        let limit = state.config.saga.max_queued_work;
        limit != 0 && self.queued(state).await > limit
    }

    /// Effect commands not yet finished, plus results not yet applied when counted.
    async fn queued(&mut self, state: &AppState) -> u64 {
        let c = &state.config;
        let results = if self.results {
            state
                .metrics
                .consumer_lag
                .with_label_values(&[&c.streams.workflow_events])
                .get()
                .max(0) as u64
        } else {
            0
        };
        if self.read_at.is_none_or(|at| at.elapsed() >= FRESH) {
            self.commands = effect_backlog(state).await;
            self.read_at = Some(Instant::now());
        }
        let unpublished = self.relay.as_ref().map_or(0, RelayHandle::unpublished);
        results + self.commands + unpublished
    }
}

/// Pending plus unacknowledged commands over the catch-all and every effect's consumer.
async fn effect_backlog(state: &AppState) -> u64 {
    let c = &state.config;
    let Ok(stream) = state
        .broker
        .jetstream()
        .get_stream(&c.streams.workflow_commands)
        .await
    else {
        return 0;
    };
    let base = &c.consumers.effect;
    let catalog = state.catalog();
    let mut names = vec![base.clone()];
    names.extend(
        catalog
            .effect_names()
            .filter(|e| has_own_consumer(base, e))
            .map(|e| consumer_name(base, e)),
    );
    let mut total = 0u64;
    for name in names {
        if let Ok(info) = stream.consumer_info(&name).await {
            total += info.num_pending + info.num_ack_pending as u64;
        }
    }
    total
}
