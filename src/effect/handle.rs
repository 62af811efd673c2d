//! The handling of one delivered effect command, from gate to ack.
//!
//! Owns the order of the steps described in [`super`]: decode and check the command
//! (refusing what can never run: [`refuse`] dead-letters it and terminates it), pass the
//! claim gate, run the attempts under the lease
//! ([`super::attempt`]), **record** the outcome in the claim, **publish** the result, and
//! **ack** the command. Every line logged while handling a command sits in one span,
//! `effect_command`, carrying its tenant, effect, command id and claim attempt.
//!
//! `handle_in` runs the steps in that order, one function each: [`admit`], [`pass_gate`],
//! [`run_attempts`], [`shape_result`], [`record_outcome`], [`publish_result`] and
//! [`complete`]. A step that ends the handling early has settled the delivery (acked,
//! nak'ed or terminated) before it returns.
//!
//! Guarantees: the outcome is recorded (CAS on the held revision) before the result is
//! published, so an executor fenced out by a takeover publishes nothing; a result is
//! published under its derived `Nats-Msg-Id` before the command is acked, so a crash in
//! between only makes the redelivery republish the stored result, which JetStream drops as
//! a duplicate; a command refused before execution never reaches an upstream and is never
//! dropped silently: it is terminated (`Term`) only after its dead letter is published.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use tracing::Instrument;
use tracing::field::Empty;

use super::attempt::{Guarded, run_guarded};
use super::claim::{self, ClaimError, Gate, Lease, StoredResult};
use super::command::{Command, CommandError, ResultType};
use super::context::{Ctx, event, outcome};
use crate::backoff::Backoff;
use crate::clock::now_ms;
use crate::deadletter;
use crate::telemetry::otel;

/// Handles one delivery inside its own `effect_command` span. The span's fields are
/// recorded once the command is accepted (a refused command has none: its dead letter is
/// logged with the tenant it is filed under).
pub(super) async fn handle(ctx: &Ctx, msg: jetstream::Message) {
    // At ERROR level so that the span is enabled under any filter that lets one of its
    // lines through: a warning must not lose the command it is about.
    let span = tracing::error_span!(
        "effect_command",
        tenant = Empty,
        effect = Empty,
        command_id = Empty,
        attempt = Empty
    );
    handle_in(ctx, msg, &span).instrument(span.clone()).await;
}

/// The steps of one delivery, in their order; each step that ends the handling early
/// (a refusal, a hand-back, a replay) has already settled the message when it returns.
async fn handle_in(ctx: &Ctx, msg: jetstream::Message, span: &tracing::Span) {
    let traceparent = crate::broker::headers::traceparent(msg.headers.as_ref());
    let metrics = &ctx.state.metrics;
    observe_queue_age(ctx, &msg);
    let (mut cmd, key) = match admit(ctx, &msg, traceparent.clone()) {
        Ok(v) => v,
        Err((kind, reason)) => {
            refuse(ctx, &msg, traceparent, kind, &reason).await;
            return;
        }
    };
    // Held until the handling ends, so the execution span covers every later step.
    let mut exec = open_execution(&mut cmd);
    span.record("tenant", cmd.tenant.as_str());
    span.record("effect", cmd.effect.as_str());
    span.record("command_id", cmd.command_id.as_str());
    let Some(mut lease) = pass_gate(ctx, &msg, &key, span).await else {
        return;
    };
    let Some(ran) = run_attempts(ctx, &msg, &cmd, &mut lease).await else {
        return;
    };
    let label = ctx.effect_label(&cmd.effect);
    metrics
        .effect_seconds
        .with_label_values(&[label.as_str()])
        .observe(ran.started.elapsed().as_secs_f64());
    let attempts = ran.attempts;
    let (result, rt) = shape_result(ctx, &cmd, ran, exec.as_mut());
    if !record_outcome(ctx, &msg, &mut lease, &result).await {
        return;
    }
    if !publish_result(ctx, &msg, &result).await {
        return;
    }
    complete(ctx, &msg, &label, rt, attempts).await;
}

/// Observes how long the command waited in its stream before this delivery.
fn observe_queue_age(ctx: &Ctx, msg: &jetstream::Message) {
    if let Ok(info) = msg.info() {
        ctx.state
            .metrics
            .effect_queue
            .observe(crate::broker::headers::stored_age(
                &info,
                crate::broker::headers::now_nanos(),
            ));
    }
}

/// Decodes the command and admits it, with its claim key; or says why it can never run,
/// as the dead-letter kind and the reason [`refuse`] files it under.
fn admit(
    ctx: &Ctx,
    msg: &jetstream::Message,
    traceparent: Option<String>,
) -> Result<(Command, String), (&'static str, String)> {
    Command::decode(msg.subject.as_str(), &msg.payload, traceparent)
        .map(|mut c| {
            c.reply_partition = crate::broker::headers::reply_partition(msg.headers.as_ref());
            c
        })
        .map_err(|e| {
            let kind = match &e {
                CommandError::Mismatch {
                    field: "tenant", ..
                } => deadletter::kind::TENANT_MISMATCH,
                _ => deadletter::kind::UNDECODABLE,
            };
            (kind, e.to_string())
        })
        .and_then(|c| {
            // Its tenant goes into the result's subject and the claim's key: a token the
            // server would refuse (too long for its control line) is refused here instead.
            crate::subject::check(&c.tenant, crate::subject::Rule::TENANT)
                .map_err(|e| (deadletter::kind::UNDECODABLE, format!("the command's {e}")))?;
            let allowed = &ctx.state.config.tenancy.allowed;
            if !allowed.is_empty() && !allowed.contains(&c.tenant) {
                return Err((
                    deadletter::kind::UNKNOWN_TENANT,
                    format!("tenant {:?} is not in tenancy.allowed", c.tenant),
                ));
            }
            match claim::claim_key(&c.tenant, &c.command_id) {
                Some(key) => Ok((c, key)),
                None => Err((
                    deadletter::kind::UNDECODABLE,
                    if c.command_id.len() <= 80 {
                        format!("command id {:?} cannot be a claim key", c.command_id)
                    } else {
                        format!(
                            "command id of {} bytes cannot be a claim key (at most {})",
                            c.command_id.len(),
                            crate::subject::MAX_ID_BYTES
                        )
                    },
                )),
            }
        })
}

/// Opens the `effect.execute` span of an admitted command, when span export is on.
fn open_execution(cmd: &mut Command) -> Option<otel::Hop> {
    // With span export on, this delivery is an `effect.execute` span: its attempts and its
    // result are its children, so the command's trace context becomes the span's.
    let exec = otel::hop(
        "effect.execute",
        otel::Kind::Consumer,
        cmd.traceparent.as_deref(),
        || {
            vec![
                otel::attr("runner.tenant", cmd.tenant.as_str()),
                otel::attr("runner.effect", cmd.effect.as_str()),
                otel::attr("runner.command_id", cmd.command_id.as_str()),
            ]
        },
    );
    if let Some(h) = &exec {
        cmd.traceparent = Some(h.traceparent().to_string());
    }
    exec
}

/// Passes the claim gate: the lease to run the command under, or `None` once the delivery
/// is settled without running (a done command's stored result republished and acked, a
/// command held elsewhere or an unreadable claim handed back).
async fn pass_gate(
    ctx: &Ctx,
    msg: &jetstream::Message,
    key: &str,
    span: &tracing::Span,
) -> Option<Lease> {
    let first_delivery = msg.info().map(|i| i.delivered <= 1).unwrap_or(false);
    let gate = match ctx.claims.gate(key, first_delivery).await {
        Ok(g) => g,
        Err(e) => {
            tracing::warn!(message = "Claim check failed; will retry.", error = %e);
            hand_back(ctx, msg, None, "the claim could not be checked").await;
            return None;
        }
    };
    match gate {
        Gate::Done(result) => {
            ctx.claim_event(event::REPLAYED);
            tracing::info!(message = "Command already done; republishing its stored result.");
            match publish(ctx, &result).await {
                Ok(()) => {
                    let _ = msg.ack().await;
                }
                Err(e) => {
                    tracing::warn!(message = "Republishing a stored result failed; will retry.", error = %e);
                    hand_back(ctx, msg, None, "its stored result could not be republished").await;
                }
            }
            None
        }
        Gate::Busy(delay) => {
            ctx.claim_event(event::BUSY);
            tracing::debug!(message = "Command held by a live executor; retrying later.", retry_in = ?delay);
            hand_back(ctx, msg, Some(delay), "another executor held its claim").await;
            None
        }
        Gate::Acquired(l) => {
            ctx.claim_event(event::ACQUIRED);
            span.record("attempt", l.attempt);
            tracing::debug!(message = "Claim acquired.");
            Some(l)
        }
        Gate::Stolen(l) => {
            ctx.claim_event(event::STEAL);
            span.record("attempt", l.attempt);
            tracing::info!(message = "Claim taken over after its lease expired.");
            Some(l)
        }
    }
}

/// What the attempts came to, with when they started.
struct Ran {
    rt: ResultType,
    payload: serde_json::Value,
    attempts: u32,
    started: Instant,
}

/// Runs the attempts under the lease ([`run_guarded`]): their outcome, or `None` once the
/// command is handed back (its lease lost, or the worker draining between retries).
async fn run_attempts(
    ctx: &Ctx,
    msg: &jetstream::Message,
    cmd: &Command,
    lease: &mut Lease,
) -> Option<Ran> {
    let metrics = &ctx.state.metrics;
    metrics.effect_in_flight.inc();
    let started = Instant::now();
    let outcome = run_guarded(ctx, msg, cmd, lease).await;
    metrics.effect_in_flight.dec();
    match outcome {
        Guarded::Done(rt, payload, attempts) => Some(Ran {
            rt,
            payload,
            attempts,
            started,
        }),
        Guarded::Lost => {
            // Someone else owns the command now. Its redelivery finds the new owner's claim.
            hand_back(ctx, msg, Some(ctx.claims.ttl()), "its lease was lost").await;
            None
        }
        Guarded::HandBack => {
            // Expire the lease at once so another replica takes the command over now.
            let released = ctx.claims.release(lease).await;
            tracing::info!(
                message = "Draining: command handed back between retries.",
                released = released.is_ok()
            );
            hand_back(
                ctx,
                msg,
                Some(Duration::ZERO),
                "a draining worker handed it back",
            )
            .await;
            None
        }
    }
}

/// The result to record and publish, with its type: a result too large for the broker
/// becomes a Failed one saying so. The execution span is told how the effect ended.
fn shape_result(
    ctx: &Ctx,
    cmd: &Command,
    ran: Ran,
    exec: Option<&mut otel::Hop>,
) -> (StoredResult, ResultType) {
    let Ran {
        rt,
        payload,
        attempts,
        ..
    } = ran;
    let (result, oversized) =
        cmd.result_within(rt, payload, attempts, ctx.state.broker.max_record_bytes());
    if let Some(bytes) = oversized {
        tracing::error!(
            message = "The effect's result is larger than a result may be; a Failed result says so instead.",
            result_type = rt.as_str(),
            bytes
        );
    }
    let rt = if oversized.is_some() {
        ResultType::Failed
    } else {
        rt
    };
    if let Some(h) = exec {
        h.set("runner.result_type", rt.as_str());
        h.set("runner.attempts", i64::from(attempts));
        if rt != ResultType::Succeeded {
            h.fail(format!("the effect ended {}", rt.as_str()));
        }
    }
    (result, rt)
}

/// Records the outcome in the claim (CAS on the held revision). `false` once the command
/// is handed back, fenced out or unrecordable, with nothing published.
async fn record_outcome(
    ctx: &Ctx,
    msg: &jetstream::Message,
    lease: &mut Lease,
    result: &StoredResult,
) -> bool {
    // Recording is retried while the lease lasts: the call's outcome is in hand, and giving
    // up here would make another executor call the upstream again.
    let mut pause = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
    loop {
        match ctx.claims.complete(lease, result.clone()).await {
            Ok(()) => return true,
            Err(e @ ClaimError::Kv { .. })
                if now_ms().saturating_add(pause.peek().as_millis() as u64) < lease.expires_ms =>
            {
                tracing::warn!(message = "Recording the outcome failed; retrying while the lease lasts.", error = %e);
                tokio::time::sleep(pause.next_wait()).await;
            }
            Err(e) => {
                ctx.claim_event(event::FAILED);
                let fenced = matches!(e, ClaimError::Fenced { .. });
                tracing::warn!(message = if fenced { "Outcome fenced out: another executor owns the command; nothing published." } else { "Recording the outcome failed; nothing published, will retry." }, error = %e);
                hand_back(ctx, msg, None, "its outcome could not be recorded").await;
                return false;
            }
        }
    }
}

/// Publishes the recorded result. `false` once the command is handed back after the last
/// try, for its redelivery to republish the stored result.
async fn publish_result(ctx: &Ctx, msg: &jetstream::Message, result: &StoredResult) -> bool {
    // The claim is done from here on; a failed publish is retried a few times, and after
    // that the redelivery republishes the stored result.
    let mut pause = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut tries = 0;
    while let Err(e) = publish(ctx, result).await {
        tries += 1;
        if tries >= 5 {
            tracing::warn!(message = "Publishing the result failed; the redelivery republishes it.", error = %e);
            hand_back(ctx, msg, None, "its result could not be published").await;
            return false;
        }
        tokio::time::sleep(pause.next_wait()).await;
    }
    true
}

/// Counts the completed command and acks it, its result published.
async fn complete(ctx: &Ctx, msg: &jetstream::Message, label: &str, rt: ResultType, attempts: u32) {
    ctx.claim_event(event::COMPLETED);
    ctx.state
        .metrics
        .effect_results
        .with_label_values(&[label, rt.as_str()])
        .inc();
    tracing::debug!(
        message = "Effect completed.",
        result_type = rt.as_str(),
        attempts
    );
    if let Err(e) = msg.ack().await {
        tracing::warn!(message = "Acknowledging an effect command failed; its redelivery republishes the result.", error = %e);
    }
}

/// Dead-letters a command that can never run (`tenant.<t>.deadletter.<kind>` on the
/// dead-letter stream, with the reason and the original body), then terminates it. If the
/// dead letter cannot be published the command is nak'ed and comes back later.
async fn refuse(
    ctx: &Ctx,
    msg: &jetstream::Message,
    traceparent: Option<String>,
    kind: &'static str,
    reason: &str,
) {
    let metrics = &ctx.state.metrics;
    let subject = msg.subject.as_str();
    let tenant = subject
        .split('.')
        .nth(1)
        .filter(|t| crate::subject::check(t, crate::subject::Rule::TENANT).is_ok())
        .unwrap_or(ctx.state.config.tenancy.default_tenant.as_str())
        .to_string();
    let source = match msg.info() {
        Ok(i) => format!("{}:{}", i.stream, i.stream_sequence),
        Err(_) => subject.to_string(),
    };
    let refused = deadletter::Refused {
        tenant: &tenant,
        kind,
        reason,
        subject,
        source: &source,
        body: &msg.payload,
        at_ms: now_ms(),
    };
    let message = deadletter::refused_command(refused);
    let mut letter = deadletter::letter_of(refused);
    letter.traceparent = traceparent.clone();
    let dl = StoredResult {
        subject: message.subject,
        msg_id: message.msg_id,
        traceparent,
        body: serde_json::value::to_raw_value(&message.body).unwrap_or_default(),
        inbox: None,
    };
    if let Err(e) = publish(ctx, &dl).await {
        // The dead-letter stream did not take it: keep it in this node's store instead, so
        // the command is terminated now rather than redelivered over and over.
        match ctx
            .state
            .store
            .write(move |t| t.push_dead_letter(letter))
            .await
        {
            Ok(kept) => {
                tracing::error!(message = "Effect command refused; the dead-letter stream did not take it, so it is kept in the local store (runner dlq list).", tenant = %tenant, kind, reason, source = %source, id = kept.id, error = %e);
                metrics.effect_deadletters_local.inc();
            }
            Err(se) => {
                tracing::warn!(message = "Cannot dead-letter a refused effect command anywhere; handing it back.", source = %source, error = %e, storage_error = %se);
                let delay = backoff_for(msg);
                if is_last_delivery(ctx, msg) {
                    // Nothing can record it: terminate rather than loop, loudly.
                    tracing::error!(message = "Effect command dropped at its redelivery limit: neither the dead-letter stream nor the local store took it.", tenant = %tenant, kind, reason, source = %source);
                    let _ = msg.ack_with(AckKind::Term).await;
                } else {
                    let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
                }
                return;
            }
        }
    } else {
        tracing::error!(message = "Effect command refused and dead-lettered.", tenant = %tenant, kind, reason, source = %source);
    }
    metrics
        .effect_commands
        .with_label_values(&[outcome::REFUSED])
        .inc();
    metrics.deadletters.with_label_values(&[kind]).inc();
    let _ = msg.ack_with(AckKind::Term).await;
}

/// The one field of a result body its headers need, read without parsing the rest.
#[derive(Default, serde::Deserialize)]
struct Tenant<'a> {
    #[serde(borrow)]
    tenant_id: Option<std::borrow::Cow<'a, str>>,
}

/// Publishes a result event; with span export on, as an `effect.result` span (child of the
/// execution that produced it) which the event names.
async fn publish(ctx: &Ctx, r: &StoredResult) -> Result<(), async_nats::Error> {
    let hop = otel::hop(
        "effect.result",
        otel::Kind::Producer,
        r.traceparent.as_deref(),
        || {
            vec![
                otel::attr("messaging.destination.name", r.subject.as_str()),
                otel::attr("messaging.message.id", r.msg_id.as_str()),
            ]
        },
    );
    let tenant: Tenant<'_> = serde_json::from_str(r.body.get()).unwrap_or_default();
    let mut h = crate::broker::headers::outgoing(
        &r.msg_id,
        tenant.tenant_id.as_deref(),
        otel::onward(hop.as_ref(), r.traceparent.as_deref()),
    );
    drop(hop);
    // Straight into the waiting partition's inbox, named as its own subject there (the
    // owner reads it as published on `subject`); else on `subject` itself.
    let to = match &r.inbox {
        Some(inbox) => {
            h.insert(crate::broker::headers::ROUTED_SUBJECT, r.subject.as_str());
            inbox.clone()
        }
        None => r.subject.clone(),
    };
    let body = bytes::Bytes::copy_from_slice(r.body.get().as_bytes());
    ctx.state
        .broker
        .jetstream()
        .publish_with_headers(to, h, body)
        .await?
        .await?;
    Ok(())
}

/// How long a command handed back after a transient failure waits before its first
/// redelivery; each later hand-back of the same command waits twice as long, up to
/// [`RETRY_MAX`].
const RETRY_SOON: Duration = Duration::from_secs(1);
/// The longest wait before a handed-back command comes again.
const RETRY_MAX: Duration = Duration::from_secs(60);

/// How many times this command was delivered (1 for the first delivery).
fn deliveries(msg: &jetstream::Message) -> u64 {
    msg.info().map(|i| i.delivered.max(1) as u64).unwrap_or(1)
}

/// Whether JetStream will not deliver this command again (`effect.max_deliver`).
fn is_last_delivery(ctx: &Ctx, msg: &jetstream::Message) -> bool {
    deliveries(msg) >= u64::try_from(ctx.state.config.effect.max_deliver).unwrap_or(u64::MAX)
}

/// [`RETRY_SOON`] doubled for every earlier delivery, at most [`RETRY_MAX`].
fn backoff_for(msg: &jetstream::Message) -> Duration {
    let n = deliveries(msg).saturating_sub(1).min(16) as u32;
    RETRY_SOON
        .saturating_mul(2u32.saturating_pow(n))
        .min(RETRY_MAX)
}

/// Hands a command back to JetStream for redelivery after `delay` (or the backoff for its
/// delivery count), because `why`. On its last delivery it is dead-lettered as
/// [`deadletter::kind::REDELIVERY_LIMIT`] instead: JetStream would never deliver it again,
/// and a command must not vanish without a record. A failed nak only means JetStream
/// redelivers after the ack wait instead.
pub(super) async fn hand_back(
    ctx: &Ctx,
    msg: &jetstream::Message,
    delay: Option<Duration>,
    why: &str,
) {
    if is_last_delivery(ctx, msg) {
        let reason = format!(
            "delivered {} times (effect.max_deliver) without completing; last: {why}",
            deliveries(msg)
        );
        let traceparent = crate::broker::headers::traceparent(msg.headers.as_ref());
        Box::pin(refuse(
            ctx,
            msg,
            traceparent,
            deadletter::kind::REDELIVERY_LIMIT,
            &reason,
        ))
        .await;
        return;
    }
    let delay = delay.unwrap_or_else(|| backoff_for(msg));
    let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
}
