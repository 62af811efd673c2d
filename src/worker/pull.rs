//! The pull size of an input consumer read through an ordered consumer (a saga input loop,
//! a router's source): as many messages per pull as fit in the consumer's part of the node's
//! read-ahead budget (`saga.max_pull_bytes` over the consumers open, [`crate::readahead`])
//! at the average message size seen, within `PULL_RANGE`.
//!
//! Why a count: the client sends an ordered consumer's pull requests without a byte limit,
//! so the message count is what bounds the bytes one pull buffers. A fixed count either lets
//! large messages fill hundreds of MiB or starves small ones. The count is fixed when the
//! consumer opens; a reader reopens it (at its checkpoint, losing nothing) when
//! `PullSize::should_reopen` says the sizes moved far enough.
//!
//! And how such a consumer's messages are taken: [`next_chunk`], everything received up
//! to a batch's cap, not what fits in one slice of the async runtime's budget; and
//! [`ReadAhead`], which goes on reading while the previous batch commits.

use crate::readahead::Part;

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

/// A consumer's chunks, read on while the reader waits for something else (its previous
/// batch's commit), up to a count and a byte cap.
///
/// Why: the client asks the server for more only while its stream is polled. A loop that
/// waits for each commit before reading again leaves the pull idle for the commit's
/// duration, and its next batch holds no more than the pull delivered meanwhile (~500
/// messages), however deep the backlog. Reading on keeps messages flowing during the
/// commit, so under a backlog the next batch is full and each fsync covers more inputs.
///
/// Guarantees: items come out in the order the stream gave them, nothing is dropped (an
/// error or the stream's end is handed on after what preceded it, and no chunk is read
/// after one holding an error), and what is held passes the count cap or the byte cap by
/// at most one chunk.
pub(crate) struct ReadAhead<S, T> {
    chunks: S,
    held: Vec<T>,
    held_bytes: usize,
    /// An error was read, or the stream ended: read no further.
    stopped: bool,
    /// The stream ended.
    ended: bool,
    max_count: usize,
    max_bytes: usize,
}

/// What a [`ReadAhead`] needs to know of an item.
pub(crate) trait Item {
    /// Payload bytes it holds.
    fn bytes(&self) -> usize;
    /// Whether it is an error (reading stops after it).
    fn is_error(&self) -> bool;
}

impl<E> Item for Result<async_nats::jetstream::Message, E> {
    fn bytes(&self) -> usize {
        self.as_ref().map_or(0, |m| m.payload.len())
    }
    fn is_error(&self) -> bool {
        self.is_err()
    }
}

impl<S, T> ReadAhead<S, T>
where
    S: futures::Stream<Item = Vec<T>> + Unpin,
    T: Item,
{
    /// Reads `chunks`, holding about `max_count` items and `max_bytes` of payload at most
    /// (`saga.max_pull_bytes`, as configured).
    pub(crate) fn new(chunks: S, max_count: usize, max_bytes: u64) -> Self {
        Self {
            chunks,
            held: Vec::new(),
            held_bytes: 0,
            stopped: false,
            ended: false,
            max_count: max_count.max(1),
            max_bytes: usize::try_from(max_bytes).unwrap_or(usize::MAX).max(1),
        }
    }

    /// The next chunk: what was read ahead (at most `max_count` of it), else the next one
    /// the stream gives; `None` once it has ended and everything held was taken.
    pub(crate) async fn next(&mut self) -> Option<Vec<T>> {
        if self.held.is_empty() {
            if self.ended {
                return None;
            }
            return next_chunk(&mut self.chunks).await;
        }
        let rest = self.held.split_off(self.held.len().min(self.max_count));
        let out = std::mem::replace(&mut self.held, rest);
        self.held_bytes = self.held.iter().map(Item::bytes).sum();
        if self.held.is_empty() && !self.ended {
            // Whatever stopped the reading (an error) has been handed on with `out`.
            self.stopped = false;
        }
        Some(out)
    }

    /// Awaits `work`, reading ahead meanwhile (up to the caps, an error or the end).
    pub(crate) async fn during<F: std::future::Future>(&mut self, work: F) -> F::Output {
        let mut work = std::pin::pin!(work);
        loop {
            let room = !self.stopped
                && self.held.len() < self.max_count
                && self.held_bytes < self.max_bytes;
            tokio::select! {
                biased;
                out = &mut work => return out,
                c = next_chunk(&mut self.chunks), if room => match c {
                    Some(c) => {
                        self.stopped = c.iter().any(Item::is_error);
                        self.held_bytes += c.iter().map(Item::bytes).sum::<usize>();
                        self.held.extend(c);
                    }
                    None => {
                        self.stopped = true;
                        self.ended = true;
                    }
                },
            }
        }
    }
}

/// Fewest and most messages one pull asks for (the client's own default is the most). One
/// at least: large inputs on a node with many consumers get one each, not a floor that
/// multiplies past the budget.
const PULL_RANGE: (i64, i64) = (1, 500);

/// The pull size of one consumer, following the sizes it reads and its part of the node's
/// budget.
pub(crate) struct PullSize {
    part: Part,
    avg: f64,
    current: i64,
}

impl PullSize {
    /// The pull size of a consumer that holds `part` of the node's budget.
    pub(crate) fn new(part: Part) -> Self {
        Self {
            part,
            avg: 1024.0,
            current: 0,
        }
    }

    /// The bytes this consumer may ask for and hold ahead now (its part of the budget).
    pub(crate) fn bytes(&self) -> u64 {
        self.part.bytes()
    }

    /// The count the average size calls for.
    pub(crate) fn wanted(&self) -> i64 {
        ((self.bytes() as f64 / self.avg.max(1.0)) as i64).clamp(PULL_RANGE.0, PULL_RANGE.1)
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
        let budget = crate::readahead::Budget::new(32 * 1024 * 1024);
        let mut p = PullSize::new(budget.part());
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
        assert_eq!(p.open(), 4, "32 MiB of 8 MiB inputs");
        // 64 consumers share the budget: 512 KiB each, one 8 MiB input per pull.
        let others: Vec<_> = (0..63).map(|_| budget.part()).collect();
        assert!(p.should_reopen(), "the part shrank");
        assert_eq!(p.open(), 1, "never fewer than one");
        drop(others);
        assert!(p.should_reopen(), "the part grew back");
    }

    /// A test item: its payload size, or an error.
    type T = Result<usize, &'static str>;

    impl Item for T {
        fn bytes(&self) -> usize {
            *self.as_ref().unwrap_or(&0)
        }
        fn is_error(&self) -> bool {
            self.is_err()
        }
    }

    /// A stream of `items`, chunked as a consumer's messages are, and the sender that feeds
    /// it (dropped: the stream ends).
    fn feed(
        items: Vec<T>,
        chunk: usize,
    ) -> (
        futures::channel::mpsc::UnboundedSender<T>,
        impl futures::Stream<Item = Vec<T>> + Unpin,
    ) {
        use futures::StreamExt;
        let (tx, rx) = futures::channel::mpsc::unbounded();
        for i in items {
            tx.unbounded_send(i).expect("the receiver is held");
        }
        (tx, rx.ready_chunks(chunk))
    }

    /// A piece of work that takes a while (the clock is paused: it ends once nothing else
    /// can run).
    async fn commit() -> &'static str {
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        "committed"
    }

    #[tokio::test(start_paused = true)]
    async fn reading_ahead_stops_at_the_count_cap_and_keeps_the_order() {
        let (_tx, chunks) = feed((1..=25).map(Ok).collect(), 4);
        let mut r = ReadAhead::new(chunks, 10, u64::MAX);
        assert_eq!(
            r.next().await.expect("a chunk"),
            vec![Ok(1), Ok(2), Ok(3), Ok(4)]
        );
        assert_eq!(r.during(commit()).await, "committed");
        // Read on in chunks of 4 until 10 were held: 12, the cap passed by one chunk.
        assert_eq!(r.held.len(), 12);
        let next = r.next().await.expect("a chunk");
        assert_eq!(
            next,
            (5..=14).map(Ok).collect::<Vec<_>>(),
            "at most the cap"
        );
        assert_eq!(
            r.next().await.expect("a chunk"),
            vec![Ok(15), Ok(16)],
            "the rest"
        );
        assert_eq!(
            r.next().await.expect("a chunk"),
            (17..=20).map(Ok).collect::<Vec<_>>()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn reading_ahead_stops_at_the_byte_cap() {
        let (_tx, chunks) = feed(vec![Ok(600); 10], 1);
        let mut r = ReadAhead::new(chunks, 100, 1000);
        r.during(commit()).await;
        assert_eq!(
            r.held.len(),
            2,
            "1 200 bytes held, the cap passed by one chunk"
        );
        assert_eq!(r.next().await.expect("a chunk").len(), 2);
        assert_eq!(
            r.next().await.expect("a chunk"),
            vec![Ok(600)],
            "read as it comes"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_and_the_end_are_handed_on_after_what_preceded_them() {
        let (tx, chunks) = feed(vec![Ok(1), Ok(2), Err("gone"), Ok(3)], 3);
        let mut r = ReadAhead::new(chunks, 100, u64::MAX);
        r.during(commit()).await;
        assert_eq!(
            r.held,
            vec![Ok(1), Ok(2), Err("gone")],
            "nothing read past the error"
        );
        assert_eq!(
            r.next().await.expect("a chunk"),
            vec![Ok(1), Ok(2), Err("gone")]
        );
        drop(tx);
        r.during(commit()).await;
        assert_eq!(r.held, vec![Ok(3)]);
        assert!(r.ended);
        assert_eq!(r.next().await.expect("a chunk"), vec![Ok(3)]);
        assert_eq!(r.next().await, None, "the end, after everything held");
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_is_ready_first_is_answered_without_reading() {
        let (_tx, chunks) = feed((1..=5).map(Ok).collect(), 8);
        let mut r = ReadAhead::new(chunks, 100, u64::MAX);
        assert_eq!(r.during(async { 7 }).await, 7);
        assert!(r.held.is_empty());
        assert_eq!(r.next().await.expect("a chunk").len(), 5);
    }
}
