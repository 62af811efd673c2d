//! The timer loop: fires due rows of the `schedule` table through the same
//! [`Processor`] and commit discipline as stream inputs.
//!
//! It peeks at the earliest due time, fires up to [`TIMER_BATCH`] due timers in one write
//! transaction, and sleeps until the next one is due or `saga.timer_poll` passes, whichever
//! is sooner, so a timer set meanwhile by a commit fires at most one poll interval late.
//!
//! Guarantees:
//! - **Deterministic replay.** A firing input carries the timer's due time as its
//!   timestamp, never the time it actually fired, so applying it gives the same result
//!   whenever it runs.
//! - **At most once per timer, never after cancellation.** The row is deleted in the
//!   transaction that applies the firing; a cancelled timer's row was deleted by the
//!   transaction that cancelled it, and the engine ignores a firing it no longer expects.
//! - A failed transaction fires nothing; the timers stay due and are tried again.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::admission::Limits;
use super::partition::partition;
use super::process::{Processor, TIMER_SUBJECT};
use crate::broker::headers;
use crate::clock::now_ms;
use crate::relay::RelayHandle;
use crate::runtime::AppState;
use crate::storage::tables::TimerEntry;

/// Most timers fired in one transaction.
pub(crate) const TIMER_BATCH: usize = 1024;

/// Fires due timers until `cancel` fires.
pub(crate) async fn run(state: Arc<AppState>, relay: RelayHandle, cancel: CancellationToken) {
    let poll = state.config.saga.timer_poll.get();
    let metrics = &state.metrics;
    while !cancel.is_cancelled() {
        let now = now_ms();
        let peek = state
            .store
            .read(|t| Ok((t.next_timer_due()?, t.timers_pending()?)))
            .await;
        let (next_due, pending) = match peek {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(message = "Cannot read timers.", error = %e);
                (None, 0)
            }
        };
        metrics.timers_pending.set(pending as i64);
        if next_due.is_some_and(|d| d <= now) {
            let catalog = state.catalog();
            let limits =
                Limits::from_config(&state.config).with_max_payload(state.broker.max_payload());
            let st = state.clone();
            let fired = state
                .store
                .write(move |t| {
                    let due: Vec<TimerEntry> = t.due_timers(now, TIMER_BATCH)?;
                    let mut p = Processor::new(&catalog, &limits, now);
                    // A paused tenant's timers are held like its other inputs.
                    p.paused = st.paused.get();
                    let mut lags = Vec::with_capacity(due.len());
                    for e in &due {
                        p.timer(t, e)?;
                        lags.push(now.saturating_sub(e.due_ms));
                    }
                    Ok((lags, p.tally))
                })
                .await;
            match fired {
                Ok((lags, tally)) => {
                    for l in &lags {
                        metrics.timer_fire_lag.observe(*l as f64 / 1000.0);
                    }
                    metrics.timers_fired.inc_by(lags.len() as u64);
                    tally.record(metrics);
                    if tally.outbox > 0 {
                        relay.note_written(tally.last_outbox, tally.outbox);
                        relay.wake();
                    }
                    if lags.len() == TIMER_BATCH {
                        continue;
                    }
                }
                Err(e) => {
                    tracing::error!(message = "Firing timers failed; will retry.", error = %e)
                }
            }
        }
        let wait = next_due
            .map(|d| Duration::from_millis(d.saturating_sub(now_ms())))
            .unwrap_or(poll)
            .min(poll);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// How long a timer firing published to the inbox is not published again while its
/// partition has not applied it yet.
const REFIRE_AFTER: Duration = Duration::from_secs(5);

/// Partitioned mode: publishes each due timer of an owned partition into that partition's
/// inbox (`runner.inbox.<p>.timer`), where it is applied in log order like any input
/// ([`Processor::fired_timer`]) — so a timer firing replays after a fail-over like the
/// inputs around it. The schedule row is deleted when the firing is applied, not here; a
/// firing published twice (a re-publish, a former owner) finds no row the second time and
/// is ignored. The `Nats-Msg-Id` is the timer's id, so repeats inside the window are not
/// even stored.
pub(crate) async fn run_partitioned(state: Arc<AppState>, cancel: CancellationToken) {
    let poll = state.config.saga.timer_poll.get();
    let count = state.config.partitions.count;
    let js = state.broker.jetstream().clone();
    let mut sent: std::collections::HashMap<String, std::time::Instant> = Default::default();
    while !cancel.is_cancelled() {
        let now = now_ms();
        let due = state
            .store
            .read(move |t| Ok((t.due_timers(now, TIMER_BATCH)?, t.timers_pending()?)))
            .await;
        let (due, pending) = match due {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(message = "Cannot read timers.", error = %e);
                (Vec::new(), 0)
            }
        };
        state.metrics.timers_pending.set(pending as i64);
        sent.retain(|_, at| at.elapsed() < REFIRE_AFTER);
        for t in due {
            let p = partition(&t.tenant, &t.saga, &t.correlation_id, count);
            if !state.placement.owns(p) {
                continue;
            }
            let id = format!(
                "timer:{}:{}:{}:{}",
                t.tenant, t.saga, t.correlation_id, t.timer_id
            );
            if sent.contains_key(&id) {
                continue;
            }
            let mut h = headers::outgoing(&id, Some(&t.tenant), None);
            h.insert(headers::ROUTED_SUBJECT, TIMER_SUBJECT);
            h.insert(headers::ROUTED_SOURCE, "timer");
            let body = serde_json::to_vec(&t).unwrap_or_default();
            let published = async {
                js.publish_with_headers(format!("runner.inbox.{p}.timer"), h, body.into())
                    .await?
                    .await
                    .map_err(async_nats::Error::from)
            };
            match published.await {
                Ok(_) => {
                    sent.insert(id, std::time::Instant::now());
                    state
                        .metrics
                        .timer_fire_lag
                        .observe(now.saturating_sub(t.due_ms) as f64 / 1000.0);
                    state.metrics.timers_fired.inc();
                }
                Err(e) => {
                    tracing::warn!(message = "Cannot publish a timer firing; will retry.", error = %e);
                    break;
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
    }
}
