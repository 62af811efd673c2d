//! How far an effect's fetch loop reads ahead of its slots ([`Pace`]: as many commands as
//! its slots finished lately), and which of the commands read ahead starts next:
//! tenants take turns ([`crate::fair::Lanes`], weighted by `tenancy.weights`), and a tenant
//! with an effect rate limit for this effect (`tenancy.effect_rate_limits`) starts at most
//! that many calls a second on this node.
//!
//! **Guarantees.**
//! - **Order per tenant** as read: a tenant's commands of this effect start in stream order.
//! - **Held, not dropped.** A tenant at its limit passes its turn (counted in
//!   `runner_tenant_effect_rate_limited_total`); its commands wait here, in order, and start
//!   as its allowance grows. Other tenants' commands start meanwhile.
//! - **Reading past a held tenant.** While only held tenants' commands wait, up to
//!   `effect.read_ahead` of them do not count against what the loop may read ahead, so
//!   another tenant's commands behind them in the stream are read and started. The
//!   consumer reads in stream order and held commands stay unacknowledged, so a held
//!   backlog larger than that window (or than the consumer's `effect.max_ack_pending`)
//!   holds the effect's other tenants behind it too, until it fits: nothing can skip
//!   messages it has not read. The limits in force are read at each turn, so a reload
//!   ([`crate::quota`]) applies at once.
//! - Every call started is counted in `runner_tenant_effect_calls_total`.

use std::time::Duration;

use async_nats::jetstream::Message;

use super::budget::Held;
use crate::fair::{Lanes, Taken, label_of};
use crate::quota::Buckets;
use crate::runtime::AppState;

/// The longest a held loop sleeps before looking at its limits again (a reload may have
/// raised them).
const RECHECK: Duration = Duration::from_secs(1);

/// How long a command read ahead should wait for a slot at the pace the slots finish.
pub(super) const PATIENCE: Duration = Duration::from_millis(500);

/// The pace at which a loop's slots finish commands, over the last [`PATIENCE`].
pub(super) struct Pace {
    at: std::time::Instant,
    count: u64,
    /// Commands finished in the last full [`PATIENCE`].
    last: u64,
}

impl Pace {
    pub(super) fn new(finished: u64) -> Self {
        Self {
            at: std::time::Instant::now(),
            count: finished,
            last: 0,
        }
    }

    /// How many commands to read ahead of the free slots: as many as finished in the last
    /// [`PATIENCE`] (none when nothing finished), at most `most`.
    pub(super) fn ahead(&mut self, finished: u64, most: usize) -> usize {
        let elapsed = self.at.elapsed();
        if elapsed >= PATIENCE {
            let periods = elapsed.as_secs_f64() / PATIENCE.as_secs_f64();
            self.last = ((finished - self.count) as f64 / periods) as u64;
            self.count = finished;
            self.at = std::time::Instant::now();
        }
        usize::try_from(self.last).unwrap_or(usize::MAX).min(most)
    }
}

/// What [`Turns::next`] gives (moved out at once, so its size costs nothing; boxing the
/// command would cost an allocation per call).
#[allow(clippy::large_enum_variant)]
pub(super) enum Next {
    /// Start this command.
    Start(Message, Held),
    /// Every tenant waiting is at its limit: look again after this long.
    Held(Duration),
    /// Nothing waits.
    Empty,
}

/// One effect loop's waiting commands.
pub(super) struct Turns {
    lanes: Lanes<(Message, Held)>,
    effect: String,
    allowances: Buckets,
    /// Whether the last [`Turns::next`] found only held tenants.
    held: bool,
}

impl Turns {
    /// No commands yet, of effect `effect`.
    pub(super) fn new(effect: String) -> Self {
        Self {
            lanes: Lanes::new(usize::MAX, usize::MAX),
            effect,
            allowances: Buckets::default(),
            held: false,
        }
    }

    /// Queues `msg` (stream sequence `seq`) in `tenant`'s lane.
    pub(super) fn push(&mut self, tenant: &str, seq: u64, msg: Message, held: Held) {
        let bytes = msg.length;
        self.lanes.push(tenant, seq, bytes, (msg, held));
        self.held = false;
    }

    /// Whether nothing waits.
    pub(super) fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// What waits and counts against the loop's read-ahead: everything, unless only
    /// tenants at their limits wait; then what passes `most_held` of them.
    pub(super) fn counted(&self, most_held: usize) -> usize {
        if self.held {
            self.lanes.len().saturating_sub(most_held)
        } else {
            self.lanes.len()
        }
    }

    /// The next command to start in tenants' turns within their limits.
    pub(super) fn next(&mut self, state: &AppState) -> Next {
        if self.lanes.is_empty() {
            return Next::Empty;
        }
        let tenancy = state.limits.get();
        let rate = |t: &str| {
            tenancy
                .effect_rate_limits
                .get(t)
                .and_then(|m| m.get(&self.effect))
                .copied()
        };
        let weight = |t: &str| tenancy.weights.get(t).copied().unwrap_or(1);
        let Taken {
            items: mut taken,
            given,
            limited,
        } = self
            .lanes
            .take_within_rates(1, weight, |_| usize::MAX, &self.allowances, rate);
        for (t, _) in &limited {
            state
                .metrics
                .tenant_effect_rate_limited
                .with_label_values(&[&label_of(&tenancy, t), &self.effect])
                .inc();
        }
        if let Some((msg, held)) = taken.pop() {
            for t in given.keys() {
                state
                    .metrics
                    .tenant_effect_calls
                    .with_label_values(&[&label_of(&tenancy, t), &self.effect])
                    .inc();
            }
            self.held = false;
            return Next::Start(msg, held);
        }
        self.held = true;
        // Nothing was taken, so every tenant waiting is at its limit.
        let wait = limited
            .iter()
            .map(|(t, r)| self.allowances.wait(t, *r))
            .min()
            .unwrap_or(RECHECK);
        Next::Held(wait.clamp(Duration::from_millis(1), RECHECK))
    }

    /// The commands that waited `age` or more since read or last returned here.
    pub(super) fn stale(&mut self, age: Duration) -> Vec<&Message> {
        self.lanes.stale(age).into_iter().map(|(m, _)| m).collect()
    }

    /// Everything waiting, taken out (the loop is ending).
    pub(super) fn take_all(&mut self) -> Vec<(Message, Held)> {
        self.lanes.take_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_reads_ahead_only_what_its_slots_finished_lately() {
        let mut pace = Pace::new(0);
        // Nothing finished yet (a hung upstream): nothing is read ahead.
        assert_eq!(pace.ahead(0, 1024), 0);
        // Half a second later, 300 finished: that many may wait for a slot.
        pace.at -= PATIENCE;
        let n = pace.ahead(300, 1024);
        assert!((290..=300).contains(&n), "{n}");
        // Never more than `effect.read_ahead`.
        pace.at -= PATIENCE;
        assert_eq!(pace.ahead(3300, 1024), 1024);
        // Slots stop finishing: the read-ahead falls to nothing within one period.
        pace.at -= PATIENCE;
        assert_eq!(pace.ahead(3300, 1024), 0);
    }
}
