//! Configuration: typed, layered, validated once.
//!
//! Layers, later ones winning: built-in defaults, the TOML file, `RUNNER__SECTION__KEY`
//! environment variables, command-line flags. Then [`Config::validate`] runs once. Unknown
//! keys are rejected wherever they come from, and every error names where the bad value came
//! from (file, line and column, or the environment variable) and the key path.
//!
//! `config/default.toml` lists every key with its default and a comment; a test keeps it in
//! step with [`Config::default`].
//!
//! Inside: `mod.rs` holds [`Config`] and its sections with their defaults; `load.rs` the
//! layering; `validate.rs` the checks; `types.rs` durations and byte sizes; `error.rs`
//! [`ConfigError`].

mod error;
mod load;
mod security;
mod tenancy;
mod types;
mod validate;

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use error::ConfigError;
pub use load::{ENV_PREFIX, Overrides, load};
pub use security::{MIN_DEPLOYMENT_KEY_BYTES, SecurityConfig};
pub use tenancy::TenancyConfig;
pub use types::{ByteSize, HumanDuration};
pub use validate::is_subject_token;

use crate::cli::Mode;

/// Removes `user:password@` (or a token) from a URL before it is shown anywhere: logs,
/// errors, `/info`. URLs with credentials are refused by validation; this guards the
/// messages that name such a URL while refusing it.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            format!("{}://***@{}", &url[..scheme_end], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}
/// The whole configuration of one `runner` process.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// What this process runs.
    pub runner: RunnerConfig,
    /// This replica's identity.
    pub node: NodeConfig,
    /// How to reach NATS.
    pub nats: NatsConfig,
    /// JetStream stream names and settings.
    pub streams: StreamsConfig,
    /// Durable consumer names.
    pub consumers: ConsumersConfig,
    /// Tenants.
    pub tenancy: TenancyConfig,
    /// Local libmdbx storage.
    pub storage: StorageConfig,
    /// Admin HTTP server.
    pub admin: AdminConfig,
    /// Saga worker, outbox relay and timers.
    pub saga: SagaConfig,
    /// Effect worker: claims, concurrency, acknowledgement timing.
    pub effect: EffectConfig,
    /// Saga partitions and their ownership (scale-out).
    pub partitions: PartitionsConfig,
    /// Distributed tracing: OTLP export of one span per hop.
    pub tracing: TracingConfig,
    /// The deployment key that seals snapshots and control inputs.
    pub security: SecurityConfig,
    /// The file this config was read from, if any (not a key: [`load`] sets it, and a
    /// reload of the tenancy limits reads the same file).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[tracing]`: span export over OTLP/HTTP (see `telemetry::otel` for the hops).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// Base URL of an OTLP/HTTP receiver (an OpenTelemetry Collector, Jaeger, Tempo…), for
    /// example `http://otel-collector:4318`; spans are posted as protobuf to
    /// `<otlp_endpoint>/v1/traces`. Unset (the default): no spans are made, and the
    /// `traceparent` of each input is passed on unchanged.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Share (0.0–1.0) of the traces that start here (inputs without a `traceparent`) that
    /// are recorded. Inputs that carry one follow its sampled flag.
    pub sample_ratio: f64,
    /// How often queued spans are sent.
    pub export_interval: HumanDuration,
    /// How long one export may take before it is given up (its spans are dropped).
    pub export_timeout: HumanDuration,
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: "runner".into(),
            sample_ratio: 1.0,
            export_interval: HumanDuration::secs(5),
            export_timeout: HumanDuration::secs(10),
        }
    }
}

/// `[partitions]`: saga partitions, owned one replica at a time through leases.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PartitionsConfig {
    /// Gone: saga mode is always partitioned. Still accepted, so a configuration written for
    /// an older release loads; a start that finds it set says so in one warning.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Number of partitions P (1..=1024). Fixed per deployment: changing it re-maps keys.
    pub count: u32,
    /// Lease TTL: the bucket's `max_age`; renewed every third of it (1s..=5m).
    pub lease_ttl: HumanDuration,
    /// KV bucket of partition and router leases and member heartbeats.
    pub leases_bucket: String,
    /// Object Store bucket of partition snapshots.
    pub snapshot_bucket: String,
    /// How often each owned partition is snapshotted (also on every hand-over); a long round
    /// spaces out the next, so rounds take at most a tenth of the node's time.
    pub snapshot_interval: HumanDuration,
    /// Snapshots kept per partition (the newest is never deleted).
    pub snapshot_keep: usize,
}

impl Default for PartitionsConfig {
    fn default() -> Self {
        Self {
            enabled: None,
            count: 64,
            lease_ttl: HumanDuration::secs(10),
            leases_bucket: "RUNNER_LEASES".into(),
            snapshot_bucket: "RUNNER_SNAPSHOTS".into(),
            snapshot_interval: HumanDuration::secs(30),
            snapshot_keep: 3,
        }
    }
}

/// `[effect]`: the effect worker.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EffectConfig {
    /// Most commands of one effect one process executes at once (1..=10000). Each effect
    /// has its own consumer and its own share, so a slow effect cannot take the slots of
    /// another; a process runs at most this many per effect (the catch-all consumer,
    /// which answers commands no effect consumer covers, has a share of its own too).
    pub concurrency: usize,
    /// How long JetStream waits for an acknowledgement before redelivering a command
    /// (the worker sends progress acknowledgements while a command runs). The default,
    /// 20 s, is the default `lease_ttl` plus 5 s: a dead worker's commands come back about
    /// when their claims lapse, so another worker runs them within `lease_ttl` + 5 s.
    pub ack_wait: HumanDuration,
    /// Most commands of one effect delivered and not yet acknowledged, across all replicas
    /// (1..=1000000): each effect's consumer has this limit of its own.
    pub max_ack_pending: i64,
    /// Most deliveries of one command (2..=10000). A command handed back that often (its
    /// dead letter could not be stored, a claim stayed busy, drains kept handing it back)
    /// is dead-lettered as `redelivery_limit` on its last delivery instead of being handed
    /// back again, so no command loops forever and none is dropped silently.
    pub max_deliver: i64,
    /// JetStream KV bucket holding the claims (created at start when missing).
    pub claims_bucket: String,
    /// Lease of a claim: renewed every third of it; another worker may take the command over
    /// only after it passed unrenewed.
    pub lease_ttl: HumanDuration,
    /// How long a claim record is kept after its last write (the bucket's `max_age`): a
    /// command redelivered later than this is executed again.
    pub claim_retention: HumanDuration,
    /// Timeout of one call when the effect declares no `timeout_ms`.
    pub default_timeout: HumanDuration,
    /// Most command bytes one effect's loop holds at once, pulled or executing (1MiB to
    /// 16GiB; raised to the server's `max_payload` when that is larger, so any command
    /// fits). Large commands then run fewer at a time instead of filling memory. The
    /// default covers 64 slots of 1 MiB commands, so pulls carry a byte limit only when
    /// the budget is set below `concurrency` × `max_payload`.
    pub max_inflight_bytes: ByteSize,
    /// Most commands of one effect a process holds read but not yet started, beyond its
    /// free slots (0..=100000; within `max_inflight_bytes`): they start in tenants' turns
    /// (`tenancy.weights`), so one tenant's queue of commands does not hold another
    /// tenant's behind it. 0: read only as many as there are free slots, in stream order.
    pub read_ahead: usize,
}

impl Default for EffectConfig {
    fn default() -> Self {
        Self {
            concurrency: 64,
            ack_wait: HumanDuration::secs(20),
            max_ack_pending: 1024,
            max_deliver: 100,
            claims_bucket: "RUNNER_EFFECT_CLAIMS".into(),
            lease_ttl: HumanDuration::secs(15),
            claim_retention: HumanDuration::secs(7 * 24 * 3600),
            default_timeout: HumanDuration::secs(30),
            max_inflight_bytes: ByteSize::mib(128),
            read_ahead: 1024,
        }
    }
}

/// `[saga]`: the saga worker, its outbox relay and its timers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SagaConfig {
    /// Most inputs applied in one libmdbx transaction (1..=10000).
    pub batch_size: usize,
    /// Largest input accepted, headers and body together; larger ones are dead-lettered as
    /// `too_large`.
    pub max_message_bytes: ByteSize,
    /// Most input bytes applied in one transaction: a batch of large events is split so
    /// (one larger input is a batch of its own). Also the most output bytes one
    /// transaction writes: it stops taking inputs there (the rest go to the next one), and
    /// an input whose outputs alone pass it is dead-lettered as `too_large`. Partitioned
    /// mode: also the most bytes of copies a router sends in one batch (one input's copies
    /// stay together).
    pub max_batch_bytes: ByteSize,
    /// About the most input bytes the node's saga input consumers ask for and read ahead of
    /// their commits, all together: each consumer open (an owned partition's loop, a routed
    /// share's router) takes an equal part (`crate::readahead`), and its pull's message
    /// count follows the average input size within that part (1 to 500 messages). A
    /// router's inputs waiting for admission are held to this much per share.
    pub max_pull_bytes: ByteSize,
    /// Fetching pauses while the outbox holds more records than this (backpressure).
    pub max_outbox_depth: u64,
    /// Most outbox records published before their acknowledgements are awaited (1..=10000).
    pub relay_window: usize,
    /// How often the relay looks at the outbox when no commit woke it.
    pub relay_poll: HumanDuration,
    /// How often the timer loop looks for due timers when none is known to be due sooner.
    pub timer_poll: HumanDuration,
    /// How long per-event dedupe markers are kept. They catch one event published twice
    /// under two stream sequences; the checkpoint already covers re-reads of one sequence.
    pub dedupe_retention: HumanDuration,
    /// Dead letters older than this are removed from the store by the retention sweep,
    /// except a pending one its key is parked behind (an operator redrives or purges it).
    pub dead_letter_retention: HumanDuration,
    /// Finished instances (completed, failed, compensated) not updated for this long are
    /// removed with their history; their dedupe markers stay for `dedupe_retention`, so a
    /// late duplicate is still recognised. Instances waiting for an operator are kept.
    pub finished_retention: HumanDuration,
    /// JetStream KV bucket of operator controls shared by every saga node (created when
    /// missing): which tenants are paused (`runner tenants pause`).
    pub control_bucket: String,
    /// Work under way goes first: while this many effect commands are queued behind sagas
    /// already started, the aggregate stream's router copies no new input into the saga
    /// inbox (and of a batch read, only as many as there is room for); new triggers wait in
    /// their stream. 0: off. Queued commands wait on their stream in arrival order, so the
    /// bound is also how long another tenant's new command can wait behind them; keep it
    /// above the effect slots that must stay busy when upstreams are slow.
    pub max_queued_work: u64,
    /// How far an input's `timestamp_ms` (the producer's clock, the saga's time: timer due
    /// times are computed from it) may lie from the time the broker stored the input; one
    /// outside is applied at the nearest edge of that window (0 to 30 days). The same on
    /// every saga node, like the manifests: a replay applies an input with the window in
    /// force then.
    pub max_clock_skew: HumanDuration,
}

impl Default for SagaConfig {
    fn default() -> Self {
        Self {
            batch_size: 1024,
            max_message_bytes: ByteSize::mib(1),
            max_batch_bytes: ByteSize::mib(64),
            max_pull_bytes: ByteSize::mib(32),
            max_outbox_depth: 100_000,
            relay_window: 1024,
            relay_poll: HumanDuration::secs(1),
            timer_poll: HumanDuration::millis(200),
            dedupe_retention: HumanDuration::secs(7 * 24 * 3600),
            dead_letter_retention: HumanDuration::secs(30 * 24 * 3600),
            finished_retention: HumanDuration::secs(7 * 24 * 3600),
            control_bucket: "RUNNER_CONTROL".into(),
            max_queued_work: 512,
            max_clock_skew: HumanDuration::secs(300),
        }
    }
}

/// `[runner]`: roles and manifests.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RunnerConfig {
    /// Roles of this process: "saga", "effect" or "combined".
    pub mode: Mode,
    /// Manifest files or directories (a list, or one comma-separated string).
    #[serde(deserialize_with = "types::paths_or_list")]
    pub manifests: Vec<PathBuf>,
    /// Longest time a drain may take before the process exits anyway (with status 1).
    pub drain_timeout: HumanDuration,
    /// Threads of the async runtime; 0: automatic ([`RunnerConfig::async_threads`]).
    pub worker_threads: usize,
}

impl RunnerConfig {
    /// The async runtime's thread count for a machine with `cores` cores (cgroup CPU quotas
    /// included): `worker_threads` when set, else half the cores, at least one. The other
    /// half is left to the threads outside the runtime — the commit thread that applies and
    /// writes every batch, store reads — and, often, to a broker on the same host. On two
    /// cores one async thread instead of two took 7-23 % off the CPU per order at 50 % and
    /// 80 % load, about as much at the maximum rate, and 35-50 % off the context switches,
    /// and cost no throughput (docs/benchmarks.md, fourteenth session): the tasks hand each
    /// other work all the time, and a second thread mostly parked and woke to take it.
    pub fn async_threads(&self, cores: usize) -> usize {
        match self.worker_threads {
            0 => (cores / 2).max(1),
            n => n,
        }
    }
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Combined,
            manifests: vec![PathBuf::from("manifests")],
            drain_timeout: HumanDuration::secs(30),
            worker_threads: 0,
        }
    }
}

/// `[node]`: replica identity.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Node id. Empty: env `RUNNER_NODE_ID`, then `HOSTNAME`, then a random UUID.
    pub id: String,
}

/// `[nats]`: connection settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// Server URLs (a list, or one comma-separated string).
    #[serde(deserialize_with = "types::string_or_list")]
    pub urls: Vec<String>,
    /// How long to keep trying the first connection before giving up.
    pub connect_timeout: HumanDuration,
    /// How long to keep retrying stream and bucket set-up at start (after the first
    /// connection) while JetStream is not answering yet, e.g. while a cluster elects its
    /// leaders.
    pub setup_timeout: HumanDuration,
    /// Timeout of JetStream API requests.
    pub request_timeout: HumanDuration,
    /// Client name shown by the server.
    pub client_name: String,
    /// Authentication token.
    pub token: Option<String>,
    /// User name (with `password`).
    pub user: Option<String>,
    /// Password (with `user`).
    pub password: Option<String>,
    /// File holding an nkey seed.
    pub nkey_seed_file: Option<PathBuf>,
    /// NATS credentials file (JWT + seed).
    pub creds_file: Option<PathBuf>,
    /// Require TLS.
    pub tls_required: bool,
    /// CA certificate (PEM) to trust.
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// Client key (PEM), with `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            urls: vec!["nats://127.0.0.1:4222".into()],
            connect_timeout: HumanDuration::secs(30),
            setup_timeout: HumanDuration::secs(60),
            request_timeout: HumanDuration::secs(5),
            client_name: "runner".into(),
            token: None,
            user: None,
            password: None,
            nkey_seed_file: None,
            creds_file: None,
            tls_required: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

/// JetStream storage backend for streams.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StreamStorage {
    /// On disk.
    File,
    /// In memory (tests, demos).
    Memory,
}

/// `[streams]`: the streams Runner reads and writes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StreamsConfig {
    /// Create missing streams at start (existing ones are checked, never changed).
    pub create: bool,
    /// Storage of streams Runner creates.
    pub storage: StreamStorage,
    /// Replicas of streams Runner creates (1..=5).
    pub replicas: usize,
    /// JetStream de-duplication window of streams Runner creates.
    pub duplicate_window: HumanDuration,
    /// Aggregate events (read).
    pub aggregate_events: String,
    /// Effect commands and aggregate commands (written by the outbox relay).
    pub workflow_commands: String,
    /// Effect results and workflow events.
    pub workflow_events: String,
    /// Internal routed saga inbox.
    pub saga_inbox: String,
    /// Dead letters.
    pub dead_letter: String,
    /// Oldest message kept in the streams Runner creates, dead-letter stream aside
    /// (`max_age`): inputs not consumed by then are gone, so it must outlast any outage
    /// you want to ride out. At least 1h and at least `duplicate_window`.
    pub max_age: HumanDuration,
    /// Most bytes each of those streams holds (`max_bytes`; 0: no byte limit, `max_age`
    /// bounds them). JetStream reserves it up front, so keep it within the server's
    /// storage. When full, new publishes are refused (discard policy `new`): publishers and
    /// the relay see errors and retry, and nothing unconsumed is dropped.
    pub max_bytes: ByteSize,
    /// Oldest message kept in the dead-letter stream (each dead letter also stays in the
    /// node's store until purged).
    pub dead_letter_max_age: HumanDuration,
    /// Most bytes the dead-letter stream holds; the oldest dead letters make room for new
    /// ones (discard policy `old`), so dead-lettering never blocks the outputs.
    pub dead_letter_max_bytes: ByteSize,
}

impl Default for StreamsConfig {
    fn default() -> Self {
        Self {
            create: true,
            storage: StreamStorage::File,
            replicas: 1,
            duplicate_window: HumanDuration::secs(120),
            max_age: HumanDuration::secs(7 * 24 * 3600),
            max_bytes: ByteSize::mib(0),
            dead_letter_max_age: HumanDuration::secs(30 * 24 * 3600),
            dead_letter_max_bytes: ByteSize::mib(256),
            aggregate_events: "AGGREGATE_EVENTS".into(),
            workflow_commands: "WORKFLOW_COMMANDS".into(),
            workflow_events: "WORKFLOW_EVENTS".into(),
            saga_inbox: "SAGA_INBOX".into(),
            dead_letter: "RUNNER_DLQ".into(),
        }
    }
}

/// `[consumers]`: durable consumer names.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumersConfig {
    /// Saga worker's durable consumer on the event streams.
    pub saga: String,
    /// Effect workers' durable consumers on the command stream: this name for the
    /// catch-all, `<name>-<effect>` for each effect's own.
    pub effect: String,
    /// A consumer that has delivered nothing for this long is probed: when its stream holds
    /// a message for it past what it delivered, it is recreated (logged, and counted in
    /// `runner_consumer_recreated_total`). 500ms to 60s.
    pub stall_check: HumanDuration,
    /// Timeout of each attempt to reopen a consumer (and of the stall probe). Short, so
    /// attempts during a leader election fail fast and are retried with backoff instead of
    /// waiting out `nats.request_timeout`. 100ms to `nats.request_timeout`.
    pub reopen_timeout: HumanDuration,
}

impl Default for ConsumersConfig {
    fn default() -> Self {
        Self {
            saga: "runner-saga".into(),
            effect: "runner-effect".into(),
            stall_check: HumanDuration::secs(3),
            reopen_timeout: HumanDuration::secs(1),
        }
    }
}

/// How hard a libmdbx commit pushes data to disk.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// fsync on every commit: an acknowledged input survives power loss. The default.
    Full,
    /// No fsync of the meta page: a power loss (not a process crash) may roll back the last
    /// commits. Inputs acked after them would then be lost. Only for disposable data.
    NoMetaSync,
    /// No fsync at all: a power loss may lose or corrupt recent commits. Tests and demos only.
    UnsafeNoSync,
}

/// `[storage]`: local libmdbx database.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Directory holding the database.
    pub data_dir: PathBuf,
    /// Commit durability.
    pub durability: Durability,
    /// Largest size the database file may grow to.
    pub max_size: ByteSize,
    /// Step by which the file grows.
    pub growth_step: ByteSize,
    /// Page size of a store this node creates: a power of two, 4KiB to 64KiB. A store that
    /// exists keeps the page size it was created with.
    pub page_size: ByteSize,
    /// Write commits through the memory map, with the kernel's readahead off, instead of
    /// writing dirty pages to the file: less CPU per commit for stores far larger than one
    /// commit's pages (a million instances), more for small ones. Under `Durability::Full`
    /// durability is the same; under the relaxed modes, processes writing the store at the
    /// same time must agree on it (libmdbx refuses the next one).
    pub write_map: bool,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("data"),
            durability: Durability::Full,
            max_size: ByteSize::gib(64),
            growth_step: ByteSize::mib(64),
            page_size: ByteSize::kib(8),
            write_map: false,
        }
    }
}

/// `[admin]`: the admin HTTP server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Listen address (port 0 picks a free port, which is logged).
    pub addr: SocketAddr,
    /// Bearer token required on `/admin/*`. Prefer setting it through `RUNNER__ADMIN__TOKEN`
    /// or `token_file` rather than in a committed file.
    pub token: Option<String>,
    /// File whose (trimmed) content is the bearer token.
    pub token_file: Option<PathBuf>,
    /// Most admin connections open at once (1..=10000), so a flood of connections cannot
    /// take the descriptors the node needs for NATS. At the cap a new connection takes the
    /// slot of the open one that has waited longest without a request in flight (closed),
    /// so slow or idle connections cannot starve the probes; it is refused only when every
    /// open one has a request in flight.
    pub max_connections: usize,
    /// A connection that sends or receives nothing for this long is closed (half-open
    /// requests, idle keep-alives).
    pub idle_timeout: HumanDuration,
    /// The longest one connection may stay open, however busy (bounds a slowly dripped
    /// request; scrapers simply reconnect).
    pub connection_timeout: HumanDuration,
    /// PEM certificate chain (server certificate first): with `tls_key_file`, the admin
    /// API, probes and `/metrics` are served over TLS only.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            token: None,
            token_file: None,
            max_connections: 64,
            idle_timeout: HumanDuration::secs(10),
            connection_timeout: HumanDuration::secs(60),
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}
