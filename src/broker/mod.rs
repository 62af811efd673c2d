//! NATS: connecting, and making sure the JetStream streams Runner relies on exist.
//!
//! At start the first connection is retried until `nats.connect_timeout`, then start fails
//! naming the URLs. Once connected, the client reconnects forever; the admin `/health`
//! reports the outage meanwhile (see [`Broker::is_connected`]).
//!
//! Set-up after the first connection (streams, the claims bucket) is retried the same way
//! until `nats.setup_timeout` while JetStream does not answer (a cluster still forming or
//! electing leaders), with a log line per retry; a definite answer that cannot change by
//! waiting (an incompatible stream, a missing one with `streams.create` off) stops the start
//! at once. See [`with_setup_retry`].
//!
//! Streams are reconciled idempotently: a missing stream is created (when `streams.create`
//! is on); an existing one is checked and never modified, and a difference that would break
//! Runner's guarantees (subjects, storage, replicas, de-duplication window) stops the start
//! with the stream, the field and both values named.

/// A connection error in words an operator can act on: a TLS handshake answered in plain
/// text (the client's TLS library reports it as a corrupt message) is named as such.
fn connect_reason(cfg: &NatsConfig, raw: &str) -> String {
    if raw.contains("InvalidContentType") || raw.contains("corrupt message") {
        let why = if cfg.tls_required {
            "nats.tls_required is set"
        } else {
            "TLS settings are given"
        };
        return format!(
            "the server did not answer the TLS handshake ({why}): is TLS enabled on it, or \
             is this a plain-text port? ({raw})"
        );
    }
    raw.to_string()
}

pub mod batch;
pub mod dlq;
pub mod fence;
pub mod fenced_batch;
pub mod fenced_round;
mod filter;
pub mod liveness;
mod streams;

use std::time::{Duration, Instant};

use async_nats::{Client, ConnectOptions, ServerAddr, jetstream};

use crate::backoff::Backoff;
use crate::config::NatsConfig;

pub mod headers;

pub use filter::{covers, overlaps, widen};
pub use streams::{
    StreamSpec, ensure_claims_bucket, ensure_leases_bucket, ensure_streams, fence_subjects,
    stream_for, stream_specs,
};

/// Errors while connecting or preparing streams.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// No connection within `nats.connect_timeout`.
    #[error("cannot connect to NATS at {urls} (gave up after {:.1}s): {reason}", waited.as_secs_f64())]
    Connect {
        /// The URLs tried.
        urls: String,
        /// How long we kept trying.
        waited: Duration,
        /// The last error.
        reason: String,
    },
    /// A credential file could not be read.
    #[error("cannot read {what} {path}: {reason}")]
    Credentials {
        /// Which setting.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// An existing stream differs from what Runner needs.
    #[error(
        "stream {stream} exists with an incompatible config: field `{field}` is {existing}, Runner needs {wanted}"
    )]
    Incompatible {
        /// Stream name.
        stream: String,
        /// The differing field.
        field: &'static str,
        /// What the server has.
        existing: String,
        /// What Runner needs.
        wanted: String,
    },
    /// A stream is missing and `streams.create` is off.
    #[error("stream {stream} does not exist and streams.create is false")]
    Missing {
        /// Stream name.
        stream: String,
    },
    /// The server refused a set-up request for good (say, subjects that overlap another
    /// stream's): waiting would not help.
    #[error("JetStream refused to {op} {stream}: {reason}")]
    Refused {
        /// What we tried.
        op: &'static str,
        /// Stream name.
        stream: String,
        /// The server's answer.
        reason: String,
    },
    /// A JetStream API call failed (no answer, or an answer that may change: a cluster still
    /// electing its leaders).
    #[error("JetStream {op} {stream}: {reason}")]
    JetStream {
        /// What we tried.
        op: &'static str,
        /// Stream name.
        stream: String,
        /// Why.
        reason: String,
    },
}

impl BrokerError {
    /// Whether waiting may help: a JetStream call that failed (timed out, no responders, no
    /// leader yet), as opposed to a definite answer about the config or credentials.
    pub fn is_transient(&self) -> bool {
        matches!(self, BrokerError::JetStream { .. })
    }
}

/// Runs set-up step `what`, retrying transient failures ([`BrokerError::is_transient`]) with
/// a capped doubling backoff until `deadline` (one deadline for every step of a start);
/// then, or at once when `cancel` fires (a drain requested during start), returns the last
/// error.
pub async fn with_setup_retry<T, F, Fut>(
    what: &str,
    deadline: Instant,
    cancel: &tokio_util::sync::CancellationToken,
    mut step: F,
) -> Result<T, BrokerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, BrokerError>>,
{
    let mut backoff =
        Backoff::new(Duration::from_millis(200), Duration::from_secs(3)).with_jitter();
    let mut tries = 1u32;
    loop {
        match step().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_transient() => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(e);
                }
                let wait = backoff.next_wait().min(deadline - now);
                tracing::warn!(message = "JetStream set-up not possible yet, retrying.", step = what, attempt = tries, error = %e, retry_in = ?wait);
                tokio::select! {
                    _ = cancel.cancelled() => return Err(e),
                    _ = tokio::time::sleep(wait) => {}
                }
                tries += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// A connected NATS client with its JetStream context.
#[derive(Clone, Debug)]
pub struct Broker {
    client: Client,
    js: jetstream::Context,
    connections: tokio::sync::watch::Receiver<u64>,
}

impl Broker {
    /// Connects, retrying until `cfg.connect_timeout`.
    pub async fn connect(cfg: &NatsConfig) -> Result<Self, BrokerError> {
        let urls = cfg.urls.join(",");
        let addrs: Vec<ServerAddr> = cfg
            .urls
            .iter()
            .map(|u| u.parse())
            .collect::<Result<_, _>>()
            .map_err(|e: std::io::Error| BrokerError::Connect {
                urls: urls.clone(),
                waited: Duration::ZERO,
                reason: e.to_string(),
            })?;
        // Counts (re)connections, so consumers can re-open at once after an outage instead of
        // waiting for their heartbeats to time out.
        let (connections_tx, connections_rx) = tokio::sync::watch::channel(0u64);
        let connections_tx = std::sync::Arc::new(connections_tx);
        let started = Instant::now();
        let deadline = started + cfg.connect_timeout.get();
        let mut delay = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        loop {
            let attempt_timeout = deadline
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(100), Duration::from_secs(5));
            let opts = options(cfg, connections_tx.clone())
                .await?
                .connection_timeout(attempt_timeout);
            match opts.connect(addrs.clone()).await {
                Ok(client) => {
                    let mut js = jetstream::new(client.clone());
                    js.set_timeout(cfg.request_timeout.get());
                    tracing::info!(message = "Connected to NATS.", nats.urls = %urls);
                    return Ok(Self {
                        client,
                        js,
                        connections: connections_rx,
                    });
                }
                Err(e) => {
                    let now = Instant::now();
                    let reason = connect_reason(cfg, &e.to_string());
                    if now >= deadline {
                        return Err(BrokerError::Connect {
                            urls,
                            waited: started.elapsed(),
                            reason,
                        });
                    }
                    let wait = delay.next_wait().min(deadline - now);
                    tracing::warn!(message = "NATS not reachable yet, retrying.", nats.urls = %urls, error = %reason, retry_in = ?wait);
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// The core NATS client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The JetStream context.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// A receiver that changes every time the connection is (re)established.
    pub fn connections(&self) -> tokio::sync::watch::Receiver<u64> {
        self.connections.clone()
    }

    /// The server's `max_payload` (headers and body of one message), as it announced it.
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// The largest body a message Runner publishes may have whatever its headers: the
    /// server's `max_payload` less [`headers::MAX_RECORD_HEADERS`]. Effect results are
    /// bounded by it; saga outputs are checked exactly (`headers::record_fits`). 0 (no
    /// server information yet) means no limit is known.
    pub fn max_record_bytes(&self) -> usize {
        self.max_payload()
            .saturating_sub(headers::MAX_RECORD_HEADERS)
    }

    /// Whether the client is connected right now.
    pub fn is_connected(&self) -> bool {
        matches!(
            self.client.connection_state(),
            async_nats::connection::State::Connected
        )
    }

    /// The connection state in words, for `/health`.
    pub fn state_text(&self) -> String {
        self.client.connection_state().to_string()
    }
}

async fn options(
    cfg: &NatsConfig,
    connections: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
) -> Result<ConnectOptions, BrokerError> {
    let mut o = match &cfg.creds_file {
        Some(p) => ConnectOptions::with_credentials_file(p)
            .await
            .map_err(|e| BrokerError::Credentials {
                what: "nats.creds_file",
                path: p.display().to_string(),
                reason: e.to_string(),
            })?,
        None => ConnectOptions::new(),
    };
    o = o
        .name(&cfg.client_name)
        .max_reconnects(None)
        .event_callback(move |event| {
            let connections = connections.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        connections.send_modify(|n| *n += 1);
                        tracing::info!(message = "NATS connection up.")
                    }
                    async_nats::Event::Disconnected => {
                        tracing::warn!(message = "NATS connection lost; reconnecting.")
                    }
                    other => tracing::debug!(message = "NATS client event.", event = %other),
                }
            }
        });
    if let Some(t) = &cfg.token {
        o = o.token(t.clone());
    }
    if let (Some(u), Some(p)) = (&cfg.user, &cfg.password) {
        o = o.user_and_password(u.clone(), p.clone());
    }
    if let Some(p) = &cfg.nkey_seed_file {
        let seed = std::fs::read_to_string(p).map_err(|e| BrokerError::Credentials {
            what: "nats.nkey_seed_file",
            path: p.display().to_string(),
            reason: e.to_string(),
        })?;
        o = o.nkey(seed.trim().to_string());
    }
    if cfg.tls_required {
        o = o.require_tls(true);
    }
    if let Some(ca) = &cfg.tls_ca_file {
        o = o.add_root_certificates(ca.clone());
    }
    if let (Some(c), Some(k)) = (&cfg.tls_cert_file, &cfg.tls_key_file) {
        o = o.add_client_certificate(c.clone(), k.clone());
    }
    Ok(o)
}
