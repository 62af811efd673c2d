//! The copies a router makes of its source's inputs, and the fenced batches that carry
//! them into the saga inbox.
//!
//! Guarantees kept here:
//! - **Whole inputs, exact progress.** A batch holds whole inputs (one input's copies are
//!   never split across batches) and ends with a marker recording the last source sequence
//!   it covers, stored atomically with the copies; an input already under the fence's
//!   watermark is never copied again.
//! - **Bounded batches.** A batch is cut before it would pass `COPIES_PER_BATCH` copies or
//!   `saga.max_batch_bytes`, unless one input's copies alone pass the bytes.
//! - **Every input accounted for.** An input no saga wants is covered by the watermark and
//!   counted, not copied; one that cannot be routed goes to partition `seq mod P`; one too
//!   large for the inbox goes there as a copy with only the start of its body, naming why.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};

use async_nats::HeaderMap;

use super::share::Share;
use super::stage;
use super::waiting::Waiting;
use crate::broker::batch::BatchMessage;
use crate::broker::fence::{Fence, Position};
use crate::broker::fenced_batch;
use crate::broker::headers;
use crate::manifest::Catalog;
use crate::runtime::AppState;
use crate::telemetry::otel;
use crate::worker::admission::{self, Limits, RawInput};
use crate::worker::consume::wanted;
use crate::worker::partition::partition;

/// Most copies in one batch (the server's atomic batch limit is 1000).
const COPIES_PER_BATCH: usize = 900;

/// The partitions an input's copies go to: one per partition its routes reach, or
/// `seq mod P` for an input that cannot be routed (its owner dead-letters it).
pub fn destinations(
    catalog: &Catalog,
    limits: &Limits,
    raw: &RawInput,
    seq: u64,
    count: u32,
) -> BTreeSet<u32> {
    routed(catalog, limits, raw, seq, count).0
}

/// [`destinations`], and whether any saga the input reaches emits effect commands (an input
/// that reaches none queues no work for an effect worker, `worker/admit.rs`).
fn routed(
    catalog: &Catalog,
    limits: &Limits,
    raw: &RawInput,
    seq: u64,
    count: u32,
) -> (BTreeSet<u32>, bool) {
    let poison = || (BTreeSet::from([(seq % u64::from(count)) as u32]), false);
    let Ok(admitted) = admission::admit(raw, limits) else {
        return poison();
    };
    match catch_unwind(AssertUnwindSafe(|| {
        crate::saga::route(catalog, &admitted.input)
    })) {
        Ok(Ok(routes)) => (
            routes
                .iter()
                .map(|r| partition(admitted.tenant, &r.saga, &r.correlation_id, count))
                .collect(),
            routes.iter().any(|r| catalog.starts_effects(&r.saga)),
        ),
        _ => poison(),
    }
}

/// Why a batch did not go through.
pub(super) enum Stop {
    /// The fence moved to another router.
    Fenced,
    /// Reopen at the fence's watermark and try again.
    Retry,
}

/// Where a router's fence marker says it got: the source sequence through which
/// everything is covered, and per tenant the last input copied beyond it (`crate::fair`).
pub(super) type Progress = (u64, BTreeMap<String, u64>);

/// Copies `inputs` (messages of `share`, each tenant's in source order, taken from the
/// lanes) into the inbox as fenced batches; advances the fence, the last marker recording
/// `progress`. A batch cut before the end records the fence's watermark as it was and,
/// per tenant, the last input copied so far. Returns how many of `inputs` reach no saga
/// that emits effect commands (they queue no effect work).
pub(super) async fn send(
    state: &AppState,
    share: &Share,
    filters: &[String],
    fence: &mut Fence,
    inputs: Vec<Waiting>,
    progress: Progress,
) -> Result<usize, Stop> {
    let mut quiet = inputs.len();
    let source = &share.source;
    let count = state.config.partitions.count;
    let catalog = state.catalog();
    let limits = Limits::from_config(&state.config).with_max_payload(state.broker.max_payload());
    let max_bytes = usize::try_from(state.config.saga.max_batch_bytes.get()).unwrap_or(usize::MAX);
    let tenancy = state.limits.get();
    let mut copies: Vec<BatchMessage> = Vec::new();
    let mut bytes = 0usize;
    // Per tenant, the last input of this call in `copies` or covered without a copy.
    let mut so_far: BTreeMap<String, u64> = BTreeMap::new();
    let mut lag = None;
    for w in inputs {
        let seq = w.seq;
        lag = Some(w.pending);
        if fence.through().is_some_and(|t| seq <= t.seq) {
            continue;
        }
        let raw = w.input;
        let tenant = crate::fair::tenant_of(&raw.subject).to_string();
        if !wanted(filters, &raw.subject) {
            // Not an input (a fence marker of the source stream, say): covered, not copied.
            so_far.insert(tenant, seq);
            continue;
        }
        let traceparent = raw.traceparent.clone();
        let payload = raw.body.clone();
        let stored_ms = raw.stored_ms.unwrap_or_default();
        let live_cap = tenancy.live_instance_caps.get(&tenant).copied();
        let timer_cap = tenancy.pending_timer_caps.get(&tenant).copied();
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
            // The tenant's caps, in force now, travel with the copy: its owner holds a new
            // instance by them, the same on every replay (`worker/cap.rs`).
            if let Some(cap) = live_cap {
                h.insert(headers::LIVE_CAP, cap.to_string().as_str());
            }
            if let Some(cap) = timer_cap {
                h.insert(headers::TIMER_CAP, cap.to_string().as_str());
            }
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
            None => {
                let (to, effects) = routed(&catalog, &limits, &raw, seq, count);
                quiet -= usize::from(effects);
                (to, payload)
            }
        };
        if to.is_empty() {
            // No saga wants it: covered by the watermark, not copied, counted.
            state.metrics.saga_unrouted.inc();
        }
        let adding = payload.len().saturating_mul(to.len());
        // Cut before an input whose copies would pass a limit, so a batch passes
        // `saga.max_batch_bytes` only when one input's copies alone do (they are never
        // split across batches: a batch and its watermark cover whole inputs).
        if !copies.is_empty()
            && (copies.len() + to.len() > COPIES_PER_BATCH
                || bytes.saturating_add(adding) > max_bytes)
        {
            let partial = partial_progress(fence, &so_far);
            flush(state, share, fence, std::mem::take(&mut copies), partial).await?;
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
        so_far.insert(tenant, seq);
    }
    if let Some(l) = lag {
        state
            .metrics
            .consumer_lag
            .with_label_values(&[&source.stream, &share.index.to_string()])
            .set(l as i64);
    }
    let moved = fence.through().is_none_or(|t| t.seq < progress.0) || *fence.lanes() != progress.1;
    if copies.is_empty() && !moved {
        return Ok(quiet);
    }
    flush(state, share, fence, copies, progress).await?;
    Ok(quiet)
}

/// The marker of a batch cut short: the fence's watermark as it is, and per tenant the
/// further of the fence's lanes and what this call copied so far (each tenant's inputs go
/// in order, so everything of a tenant up to its entry is copied).
fn partial_progress(fence: &Fence, so_far: &BTreeMap<String, u64>) -> Progress {
    let through = fence.through().map_or(0, |t| t.seq);
    let mut lanes = fence.lanes().clone();
    for (tenant, seq) in so_far {
        let last = lanes.entry(tenant.clone()).or_insert(0);
        *last = (*last).max(*seq);
    }
    lanes.retain(|_, last| *last > through);
    (through, lanes)
}

/// Stores a marker alone recording `progress` (other shares' messages read).
pub(super) async fn mark(
    state: &AppState,
    share: &Share,
    fence: &mut Fence,
    progress: Progress,
) -> Result<(), Stop> {
    if fence.through().is_some_and(|t| t.seq >= progress.0) && *fence.lanes() == progress.1 {
        return Ok(());
    }
    flush(state, share, fence, Vec::new(), progress).await
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

/// Publishes `copies` plus a marker recording `progress` as one fenced batch.
async fn flush(
    state: &AppState,
    share: &Share,
    fence: &mut Fence,
    copies: Vec<BatchMessage>,
    (through, lanes): Progress,
) -> Result<(), Stop> {
    let position = Position {
        seq: through,
        ord: 0,
    };
    fence.stage_lanes(lanes);
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
                .with_label_values(&[share.stream(), &share.index.to_string()])
                .set(through as i64);
            state.metrics.stalls.progressed(&stage(share));
            Ok(())
        }
        fenced_batch::Outcome::Fenced => Err(Stop::Fenced),
        fenced_batch::Outcome::Retry(why) => {
            crate::relay::election::publish_failed("router batch", &why);
            state.metrics.stalls.failed(&stage(share), &why);
            Err(Stop::Retry)
        }
    }
}
