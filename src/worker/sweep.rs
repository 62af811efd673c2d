//! The dedupe sweep: deletes dedupe markers older than `saga.dedupe_retention`.
//!
//! Once a minute it walks the `dedupe` table in chunks of [`SWEEP_CHUNK`] markers, one
//! write transaction per chunk, so a large table never holds the writer for long.
//!
//! Guarantee: only markers older than the retention are deleted, so an event redelivered
//! or republished within the retention is still recognised as applied. A failed chunk
//! deletes nothing and is retried at the next sweep.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::clock::now_ms;
use crate::runtime::AppState;

/// Markers examined per sweep transaction.
pub(crate) const SWEEP_CHUNK: usize = 10_000;

/// Time between sweeps (and after a failed chunk).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Sweeps until `cancel` fires.
pub(crate) async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    let retention = state.config.saga.dedupe_retention.get().as_millis() as u64;
    let mut from: Vec<u8> = Vec::new();
    loop {
        let cutoff = now_ms().saturating_sub(retention);
        let start = std::mem::take(&mut from);
        match state
            .store
            .write(move |t| t.sweep_dedupe(cutoff, &start, SWEEP_CHUNK))
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
