//! Command-line interface: `runner run | validate | test`.
//!
//! The CLI only parses; `main.rs` dispatches. Flags given on the command line override the
//! config file and the environment.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Long version string: crate version and the git revision it was built from.
pub const LONG_VERSION: &str =
    concat!(env!("CARGO_PKG_VERSION"), " (", env!("RUNNER_GIT_REV"), ")");

/// Runner executes sagas and side-effect workflows on NATS JetStream.
///
/// Sagas and effects are declared in YAML manifests. State lives in a local libmdbx
/// database; NATS JetStream carries every event and command.
#[derive(Debug, Parser)]
#[command(name = "runner", version = LONG_VERSION, propagate_version = true)]
pub struct Cli {
    /// Log output format.
    #[arg(long, value_enum, global = true, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `runner graph --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GraphFormat {
    /// Mermaid `stateDiagram-v2`.
    Mermaid,
    /// Graphviz DOT.
    Dot,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the service: connect to NATS, open local storage, serve the admin endpoints and
    /// process work until drained (SIGTERM, SIGINT or `POST /admin/drain`).
    Run(RunArgs),
    /// Check manifest files and report every problem with file:line:column.
    ///
    /// Exits 1 when any error is found; warnings are printed and exit 0.
    Validate {
        /// Manifest files or directories (searched for *.yaml / *.yml).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Also check against the store in this data directory: refuse manifests that
        /// would strand running instances (a saga version neither loaded nor migratable).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Run the test cases kept beside manifests (`*.tests.yaml`) against the pure engine.
    ///
    /// Loads every manifest under the paths, runs every test file found there, prints a
    /// readable difference for each failure and a summary line. Exits 1 on any failure.
    Test {
        /// Manifest and test files or directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Draw sagas as state diagrams: every state, and on each edge the event, the guard
    /// and what the transition emits (effects, commands, events, timers). Orchestrations are
    /// drawn with the states their instances move through, compensations included.
    Graph {
        /// Manifest files or directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Only this saga (default: every saga found).
        #[arg(long)]
        saga: Option<String>,
        /// Only this version of `--saga` (default: the newest).
        #[arg(long, requires = "saga")]
        saga_version: Option<u32>,
        /// `mermaid` (a `stateDiagram-v2`, which GitHub and many Markdown viewers draw) or
        /// `dot` (Graphviz: `runner graph … --format dot | dot -Tsvg > saga.svg`).
        #[arg(long, value_enum, default_value = "mermaid")]
        format: GraphFormat,
    },
    /// Check a manifest change before deploying it: replay the recorded history of the
    /// instances a store holds through the manifests in force (`--current`) and the new ones
    /// (`--manifest`), and report, per instance, the first step where the new ones would
    /// decide differently (another state, command, event or timer). Reads the recorded
    /// inputs back from JetStream; writes nothing. Exits 1 when any instance would differ.
    Replay {
        /// Where the store is (`--data-dir`; `--manifest` names the NEW manifests here).
        #[command(flatten)]
        store: StoreArgs,
        /// The manifests in force now (files or directories).
        #[arg(long, required = true)]
        current: Vec<PathBuf>,
        /// NATS server holding the streams the inputs came from.
        #[arg(long, default_value = "nats://127.0.0.1:4222", env = "RUNNER_NATS_URL")]
        nats_url: String,
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// Only this saga.
        #[arg(long)]
        saga: Option<String>,
        /// At most this many instances (0: all).
        #[arg(long, default_value_t = 0)]
        limit: usize,
        /// Text or JSON.
        #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Show one saga instance from the local store: state, status, version, data, pending
    /// timers and recent transitions (JSON). Works while the node runs.
    Inspect {
        /// Where the store is.
        #[command(flatten)]
        store: StoreArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Saga name.
        #[arg(long)]
        saga: String,
        /// Correlation id of the instance.
        #[arg(long)]
        id: String,
        /// `json` (the default: the instance, its timers, recent transitions, what parks
        /// it) or `text` (a summary line, then one line per transition).
        #[arg(long, value_enum, default_value_t = OutputFormat::Json)]
        output: OutputFormat,
    },
    /// Pause or resume a tenant's sagas, through a running saga node (`--admin URL`):
    /// while paused, its inputs are held whole; resuming applies them in order.
    Tenants {
        /// The node to ask (`--admin`, `--admin-token-file`).
        #[command(flatten)]
        store: StoreArgs,
        /// What to do.
        #[command(subcommand)]
        action: TenantsAction,
    },
    /// Partition operations on the node that owns the partition (`--admin URL`).
    Partitions {
        /// The node to ask (`--admin`, `--admin-token-file`).
        #[command(flatten)]
        store: StoreArgs,
        /// What to do.
        #[command(subcommand)]
        action: PartitionsAction,
    },
    /// Saga instances from the local store's index (works while the node runs).
    Instances {
        /// Where the store is.
        #[command(flatten)]
        store: StoreArgs,
        /// What to do.
        #[command(subcommand)]
        action: InstancesAction,
    },
    /// Migrate a tenant's instances of a saga from version N to N+1, as N+1's `migration`
    /// declares (both versions loaded from the manifests). Committed in batches; running it
    /// again after a crash finishes the job. Prints the report (JSON) with a sample before
    /// and after. Exits 1 when some instance could not be migrated.
    Migrate {
        /// Where the store and the manifests are.
        #[command(flatten)]
        store: StoreArgs,
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Saga name.
        #[arg(long)]
        saga: String,
        /// The version to migrate from.
        #[arg(long)]
        from: u32,
        /// Show what would change; write nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Dead letters: list them, show one, or redrive one.
    Dlq {
        /// Where the store is.
        #[command(flatten)]
        store: StoreArgs,
        /// What to do.
        #[command(subcommand)]
        action: DlqAction,
    },
}

/// Locating the store (and, for redrive, the manifests) the way `runner run` does.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// TOML config file (its `storage`, `runner.manifests` and `tenancy` are used).
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// Directory of the store. Replaces `storage.data_dir`.
    #[arg(long, global = true)]
    pub data_dir: Option<PathBuf>,
    /// Manifest file or directory (for redrive); repeat for several.
    #[arg(long = "manifest", global = true)]
    pub manifests: Vec<PathBuf>,
    /// Ask a running node's admin API (`http://host:port`) instead of opening a data
    /// directory: inspect, instances list, dlq list/show/redrive and migrate. The token
    /// comes from `--admin-token-file` or the `RUNNER_ADMIN_TOKEN` environment variable.
    #[arg(long, global = true)]
    pub admin: Option<String>,
    /// File holding the admin token (for `--admin`).
    #[arg(long, global = true)]
    pub admin_token_file: Option<PathBuf>,
    /// PEM certificate of a private CA to trust, besides the public roots, for an
    /// `--admin https://…` node whose `admin.tls_cert_file` it signed.
    #[arg(long, global = true, env = "RUNNER_ADMIN_CA_FILE")]
    pub admin_ca_file: Option<PathBuf>,
}

/// `runner instances` actions.
#[derive(Debug, Subcommand)]
pub enum InstancesAction {
    /// One page of a tenant's instances of a saga, oldest first.
    List {
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Saga name.
        #[arg(long)]
        saga: String,
        /// Only instances in this state.
        #[arg(long)]
        state: Option<String>,
        /// Only instances started at least this long ago (e.g. `15m`, `2h`, `7d`).
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<std::time::Duration>,
        /// Page size (1 to 1000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Continue after this point (the `next` a previous page printed).
        #[arg(long)]
        after: Option<String>,
        /// `text` (a line per instance, then `next: …`) or `json`.
        #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
}

/// `runner partitions` actions.
#[derive(Debug, Subcommand)]
pub enum PartitionsAction {
    /// Read a partition's inbox again from a sequence: inputs already applied (by event
    /// id), answered results and fired timers are skipped, published outputs are not sent
    /// again, but an input without an event id is applied again. Without --confirm it only
    /// says what it would do.
    Replay {
        /// The partition.
        #[arg(long)]
        partition: u32,
        /// The first inbox sequence to read again.
        #[arg(long)]
        from: u64,
        /// Do it.
        #[arg(long)]
        confirm: bool,
    },
}

/// `runner tenants` actions.
#[derive(Debug, Subcommand)]
pub enum TenantsAction {
    /// Hold every input of the tenant (events, effect results, timers) from now on.
    Pause {
        /// Tenant.
        #[arg(long)]
        tenant: String,
    },
    /// Apply what was held for the tenant, key by key in arrival order, and let it flow.
    Resume {
        /// Tenant.
        #[arg(long)]
        tenant: String,
    },
    /// Each tenant's use of the node against its limits: new inputs waiting at its
    /// routers, the oldest's wait, inputs let in, weight, rate limit, whether paused.
    List {
        /// `text` (a line per tenant) or `json`.
        #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Re-read the node's config file and put its `[tenancy]` weights, rate limits and
    /// effect rate limits in force, without a restart (ask each node).
    Reload,
}

/// How a read command prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Lines for people.
    Text,
    /// One JSON document.
    Json,
}

/// `runner dlq` actions.
#[derive(Debug, Subcommand)]
pub enum DlqAction {
    /// One page of pending dead letters (one line each, or JSON), a tenant's oldest first.
    List {
        /// Only this tenant.
        #[arg(long)]
        tenant: Option<String>,
        /// Include redriven ones.
        #[arg(long)]
        all: bool,
        /// List the dead-letter stream instead (what effect workers refused, among others),
        /// newest first; read through a node, so it needs `--admin`.
        #[arg(long)]
        stream: bool,
        /// Page size (1 to 1000); a page may hold fewer when its answer would pass 4 MiB.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Continue after this point (the `next` a previous page printed).
        #[arg(long)]
        after: Option<String>,
        /// `text` (a line per letter, a count, then `next: …` when more follow) or `json`
        /// (the page: `items`, `next`, …).
        #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
        output: OutputFormat,
    },
    /// Show one dead letter in full.
    Show {
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Dead-letter id.
        id: u64,
        /// `json` (the default) or `text` (one `field: value` line each).
        #[arg(long, value_enum, default_value_t = OutputFormat::Json)]
        output: OutputFormat,
    },
    /// Process a dead letter again, then the inputs of its key held behind it, in order.
    /// With `--stream`: put the effect command kept in that letter of the dead-letter
    /// stream back on its subject, once (through a node: needs `--admin`).
    Redrive {
        /// Tenant.
        #[arg(long)]
        tenant: String,
        /// Dead-letter id (with `--stream`, its sequence in the dead-letter stream, as
        /// `dlq list --stream` shows it).
        id: u64,
        /// Redrive a letter of the dead-letter stream (an effect command) instead.
        #[arg(long)]
        stream: bool,
    },
    /// Remove dead letters from the store (all that match the filters). A pending entry
    /// its key is parked behind is kept unless --force, which also unparks the key.
    Purge {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// Only those older than this (e.g. `7d`, `12h`).
        #[arg(long)]
        older_than: Option<String>,
        /// Only this kind (`undecodable`, `too_large`, ...).
        #[arg(long)]
        kind: Option<String>,
        /// Also remove entries that park their key (and unpark it).
        #[arg(long)]
        force: bool,
        /// List what would be removed; remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Arguments of `runner run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Which roles this process plays.
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// TOML config file. Without it, built-in defaults and RUNNER__* variables apply.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Manifest file or directory; repeat for several. Replaces `runner.manifests`.
    #[arg(long = "manifest")]
    pub manifests: Vec<PathBuf>,
    /// NATS server URL; repeat or separate with commas for a cluster. Replaces `nats.urls`.
    #[arg(long = "nats-url", value_delimiter = ',')]
    pub nats_urls: Vec<String>,
    /// Address of the admin HTTP server (port 0 picks a free port). Replaces `admin.addr`.
    #[arg(long)]
    pub admin_addr: Option<SocketAddr>,
    /// Directory for local state. Replaces `storage.data_dir`.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
}

/// The roles a `runner run` process plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Consume events and advance sagas.
    Saga,
    /// Execute effect commands.
    Effect,
    /// Both roles in one process.
    Combined,
}

impl Mode {
    /// Whether this mode runs the saga worker.
    pub fn runs_sagas(self) -> bool {
        matches!(self, Mode::Saga | Mode::Combined)
    }
    /// Whether this mode runs the effect worker.
    pub fn runs_effects(self) -> bool {
        matches!(self, Mode::Effect | Mode::Combined)
    }
    /// The lowercase name used in config and `/info`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Saga => "saga",
            Mode::Effect => "effect",
            Mode::Combined => "combined",
        }
    }
}
