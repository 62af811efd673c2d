//! Work under way goes first: new triggers wait while the work already started is queued
//! deep.
//!
//! What counts as queued: effect commands not yet finished (pending and unacknowledged on
//! every effect consumer, read from the broker), plus the triggers let in at the bound whose
//! commands the effect consumers do not show yet (fewer new commands stored than triggers). The router of the aggregate stream
//! copies into the saga inbox only as many new inputs as there is room for under
//! `saga.max_queued_work` (at least one), and none while the queue is above it, polling
//! every [`POLL`] ([`super::ownership::router`]); so the inbox partitions, which also carry the effect
//! results, do not fill with new triggers ahead of them, and a batch read under a backlog
//! (hundreds of inputs) is not taken whole. The results
//! are never held, so completions go on and the queue drains; the backlog of an overload
//! stays in the aggregate stream, as new triggers. (Results not yet applied are not
//! counted: they sit in partitions other replicas may own, whose progress the router does
//! not see.)
//!
//! **Across tenants.** Above the bound, a tenant whose part of the queued work is under its
//! weighted share of the bound (`tenancy.weights`) still gets its triggers in, up to that
//! share: so one tenant's backlog holds its own new triggers, not another tenant's. A
//! tenant's part is estimated by its part of the triggers let in lately. Those counts fade
//! as the queue drains, by half for each queue's worth of commands finished, not with
//! time: while a tenant's work is stuck (a hung upstream), its count stays and the other
//! tenants still pass. With nothing let in since this gate started, whose work is queued
//! is not known and nobody passes above the bound. The queue then stays within about
//! twice the bound. Which
//! tenant's input goes next is the lanes' turn (`crate::fair`).
//!
//! Guarantees:
//! - New triggers are never starved by work the runner can drain: they are held only while
//!   the queue is above the bound, and the queue is made of work that completes without
//!   them. (Effect commands that no effect worker consumes do not drain: with no effect
//!   worker running, triggers wait until one is, or set the bound to 0.)
//! - The count is read from the broker (consumer state), so it covers every effect worker
//!   and holds across restarts; a failed read counts as nothing queued, so an API error
//!   never holds new triggers.
//! - Holding moves no position and writes nothing: a router that stops while holding
//!   (drain, lost lease) leaves the batch to the next router, which resumes at its fence's
//!   watermark.
//! - Triggers that reach no saga emitting effect commands (a ledger, a saga that only
//!   publishes events and aggregate commands) queue no effect work: once routed they stop
//!   counting, so such sagas are never held by this gate.
//! - `saga.max_queued_work = 0` turns it off.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::effect::consumers::{consumer_name, has_own_consumer};
use crate::runtime::AppState;

/// How often a held loop looks again.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// How long a read of the effect consumers is reused.
const FRESH: Duration = Duration::from_millis(50);

/// The longest inputs let in at the bound count as queued work while no effect commands of
/// theirs are stored (a safety bound: normally their commands show first).
const CREDIT_TTL: Duration = Duration::from_secs(5);

/// What the gate lets in now.
pub(crate) enum Room {
    /// This many inputs, of any tenants (all of them when the bound is off).
    Any(usize),
    /// Above the bound: per tenant under its share, at most this many (others: none).
    PerTenant(HashMap<String, usize>),
}

/// The gate of new triggers, with its last reading of the effect consumers and the
/// triggers it let in at the bound since.
pub(crate) struct Admission {
    /// Effect commands pending or unacknowledged, at the last reading.
    commands: u64,
    /// Effect commands stored so far, at the last reading (it only grows).
    stored: u64,
    read_at: Option<Instant>,
    /// Triggers let in at the bound since `credited_at`, and `stored` then: they count as
    /// queued until as many more effect commands are stored.
    credit: u64,
    credit_base: u64,
    credited_at: Option<Instant>,
    /// Per tenant, the triggers let in lately (fading as the queue drains, [`Admission::fade`]).
    recent: HashMap<String, f64>,
    /// Effect commands finished since the counts last faded.
    drained: u64,
    /// `saga.max_queued_work` at the last look.
    limit: u64,
}

impl Admission {
    /// Nothing read or let in yet.
    fn router() -> Self {
        Self {
            commands: 0,
            stored: 0,
            read_at: None,
            credit: 0,
            credit_base: 0,
            credited_at: None,
            recent: HashMap::new(),
            drained: 0,
            limit: 0,
        }
    }

    /// Fades the recent counts by what the queue drained since: by half per queue's worth
    /// (at least the bound) of commands finished. A queue that does not drain fades nothing.
    fn fade(&mut self) {
        if self.drained == 0 {
            return;
        }
        let turnover = self.commands.max(self.limit).max(1) as f64;
        let halves = self.drained as f64 / turnover;
        self.drained = 0;
        let factor = 0.5f64.powf(halves);
        self.recent.retain(|_, n| {
            *n *= factor;
            *n >= 0.01
        });
    }

    /// Above the bound (`queued` > `limit`): per waiting tenant, how many of its triggers
    /// may go in still — its weighted share of the bound less its estimated part of the
    /// queue, divided among `parts` — and none for a tenant at or over its share.
    fn shares(
        &mut self,
        limit: u64,
        tenants: &[&str],
        weight: impl Fn(&str) -> u32,
        parts: usize,
    ) -> HashMap<String, usize> {
        self.limit = limit;
        self.fade();
        let queued = self.queued() as f64;
        let seen: f64 = self.recent.values().sum();
        if seen <= 0.0 {
            // Nothing let in (or all of it long drained): whose work is queued is not
            // known, so nobody passes.
            return tenants.iter().map(|t| (t.to_string(), 0)).collect();
        }
        let mut active: Vec<&str> = self.recent.keys().map(String::as_str).collect();
        active.extend(tenants.iter().copied());
        active.sort_unstable();
        active.dedup();
        let weights: f64 = active.iter().map(|t| f64::from(weight(t).max(1))).sum();
        tenants
            .iter()
            .map(|t| {
                let share = limit as f64 * f64::from(weight(t).max(1)) / weights.max(1.0);
                let part = match self.recent.get(*t) {
                    Some(n) if seen > 0.0 => queued * n / seen,
                    _ => 0.0,
                };
                // Whole inputs under the share, a `parts`-th of them (rounded up) here.
                let under = (share - part).max(0.0).floor() as usize;
                let room = under.div_ceil(parts.max(1));
                (t.to_string(), room)
            })
            .collect()
    }

    /// Notes what each tenant let in; `at_bound`: they count as queued work until their
    /// commands show ([`Admission::admitted`]).
    fn record(&mut self, given: &BTreeMap<String, usize>, at_bound: bool) {
        self.fade();
        let mut n = 0u64;
        for (t, k) in given {
            *self.recent.entry(t.clone()).or_default() += *k as f64;
            n += *k as u64;
        }
        if at_bound && n > 0 {
            self.admitted(n);
        }
    }

    /// How many more triggers may go in under `saga.max_queued_work` now (0: hold, while
    /// the queued work is above it); `None` when the bound is off (0).
    async fn room(&mut self, state: &AppState) -> Option<u64> {
        let limit = state.config.saga.max_queued_work;
        if limit == 0 {
            return None;
        }
        self.limit = limit;
        if self.read_at.is_none_or(|at| at.elapsed() >= FRESH) {
            let (commands, stored) = effect_backlog(state).await;
            self.note_reading(commands, stored);
        }
        // Held above the bound; at it, one more goes in (so a bound of 0 queued never
        // starves), below it, as many as there is room for.
        let queued = self.queued();
        Some(if queued > limit {
            0
        } else {
            (limit - queued).max(1)
        })
    }

    /// Takes a reading of the effect consumers: `commands` queued now, `stored` ever. What
    /// was stored since the last reading and is no longer queued has finished.
    fn note_reading(&mut self, commands: u64, stored: u64) {
        if self.read_at.is_some() {
            let added = stored.saturating_sub(self.stored);
            let finished = (self.commands + added).saturating_sub(commands);
            self.drained = self.drained.saturating_add(finished);
        }
        (self.commands, self.stored) = (commands, stored);
        self.read_at = Some(Instant::now());
    }

    /// Notes `n` triggers let in at the bound: they count as queued until `n` more effect
    /// commands are stored (their outputs, applied and published), until the router finds
    /// they reach no saga that emits effect commands ([`Admission::quiet`]), or for
    /// [`CREDIT_TTL`] at most (a transition may emit none). Completions do not consume the
    /// credit: the count of commands stored only grows.
    fn admitted(&mut self, n: u64) {
        if self.credited_at.is_none() {
            self.credit_base = self.stored;
            self.credit = 0;
        }
        self.credit += n;
        self.credited_at = Some(Instant::now());
    }

    /// Takes back the credit of `n` triggers let in that reach no saga emitting effect
    /// commands: no command of theirs will ever show.
    fn quiet(&mut self, n: u64) {
        if self.credited_at.is_some() {
            self.credit = self.credit.saturating_sub(n);
        }
    }

    /// The queued work: the commands the broker shows, plus the triggers let in whose
    /// outputs it does not show yet.
    fn queued(&mut self) -> u64 {
        let unseen = (self.credit_base + self.credit).saturating_sub(self.stored);
        match self.credited_at {
            Some(at) if at.elapsed() < CREDIT_TTL && unseen > 0 => self.commands + unseen,
            _ => {
                self.credited_at = None;
                self.commands
            }
        }
    }
}

/// The gate of one node's routers of the aggregate stream (its shares): each takes its part
/// of the room and credits what it lets in, one at a time, so the shares together stay near
/// the bound.
#[derive(Clone)]
pub(crate) struct Gate(Arc<tokio::sync::Mutex<Admission>>);

impl Gate {
    /// A gate with nothing let in yet.
    pub(crate) fn new() -> Self {
        Self(Arc::new(tokio::sync::Mutex::new(Admission::router())))
    }

    /// What of `waiting` inputs of `tenants` may go in now: [`Gate::take`] when there is
    /// room; above the bound, what each tenant under its share may still let in. Tell the
    /// gate what went in ([`Gate::record`]).
    pub(crate) async fn room(
        &self,
        state: &AppState,
        waiting: usize,
        parts: usize,
        tenants: &[&str],
    ) -> Room {
        let n = self.take(state, waiting, parts).await;
        if n > 0 {
            return Room::Any(n);
        }
        let tenancy = state.limits.get();
        let weights = &tenancy.weights;
        let limit = state.config.saga.max_queued_work;
        let mut a = self.0.lock().await;
        Room::PerTenant(a.shares(
            limit,
            tenants,
            |t| weights.get(t).copied().unwrap_or(1),
            parts,
        ))
    }

    /// Notes what each tenant let in (`at_bound`: under [`Room::PerTenant`]).
    pub(crate) async fn record(&self, given: &BTreeMap<String, usize>, at_bound: bool) {
        self.0.lock().await.record(given, at_bound);
    }

    /// Tells the gate that `n` of the triggers it let in reach no saga emitting effect
    /// commands, so they no longer count as queued work ([`Admission::quiet`]).
    pub(crate) async fn quiet(&self, n: usize) {
        if n > 0 {
            self.0.lock().await.quiet(n as u64);
        }
    }

    /// How many of `waiting` inputs may go in now (0: hold): every one when the bound is
    /// off, else a `parts`-th of the room (at least one) and no more than wait. Inputs let
    /// in while others of the batch wait count as queued until the broker shows their
    /// commands ([`Admission::admitted`]).
    pub(crate) async fn take(&self, state: &AppState, waiting: usize, parts: usize) -> usize {
        let mut a = self.0.lock().await;
        match a.room(state).await {
            None => waiting,
            Some(0) => 0,
            Some(room) => {
                let part = usize::try_from(room)
                    .unwrap_or(usize::MAX)
                    .div_ceil(parts.max(1))
                    .max(1);
                let granted = part.min(waiting);
                if granted < waiting {
                    a.admitted(granted as u64);
                }
                granted
            }
        }
    }
}

/// Pending plus unacknowledged commands over the catch-all and every effect's consumer, and
/// the effect commands stored so far (delivered or pending: it only grows, redeliveries
/// aside); zeros when the stream cannot be read.
///
/// Each command is stored once but seen by two consumers (the catch-all sees every command,
/// its effect's consumer sees it too), so "stored" is the catch-all's count alone; only
/// when the catch-all cannot be read is it summed over the effect consumers, which do not
/// overlap. (Summing both counted each command twice: the credit of triggers let in at the
/// bound was used up by half their commands, and twice the bound could start.) The queued
/// count needs no such care: the catch-all acknowledges a covered command at once, so a
/// command pending or unacknowledged is so on one consumer.
async fn effect_backlog(state: &AppState) -> (u64, u64) {
    let c = &state.config;
    let Ok(stream) = state
        .broker
        .jetstream()
        .get_stream(&c.streams.workflow_commands)
        .await
    else {
        return (0, 0);
    };

    let base = &c.consumers.effect;
    let catalog = state.catalog();
    let own = catalog
        .effect_names()
        .filter(|e| has_own_consumer(base, e))
        .map(|e| consumer_name(base, e));
    let (mut total, mut by_effect) = (0u64, 0u64);
    let mut by_catch_all = None;
    for name in std::iter::once(base.clone()).chain(own) {
        if let Ok(info) = stream.consumer_info(&name).await {
            total += info.num_pending + info.num_ack_pending as u64;
            // Every command this consumer sees so far: delivered, or waiting to be.
            let seen = info.delivered.consumer_sequence + info.num_pending;
            if &name == base {
                by_catch_all = Some(seen);
            } else {
                by_effect += seen;
            }
        }
    }
    (total, by_catch_all.unwrap_or(by_effect))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(t: &str, n: usize) -> BTreeMap<String, usize> {
        BTreeMap::from([(t.to_string(), n)])
    }

    #[test]
    fn a_stuck_tenants_part_of_the_queue_does_not_fade_with_time_and_others_still_pass() {
        let mut a = Admission::router();
        // Six of A's commands queued above a bound of four, and nothing finishing.
        a.note_reading(6, 100);
        a.record(&given("a", 6), false);
        let w = |_: &str| 1;
        let shares = a.shares(4, &["a", "b"], w, 1);
        assert_eq!(shares["a"], 0, "A is over its share");
        assert_eq!(shares["b"], 2, "B, with nothing queued, gets its share");
        // Readings go on and the queue does not move: A's part stays, B still passes.
        for _ in 0..5 {
            a.note_reading(6, 100);
        }
        let shares = a.shares(4, &["a", "b"], w, 1);
        assert_eq!((shares["a"], shares["b"]), (0, 2));
        // Two queues' worth finish: A's count falls to a quarter.
        a.note_reading(2, 104);
        a.shares(4, &["a"], w, 1);
        let left = a.recent["a"];
        assert!((left - 1.5).abs() < 1e-9, "{left}");
    }

    #[test]
    fn triggers_that_start_no_effect_stop_counting_once_routed() {
        let mut a = Admission::router();
        a.note_reading(0, 0);
        // 512 triggers let in at a bound of 512: queued until their commands show.
        a.admitted(512);
        assert_eq!(a.queued(), 512);
        // 500 of them reach only sagas that emit no effect command: no command will show.
        a.quiet(500);
        assert_eq!(a.queued(), 12);
        // The others' commands show: nothing is counted twice.
        a.note_reading(12, 12);
        assert_eq!(a.queued(), 12);
        a.note_reading(0, 12);
        assert_eq!(a.queued(), 0);
        // Nothing credited, nothing to take back.
        a.quiet(10);
        assert_eq!(a.queued(), 0);
    }

    #[test]
    fn a_gate_that_has_let_nothing_in_lets_nobody_pass_above_the_bound() {
        let mut a = Admission::router();
        a.note_reading(10, 10);
        let shares = a.shares(4, &["a", "b"], |_| 1, 1);
        assert_eq!((shares["a"], shares["b"]), (0, 0));
    }
}
