//! The admin server's listener: a cap on open connections and timeouts on each one.
//!
//! Guarantees:
//! - at most `admin.max_connections` connections are open at once, so a flood cannot take
//!   the descriptors the node needs for NATS and its store;
//! - the probes (`/health`, `/ready`) and `/metrics` stay answerable however the cap is
//!   filled: a connection accepted at the cap takes the slot of the open connection that has
//!   waited longest without a request in flight (a request dripped one byte at a time, an
//!   idle keep-alive), which is closed. Only when every open connection has a request in
//!   flight is the new one closed instead. A probe sends its request as soon as it connects,
//!   so from then on it is not the one evicted; slow connections only ever push each other
//!   out. No slot is reserved and no second listener is needed;
//! - a connection that transfers nothing for `admin.idle_timeout` (a half-open request,
//!   an idle keep-alive) is closed;
//! - no connection stays open longer than `admin.connection_timeout`, so a request dripped
//!   one byte at a time cannot be held forever.
//!
//! A request is "in flight" from the moment the router sees it (its headers are complete)
//! until its handler has answered: [`track`] marks it through the connection's [`Slot`],
//! which the router receives as connection info.
//!
//! `runner_admin_connections` shows the connections open now,
//! `runner_admin_connections_evicted_total` those closed to make room for a newer one, and
//! `runner_admin_connections_refused_total` those closed at once because every open one had
//! a request in flight.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{ConnectInfo, Request};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::{IntCounter, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// How long a connection accepted at the cap waits for the one it evicted to give its slot
/// back (it is woken at once; this only bounds a connection task that does not run).
const EVICTION_WAIT: Duration = Duration::from_secs(1);

/// A slot's `busy` once it is evicted: no request may begin on it any more.
const EVICTED: usize = usize::MAX;

/// Limits of the admin listener.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Most connections open at once.
    pub(super) max_connections: usize,
    /// Longest time without any transfer.
    pub(super) idle: Duration,
    /// Longest life of one connection.
    pub(super) lifetime: Duration,
}

/// The metrics the listener keeps.
#[derive(Clone)]
pub(super) struct Counters {
    /// Connections open now.
    pub(super) open: IntGauge,
    /// Connections closed to make room for a newer one.
    pub(super) evicted: IntCounter,
    /// Connections closed at once: every open one had a request in flight.
    pub(super) refused: IntCounter,
}

/// A listener that enforces [`Limits`].
pub(super) struct Guarded {
    inner: TcpListener,
    /// TLS for every connection, when `admin.tls_cert_file` is set ([`super::tls`]).
    tls: Option<tokio_rustls::TlsAcceptor>,
    permits: Arc<Semaphore>,
    limits: Limits,
    counters: Counters,
    slots: Arc<Slots>,
    next_id: u64,
}

impl Guarded {
    /// Wraps `inner`; `counters` are the metrics it keeps.
    pub(super) fn new(
        inner: TcpListener,
        tls: Option<tokio_rustls::TlsAcceptor>,
        limits: Limits,
        counters: Counters,
    ) -> Self {
        Self {
            inner,
            tls,
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            counters,
            slots: Arc::new(Slots {
                epoch: std::time::Instant::now(),
                open: Mutex::new(HashMap::new()),
            }),
            next_id: 0,
        }
    }

    /// A slot for a connection accepted now: a free one, or the one of the connection
    /// that has waited longest without a request in flight, which is evicted. `None` when
    /// every open connection has a request in flight.
    async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            return Some(p);
        }
        if !self.slots.evict_one() {
            return None;
        }
        self.counters.evicted.inc();
        tokio::time::timeout(EVICTION_WAIT, self.permits.clone().acquire_owned())
            .await
            .ok()?
            .ok()
    }
}

impl axum::serve::Listener for Guarded {
    type Io = Stream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, addr) = match self.inner.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors or similar: wait a moment rather than spin.
                    tracing::warn!(message = "Admin accept failed.", error = %e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Some(permit) = self.slot().await else {
                self.counters.refused.inc();
                drop(tcp);
                continue;
            };
            self.next_id += 1;
            let slot = Slot(Arc::new(SlotState {
                id: self.next_id,
                busy: AtomicUsize::new(0),
                waiting_since: AtomicU64::new(self.slots.now()),
                epoch: self.slots.epoch,
                evict: CancellationToken::new(),
            }));
            self.slots.lock().insert(slot.0.id, Arc::clone(&slot.0));
            self.counters.open.inc();
            let now = Instant::now();
            return (
                Stream {
                    io: super::tls::Transport::new(tcp, self.tls.as_ref()),
                    idle: Box::pin(tokio::time::sleep(self.limits.idle)),
                    idle_for: self.limits.idle,
                    deadline: Box::pin(tokio::time::sleep_until(now + self.limits.lifetime)),
                    evicted: Box::pin(slot.0.evict.clone().cancelled_owned()),
                    slot: slot.clone(),
                    _permit: Permit {
                        _permit: permit,
                        open: self.counters.open.clone(),
                        slots: Arc::clone(&self.slots),
                        id: slot.0.id,
                    },
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// The open connections, for choosing the one to evict.
struct Slots {
    epoch: std::time::Instant,
    open: Mutex<HashMap<u64, Arc<SlotState>>>,
}

impl Slots {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<SlotState>>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now(&self) -> u64 {
        micros_since(self.epoch)
    }

    /// Evicts the open connection that has waited longest with no request in flight;
    /// false when every one has a request in flight.
    fn evict_one(&self) -> bool {
        let open = self.lock();
        let mut idle: Vec<&Arc<SlotState>> = open
            .values()
            .filter(|s| s.busy.load(Ordering::SeqCst) == 0)
            .collect();
        idle.sort_by_key(|s| (s.waiting_since.load(Ordering::SeqCst), s.id));
        // A request may have begun since the filter: the exchange decides.
        for s in idle {
            if s.busy
                .compare_exchange(0, EVICTED, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                s.evict.cancel();
                return true;
            }
        }
        false
    }
}

fn micros_since(epoch: std::time::Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// One open connection, as the listener and the router share it.
#[derive(Debug)]
struct SlotState {
    /// Order of acceptance (breaks ties between equally old waits).
    id: u64,
    /// Requests in flight, or [`EVICTED`].
    busy: AtomicUsize,
    /// When the connection last had no request in flight, µs after `epoch`.
    waiting_since: AtomicU64,
    epoch: std::time::Instant,
    /// Cancelled when the connection is evicted; its stream then fails.
    evict: CancellationToken,
}

/// A connection's handle, given to the router as its connection info so [`track`] can
/// mark requests in flight.
#[derive(Debug, Clone)]
pub(super) struct Slot(Arc<SlotState>);

impl Slot {
    /// Marks a request in flight until the returned value is dropped; `None` on a
    /// connection already evicted.
    fn begin(&self) -> Option<InFlight> {
        self.0
            .busy
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                (b != EVICTED).then_some(b + 1)
            })
            .ok()
            .map(|_| InFlight(Arc::clone(&self.0)))
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Guarded>> for Slot {
    fn connect_info(stream: axum::serve::IncomingStream<'_, Guarded>) -> Self {
        stream.io().slot.clone()
    }
}

/// A request in flight on a connection.
struct InFlight(Arc<SlotState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let s = &self.0;
        if s.busy.fetch_sub(1, Ordering::SeqCst) == 1 {
            s.waiting_since
                .store(micros_since(s.epoch), Ordering::SeqCst);
        }
    }
}

/// Middleware: marks each request in flight on its connection while its handler runs, so
/// the connection is not the one evicted meanwhile. Requests without a [`Slot`] (a router
/// served some other way) pass untouched.
pub(super) async fn track(req: Request, next: Next) -> Response {
    let in_flight = req
        .extensions()
        .get::<ConnectInfo<Slot>>()
        .and_then(|c| c.0.begin());
    let out = next.run(req).await;
    drop(in_flight);
    out
}

/// Gives the slot back when the connection ends.
struct Permit {
    _permit: OwnedSemaphorePermit,
    open: IntGauge,
    slots: Arc<Slots>,
    id: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.slots.lock().remove(&self.id);
        self.open.dec();
    }
}

/// One admitted connection: fails with `TimedOut` once idle, too old or evicted, which
/// ends it.
pub(super) struct Stream {
    io: super::tls::Transport,
    idle: Pin<Box<Sleep>>,
    idle_for: Duration,
    deadline: Pin<Box<Sleep>>,
    evicted: Pin<Box<WaitForCancellationFutureOwned>>,
    slot: Slot,
    _permit: Permit,
}

impl Stream {
    /// An error once a limit has passed or the connection was evicted (and registers for
    /// the wake-up when it will).
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        let gone = |what| io::Error::new(io::ErrorKind::TimedOut, what);
        if self.evicted.as_mut().poll(cx).is_ready() {
            return Some(gone(
                "admin connection evicted: the connection cap was reached and it had waited longest without a request",
            ));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            return Some(gone("admin connection open too long"));
        }
        if self.idle.as_mut().poll(cx).is_ready() {
            return Some(gone("admin connection idle too long"));
        }
        None
    }

    fn progressed(&mut self) {
        let next = Instant::now() + self.idle_for;
        self.idle.as_mut().reset(next);
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.progressed();
                }
                Poll::Ready(r)
            }
            Poll::Pending => match this.expired(cx) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.io).poll_write(cx, data) {
            Poll::Ready(Ok(n)) => {
                this.progressed();
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.expired(cx) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
