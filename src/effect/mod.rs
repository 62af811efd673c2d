//! The effect worker: effect commands → upstream calls → result events.
//!
//! **Consumers** ([`consumers`]): every effect declared in the loaded manifests has a
//! durable pull consumer of its own on the command stream, `<consumers.effect>-<effect>`
//! filtered to `tenant.*.effect.<effect>.*`, and every effect-mode replica pulls from the
//! same ones (the deliver group: JetStream hands each command to one replica). Each has
//! its own fetch loop in each process, its own share of `effect.concurrency` slots and its
//! own `effect.max_ack_pending` across the replicas, so a slow upstream fills only its own
//! effect's slots and pending window; other effects go on. A loop asks JetStream for as
//! many commands as it has free slots plus what its slots finished in the last half second
//! (at most `effect.read_ahead`), and for no more bytes than its share of
//! `effect.max_inflight_bytes` has free ([`budget`]), so a replica whose slots stay full
//! leaves the rest to the others and large commands cannot fill memory. What it read ahead
//! starts in tenants' turns ([`turns`]): one tenant's queue of commands does not hold
//! another tenant's behind it, and a tenant with an effect rate limit
//! (`tenancy.effect_rate_limits`) waits there in order, holding neither a slot nor the
//! other tenants.
//! A catch-all consumer (`consumers.effect` itself, every command, headers only) acks what
//! an effect consumer of this process covers and handles the rest here: a command of an
//! effect no loaded manifest declares gets a `Failed` result saying so, through its claim
//! like any other. A manifest reload that adds an effect starts its consumer and loop
//! within a second; an effect a reload removes keeps its loop until the
//! process exits (its commands then fail as undeclared), and a consumer left from an
//! effect no longer declared is served from the next start on, so nothing it holds is
//! stranded. Per command:
//!
//! 1. **Gate** ([`claim`]): take the command's claim (create-if-absent, with no read first
//!    on a first delivery), take over one whose lease expired, republish the stored result
//!    of a finished one and execute nothing, or `nak` with a delay when a live executor
//!    holds it.
//! 2. **Execute** ([`provider`]) under a per-attempt timeout, retrying retryable failures
//!    with the saga engine's backoff formula ([`crate::saga::retry`]), behind a circuit
//!    breaker per effect ([`breaker`]). Meanwhile the lease is renewed every third of
//!    `effect.lease_ttl` and a `Progress` ack goes out every third of `effect.ack_wait`.
//!    A refused renewal abandons the call at once: the executor lost the right to finish.
//! 3. **Record** the outcome and the result event in the claim, CAS on the held revision —
//!    a zombie whose lease was taken over is refused here and publishes nothing.
//! 4. **Publish** the result on `tenant.<t>.effect_result.<effect>.<command_id>` with
//!    `Nats-Msg-Id` derived from the command id, awaiting the PubAck. A command a saga
//!    partition's relay sent names that partition (`Runner-Partition`): its result goes
//!    straight into the partition's inbox, `runner.inbox.<p>.result`, carrying its
//!    `effect_result` subject as `Runner-Subject`, so it is read once, by the owner waiting
//!    for it, and never routed.
//! 5. **Ack** the command.
//!
//! Recording before publishing is deliberate: the fence must be checked before the one
//! externally visible write. A crash between 3 and 5 leaves a done claim; the redelivered
//! command republishes the stored result under the same `Nats-Msg-Id`, which JetStream
//! drops as a duplicate within its window (and the saga side drops by event id after it).
//! The same holds when two consumers carry one command (a replica whose manifests lack an
//! effect answers through its catch-all while another runs it): the claim admits one.
//!
//! **Drain**: fetching stops on every loop; calls in flight finish and are recorded; a
//! command waiting between retries is handed back at once (its lease expired by CAS, the
//! message nak'ed) so another replica takes it over instead of the drain waiting out the
//! backoff.
//!
//! Delivery: at least once overall; at most one live executor per command; upstreams see
//! the same `Idempotency-Key` (the command id) on every attempt by every executor, so an
//! upstream that honours it applies a command once. An upstream may see a command twice
//! when its executor dies mid-call and another takes over after the lease.
//!
//! A command that cannot be decoded, whose subject and body disagree, whose tenant is not
//! allowed, or whose id cannot be a claim key is dead-lettered (`tenant.<t>.deadletter.<kind>`)
//! and terminated (`Term`); it never reaches an upstream.
//!
//! Files: this one owns the fetch loops (one per effect and the catch-all, each with its
//! slots, reopening its consumer with backoff), following reloads, and waiting for
//! in-flight commands on drain; [`consumers`] which consumers exist, where each starts and
//! what it covers; `handle.rs` the steps above for one command, in one tracing span;
//! `turns.rs` which waiting command starts next; `attempt.rs` step 2 with the lease renewal
//! and progress acks; `command.rs` the envelope
//! and the result event; `context.rs` what the handlers share; [`claim`], [`breaker`] and
//! [`provider`] one concept each.

pub mod breaker;
mod budget;
pub mod claim;
pub mod command;
pub mod consumers;
pub mod provider;

mod attempt;
mod context;
mod handle;
mod turns;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream::Stream};
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backoff::Backoff;
use crate::fair::tenant_of;
use crate::runtime::AppState;
use budget::{Budget, Held, Reservation};
use consumers::{Coverage, Opened, Which};
use context::Ctx;
use turns::{Pace, Turns};

pub use command::{Command, CommandError, ResultType};
pub use consumers::COMMAND_FILTER;
pub use context::{event, outcome};

/// How often the worker looks for effects that a manifest reload added.
const RELOAD_POLL: Duration = Duration::from_secs(1);
/// How long one pull request waits for commands.
const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// Spawns the effect worker on `tracker`; it stops fetching when `cancel` fires and returns
/// once its in-flight commands are finished.
pub fn spawn(
    tracker: &TaskTracker,
    state: Arc<AppState>,
    kv: kv::Store,
    cancel: CancellationToken,
) {
    // Series of bounded label sets exist from the start, so a zero reads as zero rather
    // than as a missing metric.
    let m = &state.metrics;
    for ev in event::ALL {
        m.effect_claims.with_label_values(&[ev]);
    }
    m.effect_commands.with_label_values(&[outcome::REFUSED]);
    let ctx = Arc::new(Ctx::new(state, kv, cancel.clone()));
    tracker.spawn(Worker::new(ctx, cancel).run());
}

/// The fetch loops of one process, and the effects they serve.
struct Worker {
    ctx: Arc<Ctx>,
    cancel: CancellationToken,
    coverage: Arc<Coverage>,
    /// The fetch loops.
    loops: TaskTracker,
    /// The command handlers of every loop, waited for on drain.
    in_flight: TaskTracker,
    /// Effect names this process has a loop for (or leaves to the catch-all on purpose).
    served: HashSet<String>,
}

impl Worker {
    fn new(ctx: Arc<Ctx>, cancel: CancellationToken) -> Self {
        Self {
            ctx,
            cancel,
            coverage: Arc::new(Coverage::default()),
            loops: TaskTracker::new(),
            in_flight: TaskTracker::new(),
            served: HashSet::new(),
        }
    }

    /// Starts a loop per effect (declared, or holding a consumer from earlier), then the
    /// catch-all; follows manifest reloads until the drain; returns once every loop and
    /// every handler has finished.
    async fn run(mut self) {
        let state = self.ctx.state.clone();
        let mut catalog = state.catalog();
        let mut names = catalog.summary().effects;
        match consumers::existing_effects(&state.config, state.broker.jetstream()).await {
            Ok(found) => names.extend(found),
            Err(e) => {
                tracing::warn!(message = "Cannot list the effect consumers; the catch-all answers the commands of effects no longer declared.", error = %e);
            }
        }
        for name in names {
            self.serve(name).await;
        }
        // Started once the effect consumers are open, so that it leaves them what they
        // cover from the start.
        self.start(Which::CatchAll, None);
        let mut poll = tokio::time::interval(RELOAD_POLL);
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                _ = poll.tick() => {}
            }
            let now = state.catalog();
            if Arc::ptr_eq(&now, &catalog) {
                continue;
            }
            catalog = now;
            for name in catalog.summary().effects {
                self.serve(name).await;
            }
        }
        self.loops.close();
        self.loops.wait().await;
        self.in_flight.close();
        self.in_flight.wait().await;
    }

    /// Starts the loop of `effect` unless it has one. An effect whose name cannot name a
    /// consumer is left to the catch-all.
    async fn serve(&mut self, effect: String) {
        if !self.served.insert(effect.clone()) {
            return;
        }
        let state = &self.ctx.state;
        if !consumers::has_own_consumer(&state.config.consumers.effect, &effect) {
            tracing::warn!(message = "Effect name cannot name a consumer; its commands go through the catch-all.", effect = %effect);
            return;
        }
        let which = Which::Effect(effect);
        // Opened here once, so its coverage is known before the catch-all starts; the loop
        // opens it again when this fails or the consumer goes away.
        let opened = consumers::open(
            &state.config,
            state.broker.jetstream(),
            &self.coverage,
            &which,
        )
        .await
        .ok();
        tracing::info!(message = "Serving an effect.", consumer = %which.name(&state.config.consumers.effect));
        self.start(which, opened);
    }

    fn start(&self, which: Which, opened: Option<Opened>) {
        let l = Loop {
            ctx: self.ctx.clone(),
            coverage: self.coverage.clone(),
            in_flight: self.in_flight.clone(),
            permits: Arc::new(Semaphore::new(self.ctx.state.config.effect.concurrency)),
            bytes: Budget::new(
                self.ctx.state.config.effect.max_inflight_bytes.get(),
                self.ctx.state.broker.max_payload(),
            ),
            which,
            finished: Arc::new(AtomicU64::new(0)),
        };
        self.loops.spawn(l.run(opened, self.cancel.clone()));
    }
}

/// One fetch loop: one effect's consumer, or the catch-all.
struct Loop {
    ctx: Arc<Ctx>,
    coverage: Arc<Coverage>,
    in_flight: TaskTracker,
    /// This loop's own share: at most `effect.concurrency` of its commands run at once.
    permits: Arc<Semaphore>,
    /// And at most `effect.max_inflight_bytes` of them are held at once ([`budget`]).
    bytes: Budget,
    which: Which,
    /// Commands this loop finished handling (what paces its read-ahead).
    finished: Arc<AtomicU64>,
}

impl Loop {
    async fn run(self, mut opened: Option<Opened>, cancel: CancellationToken) {
        let state = self.ctx.state.clone();
        let name = self.which.name(&state.config.consumers.effect);
        let mut backoff =
            Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).with_jitter();
        while !cancel.is_cancelled() {
            let attempt = match opened.take() {
                Some(o) => Ok(o),
                None => tokio::select! {
                    _ = cancel.cancelled() => break,
                    o = consumers::open(&state.config, state.broker.jetstream(), &self.coverage, &self.which) => o,
                },
            };
            let ended = match attempt {
                Ok(o) => {
                    tracing::info!(message = "Consuming effect commands.", consumer = %name, owner = self.ctx.claims.owner(), max_inflight_bytes = self.bytes.capacity_bytes());
                    match self.which {
                        Which::Effect(_) => self.pull_effect(&o, &cancel, &mut backoff).await,
                        Which::CatchAll => self.pull_catch_all(&o, &cancel, &mut backoff).await,
                    }
                }
                Err(e) => Err(e),
            };
            match ended {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(message = "Effect consumer failed; reopening it.", consumer = %name, error = %e);
                    // A drain cuts the wait short; the loop's condition then ends it.
                    backoff.sleep(&cancel).await;
                }
            }
        }
    }

    /// Pulls one effect's commands until the drain (`Ok`) or a consumer error. Beyond its
    /// free slots it reads ahead as many commands as its slots finished in the last
    /// [`turns::PATIENCE`] (at most `effect.read_ahead`) into tenants' lanes ([`crate::fair`]), and
    /// starts them in tenants' turns as slots free. So a loop whose slots stay full — a
    /// slow or hung upstream — reads no command it cannot start soon: the rest stay on the
    /// server for other replicas. Commands waiting in the lanes get a progress
    /// acknowledgement every third of `effect.ack_wait`, and go back to the stream (nak, no
    /// delay) when the loop ends, so another replica takes them at once.
    async fn pull_effect(
        &self,
        o: &Opened,
        cancel: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<(), async_nats::Error> {
        let effect = match &self.which {
            Which::Effect(e) => e.clone(),
            Which::CatchAll => String::new(),
        };
        let mut lanes = Turns::new(effect);
        let ended = self.pull_into(o, cancel, backoff, &mut lanes).await;
        for (msg, _held) in lanes.take_all() {
            let why = "its fetch loop stopped before starting it";
            handle::hand_back(&self.ctx, &msg, Some(Duration::ZERO), why).await;
        }
        ended
    }

    /// [`Loop::pull_effect`]'s loop, holding what it read in `lanes`.
    async fn pull_into(
        &self,
        o: &Opened,
        cancel: &CancellationToken,
        backoff: &mut Backoff,
        lanes: &mut Turns,
    ) -> Result<(), async_nats::Error> {
        let config = &self.ctx.state.config;
        let most = config.effect.concurrency.clamp(1, 256);
        let read_ahead = config.effect.read_ahead;
        let refresh = config.effect.ack_wait.get() / 3;
        let mut pull: Option<(jetstream::consumer::pull::Batch, Reservation)> = None;
        let mut pace = Pace::new(self.finished.load(Ordering::Relaxed));
        loop {
            let ahead = pace.ahead(self.finished.load(Ordering::Relaxed), read_ahead);
            // Start what the free slots allow, in tenants' turns within their limits.
            let mut held = None;
            while !lanes.is_empty() {
                let Ok(slot) = self.permits.clone().try_acquire_owned() else {
                    break;
                };
                held = self.start_next(lanes, slot);
                if held.is_some() {
                    break;
                }
            }
            let free = self.permits.available_permits();
            // Ask for what fits: the free slots and the read-ahead not yet used.
            let wanted = (free + ahead)
                .saturating_sub(lanes.counted(read_ahead))
                .min(most.max(free));
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                // A slot frees: for the next command waiting, else to pull again.
                slot = self.permits.clone().acquire_owned(), if held.is_none() && (!lanes.is_empty() || wanted == 0) => {
                    if let Ok(slot) = slot {
                        self.start_next(lanes, slot);
                    }
                }
                // Every tenant waiting is at its effect rate limit: look again when one
                // has an allowance.
                _ = tokio::time::sleep(held.unwrap_or_default()), if held.is_some() => {}
                room = self.bytes.reserve(), if pull.is_none() && wanted > 0 => {
                    let Some(room) = room else { return Ok(()) };
                    let batch = o
                        .consumer
                        .batch()
                        .max_messages(wanted)
                        .max_bytes(room.limit_for(wanted))
                        .expires(PULL_EXPIRES)
                        .messages()
                        .await?;
                    pull = Some((batch, room));
                }
                next = next_command(&mut pull), if pull.is_some() => match next {
                    Some(Ok(msg)) => {
                        backoff.reset();
                        let Some((_, room)) = pull.as_mut() else { continue };
                        let held = room.take(msg.length);
                        let seq = msg.info().map_or(0, |i| i.stream_sequence);
                        let tenant = tenant_of(msg.subject.as_str()).to_string();
                        lanes.push(&tenant, seq, msg, held);
                    }
                    // The server ended this pull (byte limit, batch over): not an error.
                    Some(Err(e)) if ended_by_server(&*e) => pull = None,
                    Some(Err(e)) => return Err(e),
                    None => pull = None,
                },
                _ = tokio::time::sleep(refresh), if !lanes.is_empty() => {
                    // Still held here, not forgotten: no redelivery elsewhere meanwhile.
                    for msg in lanes.stale(refresh) {
                        let _ = msg.ack_with(jetstream::AckKind::Progress).await;
                    }
                }
            }
        }
    }

    /// Starts the next command in tenants' turns on `slot` (none startable: the slot is
    /// given back). Returns how long to wait when every tenant waiting is at its limit.
    fn start_next(&self, lanes: &mut Turns, slot: OwnedSemaphorePermit) -> Option<Duration> {
        match lanes.next(&self.ctx.state) {
            turns::Next::Start(msg, held) => {
                self.dispatch(msg, slot, Some(held));
                None
            }
            turns::Next::Held(wait) => Some(wait),
            turns::Next::Empty => None,
        }
    }

    /// Pulls the catch-all's commands (headers only) until the drain (`Ok`) or a consumer
    /// error, sorting each ([`Loop::sort`]).
    async fn pull_catch_all(
        &self,
        o: &Opened,
        cancel: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<(), async_nats::Error> {
        let mut messages = o
            .consumer
            .stream()
            .max_messages_per_batch(256)
            .expires(PULL_EXPIRES)
            .messages()
            .await?;
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                n = messages.next() => n,
            };
            match next {
                Some(Ok(msg)) => {
                    backoff.reset();
                    self.sort(&o.stream, msg, cancel).await;
                }
                Some(Err(e)) => return Err(e.into()),
                None => return Err("the catch-all's message stream ended".into()),
            }
        }
    }

    /// A slot of this loop's share, or None once the drain begins.
    async fn acquire(&self, cancel: &CancellationToken) -> Option<OwnedSemaphorePermit> {
        tokio::select! {
            _ = cancel.cancelled() => None,
            p = self.permits.clone().acquire_owned() => p.ok(),
        }
    }

    /// Runs the handling of one command on the in-flight tracker, holding `permit`.
    fn dispatch(&self, msg: jetstream::Message, permit: OwnedSemaphorePermit, bytes: Option<Held>) {
        let ctx = self.ctx.clone();
        let finished = self.finished.clone();
        self.in_flight.spawn(async move {
            handle::handle(&ctx, msg).await;
            finished.fetch_add(1, Ordering::Relaxed);
            drop(permit);
            drop(bytes);
        });
    }

    /// The catch-all's decision for one command (headers only): ack it when an effect
    /// consumer of this process covers it, else fetch its body and handle it here.
    async fn sort(&self, stream: &Stream, mut msg: jetstream::Message, cancel: &CancellationToken) {
        let Ok(seq) = msg.info().map(|i| i.stream_sequence) else {
            handle::hand_back(&self.ctx, &msg, None, "its delivery info was unreadable").await;
            return;
        };
        if self.coverage.covers(msg.subject.as_str(), seq) {
            let _ = msg.ack().await;
            return;
        }
        let Some(permit) = self.acquire(cancel).await else {
            // Draining: another replica answers it.
            let why = "a draining worker handed it back";
            handle::hand_back(&self.ctx, &msg, Some(Duration::ZERO), why).await;
            return;
        };
        match stream.get_raw_message(seq).await {
            Ok(raw) => msg.message.payload = raw.payload,
            Err(e) if e.kind() == jetstream::stream::RawMessageErrorKind::NoMessageFound => {
                tracing::warn!(
                    message = "Effect command no longer in the stream; nothing to answer.",
                    stream_sequence = seq
                );
                let _ = msg.ack().await;
                return;
            }
            Err(e) => {
                tracing::warn!(message = "Cannot read an effect command's body; will retry.", stream_sequence = seq, error = %e);
                handle::hand_back(&self.ctx, &msg, None, "its body could not be read").await;
                return;
            }
        }
        self.dispatch(msg, permit, None);
    }
}

/// The next command of the pull in flight (never, when there is none).
async fn next_command(
    pull: &mut Option<(jetstream::consumer::pull::Batch, Reservation)>,
) -> Option<Result<jetstream::Message, async_nats::Error>> {
    match pull {
        Some((batch, _)) => batch.next().await,
        None => std::future::pending().await,
    }
}

/// Whether a pull's error is only the server ending that pull request (status 409 with
/// "Message Size Exceeds MaxBytes": the next command did not fit the bytes asked for;
/// "Batch Completed": the request is over with bytes left unused; "Leadership Change": the
/// consumer moved). The client reports these as errors, but the consumer is fine: the loop
/// pulls again, and only a failing pull reopens the consumer.
fn ended_by_server(e: &(dyn std::error::Error + 'static)) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    text.contains("409")
        && ["exceeds maxbytes", "batch completed", "leadership change"]
            .iter()
            .any(|s| text.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, description: &str) -> std::io::Error {
        // The wording async-nats gives a pull's status, as seen in runs.
        std::io::Error::other(format!(
            "error while processing messages from the stream: {code}, Some({description:?})"
        ))
    }

    #[test]
    fn statuses_that_only_end_a_pull_are_told_from_failures() {
        for d in [
            "Message Size Exceeds MaxBytes",
            "Batch Completed",
            "Leadership Change",
        ] {
            assert!(ended_by_server(&status(409, d)), "{d}");
        }
        for (c, d) in [
            (409, "Consumer Deleted"),
            (409, "Exceeded MaxWaiting"),
            (503, "No Responders"),
        ] {
            assert!(!ended_by_server(&status(c, d)), "{c} {d}");
        }
    }
}
