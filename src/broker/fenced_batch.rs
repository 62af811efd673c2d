//! A fenced atomic batch: messages plus the publisher's new fence marker, stored together
//! under the publisher's fence, or not at all (DESIGN §8.4). The routers and the fenced relay
//! both publish through [`publish`]; the fenced relays of one process first try to share a
//! batch ([`publish_together`], driven by `relay/combine.rs`) and fall back to [`publish`].
//!
//! **Guarantee.** The outcome is decided by the fence, never guessed from an error: after
//! any failure the fence subject is read again ([`Fence::recheck`]). A marker of ours that
//! covers the batch means it was stored ([`Outcome::Stored`]); someone else's marker means the
//! fence is lost and nothing of ours will be stored again ([`Outcome::Fenced`]); our old
//! marker means nothing was stored, and the batch is sent again (at most three tries here;
//! then [`Outcome::Retry`]). A batch refused because an id is already in the stream's
//! de-duplication window (10201, left by an earlier writer) is sent again without ids: the
//! fence and the watermark, not the ids, keep it single.

use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::Context;

use super::batch::{self, BatchError, BatchMessage};
use super::fence::{Fence, Position, Recheck};
use super::headers::without_msg_id;

pub use super::fence::Outcome;

/// How a fenced publisher's messages travel to a stream: one way per kind of stream, chosen
/// by its replica count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// One replica: every message fenced and in flight at once, then the marker
    /// ([`super::fenced_round`]).
    Round,
    /// Replicated: atomic batches ([`publish`]), since the server lets one fenced proposal
    /// per fence subject be in flight.
    Batch,
}

impl Transport {
    /// The transport for a stream of `replicas` replicas.
    pub fn for_replicas(replicas: usize) -> Self {
        if replicas <= 1 {
            Transport::Round
        } else {
            Transport::Batch
        }
    }

    /// Publishes `messages` and a marker at `position` under `fence` this way (a round is
    /// marked at once); advances the fence when they are stored.
    pub async fn publish(
        self,
        js: &Context,
        client: &Client,
        fence: &mut Fence,
        messages: &[BatchMessage],
        position: Position,
        timeout: Duration,
    ) -> Outcome {
        match self {
            Transport::Round => {
                super::fenced_round::publish(js, fence, messages, position, timeout, Duration::ZERO)
                    .await
            }
            Transport::Batch => publish(js, client, fence, messages, position, timeout).await,
        }
    }
}

/// Publishes `messages` followed by a marker at `position` as one atomic batch under
/// `fence`, and advances the fence when it is stored.
pub async fn publish(
    js: &Context,
    client: &Client,
    fence: &mut Fence,
    messages: &[BatchMessage],
    position: Position,
    timeout: Duration,
) -> Outcome {
    let mut with_ids = true;
    let mut last_error = String::new();
    for _ in 0..3 {
        let mut batch_msgs: Vec<BatchMessage> = messages.to_vec();
        if !with_ids {
            for m in &mut batch_msgs {
                m.headers = without_msg_id(&m.headers);
            }
        }
        batch_msgs.push(fence.marker(position));
        if let Some(first) = batch_msgs.first_mut() {
            first.headers = fence.headers(first.headers.clone());
        }
        let marker = batch_msgs.len() - 1;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let e = match batch::publish(client, &id, batch_msgs, timeout).await {
            Ok(stored) => {
                fence.advance(stored.sequence_of(marker), Some(position));
                return Outcome::Stored;
            }
            Err(e) => e,
        };
        last_error = e.to_string();
        match fence.recheck(js).await {
            Ok(Recheck::Advanced { seq, through }) => {
                fence.advance(seq, through);
                return if through.is_some_and(|t| t >= position) {
                    Outcome::Stored
                } else {
                    Outcome::Retry(last_error)
                };
            }
            Ok(Recheck::Superseded) => return Outcome::Fenced,
            Ok(Recheck::Unchanged) => {
                tracing::warn!(message = "Fenced batch not stored; sending it again.", fence = fence.subject(), error = %e);
                match e {
                    BatchError::Refused { .. } => return Outcome::Retry(last_error),
                    BatchError::DuplicateId(_) => with_ids = false,
                    _ => {}
                }
            }
            Err(re) => {
                tracing::warn!(message = "Fenced batch outcome unknown.", fence = fence.subject(), error = %e, recheck = %re);
                return Outcome::Retry(last_error);
            }
        }
    }
    Outcome::Retry(last_error)
}

/// One publisher's part of a shared batch ([`publish_together`]).
#[derive(Debug, Clone)]
pub struct Part {
    /// The publisher's fence, as it stands (a copy: the publisher keeps its own).
    pub fence: Fence,
    /// Its messages (at least one).
    pub messages: Vec<BatchMessage>,
    /// The watermark its marker records.
    pub position: Position,
    /// Whether its first message carries the fence's expected-sequence headers (always, for
    /// a relay; the bench's shadow leaves them out to measure what the check costs).
    pub expect: bool,
}

/// How a part of a shared batch ended.
#[derive(Debug)]
pub enum PartOutcome {
    /// Stored in the shared batch: the publisher moves its fence to its marker, stored at
    /// this stream sequence, covering the part's position.
    Stored(u64),
    /// Not stored together: the publisher sends its part alone through [`publish`], which
    /// finds out from its fence whether the shared batch landed after all.
    Alone,
}

/// Publishes several publishers' parts — each its messages, the first carrying its fence
/// headers, then its marker — as one atomic batch, so the broker's fixed cost per batch is
/// paid once for all of them. All or nothing, like any batch: when one part's fence is
/// stale the whole batch is refused, and every part is answered [`PartOutcome::Alone`];
/// so is any failure or lost answer. Nothing is decided here that [`publish`] would decide
/// otherwise: a part answered `Alone` is sent alone, whose recheck of the fence tells
/// whether the shared batch was stored (our marker covering the part) or not.
///
/// The parts must go to one stream, name distinct fences, and hold together at most
/// [`batch::MAX_MESSAGES`] messages, markers included.
pub async fn publish_together(
    client: &Client,
    parts: Vec<Part>,
    timeout: Duration,
) -> Vec<PartOutcome> {
    let count = parts.len();
    let mut messages = Vec::new();
    let mut markers = Vec::with_capacity(count);
    for part in parts {
        let start = messages.len();
        messages.extend(part.messages);
        if part.expect
            && let Some(first) = messages.get_mut(start)
        {
            first.headers = part.fence.headers(std::mem::take(&mut first.headers));
        }
        messages.push(part.fence.marker(part.position));
        markers.push(messages.len() - 1);
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    match batch::publish(client, &id, messages, timeout).await {
        Ok(stored) => markers
            .into_iter()
            .map(|i| PartOutcome::Stored(stored.sequence_of(i)))
            .collect(),
        Err(e) => {
            tracing::debug!(message = "Shared fenced batch not stored; its parts go alone.", parts = count, error = %e);
            (0..count).map(|_| PartOutcome::Alone).collect()
        }
    }
}
