//! `GET /admin/instances`: one page of a tenant's saga instances, the admin API's twin of
//! `runner instances list` (both are [`crate::ops::list_instances`]).
//!
//! Query: `tenant` and `saga` (required), `state`, `older_than` (a duration: `90s`, `15m`,
//! `2h`, `7d`), `limit` (1–1000, default 100), `after` (the `next` of the previous page).
//! Answers 200 with `{tenant, saga, items: [...], next?}`, oldest first; 400 naming the
//! parameter that is wrong. Behind the admin token like every `/admin/*` route.
//!
//! Guarantees: a listing names one tenant and reads only that tenant's index entries, so a
//! query for tenant A never returns B's instances, whatever `after` says; in partitioned
//! mode it returns only instances of partitions this node owns (a stale copy of a
//! partition it gave up is counted in `elsewhere`, not shown).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::ops::{self, OpsError};
use crate::runtime::AppState;

/// The query string.
#[derive(Debug, Deserialize)]
pub(super) struct Params {
    tenant: Option<String>,
    saga: Option<String>,
    state: Option<String>,
    older_than: Option<String>,
    limit: Option<usize>,
    after: Option<String>,
}

fn bad(message: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({ "error": message.into() })),
    )
        .into_response()
}

pub(super) async fn list(State(state): State<Arc<AppState>>, Query(p): Query<Params>) -> Response {
    let (Some(tenant), Some(saga)) = (p.tenant, p.saga) else {
        return bad("`tenant` and `saga` are required");
    };
    let older_than_ms = match p.older_than.as_deref().map(humantime::parse_duration) {
        None => None,
        Some(Ok(d)) => Some(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        Some(Err(_)) => return bad("`older_than` is not a duration (e.g. `15m`, `2h`, `7d`)"),
    };
    let st = state.clone();
    let result = tokio::task::spawn_blocking(move || {
        let parts = &st.config.partitions;
        let here = |i: &crate::saga::Instance| {
            st.placement.owns(crate::worker::partition::partition(
                &i.tenant,
                &i.saga,
                &i.correlation_id,
                parts.count,
            ))
        };
        ops::list_instances(
            &st.store,
            &ops::Listing {
                tenant: &tenant,
                saga: &saga,
                state: p.state.as_deref(),
                older_than_ms,
                after: p.after.as_deref(),
                limit: p.limit.unwrap_or(100),
            },
            &here,
        )
    })
    .await;
    match result {
        Ok(Ok(page)) => Json(page).into_response(),
        Ok(Err(OpsError::BadQuery(why))) => bad(why),
        Ok(Err(e)) => {
            tracing::warn!(message = "Listing instances failed.", error = %e);
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({ "error": e.to_string() })),
            )
                .into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({ "error": e.to_string() })),
        )
            .into_response(),
    }
}
