//! Logging and metrics.
//!
//! Logs go to stderr through `tracing`, as text or one JSON object per line, filtered by
//! `RUST_LOG` (default `info`). Events carry structured fields rather than values baked into
//! messages; the fields that identify the work come from its span: `effect_command`
//! (tenant, effect, command id, attempt; always on) around each effect command, and
//! `saga_input` (tenant, source) / `saga_apply` (saga, correlation id) around each input the
//! saga worker applies (debug level: an enabled span costs microseconds per input on the
//! commit path, so at the default level a warning there names its key itself). In text the
//! spans are a prefix of the line; in JSON they are under `span` and `spans`.
//!
//! Metrics live in one Prometheus [`Registry`] owned by the application. Every collector is
//! defined and registered here, once, by [`Metrics::new`]: the `families` submodules list
//! every metric Runner exports, with its help text, one file per part of Runner that
//! updates them; components only update the handles they are given.
//! Names follow `runner_<what>_<unit>[_total]` and labels come from bounded sets only.

use prometheus::{
    Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry,
};

mod families;
mod logging;

pub use logging::{DEFAULT_FILTER, Every, escape_controls, init_logging};

pub mod names;
use names::{EFFECT_ATTEMPT_OUTCOMES, EFFECT_RESULT_TYPES, TRANSITION_OUTCOMES};
pub mod otel;
pub mod stall;

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
    /// See [`names::SAGA_BATCH_SIZE`].
    pub saga_batch_size: Histogram,
    /// See [`names::SAGA_DEFERRED_INPUTS_TOTAL`].
    pub saga_deferred: IntCounter,
    /// See [`names::SAGA_COMMIT_SECONDS`].
    pub saga_commit_seconds: Histogram,
    /// See [`names::SAGA_TRANSITIONS_TOTAL`].
    pub saga_transitions: IntCounterVec,
    /// See [`names::SAGA_INPUTS_TOTAL`].
    pub saga_inputs: IntCounterVec,
    /// See [`names::SAGA_UNROUTED_TOTAL`].
    pub saga_unrouted: IntCounter,
    /// See [`names::CONSUMER_LAG`].
    pub consumer_lag: IntGaugeVec,
    /// See [`names::CONSUMER_CHECKPOINT`].
    pub consumer_checkpoint: IntGaugeVec,
    /// See [`names::OUTBOX_DEPTH`].
    pub outbox_depth: IntGauge,
    /// See [`names::RELAY_PUBLISHED_TOTAL`].
    pub relay_published: IntCounter,
    /// See [`names::RELAY_ERRORS_TOTAL`].
    pub relay_errors: IntCounter,
    /// Stages of the saga pipeline failing without progress ([`stall`]).
    pub stalls: std::sync::Arc<stall::Stalls>,
    /// See [`names::PIPELINE_STALLED_STAGES`].
    pub pipeline_stalled: IntGauge,
    /// See [`names::RELAY_PARKED_TOTAL`].
    pub relay_parked: IntCounter,
    /// See [`names::ADMIN_CONNECTIONS`].
    pub admin_connections: IntGauge,
    /// See [`names::ADMIN_CONNECTIONS_REFUSED_TOTAL`].
    pub admin_connections_refused: IntCounter,
    /// See [`names::ADMIN_CONNECTIONS_EVICTED_TOTAL`].
    pub admin_connections_evicted: IntCounter,
    /// See [`names::RELAY_WINDOW_SECONDS`].
    pub relay_window_seconds: Histogram,
    /// See [`names::TIMERS_PENDING`].
    pub timers_pending: IntGauge,
    /// See [`names::TIMERS_FIRED_TOTAL`].
    pub timers_fired: IntCounter,
    /// See [`names::TIMER_FIRE_LAG_SECONDS`].
    pub timer_fire_lag: Histogram,
    /// See [`names::SAGA_ADMISSION_WAIT_SECONDS`].
    pub admission_wait: Histogram,
    /// See [`names::SAGA_INPUT_WAIT_SECONDS`].
    pub input_wait: Histogram,
    /// See [`names::EFFECT_QUEUE_SECONDS`].
    pub effect_queue: Histogram,
    /// See [`names::DEADLETTERS_TOTAL`].
    pub deadletters: IntCounterVec,
    /// See [`names::TENANT_WAITING_INPUTS`].
    pub tenant_waiting: IntGaugeVec,
    /// See [`names::TENANT_OLDEST_WAIT_SECONDS`].
    pub tenant_oldest_wait: prometheus::GaugeVec,
    /// See [`names::TENANT_INPUTS_TOTAL`].
    pub tenant_inputs: IntCounterVec,
    /// See [`names::TENANT_RATE_LIMITED_TOTAL`].
    pub tenant_rate_limited: IntCounterVec,
    /// See [`names::TENANT_OUTBOX_CAPPED_TOTAL`].
    pub tenant_outbox_capped: IntCounterVec,
    /// See [`names::TENANT_OUTBOX_BYTES`].
    pub tenant_outbox_bytes: IntGaugeVec,
    /// See [`names::TENANT_APPLIED_TOTAL`].
    pub tenant_applied: IntCounterVec,
    /// See [`names::TENANT_EFFECT_CALLS_TOTAL`].
    pub tenant_effect_calls: IntCounterVec,
    /// See [`names::TENANT_EFFECT_RATE_LIMITED_TOTAL`].
    pub tenant_effect_rate_limited: IntCounterVec,
    /// See [`names::TENANT_LIVE_INSTANCES`].
    pub tenant_live: IntGaugeVec,
    /// `runner_tenant_pending_timers`.
    pub tenant_timers: IntGaugeVec,
    /// See [`names::TENANT_HELD_AT_CAP`].
    pub tenant_held_at_cap: IntGaugeVec,
    /// See [`names::TENANT_OLDEST_HELD_AT_CAP_SECONDS`].
    pub tenant_oldest_held_at_cap: prometheus::GaugeVec,
    /// See [`names::PARTITIONS_OWNED`].
    pub partitions_owned: IntGauge,
    /// See [`names::PARTITION_EPOCH`].
    pub partition_epoch: IntGaugeVec,
    /// See [`names::PARTITION_LAG`].
    pub partition_lag: IntGaugeVec,
    /// See [`names::PARTITION_CHECKPOINT`].
    pub partition_checkpoint: IntGaugeVec,
    /// See [`names::LEASE_EVENTS_TOTAL`].
    pub lease_events: IntCounterVec,
    /// See [`names::FENCED_REJECTIONS_TOTAL`].
    pub fenced_rejections: IntCounter,
    /// See [`names::RELAY_SUPPRESSED_TOTAL`].
    pub relay_suppressed: IntCounter,
    /// See [`names::ROUTER_COPIES_TOTAL`].
    pub router_copies: IntCounter,
    /// See [`names::PARTITION_START_SECONDS`].
    pub partition_start_seconds: Histogram,
    /// See [`names::PARTITION_HANDOFF_SECONDS`].
    pub partition_handoff_seconds: Histogram,
    /// See [`names::PARTITION_RESTORES_TOTAL`].
    pub partition_restores: IntCounterVec,
    /// See [`names::PARTITION_REPLAYED_TOTAL`].
    pub partition_replayed: IntCounter,
    /// See [`names::SNAPSHOTS_TOTAL`].
    pub snapshots: IntCounter,
    /// See [`names::SNAPSHOT_ROUND_SECONDS`].
    pub snapshot_round_seconds: Histogram,
    /// See [`names::SNAPSHOT_LAST_TIMESTAMP`].
    pub snapshot_last_timestamp: IntGaugeVec,
    /// See [`names::INBOX_RETENTION`].
    pub inbox_retention: IntGauge,
    /// See [`names::RETENTION_GAPS_TOTAL`].
    pub retention_gaps: IntCounter,
    /// See [`names::REFUSED_OBJECTS_TOTAL`].
    pub refused_objects: IntCounterVec,
    /// See [`names::STORE_PAGES_DIRTIED_TOTAL`]; advanced by [`Metrics::store_pages_dirtied_upto`].
    pub store_pages_dirtied: IntCounter,
    /// The libmdbx count the counter above has reached.
    store_pages_seen: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// See [`names::STORAGE_WRITE_FAILING`]; set by [`Metrics::storage_writes`].
    pub storage_write_failing: IntGauge,
    /// See [`names::STORAGE_WRITE_FAILURES_TOTAL`]; advanced by [`Metrics::storage_writes`].
    pub storage_write_failures: IntCounterVec,
    /// The store's counts (`disk_full`, `other`) the counter above has reached.
    storage_failures_seen: std::sync::Arc<[std::sync::atomic::AtomicU64; 2]>,
    /// See [`names::EFFECT_CLAIMS_TOTAL`].
    pub effect_claims: IntCounterVec,
    /// See [`names::EFFECT_COMMANDS_TOTAL`].
    pub effect_commands: IntCounterVec,
    /// See [`names::EFFECT_RESULTS_TOTAL`].
    pub effect_results: IntCounterVec,
    /// See [`names::EFFECT_ATTEMPTS_TOTAL`].
    pub effect_attempts: IntCounterVec,
    /// See [`names::EFFECT_SECONDS`].
    pub effect_seconds: HistogramVec,
    /// See [`names::EFFECT_CIRCUIT_STATE`].
    pub effect_circuit_state: IntGaugeVec,
    /// See [`names::EFFECT_IN_FLIGHT`].
    pub effect_in_flight: IntGauge,
    /// See [`names::EFFECT_DEADLETTERS_LOCAL`].
    pub effect_deadletters_local: IntCounter,
}

impl Metrics {
    /// Creates the registry with process metrics and the core collectors, registered family
    /// by family (the `families` submodules).
    pub fn new(version: &str, revision: &str, mode: &str) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let service = families::service::register(&registry, version, revision, mode)?;
        let admin = families::admin::register(&registry)?;
        let saga = families::saga::register(&registry)?;
        let router = families::router::register(&registry)?;
        let timers = families::timer::register(&registry)?;
        let relay = families::relay::register(&registry)?;
        let effect = families::effect::register(&registry)?;
        let ownership = families::ownership::register(&registry)?;
        let recovery = families::recovery::register(&registry)?;
        let storage = families::store::register(&registry)?;
        let tenant = families::tenant::register(&registry)?;
        Ok(Self {
            registry,
            nats_connected: service.nats_connected,
            draining: service.draining,
            manifest_reloads: service.manifest_reloads,
            manifest_sagas: service.manifest_sagas,
            saga_batch_size: saga.saga_batch_size,
            saga_deferred: saga.saga_deferred,
            saga_commit_seconds: saga.saga_commit_seconds,
            saga_transitions: saga.saga_transitions,
            saga_inputs: saga.saga_inputs,
            saga_unrouted: router.saga_unrouted,
            consumer_lag: router.consumer_lag,
            consumer_checkpoint: router.consumer_checkpoint,
            outbox_depth: relay.outbox_depth,
            relay_published: relay.relay_published,
            relay_errors: relay.relay_errors,
            stalls: Default::default(),
            pipeline_stalled: service.pipeline_stalled,
            relay_parked: relay.relay_parked,
            admin_connections: admin.admin_connections,
            admin_connections_refused: admin.admin_connections_refused,
            admin_connections_evicted: admin.admin_connections_evicted,
            relay_window_seconds: relay.relay_window_seconds,
            timers_pending: timers.timers_pending,
            timers_fired: timers.timers_fired,
            timer_fire_lag: timers.timer_fire_lag,
            admission_wait: router.admission_wait,
            input_wait: saga.input_wait,
            effect_queue: effect.effect_queue,
            deadletters: service.deadletters,
            tenant_waiting: tenant.waiting,
            tenant_oldest_wait: tenant.oldest_wait,
            tenant_inputs: tenant.inputs,
            tenant_rate_limited: tenant.rate_limited,
            tenant_outbox_capped: tenant.outbox_capped,
            tenant_outbox_bytes: tenant.outbox_bytes,
            tenant_applied: tenant.applied,
            tenant_effect_calls: tenant.effect_calls,
            tenant_effect_rate_limited: tenant.effect_rate_limited,
            tenant_live: tenant.live,
            tenant_timers: tenant.timers,
            tenant_held_at_cap: tenant.held_at_cap,
            tenant_oldest_held_at_cap: tenant.oldest_held_at_cap,
            partitions_owned: ownership.partitions_owned,
            partition_epoch: ownership.partition_epoch,
            partition_lag: ownership.partition_lag,
            partition_checkpoint: ownership.partition_checkpoint,
            lease_events: ownership.lease_events,
            fenced_rejections: relay.fenced_rejections,
            relay_suppressed: relay.relay_suppressed,
            router_copies: router.router_copies,
            partition_start_seconds: ownership.partition_start_seconds,
            partition_handoff_seconds: ownership.partition_handoff_seconds,
            partition_restores: recovery.partition_restores,
            partition_replayed: recovery.partition_replayed,
            snapshots: recovery.snapshots,
            snapshot_round_seconds: recovery.snapshot_round_seconds,
            snapshot_last_timestamp: recovery.snapshot_last_timestamp,
            inbox_retention: recovery.inbox_retention,
            retention_gaps: recovery.retention_gaps,
            refused_objects: recovery.refused_objects,
            store_pages_dirtied: storage.store_pages_dirtied,
            store_pages_seen: Default::default(),
            storage_write_failing: storage.storage_write_failing,
            storage_write_failures: storage.storage_write_failures,
            storage_failures_seen: Default::default(),
            effect_claims: effect.effect_claims,
            effect_commands: effect.effect_commands,
            effect_results: effect.effect_results,
            effect_attempts: effect.effect_attempts,
            effect_seconds: effect.effect_seconds,
            effect_circuit_state: effect.effect_circuit_state,
            effect_in_flight: effect.effect_in_flight,
            effect_deadletters_local: effect.effect_deadletters_local,
        })
    }

    /// Creates, at zero, the series a dashboard or alert reads for every saga and effect a
    /// node runs, so a freshly started node shows 0 rather than no data: each saga's
    /// transitions by outcome and the inputs read from `inbox` (when it runs sagas); each
    /// effect's attempts by outcome, results by type, call time and circuit state (when it
    /// runs effects). Called at start and after each manifest reload; series that exist are
    /// left as they are.
    pub fn declare<'a>(
        &self,
        sagas: Option<(impl Iterator<Item = &'a str>, &str)>,
        effects: Option<impl Iterator<Item = &'a str>>,
    ) {
        if let Some((sagas, inbox)) = sagas {
            self.saga_inputs.with_label_values(&[inbox]);
            for saga in sagas {
                for outcome in TRANSITION_OUTCOMES {
                    self.saga_transitions.with_label_values(&[saga, outcome]);
                }
            }
        }
        for effect in effects.into_iter().flatten() {
            for outcome in EFFECT_ATTEMPT_OUTCOMES {
                self.effect_attempts.with_label_values(&[effect, outcome]);
            }
            for result_type in EFFECT_RESULT_TYPES {
                self.effect_results
                    .with_label_values(&[effect, result_type]);
            }
            self.effect_seconds.with_label_values(&[effect]);
            self.tenant_effect_calls
                .with_label_values(&["other", effect]);
            self.tenant_effect_rate_limited
                .with_label_values(&["other", effect]);
            self.effect_circuit_state.with_label_values(&[effect]);
        }
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
