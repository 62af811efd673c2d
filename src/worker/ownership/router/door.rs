//! The door of the saga inbox, for one share's router: which inputs waiting in the lanes go
//! in next, and how many.
//!
//! Guarantees kept here (the rest of the router is `mod.rs`):
//! - **Work under way first, tenants in turns.** A batch takes what admission lets in now
//!   (`worker/admit.rs`): any tenant's inputs while there is room under
//!   `saga.max_queued_work`, above it only those of tenants under their weighted share; in
//!   weighted turns ([`crate::fair`]), never more of a tenant than its rate limit allows
//!   (`tenancy.rate_limits`), and nothing of a tenant whose outputs waiting in the
//!   deployment's outboxes reached its cap (`tenancy.outbox_byte_caps`,
//!   `crate::relay::Relays::deployment_bytes`). What is not let in waits in its lane, in
//!   order.
//! - **One batch at a time.** What is read meanwhile joins the lanes before the next batch
//!   is chosen; while the lanes have room no batch waits for admission, so reading goes on
//!   and every tenant's inputs reach the lanes. Full lanes wait for room — and read no
//!   further while a tenant at its outbox cap fills them (`tenancy.outbox_byte_caps`).
//! - **Seen.** What waits is reported by tenant (`crate::fair::Usage`, the `runner_tenant_*`
//!   metrics), at most every [`REPORT_EVERY`] and at once when the lanes empty; the time
//!   admission held the lanes is observed when their next batch goes.

use std::time::{Duration, Instant};

use super::copies::{Stop, send};
use super::hold::{Unheld, hold};
use super::{Ended, Reader, Routing, Stopped, share};
use crate::worker::admit::Room;

/// How often a router reports what waits in its lanes, at most.
const REPORT_EVERY: Duration = Duration::from_millis(250);

impl Routing<'_> {
    /// Copies one batch of what waits in the lanes, in tenants' turns, as far as admission
    /// lets it in now (`admit.rs`), reading the next chunk meanwhile; its marker records
    /// the lanes' progress. Returns whether a batch went. One batch at a time, so what is
    /// read meanwhile joins the lanes before the next batch is chosen; while the lanes have
    /// room it does not wait for admission (reading goes on, so every tenant's inputs
    /// reach the lanes); full lanes wait here.
    pub(super) async fn copy_once(&mut self, reader: &mut Reader) -> Result<bool, Ended> {
        {
            let tenancy = self.state.limits.get();
            // New inputs of a tenant whose outputs waiting in the outboxes reached its cap
            // wait (`tenancy.outbox_byte_caps`; results and timers are never held). They
            // ask admission for no room: credit for them would hold the others.
            let outbox_full = self.outbox_full(&tenancy);
            let waiting = self.lanes.len()
                - outbox_full
                    .iter()
                    .map(|t| self.lanes.len_of(t))
                    .sum::<usize>();
            for t in &outbox_full {
                self.state
                    .metrics
                    .tenant_outbox_capped
                    .with_label_values(&[&crate::fair::label_of(&tenancy, t)])
                    .inc();
            }
            if waiting == 0 {
                // (Not an admission wait: `held_since` is left alone.)
                self.report(false);
                return Ok(false);
            }
            let room = if self.lanes.full() {
                Room::Any(self.room(waiting).await.map_err(Ended::Stop)?)
            } else {
                // Reading goes on while admission answers (it may ask the broker, which
                // is slow under a burst): a tenant's input stored behind the burst is read
                // meanwhile, not after.
                reader.during(self.room_now(waiting)).await
            };
            let weight = |t: &str| tenancy.weights.get(t).copied().unwrap_or(1);
            // Only new inputs (the aggregate stream's routers) are rate limited.
            let rate = |t: &str| {
                self.admission.as_ref()?;
                tenancy.rate_limits.get(t).copied()
            };
            // Whether what goes in now was credited as queued work (`worker/admit.rs`): at
            // the bound, or when the room was smaller than what waits.
            let credited = match &room {
                Room::Any(n) => *n < waiting,
                Room::PerTenant(_) => true,
            };
            let (room_n, caps) = match &room {
                Room::Any(n) => (*n, None),
                Room::PerTenant(caps) => (usize::MAX, Some(caps)),
            };
            let cap = |t: &str| {
                if outbox_full.iter().any(|f| f == t) {
                    return 0;
                }
                caps.map_or(usize::MAX, |c| c.get(t).copied().unwrap_or(0))
            };
            let buckets = self.state.tenants.allowances();
            let taken = self
                .lanes
                .take_within_rates(room_n, weight, cap, buckets, rate);
            for (t, _) in &taken.limited {
                self.state
                    .metrics
                    .tenant_rate_limited
                    .with_label_values(&[&crate::fair::label_of(&tenancy, t)])
                    .inc();
            }
            let (batch, given) = (taken.items, taken.given);
            // What waits, at once when nothing does any more.
            self.report(self.lanes.is_empty());
            if batch.is_empty() {
                self.held_since.get_or_insert_with(Instant::now);
                return Ok(false);
            }
            if let Some(gate) = &self.admission {
                gate.record(&given, matches!(room, Room::PerTenant(_)))
                    .await;
                self.state
                    .tenants
                    .let_in(&given, &tenancy, &self.state.metrics);
            }
            if let Some(since) = self.held_since.take() {
                let held = since.elapsed().as_secs_f64();
                self.state.metrics.admission_wait.observe(held);
            }
            let progress = self.lanes.progress(self.read_through);
            // The next chunk is read while this batch is routed (see `ReadAhead`).
            let sent = reader
                .during(send(
                    self.state,
                    self.share,
                    &self.filters,
                    &mut self.fence,
                    batch,
                    progress,
                ))
                .await;
            match sent {
                Ok(quiet) => {
                    self.backoff.reset();
                    // They were credited as queued work until their commands show; they
                    // make none.
                    if let Some(gate) = self.admission.as_ref().filter(|_| credited) {
                        gate.quiet(quiet).await;
                    }
                }
                Err(Stop::Fenced) => {
                    return Err(Ended::Stop(Stopped::kept("fenced off by a newer router")));
                }
                Err(Stop::Retry) => {
                    self.backoff.sleep(self.cancel).await;
                    return Err(Ended::Reopen);
                }
            }
        }
        Ok(true)
    }

    /// The tenants waiting in the lanes whose outputs waiting in the deployment's outboxes
    /// reached their cap (`tenancy.outbox_byte_caps`); none for a router of results.
    fn outbox_full(&self, tenancy: &crate::config::TenancyConfig) -> Vec<String> {
        if self.admission.is_none() || tenancy.outbox_byte_caps.is_empty() {
            return Vec::new();
        }
        self.lanes
            .tenants()
            .filter(|t| {
                tenancy
                    .outbox_byte_caps
                    .get(*t)
                    .is_some_and(|c| self.state.relays.deployment_bytes(t) >= c.get())
            })
            .map(str::to_string)
            .collect()
    }

    /// Reports what waits in the lanes, by tenant (`crate::fair::Usage`): at most every
    /// [`REPORT_EVERY`], or at once when `now`.
    pub(super) fn report(&mut self, now: bool) {
        if self.admission.is_none() || (!now && self.reported_at.elapsed() < REPORT_EVERY) {
            return;
        }
        self.reported_at = Instant::now();
        let waiting = self
            .lanes
            .waiting_by_tenant()
            .into_iter()
            .map(|(t, n, oldest)| (t.to_string(), n, oldest))
            .collect();
        let tenancy = self.state.limits.get();
        self.state
            .tenants
            .report(&self.label, waiting, &tenancy, &self.state.metrics);
    }

    /// What of the `waiting` inputs admission lets in at once, without holding; all of
    /// them for a router without admission.
    async fn room_now(&self, waiting: usize) -> Room {
        match self.admission.as_ref() {
            None => Room::Any(waiting),
            Some(gate) => {
                let tenants: Vec<&str> = self.lanes.tenants().collect();
                gate.room(self.state, waiting, share::SHARES as usize, &tenants)
                    .await
            }
        }
    }

    /// How many of the `waiting` inputs may go in now: all of them for a router without
    /// admission, else this share's part of the room under the bound, once it has any.
    async fn room(&mut self, waiting: usize) -> Result<usize, Stopped> {
        let Some(gate) = self.admission.as_ref() else {
            return Ok(waiting);
        };
        match hold(self.state, gate, waiting, self.lease, self.cancel).await {
            Ok((held, room)) => {
                if !held.is_zero() {
                    // Observed when the batch goes (`copy_once`), as one wait.
                    let since = Instant::now()
                        .checked_sub(held)
                        .unwrap_or_else(Instant::now);
                    self.held_since.get_or_insert(since);
                }
                Ok(room)
            }
            Err(Unheld::Lost) => Err(Stopped::lost()),
            Err(Unheld::NotRouting) => Err(Stopped::not_routing()),
            Err(Unheld::Drain) => Err(Stopped::drain()),
        }
    }
}
