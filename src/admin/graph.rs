//! `GET /admin/graph?saga=S[&version=V]`: a loaded saga as states and labelled edges
//! ([`crate::manifest::graph::Diagram::to_json`]), which the admin page draws with the path an
//! instance took highlighted. Without `version`, the newest loaded one. 400 without `saga`,
//! 404 for a saga (or version) the manifests in force do not hold. Behind the admin token.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::operate::error;
use crate::manifest::graph::Diagram;
use crate::runtime::AppState;

/// The query string.
#[derive(Debug, Deserialize)]
pub(super) struct Params {
    saga: Option<String>,
    version: Option<u32>,
}

pub(super) async fn graph(State(state): State<Arc<AppState>>, Query(p): Query<Params>) -> Response {
    let Some(name) = p.saga.filter(|s| !s.is_empty()) else {
        return error(
            StatusCode::BAD_REQUEST,
            "give `saga` (and optionally `version`)",
        );
    };
    let catalog = state.catalog();
    let saga = match p.version {
        Some(v) => catalog.saga(&name, v),
        None => catalog.newest(&name),
    };
    match saga {
        Some(s) => (StatusCode::OK, Json(Diagram::of(s).to_json())).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            format!(
                "no saga `{name}`{} in the manifests in force",
                p.version
                    .map(|v| format!(" version {v}"))
                    .unwrap_or_default()
            ),
        ),
    }
}
