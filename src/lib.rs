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
//! | module | role |
//! |---|---|
//! | [`cli`] | command-line parsing |
//! | [`config`] | layered, validated configuration |
//! | [`manifest`] | saga and effect declarations, validation |
//! | [`expr`] | deterministic CEL expressions and JSON templates |
//! | [`saga`] | the pure saga engine |
//! | [`broker`] | NATS connection and stream reconciliation |
//! | [`storage`] | libmdbx environment, off the async runtime |
//! | [`worker`] | saga worker: consumers, batch commit, timers, dead letters |
//! | [`effect`] | effect worker: claims, providers, retries, breakers, result events |
//! | [`ops`] | operator tools: inspect, dead letters, redrive |
//! | [`relay`] | outbox relay to JetStream |
//! | [`admin`] | health, readiness, metrics, info, drain, reload |
//! | [`app`] | wiring and the drain sequence |
//! | [`shutdown`] | signal handling |
//! | [`telemetry`] | logs and metrics |
#![warn(missing_docs)]

pub mod admin;
pub mod app;
pub mod backoff;
pub mod broker;
pub mod cli;
pub mod clock;
pub mod config;
pub mod deadletter;
pub mod effect;
pub mod expr;
pub mod manifest;
pub mod ops;
pub mod relay;
pub mod runtime;
pub mod saga;
pub mod shutdown;
pub mod storage;
pub mod telemetry;
pub mod worker;
