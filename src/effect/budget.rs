//! The byte budget of one effect loop (`effect.max_inflight_bytes`): how many command bytes
//! the loop holds at once, from the pull that brings them to the end of their handling.
//!
//! Slots (`effect.concurrency`) bound how many commands run; they say nothing of size, so
//! without this 64 slots of 1 MiB commands would hold 64 MiB, and more slots more. The
//! budget bounds the bytes as well: large commands then run fewer at a time, small ones are
//! not held back.
//!
//! **How.** Before a pull the loop [`Budget::reserve`]s every byte free in the budget —
//! waiting until at least the largest message the server accepts fits. When the messages
//! the pull asks for could together pass the reservation at the largest size, the pull
//! request carries the reservation as its `max_bytes` (the server sends whole messages
//! only, and ends the pull before one that would pass it); otherwise it carries no byte
//! limit, since it cannot pass the budget anyway ([`Reservation::limit_for`]). Each command
//! delivered [`Reservation::take`]s its size out of the reservation and keeps it until its
//! handling ends; what the pull did not use goes back when the reservation is dropped.
//!
//! **Guarantees.**
//! - The bytes a loop holds never pass the budget (sizes are counted in whole KiB, rounded
//!   up, the message's full length as the client read it).
//! - Any command the server accepts fits: the budget is raised to the server's
//!   `max_payload` when that is larger, and a pull waits until that much is free, so a large
//!   command is delayed, never refused or stuck.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The unit of account: a KiB (semaphore permits are counted in `u32` by `acquire_many`).
const UNIT: usize = 1024;
/// The server's default `max_payload`, assumed while the real one is not known (0).
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
/// Room for a message's subject and reply subject beside its headers and body.
const ENVELOPE: usize = 4 * 1024;

/// A loop's byte budget.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    free: Arc<Semaphore>,
    /// Units a pull waits for: the largest message the server accepts.
    least: u32,
    capacity: u32,
}

impl Budget {
    /// A budget of `bytes`, raised to `largest_message` (the server's `max_payload`) when
    /// that is larger.
    pub(crate) fn new(bytes: u64, largest_message: usize) -> Self {
        // The server counts a message's subject and reply subject too: room for them.
        let least = units(largest_message.max(DEFAULT_MAX_PAYLOAD) + ENVELOPE);
        let wanted =
            u32::try_from(usize::try_from(bytes).unwrap_or(usize::MAX) / UNIT).unwrap_or(u32::MAX);
        let capacity = wanted.max(least);
        Self {
            free: Arc::new(Semaphore::new(capacity as usize)),
            least,
            capacity,
        }
    }

    /// The budget in bytes.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.capacity as usize * UNIT
    }

    /// Waits until the largest message fits, then takes every free byte for one pull.
    /// `None` only if the budget was closed (never, in practice).
    pub(crate) async fn reserve(&self) -> Option<Reservation> {
        let mut held = self
            .free
            .clone()
            .acquire_many_owned(self.least)
            .await
            .ok()?;
        let rest = self.free.available_permits();
        if rest > 0
            && let Ok(more) = self
                .free
                .clone()
                .try_acquire_many_owned(u32::try_from(rest).unwrap_or(u32::MAX))
        {
            held.merge(more);
        }
        Some(Reservation {
            held,
            largest: self.least as usize * UNIT,
        })
    }
}

/// The bytes reserved for one pull.
#[derive(Debug)]
pub(crate) struct Reservation {
    held: OwnedSemaphorePermit,
    /// The largest message the server accepts (with its envelope), in bytes.
    largest: usize,
}

impl Reservation {
    /// How many bytes the pull may ask for.
    pub(crate) fn bytes(&self) -> usize {
        self.held.num_permits() * UNIT
    }

    /// The byte limit to put on a pull of `count` messages: none (0) when even `count`
    /// messages of the largest size fit the reservation, so the budget cannot be passed
    /// anyway; else the reservation. (A pull with a byte limit ends with statuses the
    /// client reports as errors, and on the three-node bench such pulls halved the
    /// pipeline's rate: the limit is set only when it can bind.)
    pub(crate) fn limit_for(&self, count: usize) -> usize {
        if count.saturating_mul(self.largest) <= self.bytes() {
            0
        } else {
            self.bytes()
        }
    }

    /// Takes a delivered message of `len` bytes out of the reservation; the returned part
    /// is held until the command's handling ends. The server never sends more than was
    /// asked for, so the reservation covers it; should a count differ, what is left is taken.
    pub(crate) fn take(&mut self, len: usize) -> Held {
        let n = (units(len) as usize).min(self.held.num_permits());
        Held {
            _share: self.held.split(n),
        }
    }
}

/// A delivered command's share of the budget, given back on drop.
#[derive(Debug)]
pub(crate) struct Held {
    _share: Option<OwnedSemaphorePermit>,
}

/// Whole units covering `bytes`.
fn units(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT)).unwrap_or(u32::MAX)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reservation_takes_every_free_byte_and_gives_back_what_was_not_used() {
        let b = Budget::new(8 * 1024 * 1024, 1024 * 1024);
        let mut r = b.reserve().await.unwrap();
        assert_eq!(r.bytes(), 8 * 1024 * 1024);
        let one = r.take(3 * 1024 * 1024 + 1);
        assert_eq!(r.bytes(), 8 * 1024 * 1024 - 3 * 1024 * 1024 - 1024);
        drop(r);
        // The delivered command still holds its share; the rest is free again.
        let r = b.reserve().await.unwrap();
        assert_eq!(r.bytes(), 8 * 1024 * 1024 - 3 * 1024 * 1024 - 1024);
        drop(r);
        drop(one);
        assert_eq!(b.reserve().await.unwrap().bytes(), b.capacity_bytes());
    }

    #[tokio::test]
    async fn a_pull_waits_until_the_largest_message_fits() {
        let b = Budget::new(2 * 1024 * 1024, 1024 * 1024);
        let mut r = b.reserve().await.unwrap();
        let held = r.take(1024 * 1024 - 10);
        drop(r);
        // Less than 1 MiB is free: no pull until the held command ends.
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), b.reserve());
        assert!(waiting.await.is_err());
        drop(held);
        assert_eq!(b.reserve().await.unwrap().bytes(), 2 * 1024 * 1024);
    }

    #[tokio::test]
    async fn a_pull_carries_a_byte_limit_only_when_it_can_bind() {
        let b = Budget::new(64 * 1024 * 1024, 1024 * 1024);
        let r = b.reserve().await.unwrap();
        assert_eq!(r.limit_for(32), 0, "32 of the largest fit in 64 MiB");
        assert_eq!(r.limit_for(64), r.bytes(), "64 with their envelopes do not");
    }

    #[test]
    fn the_budget_is_raised_to_the_largest_message() {
        let b = Budget::new(1024 * 1024, 8 * 1024 * 1024);
        assert_eq!(b.capacity_bytes(), 8 * 1024 * 1024 + ENVELOPE);
    }

    #[tokio::test]
    async fn a_take_past_the_reservation_takes_what_is_left() {
        let b = Budget::new(1024 * 1024, 1024);
        let mut r = b.reserve().await.unwrap();
        let all = r.take(usize::MAX / 2);
        assert_eq!(r.bytes(), 0);
        drop(r);
        drop(all);
        assert_eq!(b.reserve().await.unwrap().bytes(), b.capacity_bytes());
    }
}
