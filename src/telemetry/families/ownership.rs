//! Partition ownership: the partitions this node holds, their lease epochs and events, how
//! far each has read and committed, and how long starting and handing one off take.

use prometheus::{Histogram, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::{LATENCY_BUCKETS, hist, reg};
use crate::telemetry::names;

/// The partition owners' collectors.
pub(in crate::telemetry) struct Ownership {
    pub(in crate::telemetry) partitions_owned: IntGauge,
    pub(in crate::telemetry) partition_epoch: IntGaugeVec,
    pub(in crate::telemetry) partition_lag: IntGaugeVec,
    pub(in crate::telemetry) partition_checkpoint: IntGaugeVec,
    pub(in crate::telemetry) lease_events: IntCounterVec,
    pub(in crate::telemetry) partition_start_seconds: Histogram,
    pub(in crate::telemetry) partition_handoff_seconds: Histogram,
}

/// Defines and registers in `r` the collectors of [`Ownership`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Ownership> {
    let partitions_owned = reg(
        r,
        IntGauge::new(names::PARTITIONS_OWNED, "Saga partitions owned now.")?,
    )?;
    let partition_epoch = reg(
        r,
        IntGaugeVec::new(
            Opts::new(names::PARTITION_EPOCH, "Lease epoch per owned partition."),
            &["partition"],
        )?,
    )?;
    let partition_lag = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::PARTITION_LAG,
                "Inbox messages not yet read, per partition.",
            ),
            &["partition"],
        )?,
    )?;
    let partition_checkpoint = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::PARTITION_CHECKPOINT,
                "Committed inbox checkpoint, per owned partition.",
            ),
            &["partition"],
        )?,
    )?;
    let lease_events = reg(
        r,
        IntCounterVec::new(
            Opts::new(names::LEASE_EVENTS_TOTAL, "Partition lease events."),
            &["event"],
        )?,
    )?;
    for e in [
        "acquired",
        "inherited",
        "renewed",
        "lost",
        "released",
        "fenced",
    ] {
        lease_events.with_label_values(&[e]);
    }
    let partition_start_seconds = hist(
        r,
        names::PARTITION_START_SECONDS,
        "Seconds from winning a partition lease to reading its inbox.",
        LATENCY_BUCKETS,
    )?;
    let partition_handoff_seconds = hist(
        r,
        names::PARTITION_HANDOFF_SECONDS,
        "Seconds from stopping a partition to releasing its lease.",
        LATENCY_BUCKETS,
    )?;
    Ok(Ownership {
        partitions_owned,
        partition_epoch,
        partition_lag,
        partition_checkpoint,
        lease_events,
        partition_start_seconds,
        partition_handoff_seconds,
    })
}
