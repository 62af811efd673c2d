//! Runner: sagas and side-effect workflows on NATS JetStream.
//!
//! ```text
//!  aggregates ──► AGGREGATE_EVENTS ──┐
//!                                    ▼
//!                         saga worker (engine, libmdbx: state + outbox + checkpoint)
//!                                    │ outbox relay (Nats-Msg-Id = deterministic id)
//!                                    ▼
//!                          WORKFLOW_COMMANDS ──► effect workers (claims, retries, breakers)
//!                                                        │
//!  saga worker ◄── WORKFLOW_EVENTS ◄── result events ◄───┘
//! ```
//!
//! Where each guarantee lives (`docs/architecture.md` has the data flow beside it):
//!
//! | guarantee | home |
//! |---|---|
//! | inputs applied once, in stream order; the checkpoint is the position of truth | [`worker`] (`consume/` resumes at it, `commit.rs` skips what it covers, [`worker::process`] dedupes by event id) |
//! | state, outbox, timers, dedupe, dead letters and checkpoint commit in one durable transaction | `worker/commit.rs`, [`storage`] |
//! | poison decided before routing | `worker/admission.rs` |
//! | pure, deterministic transitions; deterministic output ids | [`saga`], [`saga::ids`] |
//! | outbox published at least once, in order, deleted only once acknowledged | [`relay`] |
//! | durable timers; a cancelled timer never fires | `worker/timers.rs` (firing), [`worker::process`] (a cancel deletes the row in its own transaction) |
//! | dead letters: recorded with a reason, key parked, redriven in order | [`deadletter`] |
//! | at most one live executor per effect command | [`effect::claim`] |
//! | retries, timeouts, lease renewal; circuit breakers | `effect/attempt.rs`, [`effect::breaker`] |
//! | streams and buckets exist and are compatible; set-up retried while a cluster forms | [`broker`] |
//! | drain, exit codes | [`app`], [`runtime::Lifecycle`], [`shutdown`] |
//! | manifests swapped whole; no reload strands instances | [`runtime`] |
//! | config and manifest errors name their location | [`config`], [`manifest`] |
//! | every metric defined once | [`telemetry`] |
//!
//! | module | role |
//! |---|---|
//! | [`cli`] | command-line parsing |
//! | [`config`] | layered, validated configuration |
//! | [`manifest`] | saga and effect declarations, validation |
//! | [`expr`] | deterministic CEL expressions and JSON templates |
//! | [`saga`] | the pure saga engine |
//! | [`storage`] | libmdbx environment and its tables, off the async runtime |
//! | [`broker`] | NATS connection, stream and bucket set-up, headers |
//! | [`clock`], [`backoff`] | the wall clock; the one infrastructure retry backoff |
//! | [`runtime`] | the context every component shares |
//! | [`seal`] | HMAC seals of snapshots and control inputs with the deployment key |
//! | [`deadletter`] | dead letters of both sides |
//! | [`telemetry`] | logs and metrics |
//! | [`worker`] | saga worker: consuming, admission, group commit, timers, sweep |
//! | [`relay`] | outbox relay to JetStream |
//! | [`effect`] | effect worker: claims, attempts, providers, breakers, result events |
//! | [`ops`] | operator tools: inspect, redrive |
//! | [`fuzz`] | properties every untrusted-input decoder keeps, for the fuzz targets and their regression test |
//! | [`admin`] | health, readiness, metrics, info, drain, reload |
//! | [`app`] | wiring and the drain sequence |
//! | [`shutdown`] | signal handling |
#![warn(missing_docs)]

pub mod admin;
pub mod app;
pub mod asked;
pub mod backoff;
pub mod broker;
pub mod cli;
pub mod clock;
pub mod config;
pub mod deadletter;
pub mod effect;
pub mod expr;
pub mod fair;
pub mod fuzz;
pub mod manifest;
pub mod operator;
pub mod ops;
pub mod placement;
pub mod quota;
pub mod readahead;
pub mod relay;
pub mod runtime;
pub mod saga;
pub mod seal;
pub mod shutdown;
pub mod storage;
pub mod subject;
pub mod telemetry;
pub mod worker;
