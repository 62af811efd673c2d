//! Records handed from the commit to the relay in memory, so a relay that keeps up never
//! reads its outbox back from the store.
//!
//! The commit thread already holds every outbox record it writes. After the transaction is
//! durable, and before it answers the batch's loop, it hands a partition's records to that
//! partition's [`Fresh`] — one per partition on the node, shared by every owning period's
//! relay handle (`Relays::handle_for`), so the records of a batch whose loop was aborted
//! while it committed still reach the next relay. The relay takes its next window from
//! there instead of opening a read transaction on a blocking thread and decoding what was
//! just encoded. The store stays the source of truth: the relay takes
//! from memory only while memory is known to hold **every** record of the partition not yet
//! acknowledged, and reads the store otherwise.
//!
//! **How memory becomes complete** (the relay's side, [`Fresh::collect`] then
//! [`Fresh::read_through`]): before a store read the relay starts collecting; from then
//! on every commit's records are kept. A commit handed over before that moment was
//! durable before it, so the read that follows sees it. When that read returns the
//! partition's whole remaining outbox (fewer records than a window), memory holds
//! everything after it, and the relay takes from memory from then on. A record both read
//! and kept is dropped from memory as the acknowledged sequence passes it.
//!
//! **Guarantees.**
//! - **Never a gap.** Memory is used only once complete, as above. Anything that might
//!   make it incomplete or stale sends the relay back to the store ([`Fresh::forget_for`]):
//!   a failed window (its records were taken out of memory), a record parked in the store
//!   in an output's place, memory passing its bound, a sequence a writer noted but never
//!   handed over, and a new relay starting on the partition ([`Fresh::claim`]: from then on
//!   a relay of an earlier period, still winding down, can take nothing and mark nothing).
//! - **Bounded.** At most [`MAX_BYTES`] of records ([`OutboxRecord::size`]) are kept per
//!   partition; past that memory is dropped and the relay reads the store until it has
//!   caught up again.
//! - **In order.** Commits of one partition are handed over in commit order, the order of
//!   their outbox sequences, so memory is in outbox order as the store is.

use std::collections::VecDeque;

use crate::storage::tables::OutboxRecord;

/// The most record bytes one partition keeps in memory for its relay.
pub const MAX_BYTES: u64 = 512 * 1024;

/// Where a partition's memory of fresh records stands.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// Not kept: the relay reads the store.
    #[default]
    Off,
    /// Kept since the relay's last store read began; not yet known to be complete.
    Collecting,
    /// Every record of the partition above the acknowledged sequence is here.
    Complete,
}

/// One partition's records written and not yet taken by its relay.
#[derive(Debug, Default)]
pub struct Fresh {
    fill: Fill,
    records: VecDeque<(u64, OutboxRecord)>,
    bytes: u64,
    /// The highest sequence handed over or read from the store while collecting.
    through: u64,
    /// The relay this memory serves ([`Fresh::claim`]); another relay's calls change
    /// nothing and take nothing.
    relay: u64,
}

impl Fresh {
    /// A commit made `records` durable (in outbox order): kept when the relay collects.
    pub fn hand_over(&mut self, records: Vec<(u64, OutboxRecord)>) {
        if self.fill == Fill::Off {
            return;
        }
        for (seq, r) in records {
            self.bytes += r.size();
            self.through = self.through.max(seq);
            self.records.push_back((seq, r));
        }
        if self.bytes > MAX_BYTES {
            self.forget();
        }
    }

    /// A relay starts on the partition: memory is dropped and serves that relay alone from
    /// now on, so a relay of an earlier owning period still winding down (aborted, or
    /// fenced off) can neither take records nor mark memory complete. Returns the relay's
    /// claim, which it passes to every later call.
    pub fn claim(&mut self) -> u64 {
        self.forget();
        self.relay += 1;
        self.relay
    }

    /// The relay is about to read the store: keep what commits hand over from now on.
    pub fn collect(&mut self, relay: u64) {
        if self.fill == Fill::Off && relay == self.relay {
            self.fill = Fill::Collecting;
        }
    }

    /// The relay's store read (begun after [`Fresh::collect`]) returned every record the
    /// partition had left, the last one `last` (0: none): memory now holds everything
    /// after it.
    pub fn read_through(&mut self, relay: u64, last: u64) {
        if self.fill == Fill::Collecting && relay == self.relay {
            self.fill = Fill::Complete;
            self.through = self.through.max(last);
        }
    }

    /// Memory may be incomplete or stale: drop it; the relay reads the store.
    pub fn forget_for(&mut self, relay: u64) {
        if relay == self.relay {
            self.forget();
        }
    }

    fn forget(&mut self) {
        self.fill = Fill::Off;
        self.records.clear();
        self.bytes = 0;
        self.through = 0;
    }

    /// Up to `max` records with sequence `from` or later, taken out of memory, when memory
    /// is complete; `None` when the relay must read the store. `written` is the highest
    /// sequence a writer noted ([`super::RelayHandle::note_written`]): a record noted and
    /// never handed over (a writer that only stores) makes memory incomplete.
    pub fn window(
        &mut self,
        relay: u64,
        from: u64,
        max: usize,
        written: u64,
    ) -> Option<Vec<(u64, OutboxRecord)>> {
        if relay != self.relay {
            return None;
        }
        while self.records.front().is_some_and(|(s, _)| *s < from) {
            self.pop();
        }
        if self.fill != Fill::Complete {
            return None;
        }
        if written > self.through.max(from.saturating_sub(1)) {
            self.forget();
            return None;
        }
        let n = self.records.len().min(max);
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.extend(self.pop());
        }
        Some(out)
    }

    fn pop(&mut self) -> Option<(u64, OutboxRecord)> {
        let r = self.records.pop_front()?;
        self.bytes = self.bytes.saturating_sub(r.1.size());
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64) -> (u64, OutboxRecord) {
        let r = OutboxRecord {
            subject: format!("tenant.t.effect.e.{seq}"),
            msg_id: format!("m{seq}"),
            tenant: "t".into(),
            traceparent: None,
            body: "{}".into(),
            cause: (seq, 0),
        };
        (seq, r)
    }

    /// Memory claimed by a relay whose store read found nothing left: complete and empty.
    fn complete() -> (Fresh, u64) {
        let mut f = Fresh::default();
        let r = f.claim();
        f.collect(r);
        f.read_through(r, 0);
        (f, r)
    }

    fn seqs(w: &[(u64, OutboxRecord)]) -> Vec<u64> {
        w.iter().map(|(s, _)| *s).collect()
    }

    #[test]
    fn nothing_is_kept_or_taken_until_the_relay_collects() {
        let mut f = Fresh::default();
        let r = f.claim();
        f.hand_over(vec![rec(1), rec(2)]);
        assert!(f.window(r, 1, 10, 0).is_none());
        f.collect(r);
        f.hand_over(vec![rec(3)]);
        // Collecting, not yet known complete: the store is read.
        assert!(f.window(r, 1, 10, 0).is_none());
        f.read_through(r, 0);
        assert_eq!(seqs(&f.window(r, 1, 10, 0).expect("complete")), vec![3]);
    }

    #[test]
    fn records_read_from_the_store_and_kept_are_dropped_as_the_ack_passes_them() {
        let mut f = Fresh::default();
        let r = f.claim();
        f.collect(r);
        // A commit handed over after the relay began collecting and before its read: the
        // read saw it too.
        f.hand_over(vec![rec(4), rec(5)]);
        f.read_through(r, 0);
        f.hand_over(vec![rec(9)]);
        // The relay published 4 and 5 from its read: it asks from 6.
        assert_eq!(seqs(&f.window(r, 6, 10, 0).expect("complete")), vec![9]);
        assert_eq!(
            seqs(&f.window(r, 10, 10, 0).expect("complete")),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn a_window_takes_at_most_max_in_order() {
        let (mut f, r) = complete();
        f.hand_over((1..=5).map(rec).collect());
        assert_eq!(seqs(&f.window(r, 1, 2, 0).expect("complete")), vec![1, 2]);
        assert_eq!(
            seqs(&f.window(r, 3, 10, 0).expect("complete")),
            vec![3, 4, 5]
        );
    }

    #[test]
    fn forgetting_sends_the_relay_back_to_the_store_until_it_reads_through_again() {
        let (mut f, r) = complete();
        f.hand_over(vec![rec(1)]);
        f.forget_for(r);
        f.hand_over(vec![rec(2)]);
        assert!(f.window(r, 1, 10, 0).is_none());
        // A read that returned a full window (not read through) leaves memory collecting.
        f.collect(r);
        f.hand_over(vec![rec(3)]);
        assert!(f.window(r, 1, 10, 0).is_none());
        f.read_through(r, 0);
        assert_eq!(seqs(&f.window(r, 3, 10, 0).expect("complete")), vec![3]);
    }

    #[test]
    fn a_record_noted_but_never_handed_over_sends_the_relay_to_the_store() {
        let mut f = Fresh::default();
        let r = f.claim();
        f.collect(r);
        f.read_through(r, 4);
        f.hand_over(vec![rec(5)]);
        // Everything noted is here: taken from memory.
        assert_eq!(seqs(&f.window(r, 5, 10, 5).expect("complete")), vec![5]);
        // Sequence 7 was noted by a writer that only stored it.
        f.hand_over(vec![rec(6)]);
        assert!(f.window(r, 6, 10, 7).is_none());
        assert!(f.records.is_empty(), "memory is dropped");
        // Noted records the relay has acknowledged do not count.
        f.collect(r);
        f.read_through(r, 7);
        assert_eq!(
            seqs(&f.window(r, 8, 10, 7).expect("complete")),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn a_relay_of_an_earlier_period_takes_nothing_and_marks_nothing() {
        let mut f = Fresh::default();
        let old = f.claim();
        let new = f.claim();
        f.collect(new);
        f.read_through(new, 0);
        f.hand_over(vec![rec(1), rec(2)]);
        // The old relay, still winding down, reads the store and finds memory not its own.
        assert!(f.window(old, 1, 10, 2).is_none());
        f.forget_for(old);
        f.collect(old);
        f.read_through(old, 0);
        assert_eq!(
            seqs(&f.window(new, 1, 10, 2).expect("complete")),
            vec![1, 2]
        );
        // Before the new relay's store read, the old one cannot make memory complete.
        let newer = f.claim();
        f.collect(old);
        f.read_through(old, 0);
        f.hand_over(vec![rec(3)]);
        assert!(f.window(newer, 3, 10, 3).is_none());
    }

    #[test]
    fn passing_the_bound_drops_memory() {
        let (mut f, r) = complete();
        let big = OutboxRecord {
            body: "x".repeat(usize::try_from(MAX_BYTES).expect("fits")),
            ..rec(1).1
        };
        f.hand_over(vec![(1, big)]);
        assert!(f.window(r, 1, 10, 0).is_none());
        assert_eq!(f.bytes, 0);
        // Until a read through, nothing is kept.
        f.hand_over(vec![rec(2)]);
        assert!(f.records.is_empty());
    }
}
