//! A fenced round: a publisher's messages sent one by one, all in flight at once, each
//! carrying its fence headers, then — once every one is stored — its marker with the new
//! watermark (DESIGN §8.4, §8.10). A publisher may mark less often than every round (the
//! relay marks at most every [`RELAY_MARK_EVERY`], and when it goes idle or stops): a
//! marker moves the fence, so the next round waits for it, and most rounds then need none. The transport of the fenced relay and the routers on a
//! stream with one replica, where the broker checks a fenced publish as it stores it, so
//! any number may be in flight; a replicated stream refuses a second fenced publish while
//! one is being replicated, and gets atomic batches instead ([`super::fenced_batch`]).
//!
//! A round costs two round trips and no staging: an atomic batch of one message costs the
//! server about twenty plain publishes (`scripts/bench batches`).
//!
//! **Guarantees.**
//! - **Nothing from a former owner.** Every message and the marker carry the fence: once a
//!   newer owner raised, the broker stores nothing more of this round or any later one.
//! - **The watermark is exact as a lower bound.** A marker is published only after every
//!   message it covers is acknowledged, and the next round starts only after the marker
//!   is, so everything at or below the watermark is stored, and whatever a crash leaves
//!   stored above it was stored after the last marker: at most the rounds of one marking
//!   interval. A new owner re-sends those under their deterministic `Nats-Msg-Id`, which
//!   the stream drops as duplicates within its window. (An owner taking over later than
//!   the window after the crash would store those rounds again: a takeover normally comes
//!   within the lease TTL, and the window is minutes.)
//! - **The outcome is decided by the fence, never guessed**, as for a batch: after any
//!   failure the fence subject is read again ([`Fence::recheck`]).

use std::time::Duration;

/// The longest the fenced relay leaves rounds unmarked while it has records to send.
pub const RELAY_MARK_EVERY: Duration = Duration::from_millis(100);

use async_nats::jetstream::Context;
use async_nats::jetstream::context::PublishErrorKind;

use super::batch::BatchMessage;
use super::fence::{Fence, Outcome, Position, Recheck};

/// Publishes `messages` under `fence`, then — when `mark_every` has passed since the
/// fence's last marker (always, for zero) — its marker at `position`, advancing the fence;
/// a round left unmarked is covered by a later round's marker or by [`mark`].
pub async fn publish(
    js: &Context,
    fence: &mut Fence,
    messages: &[BatchMessage],
    position: Position,
    timeout: Duration,
    mark_every: Duration,
) -> Outcome {
    let mut acks = Vec::with_capacity(messages.len());
    let mut failure: Option<String> = None;
    for m in messages {
        let headers = fence.headers(m.headers.clone());
        match js
            .publish_with_headers(m.subject.clone(), headers, m.payload.clone())
            .await
        {
            Ok(ack) => acks.push(ack),
            Err(e) => {
                failure = Some(format!("publish: {e}"));
                break;
            }
        }
    }
    let mut refused = false;
    for ack in acks {
        match tokio::time::timeout(timeout, ack).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == PublishErrorKind::WrongLastSequence => refused = true,
            Ok(Err(e)) => {
                failure.get_or_insert_with(|| e.to_string());
            }
            Err(_) => {
                failure.get_or_insert_with(|| format!("no answer within {timeout:?}"));
            }
        }
    }
    if refused || failure.is_some() {
        let why = failure.unwrap_or_else(|| "refused under the fence".into());
        return settle(js, fence, position, why).await;
    }
    fence.stored_unmarked(position);
    if !fence.mark_due(mark_every) {
        return Outcome::Stored;
    }
    mark(js, fence).await
}

/// Stores a marker covering what `fence` stored unmarked, if anything (a relay gone idle
/// or stopping leaves no record of its own above the watermark).
pub async fn mark(js: &Context, fence: &mut Fence) -> Outcome {
    let Some(position) = fence.unmarked() else {
        return Outcome::Stored;
    };
    match fence.publish_marker(js, position).await {
        Ok(()) => Outcome::Stored,
        Err(why) => settle(js, fence, position, why).await,
    }
}

/// Decides a round that failed somewhere from the fence as it now stands.
async fn settle(js: &Context, fence: &mut Fence, position: Position, why: String) -> Outcome {
    match fence.recheck(js).await {
        Ok(Recheck::Advanced { seq, through }) => {
            // Our marker landed after all (its answer was lost).
            fence.advance(seq, through);
            if through.is_some_and(|t| t >= position) {
                Outcome::Stored
            } else {
                Outcome::Retry(why)
            }
        }
        Ok(Recheck::Superseded) => Outcome::Fenced,
        Ok(Recheck::Unchanged) => Outcome::Retry(why),
        Err(e) => Outcome::Retry(format!("{why}; fence unreadable: {e}")),
    }
}
