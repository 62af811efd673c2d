//! The NATS headers Runner writes and reads, built in one place.
//!
//! Every message Runner publishes to its own streams (outbox records, effect results, dead
//! letters) carries `Nats-Msg-Id` (its deterministic id, so JetStream drops a republished
//! copy inside the duplicate window), `Runner-Tenant`, and the `traceparent` of the input
//! that caused it, passed on unchanged so one trace follows a saga across every hop. Inputs
//! are read back through [`traceparent`]. (Messages the `nats` effect providers send to an
//! upstream carry the command's `Idempotency-Key` instead: see `effect/provider/nats.rs`.)

use async_nats::HeaderMap;

/// Header carrying the tenant.
pub const TENANT_HEADER: &str = "Runner-Tenant";
/// W3C trace context header.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// On a routed input in the saga inbox: the subject it was published on.
pub const ROUTED_SUBJECT: &str = "Runner-Subject";
/// On a routed input in the saga inbox: where it was read, `<stream>:<sequence>`.
pub const ROUTED_SOURCE: &str = "Runner-Source";

/// The headers of a message Runner publishes: its id, its tenant when known, and the
/// causing input's trace context when it had one.
pub fn outgoing(msg_id: &str, tenant: Option<&str>, traceparent: Option<&str>) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    if let Some(t) = tenant {
        h.insert(TENANT_HEADER, t);
    }
    if let Some(tp) = traceparent {
        h.insert(TRACEPARENT_HEADER, tp);
    }
    h
}

/// This host's clock in Unix nanoseconds, for [`stored_age`] (read once per chunk).
pub fn now_nanos() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

/// Seconds between JetStream storing the message `info` describes and `now` (from
/// [`now_nanos`]); 0 when the server's clock is ahead of this host's.
pub fn stored_age(info: &async_nats::jetstream::message::Info<'_>, now: i128) -> f64 {
    (now - info.published.unix_timestamp_nanos()).max(0) as f64 / 1e9
}

/// The `traceparent` of a received message, if it has one.
pub fn traceparent(headers: Option<&HeaderMap>) -> Option<String> {
    headers
        .and_then(|h| h.get(TRACEPARENT_HEADER))
        .map(|v| v.as_str().to_string())
}

/// `headers` without `Nats-Msg-Id` (a fenced batch sent again after the stream refused an
/// id an earlier writer left in its window: the fence, not the id, keeps it single).
pub fn without_msg_id(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (name, values) in headers.iter() {
        if *name == async_nats::header::NATS_MESSAGE_ID {
            continue;
        }
        for v in values {
            out.append(name.clone(), v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outgoing_headers_round_trip_the_trace_context() {
        let h = outgoing("id-1", Some("acme"), Some("00-abc-def-01"));
        assert_eq!(
            h.get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str()),
            Some("id-1")
        );
        assert_eq!(h.get(TENANT_HEADER).map(|v| v.as_str()), Some("acme"));
        assert_eq!(traceparent(Some(&h)).as_deref(), Some("00-abc-def-01"));
        let bare = outgoing("id-2", None, None);
        assert!(bare.get(TENANT_HEADER).is_none());
        assert_eq!(traceparent(Some(&bare)), None);
        assert_eq!(traceparent(None), None);
    }
}
