//! Dead-letter reason classes (bounded: they label a metric).
//!
//! Every dead letter carries one of these as its `kind`: it names the dead-letter stream's
//! subject (`tenant.<t>.deadletter.<kind>`) and labels `runner_deadletters_total`, whose
//! series [`ALL`] lists so that each exists from the start.

/// Body is not JSON, or lacks the envelope fields.
pub const UNDECODABLE: &str = "undecodable";
/// Subject tenant and body tenant differ.
pub const TENANT_MISMATCH: &str = "tenant_mismatch";
/// Tenant not in `tenancy.allowed`.
pub const UNKNOWN_TENANT: &str = "unknown_tenant";
/// Body larger than `saga.max_message_bytes`, or a tenant, correlation id or event id
/// longer than the key limits.
pub const TOO_LARGE: &str = "too_large";
/// An expression failed (guard, correlation, template) or the engine refused the input.
pub const EXPRESSION: &str = "expression";
/// The instance's saga version is no longer loaded.
pub const VERSION_NOT_LOADED: &str = "version_not_loaded";
/// Held behind an earlier dead letter of the same key.
pub const PARKED: &str = "parked";
/// The engine panicked on this input (a bug; the input is kept for a redrive).
pub const ENGINE_PANIC: &str = "engine_panic";
/// An effect result that answers no command the instance issued and waits for (forged,
/// another instance's, or a second answer), or an event of an orchestration step's
/// result types without `metadata.correlation_id` (it answers no command of any
/// instance). Its key is not parked.
pub const UNANSWERED_RESULT: &str = "unanswered_result";

/// An effect command delivered `effect.max_deliver` times without completing.
pub const REDELIVERY_LIMIT: &str = "redelivery_limit";
/// An output in the outbox the broker can never take (larger than its `max_payload`):
/// the relay parked it and went on.
pub const UNPUBLISHABLE: &str = "unpublishable";

/// An input whose event id was already applied to another instance of the saga (a
/// producer reused it): not a redelivery, so not dropped as one. Its key is not parked.
pub const DUPLICATE_EVENT_ID: &str = "duplicate_event_id";

/// A control input (a resume or a redrive, `worker/control.rs`) whose seal does not check
/// against the deployment key, or one stored further from when it was issued than
/// `saga.max_clock_skew` (a sealed one published again). It does nothing and parks no key.
pub const UNSEALED_CONTROL: &str = "unsealed_control";

/// An input of a paused tenant, held whole until the tenant is resumed
/// (`worker/pause.rs`). Not a failure: it is neither announced on the dead-letter
/// stream nor counted as a dead letter.
pub const TENANT_PAUSED: &str = "tenant_paused";

/// An input that would have started one more running instance of a tenant at its cap
/// (`tenancy.live_instance_caps`), or a later input of a key such an input holds; kept whole
/// and applied in order when one of the tenant's instances in its partition ends
/// (`worker/cap.rs`). Not a failure: neither announced on the dead-letter stream nor counted
/// as a dead letter.
pub const TENANT_CAPPED: &str = "tenant_capped";

/// Every kind counted as a dead letter, so their metric series exist (at 0) from the
/// start.
pub const ALL: [&str; 13] = [
    UNDECODABLE,
    TENANT_MISMATCH,
    UNKNOWN_TENANT,
    TOO_LARGE,
    EXPRESSION,
    VERSION_NOT_LOADED,
    PARKED,
    ENGINE_PANIC,
    UNANSWERED_RESULT,
    REDELIVERY_LIMIT,
    UNPUBLISHABLE,
    DUPLICATE_EVENT_ID,
    UNSEALED_CONTROL,
];
