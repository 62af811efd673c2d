//! The routers that copy source inputs into the saga inbox: how far they have read, what they
//! copied or found no saga for, and how long new inputs waited for admission.

use prometheus::{Histogram, IntCounter, IntGaugeVec, Opts, Registry};

use super::{LATENCY_BUCKETS, hist, reg};
use crate::telemetry::names;

/// The routers' collectors.
pub(in crate::telemetry) struct Router {
    pub(in crate::telemetry) saga_unrouted: IntCounter,
    pub(in crate::telemetry) consumer_lag: IntGaugeVec,
    pub(in crate::telemetry) consumer_checkpoint: IntGaugeVec,
    pub(in crate::telemetry) router_copies: IntCounter,
    pub(in crate::telemetry) admission_wait: Histogram,
}

/// Defines and registers in `r` the collectors of [`Router`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Router> {
    let saga_unrouted = reg(
        r,
        IntCounter::new(names::SAGA_UNROUTED_TOTAL, "Inputs no saga wanted.")?,
    )?;
    let consumer_lag = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::CONSUMER_LAG,
                "Messages a share's router has yet to read: in its source stream after the last one it read, taken in by its filter.",
            ),
            &["stream", "share"],
        )?,
    )?;
    let consumer_checkpoint = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::CONSUMER_CHECKPOINT,
                "Last source sequence a share's router covered in the saga inbox.",
            ),
            &["stream", "share"],
        )?,
    )?;
    let router_copies = reg(
        r,
        IntCounter::new(names::ROUTER_COPIES_TOTAL, "Input copies routed.")?,
    )?;
    let admission_wait = hist(
        r,
        names::SAGA_ADMISSION_WAIT_SECONDS,
        "Seconds a batch of new aggregate events waited behind work under way.",
        LATENCY_BUCKETS,
    )?;
    Ok(Router {
        saga_unrouted,
        consumer_lag,
        consumer_checkpoint,
        router_copies,
        admission_wait,
    })
}
