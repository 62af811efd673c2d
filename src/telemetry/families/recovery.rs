//! What a take-over rebuilds a partition from: local state or a snapshot, the inputs it
//! replays, the snapshots uploaded, and whether the inbox still held the inputs it needed.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::reg;
use crate::telemetry::names;

/// The take-over and snapshot collectors.
pub(in crate::telemetry) struct Recovery {
    pub(in crate::telemetry) partition_restores: IntCounterVec,
    pub(in crate::telemetry) partition_replayed: IntCounter,
    pub(in crate::telemetry) snapshots: IntCounter,
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
        snapshot_last_timestamp,
        inbox_retention,
        retention_gaps,
        refused_objects,
    })
}
