//! The effect workers: commands claimed, executed, refused or kept locally, their attempts,
//! results and durations, and each effect's circuit breaker.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use super::{LATENCY_BUCKETS, counters, hist, reg};
use crate::telemetry::names;

/// The effect workers' collectors.
pub(in crate::telemetry) struct Effect {
    pub(in crate::telemetry) effect_claims: IntCounterVec,
    pub(in crate::telemetry) effect_commands: IntCounterVec,
    pub(in crate::telemetry) effect_results: IntCounterVec,
    pub(in crate::telemetry) effect_attempts: IntCounterVec,
    pub(in crate::telemetry) effect_seconds: HistogramVec,
    pub(in crate::telemetry) effect_circuit_state: IntGaugeVec,
    pub(in crate::telemetry) effect_in_flight: IntGauge,
    pub(in crate::telemetry) effect_deadletters_local: IntCounter,
    pub(in crate::telemetry) effect_queue: Histogram,
}

/// Defines and registers in `r` the collectors of [`Effect`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Effect> {
    let effect_claims = counters(
        r,
        names::EFFECT_CLAIMS_TOTAL,
        "Effect claim events by event.",
        &["event"],
    )?;
    let effect_commands = counters(
        r,
        names::EFFECT_COMMANDS_TOTAL,
        "Effect commands not executed on delivery, by outcome.",
        &["outcome"],
    )?;
    let effect_results = counters(
        r,
        names::EFFECT_RESULTS_TOTAL,
        "Effect results published, by effect and result type.",
        &["effect", "result_type"],
    )?;
    let effect_attempts = counters(
        r,
        names::EFFECT_ATTEMPTS_TOTAL,
        "Effect attempts by effect and outcome.",
        &["effect", "outcome"],
    )?;
    let effect_seconds = reg(
        r,
        HistogramVec::new(
            HistogramOpts::new(
                names::EFFECT_SECONDS,
                "Seconds from claiming an effect command to its outcome, all attempts.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["effect"],
        )?,
    )?;
    let effect_circuit_state = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::EFFECT_CIRCUIT_STATE,
                "Circuit breaker state by effect: 0 closed, 1 open, 2 half-open.",
            ),
            &["effect"],
        )?,
    )?;
    let effect_in_flight = reg(
        r,
        IntGauge::new(names::EFFECT_IN_FLIGHT, "Effect commands executing now.")?,
    )?;
    let effect_deadletters_local = reg(
        r,
        IntCounter::new(
            names::EFFECT_DEADLETTERS_LOCAL,
            "Refused effect commands kept in the local store (the dead-letter stream refused them).",
        )?,
    )?;
    let effect_queue = hist(
        r,
        names::EFFECT_QUEUE_SECONDS,
        "Seconds from an effect command being stored to a worker starting on it.",
        LATENCY_BUCKETS,
    )?;
    Ok(Effect {
        effect_claims,
        effect_commands,
        effect_results,
        effect_attempts,
        effect_seconds,
        effect_circuit_state,
        effect_in_flight,
        effect_deadletters_local,
        effect_queue,
    })
}
