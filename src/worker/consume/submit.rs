//! A chunk handed to the committer, piece by piece, and each answer acted on.
//!
//! The commit side of the loop's guarantees ([`super`]) is kept here: one piece at a time,
//! each after the answer for the one before, with what a commit deferred going again first
//! (the partition stays in order); metrics and the relay's wake-up after the commit; and a
//! failed commit ending the consumer, so the loop resumes at the checkpoint.

use std::collections::VecDeque;

use super::{Loop, Next, Reader, checkpoint_gauge};
use crate::worker::admission::RawInput;
use crate::worker::commit::Applied;
use crate::worker::tally::Tally;

impl Loop {
    /// Submits `batch` to the committer in pieces of at most `saga.max_batch_bytes`, each
    /// only after the answer for the one before, reading ahead on `reader` while each
    /// commits. Inputs a commit deferred go again, first. A failed commit gives the
    /// consumer up (after a backoff): what it held is re-read from the checkpoint.
    pub(super) async fn submit(
        &mut self,
        reader: &mut Reader,
        batch: Vec<(u64, RawInput)>,
        lag: Option<u64>,
    ) -> Result<(), Next> {
        let mut pieces: VecDeque<_> = split_by_bytes(batch, self.max_batch_bytes).into();
        while let Some(batch) = pieces.pop_front() {
            let replay_until = self.input.scope.replay_until;
            let replayed_in = |batch: &[(u64, RawInput)]| {
                batch.iter().filter(|(seq, _)| *seq <= replay_until).count()
            };
            let (n, replayed) = (batch.len(), replayed_in(&batch));
            // The next batch is read while this one commits (see `ReadAhead`).
            let commit =
                self.committer
                    .submit(&self.input.checkpoint, batch, self.input.scope.clone());
            match reader.during(commit).await {
                Ok(Applied {
                    checkpoint: cp,
                    tally,
                    deferred,
                }) => {
                    // What the transaction had no room for goes again, first.
                    let (n, replayed) = (n - deferred.len(), replayed - replayed_in(&deferred));
                    if !deferred.is_empty() {
                        pieces.push_front(deferred);
                    }
                    self.committed(n, replayed, cp, lag, tally);
                }
                Err(e) => {
                    tracing::error!(message = "Batch commit failed; re-reading from the checkpoint.", stream = %self.input.stream, error = %e);
                    self.backoff.sleep(&self.cancel).await;
                    return Err(Next::Reopen);
                }
            }
        }
        Ok(())
    }

    /// After a commit that applied `n` inputs (`replayed` of them a replay) up to checkpoint
    /// `cp`: the metrics, then the relay told what was written and woken.
    fn committed(&mut self, n: usize, replayed: usize, cp: u64, lag: Option<u64>, tally: Tally) {
        let metrics = &self.state.metrics;
        let input = &self.input;
        metrics.partition_replayed.inc_by(replayed as u64);
        metrics
            .saga_inputs
            .with_label_values(&[&input.stream])
            .inc_by(n as u64);
        checkpoint_gauge(metrics, input, cp);
        if let Some(l) = lag {
            metrics
                .partition_lag
                .with_label_values(&[&input.scope.partition.to_string()])
                .set(l as i64);
        }
        tally.record(metrics, &self.state.limits.get());
        if tally.outbox > 0 {
            // The commit thread has handed the records over (`commit.rs`).
            self.relay.wake();
        }
        self.backoff.reset();
    }
}

/// Splits `batch` into consecutive batches of at most `cap` body bytes each (a message
/// larger than `cap` is a batch of its own), in order, so large events cannot make one
/// transaction hold hundreds of MiB.
fn split_by_bytes(batch: Vec<(u64, RawInput)>, cap: usize) -> Vec<Vec<(u64, RawInput)>> {
    let mut out: Vec<Vec<(u64, RawInput)>> = Vec::new();
    let mut bytes = 0usize;
    for item in batch {
        let size = item.1.body.len();
        match out.last_mut() {
            Some(last) if bytes.saturating_add(size) <= cap => {
                bytes += size;
                last.push(item);
            }
            _ => {
                bytes = size;
                out.push(vec![item]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(seq: u64, bytes: usize) -> (u64, RawInput) {
        (
            seq,
            RawInput {
                subject: "s".into(),
                body: vec![b'x'; bytes].into(),
                traceparent: None,
                header_bytes: 0,
                refused: None,
                live_cap: None,
                timer_cap: None,
                source: format!("s:{seq}"),
                stored_ms: None,
            },
        )
    }

    #[test]
    fn batches_are_split_by_bytes_in_order() {
        let batch = vec![
            input(1, 40),
            input(2, 40),
            input(3, 40),
            input(4, 200),
            input(5, 10),
        ];
        let parts = split_by_bytes(batch, 100);
        let seqs: Vec<Vec<u64>> = parts
            .iter()
            .map(|p| p.iter().map(|(s, _)| *s).collect())
            .collect();
        assert_eq!(seqs, vec![vec![1, 2], vec![3], vec![4], vec![5]]);
        assert!(split_by_bytes(Vec::new(), 100).is_empty());
    }
}
