//! Wiring: builds the components from [`Config`] and runs them on one cancellation tree.
//!
//! Start order: open storage, connect to NATS (bounded retry), reconcile streams, load the
//! manifests, bind the admin server, then start the workers of the configured mode. Any
//! failure before the admin server is up stops the start with one clear error.
//!
//! Shutdown is a drain, whatever starts it (`POST /admin/drain`, SIGTERM, SIGINT):
//! `/ready` turns 503 at once, workers stop taking new work and finish what they hold, then
//! the process exits 0. If the drain outlasts `runner.drain_timeout` the process exits 1.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::broker::{self, Broker};
use crate::config::Config;
use crate::manifest::{self, Catalog, Diagnostic};
use crate::relay::{Relay, RelayHandle};
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

/// Errors that stop the start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Storage could not be opened.
    #[error("storage at {path}: {source}")]
    Storage {
        /// Data directory.
        path: String,
        /// Why.
        source: crate::storage::StorageError,
    },
    /// NATS or stream set-up failed.
    #[error(transparent)]
    Broker(#[from] broker::BrokerError),
    /// Manifests are invalid.
    #[error("manifests are invalid:\n{}", .0.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("\n"))]
    Manifests(Vec<Diagnostic>),
    /// The admin server could not bind.
    #[error("cannot listen on admin address {addr}: {source}")]
    AdminBind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Metrics registry set-up failed.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Drained cleanly.
    Drained,
    /// The drain outlasted `runner.drain_timeout`.
    DrainTimedOut,
}

/// Picks the node id: config, then `RUNNER_NODE_ID`, then `HOSTNAME`, then a random UUID.
pub fn node_id(configured: &str, env: impl Fn(&str) -> Option<String>) -> String {
    let pick = |v: Option<String>| v.map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    pick(Some(configured.to_string()))
        .or_else(|| pick(env("RUNNER_NODE_ID")))
        .or_else(|| pick(env("HOSTNAME")))
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

/// Starts everything and runs until drained.
pub async fn run(config: Config, lifecycle: Arc<Lifecycle>) -> Result<Exit, StartError> {
    let node_id = node_id(&config.node.id, |k| std::env::var(k).ok());
    let mode = config.runner.mode;
    tracing::info!(message = "Starting.", node.id = %node_id, mode = mode.as_str(), version = VERSION, revision = GIT_REVISION);

    let storage_cfg = config.storage.clone();
    let store = tokio::task::spawn_blocking(move || Store::open(&storage_cfg))
        .await
        .map_err(|e| StartError::Storage {
            path: config.storage.data_dir.display().to_string(),
            source: crate::storage::StorageError::Task(e.to_string()),
        })?
        .map_err(|source| StartError::Storage {
            path: config.storage.data_dir.display().to_string(),
            source,
        })?;

    let broker = Broker::connect(&config.nats).await?;
    broker::ensure_streams(broker.jetstream(), &config.streams).await?;
    let claims_kv = if mode.runs_effects() {
        Some(crate::effect::ensure_claims_bucket(broker.jetstream(), &config).await?)
    } else {
        None
    };

    let paths = config.runner.manifests.clone();
    let report = tokio::task::spawn_blocking(move || manifest::load(&paths))
        .await
        .map_err(|e| {
            StartError::Manifests(vec![Diagnostic {
                file: Default::default(),
                line: 0,
                column: 0,
                severity: manifest::Severity::Error,
                message: format!("manifest loader failed: {e}"),
            }])
        })?;
    let catalog = match report.catalog {
        Some(c) => c,
        None => return Err(StartError::Manifests(report.diagnostics)),
    };
    let stranded = stranded_in(&store, &catalog).await;
    if !stranded.is_empty() {
        return Err(StartError::Manifests(stranded));
    }
    for w in &report.diagnostics {
        tracing::warn!(message = "Manifest warning.", diagnostic = %w);
    }

    let metrics = Metrics::new(VERSION, GIT_REVISION, mode.as_str())?;
    metrics
        .manifest_sagas
        .set(catalog.summary().sagas.len() as i64);
    let listener = TcpListener::bind(config.admin.addr)
        .await
        .map_err(|source| StartError::AdminBind {
            addr: config.admin.addr,
            source,
        })?;
    let admin_addr = listener
        .local_addr()
        .map_err(|source| StartError::AdminBind {
            addr: config.admin.addr,
            source,
        })?;

    let drain_timeout = config.runner.drain_timeout.get();
    let state = Arc::new(AppState {
        config,
        node_id,
        broker,
        store,
        metrics,
        lifecycle,
        catalog: RwLock::new(Arc::new(catalog)),
        started_at: SystemTime::now(),
    });

    // The admin server outlives the drain so `/ready` can report it; it stops last.
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(crate::admin::serve(
        listener,
        state.clone(),
        admin_stop.clone(),
    ));
    tracing::info!(message = "Admin server listening.", admin.addr = %admin_addr);

    // Workers of the configured mode run on this tracker and watch the work token; the
    // relay runs beside them and is stopped only after they finish, so it flushes what
    // their last commits wrote.
    let workers = TaskTracker::new();
    let relay_stop = CancellationToken::new();
    let mut relay_task = None;
    if mode.runs_sagas() {
        let handle = RelayHandle::new();
        let relay = Relay {
            js: state.broker.jetstream().clone(),
            store: state.store.clone(),
            metrics: state.metrics.clone(),
            handle: handle.clone(),
            window: state.config.saga.relay_window,
            poll: state.config.saga.relay_poll.get(),
        };
        relay_task = Some(tokio::spawn(relay.run(relay_stop.clone())));
        crate::worker::spawn(
            &workers,
            state.clone(),
            handle,
            state.lifecycle.work_token(),
        );
    }
    if let Some(kv) = claims_kv {
        crate::effect::spawn(&workers, state.clone(), kv, state.lifecycle.work_token());
    }
    workers.close();

    state.lifecycle.mark_started();
    tracing::info!(message = "Ready.", mode = mode.as_str());

    state.lifecycle.work_token().cancelled().await;
    state.metrics.draining.set(1);
    let deadline = tokio::time::Instant::now() + drain_timeout;
    let mut exit = Exit::Drained;
    if tokio::time::timeout_at(deadline, workers.wait())
        .await
        .is_err()
    {
        tracing::error!(message = "Drain timed out waiting for workers.", timeout = ?drain_timeout);
        exit = Exit::DrainTimedOut;
    }
    relay_stop.cancel();
    if let Some(task) = relay_task
        && tokio::time::timeout_at(deadline, task).await.is_err()
    {
        tracing::error!(
            message =
                "Drain timed out flushing the outbox; the rest is published on the next start."
        );
        exit = Exit::DrainTimedOut;
    }
    if tokio::time::timeout_at(deadline, state.broker.client().flush())
        .await
        .is_err()
    {
        tracing::warn!(message = "Flushing the NATS connection timed out during drain.");
    }
    if exit == Exit::Drained {
        tracing::info!(message = "Drained.");
    }
    admin_stop.cancel();
    let _ = admin_task.await;
    Ok(exit)
}
