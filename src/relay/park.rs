//! Records the broker can never take, parked so the relay goes on.
//!
//! A record that, with its headers, is larger than the server's `max_payload` or than its
//! stream's largest message (`max_msg_size`), or whose header block JetStream cannot store,
//! would be refused on every attempt, and since the relay publishes in outbox order it would
//! hold every later record behind it, across restarts. Outputs are checked against the
//! server's limit when committed, so such a record only exists if it was written before the
//! check, the limit shrank since, or its stream takes less. The relay screens each record
//! before sending it ([`unpublishable`], against the smaller of the two limits, the streams'
//! read again after every failed window) and parks the ones that can never go out
//! ([`park`]).
//!
//! Guarantee: parking is one write transaction that records a dead letter of kind
//! [`kind::UNPUBLISHABLE`] and writes its message (bounded, see
//! [`deadletter::EXCERPT_BYTES`]) in the record's place: same outbox sequence, same cause,
//! so it goes out exactly where the record would have, and the fence watermark treats it as
//! it would have treated the record. Nothing is dropped silently: the dead letter keeps the record's subject, message
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

/// Parks every record of `records` that can never be published under the largest message
/// its destination takes (`max` of a record: 0 checks only the header limit); returns how
/// many. On a storage failure it stops and returns the error (the caller retries later).
pub(crate) async fn screen(
    store: &Store,
    metrics: &Metrics,
    partition: u16,
    records: &[(u64, OutboxRecord)],
    max: impl Fn(&OutboxRecord) -> usize,
) -> Result<usize, StorageError> {
    let mut parked = 0;
    for (seq, rec) in records {
        if let Some(why) = unpublishable(rec, max(rec)) {
            park(store, metrics, partition, *seq, rec, why).await?;
            parked += 1;
        }
    }
    Ok(parked)
}
