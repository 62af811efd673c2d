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
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::broker::{self, Broker};
use crate::config::Config;
use crate::manifest::{self, Diagnostic};
use crate::runtime::{AppState, GIT_REVISION, Lifecycle, VERSION, stranded_in};
use crate::storage::Store;
use crate::telemetry::Metrics;

/// Errors that stop the start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Storage could not be opened. (The cause is this error's source, which the one-line
    /// report in `main.rs` joins on, so the message does not repeat it.)
    #[error("storage at {path}")]
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
    /// The admin server could not bind (the cause as above).
    #[error("cannot listen on admin address {addr}")]
    AdminBind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Metrics registry set-up failed.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// A replica of a single-active release runs on these streams, or what one left could
    /// not be taken over.
    #[error(transparent)]
    Upgrade(#[from] crate::worker::ownership::upgrade::UpgradeError),
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Drained cleanly.
    Drained,
    /// The drain outlasted `runner.drain_timeout`.
    DrainTimedOut,
}

/// Picks the node id: config, then `RUNNER_NODE_ID`, then `HOSTNAME`, then the data
/// directory's id (`store`, [`crate::storage::lock::NodeLock::store_id`]: the same across
/// restarts on that directory, so a replica started again is the same member and takes its
/// partitions back at once), then a random UUID. The configured id is checked by
/// validation; one taken from the environment is made usable (anything but letters, digits,
/// `-` and `_` becomes `-`, at most 64 characters), since it names keys and subjects (a host
/// name such as `a.b.c` would nest KV keys).
pub fn node_id(
    configured: &str,
    env: impl Fn(&str) -> Option<String>,
    store: Option<&str>,
) -> String {
    let pick = |v: Option<String>| v.map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    let usable = |s: String| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '-'
                }
            })
            .take(64)
            .collect()
    };
    pick(Some(configured.to_string()))
        .or_else(|| pick(env("RUNNER_NODE_ID")).map(usable))
        .or_else(|| pick(env("HOSTNAME")).map(usable))
        .or_else(|| pick(store.map(str::to_string)).map(usable))
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

/// Starts everything and runs until drained.
pub async fn run(config: Config, lifecycle: Arc<Lifecycle>) -> Result<Exit, StartError> {
    let mode = config.runner.mode;
    tracing::info!(
        message = "Starting.",
        mode = mode.as_str(),
        version = VERSION,
        revision = GIT_REVISION
    );

    // The lock is held until `run` returns: one node per data directory (`storage/lock.rs`).
    let storage_cfg = config.storage.clone();
    let (node_lock, store) = tokio::task::spawn_blocking(move || {
        let lock = crate::storage::lock::NodeLock::acquire(&storage_cfg.data_dir)?;
        Ok((lock, Store::open(&storage_cfg)?))
    })
    .await
    .unwrap_or_else(|e| Err(crate::storage::StorageError::Task(e.to_string())))
    .map_err(|source| StartError::Storage {
        path: config.storage.data_dir.display().to_string(),
        source,
    })?;
    let node_id = node_id(
        &config.node.id,
        |k| std::env::var(k).ok(),
        Some(node_lock.store_id()),
    );
    tracing::info!(message = "Node id.", node.id = %node_id);

    let broker = Broker::connect(&config.nats).await?;
    // One deadline for all of set-up; a drain requested meanwhile ends the start cleanly.
    let setup = std::time::Instant::now() + config.nats.setup_timeout.get();
    let interrupt = lifecycle.work_token();
    let streams = broker::with_setup_retry("streams", setup, &interrupt, || {
        broker::ensure_streams(broker.jetstream(), &config.streams, mode.runs_sagas())
    })
    .await;
    let claims_kv = match streams {
        Ok(()) if mode.runs_effects() => Some(
            broker::with_setup_retry("claims bucket", setup, &interrupt, || {
                broker::ensure_claims_bucket(broker.jetstream(), &config)
            })
            .await,
        )
        .transpose(),
        Ok(()) => Ok(None),
        Err(e) => Err(e),
    };
    let leases_kv = match claims_kv {
        Ok(kv) if mode.runs_sagas() => {
            let p = &config.partitions;
            let leases = broker::with_setup_retry("leases bucket", setup, &interrupt, || {
                broker::ensure_leases_bucket(
                    broker.jetstream(),
                    &p.leases_bucket,
                    p.lease_ttl.get(),
                    config.streams.replicas,
                    config.streams.storage,
                )
            })
            .await;
            let snapshots = match leases {
                Ok(l) => broker::with_setup_retry("snapshots bucket", setup, &interrupt, || {
                    crate::worker::ownership::snapshot::ensure_bucket(
                        broker.jetstream(),
                        &p.snapshot_bucket,
                        &config.streams,
                    )
                })
                .await
                .map(|s| (l, s)),
                Err(e) => Err(e),
            };
            snapshots.map(|ls| (kv, Some(ls)))
        }
        Ok(kv) => Ok((kv, None)),
        Err(e) => Err(e),
    };
    let (claims_kv, leases_kv) = match leases_kv {
        Ok(kv) => kv,
        Err(_) if lifecycle.is_draining() => {
            tracing::info!(message = "Drain requested during start-up; stopping before any work.");
            return Ok(Exit::Drained);
        }
        Err(e) => return Err(e.into()),
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
    // Outputs parked by an earlier run and not handled yet keep `/health` degraded.
    let parked_before = store
        .read(|t| {
            Ok(t.dead_letters()?
                .iter()
                .filter(|d| {
                    d.kind == crate::deadletter::kind::UNPUBLISHABLE
                        && d.status == crate::deadletter::DeadLetterStatus::Pending
                })
                .count() as u64)
        })
        .await
        .unwrap_or(0);
    metrics.relay_parked.inc_by(parked_before);
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
    let state = Arc::new(AppState::new(
        config,
        node_id,
        node_lock.store_id().to_string(),
        broker,
        store,
        metrics,
        lifecycle,
        catalog,
    ));

    // Paused tenants are known before the saga worker reads its first input.
    let pause_watch = if mode.runs_sagas() {
        match broker::with_setup_retry("control bucket", setup, &interrupt, || {
            crate::worker::control::load(&state)
        })
        .await
        {
            Ok(w) => Some(w),
            Err(_) if state.lifecycle.is_draining() => return Ok(Exit::Drained),
            Err(e) => return Err(e.into()),
        }
    } else {
        None
    };

    // Never beside a replica of a single-active release, and what one left in this store
    // and in the streams is taken over (`worker/ownership/upgrade.rs`). Last, once nothing else can
    // stop the start.
    if let Some((leases, _)) = &leases_kv {
        if state.config.partitions.enabled.is_some() {
            tracing::warn!(
                message = "`partitions.enabled` is no longer read: saga mode is always partitioned (one replica owns every partition; more replicas share them). Remove the setting."
            );
        }
        crate::worker::ownership::upgrade::take_over(&state, leases, node_lock.store_id()).await?;
    }

    // The admin server outlives the drain so `/ready` can report it; it stops last.
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(crate::admin::serve(
        listener,
        state.clone(),
        admin_stop.clone(),
    ));
    tracing::info!(message = "Admin server listening.", admin.addr = %admin_addr);

    // Workers of the configured mode run on this tracker and watch the work token; each
    // owned partition's relay is flushed by its hand-over before the tracker empties.
    let workers = TaskTracker::new();
    if let Some(w) = pause_watch {
        workers.spawn(crate::worker::control::watch(
            state.clone(),
            w,
            state.lifecycle.work_token(),
        ));
    }
    if let Some((leases, snapshots)) = leases_kv {
        crate::worker::spawn(
            &workers,
            state.clone(),
            leases,
            snapshots,
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
        tracing::error!(message = "Drain timed out: the workers did not finish (a partition whose outputs cannot be published keeps them in the outbox for the next start).", timeout = ?drain_timeout);
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
