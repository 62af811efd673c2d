//! Broker-side fencing of a partition's publishes (DESIGN §8.4). Not wired into the relay
//! yet (scale-out groundwork); it closes the gap [`super::lease`] leaves open: a holder
//! paused past its deadline that wakes up and publishes after another holder took over.
//!
//! **The fence** of partition `p` is the subject `runner.fence.<p>` ([`fence_subject`]). It
//! must be captured by the same stream the fenced messages go to, because the server checks
//! a publish only against the stream that stores it. (The WORKFLOW_COMMANDS stream does not
//! capture it today; wiring this in means adding the subject there or to an outbox stream.)
//! The stream must also keep the last message of every fence subject: a limit that removes
//! it refuses every fenced publish until the owner raises again.
//!
//! **Protocol.**
//! 1. *Raise* ([`Fence::raise`], or [`Fence::observe`] then [`Observed::raise`]), once per
//!    acquired lease: read the fence subject's last message from the stream leader
//!    (sequence `S`, 0 when there is none). If it carries a greater epoch than ours, a newer owner has raised: [`FenceError::Superseded`].
//!    Otherwise publish a marker `{epoch, owner}` on the fence subject with
//!    `Nats-Expected-Last-Subject-Sequence: S` and keep the stored sequence `F`. A raiser
//!    whose `S` is no longer the last (someone raised in between) is refused by the server
//!    and also gets [`FenceError::Superseded`]. So a marker is stored only on top of a
//!    marker with an epoch no greater than its own: marker epochs never go down.
//! 2. *Publish* ([`Fence::publish`], or [`Fence::headers`] for a caller's own publish or the
//!    first message of an atomic batch): every fenced message carries
//!    `Nats-Expected-Last-Subject-Sequence: F` and
//!    `Nats-Expected-Last-Subject-Sequence-Subject: runner.fence.<p>`; the server stores it
//!    only while `F` is still the last sequence of the fence subject.
//!
//! **Guarantee.** Once a newer owner's marker is stored, the broker refuses every publish
//! carrying the older fence (error 10071, "wrong last sequence"), however long its sender
//! was paused and whatever its clock says. Nothing in the client decides it; the stream
//! leader checks each publish against the fence subject's last sequence as it stores it.
//!
//! **One fenced publish in flight per fence subject** (replicated streams). While a
//! proposal that expects a subject's sequence is being replicated, the server refuses
//! another one expecting the same subject, also with 10071. Callers must therefore keep at
//! most one fenced publish (or atomic batch) in flight per partition and await each ack
//! before the next. This type does not enforce it: give each partition one publisher.
//!
//! **What each failure costs.**
//! - [`FenceError::Superseded`] on raise: a newer owner exists; drop the partition.
//! - [`FenceError::Fenced`] on publish: the fence moved, nothing was stored; drop the
//!   partition at once. Records left in the outbox are the new owner's to publish.
//! - [`FenceError::MaybeWritten`]: 10071 while the fence is still ours. Another fenced
//!   publish of the same fence subject was in flight (replicated streams), or a retry
//!   carrying `Nats-Msg-Id` found its first attempt stored and the server answered 10071
//!   rather than "duplicate" (DESIGN §11; seen when the checked subject is the published
//!   one — with the fence subject checked, nats-server 2.15.1 answered a retry as a
//!   duplicate). The caller checks whether its message is in the stream (by its msg-id)
//!   and retries if not; the fence is still valid.
//! - [`FenceError::Nats`]: no answer or another failure; whether the message (or marker)
//!   was stored is unknown. Retrying the same message under its `Nats-Msg-Id` is safe; a
//!   raise is retried by raising again (a lost marker just becomes an older one).

use async_nats::HeaderMap;
use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::{self, context::PublishErrorKind, stream::LastRawMessageErrorKind};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The header naming the subject whose last sequence `Nats-Expected-Last-Subject-Sequence`
/// refers to (async-nats has no constant for it).
pub const EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT: &str =
    "Nats-Expected-Last-Subject-Sequence-Subject";

/// The fence subject of `partition`: `runner.fence.<partition>`.
pub fn fence_subject(partition: u32) -> String {
    format!("runner.fence.{partition}")
}

/// The marker a raise stores on the fence subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Marker {
    /// The raiser's lease epoch.
    epoch: u64,
    /// Who raised it (for people and logs; safety does not depend on it).
    owner: String,
}

/// Fencing errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// A raise lost: another marker was stored after the one this raiser read, or the last
    /// marker carries a greater epoch. A newer owner exists.
    #[error("fence {subject}: epoch {epoch} is superseded")]
    Superseded {
        /// The fence subject.
        subject: String,
        /// The epoch that tried to raise.
        epoch: u64,
    },
    /// The broker refused a fenced publish: the fence subject moved past this fence's
    /// sequence. Nothing was stored; the partition belongs to someone else.
    #[error("fence {subject} (sequence {fence_seq}) is fenced off: last sequence is now {now_seq}")]
    Fenced {
        /// The fence subject.
        subject: String,
        /// This fence's marker sequence.
        fence_seq: u64,
        /// The fence subject's last sequence as read after the refusal.
        now_seq: u64,
    },
    /// The broker answered "wrong last sequence" but the fence is still this one: the
    /// message may already be stored (a retried msg-id) or another fenced publish was in
    /// flight. The caller checks for its message and retries if it is missing.
    #[error(
        "publish to {subject} under fence {fence_seq} was refused while the fence still holds: maybe written"
    )]
    MaybeWritten {
        /// The subject published to.
        subject: String,
        /// This fence's marker sequence.
        fence_seq: u64,
    },
    /// The server did not answer or failed for another reason; the outcome is unknown.
    #[error("fence {subject}: {op} failed: {reason}")]
    Nats {
        /// The fence subject.
        subject: String,
        /// What was tried.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// The last message on a fence subject is not a marker.
    #[error("fence {subject} holds an unreadable marker: {reason}")]
    Corrupt {
        /// The fence subject.
        subject: String,
        /// Why.
        reason: String,
    },
}

/// A raised fence: this owner's marker on one partition's fence subject.
#[derive(Debug, Clone)]
pub struct Fence {
    stream: String,
    subject: String,
    epoch: u64,
    seq: u64,
}

/// A fence subject as read by [`Fence::observe`]: its last sequence `S` and the epoch of its
/// last marker. Raising from it succeeds only while `S` is still the last sequence.
#[derive(Debug, Clone)]
pub struct Observed {
    stream: String,
    subject: String,
    seq: u64,
    epoch: Option<u64>,
}

impl Observed {
    /// `S`: the fence subject's last sequence when read (0 when it had no marker).
    pub fn sequence(&self) -> u64 {
        self.seq
    }

    /// The epoch of the last marker, `None` when there was none.
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }

    /// Publishes this owner's marker expecting `S`. [`FenceError::Superseded`] when the last
    /// marker had a greater epoch, or when another marker was stored since the read.
    pub async fn raise(
        self,
        js: &jetstream::Context,
        epoch: u64,
        owner: &str,
    ) -> Result<Fence, FenceError> {
        let Observed {
            stream,
            subject,
            seq: expected,
            epoch: held,
        } = self;
        if held.is_some_and(|held| held > epoch) {
            return Err(FenceError::Superseded { subject, epoch });
        }
        let mut headers = HeaderMap::new();
        headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, expected.to_string());
        let marker = Bytes::from(
            // A struct of a string and an integer always serialises.
            serde_json::to_vec(&Marker {
                epoch,
                owner: owner.to_string(),
            })
            .unwrap_or_default(),
        );
        match send(js, subject.clone(), headers, marker).await {
            Ok(seq) => Ok(Fence {
                stream,
                subject,
                epoch,
                seq,
            }),
            Err(Sent::WrongLastSequence) => Err(FenceError::Superseded { subject, epoch }),
            Err(Sent::Other(reason)) => Err(FenceError::Nats {
                subject,
                op: "publish marker",
                reason,
            }),
        }
    }
}

impl Fence {
    /// Raises the fence of `partition` for `owner` holding lease `epoch`, in `stream` (the
    /// stream that captures the fence subject and the fenced messages): [`Fence::observe`]
    /// then [`Observed::raise`].
    pub async fn raise(
        js: &jetstream::Context,
        stream: &str,
        partition: u32,
        epoch: u64,
        owner: &str,
    ) -> Result<Fence, FenceError> {
        Fence::observe(js, stream, partition)
            .await?
            .raise(js, epoch, owner)
            .await
    }

    /// Reads the fence of `partition` in `stream` as it stands: the first half of a raise.
    pub async fn observe(
        js: &jetstream::Context,
        stream: &str,
        partition: u32,
    ) -> Result<Observed, FenceError> {
        let subject = fence_subject(partition);
        let (seq, epoch) = match last(js, stream, &subject).await? {
            None => (0, None),
            Some((seq, payload)) => {
                let held: Marker =
                    serde_json::from_slice(&payload).map_err(|e| FenceError::Corrupt {
                        subject: subject.clone(),
                        reason: e.to_string(),
                    })?;
                (seq, Some(held.epoch))
            }
        };
        Ok(Observed {
            stream: stream.to_string(),
            subject,
            seq,
            epoch,
        })
    }

    /// `base` with the two fence headers added (replacing any earlier values):
    /// `Nats-Expected-Last-Subject-Sequence: F` and
    /// `Nats-Expected-Last-Subject-Sequence-Subject: runner.fence.<p>`.
    pub fn headers(&self, mut base: HeaderMap) -> HeaderMap {
        base.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, self.seq.to_string());
        base.insert(
            EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT,
            self.subject.as_str(),
        );
        base
    }

    /// Publishes one fenced message (`headers` plus the fence headers) and waits for its
    /// ack; returns its stream sequence. Keep one of these in flight per fence at a time.
    pub async fn publish(
        &self,
        js: &jetstream::Context,
        subject: &str,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<u64, FenceError> {
        match send(js, subject.to_string(), self.headers(headers), payload).await {
            Ok(seq) => Ok(seq),
            Err(Sent::Other(reason)) => Err(FenceError::Nats {
                subject: subject.to_string(),
                op: "publish",
                reason,
            }),
            Err(Sent::WrongLastSequence) => {
                let now_seq = last(js, &self.stream, &self.subject)
                    .await?
                    .map_or(0, |(seq, _)| seq);
                if now_seq == self.seq {
                    Err(FenceError::MaybeWritten {
                        subject: subject.to_string(),
                        fence_seq: self.seq,
                    })
                } else {
                    Err(FenceError::Fenced {
                        subject: self.subject.clone(),
                        fence_seq: self.seq,
                        now_seq,
                    })
                }
            }
        }
    }

    /// The fence subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The lease epoch this fence was raised with.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// `F`: the stream sequence of this fence's marker.
    pub fn sequence(&self) -> u64 {
        self.seq
    }
}

/// How a publish went, as far as fencing cares.
enum Sent {
    WrongLastSequence,
    Other(String),
}

async fn send(
    js: &jetstream::Context,
    subject: String,
    headers: HeaderMap,
    payload: Bytes,
) -> Result<u64, Sent> {
    let classify = |e: jetstream::context::PublishError| match e.kind() {
        PublishErrorKind::WrongLastSequence => Sent::WrongLastSequence,
        _ => Sent::Other(e.to_string()),
    };
    let ack = js
        .publish_with_headers(subject, headers, payload)
        .await
        .map_err(classify)?
        .await
        .map_err(classify)?;
    Ok(ack.sequence)
}

/// The sequence and payload of the last message on `subject` in `stream`, read from the
/// stream leader (a replica could lag and report an older fence); `None` when there is none.
async fn last(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
) -> Result<Option<(u64, Bytes)>, FenceError> {
    let nats = |op, reason: String| FenceError::Nats {
        subject: subject.to_string(),
        op,
        reason,
    };
    let s = js
        .get_stream_no_info(stream)
        .await
        .map_err(|e| nats("get stream", e.to_string()))?;
    match s.get_last_raw_message_by_subject(subject).await {
        Ok(m) => Ok(Some((m.sequence, m.payload))),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(nats("read last marker", e.to_string())),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn fence_subject_names_the_partition() {
        assert_eq!(fence_subject(0), "runner.fence.0");
        assert_eq!(fence_subject(17), "runner.fence.17");
    }

    #[test]
    fn headers_add_exactly_the_two_fence_headers() {
        let fence = Fence {
            stream: "S".into(),
            subject: fence_subject(3),
            epoch: 9,
            seq: 42,
        };
        let mut base = HeaderMap::new();
        base.insert("Nats-Msg-Id", "m-1");
        base.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "7");
        let h = fence.headers(base);
        assert_eq!(
            h.get_all(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE)
                .map(|v| v.as_str().to_string())
                .collect::<Vec<_>>(),
            vec!["42"]
        );
        assert_eq!(
            h.get(EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT)
                .map(|v| v.as_str()),
            Some("runner.fence.3")
        );
        assert_eq!(h.get("Nats-Msg-Id").map(|v| v.as_str()), Some("m-1"));
        assert_eq!(h.iter().count(), 3);
    }

    #[test]
    fn a_marker_is_its_epoch_and_owner() {
        let json: serde_json::Value = serde_json::to_value(Marker {
            epoch: 5,
            owner: "r1".into(),
        })
        .unwrap();
        assert_eq!(json, serde_json::json!({"epoch": 5, "owner": "r1"}));
    }
}
