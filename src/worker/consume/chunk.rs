//! A chunk of consumer messages turned into inputs, and which messages a reader wants.
//!
//! Guarantees: inputs keep the stream's order; a chunk ends at the first consumer error,
//! handed on after what came before it, so nothing read past an error is submitted; a
//! routed copy is read as its original (subject, source, refusal, broker time).

use crate::broker::headers;
use crate::worker::admission::RawInput;

/// The filters an ordered consumer of `filters` asks the server for: its one filter, or none
/// when it has several, the reader then skipping what matches none itself ([`wanted`]).
/// The server serves a consumer with several filters by intersecting them with the subjects
/// of the message block it reads, for every message; on a stream with a subject per saga
/// instance (effect results) that cost the three-node bench about a third of its broker
/// CPU. Reading the few messages no filter wants (fence markers) is far cheaper.
pub(crate) fn server_filters(filters: &[String]) -> Vec<String> {
    if filters.len() == 1 {
        filters.to_vec()
    } else {
        Vec::new()
    }
}

/// Whether a message on `subject` is one the reader of `filters` wants.
pub(crate) fn wanted(filters: &[String], subject: &str) -> bool {
    filters.len() <= 1 || filters.iter().any(|f| crate::broker::covers(f, subject))
}

/// One chunk of the stream, ready to submit.
pub(super) struct Chunk<E> {
    /// The messages read before any error, as (stream sequence, input).
    pub(super) batch: Vec<(u64, RawInput)>,
    /// The error that ended the chunk early, if any.
    pub(super) failure: Option<E>,
    /// Messages still pending in the stream after the last one read.
    pub(super) lag: Option<u64>,
}

/// Payloads from this size on are kept as the client received them; smaller ones are copied.
const SHARE_FROM: usize = 16 * 1024;

/// An input's body, as a saga input reader or a router keeps it. A large payload is shared
/// with the message, so a batch never holds its bytes twice. A small one is copied: sharing
/// would keep the client's whole read buffer (tens of KiB, holding other traffic) alive for
/// as long as the input waits.
pub(crate) fn body_of(payload: &bytes::Bytes) -> bytes::Bytes {
    if payload.len() >= SHARE_FROM {
        payload.clone()
    } else {
        bytes::Bytes::copy_from_slice(payload)
    }
}

/// Turns a chunk of consumer items into inputs, stopping at the first error.
pub(super) fn read_chunk<E>(
    stream: &str,
    filters: &[String],
    chunk: Vec<Result<async_nats::jetstream::Message, E>>,
    wait: &prometheus::Histogram,
) -> Chunk<E> {
    let mut out = Chunk {
        batch: Vec::with_capacity(chunk.len()),
        failure: None,
        lag: None,
    };
    let now = headers::now_nanos();
    for item in chunk {
        match item {
            Ok(msg) => {
                let Ok(info) = msg.info() else { continue };
                let seq = info.stream_sequence;
                out.lag = Some(info.pending);
                if !wanted(filters, msg.subject.as_str()) {
                    continue; // the server sent it unfiltered (see `server_filters`)
                }
                wait.observe(headers::stored_age(&info, now));
                let traceparent = headers::traceparent(msg.headers.as_ref());
                // A routed input names where it came from (the inbox is written only by
                // routers, the timer loop and effect executors, under Runner's subjects).
                let routed = |name: &str| {
                    msg.headers
                        .as_ref()
                        .and_then(|h| h.get(name))
                        .map(|v| v.as_str().to_string())
                };
                let subject =
                    routed(headers::ROUTED_SUBJECT).unwrap_or_else(|| msg.subject.to_string());
                // A control input is published into the inbox itself, never copied from a
                // source: its time is the inbox's own, whatever its headers claim (its seal
                // check bounds the time it was issued by it: `worker/control.rs`).
                let source_time = (subject != crate::worker::control::CONTROL_SUBJECT)
                    .then(|| routed(headers::ROUTED_SOURCE_TIME))
                    .flatten();
                out.batch.push((
                    seq,
                    RawInput {
                        subject,
                        body: body_of(&msg.payload),
                        traceparent,
                        // A routed copy's headers are the router's; it counted the original's.
                        header_bytes: 0,
                        refused: routed(headers::ROUTED_REFUSAL),
                        live_cap: routed(headers::LIVE_CAP).and_then(|v| v.parse().ok()),
                        timer_cap: routed(headers::TIMER_CAP).and_then(|v| v.parse().ok()),
                        source: routed(headers::ROUTED_SOURCE)
                            .unwrap_or_else(|| format!("{stream}:{seq}")),
                        // The broker's time of the input (a routed copy: of its source),
                        // which bounds the producer's `timestamp_ms` (admission.rs).
                        stored_ms: Some(headers::routed_stored_ms(
                            source_time.as_deref(),
                            headers::stored_ms(&info),
                        )),
                    },
                ));
            }
            Err(e) => {
                out.failure = Some(e);
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_filters_are_applied_here_and_one_is_left_to_the_server() {
        let one = vec!["runner.inbox.3.>".to_string()];
        assert_eq!(server_filters(&one), one);
        assert!(wanted(&one, "anything: the server filtered"));
        let two = vec![
            "tenant.*.effect_result.>".to_string(),
            "tenant.*.workflow_event.>".to_string(),
        ];
        assert!(server_filters(&two).is_empty());
        assert!(wanted(&two, "tenant.a.effect_result.charge.c1"));
        assert!(wanted(&two, "tenant.a.workflow_event.order.o1"));
        assert!(!wanted(&two, "runner.fence.WORKFLOW_EVENTS.7"));
        assert!(!wanted(&two, "tenant.a.other.x.y"));
    }

    #[test]
    fn large_bodies_share_the_message_bytes_and_small_ones_are_copied() {
        // A read buffer holding a small payload and a large one.
        let buffer = bytes::Bytes::from(vec![7u8; 100 + SHARE_FROM]);
        let small = buffer.slice(0..100);
        let large = buffer.slice(100..);
        assert_eq!(
            body_of(&large).as_ptr(),
            large.as_ptr(),
            "shared, not copied"
        );
        let copied = body_of(&small);
        assert_eq!(copied, small);
        assert_ne!(copied.as_ptr(), small.as_ptr(), "copied out of the buffer");
    }
}
