//! The admin API's operator routes over the node's own store: one instance with its timers
//! and recent transitions, and the dead letters — listed, shown, redriven. They are the
//! running node's side of `runner inspect` and `runner dlq`, and what the admin page calls.
//!
//! | route | answer |
//! |---|---|
//! | `GET /admin/instance?tenant=T&saga=S&id=C` | the `runner inspect` view; 404 when there is none |
//! | `GET /admin/dlq?[tenant=T][&all=true][&limit=N][&after=NEXT]` | one page of dead letters in key order — a tenant's oldest first, tenants by name — pending only unless `all`, at most `limit` (100; ≤ 1000): `{items, next?, total?, scanned, stopped_at?}` (`deadletter::page`) |
//! | `GET /admin/dlq/{tenant}/{id}` | one dead letter in full |
//! | `GET /admin/dlq/stream?[tenant=T][&limit=N][&after=NEXT]` | one page of the dead-letter stream's letters (effect commands refused by effect workers among them), newest first, at most `limit` (100; ≤ 1000): `{stream, items, next?, scanned, scanned_bytes, stopped_at?}` (`broker::dlq::recent`) |
//! | `POST /admin/dlq/{tenant}/{id}/redrive` | applies it again with the manifests in force, then what was held behind it; the redrive report |
//! | `POST /admin/dlq/stream/{tenant}/{seq}/redrive` | puts the effect command kept in letter `seq` of the dead-letter stream back on its subject and deletes the letter (see `broker::dlq::redrive`) |
//!
//! Guarantees: a listing reads one bounded page, never the whole table or stream: at most
//! `limit` + 1 stored letters and never more than 10 000 of them or 16 MiB
//! (`deadletter::SCAN_ENTRIES`, `SCAN_BYTES`), or 20 × `limit` stream messages and 16 MiB of
//! their payloads; filters apply while it reads, so one that matches nothing ends its page
//! there, with `next`. Its answer is at most 4 MiB (`deadletter::ANSWER_BYTES`): it holds
//! fewer than `limit` items, with `next` and `stopped_at: "answer_bytes"`, rather than pass
//! it; and each letter shows at most 4 KiB of its body (`body_stored_bytes` gives the whole
//! size, `cut: true` says something was cut; `GET /admin/dlq/{tenant}/{id}` shows it whole).
//! A page's `next` is opaque: pass it back as `after`; a tenant's `next` never reaches
//! another tenant's letters. `total` is given only when one page holds the whole listing.
//!
//! A redrive is applied once — the store marks the letter redriven in the same
//! transaction, so a second request for it is refused; a stream letter is republished under
//! a message id of its own and deleted — and redrives of both kinds share one rate limit per
//! node ([`REDRIVES_PER_SECOND`], 429 with `Retry-After` beyond it), so a script cannot turn
//! a dead-letter backlog into a burst against the saga worker. In partitioned mode the
//! partition's owner redrives the letter's key through a control input in its inbox (202;
//! `worker/control.rs`), so the redrive stays inside the partition's log and fences.
//! Behind the admin token like every `/admin/*` route.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use crate::broker::dlq::RedriveError;
use crate::deadletter::{self, DeadLetterError};
use crate::ops::{self, OpsError};
use crate::runtime::AppState;

/// Redrives one node accepts per second.
pub(super) const REDRIVES_PER_SECOND: u32 = 5;

/// An error answer: `{"error": message}` with `status` (the operator routes' one form).
pub(super) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

fn internal(e: impl std::fmt::Display) -> Response {
    error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// `GET /admin/instance` query.
#[derive(Debug, Deserialize)]
pub(super) struct InstanceParams {
    tenant: String,
    saga: String,
    id: String,
}

pub(super) async fn instance(
    State(state): State<Arc<AppState>>,
    Query(p): Query<InstanceParams>,
) -> Response {
    let store = state.store.clone();
    match tokio::task::spawn_blocking(move || ops::inspect(&store, &p.tenant, &p.saga, &p.id)).await
    {
        Ok(Ok(view)) => Json(view).into_response(),
        Ok(Err(e @ OpsError::NoInstance { .. })) => error(StatusCode::NOT_FOUND, e.to_string()),
        Ok(Err(e)) => internal(e),
        Err(e) => internal(e),
    }
}

/// `GET /admin/dlq` query.
#[derive(Debug, Deserialize)]
pub(super) struct ListParams {
    tenant: Option<String>,
    #[serde(default)]
    all: bool,
    limit: Option<usize>,
    after: Option<String>,
}

pub(super) async fn dlq_list(
    State(state): State<Arc<AppState>>,
    Query(p): Query<ListParams>,
) -> Response {
    let store = state.store.clone();
    let result = tokio::task::spawn_blocking(move || {
        deadletter::page(
            &store,
            &deadletter::Listing {
                tenant: p.tenant.as_deref(),
                all: p.all,
                after: p.after.as_deref(),
                limit: p.limit.unwrap_or(100),
            },
        )
    })
    .await;
    match result {
        Ok(Ok(page)) => Json(page).into_response(),
        Ok(Err(e @ DeadLetterError::BadQuery(_))) => error(StatusCode::BAD_REQUEST, e.to_string()),
        Ok(Err(e)) => internal(e),
        Err(e) => internal(e),
    }
}

pub(super) async fn dlq_show(
    State(state): State<Arc<AppState>>,
    Path((tenant, id)): Path<(String, u64)>,
) -> Response {
    let store = state.store.clone();
    match tokio::task::spawn_blocking(move || deadletter::show(&store, &tenant, id)).await {
        Ok(Ok(d)) => Json(d).into_response(),
        Ok(Err(e @ DeadLetterError::NotFound { .. })) => {
            error(StatusCode::NOT_FOUND, e.to_string())
        }
        Ok(Err(e)) => internal(e),
        Err(e) => internal(e),
    }
}

/// 429 with `Retry-After`: the redrive rate is used up.
fn too_many(wait: Duration) -> Response {
    let secs = wait.as_secs().max(1).to_string();
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::RETRY_AFTER, secs)],
        Json(json!({ "error": format!("at most {REDRIVES_PER_SECOND} redrives a second") })),
    )
        .into_response()
}

/// A token bucket: `REDRIVES_PER_SECOND` tokens, refilled continuously.
#[derive(Debug)]
pub(super) struct RedriveLimit(Mutex<(f64, Instant)>);

impl Default for RedriveLimit {
    fn default() -> Self {
        Self(Mutex::new((f64::from(REDRIVES_PER_SECOND), Instant::now())))
    }
}

impl RedriveLimit {
    /// Takes a token, or says how long until one is there.
    fn take(&self) -> Result<(), Duration> {
        let rate = f64::from(REDRIVES_PER_SECOND);
        let mut g = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (tokens, at) = &mut *g;
        *tokens = (*tokens + at.elapsed().as_secs_f64() * rate).min(rate);
        *at = Instant::now();
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / rate))
        }
    }
}

pub(super) async fn dlq_redrive(
    State(state): State<Arc<AppState>>,
    axum::Extension(limit): axum::Extension<Arc<RedriveLimit>>,
    Path((tenant, id)): Path<(String, u64)>,
) -> Response {
    if let Err(wait) = limit.take() {
        return too_many(wait);
    }
    redrive_in_partition(&state, tenant, id).await
}

/// `GET /admin/dlq/stream` query.
#[derive(Debug, Deserialize)]
pub(super) struct StreamParams {
    tenant: Option<String>,
    limit: Option<usize>,
    after: Option<String>,
}

pub(super) async fn dlq_stream(
    State(state): State<Arc<AppState>>,
    Query(p): Query<StreamParams>,
) -> Response {
    let limit = p.limit.unwrap_or(100);
    if limit == 0 || limit > deadletter::MAX_PAGE {
        return error(
            StatusCode::BAD_REQUEST,
            format!("`limit` must be 1 to {}", deadletter::MAX_PAGE),
        );
    }
    let after = match p.after.as_deref().map(crate::broker::dlq::parse_after) {
        None => None,
        Some(Some(seq)) => Some(seq),
        Some(None) => {
            return error(
                StatusCode::BAD_REQUEST,
                "`after` is not the `next` of an earlier page",
            );
        }
    };
    let stream = &state.config.streams.dead_letter;
    let js = state.broker.jetstream();
    match crate::broker::dlq::recent(js, stream, p.tenant.as_deref(), after, limit).await {
        Ok(page) => Json(page).into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

pub(super) async fn dlq_stream_redrive(
    State(state): State<Arc<AppState>>,
    axum::Extension(limit): axum::Extension<Arc<RedriveLimit>>,
    Path((tenant, seq)): Path<(String, u64)>,
) -> Response {
    if let Err(wait) = limit.take() {
        return too_many(wait);
    }
    let stream = &state.config.streams.dead_letter;
    match crate::broker::dlq::redrive(state.broker.jetstream(), stream, &tenant, seq).await {
        Ok(done) => {
            tracing::info!(message = "Effect command redriven from the dead-letter stream.", tenant = %tenant, seq, subject = %done.subject, duplicate = done.duplicate);
            Json(done).into_response()
        }
        Err(e @ RedriveError::BadTenant(_)) => error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e @ RedriveError::NotFound { .. }) => error(StatusCode::NOT_FOUND, e.to_string()),
        Err(e @ RedriveError::Broker(_)) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        Err(e) => error(StatusCode::CONFLICT, e.to_string()),
    }
}

/// The letter's key is redriven by its partition's owner, through a
/// control input in the partition's inbox (`worker/control.rs`), so the redrive happens in
/// log order inside the owner's commit. This node must own the partition: its copy of the
/// letter is the one in force.
async fn redrive_in_partition(state: &Arc<AppState>, tenant: String, id: u64) -> Response {
    let store = state.store.clone();
    let (t, i) = (tenant.clone(), id);
    let found = tokio::task::spawn_blocking(move || {
        store.read_blocking(|tx| {
            let Some(d) = tx.dead_letter(&t, i)? else {
                return Ok(None);
            };
            let parks = tx.parks_its_key(&d)?;
            Ok(Some((d, parks)))
        })
    })
    .await;
    let (letter, parks) = match found {
        Ok(Ok(Some(v))) => v,
        Ok(Ok(None)) => {
            return error(
                StatusCode::NOT_FOUND,
                format!("no dead letter {id} for tenant `{tenant}`"),
            );
        }
        Ok(Err(e)) => return internal(e),
        Err(e) => return internal(e),
    };
    let (Some(saga), Some(corr)) = (letter.saga.clone(), letter.correlation_id.clone()) else {
        return error(
            StatusCode::CONFLICT,
            format!(
                "dead letter {id} names no saga instance, so it belongs to no partition; \
                 republish its input from {} instead",
                letter.source
            ),
        );
    };
    if letter.status != crate::storage::tables::DeadLetterStatus::Pending || !parks {
        return error(
            StatusCode::CONFLICT,
            format!("dead letter {id} is not the pending letter its key is parked behind"),
        );
    }
    let p =
        crate::worker::partition::partition(&tenant, &saga, &corr, state.config.partitions.count);
    if !state.placement.owns(p) {
        return error(
            StatusCode::CONFLICT,
            format!("this node does not own partition {p} of dead letter {id}; ask its owner"),
        );
    }
    let body = json!({ "redrive": { "tenant": tenant, "saga": saga, "correlation_id": corr } });
    match crate::worker::control::send(state, &tenant, &body, [p]).await {
        Ok(()) => {
            tracing::info!(
                message = "Dead letter redrive sent to its partition.",
                id,
                partition = p
            );
            (
                StatusCode::ACCEPTED,
                Json(json!({ "id": id, "partition": p, "sent": true })),
            )
                .into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}
