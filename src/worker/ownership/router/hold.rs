//! Holding new triggers at the bound: a share's router of the aggregate stream waits here,
//! with its batch in hand, while the work under way is queued above
//! `saga.max_queued_work` (`admit.rs`), and learns how many of the batch go in.
//!
//! Guarantee: holding reads and writes nothing; it ends when there is room, or as soon as
//! the lease lapses, the node stops routing or a drain begins (the batch is then left to
//! the next router, which resumes at the fence's watermark).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::share;
use crate::runtime::AppState;
use crate::worker::admit::{Gate, POLL};
use crate::worker::ownership::keeper::Kept;

/// Why holding new triggers ended before the queue drained.
pub(super) enum Unheld {
    /// The lease lapsed: another router may hold the source by now.
    Lost,
    /// The node's mode no longer routes.
    NotRouting,
    /// The replica drains.
    Drain,
}

/// Holds the next batch of `waiting` new triggers while the work under way is queued at or
/// above `saga.max_queued_work` (see `admit.rs`); returns how long it held and how many of
/// them go in now (this share's part of the room; every one when the bound is off). Nothing
/// is read or written meanwhile: the batch waits in hand, read but not yet copied, and a
/// router that stops here drops it and leaves it to the next one, which resumes at the
/// fence's watermark.
pub(super) async fn hold(
    state: &AppState,
    gate: &Gate,
    waiting: usize,
    lease: &Kept,
    cancel: &CancellationToken,
) -> Result<(Duration, usize), Unheld> {
    let started = Instant::now();
    loop {
        let room = gate.take(state, waiting, share::SHARES as usize).await;
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
