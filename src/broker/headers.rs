//! The NATS headers Runner writes and reads, built in one place.
//!
//! Every message Runner publishes to its own streams (outbox records, effect results, dead
//! letters) carries `Nats-Msg-Id` (its deterministic id, so JetStream drops a republished
//! copy inside the duplicate window), `Runner-Tenant`, and the `traceparent` of the input
//! that caused it, passed on unchanged so one trace follows a saga across every hop. Inputs
//! are read back through [`traceparent`]. (Messages the `nats` effect providers send to an
//! upstream carry the command's `Idempotency-Key` instead: see `effect/provider/nats.rs`.)
//!
//! **Sizes count the whole message.** The broker's `max_payload` bounds the header block and
//! the body together, and JetStream refuses a header block over [`MAX_HEADER_BLOCK`] (error
//! 10097). So every bound Runner applies is computed here, from the bytes the headers take on
//! the wire ([`block_bytes`], [`record_bytes`]), never from the body alone. What Runner
//! copies from a producer's headers is validated first: only a well-formed W3C
//! `traceparent` (at most [`TRACEPARENT_BYTES`]) is ever read or written through
//! [`traceparent`] and [`outgoing`]; anything else under that name is dropped, so no producer
//! header can make Runner's own messages larger than it accounted for.

use async_nats::HeaderMap;

/// Header carrying the tenant.
pub const TENANT_HEADER: &str = "Runner-Tenant";
/// W3C trace context header.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// On a routed input in the saga inbox: the subject it was published on.
pub const ROUTED_SUBJECT: &str = "Runner-Subject";
/// On a routed input in the saga inbox: where it was read, `<stream>:<sequence>`.
pub const ROUTED_SOURCE: &str = "Runner-Source";

/// On a routed input in the saga inbox: when the broker stored the source message (its
/// JetStream timestamp, ms since the epoch, decimal), so the copy is applied with the
/// source's time bound, on first read and on every replay of the inbox alike.
pub const ROUTED_SOURCE_TIME: &str = "Runner-Source-Time";

/// On a routed input in the saga inbox: the tenant's cap on running instances when the
/// router copied it (`tenancy.live_instance_caps`, decimal), which the partition's owner
/// holds a new instance at (`worker/cap.rs`), on every replay of the inbox alike.
pub const LIVE_CAP: &str = "Runner-Live-Cap";

/// Likewise, the tenant's cap on pending timers (`tenancy.pending_timer_caps`, decimal).
pub const TIMER_CAP: &str = "Runner-Timer-Cap";

/// On a routed input in the saga inbox: the router refused it at admission, `<kind>: <why>`;
/// the partition's owner dead-letters it with that reason instead of admitting it again.
pub const ROUTED_REFUSAL: &str = "Runner-Refused";

/// On an effect command a partition's relay publishes: the saga inbox partition that owns the
/// instance waiting for it (decimal). Its executor publishes the result straight into that
/// partition's inbox ([`inbox_result_subject`]), so a result is read once, by its owner,
/// instead of being published to the workflow events stream and routed again.
pub const REPLY_PARTITION: &str = "Runner-Partition";

/// The most partitions a deployment may have (`partitions.count`); a larger
/// [`REPLY_PARTITION`] is not believed.
pub const MAX_PARTITIONS: u32 = 1024;

/// The subject of an effect result published straight into inbox partition `p`.
pub fn inbox_result_subject(p: u32) -> String {
    format!("runner.inbox.{p}.result")
}

/// The partition an effect command asks its result to be published into, when it carries a
/// well-formed [`REPLY_PARTITION`] (a decimal below [`MAX_PARTITIONS`]).
pub fn reply_partition(headers: Option<&HeaderMap>) -> Option<u32> {
    let v = headers?.get(REPLY_PARTITION)?.as_str();
    if v.is_empty() || v.len() > 4 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok().filter(|p| *p < MAX_PARTITIONS)
}

/// The largest header block JetStream stores (it encodes the length in 16 bits; a larger
/// one is refused with error 10097).
pub const MAX_HEADER_BLOCK: usize = u16::MAX as usize;
/// Length of a W3C `traceparent` of version `00`, the only form Runner passes on.
pub const TRACEPARENT_BYTES: usize = 55;
/// Upper bound of the headers a relay adds to a record beyond [`outgoing`]: the atomic batch
/// headers (`Nats-Batch-Id`, `Nats-Batch-Sequence`, `Nats-Batch-Commit`), an effect
/// command's [`REPLY_PARTITION`] and the fence headers (`Nats-Expected-Last-Subject-Sequence` and its `…-Subject`, a fence subject of two
/// stream names of at most 255 bytes each). The unit test below checks the bound.
pub const RELAY_HEADER_RESERVE: usize = 1024;
/// Upper bound of the header block of any message Runner publishes from a record: every
/// value in it is bounded (a message id Runner derives, a tenant of at most 128 bytes, a
/// valid `traceparent`) and a relay adds at most [`RELAY_HEADER_RESERVE`]. The unit test
/// below checks the bound.
pub const MAX_RECORD_HEADERS: usize = 2048;

/// `tp` when it is a well-formed W3C `traceparent` Runner may pass on: version `00`,
/// exactly [`TRACEPARENT_BYTES`] of lowercase hex fields, ids not all zero. A later
/// version's first four fields are read as a version `00` value (the W3C rule for a reader
/// of an older version) and passed on in that form; anything else is `None`.
pub fn valid_traceparent(tp: &str) -> Option<std::borrow::Cow<'_, str>> {
    use std::borrow::Cow;
    let head = tp.get(..TRACEPARENT_BYTES)?;
    let f = crate::telemetry::otel::fields(head)?;
    let zero = |s: &str| s.bytes().all(|b| b == b'0');
    if f.version == "ff"
        || head.bytes().any(|b| b.is_ascii_uppercase())
        || zero(f.trace)
        || zero(f.span)
    {
        return None;
    }
    if f.version == "00" {
        return (tp.len() == TRACEPARENT_BYTES).then_some(Cow::Borrowed(tp));
    }
    if tp.len() > TRACEPARENT_BYTES && tp.as_bytes()[TRACEPARENT_BYTES] != b'-' {
        return None;
    }
    Some(Cow::Owned(format!("00-{}-{}-{}", f.trace, f.span, f.flags)))
}

/// The headers of a message Runner publishes: its id, its tenant when known, and the
/// causing input's trace context when it had a valid one ([`valid_traceparent`]).
pub fn outgoing(msg_id: &str, tenant: Option<&str>, traceparent: Option<&str>) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    if let Some(t) = tenant {
        h.insert(TENANT_HEADER, t);
    }
    if let Some(tp) = traceparent.and_then(valid_traceparent) {
        h.insert(TRACEPARENT_HEADER, tp.as_ref());
    }
    h
}

/// Bytes of `headers` on the wire: `NATS/1.0\r\n`, a `Name: value\r\n` line per value, and
/// the closing `\r\n`; 0 for none (a message without headers has no block).
pub fn block_bytes(headers: Option<&HeaderMap>) -> usize {
    let Some(h) = headers.filter(|h| !h.is_empty()) else {
        return 0;
    };
    let mut n = b"NATS/1.0\r\n".len() + 2;
    for (name, values) in h.iter() {
        let name: &str = name.as_ref();
        for v in values {
            n += name.len() + 2 + v.as_str().len() + 2;
        }
    }
    n
}

fn line(name: &str, value_len: usize) -> usize {
    name.len() + 2 + value_len + 2
}

/// The header block [`outgoing`] makes for these values, without building it.
pub fn outgoing_bytes(msg_id: &str, tenant: Option<&str>, traceparent: Option<&str>) -> usize {
    let mut n = b"NATS/1.0\r\n".len() + 2 + line("Nats-Msg-Id", msg_id.len());
    if let Some(t) = tenant {
        n += line(TENANT_HEADER, t.len());
    }
    if traceparent.and_then(valid_traceparent).is_some() {
        n += line(TRACEPARENT_HEADER, TRACEPARENT_BYTES);
    }
    n
}

/// The largest message a record with these values becomes when a relay publishes it: its
/// body, the [`outgoing`] headers, and what a relay may add ([`RELAY_HEADER_RESERVE`]).
/// The record can be published when this is at most the broker's `max_payload` and its
/// header block at most [`MAX_HEADER_BLOCK`] (see [`record_fits`]).
pub fn record_bytes(
    msg_id: &str,
    tenant: Option<&str>,
    traceparent: Option<&str>,
    body_len: usize,
) -> usize {
    outgoing_bytes(msg_id, tenant, traceparent) + RELAY_HEADER_RESERVE + body_len
}

/// Why a record with these values can never be published under `max_payload` (0: unknown,
/// only the header limit is checked), or `None` when it can.
pub fn record_fits(
    msg_id: &str,
    tenant: Option<&str>,
    traceparent: Option<&str>,
    body_len: usize,
    max_payload: usize,
) -> Result<(), String> {
    let head = outgoing_bytes(msg_id, tenant, traceparent) + RELAY_HEADER_RESERVE;
    if head > MAX_HEADER_BLOCK {
        return Err(format!(
            "its headers would be {head} bytes; JetStream stores at most {MAX_HEADER_BLOCK}"
        ));
    }
    let total = head + body_len;
    if max_payload > 0 && total > max_payload {
        return Err(format!(
            "it would be {total} bytes ({body_len} of body, {head} of headers); the broker takes \
             at most {max_payload} (max_payload)"
        ));
    }
    Ok(())
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

/// When JetStream stored the message `info` describes, ms since the epoch (0 for a time
/// before the epoch). Fixed per stream sequence: every read of the message gets it.
pub fn stored_ms(info: &async_nats::jetstream::message::Info<'_>) -> u64 {
    u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0)
}

/// The stored time a routed copy is applied with: its source's, from
/// [`ROUTED_SOURCE_TIME`], or, when that is absent or unreadable (a copy routed before the
/// header existed), the copy's own `stored_ms` — fixed per inbox sequence as well.
pub fn routed_stored_ms(source_time: Option<&str>, own_ms: u64) -> u64 {
    source_time
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(own_ms)
}

/// The `traceparent` of a received message, if it has a valid one ([`valid_traceparent`]);
/// a malformed or oversized value is dropped here, so it never reaches a record.
pub fn traceparent(headers: Option<&HeaderMap>) -> Option<String> {
    headers
        .and_then(|h| h.get(TRACEPARENT_HEADER))
        .and_then(|v| valid_traceparent(v.as_str()).map(|tp| tp.into_owned()))
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

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn only_a_plain_partition_number_sends_a_result_into_the_inbox() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(REPLY_PARTITION, v);
            reply_partition(Some(&h))
        };
        assert_eq!(with("0"), Some(0));
        assert_eq!(with("1023"), Some(1023));
        for bad in ["", "1024", "99999", "-1", "+3", "3 ", "x", "1.5", "0x1"] {
            assert_eq!(with(bad), None, "{bad:?}");
        }
        assert_eq!(reply_partition(None), None);
        assert_eq!(reply_partition(Some(&HeaderMap::new())), None);
        assert_eq!(inbox_result_subject(7), "runner.inbox.7.result");
    }

    #[test]
    fn a_routed_copy_is_applied_with_its_source_s_stored_time() {
        let own = 1_800_000_000_500;
        assert_eq!(
            routed_stored_ms(Some("1800000000000"), own),
            1_800_000_000_000
        );
        // A copy without the header (routed by an older router), or with junk in it: the
        // copy's own stored time, which is as fixed as the source's.
        for junk in [None, Some(""), Some("soon"), Some("-1"), Some("1e3")] {
            assert_eq!(routed_stored_ms(junk, own), own, "{junk:?}");
        }
    }

    #[test]
    fn only_well_formed_trace_contexts_pass() {
        assert_eq!(valid_traceparent(TP).as_deref(), Some(TP));
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
        assert_eq!(valid_traceparent(later).as_deref(), Some(TP));
        for bad in [
            "",
            "00-abc-def-01",
            &format!("{TP}-more"),
            &format!("{TP}{}", "x".repeat(60_000)),
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "02-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-4bf92f3577b34da6a3ce929d0e0e47é6-00f067aa0ba902b7-01",
        ] {
            assert_eq!(valid_traceparent(bad), None, "{bad:?}");
        }
        let mut h = HeaderMap::new();
        h.insert(TRACEPARENT_HEADER, "x".repeat(60_000).as_str());
        assert_eq!(traceparent(Some(&h)), None);
        // `outgoing` drops what it may not pass on, whoever calls it.
        let out = outgoing("id", None, Some(&"y".repeat(60_000)));
        assert!(out.get(TRACEPARENT_HEADER).is_none());
    }

    #[test]
    fn header_sizes_are_the_wire_sizes() {
        let h = outgoing("id-1", Some("acme"), Some(TP));
        // What the client writes: the version line, one line per value, the blank line.
        let wire = format!(
            "NATS/1.0\r\nNats-Msg-Id: id-1\r\nRunner-Tenant: acme\r\ntraceparent: {TP}\r\n\r\n"
        );
        assert_eq!(block_bytes(Some(&h)), wire.len());
        assert_eq!(outgoing_bytes("id-1", Some("acme"), Some(TP)), wire.len());
        assert_eq!(
            outgoing_bytes("id-1", Some("acme"), Some("bad")),
            wire.len() - 13 - 57
        );
        assert_eq!(block_bytes(None), 0);
        assert_eq!(block_bytes(Some(&HeaderMap::new())), 0);
        assert_eq!(
            record_bytes("id-1", Some("acme"), Some(TP), 10),
            wire.len() + RELAY_HEADER_RESERVE + 10
        );
    }

    #[test]
    fn the_record_header_bound_holds_for_the_longest_values() {
        let id = "i".repeat(128);
        let tenant = "t".repeat(128); // the longest tenant admission lets through
        let longest = outgoing_bytes(&id, Some(&tenant), Some(TP)) + RELAY_HEADER_RESERVE;
        assert!(longest <= MAX_RECORD_HEADERS, "{longest}");
        // A producer's oversized trace context adds nothing.
        let junk = "z".repeat(70_000);
        assert_eq!(
            outgoing_bytes(&id, Some(&tenant), Some(&junk)),
            outgoing_bytes(&id, Some(&tenant), None)
        );
        assert!(record_fits(&id, Some(&tenant), Some(&junk), 10, 4096).is_ok());
        let why = record_fits("id", None, None, 1_048_000, 1 << 20).expect_err("too large");
        assert!(why.contains("1048576"), "{why}");
    }

    #[test]
    fn the_relay_reserve_covers_batch_and_fence_headers() {
        use crate::broker::fence::EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT;
        use async_nats::header::{
            NATS_BATCH_COMMIT, NATS_BATCH_ID, NATS_BATCH_SEQUENCE,
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
        };
        let longest_stream = "S".repeat(255);
        let mut h = HeaderMap::new();
        h.insert(NATS_BATCH_ID, "b".repeat(64).as_str());
        h.insert(NATS_BATCH_SEQUENCE, "1000");
        h.insert(NATS_BATCH_COMMIT, "1");
        h.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            u64::MAX.to_string().as_str(),
        );
        h.insert(
            EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT,
            crate::broker::fence::fence_subject(
                &longest_stream,
                format!("{longest_stream}.{}", u32::MAX),
            )
            .as_str(),
        );
        h.insert(REPLY_PARTITION, (MAX_PARTITIONS - 1).to_string().as_str());
        // Only the lines count: the version line and blank line are the record's own.
        let lines = block_bytes(Some(&h)) - b"NATS/1.0\r\n\r\n".len();
        assert!(lines <= RELAY_HEADER_RESERVE, "{lines}");
    }

    #[test]
    fn outgoing_headers_round_trip_the_trace_context() {
        let h = outgoing("id-1", Some("acme"), Some(TP));
        assert_eq!(
            h.get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str()),
            Some("id-1")
        );
        assert_eq!(h.get(TENANT_HEADER).map(|v| v.as_str()), Some("acme"));
        assert_eq!(traceparent(Some(&h)).as_deref(), Some(TP));
        let bare = outgoing("id-2", None, None);
        assert!(bare.get(TENANT_HEADER).is_none());
        assert_eq!(traceparent(Some(&bare)), None);
        assert_eq!(traceparent(None), None);
    }
}
