//! The retention sweep: nothing in the store grows without bound.
//!
//! Once a minute it walks the `dedupe` table in chunks of [`SWEEP_CHUNK`] markers, one
//! write transaction per chunk, so a large table never holds the writer for long, and
//! removes dead letters older than `saga.dead_letter_retention`; every
//! [`INSTANCE_SWEEP_EVERY`] it walks the instances the same way and removes those finished
//! before `saga.finished_retention`, with their history.
//!
//! Guarantees: only markers older than the retention are deleted, so an event redelivered
//! or republished within the retention is still recognised as applied, also for an
//! instance removed meanwhile; a pending dead letter its key is parked behind is never
//! removed by the sweep, nor an instance whose key is parked or that waits for an operator.
//! A failed chunk deletes nothing and is retried at the next sweep.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::clock::now_ms;
use crate::runtime::AppState;

/// Markers examined per sweep transaction.
pub(crate) const SWEEP_CHUNK: usize = 10_000;

/// Time between sweeps (and after a failed chunk).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Time between walks of the instances (each reads every stored instance's status).
const INSTANCE_SWEEP_EVERY: Duration = Duration::from_secs(600);

/// Sweeps until `cancel` fires.
pub(crate) async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    let retention = state.config.saga.dedupe_retention.get().as_millis() as u64;
    let mut from: Vec<u8> = Vec::new();
    let mut instances_due = tokio::time::Instant::now();
    loop {
        if from.is_empty() {
            expire_dead_letters(&state).await;
            if tokio::time::Instant::now() >= instances_due {
                expire_instances(&state).await;
                instances_due = tokio::time::Instant::now() + INSTANCE_SWEEP_EVERY;
            }
        }
        let cutoff = now_ms().saturating_sub(retention);
        let start = std::mem::take(&mut from);
        match state
            .store
            .write_logged(move |t| t.sweep_dedupe(cutoff, &start, SWEEP_CHUNK))
            .await
        {
            Ok((deleted, next)) => {
                if deleted > 0 {
                    tracing::debug!(message = "Expired dedupe markers deleted.", deleted);
                }
                if let Some(k) = next {
                    from = k;
                    continue;
                }
            }
            Err(e) => tracing::warn!(message = "Dedupe sweep failed; will retry.", error = %e),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(SWEEP_EVERY) => {}
        }
    }
}

/// Removes dead letters past `saga.dead_letter_retention` (see [`crate::deadletter::purge`]).
async fn expire_dead_letters(state: &AppState) {
    let age = state.config.saga.dead_letter_retention.get().as_millis() as u64;
    let p = crate::deadletter::Purge {
        before_ms: Some(now_ms().saturating_sub(age)),
        ..Default::default()
    };
    let store = state.store.clone();
    match tokio::task::spawn_blocking(move || crate::deadletter::purge(&store, &p)).await {
        Ok(Ok(gone)) if !gone.is_empty() => {
            tracing::info!(
                message = "Expired dead letters removed.",
                removed = gone.len()
            );
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::warn!(message = "Dead-letter sweep failed; will retry.", error = %e),
        Err(e) => tracing::warn!(message = "Dead-letter sweep failed; will retry.", error = %e),
    }
}

/// Removes instances finished before `saga.finished_retention`, chunk by chunk.
async fn expire_instances(state: &AppState) {
    let age = state.config.saga.finished_retention.get().as_millis() as u64;
    let cutoff = now_ms().saturating_sub(age);
    let mut from: Vec<u8> = Vec::new();
    let mut removed = 0;
    loop {
        let start = std::mem::take(&mut from);
        match state
            .store
            .write_logged(move |t| t.sweep_finished(cutoff, &start, SWEEP_CHUNK))
            .await
        {
            Ok((n, next)) => {
                // A successor would keep these until its own sweep: the partitions' snapshots
                // are retaken when any went.
                if n > 0 {
                    state.store.note_unlogged();
                }
                removed += n;
                match next {
                    Some(k) => from = k,
                    None => break,
                }
            }
            Err(e) => {
                tracing::warn!(message = "Instance sweep failed; will retry.", error = %e);
                break;
            }
        }
    }
    if removed > 0 {
        tracing::info!(
            message = "Finished instances past their retention removed.",
            removed
        );
    }
}
