//! The saga worker's batches: inputs read and applied, how long they waited and how long a
//! batch takes to commit, and the transitions they made.

use prometheus::{Histogram, IntCounter, IntCounterVec, Opts, Registry};

use super::{LATENCY_BUCKETS, hist, reg};
use crate::telemetry::names;

/// The saga worker's collectors.
pub(in crate::telemetry) struct Saga {
    pub(in crate::telemetry) saga_batch_size: Histogram,
    pub(in crate::telemetry) saga_deferred: IntCounter,
    pub(in crate::telemetry) saga_commit_seconds: Histogram,
    pub(in crate::telemetry) saga_transitions: IntCounterVec,
    pub(in crate::telemetry) saga_inputs: IntCounterVec,
    pub(in crate::telemetry) input_wait: Histogram,
}

/// Defines and registers in `r` the collectors of [`Saga`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Saga> {
    let saga_batch_size = hist(
        r,
        names::SAGA_BATCH_SIZE,
        "Inputs applied per libmdbx transaction.",
        &[
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ],
    )?;
    let saga_deferred = reg(
        r,
        IntCounter::new(
            names::SAGA_DEFERRED_INPUTS_TOTAL,
            "Inputs a transaction left for the next one: its outputs reached saga.max_batch_bytes.",
        )?,
    )?;
    let saga_commit_seconds = hist(
        r,
        names::SAGA_COMMIT_SECONDS,
        "Seconds to apply a batch and commit it durably.",
        LATENCY_BUCKETS,
    )?;
    let saga_transitions = reg(
        r,
        IntCounterVec::new(
            Opts::new(
                names::SAGA_TRANSITIONS_TOTAL,
                "Saga applications by saga and outcome.",
            ),
            &["saga", "outcome"],
        )?,
    )?;
    let saga_inputs = reg(
        r,
        IntCounterVec::new(
            Opts::new(names::SAGA_INPUTS_TOTAL, "Inputs read by stream."),
            &["stream"],
        )?,
    )?;
    let input_wait = hist(
        r,
        names::SAGA_INPUT_WAIT_SECONDS,
        "Seconds from an input being stored to the saga worker reading it.",
        LATENCY_BUCKETS,
    )?;
    Ok(Saga {
        saga_batch_size,
        saga_deferred,
        saga_commit_seconds,
        saga_transitions,
        saga_inputs,
        input_wait,
    })
}
