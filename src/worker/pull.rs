//! The pull size of an input consumer read through an ordered consumer (a saga input loop,
//! a router's source): as many messages per pull as fit in `saga.max_pull_bytes` at the
//! average message size seen, within `PULL_RANGE`.
//!
//! Why a count: the client sends an ordered consumer's pull requests without a byte limit,
//! so the message count is what bounds the bytes one pull buffers. A fixed count either lets
//! large messages fill hundreds of MiB or starves small ones. The count is fixed when the
//! consumer opens; a reader reopens it (at its checkpoint, losing nothing) when
//! `PullSize::should_reopen` says the sizes moved far enough.
//!
//! And how such a consumer's messages are taken: [`next_chunk`], everything received up
//! to a batch's cap, not what fits in one slice of the async runtime's budget.

/// The next chunk of a `ready_chunks` stream of consumer messages: everything already
/// received, up to the chunk's cap. Polled plainly, a chunk ends where tokio's cooperative
/// budget (128 channel receives per poll of a task) makes the client's channel report
/// nothing ready, whatever it holds: under a backlog every batch would be ~125 inputs and
/// pay a commit (and its fsync) for so few. The cap bounds the work of one such poll.
/// (Public so that the bench's messaging limit reads its consumers the same way.)
pub async fn next_chunk<S: futures::Stream + Unpin>(chunks: &mut S) -> Option<S::Item> {
    use futures::StreamExt;
    tokio::task::unconstrained(chunks.next()).await
}

/// Fewest and most messages one pull asks for (the client's own default is the most).
const PULL_RANGE: (i64, i64) = (8, 500);

/// The pull size of one consumer, following the sizes it reads.
pub(crate) struct PullSize {
    cap: f64,
    avg: f64,
    current: i64,
}

impl PullSize {
    pub(crate) fn new(cap: u64) -> Self {
        Self {
            cap: cap as f64,
            avg: 1024.0,
            current: 0,
        }
    }

    /// The count the average size calls for.
    pub(crate) fn wanted(&self) -> i64 {
        ((self.cap / self.avg.max(1.0)) as i64).clamp(PULL_RANGE.0, PULL_RANGE.1)
    }

    /// The count for a consumer opened now.
    pub(crate) fn open(&mut self) -> i64 {
        self.current = self.wanted();
        self.current
    }

    /// Takes the sizes of a chunk read into the average.
    pub(crate) fn observe(&mut self, sizes: impl Iterator<Item = usize>) {
        let (mut n, mut total) = (0usize, 0usize);
        for size in sizes {
            n += 1;
            total = total.saturating_add(size);
        }
        if n == 0 {
            return;
        }
        self.avg = 0.5 * self.avg + 0.5 * (total as f64 / n as f64);
    }

    /// Whether the count called for is half as large again or smaller, or two thirds or less,
    /// than the consumer's (a margin, so sizes near a boundary do not reopen it over and over).
    pub(crate) fn should_reopen(&self) -> bool {
        let (w, c) = (self.wanted(), self.current);
        c > 0 && (w * 3 <= c * 2 || w * 2 >= c * 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pull_size_follows_the_input_size_within_its_range() {
        let mut p = PullSize::new(32 * 1024 * 1024);
        assert_eq!(p.open(), 500, "small inputs: the client's full pull");
        let big = || std::iter::repeat_n(256 * 1024, 50);
        p.observe(big());
        assert!(p.should_reopen());
        p.observe(big());
        p.observe(big());
        let n = p.open();
        assert!((128..=170).contains(&n), "{n} pulls of 256 KiB");
        assert!(!p.should_reopen());
        let huge = || std::iter::repeat_n(8 * 1024 * 1024, 4);
        for _ in 0..6 {
            p.observe(huge());
        }
        assert_eq!(p.open(), 8, "never fewer than the floor");
    }
}
