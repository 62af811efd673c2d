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
use crate::worker::ownership::{claims, lease};

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

/// How an operator clears a share's refused marker.
const RESET: &str = "nothing is routed until an operator resets it (POST /admin/router-fence)";

/// Raises the share's fence; a share with no marker of its own yet carries the marker of
/// the source's former single router forward, so it starts where that router stopped. A
/// marker claiming a source sequence the source has not reached, or a lease epoch the
/// leases bucket has not reached (forged, or from another deployment), is refused
/// (`claims.rs`): routing after it would skip every input up to it, or never start. The
/// share then stays unrouted, stalled in `/health`, until an operator resets its fence
/// (`POST /admin/router-fence`).
pub(super) async fn raise(state: &AppState, share: &Share, epoch: u64) -> Result<Fence, String> {
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let seen = Fence::observe(js, inbox, share)
        .await
        .map_err(|e| e.to_string())?;
    claims::marker(state, &seen, share.stream(), RESET).await?;
    let mut fence = seen
        .raise(js, epoch, &state.node_id)
        .await
        .map_err(|e| e.to_string())?;
    if fence.through().is_none() {
        let before = Fence::observe(js, inbox, share.stream())
            .await
            .map_err(|e| e.to_string())?;
        if let Some(at) = before.through() {
            claims::watermark(state, at.seq, share.stream(), RESET).await?;
            fence.publish_marker(js, at).await?;
            tracing::info!(message = "Share starts where the source's single router stopped.", share = %share, seq = at.seq);
        }
    }
    Ok(fence)
}
