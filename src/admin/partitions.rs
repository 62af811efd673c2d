//! `POST /admin/partitions/{p}/replay`: an operator's replay of partition `p` from an inbox
//! sequence (the mechanism and what it applies again: `worker/replay.rs`).
//!
//! Body `{"from": N, "confirm": true}`. Without `confirm` nothing is done: the answer (400)
//! says what the replay would read again and what it would apply again. 409 when the node
//! is not partitioned or does not own `p` (ask the owner: `/info` lists what each node
//! holds); 400 when `from` is 0 or lies past the checkpoint + 1 (a replay only goes back).
//! 202 once the partition's loop has been asked; it replays between two batches. Behind the
//! admin token.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::operate::error;
use crate::runtime::AppState;
use crate::worker::ownership::partition_checkpoint;

fn answer(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

pub(super) async fn replay(
    State(state): State<Arc<AppState>>,
    Path(p): Path<u32>,
    body: Option<Json<Value>>,
) -> Response {
    if !state.config.runner.mode.runs_sagas() {
        return error(StatusCode::CONFLICT, "replay is for saga nodes");
    }
    let count = state.config.partitions.count;
    if p >= count {
        return error(
            StatusCode::BAD_REQUEST,
            format!("partition {p} does not exist (partitions.count is {count})"),
        );
    }
    if !state.placement.owns(p) {
        return error(
            StatusCode::CONFLICT,
            format!("this node does not own partition {p}; ask its owner"),
        );
    }
    let body = body.map(|Json(b)| b).unwrap_or(Value::Null);
    let Some(from) = body.get("from").and_then(Value::as_u64).filter(|f| *f > 0) else {
        return error(
            StatusCode::BAD_REQUEST,
            "body must be {\"from\": <inbox sequence, 1 or more>, \"confirm\": true}",
        );
    };
    let key = partition_checkpoint(&state, p);
    let checkpoint = match state.store.read(move |t| t.checkpoint(&key)).await {
        Ok(c) => c,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    if from > checkpoint + 1 {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "partition {p} has applied its inbox through sequence {checkpoint}; a replay \
                 from {from} would skip inputs (it only goes back)"
            ),
        );
    }
    if body.get("confirm").and_then(Value::as_bool) != Some(true) {
        return answer(
            StatusCode::BAD_REQUEST,
            json!({
                "error": "not confirmed: repeat with \"confirm\": true",
                "partition": p,
                "from": from,
                "checkpoint": checkpoint,
                "would": format!(
                    "read partition {p}'s inbox again from sequence {from} through \
                     {checkpoint} and on; events already applied (by id), answered effect \
                     results and fired timers are skipped and published outputs are not sent \
                     again, but an input without an event id, or older than \
                     saga.dedupe_retention, is applied again"
                ),
            }),
        );
    }
    state.replays.request(p, from);
    tracing::warn!(
        message = "Partition replay requested.",
        partition = p,
        from_sequence = from,
        checkpoint
    );
    answer(
        StatusCode::ACCEPTED,
        json!({ "partition": p, "from": from, "checkpoint_before": checkpoint }),
    )
}
