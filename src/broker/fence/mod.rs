//! Broker-side fencing of a partition's publishes (DESIGN §8.4), used by the fenced relay
//! ([`crate::relay::fenced`]) and the routers (`worker/ownership/router/`). It closes the gap a
//! lease (`worker/ownership/lease.rs`) leaves open: a holder paused past its deadline that wakes up and
//! publishes after another holder took over.
//!
//! **The fence** of partition `p` in stream `S` is the subject `runner.fence.<S>.<p>`
//! ([`fence_subject`]); a router's fence uses its source's name as the key. It is captured by
//! the same stream the fenced messages go to ([`crate::broker::fence_subjects`]), because the
//! server checks a publish only against the stream that stores it.
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
//!    `Nats-Expected-Last-Subject-Sequence-Subject: runner.fence.<S>.<p>`; the server stores it
//!    only while `F` is still the last sequence of the fence subject.
//! 3. *Batch* (the relay and the routers, on a replicated stream): a fenced publisher's
//!    messages go out as atomic batches ([`crate::broker::batch`]) whose first message
//!    carries the fence headers and whose last is a new marker ([`Fence::marker`]) with the
//!    publisher's watermark ([`Position`]): the messages and the watermark that covers them
//!    are stored together or not at all, and the marker's sequence becomes the fence's `F`
//!    ([`Fence::advance`]). On a stream of one replica they go out as rounds instead
//!    ([`crate::broker::fenced_round`]): every message fenced, all in flight, then the
//!    marker once all are stored ([`Fence::publish_marker`]).
//!    A new owner reads the watermark when it raises ([`Observed::through`]; the raise's own
//!    marker carries it forward), so it knows exactly what its predecessors stored — however
//!    long ago, without leaning on the de-duplication window. A publisher that stores in
//!    several ordered lanes (a router taking tenants in turns) also records, per lane, the
//!    last position stored beyond the watermark ([`Fence::stage_lanes`],
//!    [`Observed::lanes`]), carried forward the same way.
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
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::broker::batch::BatchMessage;

mod error;

pub use error::FenceError;

/// The header naming the subject whose last sequence `Nats-Expected-Last-Subject-Sequence`
/// refers to (async-nats has no constant for it).
pub const EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT: &str =
    "Nats-Expected-Last-Subject-Sequence-Subject";

/// The fence subject of `key` (a partition number, or a router's source) in `stream`:
/// `runner.fence.<stream>.<key>`, which [`crate::broker::fence_subjects`] makes the stream
/// capture.
pub fn fence_subject(stream: &str, key: impl std::fmt::Display) -> String {
    format!("runner.fence.{stream}.{key}")
}

/// How far a fenced publisher got: everything it publishes is ordered by (`seq`, `ord`) —
/// for the relay the SAGA_INBOX sequence of the input that caused a record and the record's
/// rank among that input's records, for a router the source stream sequence (`ord` 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct Position {
    /// Sequence of the cause.
    pub seq: u64,
    /// Rank among the messages of one cause.
    #[serde(default)]
    pub ord: u32,
}

/// The marker stored on a fence subject: by a raise, and at the end of every fenced batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Marker {
    /// The raiser's lease epoch.
    epoch: u64,
    /// Who raised it (for people and logs; safety does not depend on it).
    owner: String,
    /// Everything at or before this position is stored in the stream (absent: nothing
    /// known). Written in the same atomic batch as the messages it covers, so it is exact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    through: Option<Position>,
    /// A publisher that stores its messages in several ordered lanes (a router's tenants)
    /// may get further in one lane than in another: per lane, the last sequence stored
    /// beyond `through`, in order within the lane. Empty for a publisher of one lane.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    lanes: BTreeMap<String, u64>,
}

/// A raised fence: this owner's marker on one partition's fence subject.
#[derive(Debug, Clone)]
pub struct Fence {
    stream: String,
    subject: String,
    epoch: u64,
    seq: u64,
    owner: String,
    through: Option<Position>,
    /// The last marker's lanes (see [`Fence::stage_lanes`]).
    lanes: BTreeMap<String, u64>,
    /// The lanes the next marker records, until it is stored.
    staged: Option<BTreeMap<String, u64>>,
    /// Stored under this fence beyond `through`, not yet covered by a marker (rounds).
    unmarked: Option<Position>,
    /// When this owner last stored a marker.
    marked_at: Option<std::time::Instant>,
}

/// A fence subject as read by [`Fence::observe`]: its last sequence `S` and the epoch of its
/// last marker. Raising from it succeeds only while `S` is still the last sequence.
#[derive(Debug, Clone)]
pub struct Observed {
    stream: String,
    subject: String,
    seq: u64,
    epoch: Option<u64>,
    through: Option<Position>,
    lanes: BTreeMap<String, u64>,
}

impl Observed {
    /// `S`: the fence subject's last sequence when read (0 when it had no marker).
    pub fn sequence(&self) -> u64 {
        self.seq
    }

    /// The fence subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The epoch of the last marker, `None` when there was none.
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }

    /// The watermark of the last marker: what every earlier owner has stored.
    pub fn through(&self) -> Option<Position> {
        self.through
    }

    /// The last marker's lanes: per lane, how far beyond [`Observed::through`] it is stored.
    pub fn lanes(&self) -> &BTreeMap<String, u64> {
        &self.lanes
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
            through,
            lanes,
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
                through,
                lanes: lanes.clone(),
            })
            .unwrap_or_default(),
        );
        match send(js, subject.clone(), headers, marker).await {
            Ok(seq) => Ok(Fence {
                stream,
                subject,
                epoch,
                seq,
                owner: owner.to_string(),
                through,
                lanes,
                staged: None,
                unmarked: None,
                marked_at: Some(std::time::Instant::now()),
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

impl Observed {
    /// An operator's repair of a fence whose last marker cannot be right (a watermark past
    /// what the stream holds, say): stores a marker with epoch 0 and watermark `through`
    /// (none: nothing is known stored) and no lanes (nothing beyond `through` is taken as
    /// stored),
    /// only while the marker read is still the last (a compare-and-set on its sequence).
    /// Its holder's next fenced publish is then refused, and the raise that follows
    /// succeeds whatever epoch the replaced marker claimed and resumes after `through`.
    /// (The one place a marker's epoch goes down: on an operator's explicit order.)
    pub async fn reset(
        self,
        js: &jetstream::Context,
        through: Option<Position>,
        owner: &str,
    ) -> Result<u64, FenceError> {
        let mut headers = HeaderMap::new();
        headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, self.seq.to_string());
        let marker = Bytes::from(
            serde_json::to_vec(&Marker {
                epoch: 0,
                owner: owner.to_string(),
                through,
                lanes: BTreeMap::new(),
            })
            .unwrap_or_default(),
        );
        match send(js, self.subject.clone(), headers, marker).await {
            Ok(seq) => Ok(seq),
            Err(Sent::WrongLastSequence) => Err(FenceError::Superseded {
                subject: self.subject,
                epoch: 0,
            }),
            Err(Sent::Other(reason)) => Err(FenceError::Nats {
                subject: self.subject,
                op: "publish reset marker",
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
        key: impl std::fmt::Display,
        epoch: u64,
        owner: &str,
    ) -> Result<Fence, FenceError> {
        Fence::observe(js, stream, key)
            .await?
            .raise(js, epoch, owner)
            .await
    }

    /// Reads the fence of `key` in `stream` as it stands: the first half of a raise.
    pub async fn observe(
        js: &jetstream::Context,
        stream: &str,
        key: impl std::fmt::Display,
    ) -> Result<Observed, FenceError> {
        let subject = fence_subject(stream, key);
        let (seq, held) = match last(js, stream, &subject).await? {
            None => (0, None),
            Some((seq, payload)) => (seq, Some(decode(&subject, &payload)?)),
        };
        let (epoch, through, lanes) = match held {
            Some(m) => (Some(m.epoch), m.through, m.lanes),
            None => (None, None, BTreeMap::new()),
        };
        Ok(Observed {
            stream: stream.to_string(),
            subject,
            seq,
            epoch,
            through,
            lanes,
        })
    }

    /// Whether this fence still holds: the fence subject's last message is this fence's
    /// marker. After an unknown or refused batch, [`Fence::recheck`] tells whether the batch
    /// landed (the marker moved to one of ours) or not.
    pub async fn recheck(&self, js: &jetstream::Context) -> Result<Recheck, FenceError> {
        match last(js, &self.stream, &self.subject).await? {
            Some((seq, _)) if seq == self.seq => Ok(Recheck::Unchanged),
            Some((seq, payload)) => {
                let m = decode(&self.subject, &payload)?;
                if m.epoch == self.epoch && m.owner == self.owner {
                    Ok(Recheck::Advanced {
                        seq,
                        through: m.through,
                    })
                } else {
                    Ok(Recheck::Superseded)
                }
            }
            None => Ok(Recheck::Superseded),
        }
    }

    /// The watermark this fence knows: the last marker's when raised, then the last one this
    /// owner stored.
    pub fn through(&self) -> Option<Position> {
        self.through
    }

    /// The lanes of the last marker known stored (what this owner raised over, then its
    /// own): per lane, the last sequence stored beyond [`Fence::through`].
    pub fn lanes(&self) -> &BTreeMap<String, u64> {
        &self.lanes
    }

    /// Sets the lanes the next marker records ([`Fence::marker`]); they become
    /// [`Fence::lanes`] once a marker is stored ([`Fence::advance`]). Stage them before
    /// every fenced publish of a publisher with lanes: a publish that was not stored leaves
    /// them staged, and the next publish stages its own.
    pub fn stage_lanes(&mut self, lanes: BTreeMap<String, u64>) {
        self.staged = Some(lanes);
    }

    /// The marker message that ends this fence's part of a batch and records `through`
    /// (with the staged lanes, else the last marker's).
    pub fn marker(&self, through: Position) -> BatchMessage {
        let lanes = self.staged.as_ref().unwrap_or(&self.lanes).clone();
        BatchMessage {
            subject: self.subject.clone(),
            headers: HeaderMap::new(),
            payload: Bytes::from(
                // A struct of strings and integers always serialises.
                serde_json::to_vec(&Marker {
                    epoch: self.epoch,
                    owner: self.owner.clone(),
                    through: Some(through),
                    lanes,
                })
                .unwrap_or_default(),
            ),
        }
    }

    /// Publishes this owner's marker at `through` on its own (expecting the fence's `F`)
    /// and advances the fence to it: the end of a fenced round
    /// ([`crate::broker::fenced_round`]). An error says why, and whether it was stored is
    /// for [`Fence::recheck`] to tell.
    pub async fn publish_marker(
        &mut self,
        js: &jetstream::Context,
        through: Position,
    ) -> Result<(), String> {
        let marker = self.marker(through);
        let mut headers = HeaderMap::new();
        headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, self.seq.to_string());
        match send(js, marker.subject, headers, marker.payload).await {
            Ok(seq) => {
                self.advance(seq, Some(through));
                Ok(())
            }
            Err(Sent::WrongLastSequence) => Err("marker refused: the fence moved".into()),
            Err(Sent::Other(reason)) => Err(format!("marker: {reason}")),
        }
    }

    /// Moves the fence to a marker of ours stored at `seq`, covering `through`.
    pub fn advance(&mut self, seq: u64, through: Option<Position>) {
        self.seq = seq;
        self.marked_at = Some(std::time::Instant::now());
        if through.is_some() {
            self.through = through;
        }
        if let Some(lanes) = self.staged.take() {
            self.lanes = lanes;
        }
        if self.unmarked.is_some() && self.unmarked <= self.through {
            self.unmarked = None;
        }
    }

    /// Records that everything up to `position` is stored under this fence, with no marker
    /// covering it yet ([`Fence::unmarked`]).
    pub fn stored_unmarked(&mut self, position: Position) {
        // Staged lanes need a marker even where the watermark stays.
        if self.staged.is_some() || self.through.is_none_or(|t| position > t) {
            self.unmarked = self.unmarked.max(Some(position));
        }
    }

    /// The position stored under this fence that no marker covers yet, if any: what the
    /// next marker should record.
    pub fn unmarked(&self) -> Option<Position> {
        self.unmarked
    }

    /// Whether `every` has passed since this owner last stored a marker.
    pub fn mark_due(&self, every: std::time::Duration) -> bool {
        self.marked_at.is_none_or(|at| at.elapsed() >= every)
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

/// How a fenced publish (an atomic batch, [`crate::broker::fenced_batch`], or a round,
/// [`crate::broker::fenced_round`]) ended.
#[derive(Debug)]
pub enum Outcome {
    /// Stored (now or by an earlier try whose answer was lost); the fence moved to its marker.
    Stored,
    /// Another owner's marker is on the fence: this publisher must stop.
    Fenced,
    /// Not stored, or unknown; try again later from the fence's watermark.
    Retry(String),
}

/// What [`Fence::recheck`] found on the fence subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recheck {
    /// Still this fence's marker: a batch that carried it was not stored.
    Unchanged,
    /// A later marker of this same owner and epoch: a batch of ours was stored.
    Advanced {
        /// Its sequence (the fence's new `F`).
        seq: u64,
        /// Its watermark.
        through: Option<Position>,
    },
    /// Someone else's marker, or none: the fence is lost.
    Superseded,
}

fn decode(subject: &str, payload: &[u8]) -> Result<Marker, FenceError> {
    serde_json::from_slice(payload).map_err(|e| FenceError::Corrupt {
        subject: subject.to_string(),
        reason: e.to_string(),
    })
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
mod tests;
