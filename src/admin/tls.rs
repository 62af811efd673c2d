//! TLS for the admin listener (`admin.tls_cert_file`, `admin.tls_key_file`): rustls on the
//! ring provider, the stack every other TLS user in Runner already uses.
//!
//! Guarantees:
//! - a certificate or key that cannot be read or does not fit is a start-up error naming
//!   the file, never a listener that quietly serves plain HTTP;
//! - the handshake happens on the connection's own task, inside the guarded stream
//!   ([`super::guard`]), so a client that connects and stalls its handshake holds only its
//!   own slot and is closed by the same idle and lifetime limits as a slow request; the
//!   accept loop never waits for a handshake;
//! - a failed handshake (plain HTTP sent to the TLS port, an untrusted client) ends that
//!   connection only, logged at debug.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

/// Reads the certificate chain and key and makes the acceptor; the error names the key
/// and file at fault.
pub(crate) fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, String> {
    let at = |what: &str, p: &Path, e: &dyn std::fmt::Display| {
        format!("admin.{what} {}: {e}", p.display())
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| at("tls_cert_file", cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| at("tls_cert_file", cert, &e))?;
    if chain.is_empty() {
        return Err(at("tls_cert_file", cert, &"holds no PEM certificate"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| at("tls_key_file", key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("admin TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            format!(
                "admin.tls_cert_file {} with admin.tls_key_file {}: {e}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The bytes under one admin connection: plain TCP, or TLS once its handshake is done.
pub(super) enum Transport {
    Plain(TcpStream),
    Handshake(Pin<Box<tokio_rustls::Accept<TcpStream>>>),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Failed,
}

impl Transport {
    /// Plain TCP, or the TLS handshake with `tls` started on it.
    pub(super) fn new(tcp: TcpStream, tls: Option<&TlsAcceptor>) -> Self {
        match tls {
            Some(a) => Transport::Handshake(Box::pin(a.accept(tcp))),
            None => Transport::Plain(tcp),
        }
    }

    /// Drives the handshake; ready once bytes can flow.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Transport::Handshake(accept) = self {
            match ready!(accept.as_mut().poll(cx)) {
                Ok(s) => *self = Transport::Tls(Box::new(s)),
                Err(e) => {
                    tracing::debug!(message = "Admin TLS handshake failed.", error = %e);
                    *self = Transport::Failed;
                    return Poll::Ready(Err(e));
                }
            }
        }
        match self {
            Transport::Failed => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "admin TLS handshake failed",
            ))),
            _ => Poll::Ready(Ok(())),
        }
    }

    /// The stream bytes flow on (after [`Transport::poll_ready`]).
    fn io(&mut self) -> Pin<&mut (dyn AsyncReadWrite + Unpin)> {
        match self {
            Transport::Plain(t) => Pin::new(t),
            Transport::Tls(t) => Pin::new(t.as_mut()),
            Transport::Handshake(_) | Transport::Failed => unreachable!("polled before ready"),
        }
    }
}

/// What both transports are.
trait AsyncReadWrite: AsyncRead + AsyncWrite {}
impl<T: AsyncRead + AsyncWrite> AsyncReadWrite for T {}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_ready(cx))?;
        this.io().poll_read(cx, buf)
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_ready(cx))?;
        this.io().poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_ready(cx))?;
        this.io().poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this {
            Transport::Handshake(_) | Transport::Failed => Poll::Ready(Ok(())),
            _ => this.io().poll_shutdown(cx),
        }
    }
}
