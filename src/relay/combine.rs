//! Shared fenced batches: the partition relays of one process that publish to the same
//! stream at the same time share one atomic batch, so the broker's fixed cost per batch
//! (`scripts/bench batches`: about twelve plain publishes' worth of server CPU, whatever
//! the batch's size) is paid once for all of them instead of once per partition.
//!
//! Group commit, with no task of its own: a relay queues its part in the stream's lane;
//! whoever finds no shared batch of that lane in flight sends every part queued (up to the
//! batch limit) and answers each; the others wait for their answer or for the batch in
//! flight to end, then look again. Nobody waits for company: a part that finds the lane
//! idle goes out at once, alone or with whatever queued meanwhile.
//!
//! **Guarantees.**
//! - Nothing is decided here. A part comes back stored at its marker's sequence, or
//!   `Alone` — refused (one stale fence refuses the whole batch), failed, unanswered, or
//!   dropped because the relay sending it was stopped mid-flight — and a part that is alone
//!   is sent by its relay through the single fenced path ([`fenced_batch::publish`]),
//!   which decides from the fence whether it was stored.
//! - Order per partition is its relay's: a relay has one part queued at a time and waits
//!   for its answer before the next.
//! - One shared batch in flight per stream and process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::Client;
use tokio::sync::oneshot;

use crate::broker::batch::MAX_MESSAGES;
use crate::broker::fenced_batch::{self, Part, PartOutcome};

/// The lanes of one process, by stream; cheap to share.
#[derive(Default)]
pub struct Combiner {
    lanes: Mutex<HashMap<String, Arc<Lane>>>,
}

impl std::fmt::Debug for Combiner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Combiner").finish_non_exhaustive()
    }
}

/// The parts waiting for one stream, and its one batch in flight.
#[derive(Default)]
struct Lane {
    queue: Mutex<Vec<Waiting>>,
    sending: tokio::sync::Mutex<()>,
}

/// A queued part and where its answer goes.
struct Waiting {
    part: Part,
    reply: oneshot::Sender<PartOutcome>,
}

impl Combiner {
    /// Publishes `part` into `stream` in a batch shared with the other parts queued for it;
    /// see the module doc for what the answer means.
    pub async fn publish(
        &self,
        client: &Client,
        stream: &str,
        part: Part,
        timeout: Duration,
    ) -> PartOutcome {
        let lane = self.lane(stream);
        let (tx, mut rx) = oneshot::channel();
        lock(&lane.queue).push(Waiting { part, reply: tx });
        loop {
            let sending = tokio::select! {
                biased;
                answer = &mut rx => return answer.unwrap_or(PartOutcome::Alone),
                sending = lane.sending.lock() => sending,
            };
            // Answered by the batch that just ended?
            if let Ok(answer) = rx.try_recv() {
                return answer;
            }
            let (parts, replies): (Vec<Part>, Vec<_>) =
                lane.take().into_iter().map(|w| (w.part, w.reply)).unzip();
            if !parts.is_empty() {
                let outcomes = fenced_batch::publish_together(client, parts, timeout).await;
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    // A relay stopped meanwhile no longer listens.
                    let _ = reply.send(outcome);
                }
            }
            drop(sending);
        }
    }

    fn lane(&self, stream: &str) -> Arc<Lane> {
        lock(&self.lanes)
            .entry(stream.to_string())
            .or_default()
            .clone()
    }
}

impl Lane {
    /// The queued parts, oldest first, as many as fit one batch (always at least one: a
    /// relay's part holds at most `MAX_MESSAGES - 1` messages plus its marker).
    fn take(&self) -> Vec<Waiting> {
        let mut queue = lock(&self.queue);
        let mut count = 0;
        let mut n = 0;
        for w in queue.iter() {
            let size = w.part.messages.len() + 1;
            if n > 0 && count + size > MAX_MESSAGES {
                break;
            }
            count += size;
            n += 1;
        }
        queue.drain(..n).collect()
    }
}

/// Locks `m`, going on with the data of a holder that panicked (the queue stays usable).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
