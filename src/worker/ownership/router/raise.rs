//! Raising a share's fence: where a share starts and which markers it refuses.
//!
//! Guarantees kept here:
//! - A share with no marker of its own starts where the source's former single router
//!   stopped (its marker is carried forward), so nothing that router copied is copied again.
//! - No share routes while a replica of an earlier release holds that router's lease.
//! - A watermark past the source's last sequence is refused, not obeyed: obeying it would
//!   skip every input up to it. The share routes nothing and shows as stalled until an
//!   operator resets its fence (`POST /admin/router-fence`, `admin/fences.rs`).

use async_nats::jetstream::kv;

use super::router_key;
use super::share::Share;
use crate::broker::fence::Fence;
use crate::runtime::AppState;
use crate::worker::ownership::lease;

/// The owner of the source's single-router lease of an earlier release, when another
/// replica holds it.
pub(super) async fn legacy_router(
    state: &AppState,
    leases: &kv::Store,
    share: &Share,
) -> Option<String> {
    match lease::holder(leases, &router_key(share.stream())).await {
        Ok(Some(h)) if h.owner != state.node_id => Some(h.owner),
        _ => None,
    }
}

/// Raises the share's fence; a share with no marker of its own yet carries the marker of
/// the source's former single router forward, so it starts where that router stopped. A
/// marker claiming a source sequence the source has not reached (forged, or from another
/// deployment) is refused: routing after it would skip every input up to it. The share then
/// stays unrouted, stalled in `/health`, until an operator resets its fence
/// (`POST /admin/router-fence`).
pub(super) async fn raise(state: &AppState, share: &Share, epoch: u64) -> Result<Fence, String> {
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let mut fence = Fence::raise(js, inbox, share, epoch, &state.node_id)
        .await
        .map_err(|e| e.to_string())?;
    if fence.through().is_none() {
        let before = Fence::observe(js, inbox, share.stream())
            .await
            .map_err(|e| e.to_string())?;
        if let Some(at) = before.through() {
            past_the_source(state, share, at.seq).await?;
            fence.publish_marker(js, at).await?;
            tracing::info!(message = "Share starts where the source's single router stopped.", share = %share, seq = at.seq);
        }
    }
    if let Some(at) = fence.through() {
        past_the_source(state, share, at.seq).await?;
    }
    Ok(fence)
}

/// Refuses a watermark at `seq` past the source's last sequence.
async fn past_the_source(state: &AppState, share: &Share, seq: u64) -> Result<(), String> {
    let last = last_sequence(state, share.stream())
        .await
        .map_err(|e| format!("cannot read the source stream: {e}"))?;
    if seq > last {
        return Err(format!(
            "its marker says the source is routed through sequence {seq}, but {} holds \
             sequences up to {last} only: the marker is forged or from another deployment; \
             nothing is routed until an operator resets it (POST /admin/router-fence)",
            share.stream()
        ));
    }
    Ok(())
}

/// The last sequence `stream` holds (0 when empty).
pub(crate) async fn last_sequence(
    state: &AppState,
    stream: &str,
) -> Result<u64, async_nats::Error> {
    // Looking the stream up reads its info from the server: no second request.
    let s = state.broker.jetstream().get_stream(stream).await?;
    Ok(s.cached_info().state.last_sequence)
}
