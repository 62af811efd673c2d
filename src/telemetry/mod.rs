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
//! defined and registered here, once, by [`Metrics::new`] (so one file lists every metric
//! Runner exports, with its help text); components only update the handles they are given.
//! Names follow `runner_<what>_<unit>[_total]` and labels come from bounded sets only.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

mod logging;

pub use logging::{DEFAULT_FILTER, Every, escape_controls, init_logging};

pub mod names;
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
    /// See [`names::SNAPSHOT_LAST_TIMESTAMP`].
    pub snapshot_last_timestamp: IntGaugeVec,
    /// See [`names::INBOX_RETENTION`].
    pub inbox_retention: IntGauge,
    /// See [`names::RETENTION_GAPS_TOTAL`].
    pub retention_gaps: IntCounter,
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

fn reg<C: prometheus::core::Collector + Clone + 'static>(
    r: &Registry,
    c: C,
) -> prometheus::Result<C> {
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

/// The `reason` label values of [`names::STORAGE_WRITE_FAILURES_TOTAL`], in the order of
/// [`crate::storage::WriteFailures`]' fields.
const STORAGE_FAILURE_REASONS: [&str; 2] = ["disk_full", "other"];

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

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
        for outcome in ["applied", "rejected"] {
            manifest_reloads.with_label_values(&[outcome]);
        }
        let manifest_sagas =
            IntGauge::new(names::MANIFEST_SAGAS, "Saga versions currently loaded.")?;
        registry.register(Box::new(manifest_sagas.clone()))?;
        let r = &registry;
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            reg(
                r,
                Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?,
            )
        };
        let saga_batch_size = hist(
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
        let saga_unrouted = reg(
            r,
            IntCounter::new(names::SAGA_UNROUTED_TOTAL, "Inputs no saga wanted.")?,
        )?;
        let consumer_lag = reg(
            r,
            IntGaugeVec::new(
                Opts::new(
                    names::CONSUMER_LAG,
                    "Messages in a source stream after the last one its router read.",
                ),
                &["stream"],
            )?,
        )?;
        let consumer_checkpoint = reg(
            r,
            IntGaugeVec::new(
                Opts::new(
                    names::CONSUMER_CHECKPOINT,
                    "Last source sequence routed into the saga inbox.",
                ),
                &["stream"],
            )?,
        )?;
        let outbox_depth = reg(
            r,
            IntGauge::new(names::OUTBOX_DEPTH, "Records waiting in the outbox.")?,
        )?;
        let relay_published = reg(
            r,
            IntCounter::new(
                names::RELAY_PUBLISHED_TOTAL,
                "Outbox records published and acknowledged.",
            )?,
        )?;
        let relay_errors = reg(
            r,
            IntCounter::new(names::RELAY_ERRORS_TOTAL, "Failed relay rounds.")?,
        )?;
        let admin_connections = reg(
            r,
            IntGauge::new(names::ADMIN_CONNECTIONS, "Admin connections open now.")?,
        )?;
        let admin_connections_refused = reg(
            r,
            IntCounter::new(
                names::ADMIN_CONNECTIONS_REFUSED_TOTAL,
                "Admin connections closed at once: admin.max_connections were open, each with a request in flight.",
            )?,
        )?;
        let admin_connections_evicted = reg(
            r,
            IntCounter::new(
                names::ADMIN_CONNECTIONS_EVICTED_TOTAL,
                "Admin connections closed to make room for a newer one at admin.max_connections: the one open that had waited longest without a request in flight.",
            )?,
        )?;
        let relay_parked = reg(
            r,
            IntCounter::new(
                names::RELAY_PARKED_TOTAL,
                "Outputs the relay parked and dead-lettered: the broker can never take them.",
            )?,
        )?;
        let pipeline_stalled = reg(
            r,
            IntGauge::new(
                names::PIPELINE_STALLED_STAGES,
                "Relays and routers failing on every attempt for 30 s or more (read at each scrape).",
            )?,
        )?;
        let relay_window_seconds = hist(
            names::RELAY_WINDOW_SECONDS,
            "Seconds from publishing a window of outbox records to all acknowledged.",
            LATENCY_BUCKETS,
        )?;
        let timers_pending = reg(
            r,
            IntGauge::new(names::TIMERS_PENDING, "Timers waiting to fire.")?,
        )?;
        let timers_fired = reg(
            r,
            IntCounter::new(names::TIMERS_FIRED_TOTAL, "Timers fired.")?,
        )?;
        let timer_fire_lag = hist(
            names::TIMER_FIRE_LAG_SECONDS,
            "Seconds between a timer's due time and its firing.",
            LATENCY_BUCKETS,
        )?;
        let input_wait = hist(
            names::SAGA_INPUT_WAIT_SECONDS,
            "Seconds from an input being stored to the saga worker reading it.",
            LATENCY_BUCKETS,
        )?;
        let effect_queue = hist(
            names::EFFECT_QUEUE_SECONDS,
            "Seconds from an effect command being stored to a worker starting on it.",
            LATENCY_BUCKETS,
        )?;
        let admission_wait = hist(
            names::SAGA_ADMISSION_WAIT_SECONDS,
            "Seconds a batch of new aggregate events waited behind work under way.",
            LATENCY_BUCKETS,
        )?;
        let deadletters = reg(
            r,
            IntCounterVec::new(
                Opts::new(names::DEADLETTERS_TOTAL, "Dead letters by kind."),
                &["kind"],
            )?,
        )?;
        // Every kind exists from the start, so a zero reads as zero, not as a missing series.
        for k in crate::deadletter::kind::ALL {
            deadletters.with_label_values(&[k]);
        }
        let counters = |name: &str, help: &str, labels: &[&str]| {
            reg(r, IntCounterVec::new(Opts::new(name, help), labels)?)
        };
        let effect_claims = counters(
            names::EFFECT_CLAIMS_TOTAL,
            "Effect claim events by event.",
            &["event"],
        )?;
        let effect_commands = counters(
            names::EFFECT_COMMANDS_TOTAL,
            "Effect commands not executed on delivery, by outcome.",
            &["outcome"],
        )?;
        let effect_results = counters(
            names::EFFECT_RESULTS_TOTAL,
            "Effect results published, by effect and result type.",
            &["effect", "result_type"],
        )?;
        let effect_attempts = counters(
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
        let fenced_rejections = reg(
            r,
            IntCounter::new(
                names::FENCED_REJECTIONS_TOTAL,
                "Fenced publishes refused by the broker.",
            )?,
        )?;
        let relay_suppressed = reg(
            r,
            IntCounter::new(
                names::RELAY_SUPPRESSED_TOTAL,
                "Outbox records a predecessor had already published.",
            )?,
        )?;
        let router_copies = reg(
            r,
            IntCounter::new(names::ROUTER_COPIES_TOTAL, "Input copies routed.")?,
        )?;
        let partition_start_seconds = hist(
            names::PARTITION_START_SECONDS,
            "Seconds from winning a partition lease to reading its inbox.",
            LATENCY_BUCKETS,
        )?;
        let partition_handoff_seconds = hist(
            names::PARTITION_HANDOFF_SECONDS,
            "Seconds from stopping a partition to releasing its lease.",
            LATENCY_BUCKETS,
        )?;
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
        let store_pages_dirtied = reg(
            r,
            IntCounter::new(
                names::STORE_PAGES_DIRTIED_TOTAL,
                "Store pages write transactions added or copied for update (about the pages commits write).",
            )?,
        )?;
        let storage_write_failing = reg(
            r,
            IntGauge::new(
                names::STORAGE_WRITE_FAILING,
                "1 while storage writes fail: the last write transaction failed (read at each scrape).",
            )?,
        )?;
        let storage_write_failures = reg(
            r,
            IntCounterVec::new(
                Opts::new(
                    names::STORAGE_WRITE_FAILURES_TOTAL,
                    "Write transactions failed in libmdbx, by reason (disk_full: ENOSPC on the data directory's disk; other).",
                ),
                &["reason"],
            )?,
        )?;
        for reason in STORAGE_FAILURE_REASONS {
            storage_write_failures
                .with_label_values(&[reason])
                .inc_by(0);
        }
        Ok(Self {
            registry,
            effect_claims,
            effect_commands,
            effect_results,
            effect_attempts,
            effect_seconds,
            effect_circuit_state,
            effect_in_flight,
            effect_deadletters_local,
            nats_connected,
            draining,
            manifest_reloads,
            manifest_sagas,
            saga_batch_size,
            saga_deferred,
            saga_commit_seconds,
            saga_transitions,
            saga_inputs,
            saga_unrouted,
            consumer_lag,
            consumer_checkpoint,
            outbox_depth,
            relay_published,
            relay_errors,
            relay_parked,
            stalls: Default::default(),
            pipeline_stalled,
            admin_connections,
            admin_connections_refused,
            admin_connections_evicted,
            relay_window_seconds,
            timers_pending,
            timers_fired,
            timer_fire_lag,
            admission_wait,
            input_wait,
            effect_queue,
            deadletters,
            partitions_owned,
            partition_epoch,
            partition_lag,
            partition_checkpoint,
            lease_events,
            fenced_rejections,
            relay_suppressed,
            router_copies,
            partition_start_seconds,
            partition_handoff_seconds,
            partition_restores,
            partition_replayed,
            snapshots,
            snapshot_last_timestamp,
            inbox_retention,
            retention_gaps,
            store_pages_dirtied,
            store_pages_seen: Default::default(),
            storage_write_failing,
            storage_write_failures,
            storage_failures_seen: Default::default(),
        })
    }

    /// Sets [`names::STORAGE_WRITE_FAILING`] and brings [`names::STORAGE_WRITE_FAILURES_TOTAL`]
    /// up to the store's counts (each failure added once, whatever the order of scrapes).
    pub fn storage_writes(&self, failing: bool, failures: crate::storage::WriteFailures) {
        use std::sync::atomic::Ordering;
        self.storage_write_failing.set(i64::from(failing));
        let totals = [failures.disk_full, failures.other];
        for ((reason, total), seen) in STORAGE_FAILURE_REASONS
            .iter()
            .zip(totals)
            .zip(self.storage_failures_seen.iter())
        {
            let before = seen.fetch_max(total, Ordering::SeqCst);
            if total > before {
                self.storage_write_failures
                    .with_label_values(&[reason])
                    .inc_by(total - before);
            }
        }
    }

    /// Brings [`names::STORE_PAGES_DIRTIED_TOTAL`] up to `total`, libmdbx's running count;
    /// scrapes at the same time add each page once.
    pub fn store_pages_dirtied_upto(&self, total: u64) {
        use std::sync::atomic::Ordering;
        let seen = self.store_pages_seen.fetch_max(total, Ordering::SeqCst);
        if total > seen {
            self.store_pages_dirtied.inc_by(total - seen);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_counter_follows_the_store_s_count_once_whatever_the_order_of_scrapes() {
        let m = Metrics::new("0", "r", "saga").expect("registers");
        m.store_pages_dirtied_upto(10);
        m.store_pages_dirtied_upto(7); // a scrape that read earlier, answering later
        assert_eq!(m.store_pages_dirtied.get(), 10);
        m.store_pages_dirtied_upto(15);
        m.store_pages_dirtied_upto(15);
        assert_eq!(m.store_pages_dirtied.get(), 15);
        assert!(m.encode().contains("runner_store_pages_dirtied_total 15"));
    }

    #[test]
    fn storage_write_failures_are_counted_once_by_reason_and_the_gauge_follows_the_store() {
        use crate::storage::WriteFailures;
        let m = Metrics::new("0", "r", "saga").expect("registers");
        let text = m.encode();
        assert!(text.contains("runner_storage_write_failing 0"), "{text}");
        assert!(
            text.contains(r#"runner_storage_write_failures_total{reason="disk_full"} 0"#),
            "both reasons are exported before any failure: {text}"
        );
        let failures = |disk_full, other| WriteFailures { disk_full, other };
        m.storage_writes(true, failures(3, 1));
        m.storage_writes(true, failures(2, 1)); // a scrape that read earlier, answering later
        let text = m.encode();
        assert!(text.contains("runner_storage_write_failing 1"), "{text}");
        assert!(text.contains(r#"runner_storage_write_failures_total{reason="disk_full"} 3"#));
        assert!(text.contains(r#"runner_storage_write_failures_total{reason="other"} 1"#));
        m.storage_writes(false, failures(3, 1));
        assert!(m.encode().contains("runner_storage_write_failing 0"));
    }
}
