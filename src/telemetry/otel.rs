//! Distributed tracing: one span per hop a saga's work takes, joined by W3C trace context
//! and exported over OTLP/HTTP.
//!
//! The hops, each a span whose parent is the previous one, with the `traceparent` header of
//! the message it sends naming the span (so the next hop, on this node or another, becomes
//! its child):
//!
//! | span | kind | where | message it stamps |
//! |---|---|---|---|
//! | `saga.route` | producer | partition router | the input's copy in the partition inbox |
//! | `saga.transition` | consumer | saga worker, per applied input | every outbox record it writes |
//! | `outbox.publish` | producer | relay | the published command, event or effect command |
//! | `effect.execute` | consumer | effect worker, per command | — |
//! | `effect.call` | client | effect worker, per attempt | the upstream request (`traceparent` header / gRPC metadata) |
//! | `effect.result` | producer | effect worker | the effect's result event |
//!
//! Guarantees:
//! - With no `tracing.otlp_endpoint` nothing here does any work: [`hop`] returns `None`,
//!   and every component passes the input's `traceparent` on unchanged (the behaviour
//!   tracing had before export existed).
//! - With an endpoint, an input that carries a well-formed `traceparent` continues that
//!   trace and follows its sampled flag; an input without one (or with a malformed one)
//!   starts a trace of its own, recorded for `tracing.sample_ratio` of trace ids.
//! - Export never blocks the work: spans are queued to a batch processor on its own thread
//!   (queue bounded at 2 048 spans; when it is full, spans are dropped, never the work),
//!   which posts protobuf to `<otlp_endpoint>/v1/traces`. A receiver that is down costs
//!   spans, not throughput. [`Exporter::shutdown`] flushes what is queued at exit.
//! - A span is the moment of its hop, not the wait around it: `outbox.publish` ends when the
//!   record is handed to the client, before the broker's acknowledgement.

use std::sync::OnceLock;

use opentelemetry::Context;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};

use crate::config::TracingConfig;

pub use opentelemetry::KeyValue;
pub use opentelemetry::trace::SpanKind as Kind;

/// The process's tracer, set once by [`init`] when export is configured.
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Spans queued for export at most; beyond it new spans are dropped.
const QUEUE: usize = 2048;

/// Owns the export pipeline; [`Exporter::shutdown`] flushes it.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// Exports what is still queued (bounded by the export timeout) and stops the exporter.
    /// Blocking: call it outside the async runtime, at exit.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(message = "Flushing the last trace spans failed.", error = %e);
        }
    }
}

/// Starts OTLP export when `cfg.otlp_endpoint` is set; `None` (and no tracing work at all)
/// when it is not. `node` and `mode` become resource attributes of every span.
pub fn init(cfg: &TracingConfig, node: &str, mode: &str) -> anyhow::Result<Option<Exporter>> {
    let Some(endpoint) = cfg.otlp_endpoint.as_deref() else {
        return Ok(None);
    };
    let url = traces_url(endpoint);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url.clone())
        .with_timeout(cfg.export_timeout.get())
        .build()
        .map_err(|e| anyhow::anyhow!("tracing.otlp_endpoint {url}: {e}"))?;
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(QUEUE)
        .with_scheduled_delay(cfg.export_interval.get())
        .build();
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch)
        .build();
    let resource = Resource::builder()
        .with_service_name(cfg.service_name.clone())
        .with_attributes([
            KeyValue::new("service.instance.id", node.to_string()),
            KeyValue::new("runner.mode", mode.to_string()),
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        ])
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            cfg.sample_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("runner");
    if TRACER.set(tracer).is_err() {
        anyhow::bail!("tracing export was started twice in one process");
    }
    tracing::info!(message = "Exporting trace spans over OTLP/HTTP.", endpoint = %url, sample_ratio = cfg.sample_ratio);
    Ok(Some(Exporter { provider }))
}

/// `<endpoint>/v1/traces`, unless the endpoint already names that path.
fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_string()
    } else {
        format!("{base}/v1/traces")
    }
}

/// Whether spans are being made (export configured).
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// One hop's span. It ends when dropped; its [`Hop::traceparent`] goes on the message
/// (or request) the hop sends.
pub struct Hop {
    span: opentelemetry_sdk::trace::Span,
    traceparent: String,
}

impl Hop {
    /// The W3C `traceparent` naming this span, for the next hop.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// Adds an attribute (for what is known only once the hop has run).
    pub fn set(&mut self, key: &'static str, value: impl Into<opentelemetry::Value>) {
        self.span.set_attribute(KeyValue::new(key, value));
    }

    /// Marks the hop as failed, with a short description.
    pub fn fail(&mut self, description: impl Into<String>) {
        self.span.set_status(Status::error(description.into()));
    }
}

impl Drop for Hop {
    fn drop(&mut self) {
        self.span.end();
    }
}

/// Starts the span of one hop as a child of `parent` (a `traceparent`), or of nothing when
/// `parent` is absent or malformed. `attrs` is called only when a span is made. `None` when
/// export is not configured.
pub fn hop(
    name: &'static str,
    kind: SpanKind,
    parent: Option<&str>,
    attrs: impl FnOnce() -> Vec<KeyValue>,
) -> Option<Hop> {
    let tracer = TRACER.get()?;
    let cx = match parent.and_then(parse) {
        Some(remote) => Context::new().with_remote_span_context(remote),
        None => Context::new(),
    };
    let span = tracer
        .span_builder(name)
        .with_kind(kind)
        .with_attributes(attrs())
        .start_with_context(tracer, &cx);
    let traceparent = format(span.span_context());
    Some(Hop { span, traceparent })
}

/// The `traceparent` to send on: the hop's when there is one, else the one received.
pub fn onward<'a>(hop: Option<&'a Hop>, received: Option<&'a str>) -> Option<&'a str> {
    hop.map(Hop::traceparent).or(received)
}

/// The fields of a `traceparent` shaped `<2 hex>-<32 hex>-<16 hex>-<2 hex>[-…]`.
pub struct Fields<'a> {
    /// Version.
    pub version: &'a str,
    /// Trace id.
    pub trace: &'a str,
    /// Parent (span) id.
    pub span: &'a str,
    /// Flags.
    pub flags: &'a str,
    /// Whether more fields follow (allowed by versions after `00` only).
    pub more: bool,
}

/// The four fields of `tp` when each has its length and is hex; `None` otherwise.
pub fn fields(tp: &str) -> Option<Fields<'_>> {
    let mut parts = tp.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(version, 2) && hex(trace, 32) && hex(span, 16) && hex(flags, 2)).then_some(Fields {
        version,
        trace,
        span,
        flags,
        more: parts.next().is_some(),
    })
}

/// Parses a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`; later versions may append
/// fields). `None` for anything malformed, the invalid version `ff`, or all-zero ids.
pub fn parse(tp: &str) -> Option<SpanContext> {
    let Fields {
        version,
        trace,
        span,
        flags,
        more,
    } = fields(tp)?;
    if version == "ff" || (version == "00" && more) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()? & 1);
    Some(SpanContext::new(
        trace_id,
        span_id,
        flags,
        true,
        TraceState::default(),
    ))
}

/// The `traceparent` naming `cx`.
pub fn format(cx: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        cx.trace_id(),
        cx.span_id(),
        cx.trace_flags().to_u8()
    )
}

/// Attribute helper: a string attribute.
pub fn attr(key: &'static str, value: impl Into<String>) -> KeyValue {
    KeyValue::new(key, value.into())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_round_trips() {
        let cx = parse(TP).unwrap();
        assert!(cx.is_sampled());
        assert!(cx.is_remote());
        assert_eq!(format(&cx), TP);
        let unsampled = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!unsampled.is_sampled());
    }

    #[test]
    fn malformed_trace_contexts_are_refused() {
        for bad in [
            "",
            "00-abc-def-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ] {
            assert!(parse(bad).is_none(), "{bad:?} was accepted");
        }
        // A later version may carry more fields; its first four are read.
        assert!(parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz").is_some());
    }

    #[test]
    fn without_export_no_span_is_made() {
        assert!(!enabled());
        let mut called = false;
        let h = hop("saga.transition", Kind::Consumer, Some(TP), || {
            called = true;
            vec![]
        });
        assert!(h.is_none());
        assert!(!called, "attributes were built for a span that is not made");
        assert_eq!(onward(h.as_ref(), Some(TP)), Some(TP));
    }

    #[test]
    fn the_traces_path_is_added_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }
}
