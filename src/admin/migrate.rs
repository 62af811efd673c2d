//! `POST /admin/migrate`: the admin API's twin of `runner migrate`, run by the node with the
//! manifests it has loaded (both versions must be in force).
//!
//! Body: `{"tenant": T, "saga": S, "from": N, "dry_run": false}`. Answers 200 with the
//! migration report (see [`crate::ops::migrate`]), 400 naming what is wrong (a missing
//! field, a version N+1 not loaded with a migration from N). In partitioned mode the node
//! migrates only the instances of the partitions it owns (`elsewhere` counts the others):
//! call it on every node, or again after a rebalance, until `migrated` is 0 everywhere.
//! Behind the admin token like every `/admin/*` route.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::ops::OpsError;
use crate::ops::migrate::migrate_instances;
use crate::runtime::AppState;
use crate::saga::Instance;

/// The request body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Body {
    tenant: String,
    saga: String,
    from: u32,
    #[serde(default)]
    dry_run: bool,
}

pub(super) async fn migrate(
    State(state): State<Arc<AppState>>,
    body: Result<Json<Body>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(b) = match body {
        Ok(b) => b,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({ "error": e.body_text() })),
            )
                .into_response();
        }
    };
    if let Some(refused) = super::refuse_tenant(&b.tenant) {
        return refused;
    }
    let catalog = state.catalog();
    let st = state.clone();
    let result = tokio::task::spawn_blocking(move || {
        let parts = &st.config.partitions;
        let here = |i: &Instance| {
            st.placement.owns(crate::worker::partition::partition(
                &i.tenant,
                &i.saga,
                &i.correlation_id,
                parts.count,
            ))
        };
        migrate_instances(
            &st.store, &catalog, &b.tenant, &b.saga, b.from, b.dry_run, &here,
        )
    })
    .await;
    match result {
        Ok(Ok(report)) => {
            tracing::info!(
                message = "Instances migrated.",
                tenant = %report.tenant,
                saga = %report.saga,
                from = report.from,
                migrated = report.migrated,
                failed = report.failed.len(),
                dry_run = report.dry_run
            );
            Json(report).into_response()
        }
        Ok(Err(OpsError::BadQuery(why))) => {
            (StatusCode::BAD_REQUEST, Json(json!({ "error": why }))).into_response()
        }
        Ok(Err(e)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({ "error": e.to_string() })),
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({ "error": e.to_string() })),
        )
            .into_response(),
    }
}
