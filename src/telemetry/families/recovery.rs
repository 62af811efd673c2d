//! What a take-over rebuilds a partition from: local state or a snapshot, the inputs it
//! replays, the snapshots uploaded, and whether the inbox still held the inputs it needed.

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::{hist, reg};
use crate::telemetry::names;

/// The buckets of the snapshot round histogram, in seconds: from an idle node's round to a
/// store of millions of instances.
const ROUND_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// The take-over and snapshot collectors.
pub(in crate::telemetry) struct Recovery {
    pub(in crate::telemetry) partition_restores: IntCounterVec,
    pub(in crate::telemetry) partition_replayed: IntCounter,
    pub(in crate::telemetry) snapshots: IntCounter,
    pub(in crate::telemetry) snapshot_round_seconds: Histogram,
    pub(in crate::telemetry) snapshot_last_timestamp: IntGaugeVec,
    pub(in crate::telemetry) inbox_retention: IntGauge,
    pub(in crate::telemetry) retention_gaps: IntCounter,
    pub(in crate::telemetry) refused_objects: IntCounterVec,
}

/// Defines and registers in `r` the collectors of [`Recovery`].
pub(in crate::telemetry) fn register(r: &Registry) -> prometheus::Result<Recovery> {
    let partition_restores = reg(
        r,
        IntCounterVec::new(
            Opts::new(
                names::PARTITION_RESTORES_TOTAL,
                "Partition starts by state source.",
            ),
            &["source"],
        )?,
    )?;
    for src in ["local", "snapshot"] {
        partition_restores.with_label_values(&[src]);
    }
    let partition_replayed = reg(
        r,
        IntCounter::new(
            names::PARTITION_REPLAYED_TOTAL,
            "Inputs applied again on take-over.",
        )?,
    )?;
    let snapshots = reg(
        r,
        IntCounter::new(names::SNAPSHOTS_TOTAL, "Partition snapshots uploaded.")?,
    )?;
    let snapshot_round_seconds = hist(
        r,
        names::SNAPSHOT_ROUND_SECONDS,
        "Seconds each snapshot round took.",
        ROUND_BUCKETS,
    )?;
    let snapshot_last_timestamp = reg(
        r,
        IntGaugeVec::new(
            Opts::new(
                names::SNAPSHOT_LAST_TIMESTAMP,
                "When each partition's last snapshot was uploaded (Unix seconds).",
            ),
            &["partition"],
        )?,
    )?;
    let inbox_retention = reg(
        r,
        IntGauge::new(
            names::INBOX_RETENTION,
            "How long the saga inbox keeps inputs (seconds; 0 = no age limit).",
        )?,
    )?;
    let retention_gaps = reg(
        r,
        IntCounter::new(
            names::RETENTION_GAPS_TOTAL,
            "Take-overs whose needed inputs were gone from the inbox.",
        )?,
    )?;
    let refused_objects = reg(
        r,
        IntCounterVec::new(
            Opts::new(
                names::REFUSED_OBJECTS_TOTAL,
                "Snapshots and fence markers refused as forged or foreign, by object.",
            ),
            &["object"],
        )?,
    )?;
    for o in names::REFUSED_OBJECTS {
        refused_objects.with_label_values(&[o]);
    }
    Ok(Recovery {
        partition_restores,
        partition_replayed,
        snapshots,
        snapshot_round_seconds,
        snapshot_last_timestamp,
        inbox_retention,
        retention_gaps,
        refused_objects,
    })
}
