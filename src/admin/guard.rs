//! The admin server's listener: a cap on open connections and timeouts on each one.
//!
//! Guarantees:
//! - at most `admin.max_connections` connections are open at once; a connection beyond the
//!   cap is closed as soon as it is accepted, so a flood cannot take the descriptors the
//!   node needs for NATS and its store;
//! - a connection that transfers nothing for `admin.idle_timeout` (a half-open request,
//!   an idle keep-alive) is closed;
//! - no connection stays open longer than `admin.connection_timeout`, so a request dripped
//!   one byte at a time cannot be held forever.
//!
//! `runner_admin_connections` shows the connections open now and
//! `runner_admin_connections_refused_total` those closed at the cap.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::{IntCounter, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

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

/// A listener that enforces [`Limits`].
pub(super) struct Guarded {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    limits: Limits,
    open: IntGauge,
    refused: IntCounter,
}

impl Guarded {
    /// Wraps `inner`; `open` and `refused` are the metrics it keeps.
    pub(super) fn new(
        inner: TcpListener,
        limits: Limits,
        open: IntGauge,
        refused: IntCounter,
    ) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            open,
            refused,
        }
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
            let Ok(permit) = self.permits.clone().try_acquire_owned() else {
                self.refused.inc();
                drop(tcp);
                continue;
            };
            self.open.inc();
            let now = Instant::now();
            return (
                Stream {
                    tcp,
                    idle: Box::pin(tokio::time::sleep(self.limits.idle)),
                    idle_for: self.limits.idle,
                    deadline: Box::pin(tokio::time::sleep_until(now + self.limits.lifetime)),
                    _permit: Permit {
                        _permit: permit,
                        open: self.open.clone(),
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

/// Gives the slot back when the connection ends.
struct Permit {
    _permit: OwnedSemaphorePermit,
    open: IntGauge,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// One admitted connection: fails with `TimedOut` once idle or too old, which ends it.
pub(super) struct Stream {
    tcp: TcpStream,
    idle: Pin<Box<Sleep>>,
    idle_for: Duration,
    deadline: Pin<Box<Sleep>>,
    _permit: Permit,
}

impl Stream {
    /// An error once a limit has passed (and registers for the wake-up when it will).
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        let gone = |what| io::Error::new(io::ErrorKind::TimedOut, what);
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
        match Pin::new(&mut this.tcp).poll_read(cx, buf) {
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
        match Pin::new(&mut this.tcp).poll_write(cx, data) {
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
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}
