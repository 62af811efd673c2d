//! Saga timers: those waiting, those fired, and how late they fired.

use prometheus::{Histogram, IntCounter, IntGauge, Registry};

use super::{LATENCY_BUCKETS, hist, reg};
use crate::telemetry::names;

/// The timers' collectors.
pub(in crate::telemetry) struct Timers {
    pub(in crate::telemetry) timers_pending: IntGauge,
    pub(in crate::telemetry) timers_fired: IntCounter,
    pub(in crate::telemetry) timer_fire_lag: Histogram,
}

/// Defines and registers in `r` the collectors of [`Timers`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Timers> {
    let timers_pending = reg(
        r,
        IntGauge::new(names::TIMERS_PENDING, "Timers waiting to fire.")?,
    )?;
    let timers_fired = reg(
        r,
        IntCounter::new(names::TIMERS_FIRED_TOTAL, "Timers fired.")?,
    )?;
    let timer_fire_lag = hist(
        r,
        names::TIMER_FIRE_LAG_SECONDS,
        "Seconds between a timer's due time and its firing.",
        LATENCY_BUCKETS,
    )?;
    Ok(Timers {
        timers_pending,
        timers_fired,
        timer_fire_lag,
    })
}
