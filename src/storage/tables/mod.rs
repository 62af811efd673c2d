//! Typed access to the keyspaces inside one libmdbx transaction: one file per table, each
//! with its records, its keys and its `impl Tables` block.
//!
//! Key layouts (numbers big-endian so byte order is numeric order; strings separated by a
//! 0x00 byte, which subject tokens and ids never contain; the tenant in every tenant key):
//!
//! | table | key | value | file |
//! |---|---|---|---|
//! | `saga` | `t 0 saga 0 correlation_id` | [`Instance`](crate::saga::Instance) as JSON | [`saga`] |
//! | `saga` | `t 0 saga 0 correlation_id 0 slot:u64` | [`HistoryEntry`], binary; slot = n mod [`HISTORY_KEEP`]: each instance keeps its last transitions in a ring beside it | [`history`] |
//! | `outbox` | `partition:u16 seq:u64` | [`OutboxRecord`], binary | [`outbox`] |
//! | `checkpoint` | consumer name | last applied stream sequence, `u64` | [`checkpoint`] |
//! | `dedupe` | `t 0 saga 0 event_id` | applied-at ms, `u64` | [`dedupe`] |
//! | `schedule` | `due_ms:u64 t 0 saga 0 correlation_id 0 timer` | [`TimerEntry`] as JSON | [`timers`] |
//! | `deadletter` | `t 0 id:u64` | [`DeadLetter`] as JSON | [`deadletter`] |
//! | `parked` | `t 0 saga 0 correlation_id` | id of the dead letter that parked the key, `u64` | [`deadletter`] |
//! | `index` | `s t 0 saga 0 state 0 started_ms:u64 correlation_id` and `a t 0 saga 0 started_ms:u64 correlation_id` | empty: instances by state and by age | [`index`] |
//! | `capped` | `t 0 partition:u16 first_id:u64`, and `… first_id:u64 id:u64` for each letter held behind it | empty: keys held at the tenant's cap on running instances, oldest first | [`capped`] |
//! | `live` | `t 0 partition:u16` (+ `T` for timers) | running instances (pending timers) of the tenant in the partition, `u64` | [`live`] |
//! | `meta` | name | counters (`outbox_seq`, `deadletter_id`), `u64` | [`outbox`], [`deadletter`] |
//! | `history` | as the ring keys above | history written by earlier versions (read, no longer written) | [`history`] |
//!
//! [`Tables`] itself (the open tables of one transaction) is in [`txn`]; the key helpers
//! and value codecs the tables share are in [`keys`].
//!
//! Guarantee: everything here runs inside a caller's transaction; nothing commits on its
//! own, so a caller composes state, outbox, timers, markers and checkpoint into one atomic
//! commit.

pub mod capped;
pub mod checkpoint;
pub mod deadletter;
pub mod dedupe;
pub mod history;
pub mod index;
pub mod keys;
pub mod live;
pub mod outbox;
pub mod saga;
pub mod timers;
pub mod txn;

pub use capped::{CappedKey, HeldAtCap};
pub use deadletter::{DeadLetter, DeadLetterStatus};
pub use dedupe::dedupe_key;
pub use history::{HISTORY_KEEP, HistoryEntry};
pub use index::{
    InstancePage, InstanceQuery, MAX_PAGE, decode_after, encode_after, is_continuation,
};
pub use keys::instance_key;
pub use live::{Counted, TenantCounts};
pub use outbox::{DEFAULT_PARTITION, OutboxRecord};
pub use timers::TimerEntry;
pub use txn::Tables;
