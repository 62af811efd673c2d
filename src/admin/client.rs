//! The admin API as the CLI's operator commands use it against a running node
//! (`--admin URL`): one blocking call per command, the bearer token from
//! `--admin-token-file` or `RUNNER_ADMIN_TOKEN`; an `https://` node is checked against the
//! public roots and, with `--admin-ca-file` / `RUNNER_ADMIN_CA_FILE`, a private CA.
//!
//! Guarantee: an answer other than 2xx is an error carrying the status and the node's own
//! `error` text; the token never appears in an error.

use serde_json::Value as Json;

/// A running node's admin API.
#[derive(Debug, Clone)]
pub struct AdminClient {
    base: String,
    token: Option<String>,
    /// A private CA's certificate to trust (PEM).
    ca: Option<reqwest::Certificate>,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The node could not be reached.
    #[error("cannot reach the admin API at {base}: {reason}")]
    Unreachable {
        /// The base URL.
        base: String,
        /// Why.
        reason: String,
    },
    /// The node answered with an error.
    #[error("the node answered {status}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The node's `error`, or the body.
        message: String,
    },
}

impl AdminClient {
    /// A client of the node at `base` (`http://host:port`).
    pub fn new(base: &str, token: Option<String>) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            token,
            ca: None,
        }
    }

    /// The same client, also trusting the CA certificate `pem` for an `https://` node.
    pub fn trusting(mut self, pem: &[u8]) -> Result<Self, String> {
        self.ca = Some(reqwest::Certificate::from_pem(pem).map_err(|e| e.to_string())?);
        Ok(self)
    }

    /// `GET path` (with its query); the JSON answer.
    pub fn get(&self, path: &str) -> Result<Json, ClientError> {
        self.call(reqwest::Method::GET, path)
    }

    /// `POST path` with a JSON body; the JSON answer.
    pub fn post(&self, path: &str, body: &Json) -> Result<Json, ClientError> {
        self.call_with(reqwest::Method::POST, path, Some(body))
    }

    fn call(&self, method: reqwest::Method, path: &str) -> Result<Json, ClientError> {
        self.call_with(method, path, None)
    }

    fn call_with(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Json>,
    ) -> Result<Json, ClientError> {
        let unreachable = |reason: String| ClientError::Unreachable {
            base: self.base.clone(),
            reason,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| unreachable(e.to_string()))?;
        rt.block_on(async {
            let mut client = reqwest::Client::builder();
            if let Some(ca) = &self.ca {
                client = client.add_root_certificate(ca.clone());
            }
            let client = client.build().map_err(|e| unreachable(e.to_string()))?;
            let mut req = client
                .request(method, format!("{}{path}", self.base))
                .timeout(std::time::Duration::from_secs(60));
            if let Some(t) = &self.token {
                req = req.bearer_auth(t);
            }
            if let Some(b) = body {
                req = req.json(b);
            }
            let resp = req
                .send()
                .await
                .map_err(|e| unreachable(e.without_url().to_string()))?;
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap_or_default();
            let json: Json = serde_json::from_str(&text).unwrap_or(Json::String(text));
            if (200..300).contains(&status) {
                Ok(json)
            } else {
                let message = json
                    .get("error")
                    .and_then(Json::as_str)
                    .map(str::to_string)
                    .unwrap_or_else(|| json.to_string());
                Err(ClientError::Refused { status, message })
            }
        })
    }
}

/// Percent-encodes a query value.
pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
