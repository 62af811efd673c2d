//! Records the broker can never take, parked so the relay goes on.
//!
//! A record that, with its headers, is larger than the server's `max_payload`, or whose
//! header block JetStream cannot store, would be refused on every attempt, and since the relay publishes in outbox order it would hold
//! every later record behind it, across restarts. Outputs are checked against that budget
//! when committed, so such a record only exists if it was written before the check, or the
//! server's limit shrank since. Both relays screen each record before sending it
//! ([`unpublishable`]) and park the ones that can never go out ([`park`]).
//!
//! Guarantee: parking is one write transaction that records a dead letter of kind
//! [`kind::UNPUBLISHABLE`] and writes its message (bounded, see
//! [`deadletter::EXCERPT_BYTES`]) in the record's place: same outbox sequence, same cause,
//! so it goes out exactly where the record would have, and in partitioned mode the fence
//! watermark treats it as it would have treated the record. Nothing is dropped silently: the dead letter keeps the record's subject, message
//! id and an excerpt of its body; `runner_relay_parked_total` counts it and `/health`
//! reports the node degraded while parked records are pending.

use crate::clock::now_ms;
use crate::deadletter::{self, Poison, Refused, kind};
use crate::storage::tables::OutboxRecord;
use crate::storage::{StorageError, Store};
use crate::telemetry::Metrics;

/// Why `rec` can never be published under the broker's `max_payload` (0: unknown, only the
/// header limit is checked), counting the headers it goes out with and those a relay adds.
pub(crate) fn unpublishable(rec: &OutboxRecord, max_payload: usize) -> Option<String> {
    crate::broker::headers::record_fits(
        &rec.msg_id,
        Some(&rec.tenant),
        rec.traceparent.as_deref(),
        rec.body.len(),
        max_payload,
    )
    .err()
    .map(|why| {
        format!(
            "output `{}` (message id {}): {why}",
            rec.subject, rec.msg_id
        )
    })
}

/// Whether the broker refused a publish for a reason sending it again cannot change: the
/// message is larger than the connection's `max_payload` (the client refuses it before
/// sending), than the stream's largest message (10054), or its header block than JetStream
/// stores (10097). The record is then parked at once ([`park_seq`]) instead of retried.
pub(crate) fn refused_for_good(e: &async_nats::jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::PublishErrorKind;
    if e.kind() == PublishErrorKind::MaxPayloadExceeded {
        return true;
    }
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|j| {
            matches!(
                j.error_code(),
                ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                    | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
            )
        })
}

/// Parks outbox record `seq` of `partition` (read again here) because the broker refused it
/// for good with `reason`; nothing when the record is gone already.
pub(crate) async fn park_seq(
    store: &Store,
    metrics: &Metrics,
    partition: u16,
    seq: u64,
    reason: String,
) -> Result<(), StorageError> {
    let found = store
        .read(move |t| t.outbox_batch(partition, seq, 1))
        .await?
        .into_iter()
        .find(|(s, _)| *s == seq);
    match found {
        Some((_, rec)) => {
            let why = format!(
                "output `{}` (message id {}) was refused by the broker: {reason}",
                rec.subject, rec.msg_id
            );
            park(store, metrics, partition, seq, &rec, why).await
        }
        None => Ok(()),
    }
}

/// Replaces outbox record `seq` of `partition` by its dead letter, in one transaction.
pub(crate) async fn park(
    store: &Store,
    metrics: &Metrics,
    partition: u16,
    seq: u64,
    rec: &OutboxRecord,
    reason: String,
) -> Result<(), StorageError> {
    let rec = rec.clone();
    let why = reason.clone();
    store
        .write(move |t| {
            let source = format!("outbox:{partition}:{seq}");
            let letter = deadletter::store(
                t,
                Poison {
                    refused: Refused {
                        tenant: &rec.tenant,
                        kind: kind::UNPUBLISHABLE,
                        reason: &why,
                        subject: &rec.subject,
                        source: &source,
                        body: rec.body.as_bytes(),
                        at_ms: now_ms(),
                    },
                    traceparent: rec.traceparent.as_deref(),
                    route: None,
                    // Its message takes the record's place and cause (see the module doc).
                    outbox: (partition, rec.cause),
                    // An output, not an input: it is never redriven into a saga.
                    stored_ms: None,
                },
            )?;
            t.replace_outbox(partition, seq, &letter)
        })
        .await?;
    metrics.relay_parked.inc();
    tracing::error!(message = "Relay parked an output the broker can never take; it is dead-lettered and the relay goes on.", partition, outbox_seq = seq, reason = %reason);
    Ok(())
}

/// Parks every record of `records` that can never be published; returns how many. On a
/// storage failure it stops and returns the error (the caller retries later).
pub(crate) async fn screen(
    store: &Store,
    metrics: &Metrics,
    partition: u16,
    records: &[(u64, OutboxRecord)],
    max: usize,
) -> Result<usize, StorageError> {
    let mut parked = 0;
    for (seq, rec) in records {
        if let Some(why) = unpublishable(rec, max) {
            park(store, metrics, partition, *seq, rec, why).await?;
            parked += 1;
        }
    }
    Ok(parked)
}

#[cfg(test)]
mod tests {
    use super::refused_for_good;
    use async_nats::jetstream::context::{PublishError, PublishErrorKind};

    fn refusal(code: u64) -> PublishError {
        let e: async_nats::jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": 400, "err_code": code, "description": "refused"
        }))
        .expect("a JetStream error");
        PublishError::with_source(PublishErrorKind::Other, e)
    }

    #[test]
    fn only_refusals_a_retry_cannot_change_park_at_once() {
        assert!(refused_for_good(&refusal(10097)));
        assert!(refused_for_good(&refusal(10054)));
        assert!(refused_for_good(&PublishError::new(
            PublishErrorKind::MaxPayloadExceeded
        )));
        assert!(!refused_for_good(&refusal(10071)));
        assert!(!refused_for_good(&PublishError::new(
            PublishErrorKind::TimedOut
        )));
        assert!(!refused_for_good(&PublishError::new(
            PublishErrorKind::StreamNotFound
        )));
    }
}
