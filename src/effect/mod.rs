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

pub mod breaker;
pub mod claim;
pub mod provider;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull, kv};
use futures::StreamExt;
use serde_json::{Value as Json, json};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock::now_ms;
use crate::deadletter;
use crate::manifest::catalog::Effect;
use crate::manifest::model::RetryPolicy;
use crate::runtime::AppState;
use crate::saga::retry::{JitterKey, delay_ms};
use breaker::Breakers;
use claim::{ClaimError, Claims, Gate, Lease, StoredResult};
use provider::{CallEnv, EffectError, Provider};

/// Subject filter of the effect consumer.
pub const COMMAND_FILTER: &str = "tenant.*.effect.>";

/// Final result types of an effect command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultType {
    /// The upstream did it.
    Succeeded,
    /// A fatal failure, or retries spent.
    Failed,
    /// The last attempt timed out, retries spent.
    TimedOut,
}

impl ResultType {
    /// Name in the result envelope.
    pub fn as_str(self) -> &'static str {
        match self {
            ResultType::Succeeded => "Succeeded",
            ResultType::Failed => "Failed",
            ResultType::TimedOut => "TimedOut",
        }
    }
}

/// An effect command, decoded.
#[derive(Debug, Clone)]
pub struct Command {
    /// Tenant.
    pub tenant: String,
    /// Command id (the idempotency key).
    pub command_id: String,
    /// Effect name.
    pub effect: String,
    /// The whole envelope.
    pub body: Json,
    /// `traceparent` header.
    pub traceparent: Option<String>,
}

/// Why a command was refused before any execution.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// Not JSON, or a required field is missing.
    #[error("undecodable effect command on {subject}: {reason}")]
    Undecodable {
        /// Subject.
        subject: String,
        /// Why.
        reason: String,
    },
    /// The subject and the body name different tenants, effects or ids.
    #[error(
        "effect command on {subject}: subject says {field} {in_subject:?}, body says {in_body:?}"
    )]
    Mismatch {
        /// Subject.
        subject: String,
        /// Which field.
        field: &'static str,
        /// Value in the subject.
        in_subject: String,
        /// Value in the body.
        in_body: String,
    },
}

impl Command {
    /// Decodes `tenant.<t>.effect.<name>.<command_id>` and its body.
    pub fn decode(
        subject: &str,
        payload: &[u8],
        traceparent: Option<String>,
    ) -> Result<Self, CommandError> {
        let undecodable = |reason: String| CommandError::Undecodable {
            subject: subject.to_string(),
            reason,
        };
        let parts: Vec<&str> = subject.split('.').collect();
        let [_, t, _, name, id] = parts.as_slice() else {
            return Err(undecodable(
                "subject is not tenant.<t>.effect.<name>.<id>".into(),
            ));
        };
        let body: Json =
            serde_json::from_slice(payload).map_err(|e| undecodable(format!("not JSON: {e}")))?;
        let field = |k: &str| {
            body.get(k)
                .and_then(Json::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| undecodable(format!("no `{k}` string")))
        };
        let tenant = field("tenant_id")?;
        let effect = field("effect_name")?;
        let command_id = field("command_id")?;
        for (name, sub, b) in [
            ("tenant", *t, &tenant),
            ("effect", *name, &effect),
            ("command id", *id, &command_id),
        ] {
            if sub != b {
                return Err(CommandError::Mismatch {
                    subject: subject.to_string(),
                    field: name,
                    in_subject: sub.to_string(),
                    in_body: b.clone(),
                });
            }
        }
        Ok(Self {
            tenant,
            command_id,
            effect,
            body,
            traceparent,
        })
    }

    /// The retry policy carried in `metadata.retry`, if any.
    fn retry(&self) -> Option<RetryPolicy> {
        self.body
            .pointer("/metadata/retry")
            .and_then(|r| serde_json::from_value(r.clone()).ok())
    }

    /// The id of this command's result event: a UUID v7 derived from the command id alone,
    /// with the command id's own time bits, so every executor and every replay agrees.
    pub fn result_id(&self) -> String {
        let ts = uuid::Uuid::parse_str(&self.command_id)
            .ok()
            .and_then(|u| u.get_timestamp())
            .map(|t| {
                let (s, n) = t.to_unix();
                s * 1000 + u64::from(n) / 1_000_000
            })
            .unwrap_or(0);
        let seed = crate::saga::ids::IdSeed {
            tenant: &self.tenant,
            saga: "effect_result",
            correlation_id: &self.effect,
            input_event_id: &self.command_id,
            timestamp_ms: ts,
        };
        crate::saga::ids::derive(&seed, 0).to_string()
    }

    /// The result event for an outcome.
    pub fn result(&self, rt: ResultType, payload: Json, attempts: u32) -> StoredResult {
        let id = self.result_id();
        StoredResult {
            subject: format!(
                "tenant.{}.effect_result.{}.{}",
                self.tenant, self.effect, self.command_id
            ),
            msg_id: id.clone(),
            traceparent: self.traceparent.clone(),
            body: json!({
                "v": 1,
                "event_id": id,
                "tenant_id": self.tenant,
                "command_id": self.command_id,
                "effect_name": self.effect,
                "result_type": rt.as_str(),
                "payload": payload,
                "attempts": attempts,
                "timestamp_ms": now_ms(),
                "metadata": self.body.get("metadata").cloned().unwrap_or_else(|| json!({})),
            }),
        }
    }
}

/// Claim events (a metric label and a log message each).
pub mod event {
    /// A first executor took a command.
    pub const ACQUIRED: &str = "acquired";
    /// A live executor holds it; nak'ed with a delay.
    pub const BUSY: &str = "busy";
    /// Taken over after the lease expired.
    pub const STEAL: &str = "steal";
    /// Lease extended.
    pub const RENEWED: &str = "renewed";
    /// A renewal was refused or the lease ran out: execution abandoned.
    pub const RENEW_FAILED: &str = "renew_failed";
    /// Outcome recorded and published.
    pub const COMPLETED: &str = "completed";
    /// Recording the outcome was refused (fenced out) or failed.
    pub const FAILED: &str = "failed";
    /// A finished command came again: its stored result was republished.
    pub const REPLAYED: &str = "replayed";
}

/// Everything a command handler shares.
struct Ctx {
    state: Arc<AppState>,
    claims: Claims,
    http: reqwest::Client,
    breakers: Breakers,
    providers: Mutex<HashMap<String, CachedProvider>>,
    /// Cancelled when the drain begins.
    drain: CancellationToken,
    per_effect: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// A compiled provider with the declaration it was compiled from (held, so a reloaded
/// catalog's declaration is never mistaken for it).
type CachedProvider = (Arc<Effect>, Result<Arc<Provider>, String>);

impl Ctx {
    /// A slot for one more command of `effect`, if it is under its limit.
    fn effect_slot(&self, effect: &str) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let sem = {
            let mut g = match self.per_effect.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            g.entry(effect.to_string())
                .or_insert_with(|| {
                    Arc::new(Semaphore::new(
                        self.state.config.effect.concurrency_per_effect,
                    ))
                })
                .clone()
        };
        sem.try_acquire_owned().ok()
    }

    fn claim_event(&self, ev: &'static str) {
        self.state
            .metrics
            .effect_claims
            .with_label_values(&[ev])
            .inc();
    }

    /// The compiled provider of an effect, cached per catalog generation.
    fn provider(&self, effect: &Arc<Effect>) -> Result<Arc<Provider>, String> {
        let mut g = match self.providers.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some((decl, p)) = g.get(&effect.name)
            && Arc::ptr_eq(decl, effect)
        {
            return p.clone();
        }
        let p = Provider::compile(effect)
            .map(Arc::new)
            .map_err(|e| e.to_string());
        g.insert(effect.name.clone(), (effect.clone(), p.clone()));
        p
    }
}

/// Spawns the effect worker on `tracker`; it stops fetching when `cancel` fires and returns
/// once its in-flight commands are finished.
pub fn spawn(
    tracker: &TaskTracker,
    state: Arc<AppState>,
    kv: kv::Store,
    cancel: CancellationToken,
) {
    let owner = format!("{}/{}", state.node_id, uuid::Uuid::new_v4().simple());
    let claims = Claims::new(kv, owner, state.config.effect.lease_ttl.get());
    let http = reqwest::Client::builder()
        .user_agent(concat!("runner/", env!("CARGO_PKG_VERSION")))
        .build()
        .unwrap_or_default();
    let breakers = Breakers::new(state.metrics.effect_circuit_state.clone());
    let ctx = Arc::new(Ctx {
        state,
        claims,
        http,
        breakers,
        providers: Mutex::new(HashMap::new()),
        drain: cancel.clone(),
        per_effect: Mutex::new(HashMap::new()),
    });
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
    let mut backoff = Duration::from_millis(100);
    'connect: while !cancel.is_cancelled() {
        let opened = tokio::select! {
            _ = cancel.cancelled() => break,
            m = open_consumer(&ctx) => m,
        };
        let mut messages = match opened {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(message = "Cannot open the effect consumer; retrying.", error = %e);
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
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
                    backoff = Duration::from_millis(100);
                    let ctx = ctx.clone();
                    in_flight.spawn(async move {
                        handle(&ctx, msg).await;
                        drop(permit);
                    });
                }
                Some(Err(e)) => {
                    tracing::warn!(message = "Effect consumer error; reopening.", error = %e);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue 'connect;
                }
                None => continue 'connect,
            }
        }
    }
    in_flight.close();
    in_flight.wait().await;
}

async fn handle(ctx: &Ctx, msg: jetstream::Message) {
    let traceparent = crate::broker::headers::traceparent(msg.headers.as_ref());
    let metrics = &ctx.state.metrics;
    let decoded = Command::decode(msg.subject.as_str(), &msg.payload, traceparent.clone())
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
                    format!("command id {:?} cannot be a claim key", c.command_id),
                )),
            }
        });
    let (cmd, key) = match decoded {
        Ok(v) => v,
        Err((kind, reason)) => {
            refuse(ctx, &msg, traceparent, kind, &reason).await;
            return;
        }
    };
    let Some(_slot) = ctx.effect_slot(&cmd.effect) else {
        metrics
            .effect_commands
            .with_label_values(&["throttled"])
            .inc();
        let _ = msg
            .ack_with(AckKind::Nak(Some(Duration::from_millis(250))))
            .await;
        return;
    };
    let span_fields = (
        cmd.tenant.as_str(),
        cmd.effect.as_str(),
        cmd.command_id.as_str(),
    );
    let first_delivery = msg.info().map(|i| i.delivered <= 1).unwrap_or(false);
    let gate = match ctx.claims.gate(&key, first_delivery).await {
        Ok(g) => g,
        Err(e) => {
            tracing::warn!(message = "Claim check failed; will retry.", tenant = span_fields.0, effect = span_fields.1, command_id = span_fields.2, error = %e);
            retry_soon(&msg).await;
            return;
        }
    };
    let mut lease = match gate {
        Gate::Done(result) => {
            ctx.claim_event(event::REPLAYED);
            tracing::info!(
                message = "Command already done; republishing its stored result.",
                tenant = span_fields.0,
                effect = span_fields.1,
                command_id = span_fields.2
            );
            match publish(ctx, &result).await {
                Ok(()) => {
                    let _ = msg.ack().await;
                }
                Err(e) => {
                    tracing::warn!(message = "Republishing a stored result failed; will retry.", command_id = span_fields.2, error = %e);
                    retry_soon(&msg).await;
                }
            }
            return;
        }
        Gate::Busy(delay) => {
            ctx.claim_event(event::BUSY);
            tracing::debug!(message = "Command held by a live executor; retrying later.", command_id = span_fields.2, retry_in = ?delay);
            let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
            return;
        }
        Gate::Acquired(l) => {
            ctx.claim_event(event::ACQUIRED);
            tracing::debug!(
                message = "Claim acquired.",
                command_id = span_fields.2,
                attempt = l.attempt
            );
            l
        }
        Gate::Stolen(l) => {
            ctx.claim_event(event::STEAL);
            tracing::info!(
                message = "Claim taken over after its lease expired.",
                tenant = span_fields.0,
                effect = span_fields.1,
                command_id = span_fields.2,
                attempt = l.attempt
            );
            l
        }
    };

    metrics.effect_in_flight.inc();
    let started = Instant::now();
    let outcome = run_guarded(ctx, &msg, &cmd, &mut lease).await;
    metrics.effect_in_flight.dec();
    let (rt, payload, attempts) = match outcome {
        Guarded::Done(rt, payload, attempts) => (rt, payload, attempts),
        Guarded::Lost => {
            // Someone else owns the command now. Its redelivery finds the new owner's claim.
            let _ = msg.ack_with(AckKind::Nak(Some(ctx.claims.ttl()))).await;
            return;
        }
        Guarded::HandBack => {
            // Expire the lease at once so another replica takes the command over now.
            let released = ctx.claims.release(&mut lease).await;
            tracing::info!(
                message = "Draining: command handed back between retries.",
                command_id = span_fields.2,
                released = released.is_ok()
            );
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            return;
        }
    };
    let label = effect_label(ctx, &cmd.effect);
    metrics
        .effect_seconds
        .with_label_values(&[label.as_str()])
        .observe(started.elapsed().as_secs_f64());
    let result = cmd.result(rt, payload, attempts);
    // Recording is retried while the lease lasts: the call's outcome is in hand, and giving
    // up here would make another executor call the upstream again.
    let mut pause = Duration::from_millis(100);
    loop {
        match ctx.claims.complete(&mut lease, result.clone()).await {
            Ok(()) => break,
            Err(e @ ClaimError::Kv { .. })
                if now_ms().saturating_add(pause.as_millis() as u64) < lease.expires_ms =>
            {
                tracing::warn!(message = "Recording the outcome failed; retrying while the lease lasts.", command_id = span_fields.2, error = %e);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(e) => {
                ctx.claim_event(event::FAILED);
                let fenced = matches!(e, ClaimError::Fenced { .. });
                tracing::warn!(message = if fenced { "Outcome fenced out: another executor owns the command; nothing published." } else { "Recording the outcome failed; nothing published, will retry." }, tenant = span_fields.0, effect = span_fields.1, command_id = span_fields.2, attempt = lease.attempt, error = %e);
                retry_soon(&msg).await;
                return;
            }
        }
    }
    // The claim is done from here on; a failed publish is retried a few times, and after
    // that the redelivery republishes the stored result.
    let mut pause = Duration::from_millis(100);
    let mut tries = 0;
    while let Err(e) = publish(ctx, &result).await {
        tries += 1;
        if tries >= 5 {
            tracing::warn!(message = "Publishing the result failed; the redelivery republishes it.", command_id = span_fields.2, error = %e);
            retry_soon(&msg).await;
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
    ctx.claim_event(event::COMPLETED);
    metrics
        .effect_results
        .with_label_values(&[label.as_str(), rt.as_str()])
        .inc();
    tracing::debug!(
        message = "Effect completed.",
        tenant = span_fields.0,
        effect = span_fields.1,
        command_id = span_fields.2,
        result_type = rt.as_str(),
        attempts
    );
    if let Err(e) = msg.ack().await {
        tracing::warn!(message = "Acknowledging an effect command failed; its redelivery republishes the result.", command_id = span_fields.2, error = %e);
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
        .filter(|t| crate::config::is_subject_token(t))
        .unwrap_or(ctx.state.config.tenancy.default_tenant.as_str())
        .to_string();
    let source = match msg.info() {
        Ok(i) => format!("{}:{}", i.stream, i.stream_sequence),
        Err(_) => subject.to_string(),
    };
    let message = deadletter::refused_command(deadletter::Poison {
        tenant: &tenant,
        kind,
        reason,
        subject,
        source: &source,
        body: &msg.payload,
        traceparent: traceparent.as_deref(),
        route: None,
        at_ms: now_ms(),
    });
    let dl = StoredResult {
        subject: message.subject,
        msg_id: format!("dl:{source}:effect"),
        traceparent,
        body: message.body,
    };
    if let Err(e) = publish(ctx, &dl).await {
        tracing::warn!(message = "Cannot dead-letter a refused effect command; will retry.", source = %source, error = %e);
        retry_soon(msg).await;
        return;
    }
    tracing::error!(message = "Effect command refused and dead-lettered.", tenant = %tenant, kind, reason, source = %source);
    metrics
        .effect_commands
        .with_label_values(&["refused"])
        .inc();
    metrics.deadletters.with_label_values(&[kind]).inc();
    let _ = msg.ack_with(AckKind::Term).await;
}

fn effect_label(ctx: &Ctx, name: &str) -> String {
    if ctx.state.catalog().effect(name).is_some() {
        name.to_string()
    } else {
        "undeclared".to_string()
    }
}

async fn publish(ctx: &Ctx, r: &StoredResult) -> Result<(), async_nats::Error> {
    let h = crate::broker::headers::outgoing(
        &r.msg_id,
        r.body.get("tenant_id").and_then(Json::as_str),
        r.traceparent.as_deref(),
    );
    let body = serde_json::to_vec(&r.body)?;
    ctx.state
        .broker
        .jetstream()
        .publish_with_headers(r.subject.clone(), h, body.into())
        .await?
        .await?;
    Ok(())
}

/// How a guarded execution ended.
enum Guarded {
    /// An outcome to record and publish.
    Done(ResultType, Json, u32),
    /// The lease was lost: the call was abandoned.
    Lost,
    /// Draining while waiting between retries: give the command back.
    HandBack,
}

/// Runs the command while renewing the lease and sending progress acks.
async fn run_guarded(
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
        tokio::select! {
            out = &mut exec => return match out {
                Some((rt, payload, attempts)) => Guarded::Done(rt, payload, attempts),
                None => Guarded::HandBack,
            },
            _ = renew.tick() => {
                match ctx.claims.renew(lease).await {
                    Ok(()) => ctx.claim_event(event::RENEWED),
                    Err(e @ ClaimError::Fenced { .. }) => {
                        ctx.claim_event(event::RENEW_FAILED);
                        tracing::warn!(message = "Lease renewal refused: another executor took the command over; abandoning it.", command_id = %cmd.command_id, attempt = lease.attempt, error = %e);
                        return Guarded::Lost;
                    }
                    Err(e) => {
                        if now_ms() >= lease.expires_ms {
                            ctx.claim_event(event::RENEW_FAILED);
                            tracing::warn!(message = "Lease expired without a successful renewal; abandoning the command.", command_id = %cmd.command_id, error = %e);
                            return Guarded::Lost;
                        }
                        tracing::warn!(message = "Lease renewal failed; will try again before it expires.", command_id = %cmd.command_id, error = %e);
                    }
                }
            }
            _ = progress.tick() => {
                let _ = msg.ack_with(AckKind::Progress).await;
            }
        }
    }
}

/// All attempts of one command: timeout per attempt, breaker, retries with backoff.
async fn execute(ctx: &Ctx, cmd: &Command) -> Option<(ResultType, Json, u32)> {
    let catalog = ctx.state.catalog();
    let Some(effect) = catalog.effect(&cmd.effect).cloned() else {
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
    let env = CallEnv {
        http: &ctx.http,
        nats: ctx.state.broker.client(),
        timeout,
    };
    let breaker = effect.circuit_breaker.as_ref();
    let metrics = &ctx.state.metrics;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
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
            Err(EffectError::TimedOut(_)) => "timed_out",
            Err(EffectError::CircuitOpen(_)) => "circuit_open",
            Err(_) => "retryable",
        };
        metrics
            .effect_attempts
            .with_label_values(&[effect.name.as_str(), outcome])
            .inc();
        let err = match result {
            Ok(payload) => return Some((ResultType::Succeeded, payload, attempts)),
            Err(e) => e,
        };
        let retries_done = attempts.saturating_sub(1);
        if !err.is_retryable() || retries_done >= policy.retry_limit {
            tracing::info!(message = "Effect failed.", effect = %effect.name, command_id = %cmd.command_id, attempts, error = %err);
            let rt = if matches!(err, EffectError::TimedOut(_)) {
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
        tracing::debug!(message = "Effect attempt failed; retrying.", effect = %effect.name, command_id = %cmd.command_id, retry, wait = ?wait, error = %err);
        // A drain does not wait out a backoff: the command is handed back instead.
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = ctx.drain.cancelled() => return None,
        }
    }
}

/// How long a command handed back after a transient failure waits before redelivery.
const RETRY_SOON: Duration = Duration::from_secs(1);

/// Hands a command back to JetStream for redelivery after [`RETRY_SOON`]; a failed nak only
/// means JetStream redelivers after the ack wait instead.
async fn retry_soon(msg: &async_nats::jetstream::Message) {
    let _ = msg.ack_with(AckKind::Nak(Some(RETRY_SOON))).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_checks_subject_against_body() {
        let body = json!({"v":1,"tenant_id":"acme","command_id":"c1","effect_name":"pay","payload":{},"metadata":{"saga":"order"}});
        let bytes = serde_json::to_vec(&body).expect("json");
        let c = Command::decode("tenant.acme.effect.pay.c1", &bytes, None).expect("decodes");
        assert_eq!(c.effect, "pay");
        assert!(matches!(
            Command::decode("tenant.other.effect.pay.c1", &bytes, None),
            Err(CommandError::Mismatch {
                field: "tenant",
                ..
            })
        ));
        assert!(matches!(
            Command::decode("tenant.acme.effect.pay.c1", b"nope", None),
            Err(CommandError::Undecodable { .. })
        ));
    }

    #[test]
    fn result_echoes_metadata_and_has_a_stable_id() {
        let id = uuid::Uuid::now_v7().to_string();
        let body = json!({"v":1,"tenant_id":"_","command_id":id,"effect_name":"pay","payload":{},"metadata":{"saga":"order","correlation_id":"o1"}});
        let bytes = serde_json::to_vec(&body).expect("json");
        let c = Command::decode(
            &format!("tenant._.effect.pay.{id}"),
            &bytes,
            Some("tp".into()),
        )
        .expect("decodes");
        let a = c.result(ResultType::Succeeded, json!({"x":1}), 1);
        let b = c.result(ResultType::Failed, json!({}), 3);
        assert_eq!(a.msg_id, b.msg_id);
        assert_eq!(a.body["event_id"], json!(a.msg_id));
        assert_eq!(a.body["metadata"]["saga"], json!("order"));
        assert_eq!(a.subject, format!("tenant._.effect_result.pay.{id}"));
        assert_eq!(a.traceparent.as_deref(), Some("tp"));
        assert_eq!(
            uuid::Uuid::parse_str(&a.msg_id)
                .expect("uuid")
                .get_version_num(),
            7
        );
    }
}
