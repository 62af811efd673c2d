//! An operator's repair of a fence whose marker cannot be right: one whose claims
//! `worker/ownership/claims.rs` refuses (a watermark past the stream it covers, an epoch past
//! the leases bucket), so the router share or partition behind it is stalled in `/health`.
//!
//! - `POST /admin/router-fence`, body `{"share": "<source>/<n>", "through": N, "confirm":
//!   true}`: a router share's fence. The share's router raises again and routes from
//!   `N + 1`: inputs at or below `N` are not routed again, inputs above it are (the inbox's
//!   duplicate window and the partitions' dedupe markers drop what was already routed).
//!   `N` is required and at most the source's last sequence.
//! - `POST /admin/partition-fence`, body `{"partition": p, "through": N, "confirm": true}`:
//!   partition `p`'s fence in every stream its outputs go to. `N` (optional, at most the
//!   inbox's last sequence) says the outputs of inbox inputs up to `N` are stored: its next
//!   owner does not publish them again. Without it nothing is taken as stored: the owner
//!   publishes every record its outbox holds under its message id (the streams' duplicate
//!   windows drop the ones already stored).
//!
//! Without `confirm` nothing is done: the answer (400) shows each marker in place, the
//! covered stream's last sequence and what the reset would store. With it, a marker with
//! epoch 0 and the chosen watermark replaces each last one (compare-and-set on its
//! sequence, [`Fence`]'s `Observed::reset`); a holder still publishing under the old
//! marker is refused by the broker and raises again. 400 for an unknown share or partition
//! or `N` past the covered stream; 409 on a node that runs no sagas or when a marker moved
//! while it was read. Behind the admin token.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::operate::error;
use crate::broker::fence::{Fence, Observed, Position};
use crate::broker::stream_specs;
use crate::runtime::AppState;
use crate::worker::ownership::claims::last_sequence;
use crate::worker::ownership::router::share::Share;

/// A router share's reset.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ShareReset {
    share: String,
    through: u64,
    #[serde(default)]
    confirm: bool,
}

/// A partition's reset.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PartitionReset {
    partition: u32,
    #[serde(default)]
    through: Option<u64>,
    #[serde(default)]
    confirm: bool,
}

type Body<T> = Result<Json<T>, axum::extract::rejection::JsonRejection>;

/// `POST /admin/router-fence`.
pub(super) async fn reset_share(
    State(state): State<Arc<AppState>>,
    body: Body<ShareReset>,
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
    let target = Target {
        what: format!("router share {share}"),
        covers: share.stream().to_string(),
        fences: vec![(state.config.streams.saga_inbox.clone(), share.to_string())],
    };
    match target.reset(&state, Some(req.through), req.confirm).await {
        Ok(replaced) => ok(json!({
            "share": share.to_string(),
            "through": req.through,
            "replaced": replaced[0],
        })),
        Err(r) => r,
    }
}

/// `POST /admin/partition-fence`.
pub(super) async fn reset_partition(
    State(state): State<Arc<AppState>>,
    body: Body<PartitionReset>,
) -> Response {
    if !state.config.runner.mode.runs_sagas() {
        return error(StatusCode::CONFLICT, "partition fences are for saga nodes");
    }
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let count = state.config.partitions.count;
    if req.partition >= count {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "no partition {}; partitions are 0 to {}",
                req.partition,
                count - 1
            ),
        );
    }
    let inbox = state.config.streams.saga_inbox.clone();
    let fences = stream_specs(&state.config.streams)
        .into_iter()
        .filter(|s| s.fenced && s.name != inbox)
        .map(|s| (s.name, req.partition.to_string()))
        .collect();
    let target = Target {
        what: format!("partition {}", req.partition),
        covers: inbox,
        fences,
    };
    match target.reset(&state, req.through, req.confirm).await {
        Ok(replaced) => ok(json!({
            "partition": req.partition,
            "through": req.through,
            "replaced": replaced,
        })),
        Err(r) => r,
    }
}

/// The fences one reset replaces: `(stream, key)` pairs, whose watermarks count sequences of
/// `covers`.
struct Target {
    what: String,
    covers: String,
    fences: Vec<(String, String)>,
}

impl Target {
    /// Reads every fence; with `confirm`, replaces each marker by one of epoch 0 at
    /// `through`. The markers replaced, or the error answer.
    async fn reset(
        &self,
        state: &AppState,
        through: Option<u64>,
        confirm: bool,
    ) -> Result<Vec<Value>, Response> {
        let last = last_sequence(state, &self.covers).await.map_err(|e| {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot read {}: {e}", self.covers),
            )
        })?;
        if let Some(n) = through.filter(|n| *n > last) {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!(
                    "through {n} is past the last sequence of {} ({last})",
                    self.covers
                ),
            ));
        }
        let js = state.broker.jetstream();
        let mut seen: Vec<(Observed, Value)> = Vec::new();
        for (stream, key) in &self.fences {
            let o = Fence::observe(js, stream, key)
                .await
                .map_err(|e| error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
            let shown = json!({
                "stream": stream,
                "epoch": o.epoch(),
                "through": o.through().map(|t| t.seq),
            });
            seen.push((o, shown));
        }
        let in_place: Vec<Value> = seen.iter().map(|(_, v)| v.clone()).collect();
        if !confirm {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!(
                    "not confirmed: the markers of {} are {} and {} ends at {last}; with \
                     \"confirm\": true each is replaced by a marker with epoch 0 through {}",
                    self.what,
                    Value::Array(in_place),
                    self.covers,
                    through.map_or("nothing".to_string(), |n| n.to_string()),
                ),
            ));
        }
        let owner = format!("admin:{}", state.node_id);
        let at = through.map(|seq| Position { seq, ord: 0 });
        for (o, _) in seen {
            let stream = o.subject().to_string();
            match o.reset(js, at, &owner).await {
                Ok(seq) => {
                    tracing::warn!(message = "Fence reset by an operator.", fence = %stream, target = %self.what, through = ?through, marker = seq);
                }
                Err(e) => {
                    return Err(error(
                        StatusCode::CONFLICT,
                        format!("the fence {stream} moved while it was read; read it again: {e}"),
                    ));
                }
            }
        }
        Ok(in_place)
    }
}

fn ok(body: Value) -> Response {
    (StatusCode::OK, Json(body)).into_response()
}
