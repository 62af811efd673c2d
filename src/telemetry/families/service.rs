//! The process as a whole: whether it is connected and draining, the manifest it runs, the
//! dead letters every component records, and the pipeline stages that have stalled.

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::reg;
use crate::telemetry::names;

/// The collectors of the process as a whole.
pub(in crate::telemetry) struct Service {
    pub(in crate::telemetry) nats_connected: IntGauge,
    pub(in crate::telemetry) draining: IntGauge,
    pub(in crate::telemetry) manifest_reloads: IntCounterVec,
    pub(in crate::telemetry) manifest_sagas: IntGauge,
    pub(in crate::telemetry) deadletters: IntCounterVec,
    pub(in crate::telemetry) pipeline_stalled: IntGauge,
}

/// Registers in `registry` the process collector (on Linux) and the build information, set
/// once from `version`, `revision` and `mode`, and defines and registers the collectors of
/// [`Service`].
pub(in crate::telemetry) fn register(
    registry: &Registry,
    version: &str,
    revision: &str,
    mode: &str,
) -> prometheus::Result<Service> {
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    let build = IntGaugeVec::new(
        Opts::new(
            names::BUILD_INFO,
            "Build information; the value is always 1.",
        ),
        &["version", "revision", "mode"],
    )?;
    build.with_label_values(&[version, revision, mode]).set(1);
    registry.register(Box::new(build))?;
    let nats_connected = IntGauge::new(
        names::NATS_CONNECTED,
        "1 while the NATS connection is up, else 0.",
    )?;
    registry.register(Box::new(nats_connected.clone()))?;
    let draining = IntGauge::new(names::DRAINING, "1 while the process is draining.")?;
    registry.register(Box::new(draining.clone()))?;
    let manifest_reloads = IntCounterVec::new(
        Opts::new(
            names::MANIFEST_RELOADS_TOTAL,
            "Manifest reloads by outcome.",
        ),
        &["outcome"],
    )?;
    registry.register(Box::new(manifest_reloads.clone()))?;
    for outcome in ["applied", "rejected"] {
        manifest_reloads.with_label_values(&[outcome]);
    }
    let manifest_sagas = IntGauge::new(names::MANIFEST_SAGAS, "Saga versions currently loaded.")?;
    registry.register(Box::new(manifest_sagas.clone()))?;
    let deadletters = reg(
        registry,
        IntCounterVec::new(
            Opts::new(names::DEADLETTERS_TOTAL, "Dead letters by kind."),
            &["kind"],
        )?,
    )?;
    // Every kind exists from the start, so a zero reads as zero, not as a missing series.
    for k in crate::deadletter::kind::ALL {
        deadletters.with_label_values(&[k]);
    }
    let pipeline_stalled = reg(
        registry,
        IntGauge::new(
            names::PIPELINE_STALLED_STAGES,
            "Relays and routers failing on every attempt for 30 s or more (read at each scrape).",
        )?,
    )?;
    Ok(Service {
        nats_connected,
        draining,
        manifest_reloads,
        manifest_sagas,
        deadletters,
        pipeline_stalled,
    })
}
