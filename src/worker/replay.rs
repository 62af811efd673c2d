//! Replaying a partition from an inbox sequence (`runner partitions replay`,
//! `POST /admin/partitions/{p}/replay`): the owner moves partition `p`'s checkpoint back to
//! `from - 1` and reads its inbox again from `from`, as a new owner does after a take-over.
//!
//! What a replay applies again: inputs already reflected in the store are recognised and
//! skipped — an event whose id was applied (within `saga.dedupe_retention`), an effect result
//! whose command is answered, a timer that already fired — and outputs of inputs at or below
//! the fence watermark are not published twice (the fenced relay drops them). An input
//! without an event id, or older than the dedupe retention, *is* applied again: that is why
//! the operator must confirm.
//!
//! Guarantees: a replay only moves back (a `from` past the checkpoint + 1 would skip inputs
//! and is refused); it is done by the partition's consuming loop itself, between batches,
//! in a write transaction of its own, so it never races a commit of that partition; only the
//! node that owns the partition accepts it; the inputs read again are counted in
//! `runner_partition_replayed_inputs_total`.
