//! The attempts of one claimed command, under a live lease.
//!
//! Owns [`run_guarded`]: it runs every attempt of a command ([`execute`]: a timeout per
//! attempt, the effect's circuit breaker, retries of retryable failures with the saga
//! engine's backoff formula, [`crate::saga::retry`]) while, beside it, the claim's lease is
//! renewed every third of `effect.lease_ttl` and a `Progress` ack goes out every third of
//! `effect.ack_wait`.
//!
//! Guarantees: a renewal refused by CAS, or a lease that runs out unrenewed, abandons the
//! call at once ([`Guarded::Lost`]) — at the lease's recorded end, not at the next renewal
//! tick, so no attempt runs or starts past it: the executor has lost the right to finish,
//! and another one may already be running the command. A drain does not wait out a backoff between
//! retries: the command is handed back ([`Guarded::HandBack`]) for another replica. Every
//! attempt, by every executor, carries the command id as its idempotency key.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use serde_json::{Value as Json, json};

use super::claim::{ClaimError, Lease};
use super::command::{Command, ResultType};
use super::context::{Ctx, event};
use super::provider::{CallEnv, EffectError};
use crate::clock::now_ms;
use crate::manifest::model::RetryPolicy;
use crate::saga::retry::{JitterKey, delay_ms};
use crate::telemetry::otel;

/// How a guarded execution ended.
pub(super) enum Guarded {
    /// An outcome to record and publish.
    Done(ResultType, Json, u32),
    /// The lease was lost: the call was abandoned.
    Lost,
    /// Draining while waiting between retries: give the command back.
    HandBack,
}

/// Runs the command while renewing the lease and sending progress acks.
pub(super) async fn run_guarded(
    ctx: &Ctx,
    msg: &jetstream::Message,
    cmd: &Command,
    lease: &mut Lease,
) -> Guarded {
    let ttl = ctx.claims.ttl();
    let exec = execute(ctx, cmd);
    tokio::pin!(exec);
    let mut renew = tokio::time::interval(ttl / 3);
    renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    renew.tick().await;
    let mut progress = tokio::time::interval(ctx.state.config.effect.ack_wait.get() / 3);
    progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    progress.tick().await;
    loop {
        // The lease's own end, as the claim records it: between two renewal ticks it may
        // run out (renewals failing while NATS is unreachable), and from then on another
        // executor may take the command. Nothing of this attempt, and no further attempt,
        // may go on past it.
        let left = std::time::Duration::from_millis(lease.expires_ms.saturating_sub(now_ms()));
        tokio::select! {
            out = &mut exec => return match out {
                Some((rt, payload, attempts)) => Guarded::Done(rt, payload, attempts),
                None => Guarded::HandBack,
            },
            _ = renew.tick() => {
                // A renewal nobody answers (NATS unreachable) must not keep the call going
                // past the lease's end either.
                let Ok(renewed) = tokio::time::timeout(left, ctx.claims.renew(lease)).await else {
                    ctx.claim_event(event::RENEW_FAILED);
                    tracing::warn!(message = "Lease ran out while its renewal went unanswered: another executor may hold the command now; abandoning the command.");
                    return Guarded::Lost;
                };
                match renewed {
                    Ok(()) => ctx.claim_event(event::RENEWED),
                    Err(e @ ClaimError::Fenced { .. }) => {
                        ctx.claim_event(event::RENEW_FAILED);
                        tracing::warn!(message = "Lease renewal refused: another executor took the command over; abandoning it.", error = %e);
                        return Guarded::Lost;
                    }
                    Err(e) => {
                        if now_ms() >= lease.expires_ms {
                            ctx.claim_event(event::RENEW_FAILED);
                            tracing::warn!(message = "Lease expired without a successful renewal; abandoning the command.", error = %e);
                            return Guarded::Lost;
                        }
                        tracing::warn!(message = "Lease renewal failed; will try again before it expires.", error = %e);
                    }
                }
            }
            _ = progress.tick() => {
                let _ = msg.ack_with(AckKind::Progress).await;
            }
            () = tokio::time::sleep(left) => {
                ctx.claim_event(event::RENEW_FAILED);
                tracing::warn!(message = "Lease ran out before a renewal succeeded: another executor may hold the command now; abandoning the command.");
                return Guarded::Lost;
            }
        }
    }
}

/// All attempts of one command: timeout per attempt, breaker, retries with backoff.
async fn execute(ctx: &Ctx, cmd: &Command) -> Option<(ResultType, Json, u32)> {
    let catalog = ctx.state.catalog();
    let Some(effect) = catalog.effect(&cmd.effect).cloned() else {
        tracing::warn!(
            message = "No loaded manifest declares this effect; answering the command as failed."
        );
        let e = EffectError::Fatal {
            reason: format!(
                "effect `{}` is not declared in the loaded manifests",
                cmd.effect
            ),
            details: json!({}),
        };
        return Some((ResultType::Failed, e.to_payload(), 0));
    };
    let provider = match ctx.provider(&effect) {
        Ok(p) => p,
        Err(reason) => {
            let e = EffectError::Fatal {
                reason,
                details: json!({}),
            };
            return Some((ResultType::Failed, e.to_payload(), 0));
        }
    };
    let policy = cmd.retry().or(effect.retry).unwrap_or(RetryPolicy {
        retry_limit: 0,
        base_backoff: None,
        max_backoff: 0,
        enable_jitter: false,
    });
    let timeout = cmd
        .body
        .get("timeout_ms")
        .and_then(Json::as_u64)
        .or(effect.timeout_ms)
        .map(Duration::from_millis)
        .unwrap_or(ctx.state.config.effect.default_timeout.get());
    let breaker = effect.circuit_breaker.as_ref();
    let metrics = &ctx.state.metrics;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        // Each attempt is an `effect.call` span (child of `effect.execute`); the upstream
        // is sent its trace context, so the upstream's own spans join the trace.
        let mut call = otel::hop(
            "effect.call",
            otel::Kind::Client,
            cmd.traceparent.as_deref(),
            || {
                vec![
                    otel::attr("runner.effect", effect.name.as_str()),
                    otel::attr("runner.command_id", cmd.command_id.as_str()),
                    otel::KeyValue::new("runner.attempt", i64::from(attempts)),
                ]
            },
        );
        let env = CallEnv {
            http: &ctx.http,
            nats: ctx.state.broker.client(),
            timeout,
            // A result holds the answer (or what `result` makes of it): an answer larger
            // than a result may be could never be reported as it is.
            max_answer_bytes: ctx.state.broker.max_record_bytes(),
            traceparent: otel::onward(call.as_ref(), cmd.traceparent.as_deref()),
        };
        let result = if ctx.breakers.allow(&effect.name, breaker) {
            let r = match tokio::time::timeout(
                timeout,
                provider.call(&effect.name, &cmd.body, &cmd.command_id, &env),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(EffectError::TimedOut(timeout)),
            };
            let health_failure = r
                .as_ref()
                .err()
                .is_some_and(EffectError::counts_for_breaker);
            ctx.breakers.record(&effect.name, breaker, health_failure);
            r
        } else {
            Err(EffectError::CircuitOpen(effect.name.clone()))
        };
        let outcome = match &result {
            Ok(_) => "succeeded",
            Err(EffectError::Fatal { .. }) => "fatal",
            Err(e) if e.is_timeout() => "timed_out",
            Err(EffectError::CircuitOpen(_)) => "circuit_open",
            Err(_) => "retryable",
        };
        metrics
            .effect_attempts
            .with_label_values(&[effect.name.as_str(), outcome])
            .inc();
        if let Some(call) = call.as_mut() {
            call.set("runner.outcome", outcome);
            if let Err(e) = &result {
                call.fail(e.to_string());
            }
        }
        drop(call);
        let err = match result {
            Ok(payload) => return Some((ResultType::Succeeded, payload, attempts)),
            Err(e) => e,
        };
        let retries_done = attempts.saturating_sub(1);
        if !err.is_retryable() || retries_done >= policy.retry_limit {
            tracing::info!(message = "Effect failed.", attempts, error = %err);
            let rt = if err.is_timeout() {
                ResultType::TimedOut
            } else {
                ResultType::Failed
            };
            return Some((rt, err.to_payload(), attempts));
        }
        let retry = retries_done + 1;
        let key = JitterKey {
            tenant: &cmd.tenant,
            saga: &effect.name,
            correlation_id: &cmd.command_id,
            step: "effect",
        };
        let mut wait = Duration::from_millis(delay_ms(&policy, retry, &key));
        if let EffectError::Retryable {
            retry_after: Some(after),
            ..
        } = &err
        {
            wait = wait.max(*after);
        }
        if matches!(err, EffectError::CircuitOpen(_)) {
            // No call went out; wait at least a little so an open circuit is not spun on.
            wait = wait.max(Duration::from_millis(100));
        }
        tracing::debug!(message = "Effect attempt failed; retrying.", retry, wait = ?wait, error = %err);
        // A drain does not wait out a backoff: the command is handed back instead.
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = ctx.drain.cancelled() => return None,
        }
    }
}
