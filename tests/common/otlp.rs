//! An OTLP/HTTP trace receiver for the tracing tests: it serves `POST /v1/traces` the way
//! an OpenTelemetry Collector's `otlphttp` receiver does (protobuf `ExportTraceServiceRequest`
//! in, an empty `ExportTraceServiceResponse` out), decodes each request with the
//! OpenTelemetry project's own protobuf definitions, and keeps every span it was sent.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;

/// One received span, with ids as lowercase hex.
#[derive(Debug, Clone)]
pub struct Received {
    /// Span name.
    pub name: String,
    /// Trace id (32 hex).
    pub trace_id: String,
    /// Span id (16 hex).
    pub span_id: String,
    /// Parent span id (16 hex), empty for a root span.
    pub parent: String,
    /// `SpanKind` as its protobuf number (2 server, 3 client, 4 producer, 5 consumer).
    pub kind: i32,
    /// Error status (`STATUS_CODE_ERROR`).
    pub failed: bool,
    /// String and integer attributes of the span, as text.
    pub attrs: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service: String,
}

impl Received {
    /// The attribute `key`, if the span has it.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The receiver: `endpoint` is what goes into `tracing.otlp_endpoint`.
#[derive(Clone)]
pub struct Receiver {
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub endpoint: String,
    spans: Arc<Mutex<Vec<Received>>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        _ => String::new(),
    }
}

impl Receiver {
    /// Starts on a free loopback port.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let me = Self {
            endpoint,
            spans: Arc::new(Mutex::new(Vec::new())),
        };
        let state = me.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let state = state.clone();
                async move { state.export(&headers, &body) }
            }),
        );
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        me
    }

    fn export(&self, headers: &HeaderMap, body: &[u8]) -> axum::response::Response {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if content_type != "application/x-protobuf" {
            return (StatusCode::UNSUPPORTED_MEDIA_TYPE, "protobuf only").into_response();
        }
        let req = match ExportTraceServiceRequest::decode(body) {
            Ok(r) => r,
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        };
        let mut got = Vec::new();
        for rs in req.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                .map(|a| text(a.value.as_ref().and_then(|v| v.value.as_ref())))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    got.push(Received {
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        kind: s.kind,
                        failed: s.status.as_ref().is_some_and(|st| st.code == 2),
                        attrs: s
                            .attributes
                            .iter()
                            .map(|a| {
                                (
                                    a.key.clone(),
                                    text(a.value.as_ref().and_then(|v| v.value.as_ref())),
                                )
                            })
                            .collect(),
                        service: service.clone(),
                    });
                }
            }
        }
        self.spans.lock().unwrap().extend(got);
        let reply = ExportTraceServiceResponse::default().encode_to_vec();
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/x-protobuf")],
            reply,
        )
            .into_response()
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of trace `trace_id`.
    pub fn trace(&self, trace_id: &str) -> Vec<Received> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }
}
