//! The admin HTTP server (axum).
//!
//! | route | answer |
//! |---|---|
//! | `GET /health` | 200 when NATS answers a JetStream round trip within 2 s and storage answers, else 503; JSON either way, `status` `degraded` (still 200) while outputs the broker can never take are parked, a relay or router has failed on every attempt for 30 s (`stalled`), or storage writes fail (`storage.ok` false, `storage.write_failing` true, `storage.error` the reason — "the disk holding `<data_dir>` is full (ENOSPC)" for a full disk — until a write commits: a restart would not free the disk, and the node goes on by itself) |
//! | `GET /ready` | 200 when started and not draining, else 503 |
//! | `GET /metrics` | Prometheus text |
//! | `GET /admin/ui` | the admin page (static, embedded; it holds no data and asks the API below for everything, with the token the operator types in) |
//! | `GET /info` | JSON: version, revision, mode, node id, manifests, streams, consumers, partitions owned with epochs, router shares held (`<source>/<share>`), `saga_progress` (`progress.rs`) |
//! | `POST /admin/drain` | begins the drain (202); the process exits when drained |
//! | `POST /admin/reload` | re-reads the manifests; 200 when swapped in, 422 with every problem when rejected (the old ones stay) |
//! | `GET /admin/instances` | one page of a tenant's instances of a saga by state and age (see `instances.rs`) |
//! | `GET /admin/instance`, `GET /admin/dlq`, `GET /admin/dlq/{tenant}/{id}`, `POST /admin/dlq/{tenant}/{id}/redrive` | one instance; dead letters listed one bounded page at a time (`after=NEXT`), shown whole, redriven, rate-limited (see `operate.rs`) |
//! | `GET /admin/dlq/stream`, `POST /admin/dlq/stream/{tenant}/{seq}/redrive` | the dead-letter stream's letters (refused effect commands among them) listed one bounded page at a time and redriven once (see `operate.rs`) |
//! | `POST /admin/tenants/{tenant}/pause`, `…/resume`, `GET /admin/tenants/paused` | a tenant's inputs held, then released in order (see `tenants.rs`) |
//! | `GET /admin/tenants` | each tenant's new inputs waiting, the oldest's wait, what went in, weight, rate limits, pause |
//! | `POST /admin/tenants/reload` | the config file's `[tenancy]` limits re-read and put in force (see `tenants.rs`) |
//! | `POST /admin/partitions/{p}/replay` | `{"from", "confirm"}`: the owner reads partition `p`'s inbox again from `from` (see `partitions.rs`) |
//! | `GET /admin/graph?saga=S[&version=V]` | a loaded saga as states and labelled edges, for the admin page's diagram (see `graph.rs`) |
//! | `POST /admin/router-fence` | `{"share", "through", "confirm"}`: replaces a router share's fence marker (one whose watermark the share refuses) so the share routes from `through + 1` (see `fences.rs`) |
//! | `POST /admin/partition-fence` | `{"partition", "through"?, "confirm"}`: replaces partition `p`'s fence markers (ones whose epoch or watermark the partition refuses) so it can be taken again (see `fences.rs`) |
//! | `POST /admin/migrate` | `{"tenant", "saga", "from", "dry_run"}`: migrates instances to the next version (see `migrate.rs`) |
//! | `POST /admin/node-mode` | `{"mode": "full" \| "router_only" \| "disabled"}`: what this replica takes part in (partitioned mode) |
//!
//! The dead-letter listings (`/admin/dlq`, `/admin/dlq/stream`) answer one page whose cost is
//! bounded whatever is stored — entries read, bytes read, bytes answered (4 MiB), bytes shown
//! per letter — and a `next` to pass back as `after`, as `/admin/instances` pages its index;
//! none reads a whole table or stream in one call.
//!
//! A tenant given to a tenant-scoped route (`{tenant}` in the path, `tenant` in the query or
//! the migrate body) that cannot be a tenant (NUL, whitespace, `.`, `*`, `>`, over 128
//! bytes: `worker::admission::is_tenant`) is answered 400 naming the rule, in one place
//! (`tenant_guard`), before the route runs.
//!
//! When `admin.token` (or `admin.token_file`) is set, `/admin/*` requires
//! `Authorization: Bearer <token>`, compared in constant time; without it the answer is 401,
//! and `/info` shows only version, mode and readiness. A token is mandatory whenever
//! `admin.addr` is not a loopback address (configuration validation refuses otherwise); on
//! loopback without one the start-up log says the admin API is open. The probes and
//! `/metrics` stay open so orchestrators and scrapers need no secret (metrics carry no
//! tenant data or secrets). The listener caps open connections and times out idle and
//! long-lived ones (`guard.rs`); at the cap a new connection takes the slot of the one that
//! has waited longest without a request in flight, so slow or idle connections filling the
//! cap cannot starve the probes.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::placement::NodeMode;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod client;
mod fences;
mod graph;
mod guard;
mod instances;
mod migrate;
mod operate;
mod partitions;
mod progress;
mod tenants;
pub(crate) mod tls;

use crate::broker::stream_specs;
use crate::config::redact_url;
use crate::runtime::{AppState, GIT_REVISION, ReloadOutcome, VERSION};

/// Builds the router. `token` is the bearer token required on `/admin/*`, if any.
pub fn router(state: Arc<AppState>, token: Option<String>) -> Router {
    let token = Arc::new(token);
    let admin = Router::new()
        .route("/admin/drain", post(drain))
        .route("/admin/reload", post(reload))
        .route("/admin/node-mode", post(node_mode))
        .route("/admin/instances", get(instances::list))
        .route("/admin/migrate", post(migrate::migrate))
        .route("/admin/instance", get(operate::instance))
        .route("/admin/graph", get(graph::graph))
        .route("/admin/dlq", get(operate::dlq_list))
        .route("/admin/dlq/stream", get(operate::dlq_stream))
        .route(
            "/admin/dlq/stream/{tenant}/{seq}/redrive",
            post(operate::dlq_stream_redrive),
        )
        .route("/admin/partitions/{p}/replay", post(partitions::replay))
        .route("/admin/router-fence", post(fences::reset_share))
        .route("/admin/partition-fence", post(fences::reset_partition))
        .route("/admin/tenants", get(tenants::list))
        .route("/admin/tenants/paused", get(tenants::paused))
        .route("/admin/tenants/reload", post(tenants::reload))
        .route("/admin/tenants/{tenant}/pause", post(tenants::pause_tenant))
        .route(
            "/admin/tenants/{tenant}/resume",
            post(tenants::resume_tenant),
        )
        .route("/admin/dlq/{tenant}/{id}", get(operate::dlq_show))
        .route(
            "/admin/dlq/{tenant}/{id}/redrive",
            post(operate::dlq_redrive),
        )
        .route_layer(middleware::from_fn(tenant_guard))
        .layer(axum::Extension(Arc::new(operate::RedriveLimit::default())))
        .layer(middleware::from_fn_with_state(token.clone(), require_token));
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/info", get(info))
        .route("/admin/ui", get(ui))
        .layer(axum::Extension(token))
        .merge(admin)
        .with_state(state)
}

/// Whether `headers` carry the bearer token (always true when none is configured).
fn authorized(token: &Option<String>, headers: &HeaderMap) -> bool {
    let Some(expected) = token else {
        return true;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    constant_time_eq(given.as_bytes(), expected.as_bytes())
}

/// Serves the admin router on `listener` until `stop` is cancelled.
///
/// With `tls` (made at start by [`tls::acceptor`] from `admin.tls_cert_file` and
/// `admin.tls_key_file`) every connection is TLS; without it, plain HTTP.
pub async fn serve(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<AppState>,
    stop: CancellationToken,
) {
    let token = match admin_token(&state) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(message = "Cannot read admin token file; admin endpoints stay locked.", error = %e);
            // Fail closed: an unguessable token nobody knows.
            Some(uuid::Uuid::new_v4().to_string() + &uuid::Uuid::new_v4().to_string())
        }
    };
    if token.is_none() {
        tracing::warn!(message = "The admin API is open: no admin.token is set. It listens on a loopback address only, so only this host can drain or reload the node.", addr = %state.config.admin.addr);
    }
    let a = &state.config.admin;
    let listener = guard::Guarded::new(
        listener,
        tls,
        guard::Limits {
            max_connections: a.max_connections,
            idle: a.idle_timeout.get(),
            lifetime: a.connection_timeout.get(),
        },
        guard::Counters {
            open: state.metrics.admin_connections.clone(),
            evicted: state.metrics.admin_connections_evicted.clone(),
            refused: state.metrics.admin_connections_refused.clone(),
        },
    );
    // Each request is marked in flight on its connection, which keeps the connection from
    // being evicted at the cap meanwhile (`guard.rs`).
    let app = router(state, token)
        .layer(middleware::from_fn(guard::track))
        .into_make_service_with_connect_info::<guard::Slot>();
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
    {
        tracing::error!(message = "Admin server failed.", error = %e);
    }
}

fn admin_token(state: &AppState) -> std::io::Result<Option<String>> {
    if let Some(t) = &state.config.admin.token {
        return Ok(Some(t.clone()));
    }
    match &state.config.admin.token_file {
        Some(p) => Ok(Some(std::fs::read_to_string(p)?.trim().to_string())),
        None => Ok(None),
    }
}

pub use crate::seal::constant_time_eq;

async fn require_token(
    State(token): State<Arc<Option<String>>>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    {
        if !authorized(&token, &headers) {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                Json(json!({"error": "a valid bearer token is required"})),
            )
                .into_response();
        }
    }
    next.run(req).await
}

/// Refuses a route's tenant — a `{tenant}` in its path or a `tenant` in its query — that
/// cannot be a tenant ([`is_tenant`](crate::worker::admission::is_tenant)) before the route
/// runs: 400 naming the rule, never a lookup under an impossible key nor a broker error. The
/// one check of every tenant-scoped route but `POST /admin/migrate`, whose tenant is in the
/// body (it calls [`refuse_tenant`]). Behind the token check.
async fn tenant_guard(req: Request, next: Next) -> Response {
    use axum::extract::{FromRequestParts, Query, RawPathParams};
    let (mut parts, body) = req.into_parts();
    let mut given: Vec<String> = Vec::new();
    if let Ok(params) = RawPathParams::from_request_parts(&mut parts, &()).await {
        given.extend(
            params
                .iter()
                .filter(|(k, _)| *k == "tenant")
                .map(|(_, v)| v.to_string()),
        );
    }
    // A query that does not parse is the route's own 400.
    if let Ok(Query(q)) = Query::<Vec<(String, String)>>::try_from_uri(&parts.uri) {
        given.extend(q.into_iter().filter(|(k, _)| k == "tenant").map(|(_, v)| v));
    }
    if let Some(refused) = given.iter().find_map(|t| refuse_tenant(t)) {
        return refused;
    }
    next.run(Request::from_parts(parts, body)).await
}

/// The 400 answer naming the rule when `tenant` cannot be a tenant; `None` for a tenant.
fn refuse_tenant(tenant: &str) -> Option<Response> {
    use crate::worker::admission::{TENANT_RULE, shown_tenant};
    let problem = crate::subject::check(tenant, crate::subject::Rule::TENANT).err()?;
    Some(operate::error(
        StatusCode::BAD_REQUEST,
        format!(
            "`tenant` must be a name: {problem}; {TENANT_RULE}; given `{}` ({} bytes)",
            shown_tenant(tenant),
            tenant.len()
        ),
    ))
}

/// How long `/health` waits for NATS to answer a round trip.
const NATS_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

async fn health(State(state): State<Arc<AppState>>) -> Response {
    // A connected socket is not enough: a frozen server keeps it open. Ask JetStream a
    // question (its account info) and require an answer in time.
    let answered = state.broker.is_connected()
        && tokio::time::timeout(NATS_PROBE_TIMEOUT, state.broker.jetstream().query_account())
            .await
            .is_ok_and(|r| r.is_ok());
    let nats_ok = answered;
    state.metrics.nats_connected.set(i64::from(nats_ok));
    let storage = state.store.check().await;
    let writes = storage_writes(&state);
    let mut storage_json = match &storage {
        Ok(stats) => {
            json!({
                "ok": true,
                "entries": stats.entries,
                "map_size_bytes": stats.map_size,
                "page_size_bytes": stats.page_size,
                "write_failing": false,
            })
        }
        Err(e) => json!({"ok": false, "error": e.to_string(), "write_failing": false}),
    };
    if let Some(f) = &writes {
        // A store that reads but cannot write: the last write transaction failed.
        storage_json["ok"] = json!(false);
        storage_json["write_failing"] = json!(true);
        storage_json["disk_full"] = json!(f.disk_full);
        storage_json["failed_writes"] = json!(f.failed_writes);
        storage_json["failing_for_seconds"] = json!(f.since.elapsed().as_secs());
        if storage.is_ok() {
            storage_json["error"] = json!(f.error);
        }
    }
    let ok = nats_ok && storage.is_ok();
    // Parked outputs do not make the node unavailable (a restart would not help), but an
    // operator must look at them: the node reports itself degraded until they are handled.
    // Nor does a relay or router that has failed on every attempt for a while (a record
    // refused for a reason Runner does not know to park, a stream it cannot write): the
    // node is connected, but its outputs do not move. Nor do failing storage writes (a full
    // disk): a restart would not free the disk, every input stays in its stream and the node
    // goes on by itself once a commit succeeds.
    let parked = state.metrics.relay_parked.get();
    let stalled = stalled_stages(&state.metrics);
    let status = match (ok, parked > 0 || !stalled.is_empty() || writes.is_some()) {
        (false, _) => "unavailable",
        (true, false) => "ok",
        (true, true) => "degraded",
    };
    let body = json!({
        "status": status,
        "nats": {"ok": nats_ok, "state": state.broker.state_text()},
        "storage": storage_json,
        "relay": {"parked_outputs": parked},
        "stalled": stalled
            .iter()
            .map(|(stage, d, why)| json!({"stage": stage, "seconds": d.as_secs(), "last_error": why}))
            .collect::<Vec<_>>(),
    });
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// The store's write failure, if its writes fail now; also sets the storage write metrics.
fn storage_writes(state: &AppState) -> Option<crate::storage::WriteFailure> {
    let failing = state.store.write_failure();
    state
        .metrics
        .storage_writes(failing.is_some(), state.store.write_failures());
    failing
}

/// The stalled stages (`telemetry::stall`), also set on their gauge.
fn stalled_stages(
    metrics: &crate::telemetry::Metrics,
) -> Vec<(String, std::time::Duration, String)> {
    let stalled = metrics
        .stalls
        .stalled(crate::telemetry::stall::STALLED_AFTER);
    metrics.pipeline_stalled.set(stalled.len() as i64);
    stalled
}

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let lc = &state.lifecycle;
    if lc.is_ready() {
        (StatusCode::OK, Json(json!({"ready": true}))).into_response()
    } else {
        let reason = if lc.is_draining() {
            "draining"
        } else {
            "starting"
        };
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"ready": false, "reason": reason})),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    state
        .metrics
        .nats_connected
        .set(i64::from(state.broker.is_connected()));
    stalled_stages(&state.metrics);
    storage_writes(&state);
    match state.store.run(|s| s.pages_dirtied()).await {
        Ok(n) => state.metrics.store_pages_dirtied_upto(n),
        Err(e) => tracing::debug!(message = "Cannot read the store's page counters.", error = %e),
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}

async fn info(
    State(state): State<Arc<AppState>>,
    axum::Extension(token): axum::Extension<Arc<Option<String>>>,
    headers: HeaderMap,
) -> Response {
    let cfg = &state.config;
    let mode = cfg.runner.mode;
    if !authorized(&token, &headers) {
        // What probes and dashboards need, nothing about data, tenants or manifests.
        let lc = &state.lifecycle;
        return Json(json!({
            "version": VERSION,
            "revision": GIT_REVISION,
            "mode": mode.as_str(),
            "ready": lc.is_ready(),
            "draining": lc.is_draining(),
            "full_view": "send the admin bearer token",
        }))
        .into_response();
    }
    let progress = progress::saga_progress(&state).await;
    let streams: Vec<_> = stream_specs(&cfg.streams)
        .into_iter()
        .map(|s| json!({"name": s.name, "subjects": s.subjects}))
        .collect();
    let started = state
        .started_at
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    Json(json!({
        "version": VERSION,
        "git_revision": GIT_REVISION,
        "mode": mode.as_str(),
        "roles": {"saga": mode.runs_sagas(), "effect": mode.runs_effects()},
        "node_id": state.node_id,
        "started_at_ms": started,
        "ready": state.lifecycle.is_ready(),
        "draining": state.lifecycle.is_draining(),
        "sealed": state.seal.enabled(),
        "manifests": state.catalog().summary(),
        "nats": {"urls": cfg.nats.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>(), "connected": state.broker.is_connected()},
        "streams": streams,
        "consumers": {"saga": cfg.consumers.saga, "effect": cfg.consumers.effect},
        "saga_progress": progress,
        "partitions": {
            "count": cfg.partitions.count,
            "node_mode": state.placement.mode().as_str(),
            "owned": state.placement.owned(),
            "routing": state.placement.routing(),
        },
        "tenancy": {"default_tenant": cfg.tenancy.default_tenant, "allowed": cfg.tenancy.allowed},
        "storage": {"path": state.store.path().display().to_string(), "durability": cfg.storage.durability},
    }))
    .into_response()
}

/// The admin page: one static document compiled into the binary. It carries no data, so it
/// is served without the token; every call it makes sends the token the operator typed.
async fn ui() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; frame-ancestors 'none'",
            ),
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        include_str!("ui/index.html"),
    )
        .into_response()
}

async fn drain(State(state): State<Arc<AppState>>) -> Response {
    let first = state.lifecycle.begin_drain("admin request");
    (
        StatusCode::ACCEPTED,
        Json(json!({"draining": true, "already": !first})),
    )
        .into_response()
}

async fn reload(State(state): State<Arc<AppState>>) -> Response {
    match state.reload_manifests().await {
        ReloadOutcome::Applied { catalog, warnings } => (
            StatusCode::OK,
            Json(json!({
                "status": "applied",
                "manifests": catalog.summary(),
                "warnings": warnings.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
            })),
        )
            .into_response(),
        ReloadOutcome::Rejected { diagnostics } => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({
                "status": "rejected",
                "reason": "the manifests are invalid; the previous ones stay in force",
                "errors": diagnostics.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
            })),
        )
            .into_response(),
    }
}

/// `POST /admin/node-mode` with `{"mode": "full" | "router_only" | "disabled"}`: switches
/// what this replica takes part in (partitioned mode); it hands over what the new mode
/// excludes within a tick.
async fn node_mode(
    State(state): State<Arc<AppState>>,
    body: Option<Json<serde_json::Value>>,
) -> Response {
    let wanted = body
        .as_ref()
        .and_then(|b| b.get("mode"))
        .and_then(|m| m.as_str())
        .and_then(NodeMode::parse);
    let Some(mode) = wanted else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "body must be {\"mode\": \"full\" | \"router_only\" | \"disabled\"}"})),
        )
            .into_response();
    };
    let before = state.placement.mode();
    state.placement.set_mode(mode);
    tracing::info!(
        message = "Node mode changed.",
        from = before.as_str(),
        to = mode.as_str()
    );
    (
        StatusCode::OK,
        Json(json!({"node_mode": mode.as_str(), "previous": before.as_str()})),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_compare() {
        assert!(constant_time_eq(b"secret-token-123", b"secret-token-123"));
        assert!(!constant_time_eq(b"secret-token-123", b"secret-token-124"));
        assert!(!constant_time_eq(b"short", b"longer"));
    }

    #[test]
    fn urls_lose_credentials() {
        assert_eq!(
            redact_url("nats://user:pw@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(redact_url("nats://host:4222"), "nats://host:4222");
    }
}
