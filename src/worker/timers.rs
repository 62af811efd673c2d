//! The timer loop: each due row of the `schedule` table whose instance belongs to a
//! partition this node owns is published into that partition's inbox
//! (`runner.inbox.<p>.timer`) and applied there in log order like any other input
//! ([`super::process::Processor::fired_timer`]).
//!
//! It reads the due rows every `saga.timer_poll`, so a timer fires at most one poll late
//! (plus the inbox's own delay); a pass that found a full batch due is followed by the next
//! at once. A pass publishes its firings without waiting for each acknowledgement before
//! the next publish (they are awaited together), so a burst of due timers fires at the
//! rate the stream stores them, not one round trip per timer.
//!
//! Guarantees:
//! - **Deterministic replay.** A firing carries the timer's due time as its timestamp,
//!   never the time it was published, and sits in the partition's log with the inputs
//!   around it, so a successor replaying the partition applies it at the same place.
//! - **At most once per timer, never after cancellation.** The row is deleted by the
//!   transaction that applies the firing, not here; a firing published twice (a re-publish
//!   after [`REFIRE_AFTER`], a former owner's) finds no row the second time and is ignored,
//!   and a cancelled timer's row was deleted by the transaction that cancelled it.
//! - **Nothing stored twice in the window.** The `Nats-Msg-Id` is the timer's id.
//! - A failed publish stops the pass; its row, and those of the firings after it, stay due
//!   and are published on the next one (a firing that was stored after all is not stored
//!   twice: the `Nats-Msg-Id`).
//! - **Rows fired and not yet applied do not hold the ones behind them.** A pass passes
//!   over the rows it published within [`REFIRE_AFTER`] (they stay until their partition
//!   applies the firing), so under a burst each pass takes the next due rows.
//! - **Other partitions' rows do not hold this node's timers.** A store keeps the rows of a
//!   partition the node handed over (an import replaces them if it owns it again); a pass
//!   passes over them, up to [`SCAN_AT_MOST`] due rows (past that it warns once).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::partition::partition;
use super::process::TIMER_SUBJECT;
use crate::broker::headers;
use crate::clock::now_ms;
use crate::runtime::AppState;

/// Most due timers read in one pass.
pub(crate) const TIMER_BATCH: usize = 1024;

/// Most due rows one pass looks at: rows of partitions this node no longer owns (its store
/// keeps them until it owns the partition again, when an import replaces them) are passed
/// over, up to this many.
const SCAN_AT_MOST: usize = 64 * TIMER_BATCH;

/// How long a timer firing published to the inbox is not published again while its
/// partition has not applied it yet.
const REFIRE_AFTER: Duration = Duration::from_secs(5);

/// Publishes each due timer of an owned partition into that partition's
/// inbox (`runner.inbox.<p>.timer`), where it is applied in log order like any input
/// ([`super::process::Processor::fired_timer`]) — so a timer firing replays after a fail-over like the
/// inputs around it. The schedule row is deleted when the firing is applied, not here; a
/// firing published twice (a re-publish, a former owner) finds no row the second time and
/// is ignored. The `Nats-Msg-Id` is the timer's id, so repeats inside the window are not
/// even stored.
pub(crate) async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    let poll = state.config.saga.timer_poll.get();
    let count = state.config.partitions.count;
    let js = state.broker.jetstream().clone();
    // Schedule keys of the rows published lately, and when. Shared with the store read of
    // each pass, not copied into it: the read has ended before the map changes again, so
    // `Arc::make_mut` finds it unshared and changes it in place.
    let mut sent: Arc<std::collections::HashMap<Vec<u8>, std::time::Instant>> = Default::default();
    // Whether the last pass stopped at SCAN_AT_MOST (logged once per episode).
    let mut scan_cut_logged = false;
    while !cancel.is_cancelled() {
        let now = now_ms();
        let owned = state.placement.owned();
        Arc::make_mut(&mut sent).retain(|_, at| at.elapsed() < REFIRE_AFTER);
        let published = Arc::clone(&sent);
        let due = state
            .store
            .read(move |t| {
                let wanted = |key: &[u8], t: &str, s: &str, c: &str| {
                    owned.contains_key(&partition(t, s, c, count)) && !published.contains_key(key)
                };
                let due = t.due_timers_kept(now, TIMER_BATCH, SCAN_AT_MOST, wanted)?;
                Ok((due, t.timers_pending()?))
            })
            .await;
        let ((due, cut), pending) = match due {
            Ok(v) => v,
            Err(e) => {
                tracing::error!(message = "Cannot read timers.", error = %e);
                ((Vec::new(), false), 0)
            }
        };
        if cut && !scan_cut_logged {
            tracing::warn!(
                message = "More due timers of partitions this node no longer owns, or fired and not yet applied, than one pass looks at; later timers of its own partitions wait behind them.",
                looked_at = SCAN_AT_MOST
            );
        }
        scan_cut_logged = cut;
        state.metrics.timers_pending.set(pending as i64);
        let full = due.len() >= TIMER_BATCH;
        let mut failed = false;
        // Published in order, acknowledgements awaited after: (schedule key, due time, ack).
        let mut acks = Vec::with_capacity(due.len());
        for t in due {
            let p = partition(&t.tenant, &t.saga, &t.correlation_id, count);
            if !state.placement.owns(p) {
                continue;
            }
            let id = format!(
                "timer:{}:{}:{}:{}",
                t.tenant, t.saga, t.correlation_id, t.timer_id
            );
            let mut h = headers::outgoing(&id, Some(&t.tenant), None);
            h.insert(headers::ROUTED_SUBJECT, TIMER_SUBJECT);
            h.insert(headers::ROUTED_SOURCE, "timer");
            let body = serde_json::to_vec(&t).unwrap_or_default();
            match js
                .publish_with_headers(format!("runner.inbox.{p}.timer"), h, body.into())
                .await
            {
                Ok(ack) => acks.push((t.key(), t.due_ms, ack)),
                Err(e) => {
                    crate::relay::election::publish_failed("timer firing", &e);
                    failed = true;
                    break;
                }
            }
        }
        for (key, due_ms, ack) in acks {
            match ack.await {
                Ok(_) => {
                    Arc::make_mut(&mut sent).insert(key, std::time::Instant::now());
                    state
                        .metrics
                        .timer_fire_lag
                        .observe(now.saturating_sub(due_ms) as f64 / 1000.0);
                    state.metrics.timers_fired.inc();
                }
                Err(e) => {
                    crate::relay::election::publish_failed("timer firing", &e);
                    failed = true;
                    break;
                }
            }
        }
        // More may be due behind a full batch: look again at once, unless publishing fails.
        if full && !failed {
            continue;
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
    }
}
