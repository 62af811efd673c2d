//! Where the `grpc` provider's calls go: the `endpoint` setting, its TLS settings, and the
//! channel every call of one effect shares.
//!
//! Owns [`Target`] and the reading of `endpoint`, `tls_ca_file`, `tls_cert_file`,
//! `tls_key_file` and `tls_server_name`.
//!
//! Guarantees: the endpoint is a plain `scheme://host:port` (never a template, no path or
//! query); TLS settings are refused on an `http://` endpoint rather than ignored; every TLS
//! file is read and checked when the manifest is loaded, not on the first call; the channel
//! is made once, lazily, so loading a manifest never connects.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::Value as Json;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::super::error::SettingsError;
use super::super::settings::{Settings, pem_certificates};

/// Where calls go: the endpoint and, once the first call made it, its channel (HTTP/2
/// connections shared by every call of this effect).
#[derive(Clone)]
pub(super) struct Target {
    endpoint: Endpoint,
    channel: Arc<OnceLock<Channel>>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Target")
    }
}

impl Target {
    /// Reads the `endpoint` and TLS settings; no connection is made yet.
    pub(super) fn of(c: &Settings<'_>) -> Result<Self, SettingsError> {
        Ok(Self {
            endpoint: endpoint(c)?,
            channel: Arc::default(),
        })
    }

    /// The shared channel, made (lazily connecting) on the first call.
    pub(super) fn channel(&self) -> Channel {
        self.channel
            .get_or_init(|| self.endpoint.connect_lazy())
            .clone()
    }
}

/// The endpoint, with its TLS settings.
fn endpoint(c: &Settings<'_>) -> Result<Endpoint, SettingsError> {
    let url = match c.get("endpoint") {
        Some(Json::String(u)) => u,
        Some(_) => return Err(c.err("endpoint", "must be a URL string")),
        None => return Err(c.err("endpoint", "is required")),
    };
    if url.contains("${") {
        return Err(c.err(
            "endpoint",
            "is not a template: write the address itself (credentials belong in `metadata`)",
        ));
    }
    let uri: tonic::codegen::http::Uri = url
        .parse()
        .map_err(|_| c.err("endpoint", "is not a URL (`http://host:port`)"))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(c.err("endpoint", "must start with http:// or https://")),
    };
    if uri.host().is_none_or(str::is_empty) {
        return Err(c.err("endpoint", "has no host"));
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err(c.err(
            "endpoint",
            "has a path or query; gRPC calls go to `/package.Service/Method` on the host, \
             so write only `scheme://host:port`",
        ));
    }
    let endpoint = Endpoint::from_shared(url.clone())
        .map_err(|e| c.err("endpoint", e.to_string()))?
        .connect_timeout(Duration::from_secs(10));
    let ca = c.path("tls_ca_file")?;
    let cert = c.path("tls_cert_file")?;
    let key = c.path("tls_key_file")?;
    let name = match c.get("tls_server_name") {
        None => None,
        Some(Json::String(n)) => Some(n.clone()),
        Some(_) => return Err(c.err("tls_server_name", "must be a host name")),
    };
    if !https {
        for (k, set) in [
            ("tls_ca_file", ca.is_some()),
            ("tls_cert_file", cert.is_some()),
            ("tls_key_file", key.is_some()),
            ("tls_server_name", name.is_some()),
        ] {
            if set {
                return Err(c.err(k, "needs an https:// endpoint"));
            }
        }
        return Ok(endpoint);
    }
    let read = |key: &str, p: &std::path::Path| {
        std::fs::read(p).map_err(|e| c.err(key, format!("cannot read `{}`: {e}", p.display())))
    };
    let mut tls = ClientTlsConfig::new();
    tls = match &ca {
        Some(p) => {
            pem_certificates(p).map_err(|e| c.err("tls_ca_file", e))?;
            tls.ca_certificate(Certificate::from_pem(read("tls_ca_file", p)?))
        }
        None => tls.with_webpki_roots(),
    };
    match (&cert, &key) {
        (Some(cp), Some(kp)) => {
            pem_certificates(cp).map_err(|e| c.err("tls_cert_file", e))?;
            tls = tls.identity(Identity::from_pem(
                read("tls_cert_file", cp)?,
                read("tls_key_file", kp)?,
            ));
        }
        (None, None) => {}
        (Some(_), None) => {
            return Err(c.err(
                "tls_cert_file",
                "needs `tls_key_file` (its private key) too",
            ));
        }
        (None, Some(_)) => {
            return Err(c.err(
                "tls_key_file",
                "needs `tls_cert_file` (its certificate) too",
            ));
        }
    }
    if let Some(n) = name {
        tls = tls.domain_name(n);
    }
    endpoint
        .tls_config(tls)
        .map_err(|e| c.err("endpoint", format!("TLS set-up: {e}")))
}
