//! Pausing and resuming a tenant through the admin API (the node's side of
//! `runner tenants`; the mechanism and its guarantees are `worker/pause.rs`).
//!
//! | route | answer |
//! |---|---|
//! | `POST /admin/tenants/{tenant}/pause` | pauses the tenant on every saga node: `{tenant, paused: true}` |
//! | `POST /admin/tenants/{tenant}/resume` | resumes it: the resume is sent to every partition, whose owner releases what it held |
//! | `GET /admin/tenants/paused` | the tenants this node holds inputs for now |
//! | `GET /admin/tenants` | every tenant known here: its running saga instances in the partitions this node owns, its cap on them and the inputs held at it, new inputs waiting at this node's routers, the oldest's wait, inputs let in, weight, rate limits, paused |
//! | `POST /admin/tenants/reload` | re-reads the config file's `[tenancy]` limits (weights, rate limits, effect rate limits) and puts them in force; 422 naming the file, line and key when invalid |
//!
//! Only a node that runs the saga worker answers pause and resume (409 otherwise); every node
//! reloads its limits. A tenant the control bucket cannot
//! key (anything but ASCII letters, digits, `-`, `_`, `=`, `/`; `worker::control::pausable`)
//! is answered 400 naming that rule. Behind the admin token.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::operate::error;
use crate::runtime::AppState;
use crate::worker::control::{self as pause, PauseError};

fn refused(e: PauseError) -> Response {
    match e {
        PauseError::BadTenant(_) => error(StatusCode::BAD_REQUEST, e.to_string()),
        PauseError::Broker(_) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        PauseError::Storage(_) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn runs_sagas(state: &AppState) -> Option<Response> {
    (!state.config.runner.mode.runs_sagas()).then(|| {
        error(
            StatusCode::CONFLICT,
            "this node runs no saga worker; ask a saga or combined node",
        )
    })
}

pub(super) async fn pause_tenant(
    State(state): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Response {
    // The tenant was checked by the route layer (`admin/mod.rs`, 400 naming the rule).
    if let Some(r) = runs_sagas(&state) {
        return r;
    }
    match pause::pause(&state, &tenant).await {
        Ok(()) => Json(json!({ "tenant": tenant, "paused": true })).into_response(),
        Err(e) => refused(e),
    }
}

pub(super) async fn resume_tenant(
    State(state): State<Arc<AppState>>,
    Path(tenant): Path<String>,
) -> Response {
    // The tenant was checked by the route layer (`admin/mod.rs`, 400 naming the rule).
    if let Some(r) = runs_sagas(&state) {
        return r;
    }
    match pause::resume(&state, &tenant).await {
        Ok(done) => Json(done).into_response(),
        Err(e) => refused(e),
    }
}

/// `POST /admin/tenants/reload`: re-reads the node's config file and puts its `[tenancy]`
/// limits in force (`crate::quota`); 200 with the keys changed and those that wait for a
/// restart, 422 naming the file, line and key of what is wrong (the limits in force stay).
pub(super) async fn reload(State(state): State<Arc<AppState>>) -> Response {
    let s = state.clone();
    match tokio::task::spawn_blocking(move || s.reload_tenancy()).await {
        Ok(Ok(changed)) => Json(json!({
            "status": "applied",
            "applied": changed.applied,
            "at_next_start": changed.restart,
            "warnings": changed.warnings,
        }))
        .into_response(),
        Ok(Err(e)) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({
                "status": "rejected",
                "reason": "the config is invalid; the limits in force stay",
                "error": e.to_string(),
            })),
        )
            .into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reload failed: {e}"),
        ),
    }
}

/// `GET /admin/tenants`: every tenant this node knows of — with running instances in the
/// partitions it owns, seen at its routers, named in `[tenancy]`, or paused — with those
/// instances, what waits, what went in, its weight, rate limit and pause.
pub(super) async fn list(State(state): State<Arc<AppState>>) -> Response {
    let tenancy = state.limits.get();
    let usage = state.tenants.snapshot();
    let paused = state.paused.get();
    let (live, held) = if state.config.runner.mode.runs_sagas() {
        let owned = state.placement.owned();
        let read = state
            .store
            .read(move |t| {
                let mine = |p| owned.contains_key(&p);
                Ok((t.counts_by_tenant(mine)?, t.capped_by_tenant(mine)?))
            })
            .await;
        match read {
            Ok(both) => both,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    } else {
        Default::default()
    };
    let mut names: std::collections::BTreeSet<String> = usage.keys().cloned().collect();
    names.extend(live.keys().cloned());
    names.extend(held.keys().cloned());
    names.extend(tenancy.live_instance_caps.keys().cloned());
    names.extend(tenancy.pending_timer_caps.keys().cloned());
    names.extend(tenancy.outbox_byte_caps.keys().cloned());
    names.extend(state.relays.bytes_by_tenant().into_keys());
    names.extend(tenancy.weights.keys().cloned());
    names.extend(tenancy.rate_limits.keys().cloned());
    names.extend(tenancy.effect_rate_limits.keys().cloned());
    names.extend(tenancy.allowed.iter().cloned());
    names.extend(paused.iter().cloned());
    let tenants: Vec<_> = names
        .iter()
        .map(|t| {
            let u = usage.get(t).cloned().unwrap_or_default();
            json!({
                "tenant": t,
                "live_instances": live.get(t).map_or(0, |c| c.live),
                "live_instance_cap": tenancy.live_instance_caps.get(t),
                "pending_timers": live.get(t).map_or(0, |c| c.timers),
                "pending_timer_cap": tenancy.pending_timer_caps.get(t),
                // The deployment's, as its cap counts them: this node's exact, the others'
                // as their last heartbeats said.
                "outbox_bytes": state.relays.deployment_bytes(t),
                "outbox_byte_cap": tenancy.outbox_byte_caps.get(t).map(|c| c.get()),
                "held_at_cap": held.get(t).map_or(0, |h| h.inputs),
                "waiting_inputs": u.waiting_inputs,
                "oldest_wait_s": u.oldest_wait_s,
                "inputs_let_in": u.inputs_let_in,
                "weight": tenancy.weights.get(t).copied().unwrap_or(1),
                "rate_limit_per_s": tenancy.rate_limits.get(t),
                "effect_rate_limits_per_s": tenancy.effect_rate_limits.get(t),
                "paused": paused.contains(t),
            })
        })
        .collect();
    let paused: Vec<&String> = paused.iter().collect();
    Json(json!({ "tenants": tenants, "paused": paused })).into_response()
}

pub(super) async fn paused(State(state): State<Arc<AppState>>) -> Response {
    let paused: Vec<String> = state.paused.get().iter().cloned().collect();
    Json(json!({ "paused": paused })).into_response()
}
