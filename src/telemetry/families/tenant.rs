//! Tenants at the door of the saga inbox: new inputs read and waiting to go in (by tenant),
//! how long the oldest has waited, what went in, and the turns a tenant passed at its rate
//! limit; what was applied for each; and at the effect worker, each tenant's calls per
//! effect and the turns it passed at its effect rate limit; its running instances, and the
//! inputs held at its cap on them and the oldest's age. The `tenant` label is bounded: a
//! tenant named in `[tenancy]` (allowed, weights, rate limits, caps, the default tenant) has
//! its own series, every other tenant counts as
//! `other` (`crate::fair::Usage`).

use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use super::{counters, reg};
use crate::telemetry::names;

/// The tenant collectors.
pub(in crate::telemetry) struct Tenant {
    pub(in crate::telemetry) waiting: IntGaugeVec,
    pub(in crate::telemetry) oldest_wait: GaugeVec,
    pub(in crate::telemetry) inputs: IntCounterVec,
    pub(in crate::telemetry) rate_limited: IntCounterVec,
    pub(in crate::telemetry) outbox_capped: IntCounterVec,
    pub(in crate::telemetry) outbox_bytes: IntGaugeVec,
    pub(in crate::telemetry) applied: IntCounterVec,
    pub(in crate::telemetry) effect_calls: IntCounterVec,
    pub(in crate::telemetry) effect_rate_limited: IntCounterVec,
    pub(in crate::telemetry) live: IntGaugeVec,
    pub(in crate::telemetry) timers: IntGaugeVec,
    pub(in crate::telemetry) held_at_cap: IntGaugeVec,
    pub(in crate::telemetry) oldest_held_at_cap: GaugeVec,
}

/// Defines and registers in `r` the collectors of [`Tenant`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Tenant> {
    let waiting = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::TENANT_WAITING_INPUTS,
                "New inputs read by this node's routers and waiting to enter the saga inbox.",
            ),
            &["tenant"],
        )?,
    )?;
    let oldest_wait = reg(
        r,
        GaugeVec::new(
            Opts::new(
                names::TENANT_OLDEST_WAIT_SECONDS,
                "How long the oldest of a tenant's waiting new inputs has waited, seconds.",
            ),
            &["tenant"],
        )?,
    )?;
    let inputs = counters(
        r,
        names::TENANT_INPUTS_TOTAL,
        "New inputs this node's routers let into the saga inbox.",
        &["tenant"],
    )?;
    let rate_limited = counters(
        r,
        names::TENANT_RATE_LIMITED_TOTAL,
        "Turns a tenant with new inputs waiting passed at its rate limit.",
        &["tenant"],
    )?;
    let outbox_capped = counters(
        r,
        names::TENANT_OUTBOX_CAPPED_TOTAL,
        "Times a router found the tenant's new inputs waiting because its outputs waiting in the outboxes reached its cap (tenancy.outbox_byte_caps); it looks again about every 20 ms while they wait.",
        &["tenant"],
    )?;
    let outbox_bytes = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::TENANT_OUTBOX_BYTES,
                "Bytes of the tenant's saga outputs waiting in this node's outboxes to be published.",
            ),
            &["tenant"],
        )?,
    )?;
    let applied = counters(
        r,
        names::TENANT_APPLIED_TOTAL,
        "Inputs applied to saga instances (committed transitions).",
        &["tenant"],
    )?;
    let effect_calls = counters(
        r,
        names::TENANT_EFFECT_CALLS_TOTAL,
        "Effect calls this node's effect worker started.",
        &["tenant", "effect"],
    )?;
    let effect_rate_limited = counters(
        r,
        names::TENANT_EFFECT_RATE_LIMITED_TOTAL,
        "Turns a tenant with effect commands waiting passed at its effect rate limit.",
        &["tenant", "effect"],
    )?;
    let live = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::TENANT_LIVE_INSTANCES,
                "Running saga instances in the partitions this node owns.",
            ),
            &["tenant"],
        )?,
    )?;
    let timers = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::TENANT_PENDING_TIMERS,
                "Pending saga timers in the partitions this node owns.",
            ),
            &["tenant"],
        )?,
    )?;
    let held_at_cap = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::TENANT_HELD_AT_CAP,
                "Inputs held at the tenant's cap on running instances or pending timers (tenancy.live_instance_caps, tenancy.pending_timer_caps), in the partitions this node owns.",
            ),
            &["tenant"],
        )?,
    )?;
    let oldest_held_at_cap = reg(
        r,
        GaugeVec::new(
            Opts::new(
                names::TENANT_OLDEST_HELD_AT_CAP_SECONDS,
                "How long the oldest input held at the tenant's cap has been held, seconds.",
            ),
            &["tenant"],
        )?,
    )?;
    // Every tenant not named in `[tenancy]` counts here: its series exist from the start.
    live.with_label_values(&["other"]).set(0);
    timers.with_label_values(&["other"]).set(0);
    outbox_bytes.with_label_values(&["other"]).set(0);
    outbox_capped.with_label_values(&["other"]);
    held_at_cap.with_label_values(&["other"]).set(0);
    oldest_held_at_cap.with_label_values(&["other"]).set(0.0);
    waiting.with_label_values(&["other"]).set(0);
    oldest_wait.with_label_values(&["other"]).set(0.0);
    inputs.with_label_values(&["other"]);
    rate_limited.with_label_values(&["other"]);
    applied.with_label_values(&["other"]);
    Ok(Tenant {
        waiting,
        oldest_wait,
        inputs,
        rate_limited,
        outbox_capped,
        outbox_bytes,
        applied,
        effect_calls,
        effect_rate_limited,
        live,
        timers,
        held_at_cap,
        oldest_held_at_cap,
    })
}
