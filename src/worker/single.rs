//! One single-active saga replica per set of streams (DESIGN §8.9, until partitioned mode is
//! the only saga mode).
//!
//! A single-active replica reads every input of its streams and keeps all of their state in
//! its own store. A second one started beside it with the same configuration would apply
//! every input again from its own empty store and publish every output a second time under
//! ids the de-duplication window no longer remembers (measured: a lagging second replica
//! cancelled 89 orders that had shipped). So the saga pipeline of a single-active replica
//! runs only while it holds the lease [`KEY`] in the leases bucket, and partitioned and
//! single-active replicas refuse to run beside each other.
//!
//! **Protocol.**
//! - *Start, single-active*: take [`KEY`] with the owner `<node id>@<store id>` (the store
//!   id is the data directory's, [`crate::storage::lock::store_id`]). Held by this data
//!   directory's previous process (killed: this process holds the directory's lock, so that
//!   one is dead): take it over at once (delete expecting its revision, then take it). Held
//!   by anyone else: refuse to start, naming the holder. Then look for partitioned members
//!   (`m.*` keys): refuse, naming them, and release.
//! - *Start, partitioned*: refuse while [`KEY`] is held, naming the holder.
//! - *Run*: the lease is renewed by its own task ([`super::keeper`]). If it is lost (a
//!   renewal answered "wrong revision", or the deadline passed during a NATS outage), the
//!   node drains: it stops taking inputs, finishes what it holds, and exits, so a restart
//!   takes the lease again or is refused.
//! - *Drain*: the lease is released after the pipeline stopped.
//!
//! Guarantee: of the replicas that hold the lease or a partition, at most one runs a
//! single-active pipeline, and never beside a partitioned one — whatever their
//! configuration, as long as they share the leases bucket (`partitions.leases_bucket`).
//! The checks on both sides are write-then-read against one bucket, so of two replicas
//! started at the same moment at least one sees the other, except a partitioned replica
//! that checked before the single-active one took the lease and wrote its own member key
//! after that one looked (both within a few milliseconds): that window is logged by
//! neither. Fencing, as partitioned mode has it, is not given to the single-active relay.

use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;

use super::keeper::Kept;
use super::lease::{self, Lease, LeaseError};

/// The lease key a single-active replica holds while its saga pipeline runs.
pub const KEY: &str = "saga.single-active";

/// Why this replica may not run its saga pipeline.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SingleError {
    /// Another replica runs single-active on these streams.
    #[error(
        "another replica (`{owner}`) runs the saga pipeline single-active on these streams; a \
         second one would apply every input again. Stop that one, or give every saga replica \
         `partitions.enabled = true` to share the work"
    )]
    Held {
        /// The holder's owner string.
        owner: String,
    },
    /// Partitioned replicas run on these streams.
    #[error(
        "partitioned replicas ({members}) run on these streams and this one has \
         `partitions.enabled = false`: it would apply every input they own. Give it \
         `partitions.enabled = true`"
    )]
    Partitioned {
        /// Their node ids, comma-separated.
        members: String,
    },
    /// The leases bucket did not answer.
    #[error("the single-active lease: {0}")]
    Lease(#[from] LeaseError),
}

/// The owner string of this replica.
fn owner(node_id: &str, store_id: &str) -> String {
    format!("{node_id}@{store_id}")
}

/// Takes the single-active lease for this replica (see the module doc), or says why not.
pub async fn take(
    kv: &kv::Store,
    node_id: &str,
    store_id: &str,
    ttl: Duration,
) -> Result<Kept, SingleError> {
    let me = owner(node_id, store_id);
    let mut tries = 0;
    let lease = loop {
        tries += 1;
        if let Some(l) = Lease::acquire(kv, KEY, &me, ttl).await? {
            break l;
        }
        let Some(h) = lease::holder(kv, KEY).await? else {
            continue; // released between the two reads: try again
        };
        let ours = h.owner.rsplit_once('@').map(|(_, s)| s) == Some(store_id);
        if !ours || tries > 3 {
            return Err(SingleError::Held { owner: h.owner });
        }
        // This data directory's previous process: it is dead (this one holds the
        // directory's lock), so its lease is void.
        tracing::info!(message = "Taking over the single-active lease this data directory's previous run left.", previous = %h.owner);
        if let Err(e) = kv.delete_expect_revision(KEY, Some(h.revision)).await {
            tracing::debug!(message = "The previous single-active lease changed meanwhile.", error = %e);
        }
    };
    let kept = Kept::keep(lease, None);
    let members = members(kv).await?;
    if !members.is_empty() {
        if let Err(e) = kept.release().await {
            tracing::warn!(message = "Cannot release the single-active lease.", error = %e);
        }
        return Err(SingleError::Partitioned {
            members: members.join(", "),
        });
    }
    Ok(kept)
}

/// Refuses a partitioned replica while a single-active one holds [`KEY`].
pub async fn refuse_if_held(kv: &kv::Store) -> Result<(), SingleError> {
    match lease::holder(kv, KEY).await? {
        Some(h) => Err(SingleError::Held { owner: h.owner }),
        None => Ok(()),
    }
}

/// The node ids with a live member key in the bucket (partitioned replicas alive now).
async fn members(kv: &kv::Store) -> Result<Vec<String>, LeaseError> {
    let err = |op: &'static str, e: &dyn std::fmt::Display| LeaseError::Kv {
        key: "m.*".into(),
        op,
        reason: e.to_string(),
    };
    let mut keys = kv.keys().await.map_err(|e| err("keys", &e))?;
    let mut out = Vec::new();
    while let Some(k) = keys.next().await {
        let k = k.map_err(|e| err("keys", &e))?;
        let Some(node) = k.strip_prefix("m.") else {
            continue;
        };
        // Only a live entry counts (not a delete or an expiry marker).
        let live = kv
            .entry(&k)
            .await
            .map_err(|e| err("entry", &e))?
            .is_some_and(|e| e.operation == kv::Operation::Put);
        if live {
            out.push(node.to_string());
        }
    }
    out.sort();
    Ok(out)
}
