//! The outbox relay: records waiting, published, suppressed as already published, parked,
//! and the broker's refusals of fenced publishes.

use prometheus::{Histogram, IntCounter, IntGauge, Registry};

use super::{LATENCY_BUCKETS, hist, reg};
use crate::telemetry::names;

/// The relay's collectors.
pub(in crate::telemetry) struct Relay {
    pub(in crate::telemetry) outbox_depth: IntGauge,
    pub(in crate::telemetry) relay_published: IntCounter,
    pub(in crate::telemetry) relay_errors: IntCounter,
    pub(in crate::telemetry) relay_parked: IntCounter,
    pub(in crate::telemetry) relay_window_seconds: Histogram,
    pub(in crate::telemetry) relay_suppressed: IntCounter,
    pub(in crate::telemetry) fenced_rejections: IntCounter,
}

/// Defines and registers in `r` the collectors of [`Relay`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Relay> {
    let outbox_depth = reg(
        r,
        IntGauge::new(names::OUTBOX_DEPTH, "Records waiting in the outbox.")?,
    )?;
    let relay_published = reg(
        r,
        IntCounter::new(
            names::RELAY_PUBLISHED_TOTAL,
            "Outbox records published and acknowledged.",
        )?,
    )?;
    let relay_errors = reg(
        r,
        IntCounter::new(names::RELAY_ERRORS_TOTAL, "Failed relay rounds.")?,
    )?;
    let relay_parked = reg(
        r,
        IntCounter::new(
            names::RELAY_PARKED_TOTAL,
            "Outputs the relay parked and dead-lettered: the broker can never take them.",
        )?,
    )?;
    let relay_window_seconds = hist(
        r,
        names::RELAY_WINDOW_SECONDS,
        "Seconds from publishing a window of outbox records to all acknowledged.",
        LATENCY_BUCKETS,
    )?;
    let relay_suppressed = reg(
        r,
        IntCounter::new(
            names::RELAY_SUPPRESSED_TOTAL,
            "Outbox records a predecessor had already published.",
        )?,
    )?;
    let fenced_rejections = reg(
        r,
        IntCounter::new(
            names::FENCED_REJECTIONS_TOTAL,
            "Fenced publishes refused by the broker.",
        )?,
    )?;
    Ok(Relay {
        outbox_depth,
        relay_published,
        relay_errors,
        relay_parked,
        relay_window_seconds,
        relay_suppressed,
        fenced_rejections,
    })
}
