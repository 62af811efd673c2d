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
//! - a request counts as in flight from the moment its headers have been read off the
//!   connection (the blank line that ends them), before the router has parsed them: a
//!   probe that has sent its request is not evicted while it waits to be routed. That
//!   protection lapses after [`HEADERS_GRACE`] if the router never takes the request up
//!   (bytes that only looked like the end of headers), so it cannot pin a slot;
//! - a connection that transfers nothing for `admin.idle_timeout` (a half-open request,
//!   an idle keep-alive) is closed;
//! - no connection stays open longer than `admin.connection_timeout`, so a request dripped
//!   one byte at a time cannot be held forever.
//!
//! A request is "in flight" from the moment its headers' end is read until its handler has
//! answered: [`Stream`] notes the end of the headers, [`track`] marks the request through
//! the connection's [`Slot`], which the router receives as connection info.
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

/// How long headers read off a connection protect it from eviction before the router takes
/// the request up. Far longer than parsing and routing take; short enough that bytes that
/// only looked like the end of headers do not hold a slot.
const HEADERS_GRACE: Duration = Duration::from_secs(1);

/// The blank line that ends a request's headers.
const HEADERS_END: &[u8; 4] = b"\r\n\r\n";

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
                headers_read_at: AtomicU64::new(0),
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
                    headers_end: HeadersEnd::default(),
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
        let now = self.now();
        let grace = u64::try_from(HEADERS_GRACE.as_micros()).unwrap_or(u64::MAX);
        let open = self.lock();
        let mut idle: Vec<&Arc<SlotState>> = open
            .values()
            .filter(|s| s.busy.load(Ordering::SeqCst) == 0)
            .filter(|s| {
                let read_at = s.headers_read_at.load(Ordering::SeqCst);
                read_at == 0 || now.saturating_sub(read_at) > grace
            })
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
    /// When the end of a request's headers was last read and the router has not taken the
    /// request up yet, µs after `epoch`; 0 when there is none.
    headers_read_at: AtomicU64,
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
        let began = self
            .0
            .busy
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                (b != EVICTED).then_some(b + 1)
            })
            .ok()
            .map(|_| InFlight(Arc::clone(&self.0)));
        // The request whose headers were read is now in flight.
        self.0.headers_read_at.store(0, Ordering::SeqCst);
        began
    }

    /// Notes that the end of a request's headers was read: the connection is not evicted
    /// while the router has yet to take the request up (at most [`HEADERS_GRACE`]).
    fn headers_read(&self) {
        // Never 0, which means none.
        let now = micros_since(self.0.epoch).max(1);
        self.0.headers_read_at.store(now, Ordering::SeqCst);
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
    /// Where the end of a request's headers is, in the bytes read.
    headers_end: HeadersEnd,
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

/// Finds the blank line that ends a request's headers in bytes read in pieces.
#[derive(Debug, Default)]
struct HeadersEnd {
    /// How many bytes of [`HEADERS_END`] the bytes so far end with.
    matched: usize,
}

impl HeadersEnd {
    /// Whether `read`, following what came before, holds the end of a request's headers.
    fn feed(&mut self, read: &[u8]) -> bool {
        let mut seen = false;
        for &b in read {
            self.matched = if b == HEADERS_END[self.matched] {
                self.matched + 1
            } else {
                usize::from(b == HEADERS_END[0])
            };
            if self.matched == HEADERS_END.len() {
                self.matched = 0;
                seen = true;
            }
        }
        seen
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
                    if this.headers_end.feed(&buf.filled()[before..]) {
                        this.slot.headers_read();
                    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use axum::serve::Listener as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn the_end_of_headers_is_found_across_reads() {
        let mut h = HeadersEnd::default();
        assert!(!h.feed(b"GET / HTTP/1.1\r\nHost: x\r"));
        assert!(!h.feed(b"\n"));
        assert!(h.feed(b"\r\n"));
        // After a stray carriage return, and not inside a header line.
        assert!(h.feed(b"GET / HTTP/1.1\r\r\n\r\n"));
        assert!(!h.feed(b"a\r\nb\n\r\nc\r\n\r"));
        assert!(h.feed(b"\n"));
    }

    fn guarded(listener: TcpListener) -> Guarded {
        let limits = Limits {
            max_connections: 1,
            idle: Duration::from_secs(30),
            lifetime: Duration::from_secs(60),
        };
        let counters = Counters {
            open: IntGauge::new("open", "open").unwrap(),
            evicted: IntCounter::new("evicted", "evicted").unwrap(),
            refused: IntCounter::new("refused", "refused").unwrap(),
        };
        Guarded::new(listener, None, limits, counters)
    }

    /// Opens a connection, sends `sent`, and reads on the accepted side what came.
    async fn accepted_after(g: &mut Guarded, sent: &[u8]) -> (tokio::net::TcpStream, Stream) {
        let addr = g.local_addr().unwrap();
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client.write_all(sent).await.unwrap();
        let (mut stream, _) = g.accept().await;
        let mut buf = vec![0u8; sent.len()];
        stream.read_exact(&mut buf).await.unwrap();
        (client, stream)
    }

    #[tokio::test]
    async fn a_connection_whose_headers_were_read_is_not_evicted_before_it_is_routed() {
        let mut g = guarded(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let (_client, stream) = accepted_after(&mut g, b"GET /health HTTP/1.1\r\n\r\n").await;
        assert!(
            !g.slots.evict_one(),
            "a request read and not yet routed holds its connection"
        );
        // Taken up by the router and answered: the connection waits again.
        drop(stream.slot.begin());
        assert!(g.slots.evict_one(), "an answered connection can be evicted");
    }

    #[tokio::test]
    async fn a_connection_with_half_its_headers_can_be_evicted() {
        let mut g = guarded(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let (_client, _stream) = accepted_after(&mut g, b"GET /health HTTP/1.1\r\nHo").await;
        assert!(
            g.slots.evict_one(),
            "a dripped request does not hold its slot"
        );
    }

    #[tokio::test]
    async fn headers_never_routed_stop_protecting_their_connection() {
        let mut g = guarded(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let (_client, _stream) = accepted_after(&mut g, b"\r\n\r\n").await;
        assert!(!g.slots.evict_one());
        std::thread::sleep(HEADERS_GRACE + Duration::from_millis(50));
        assert!(
            g.slots.evict_one(),
            "protected for {HEADERS_GRACE:?} at most"
        );
    }
}
