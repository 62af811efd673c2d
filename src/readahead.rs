//! The node's budget of saga input bytes read ahead of their commit: `saga.max_pull_bytes`,
//! shared by every input consumer open on the node.
//!
//! A node reads its inputs through many consumers at once: one per partition it owns (up to
//! `partitions.count`) and one per router share it routes. Each asks the server for messages
//! ahead of what it has committed (its pull) and holds some while a batch commits (its
//! read-ahead). Sized per consumer, those add up with the number of consumers: with 64
//! partitions and 256 KiB inputs, a node asked for and buffered about 2 GiB and its server
//! stopped answering in time.
//!
//! Guarantees:
//! - every consumer open on the node holds a [`Part`] of one [`Budget`], and a part's
//!   [`Part::bytes`] is the budget divided by the number of parts held now, so the
//!   consumers' pulls and read-aheads together stay near the budget, however many partitions
//!   and shares the node holds (each may pass its part by one message: a pull asks for at
//!   least one);
//! - a part is given back when its consumer's loop ends (drop), so the others' parts grow
//!   again; a consumer sizes its pull when it opens and reopens when the size it is due
//!   moves far enough (`worker::pull::PullSize`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The node's read-ahead budget.
#[derive(Debug)]
pub struct Budget {
    bytes: u64,
    parts: AtomicUsize,
}

impl Budget {
    /// A budget of `bytes` (`saga.max_pull_bytes`), no part held yet.
    pub fn new(bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            bytes,
            parts: AtomicUsize::new(0),
        })
    }

    /// A part for one consumer, held until dropped.
    pub fn part(self: &Arc<Self>) -> Part {
        self.parts.fetch_add(1, Ordering::SeqCst);
        Part {
            budget: Arc::clone(self),
        }
    }

    /// Parts held now.
    pub fn parts(&self) -> usize {
        self.parts.load(Ordering::SeqCst)
    }
}

/// One consumer's part of the [`Budget`].
#[derive(Debug)]
pub struct Part {
    budget: Arc<Budget>,
}

impl Part {
    /// The bytes this consumer may ask for and hold now: the budget over the parts held.
    pub fn bytes(&self) -> u64 {
        let parts = u64::try_from(self.budget.parts().max(1)).unwrap_or(u64::MAX);
        (self.budget.bytes / parts).max(1)
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        self.budget.parts.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_divide_the_budget_and_give_it_back() {
        let b = Budget::new(32 << 20);
        let one = b.part();
        assert_eq!(one.bytes(), 32 << 20);
        let more: Vec<Part> = (0..63).map(|_| b.part()).collect();
        assert_eq!(one.bytes(), (32 << 20) / 64);
        assert_eq!(more[5].bytes(), (32 << 20) / 64);
        drop(more);
        assert_eq!(b.parts(), 1);
        assert_eq!(one.bytes(), 32 << 20);
    }
}
