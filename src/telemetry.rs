//! Logging and metrics.
//!
//! Logs go to stderr through `tracing`, as text or one JSON object per line, filtered by
//! `RUST_LOG` (default `info`). Events carry structured fields (`tenant`, `saga`,
//! `correlation_id`, `trace_id` where they apply) rather than values baked into messages.
//!
//! Metrics live in one Prometheus [`Registry`] owned by the application; each component
//! registers its collectors at start. Names follow `runner_<what>_<unit>[_total]` and labels
//! come from bounded sets only.

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// Filter used when `RUST_LOG` is unset: our events at info, chatty libraries at warn.
pub const DEFAULT_FILTER: &str = "info,async_nats=warn,libmdbx=warn";

/// Installs the global tracing subscriber. Call once, first thing in `main`.
pub fn init_logging(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            use std::io::IsTerminal;
            builder
                .with_target(false)
                .with_ansi(std::io::stderr().is_terminal())
                .init()
        }
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .init(),
    }
}

/// Metric names, described once.
pub mod names {
    /// Build information (value 1), labelled with version, revision and mode.
    pub const BUILD_INFO: &str = "runner_build_info";
    /// 1 while the NATS connection is up, 0 otherwise (updated on every scrape).
    pub const NATS_CONNECTED: &str = "runner_nats_connected";
    /// 1 while the process is draining.
    pub const DRAINING: &str = "runner_draining";
    /// Manifest reloads by outcome (`applied` | `rejected`).
    pub const MANIFEST_RELOADS_TOTAL: &str = "runner_manifest_reloads_total";
    /// Sagas currently loaded (one per name and version).
    pub const MANIFEST_SAGAS: &str = "runner_manifest_sagas";
}

/// The application's registry and the collectors the core owns.
#[derive(Clone)]
pub struct Metrics {
    /// The one registry `/metrics` encodes.
    pub registry: Registry,
    /// See [`names::NATS_CONNECTED`].
    pub nats_connected: IntGauge,
    /// See [`names::DRAINING`].
    pub draining: IntGauge,
    /// See [`names::MANIFEST_RELOADS_TOTAL`].
    pub manifest_reloads: IntCounterVec,
    /// See [`names::MANIFEST_SAGAS`].
    pub manifest_sagas: IntGauge,
}

impl Metrics {
    /// Creates the registry with process metrics and the core collectors.
    pub fn new(version: &str, revision: &str, mode: &str) -> prometheus::Result<Self> {
        let registry = Registry::new();
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
        let manifest_sagas =
            IntGauge::new(names::MANIFEST_SAGAS, "Saga versions currently loaded.")?;
        registry.register(Box::new(manifest_sagas.clone()))?;
        Ok(Self {
            registry,
            nats_connected,
            draining,
            manifest_reloads,
            manifest_sagas,
        })
    }

    /// Encodes every registered metric in the Prometheus text format.
    pub fn encode(&self) -> String {
        use prometheus::Encoder;
        let mut buf = Vec::new();
        let encoder = prometheus::TextEncoder::new();
        if let Err(e) = encoder.encode(&self.registry.gather(), &mut buf) {
            tracing::error!(message = "Encoding metrics failed.", error = %e);
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}
