//! A real local HTTP upstream for effect tests: records every request (path, the
//! `Idempotency-Key` header and the other headers, when it arrived and when its handling
//! ended) and answers what the test's script says — a
//! status, a JSON body, an optional delay and `Retry-After`, and optionally only once the
//! test opens a [`Latch`].
//!
//! A held reply is how a test keeps a call in flight for as long as it needs, whatever the
//! machine's speed: the call is answered when the test releases it, not after a guessed
//! number of seconds. The upstream counts the calls it is holding or answering right now
//! ([`Upstream::in_flight`]) and the most it ever had at once ([`Upstream::max_in_flight`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value as Json, json};

/// What the upstream answers.
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: Json,
    /// Wait before answering.
    pub delay: Duration,
    /// `Retry-After` header, in seconds.
    pub retry_after: Option<u64>,
    /// Answer only once this latch is released.
    pub hold: Option<Latch>,
}

/// A one-way gate the test opens: calls held on it wait until [`Latch::release`].
#[derive(Clone, Debug)]
pub struct Latch(Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Latch {
    fn default() -> Self {
        Self::new()
    }
}

impl Latch {
    /// A closed latch.
    pub fn new() -> Self {
        Self(Arc::new(tokio::sync::watch::channel(false).0))
    }
    /// Opens it: every held call, and every later one, is answered.
    pub fn release(&self) {
        self.0.send_replace(true);
    }
    /// Waits until the latch is open.
    pub async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }
}

impl Reply {
    /// 200 with `body`.
    pub fn ok(body: Json) -> Self {
        Self {
            status: 200,
            body,
            delay: Duration::ZERO,
            retry_after: None,
            hold: None,
        }
    }
    /// `status` with an error body.
    pub fn status(status: u16) -> Self {
        Self {
            status,
            body: json!({"error": status}),
            delay: Duration::ZERO,
            retry_after: None,
            hold: None,
        }
    }
    /// The same reply after `d`.
    pub fn after(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
    /// The same reply, sent only once `latch` is released.
    pub fn until(mut self, latch: &Latch) -> Self {
        self.hold = Some(latch.clone());
        self
    }
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Hit {
    /// Path.
    pub path: String,
    /// `Idempotency-Key` header.
    pub key: Option<String>,
    /// `traceparent` header.
    pub traceparent: Option<String>,
    /// Request body.
    pub body: Json,
    /// Every request header (names in lower case; a repeated header keeps its last value).
    pub headers: HashMap<String, String>,
    /// Arrival.
    pub at: Instant,
    /// When the upstream was done with it: answered, or dropped because the client went
    /// away before the answer (`None` while it is still held or delayed).
    pub ended: Option<Instant>,
    /// How many requests with this key (this one included).
    pub nth: usize,
}

/// Decides a reply from (path, idempotency key, nth request with that key).
pub type Script = Arc<dyn Fn(&str, &str, usize) -> Reply + Send + Sync>;

/// The running upstream.
#[derive(Clone)]
pub struct Upstream {
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub base: String,
    hits: Arc<Mutex<Vec<Hit>>>,
    script: Arc<Mutex<Script>>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
}

/// Counts one call in flight for as long as it lives (also when the client goes away and
/// the server drops the handler).
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Stamps the end of one request's handling when it is dropped: after the answer is made,
/// or when the server drops the handler early.
struct Ends {
    hits: Arc<Mutex<Vec<Hit>>>,
    index: usize,
}

impl Drop for Ends {
    fn drop(&mut self) {
        if let Ok(mut hits) = self.hits.lock()
            && let Some(h) = hits.get_mut(self.index)
        {
            h.ended = Some(Instant::now());
        }
    }
}

impl Upstream {
    /// Starts on a free loopback port, answering with `script`.
    pub async fn start(script: Script) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let up = Self {
            base,
            hits: Arc::new(Mutex::new(Vec::new())),
            script: Arc::new(Mutex::new(script)),
            in_flight: Arc::new(AtomicUsize::new(0)),
            max_in_flight: Arc::new(AtomicUsize::new(0)),
        };
        let handler_state = up.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let up = handler_state.clone();
            async move { up.answer(uri, headers, body).await }
        });
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        up
    }

    /// Replaces the script.
    pub fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }

    async fn answer(&self, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let _in_flight = InFlight(self.in_flight.clone());
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let path = uri.path().to_string();
        let (reply, _ends) = {
            let mut hits = self.hits.lock().unwrap();
            let nth = 1 + hits.iter().filter(|h| h.key == key).count();
            hits.push(Hit {
                path: path.clone(),
                key: key.clone(),
                traceparent: headers
                    .get("traceparent")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                body: serde_json::from_slice(&body).unwrap_or(Json::Null),
                headers: headers
                    .iter()
                    .filter_map(|(k, v)| Some((k.as_str().to_owned(), v.to_str().ok()?.to_owned())))
                    .collect(),
                at: Instant::now(),
                ended: None,
                nth,
            });
            let ends = Ends {
                hits: self.hits.clone(),
                index: hits.len() - 1,
            };
            let script = self.script.lock().unwrap().clone();
            (script(&path, key.as_deref().unwrap_or(""), nth), ends)
        };
        if let Some(latch) = &reply.hold {
            latch.wait().await;
        }
        if !reply.delay.is_zero() {
            tokio::time::sleep(reply.delay).await;
        }
        let status = StatusCode::from_u16(reply.status).unwrap();
        let mut resp = (status, axum::Json(reply.body)).into_response();
        if let Some(s) = reply.retry_after {
            resp.headers_mut()
                .insert("retry-after", s.to_string().parse().unwrap());
        }
        resp
    }

    /// Calls received and not yet answered (held, delayed or being answered).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// The most calls ever in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    /// Every request so far.
    pub fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }

    /// Requests per idempotency key.
    pub fn per_key(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for h in self.hits() {
            *m.entry(h.key.unwrap_or_default()).or_insert(0) += 1;
        }
        m
    }

    /// Requests carrying `key`.
    pub fn count(&self, key: &str) -> usize {
        self.hits()
            .iter()
            .filter(|h| h.key.as_deref() == Some(key))
            .count()
    }
}
