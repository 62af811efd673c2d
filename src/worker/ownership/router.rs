//! The router of one source stream (partitioned mode, DESIGN §8.2): copies each input of
//! the source into the saga inbox partition of every saga instance it reaches.
//!
//! A routed copy goes to `runner.inbox.<p>.<source>` with headers `Runner-Subject` (where
//! it was published), `Runner-Source` (`<source>:<seq>`), `Runner-Source-Time` (when the
//! broker stored the source message, which bounds the input's time), its `traceparent`, and
//! `Nats-Msg-Id` `<source>:<seq>:<p>`. An input that reaches several instances in one
//! partition is copied there once (the partition's owner applies it to each); an input
//! that cannot be routed (undecodable, a failing correlation expression, an engine panic)
//! goes to partition `seq mod P`, whose owner dead-letters it with the reason; an input no
//! saga wants is not copied (`runner_saga_unrouted_total` counts it).
//!
//! **Guarantees.**
//! - **One router per source.** It runs only while holding the lease `r.<source>` in the
//!   leases bucket, renewed by a task of its own ([`super::keeper`]) so a slow batch never
//!   lets it lapse; past its monotonic deadline it stops before the next batch.
//! - **Fenced, atomic, exact progress.** Copies go out as atomic batches into the inbox,
//!   fenced on `runner.fence.<inbox>.<source>`, each ending with a marker that records the
//!   last source sequence it covers. So a batch and its progress are stored together or not
//!   at all; a router that was paused and replaced cannot store anything (the new router
//!   raised the fence); and a new router resumes exactly after the last marker. No input
//!   is copied twice or skipped, whatever the de-duplication window.
//! - **Per-source order.** One batch in flight; the next starts after the answer, so the
//!   inbox holds every partition's inputs in source order. (The next chunk of the source
//!   is read while a batch is in flight, [`ReadAhead`], but sent only after the answer.)
//! - **Bounded bytes.** A pull of the source asks for as many messages as fit in
//!   `saga.max_pull_bytes` at the sizes seen ([`crate::worker::pull`]), and a batch of copies is cut
//!   before it would pass `saga.max_batch_bytes` (one input's copies stay together, so only
//!   an input whose copies alone pass it makes a larger batch). Copies share the source
//!   message's body rather than each holding its own.
//!
//! - **Work under way first.** The aggregate stream's router copies only as many inputs as
//!   fit under `saga.max_queued_work` and holds the rest while effect commands are queued
//!   at the bound (`admit.rs`); the results router never waits, so inbox partitions do not
//!   fill with new triggers ahead of them.
//!
//! **What each failure costs.** A refused or unanswered batch is checked against the fence
//! ([`Fence::recheck`]): landed (carry on), not landed (send it again), or fenced off (stop
//! routing; contend for the lease again).
//!
//! **Sizes.** An input is counted whole, its header block with its body: one larger than
//! `saga.max_message_bytes`, or whose copy (with the headers above and those of the fenced
//! batch) the inbox could not take under the broker's `max_payload`, is sent to its poison
//! partition as a copy with only the start of its body (what a dead letter keeps), carrying
//! `Runner-Refused` with the reason; its owner
//! dead-letters it as `too_large`, and routing goes on.

use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::keeper::Kept;
use super::lease::Lease;
use crate::backoff::Backoff;
use crate::broker::batch::BatchMessage;
use crate::broker::fence::{Fence, Position};
use crate::broker::fenced_batch;
use crate::broker::headers;
use crate::broker::liveness::{Liveness, Probe};
use crate::manifest::Catalog;
use crate::runtime::AppState;
use crate::telemetry::otel;
use crate::worker::admission::{self, Limits, RawInput};
use crate::worker::admit::{Admission, POLL};
use crate::worker::consume::{ORDERED_PULL_EXPIRY, Source, server_filters, wanted};
use crate::worker::partition::partition;
use crate::worker::pull::{PullSize, ReadAhead};

/// Most source inputs in one batch (each may add a few copies; the batch limit is 1000).
const INPUTS_PER_BATCH: usize = 200;
/// Most copies in one batch (the server's atomic batch limit is 1000).
const COPIES_PER_BATCH: usize = 900;

/// The lease key of a source's router.
pub fn router_key(source: &str) -> String {
    format!("r.{source}")
}

/// The partitions an input's copies go to: one per partition its routes reach, or
/// `seq mod P` for an input that cannot be routed (its owner dead-letters it).
pub fn destinations(
    catalog: &Catalog,
    limits: &Limits,
    raw: &RawInput,
    seq: u64,
    count: u32,
) -> BTreeSet<u32> {
    let poison = || BTreeSet::from([(seq % u64::from(count)) as u32]);
    let Ok(admitted) = admission::admit(raw, limits) else {
        return poison();
    };
    match catch_unwind(AssertUnwindSafe(|| {
        crate::saga::route(catalog, &admitted.input)
    })) {
        Ok(Ok(routes)) => routes
            .iter()
            .map(|r| partition(admitted.tenant, &r.saga, &r.correlation_id, count))
            .collect(),
        _ => poison(),
    }
}

/// Routes `source` while this replica holds its lease, contending again after losing it,
/// until `cancel` fires.
pub(crate) async fn run(
    state: Arc<AppState>,
    leases: kv::Store,
    source: Source,
    cancel: CancellationToken,
) {
    let ttl = state.config.partitions.lease_ttl.get();
    let key = router_key(&source.stream);
    let mut backoff = Backoff::new(Duration::from_millis(200), ttl / 3).with_jitter();
    while !cancel.is_cancelled() {
        if !state.placement.mode().routes() {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(ttl / 10) => continue,
            }
        }
        let store = Some(state.store_id.as_str());
        let lease = match Lease::reclaim_or_acquire(&leases, &key, &state.node_id, store, ttl).await
        {
            Ok(Some(l)) => l,
            Ok(None) => {
                // Someone routes it; look again in a while (it may die).
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(ttl / 3) => continue,
                }
            }
            Err(e) => {
                tracing::warn!(message = "Cannot contend for the router lease.", source = %source.stream, error = %e);
                backoff.sleep(&cancel).await;
                continue;
            }
        };
        tracing::info!(message = "Routing.", source = %source.stream, epoch = lease.epoch());
        state
            .placement
            .set_routing(&source.stream, Some(lease.epoch()));
        // Renewed by its own task: a slow batch never lets it lapse.
        let lease = Kept::keep(lease, None);
        let why = route_while_held(&state, &source, lease, &cancel).await;
        state.metrics.stalls.gone(&stage(&source.stream));
        state.placement.set_routing(&source.stream, None);
        tracing::info!(message = "Stopped routing.", source = %source.stream, reason = %why);
        backoff.sleep(&cancel).await;
    }
}

/// Routes until the lease or the fence is lost, or `cancel` fires; returns why it stopped.
async fn route_while_held(
    state: &AppState,
    source: &Source,
    lease: Kept,
    cancel: &CancellationToken,
) -> String {
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let mut fence =
        match Fence::raise(js, inbox, &source.stream, lease.epoch(), &state.node_id).await {
            Ok(f) => f,
            Err(e) => return format!("cannot raise the fence: {e}"),
        };
    let mut backoff =
        Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).with_jitter();
    let liveness = Liveness::new(
        js,
        &state.metrics.registry,
        state.config.consumers.stall_check.get(),
        state.config.consumers.reopen_timeout.get(),
    );
    let label = format!("router:{}", source.stream);
    // Bytes bounded on both sides: the pull's count follows the sizes read, and a batch of
    // copies is cut at `saga.max_batch_bytes` (see `send`).
    let max_pull_bytes = state.config.saga.max_pull_bytes.get();
    let mut pull = PullSize::new(max_pull_bytes);
    // New triggers wait behind work under way (admit.rs); results are never held.
    let mut admission =
        (source.stream == state.config.streams.aggregate_events).then(Admission::router);
    'open: loop {
        let from = fence.through().map_or(1, |p| p.seq + 1);
        let consumer = async {
            let stream = liveness.context().get_stream(&source.stream).await?;
            let c = stream
                .create_consumer(OrderedConfig {
                    filter_subjects: server_filters(&source.filters),
                    deliver_policy: DeliverPolicy::ByStartSequence {
                        start_sequence: from,
                    },
                    // Short pulls: a consumer lost with its server (a stream leader that
                    // died) is noticed by missed heartbeats within seconds, not after the
                    // default 30 s pull expiry.
                    max_expires: ORDERED_PULL_EXPIRY,
                    max_batch: pull.open(),
                    ..OrderedConfig::default()
                })
                .await?;
            Ok::<_, async_nats::Error>(c.messages().await?)
        };
        let mut reader = match consumer.await {
            Ok(m) => ReadAhead::new(
                m.ready_chunks(INPUTS_PER_BATCH),
                INPUTS_PER_BATCH,
                max_pull_bytes,
            ),
            Err(e) => {
                tracing::warn!(message = "Router cannot open its consumer; retrying.", source = %source.stream, error = %e);
                backoff.sleep(cancel).await;
                if cancel.is_cancelled() {
                    return "drain".into();
                }
                continue;
            }
        };
        // Since when the consumer has delivered nothing (liveness, see broker/liveness.rs).
        let mut idle_since = Instant::now();
        loop {
            if !lease.is_valid() {
                return "the lease expired or was lost".into();
            }
            if !state.placement.mode().routes() {
                let _ = lease.release().await;
                return "node mode excludes routing".into();
            }
            let next = tokio::select! {
                _ = cancel.cancelled() => {
                    let _ = lease.release().await;
                    return "drain".into();
                }
                _ = tokio::time::sleep(lease.ttl() / 6) => {
                    if idle_since.elapsed() >= liveness.stall_check() {
                        idle_since = Instant::now();
                        let after = fence.through().map_or(0, |p| p.seq);
                        if let Probe::Pending(seq) =
                            liveness.probe(&source.stream, &source.filters, after).await
                        {
                            let detail = format!("message {seq} waits past sequence {after}");
                            liveness.recreating(&label, "stalled", &detail);
                            continue 'open;
                        }
                    }
                    continue;
                }
                c = reader.next() => c,
            };
            idle_since = Instant::now();
            let Some(chunk) = next else { continue 'open };
            let mut inputs = Vec::with_capacity(chunk.len());
            let mut failed = false;
            for item in chunk {
                match item {
                    Ok(msg) => inputs.push(msg),
                    Err(e) => {
                        tracing::warn!(message = "Router consumer error; reopening.", source = %source.stream, error = %e);
                        failed = true;
                        break;
                    }
                }
            }
            // A consumer that went back to the stream's start (see `Liveness::rewound`)
            // would have everything read again: reopen at the fence's watermark instead.
            let first = inputs
                .first()
                .and_then(|m| m.info().ok())
                .map(|i| i.stream_sequence);
            if let (Some(first), Some(through)) = (first, fence.through())
                && first <= through.seq
            {
                let detail = format!("delivered {first} after {}", through.seq);
                liveness.rewound(&label, &detail);
                continue 'open;
            }
            if !inputs.is_empty() {
                pull.observe(inputs.iter().map(|m| m.payload.len()));
                let mut rest = inputs;
                while !rest.is_empty() {
                    // New triggers only as far as the bound has room (`admit.rs`).
                    let room = match admission.as_mut() {
                        None => rest.len(),
                        Some(a) => match hold(state, a, &lease, cancel).await {
                            Ok((held, room)) => {
                                if !held.is_zero() {
                                    state.metrics.admission_wait.observe(held.as_secs_f64());
                                }
                                room
                            }
                            Err(Unheld::Lost) => return "the lease expired or was lost".into(),
                            Err(Unheld::NotRouting) => {
                                let _ = lease.release().await;
                                return "node mode excludes routing".into();
                            }
                            Err(Unheld::Drain) => {
                                let _ = lease.release().await;
                                return "drain".into();
                            }
                        },
                    };
                    let split = room < rest.len();
                    let later = rest.split_off(room.clamp(1, rest.len()));
                    let batch = std::mem::replace(&mut rest, later);
                    // At the bound, what goes in counts until the broker shows it.
                    if let Some(a) = admission.as_mut().filter(|_| split) {
                        a.admitted(batch.len() as u64);
                    }
                    // The next chunk is read while this one is routed (see `ReadAhead`).
                    match reader.during(send(state, source, &mut fence, batch)).await {
                        Ok(()) => backoff.reset(),
                        Err(Stop::Fenced) => return "fenced off by a newer router".into(),
                        Err(Stop::Retry) => {
                            backoff.sleep(cancel).await;
                            continue 'open;
                        }
                    }
                }
                if pull.should_reopen() {
                    // Everything read is routed and covered by the fence's watermark,
                    // where the consumer reopens: nothing is lost.
                    continue 'open;
                }
            }
            if failed {
                backoff.sleep(cancel).await;
                continue 'open;
            }
        }
    }
}

/// Why holding new triggers ended before the queue drained.
enum Unheld {
    /// The lease lapsed: another router may hold the source by now.
    Lost,
    /// The node's mode no longer routes.
    NotRouting,
    /// The replica drains.
    Drain,
}

/// Holds the next batch of new triggers while the work under way is queued at or above
/// `saga.max_queued_work` (see `admit.rs`); returns how long it held and how many inputs
/// fit now (every one when the bound is off). Nothing is read or written meanwhile: the batch waits in hand, read but not yet copied, and a router that
/// stops here drops it and leaves it to the next one, which resumes at the fence's
/// watermark.
async fn hold(
    state: &AppState,
    admission: &mut Admission,
    lease: &Kept,
    cancel: &CancellationToken,
) -> Result<(Duration, usize), Unheld> {
    let started = Instant::now();
    loop {
        let room = match admission.room(state).await {
            None => usize::MAX,
            Some(0) => 0,
            Some(r) => usize::try_from(r).unwrap_or(usize::MAX),
        };
        if room > 0 {
            return Ok((started.elapsed(), room));
        }
        if !lease.is_valid() {
            return Err(Unheld::Lost);
        }
        if !state.placement.mode().routes() {
            return Err(Unheld::NotRouting);
        }
        tokio::select! {
            _ = cancel.cancelled() => return Err(Unheld::Drain),
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

/// Why a batch did not go through.
enum Stop {
    /// The fence moved to another router.
    Fenced,
    /// Reopen at the fence's watermark and try again.
    Retry,
}

/// Copies `inputs` into the inbox as fenced batches; advances the fence.
async fn send(
    state: &AppState,
    source: &Source,
    fence: &mut Fence,
    inputs: Vec<async_nats::jetstream::Message>,
) -> Result<(), Stop> {
    let count = state.config.partitions.count;
    let catalog = state.catalog();
    let limits = Limits::from_config(&state.config).with_max_payload(state.broker.max_payload());
    let max_bytes = usize::try_from(state.config.saga.max_batch_bytes.get()).unwrap_or(usize::MAX);
    let mut copies: Vec<BatchMessage> = Vec::new();
    let mut bytes = 0usize;
    let mut last = None;
    let mut lag = None;
    for msg in inputs {
        let Ok(info) = msg.info() else { continue };
        let seq = info.stream_sequence;
        lag = Some(info.pending);
        if fence.through().is_some_and(|t| seq <= t.seq) {
            continue;
        }
        if !wanted(&source.filters, msg.subject.as_str()) {
            // Not an input (a fence marker of the source stream, say): covered, not copied.
            last = Some(seq);
            continue;
        }
        let traceparent = headers::traceparent(msg.headers.as_ref());
        let payload = msg.payload.clone();
        let stored_ms = headers::stored_ms(&info);
        let raw = RawInput {
            subject: msg.subject.to_string(),
            body: payload.clone(),
            traceparent: traceparent.clone(),
            header_bytes: headers::block_bytes(msg.headers.as_ref()),
            refused: None,
            source: format!("{}:{seq}", source.stream),
            stored_ms: Some(stored_ms),
        };
        // The routing is a span of its own (when spans are exported); the copies name it.
        let hop = otel::hop(
            "saga.route",
            otel::Kind::Producer,
            traceparent.as_deref(),
            || {
                vec![
                    otel::attr("messaging.destination.name", raw.subject.as_str()),
                    otel::attr("runner.source", raw.source.as_str()),
                ]
            },
        );
        let onward = otel::onward(hop.as_ref(), traceparent.as_deref());
        let copy_headers = |p: u32| {
            let mut h = HeaderMap::new();
            h.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("{}:{seq}:{p}", source.stream).as_str(),
            );
            h.insert(headers::ROUTED_SUBJECT, raw.subject.as_str());
            h.insert(headers::ROUTED_SOURCE, raw.source.as_str());
            // The source's stored time travels with the copy: the owner bounds the input's
            // time by it, on every replay of the inbox the same (not by the copy's own time,
            // which a router's lag would move).
            h.insert(headers::ROUTED_SOURCE_TIME, stored_ms.to_string().as_str());
            if let Some(tp) = onward {
                h.insert(headers::TRACEPARENT_HEADER, tp);
            }
            h
        };
        let poison = (seq % u64::from(count)) as u32;
        // The input counted whole, then its copy as it would go out: an input refused as too
        // large, or whose copy the inbox could not take, goes to its poison partition as a
        // copy with only the start of its body (what a dead letter keeps), naming why; its
        // owner dead-letters it (the original stays in the source stream at `raw.source`).
        let refused = admission::oversized(&raw, &limits)
            .or_else(|| copy_refusal(&copy_headers(poison), payload.len(), limits.max_payload));
        let (to, payload) = match &refused {
            Some(_) => (
                BTreeSet::from([poison]),
                excerpt(&payload, &copy_headers(poison), &limits),
            ),
            None => (destinations(&catalog, &limits, &raw, seq, count), payload),
        };
        if to.is_empty() {
            // No saga wants it: covered by the watermark, not copied, counted.
            state.metrics.saga_unrouted.inc();
        }
        let adding = payload.len().saturating_mul(to.len());
        // Cut before an input whose copies would pass a limit, so a batch passes
        // `saga.max_batch_bytes` only when one input's copies alone do (they are never
        // split across batches: a batch and its watermark cover whole inputs).
        if let Some(prev) = last
            && !copies.is_empty()
            && (copies.len() + to.len() > COPIES_PER_BATCH
                || bytes.saturating_add(adding) > max_bytes)
        {
            flush(
                state,
                &source.stream,
                fence,
                std::mem::take(&mut copies),
                prev,
            )
            .await?;
            bytes = 0;
        }
        for p in to {
            let mut h = copy_headers(p);
            if let Some(why) = &refused {
                h.insert(headers::ROUTED_REFUSAL, why.as_str());
            }
            copies.push(BatchMessage {
                subject: format!("runner.inbox.{p}.{}", source.stream),
                headers: h,
                payload: payload.clone(),
            });
        }
        bytes = bytes.saturating_add(adding);
        last = Some(seq);
    }
    if let Some(l) = lag {
        state
            .metrics
            .consumer_lag
            .with_label_values(&[&source.stream])
            .set(l as i64);
    }
    match last {
        Some(seq) if fence.through().is_none_or(|t| t.seq < seq) => {
            flush(state, &source.stream, fence, copies, seq).await
        }
        _ => Ok(()),
    }
}

/// The router of `source`'s name among the stalled stages ([`crate::telemetry::stall`]).
fn stage(source: &str) -> String {
    format!("router.{source}")
}

/// What a refused input's copy carries of its body: the part a dead letter keeps
/// ([`crate::deadletter::EXCERPT_BYTES`]), or nothing when even that would not fit beside
/// `headers`.
fn excerpt(body: &bytes::Bytes, headers: &HeaderMap, limits: &Limits) -> bytes::Bytes {
    let part = body.slice(..body.len().min(crate::deadletter::EXCERPT_BYTES));
    match copy_refusal(headers, part.len(), limits.max_payload) {
        None => part,
        Some(_) => bytes::Bytes::new(),
    }
}

/// Why a copy with `headers` and a body of `body_len` bytes cannot go into the inbox under
/// `max_payload` (0: unknown), counting what the fenced batch adds; `None` when it can.
fn copy_refusal(headers: &HeaderMap, body_len: usize, max_payload: usize) -> Option<String> {
    let head = headers::block_bytes(Some(headers)) + headers::RELAY_HEADER_RESERVE;
    let whole = head + body_len;
    (head > headers::MAX_HEADER_BLOCK || (max_payload > 0 && whole > max_payload)).then(|| {
        format!(
            "its copy into the saga inbox would be {whole} bytes ({body_len} of body, {head} of \
             headers); the broker takes at most {max_payload} (max_payload)"
        )
    })
}

/// Publishes `copies` plus a marker covering source sequence `through` as one fenced batch.
async fn flush(
    state: &AppState,
    source: &str,
    fence: &mut Fence,
    copies: Vec<BatchMessage>,
    through: u64,
) -> Result<(), Stop> {
    let position = Position {
        seq: through,
        ord: 0,
    };
    let timeout = state.config.nats.request_timeout.get();
    let js = state.broker.jetstream();
    let transport = fenced_batch::Transport::for_replicas(state.config.streams.replicas);
    match transport
        .publish(js, state.broker.client(), fence, &copies, position, timeout)
        .await
    {
        fenced_batch::Outcome::Stored => {
            state.metrics.router_copies.inc_by(copies.len() as u64);
            state
                .metrics
                .consumer_checkpoint
                .with_label_values(&[source])
                .set(through as i64);
            state.metrics.stalls.progressed(&stage(source));
            Ok(())
        }
        fenced_batch::Outcome::Fenced => Err(Stop::Fenced),
        fenced_batch::Outcome::Retry(why) => {
            crate::relay::election::publish_failed("router batch", &why);
            state.metrics.stalls.failed(&stage(source), &why);
            Err(Stop::Retry)
        }
    }
}
