//! The context every component shares: the loaded config, this node's identity, the NATS
//! broker, the store, the metrics, the manifests in force and the lifecycle (started,
//! draining).
//!
//! It sits below the components: admin, worker and effect read it, and only the wiring in
//! [`crate::app`] builds it. Guarantees: the manifests in force are swapped whole (a reader
//! sees the old catalog or the new one, never a mix), and a reload that is invalid or would
//! strand stored instances leaves the old catalog in force; a drain begins once, and
//! cancels the work token every worker watches.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use tokio_util::sync::CancellationToken;

use crate::broker::Broker;
use crate::config::Config;
use crate::manifest::{self, Catalog, Diagnostic};
use crate::placement::Placement;
use crate::storage::Store;
use crate::telemetry::Metrics;

/// Crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Git revision the binary was built from.
pub const GIT_REVISION: &str = env!("RUNNER_GIT_REV");

/// Start and drain state shared by every component.
#[derive(Debug)]
pub struct Lifecycle {
    started: AtomicBool,
    draining: AtomicBool,
    /// Cancelled when the drain begins: workers stop taking new work.
    work: CancellationToken,
}

impl Lifecycle {
    /// A lifecycle that has neither started nor begun draining.
    pub fn new() -> Self {
        Self {
            started: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            work: CancellationToken::new(),
        }
    }
    /// Marks start-up complete.
    pub fn mark_started(&self) {
        self.started.store(true, Ordering::SeqCst);
    }
    /// Whether the process is started and not draining.
    pub fn is_ready(&self) -> bool {
        self.started.load(Ordering::SeqCst) && !self.is_draining()
    }
    /// Whether a drain has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
    /// Begins the drain; returns false if one had already begun.
    pub fn begin_drain(&self, why: &str) -> bool {
        let first = !self.draining.swap(true, Ordering::SeqCst);
        if first {
            tracing::info!(message = "Drain started.", reason = why);
            self.work.cancel();
        }
        first
    }
    /// The token workers watch to stop taking new work.
    pub fn work_token(&self) -> CancellationToken {
        self.work.clone()
    }
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self::new()
    }
}

/// Everything the admin endpoints and workers share.
pub struct AppState {
    /// The loaded config.
    pub config: Config,
    /// This replica's identity.
    pub node_id: String,
    /// Its data directory's identity ([`crate::storage::lock::NodeLock::store_id`]): leases
    /// it holds carry it, so a process started again on the directory takes them back.
    pub store_id: String,
    /// NATS.
    pub broker: Broker,
    /// Local storage.
    pub store: Store,
    /// Metrics registry.
    pub metrics: Metrics,
    /// Start/drain state.
    pub lifecycle: Arc<Lifecycle>,
    /// The manifests in force; swapped whole on reload.
    catalog: RwLock<Arc<Catalog>>,
    /// When the process started.
    pub started_at: SystemTime,
    /// Node mode, and what this replica holds in partitioned mode.
    pub placement: Placement,
    /// Tenants paused now (`worker/pause.rs`).
    pub paused: crate::asked::Paused,
    /// What each tenant uses of this node's routers (`crate::fair::Usage`).
    pub tenants: crate::fair::Usage,
    /// The `[tenancy]` limits in force (`crate::quota`): read them here, not from
    /// `config`, which keeps the values the node started with.
    pub limits: crate::quota::Limits,
    /// Partition replays asked for by an operator (`worker/replay.rs`).
    pub replays: crate::asked::Replays,
    /// Fenced batches shared by this process's partition relays (`relay/combine.rs`).
    pub shared_batches: Arc<crate::relay::combine::Combiner>,
    /// Every relay of this node, for the node-wide outbox depth.
    pub relays: Arc<crate::relay::Relays>,
    /// The deployment key's seals (snapshots, control inputs).
    pub seal: crate::seal::Seal,
    /// Input bytes read ahead of their commit, shared by every input consumer of the node
    /// (`saga.max_pull_bytes`, [`crate::readahead`]).
    pub readahead: Arc<crate::readahead::Budget>,
}

/// Result of a manifest reload.
#[derive(Debug)]
pub enum ReloadOutcome {
    /// The new catalog is in force.
    Applied {
        /// Its summary.
        catalog: Arc<Catalog>,
        /// Warnings found.
        warnings: Vec<Diagnostic>,
    },
    /// The old catalog stays in force.
    Rejected {
        /// Every problem found.
        diagnostics: Vec<Diagnostic>,
    },
}

impl AppState {
    /// The shared context of a started node, with `catalog` in force.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: Config,
        node_id: String,
        store_id: String,
        broker: Broker,
        store: Store,
        metrics: Metrics,
        lifecycle: Arc<Lifecycle>,
        catalog: Catalog,
        seal: crate::seal::Seal,
    ) -> Self {
        declare(&metrics, &config, &catalog);
        let limits = crate::quota::Limits::new(config.tenancy.clone());
        let readahead = crate::readahead::Budget::new(config.saga.max_pull_bytes.get());
        Self {
            config,
            node_id,
            store_id,
            broker,
            store,
            metrics,
            lifecycle,
            catalog: RwLock::new(Arc::new(catalog)),
            started_at: SystemTime::now(),
            placement: Placement::default(),
            paused: Default::default(),
            tenants: Default::default(),
            limits,
            replays: Default::default(),
            shared_batches: Default::default(),
            relays: Default::default(),
            seal,
            readahead,
        }
    }

    /// The manifests in force.
    pub fn catalog(&self) -> Arc<Catalog> {
        match self.catalog.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Running instances whose saga version `catalog` could not run or migrate, as
    /// diagnostics (empty when none, or when storage cannot be read — then the error is one).
    pub async fn stranded_by(&self, catalog: &Catalog) -> Vec<Diagnostic> {
        stranded_in(&self.store, catalog).await
    }

    /// Re-reads the config file the node started with (and its environment, as at start)
    /// and puts its `[tenancy]` limits in force ([`crate::quota::Limits::replace`]) when
    /// the whole config is valid; otherwise the error names the file, line and key, and
    /// the limits in force stay.
    pub fn reload_tenancy(&self) -> Result<crate::quota::Changed, crate::config::ConfigError> {
        let c = &self.config;
        let overrides = crate::config::Overrides {
            mode: Some(c.runner.mode),
            manifests: c.runner.manifests.clone(),
            nats_urls: c.nats.urls.clone(),
            admin_addr: Some(c.admin.addr),
            data_dir: Some(c.storage.data_dir.clone()),
        };
        let next = match crate::config::load(c.source.as_deref(), std::env::vars(), &overrides) {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(message = "Tenancy reload rejected; the limits in force stay.", error = %e);
                return Err(e);
            }
        };
        let mut changed = self.limits.replace(next.tenancy);
        changed.warnings =
            crate::quota::unknown_effects(&self.limits.get(), &self.catalog().summary().effects);
        for w in &changed.warnings {
            tracing::warn!(message = "A tenancy limit holds nothing.", problem = %w);
        }
        tracing::info!(
            message = "Tenancy limits reloaded.",
            applied = ?changed.applied,
            at_next_start = ?changed.restart
        );
        Ok(changed)
    }

    /// Re-reads and validates the configured manifests; swaps them in only when valid.
    pub async fn reload_manifests(&self) -> ReloadOutcome {
        let paths = self.config.runner.manifests.clone();
        let report = match tokio::task::spawn_blocking(move || manifest::load(&paths)).await {
            Ok(r) => r,
            Err(e) => {
                return ReloadOutcome::Rejected {
                    diagnostics: vec![Diagnostic {
                        file: Default::default(),
                        line: 0,
                        column: 0,
                        severity: manifest::Severity::Error,
                        message: format!("manifest loader failed: {e}"),
                    }],
                };
            }
        };
        let stranded = match &report.catalog {
            Some(c) => self.stranded_by(c).await,
            None => Vec::new(),
        };
        match report.catalog {
            Some(_) if !stranded.is_empty() => {
                self.metrics
                    .manifest_reloads
                    .with_label_values(&["rejected"])
                    .inc();
                tracing::warn!(
                    message = "Manifest reload rejected: it would strand running instances."
                );
                ReloadOutcome::Rejected {
                    diagnostics: stranded,
                }
            }
            Some(c) => {
                declare(&self.metrics, &self.config, &c);
                let c = Arc::new(c);
                match self.catalog.write() {
                    Ok(mut g) => *g = c.clone(),
                    Err(poisoned) => *poisoned.into_inner() = c.clone(),
                }
                self.metrics
                    .manifest_reloads
                    .with_label_values(&["applied"])
                    .inc();
                self.metrics
                    .manifest_sagas
                    .set(c.summary().sagas.len() as i64);
                tracing::info!(
                    message = "Manifests reloaded.",
                    sagas = c.summary().sagas.len()
                );
                ReloadOutcome::Applied {
                    catalog: c,
                    warnings: report.diagnostics,
                }
            }
            None => {
                self.metrics
                    .manifest_reloads
                    .with_label_values(&["rejected"])
                    .inc();
                tracing::warn!(
                    message = "Manifest reload rejected; the previous manifests stay in force.",
                    errors = report.errors().count()
                );
                ReloadOutcome::Rejected {
                    diagnostics: report.diagnostics,
                }
            }
        }
    }
}

/// Running instances in `store` that `catalog` would strand, as diagnostics.
pub async fn stranded_in(store: &Store, catalog: &Catalog) -> Vec<Diagnostic> {
    match store.read(|t| t.running_versions()).await {
        Ok(in_use) => catalog
            .stranded(&in_use)
            .iter()
            .map(|s| s.to_diagnostic())
            .collect(),
        Err(e) => vec![Diagnostic {
            file: "<store>".into(),
            line: 0,
            column: 0,
            severity: manifest::Severity::Error,
            message: format!("cannot read running instances: {e}"),
        }],
    }
}

/// The series of `catalog`'s sagas and effects this node's mode runs, created at zero
/// ([`Metrics::declare`]).
fn declare(metrics: &Metrics, config: &Config, catalog: &Catalog) {
    let mode = config.runner.mode;
    metrics.declare(
        mode.runs_sagas()
            .then(|| (catalog.saga_names(), config.streams.saga_inbox.as_str())),
        mode.runs_effects().then(|| catalog.effect_names()),
    );
}
