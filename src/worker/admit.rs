//! Work under way goes first (single-active mode): new triggers wait while the work already
//! started is queued deep.
//!
//! Before the aggregate-events loop hands a batch to the commit, it reads how much work is
//! queued behind sagas already under way: effect results not yet applied (the results
//! loop's lag) plus effect commands not yet finished (pending and unacknowledged on every
//! effect consumer). While that is above `saga.max_queued_work`, the loop waits, polling
//! every [`POLL`]. The results loop is never held, so completions go on and the queue
//! drains; the backlog of an overload stays in the aggregate stream, as new triggers.
//!
//! Guarantees:
//! - New triggers are never starved: they are held only while the queue is above the bound,
//!   and the queue is made of work the runner drains without them.
//! - The count is read from the broker (consumer state), so it covers every effect worker
//!   and holds across restarts; a failed read counts as nothing queued, so an API error
//!   never holds the loop.
//! - `saga.max_queued_work = 0` turns it off. Partitioned mode does not use it yet.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::effect::consumers::{consumer_name, has_own_consumer};
use crate::runtime::AppState;

/// How often a held loop looks again.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// How long a read of the effect consumers is reused.
const FRESH: Duration = Duration::from_millis(50);

/// The aggregate loop's gate, with its last reading of the effect consumers.
pub(crate) struct Admission {
    commands: u64,
    read_at: Option<Instant>,
}

impl Admission {
    pub(crate) fn new() -> Self {
        Self {
            commands: 0,
            read_at: None,
        }
    }

    /// Waits while the queued work is above the bound (or until `cancel`). Returns how
    /// long it held.
    pub(crate) async fn wait(&mut self, state: &AppState, cancel: &CancellationToken) -> Duration {
        let limit = state.config.saga.max_queued_work;
        let started = Instant::now();
        if limit == 0 {
            return Duration::ZERO;
        }
        while !cancel.is_cancelled() && self.queued(state).await > limit {
            tokio::time::sleep(POLL).await;
        }
        started.elapsed()
    }

    /// Results not yet applied plus effect commands not yet finished.
    async fn queued(&mut self, state: &AppState) -> u64 {
        let c = &state.config;
        let results = state
            .metrics
            .consumer_lag
            .with_label_values(&[&c.streams.workflow_events])
            .get()
            .max(0) as u64;
        if self.read_at.is_none_or(|at| at.elapsed() >= FRESH) {
            self.commands = effect_backlog(state).await;
            self.read_at = Some(Instant::now());
        }
        results + self.commands
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
