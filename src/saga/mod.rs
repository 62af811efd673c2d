//! The saga engine: a pure function from (catalog, instance or none, input) to a result.
//!
//! ```text
//!   Input ──route()──▶ [(saga, correlation id)] ──apply()──▶ Applied { instance', work[], timers }
//!                                                    └─────▶ StepError (typed outcome)
//! ```
//!
//! [`route`] tells which sagas an input concerns and under which correlation id (the router
//! runs it); [`apply`] advances one instance (the partition owner runs it, then commits the
//! new instance, the work items and the timers in one storage transaction).
//!
//! Guarantees:
//! - **Pure.** No I/O, no clock, no randomness. Time inside a saga is the input's
//!   `timestamp_ms`: a timer's due time is that plus its delay. That timestamp is the
//!   producer's clock, so the worker passes in with each input the bound it is applied
//!   within ([`TimeBound`]: the broker's stored time of the input ± `saga.max_clock_skew`);
//!   a timestamp outside it is moved to its nearest edge before anything reads it.
//! - **Deterministic.** The same catalog, instance and input give byte-identical results
//!   (objects are ordered maps, output bodies are written with their keys in order — see
//!   `body.rs` —, ids are derived, see [`ids`]), so replaying an input after a crash
//!   reproduces the same outputs, byte for byte, with the same ids.
//! - **Typed outcomes.** Everything that is not a transition is a [`StepError`] variant the
//!   caller acts on: ignore ([`StepError::NotStarting`], [`StepError::NoTransition`],
//!   [`StepError::Finished`], [`StepError::StaleTimer`]), dead-letter and park the key
//!   ([`StepError::Poison`], [`StepError::VersionNotLoaded`], [`StepError::UnknownSaga`]),
//!   or dead-letter without parking anything ([`StepError::UnansweredCommand`],
//!   [`StepError::UncorrelatedReply`]: an answer to no command of the instance).
//!
//! Event names: transitions are keyed by the input's *event name* — the `event_type` of an
//! aggregate or workflow event, `<effect>.<result_type>` of an effect result
//! (`charge_card.Succeeded`), `timer.<name>` of a timer firing.
//!
//! Inside (each file states its own guarantee):
//!
//! | file | owns |
//! |---|---|
//! | `types.rs` | inputs, instances, work items, timer changes, [`StepError`] |
//! | `body.rs` | [`Body`]: a work item's envelope as the JSON text it is published as |
//! | `engine.rs` | [`route`] and [`apply`]: what every saga style shares |
//! | `machine.rs` | a state-machine saga's transition |
//! | `orchestrate.rs` | an orchestration's steps, retries and compensations |
//! | `emitter.rs` | the work and timers one application emits, and template variables |
//! | [`ids`] | every deterministic id |
//! | [`retry`] | the backoff formula shared with the effect worker |
//! | [`migrate`] | explicit migration from version N to N+1 |
//! | [`scenario`] | `runner test`: scenario files run against the engine |

mod body;
mod emitter;
mod engine;
pub mod ids;
mod machine;
pub mod migrate;
mod orchestrate;
pub mod retry;
pub mod scenario;
mod types;

pub use body::Body;
pub use engine::{apply, apply_owned, route};
pub use types::{
    Applied, DEFAULT_MAX_CLOCK_SKEW_MS, ENVELOPE_VERSION, Input, InputKind, Instance, Route,
    ScheduledTimer, Status, StepError, TERMINAL_EVENTS, TimeBound, TimerCancel, TimerSet, WorkItem,
    WorkKind, is_terminal_event,
};
