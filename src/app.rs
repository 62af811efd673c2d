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

use async_nats::jetstream::kv;
use async_nats::jetstream::object_store::ObjectStore;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::broker::{self, Broker};
use crate::cli::Mode;
use crate::config::Config;
use crate::manifest::{self, Catalog, Diagnostic};
use crate::runtime::{AppState, GIT_REVISION, Lifecycle, VERSION, stranded_in};
use crate::storage::Store;
use crate::storage::lock::NodeLock;
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
    /// The admin TLS certificate or key cannot be used.
    #[error("{0}")]
    AdminTls(String),
    /// The deployment key cannot be used.
    #[error(transparent)]
    Seal(#[from] crate::seal::KeyError),
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

/// What the workers of this node's mode are handed from NATS at start-up.
struct Buckets {
    /// The effect side's claims bucket, when this node runs effects.
    claims: Option<kv::Store>,
    /// The saga side's partition leases and snapshots, when this node runs sagas.
    partitions: Option<(kv::Store, ObjectStore)>,
}

/// Starts everything and runs until drained.
///
/// The steps below run in this order; each helper owns one of them. A drain requested
/// while NATS is being set up ends the start cleanly, with nothing started.
pub async fn run(config: Config, lifecycle: Arc<Lifecycle>) -> Result<Exit, StartError> {
    let mode = config.runner.mode;
    tracing::info!(
        message = "Starting.",
        mode = mode.as_str(),
        version = VERSION,
        revision = GIT_REVISION
    );

    let seal = crate::seal::Seal::load(&config.security)?;
    if !seal.enabled() && mode.runs_sagas() {
        tracing::warn!(
            message = "No deployment key: snapshots and control inputs are not sealed, so whoever can write to Runner's buckets and subjects could forge them. Set security.deployment_key_file (see docs/security.md)."
        );
    }

    // The lock is held until `run` returns: one node per data directory (`storage/lock.rs`).
    let (node_lock, store) = open_store(&config).await?;
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
    let buckets = match ensure_streams_and_buckets(&broker, &config, setup, &interrupt).await {
        Ok(b) => b,
        Err(_) if lifecycle.is_draining() => {
            tracing::info!(message = "Drain requested during start-up; stopping before any work.");
            return Ok(Exit::Drained);
        }
        Err(e) => return Err(e.into()),
    };

    let catalog = load_manifests(&config, &store).await?;
    let metrics = start_metrics(mode, &catalog, &store).await?;
    let (listener, admin_addr) = bind_admin(config.admin.addr).await?;
    let admin_tls = admin_tls(&config.admin)?;

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
        seal,
    ));

    // Paused tenants are known before the saga worker reads its first input.
    let pause_watch = match load_pause_watch(&state, setup, &interrupt).await {
        Ok(w) => w,
        Err(_) if state.lifecycle.is_draining() => return Ok(Exit::Drained),
        Err(e) => return Err(e.into()),
    };

    // Never beside a replica of a single-active release, and what one left in this store
    // and in the streams is taken over (`worker/upgrade.rs`). Last, once nothing else can
    // stop the start.
    if let Some((leases, _)) = &buckets.partitions {
        take_over_earlier_release(&state, leases, node_lock.store_id()).await?;
    }

    // The admin server outlives the drain so `/ready` can report it; it stops last.
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(crate::admin::serve(
        listener,
        admin_tls,
        state.clone(),
        admin_stop.clone(),
    ));
    tracing::info!(message = "Admin server listening.", admin.addr = %admin_addr);

    // Workers of the configured mode run on this tracker and watch the work token; each
    // owned partition's relay is flushed by its hand-over before the tracker empties.
    let workers = TaskTracker::new();
    start_saga_side(&workers, &state, pause_watch, buckets.partitions);
    start_effect_side(&workers, &state, buckets.claims);
    workers.close();
    state.lifecycle.mark_started();
    tracing::info!(message = "Ready.", mode = mode.as_str());

    let exit = wait_and_drain(&state, &workers, drain_timeout).await;
    admin_stop.cancel();
    let _ = admin_task.await;
    Ok(exit)
}

/// Takes the data directory's lock, then opens the store in it (both off the async
/// threads).
async fn open_store(config: &Config) -> Result<(NodeLock, Store), StartError> {
    let storage_cfg = config.storage.clone();
    tokio::task::spawn_blocking(move || {
        let lock = NodeLock::acquire(&storage_cfg.data_dir)?;
        Ok((lock, Store::open(&storage_cfg)?))
    })
    .await
    .unwrap_or_else(|e| Err(crate::storage::StorageError::Task(e.to_string())))
    .map_err(|source| StartError::Storage {
        path: config.storage.data_dir.display().to_string(),
        source,
    })
}

/// Makes sure the streams exist, then the buckets this node's mode uses (claims for the
/// effect side; leases, then snapshots, for the saga side), each retried until `setup` or
/// `interrupt`. The first failure ends it.
async fn ensure_streams_and_buckets(
    broker: &Broker,
    config: &Config,
    setup: std::time::Instant,
    interrupt: &CancellationToken,
) -> Result<Buckets, broker::BrokerError> {
    let mode = config.runner.mode;
    broker::with_setup_retry("streams", setup, interrupt, || {
        broker::ensure_streams(broker.jetstream(), &config.streams, mode.runs_sagas())
    })
    .await?;
    let claims = if mode.runs_effects() {
        Some(
            broker::with_setup_retry("claims bucket", setup, interrupt, || {
                broker::ensure_claims_bucket(broker.jetstream(), config)
            })
            .await?,
        )
    } else {
        None
    };
    let partitions = if mode.runs_sagas() {
        let p = &config.partitions;
        let leases = broker::with_setup_retry("leases bucket", setup, interrupt, || {
            broker::ensure_leases_bucket(
                broker.jetstream(),
                &p.leases_bucket,
                p.lease_ttl.get(),
                config.streams.replicas,
                config.streams.storage,
            )
        })
        .await?;
        let snapshots = broker::with_setup_retry("snapshots bucket", setup, interrupt, || {
            crate::worker::ownership::snapshot::ensure_bucket(
                broker.jetstream(),
                &p.snapshot_bucket,
                &config.streams,
            )
        })
        .await?;
        Some((leases, snapshots))
    } else {
        None
    };
    Ok(Buckets { claims, partitions })
}

/// Loads the manifests (off the async threads) into a catalog; refuses one that leaves
/// instances in the store on a version it no longer has, and logs its warnings.
async fn load_manifests(config: &Config, store: &Store) -> Result<Catalog, StartError> {
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
    let stranded = stranded_in(store, &catalog).await;
    if !stranded.is_empty() {
        return Err(StartError::Manifests(stranded));
    }
    for w in &report.diagnostics {
        tracing::warn!(message = "Manifest warning.", diagnostic = %w);
    }
    for w in crate::quota::unknown_effects(&config.tenancy, &catalog.summary().effects) {
        tracing::warn!(message = "A tenancy limit holds nothing.", problem = %w);
    }
    Ok(catalog)
}

/// The metrics registry, seeded with what is known before any work: the sagas loaded and
/// the outputs an earlier run parked.
async fn start_metrics(
    mode: Mode,
    catalog: &Catalog,
    store: &Store,
) -> Result<Metrics, StartError> {
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
    Ok(metrics)
}

/// Binds the admin listener; also answers the address it got (the port, when `addr` asked
/// for any).
async fn bind_admin(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::AdminBind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| StartError::AdminBind { addr, source })?;
    Ok((listener, bound))
}

/// The admin listener's TLS acceptor when `admin.tls_cert_file` and `admin.tls_key_file`
/// are set; a file that cannot be used stops the start, named.
fn admin_tls(
    admin: &crate::config::AdminConfig,
) -> Result<Option<tokio_rustls::TlsAcceptor>, StartError> {
    match (&admin.tls_cert_file, &admin.tls_key_file) {
        (Some(cert), Some(key)) => crate::admin::tls::acceptor(cert, key)
            .map(Some)
            .map_err(StartError::AdminTls),
        _ => Ok(None),
    }
}

/// The paused tenants and a watch on them, when this node runs sagas (retried until
/// `setup` or `interrupt`).
async fn load_pause_watch(
    state: &AppState,
    setup: std::time::Instant,
    interrupt: &CancellationToken,
) -> Result<Option<kv::Watch>, broker::BrokerError> {
    if !state.config.runner.mode.runs_sagas() {
        return Ok(None);
    }
    broker::with_setup_retry("control bucket", setup, interrupt, || {
        crate::worker::control::load(state)
    })
    .await
    .map(Some)
}

/// Refuses to run beside a replica of a single-active release and takes over what one
/// left (`worker/upgrade.rs`); warns about a setting no longer read.
async fn take_over_earlier_release(
    state: &AppState,
    leases: &kv::Store,
    store_id: &str,
) -> Result<(), StartError> {
    if state.config.partitions.enabled.is_some() {
        tracing::warn!(
            message = "`partitions.enabled` is no longer read: saga mode is always partitioned (one replica owns every partition; more replicas share them). Remove the setting."
        );
    }
    crate::worker::ownership::upgrade::take_over(state, leases, store_id).await?;
    Ok(())
}

/// Spawns the saga side on `workers` when this node runs sagas: the paused-tenants watch,
/// then the partition workers.
fn start_saga_side(
    workers: &TaskTracker,
    state: &Arc<AppState>,
    pause_watch: Option<kv::Watch>,
    partitions: Option<(kv::Store, ObjectStore)>,
) {
    if let Some(w) = pause_watch {
        workers.spawn(crate::worker::control::watch(
            state.clone(),
            w,
            state.lifecycle.work_token(),
        ));
    }
    if let Some((leases, snapshots)) = partitions {
        crate::worker::spawn(
            workers,
            state.clone(),
            leases,
            snapshots,
            state.lifecycle.work_token(),
        );
    }
}

/// Spawns the effect side on `workers` when this node runs effects.
fn start_effect_side(workers: &TaskTracker, state: &Arc<AppState>, claims: Option<kv::Store>) {
    if let Some(kv) = claims {
        crate::effect::spawn(workers, state.clone(), kv, state.lifecycle.work_token());
    }
}

/// Waits for the drain to start, then for the workers to finish and the NATS connection to
/// flush, both within `drain_timeout`; answers whether the workers made it in time.
async fn wait_and_drain(
    state: &AppState,
    workers: &TaskTracker,
    drain_timeout: std::time::Duration,
) -> Exit {
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
    exit
}
