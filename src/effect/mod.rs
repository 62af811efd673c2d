//! The effect worker: effect commands → upstream calls → result events.
//!
//! Every replica running effects pulls from one shared durable consumer
//! (`consumers.effect`) on the command stream, filtered to `tenant.*.effect.>`, with
//! explicit acks, `effect.ack_wait` and `effect.max_ack_pending`. A process runs at most
//! `effect.concurrency` commands at once. Per command:
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
//!    `Nats-Msg-Id` derived from the command id, awaiting the PubAck.
//! 5. **Ack** the command.
//!
//! Recording before publishing is deliberate: the fence must be checked before the one
//! externally visible write. A crash between 3 and 5 leaves a done claim; the redelivered
//! command republishes the stored result under the same `Nats-Msg-Id`, which JetStream
//! drops as a duplicate within its window (and the saga side drops by event id after it).
//!
//! **Drain**: fetching stops; calls in flight finish and are recorded; a command waiting
//! between retries is handed back at once (its lease expired by CAS, the message nak'ed) so
//! another replica takes it over instead of the drain waiting out the backoff.
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
//! Files: this one owns the consumer loop (fetching, the process-wide concurrency limit,
//! reopening the consumer with backoff, waiting for in-flight commands on drain);
//! `handle.rs` the steps above for one command, in one tracing span; `attempt.rs` step 2
//! with the lease renewal and progress acks; `command.rs` the envelope and the result
//! event; `context.rs` what the handlers share; [`claim`], [`breaker`] and [`provider`]
//! one concept each.

pub mod breaker;
pub mod claim;
pub mod command;
pub mod provider;

mod attempt;
mod context;
mod handle;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, kv};
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backoff::Backoff;
use crate::runtime::AppState;
use context::Ctx;

pub use command::{Command, CommandError, ResultType};
pub use context::{event, outcome};

/// Subject filter of the effect consumer.
pub const COMMAND_FILTER: &str = "tenant.*.effect.>";

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
    for o in [outcome::THROTTLED, outcome::REFUSED] {
        m.effect_commands.with_label_values(&[o]);
    }
    let ctx = Arc::new(Ctx::new(state, kv, cancel.clone()));
    tracker.spawn(consume(ctx, cancel));
}

async fn open_consumer(ctx: &Ctx) -> Result<pull::Stream, async_nats::Error> {
    let c = &ctx.state.config;
    let stream = ctx
        .state
        .broker
        .jetstream()
        .get_stream(&c.streams.workflow_commands)
        .await?;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(c.consumers.effect.clone()),
            description: Some("Runner effect workers (shared)".into()),
            filter_subject: COMMAND_FILTER.into(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: c.effect.ack_wait.get(),
            max_ack_pending: c.effect.max_ack_pending,
            max_deliver: -1,
            ..Default::default()
        })
        .await?;
    let batch = c.effect.concurrency.clamp(1, 256);
    Ok(consumer
        .stream()
        .max_messages_per_batch(batch)
        .expires(Duration::from_secs(5))
        .messages()
        .await?)
}

async fn consume(ctx: Arc<Ctx>, cancel: CancellationToken) {
    let in_flight = TaskTracker::new();
    let permits = Arc::new(Semaphore::new(ctx.state.config.effect.concurrency));
    let mut backoff =
        Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).with_jitter();
    'connect: while !cancel.is_cancelled() {
        let opened = tokio::select! {
            _ = cancel.cancelled() => break,
            m = open_consumer(&ctx) => m,
        };
        let mut messages = match opened {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(message = "Cannot open the effect consumer; retrying.", error = %e);
                if !backoff.sleep(&cancel).await {
                    break;
                }
                continue;
            }
        };
        tracing::info!(message = "Consuming effect commands.", consumer = %ctx.state.config.consumers.effect, owner = ctx.claims.owner());
        loop {
            let permit = tokio::select! {
                _ = cancel.cancelled() => break 'connect,
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break 'connect,
                },
            };
            let next = tokio::select! {
                _ = cancel.cancelled() => break 'connect,
                n = messages.next() => n,
            };
            match next {
                Some(Ok(msg)) => {
                    backoff.reset();
                    let ctx = ctx.clone();
                    in_flight.spawn(async move {
                        handle::handle(&ctx, msg).await;
                        drop(permit);
                    });
                }
                Some(Err(e)) => {
                    tracing::warn!(message = "Effect consumer error; reopening.", error = %e);
                    // A drain cuts the wait short; the loop's condition then ends it.
                    backoff.sleep(&cancel).await;
                    continue 'connect;
                }
                None => continue 'connect,
            }
        }
    }
    in_flight.close();
    in_flight.wait().await;
}
