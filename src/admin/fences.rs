//! `POST /admin/router-fence`: an operator's repair of a router share's fence whose marker
//! cannot be right — a watermark past what the source holds, which the share's router
//! refuses (it routes nothing and shows as stalled in `/health`), or an epoch no lease will
//! ever reach.
//!
//! Body `{"share": "<source>/<n>", "through": N, "confirm": true}`. Without `confirm`
//! nothing is done: the answer (400) shows the marker in place, the source's last sequence
//! and what the reset would store. With it, a marker with epoch 0 and watermark `N` replaces
//! the last one (compare-and-set on its sequence, [`Fence`]'s `Observed::reset`); the
//! share's router raises again and routes from `N + 1`. Choosing `N` is the operator's
//! call: inputs at or below it are not routed again, inputs above it are (the inbox's
//! duplicate window and the partitions' dedupe markers drop what was already routed). 400
//! for an unknown share or `N` past the source's last sequence; 409 on a node that runs no
//! sagas. Behind the admin token.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::operate::error;
use crate::broker::fence::{Fence, Position};
use crate::runtime::AppState;
use crate::worker::ownership::router::last_sequence;
use crate::worker::ownership::router::share::Share;

/// The request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Reset {
    share: String,
    through: u64,
    #[serde(default)]
    confirm: bool,
}

pub(super) async fn reset(
    State(state): State<Arc<AppState>>,
    body: Result<Json<Reset>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if !state.config.runner.mode.runs_sagas() {
        return error(StatusCode::CONFLICT, "router fences are for saga nodes");
    }
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let shares: Vec<Share> = crate::worker::sources(&state)
        .iter()
        .flat_map(Share::all)
        .collect();
    let Some(share) = shares.iter().find(|s| s.to_string() == req.share) else {
        let known: Vec<String> = shares.iter().map(Share::to_string).collect();
        return error(
            StatusCode::BAD_REQUEST,
            format!("no router share {:?}; the shares are {known:?}", req.share),
        );
    };
    let last = match last_sequence(&state, share.stream()).await {
        Ok(l) => l,
        Err(e) => {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot read {}: {e}", share.stream()),
            );
        }
    };
    if req.through > last {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "through {} is past the last sequence of {} ({last})",
                req.through,
                share.stream()
            ),
        );
    }
    let js = state.broker.jetstream();
    let inbox = &state.config.streams.saga_inbox;
    let seen = match Fence::observe(js, inbox, share).await {
        Ok(o) => o,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let in_place = json!({
        "epoch": seen.epoch(),
        "through": seen.through().map(|t| t.seq),
    });
    if !req.confirm {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "not confirmed: the marker of {share} holds epoch {:?} through {:?} and {} ends at \
                 {last}; with \"confirm\": true a marker with epoch 0 through {} replaces it and \
                 the share routes from {}",
                seen.epoch(),
                seen.through().map(|t| t.seq),
                share.stream(),
                req.through,
                req.through + 1
            ),
        );
    }
    let owner = format!("admin:{}", state.node_id);
    let through = Position {
        seq: req.through,
        ord: 0,
    };
    match seen.reset(js, through, &owner).await {
        Ok(seq) => {
            tracing::warn!(message = "Router fence reset by an operator.", share = %share, through = req.through, marker = seq);
            (
                StatusCode::OK,
                Json(json!({
                    "share": share.to_string(),
                    "through": req.through,
                    "replaced": in_place,
                })),
            )
                .into_response()
        }
        Err(e) => error(
            StatusCode::CONFLICT,
            format!("the fence moved while it was read; read it again: {e}"),
        ),
    }
}
