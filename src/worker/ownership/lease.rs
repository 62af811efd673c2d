//! Ownership leases: at most one holder per key (a saga partition, a router's source), kept
//! in a JetStream KV bucket (DESIGN §8.3), set up by [`crate::broker::ensure_leases_bucket`];
//! used by the ownership task ([`super`]) and [`super::router`].
//!
//! **The bucket** keeps one revision per key (`history 1`), ages every entry out `TTL` after
//! its last write (`max_age = TTL`) and writes a marker when it does (`limit_markers`), so a
//! watcher sees an expiry at once. Leases never use per-key TTL: an `update` writes no TTL,
//! so a per-key-TTL lease that was renewed once would never expire.
//!
//! **Protocol.**
//! 1. *Acquire* ([`Lease::acquire`]): `create` the key (only if absent, or if its last entry
//!    is a delete or expiry marker). The revision of the winning write is the lease's
//!    **epoch**; revisions are the bucket stream's sequence, so a later holder of the same
//!    key always has a greater epoch. A contender that loses gets `None` and tries later.
//! 2. *Renew* ([`Lease::renew`]) every [`Lease::renew_every`] (TTL/3): `update` the key,
//!    expecting the revision this holder wrote last. Each write restarts the age, so a
//!    renewed lease outlives its TTL. An answer "wrong revision" means the server no longer
//!    holds this holder's write: the lease is lost ([`LeaseError::Lost`]), for good.
//! 3. *Release* ([`Lease::release`]): delete the key expecting the held revision; another
//!    contender can create it at once.
//! 4. *Hand over* ([`Lease::hand_over`]): instead of deleting, write `{handoff: N}` expecting
//!    the held revision, where `N` is the checkpoint of the snapshot the holder stored last.
//!    The key is free from then on ([`holder`] reads nobody); the next contender takes it
//!    with a compare-and-set on that revision, and learns `N`
//!    ([`Lease::handed_over_at`]), so it can wait for that snapshot instead of trusting a
//!    listing that may lag the write. An unclaimed hand-over ages out like any entry. (A
//!    replica of an older version reads a hand-over as held and waits for it to age out:
//!    one TTL late, and it replays from the newest snapshot it lists.)
//!
//! The value is JSON `{owner, epoch, nonce}` (no `epoch` in the acquiring write itself, whose
//! own revision is the epoch: read it with [`holder`]), plus `handoff` in a hand-over and
//! `store`, the holder's data directory, which lets a process started again on that
//! directory take the key back at once ([`Lease::reclaim_or_acquire`]).
//! Readers ignore fields they do not know. The `nonce`
//! is random per acquisition: when the server's answer to a write is lost (a timeout) but the
//! write landed, the holder recognises its own write by it and carries on, instead of taking
//! its own write for a rival's. Safety does not rest on `owner` being unique.
//!
//! **Guarantee.** At most one holder per key *as the server sees it*: every write is a
//! compare-and-set on the key's last revision, decided by the stream leader. The holder
//! trusts only its own monotonic clock: [`Lease::valid_until`] is the send time of the last
//! successful write (acquire or renew) + TTL − a margin of TTL/5, and the server cannot
//! expire the entry before send + TTL (it ages entries from when it stored them, which is
//! after the send). No synchronised wall clocks are needed, only clocks that tick at about
//! the same rate; a step of the server's clock, or a suspended host (whose monotonic clock
//! stops), breaks the bound.
//!
//! **Why this is not enough on its own.** A holder can check [`Lease::is_valid`], then be
//! paused (GC, SIGSTOP, a blocked runtime thread, a frozen VM) past its deadline and write
//! afterwards, when another holder already owns the key. No check on the client closes that
//! gap; only the resource written to can refuse a stale writer. That is broker-side fencing
//! (DESIGN §8.4: a fence marker per partition and an expected-last-subject-sequence header
//! on every outbox publish), which lives in [`crate::broker::fence`]: every publish of a partition's
//! relay and of a router is fenced, so a paused former holder stores nothing.
//!
//! **What each failure costs.**
//! - A holder that crashes or stops renewing: the key is free TTL after its last write;
//!   until then nobody owns it (fail-over ≤ TTL plus the new owner's start).
//! - A renew that fails without an answer (timeout, no connection): nothing yet; the
//!   deadline does not move, and the holder must stop work when it passes unless a later
//!   renew succeeds.
//! - A renew answered "wrong revision": the lease is lost; the holder stops at once.
//! - A create whose answer is lost and whose write lands later than the holder could
//!   check: the key is held by nobody who knows it until it ages out (≤ one TTL).
//! - A holder that does not release (killed): the successor waits up to one TTL.

use std::time::{Duration, Instant};

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The value stored under a lease key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct LeaseValue {
    /// Who holds it (for people and logs; safety does not depend on it).
    owner: String,
    /// The lease's epoch; absent in the entry written by the winning create, whose own
    /// revision is the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    epoch: Option<u64>,
    /// Random per acquisition: lets a holder recognise its own write.
    nonce: String,
    /// Set by a hand-over: the key is free, and the state it left is the snapshot at this
    /// checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    handoff: Option<u64>,
    /// The data directory of the holder's process (its store id): a process that holds the
    /// same directory's lock knows this holder is dead, and takes the key at once
    /// ([`Lease::reclaim_or_acquire`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    store: Option<String>,
}

/// Lease errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// The server no longer holds this holder's last write: the lease expired, was released,
    /// or another contender holds it now. Stop at once; the lease cannot be renewed.
    #[error("lease {key} (epoch {epoch}) is lost: the bucket no longer holds its last write")]
    Lost {
        /// The lease key.
        key: String,
        /// The epoch that was held.
        epoch: u64,
    },
    /// The key has characters a KV key cannot hold.
    #[error("{key:?} is not a valid lease key")]
    InvalidKey {
        /// The key.
        key: String,
    },
    /// The bucket did not answer, or failed for another reason. Whether the write happened
    /// is unknown; a holder keeps relying on its deadline only.
    #[error("lease {key}: KV {op} failed: {reason}")]
    Kv {
        /// The lease key.
        key: String,
        /// What was tried.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// The entry under a lease key is not a lease (another program's key, or corruption).
    #[error("lease {key} holds an unreadable value: {reason}")]
    Corrupt {
        /// The lease key.
        key: String,
        /// Why.
        reason: String,
    },
}

/// Who holds a lease key right now, as the bucket says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The holder's `owner`.
    pub owner: String,
    /// The holder's epoch (the revision of the create that won the key).
    pub epoch: u64,
    /// The revision of the entry read (the holder's last write).
    pub revision: u64,
}

/// The current holder of `key`, or `None` when nobody holds it (never created, released,
/// handed over, or expired).
pub async fn holder(kv: &kv::Store, key: &str) -> Result<Option<Holder>, LeaseError> {
    let Some(entry) = read(kv, key).await? else {
        return Ok(None);
    };
    if entry.value.handoff.is_some() {
        return Ok(None);
    }
    Ok(Some(Holder {
        owner: entry.value.owner,
        epoch: entry.value.epoch.unwrap_or(entry.revision),
        revision: entry.revision,
    }))
}

/// A decoded live entry of a lease key.
struct Read {
    value: LeaseValue,
    revision: u64,
}

/// The live entry of `key`; `None` when its last entry is a delete or expiry marker.
async fn read(kv: &kv::Store, key: &str) -> Result<Option<Read>, LeaseError> {
    let entry = kv.entry(key).await.map_err(|e| LeaseError::Kv {
        key: key.to_string(),
        op: "get",
        reason: e.to_string(),
    })?;
    match entry {
        Some(e) if e.operation == Operation::Put => {
            let value = serde_json::from_slice(&e.value).map_err(|err| LeaseError::Corrupt {
                key: key.to_string(),
                reason: err.to_string(),
            })?;
            Ok(Some(Read {
                value,
                revision: e.revision,
            }))
        }
        _ => Ok(None),
    }
}

/// The revision of the live entry of `key` when it is this holder's own write (it carries
/// `nonce`); `None` otherwise, and also when it cannot be read (a reader that cannot tell
/// must not assume it is its own).
async fn own_write(kv: &kv::Store, key: &str, nonce: &str) -> Option<(u64, Option<u64>)> {
    match read(kv, key).await {
        Ok(Some(r)) if r.value.nonce == nonce => Some((r.revision, r.value.epoch)),
        _ => None,
    }
}

/// Swaps a handed-over entry (at `revision`) for `value`: the new holder's revision, or `None`
/// when another contender swapped it first.
async fn take_handed_over(
    kv: &kv::Store,
    key: &str,
    value: Bytes,
    revision: u64,
) -> Result<Option<u64>, LeaseError> {
    match kv.update(key, value, revision).await {
        Ok(revision) => Ok(Some(revision)),
        Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(None),
        Err(e) => Err(LeaseError::Kv {
            key: key.to_string(),
            op: "update",
            reason: e.to_string(),
        }),
    }
}

/// The part of the TTL a holder gives up as a safety margin: it stops TTL/5 before the
/// server could expire its lease (8 s of a 10 s TTL, as DESIGN §8.3).
fn margin(ttl: Duration) -> Duration {
    ttl / 5
}

/// A held lease on one key.
pub struct Lease {
    kv: kv::Store,
    key: String,
    owner: String,
    store: Option<String>,
    nonce: String,
    ttl: Duration,
    epoch: u64,
    revision: u64,
    valid_until: Instant,
    handed_over_at: Option<u64>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("owner", &self.owner)
            .field("epoch", &self.epoch)
            .field("revision", &self.revision)
            .field("ttl", &self.ttl)
            .field("valid_until", &self.valid_until)
            .finish()
    }
}

/// The one write a holder makes after acquiring, each a compare-and-set on its revision.
enum Write {
    Renew(Bytes),
    HandOver(Bytes),
    Release,
}

impl Lease {
    /// Tries to take `key` for `owner`. `ttl` must be the bucket's `max_age` (the bucket set
    /// up by [`crate::broker::ensure_leases_bucket`] with the same TTL). Returns `None` when
    /// another holder has it.
    pub async fn acquire(
        kv: &kv::Store,
        key: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, LeaseError> {
        Self::reclaim_or_acquire(kv, key, owner, None, ttl).await
    }

    /// [`Lease::acquire`] for a process that holds the lock of the data directory `store`
    /// (its store id): a key held by an earlier process on that same directory — dead, since
    /// this one holds the lock — is taken at once with a compare-and-set on its revision,
    /// under a new, greater epoch, instead of after its TTL. So a replica killed and started
    /// again on its own data takes its partitions back without a TTL's stall. (A copy of a
    /// data directory carries its id: never run two processes on copies of one.)
    pub async fn reclaim_or_acquire(
        kv: &kv::Store,
        key: &str,
        owner: &str,
        store: Option<&str>,
        ttl: Duration,
    ) -> Result<Option<Lease>, LeaseError> {
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let value = encode(&LeaseValue {
            owner: owner.to_string(),
            epoch: None,
            nonce: nonce.clone(),
            handoff: None,
            store: store.map(str::to_string),
        });
        let sent = Instant::now();
        let mut handed_over_at = None;
        let (revision, epoch) = match kv.create(key, value.clone()).await {
            Ok(revision) => (revision, revision),
            Err(e) => match e.kind() {
                CreateErrorKind::InvalidKey => {
                    return Err(LeaseError::InvalidKey {
                        key: key.to_string(),
                    });
                }
                // Someone holds it — unless that someone is this very create, whose first
                // answer was lost.
                CreateErrorKind::AlreadyExists => match read(kv, key).await.ok().flatten() {
                    Some(r) if r.value.nonce == nonce => {
                        (r.revision, r.value.epoch.unwrap_or(r.revision))
                    }
                    // Held by this data directory's dead previous process: ours now.
                    Some(r) if store.is_some() && r.value.store.as_deref() == store => {
                        match take_handed_over(kv, key, value, r.revision).await? {
                            Some(revision) => (revision, revision),
                            None => return Ok(None),
                        }
                    }
                    // Handed over: free to whoever swaps it first.
                    Some(r) if r.value.handoff.is_some() => {
                        match take_handed_over(kv, key, value, r.revision).await? {
                            Some(revision) => {
                                handed_over_at = r.value.handoff;
                                (revision, revision)
                            }
                            None => return Ok(None),
                        }
                    }
                    _ => return Ok(None),
                },
                _ => {
                    return Err(LeaseError::Kv {
                        key: key.to_string(),
                        op: "create",
                        reason: e.to_string(),
                    });
                }
            },
        };
        Ok(Some(Lease {
            kv: kv.clone(),
            key: key.to_string(),
            owner: owner.to_string(),
            store: store.map(str::to_string),
            nonce,
            ttl,
            epoch,
            revision,
            valid_until: sent + ttl - margin(ttl),
            handed_over_at,
        }))
    }

    /// Extends the lease: a compare-and-set on the revision last written. On success the
    /// deadline moves to this call's send time + TTL − margin. [`LeaseError::Lost`] means the
    /// lease is gone for good (and [`Lease::is_valid`] is false from then on);
    /// [`LeaseError::Kv`] leaves the deadline where it was.
    pub async fn renew(&mut self) -> Result<(), LeaseError> {
        let value = self.value(None);
        let (revision, sent) = self.write(Write::Renew(value)).await?;
        self.revision = revision;
        self.valid_until = sent + self.ttl - margin(self.ttl);
        Ok(())
    }

    /// Gives the key up: deletes it expecting the held revision, so another contender can
    /// acquire it at once. [`LeaseError::Lost`] means it was no longer held anyway.
    pub async fn release(mut self) -> Result<(), LeaseError> {
        self.write(Write::Release).await.map(|_| ())
    }

    /// Gives the key up saying that the state it leaves is the snapshot at `checkpoint`: a
    /// compare-and-set on the held revision. The next holder reads `checkpoint` from
    /// [`Lease::handed_over_at`]. [`LeaseError::Lost`] means it was no longer held anyway.
    pub async fn hand_over(mut self, checkpoint: u64) -> Result<(), LeaseError> {
        let value = self.value(Some(checkpoint));
        self.write(Write::HandOver(value)).await.map(|_| ())
    }

    /// This holder's value for a renewal (`handoff` none) or a hand-over.
    fn value(&self, handoff: Option<u64>) -> Bytes {
        encode(&LeaseValue {
            owner: self.owner.clone(),
            epoch: Some(self.epoch),
            nonce: self.nonce.clone(),
            handoff,
            store: self.store.clone(),
        })
    }

    /// Runs `write` as a compare-and-set on the held revision. When the server answers
    /// "wrong revision" but the live entry is this holder's own later write (an earlier
    /// answer was lost), it retries once on that revision; otherwise the lease is lost.
    /// Returns the new revision and the send time of the write that succeeded.
    async fn write(&mut self, write: Write) -> Result<(u64, Instant), LeaseError> {
        let mut expected = self.revision;
        for _ in 0..2 {
            let sent = Instant::now();
            let answer = match &write {
                Write::Renew(value) | Write::HandOver(value) => {
                    self.kv.update(&self.key, value.clone(), expected).await
                }
                Write::Release => self
                    .kv
                    .delete_expect_revision(&self.key, Some(expected))
                    .await
                    .map(|()| expected),
            };
            match answer {
                Ok(revision) => return Ok((revision, sent)),
                Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                    match own_write(&self.kv, &self.key, &self.nonce).await {
                        Some((revision, _)) if revision > expected => expected = revision,
                        _ => break,
                    }
                }
                Err(e) if e.kind() == UpdateErrorKind::InvalidKey => {
                    return Err(LeaseError::InvalidKey {
                        key: self.key.clone(),
                    });
                }
                Err(e) => {
                    return Err(LeaseError::Kv {
                        key: self.key.clone(),
                        op: match write {
                            Write::Renew(_) | Write::HandOver(_) => "update",
                            Write::Release => "delete",
                        },
                        reason: e.to_string(),
                    });
                }
            }
        }
        self.valid_until = self.valid_until.min(Instant::now());
        Err(LeaseError::Lost {
            key: self.key.clone(),
            epoch: self.epoch,
        })
    }

    /// The lease key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The epoch: the revision of the create that won the key. Greater for every later
    /// holder of the same key.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The checkpoint of the snapshot the previous holder handed the key over with, when it
    /// did ([`Lease::hand_over`]); `None` when the key was free, released or expired.
    pub fn handed_over_at(&self) -> Option<u64> {
        self.handed_over_at
    }

    /// The TTL (the bucket's `max_age`).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How often to renew: a third of the TTL, so two renewals can fail before the deadline.
    pub fn renew_every(&self) -> Duration {
        self.ttl / 3
    }

    /// The holder's deadline by its monotonic clock: the send time of the last successful
    /// acquire or renew + TTL − TTL/5. Past it the holder must stop pulling and publishing.
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// Whether the deadline is still ahead (false once the lease is known lost).
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until
    }
}

fn encode(value: &LeaseValue) -> Bytes {
    // A struct of strings and integers always serialises.
    Bytes::from(serde_json::to_vec(value).unwrap_or_default())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_create_carries_no_epoch_and_readers_ignore_unknown_fields() {
        let v = LeaseValue {
            owner: "r1".into(),
            epoch: None,
            nonce: "n".into(),
            handoff: None,
            store: None,
        };
        let json: serde_json::Value = serde_json::from_slice(&encode(&v)).unwrap();
        assert_eq!(json, serde_json::json!({"owner": "r1", "nonce": "n"}));
        let later: LeaseValue = serde_json::from_value(serde_json::json!({
            "owner": "r1", "epoch": 7, "nonce": "n",
            "handoff": 42, "heir": "r2"
        }))
        .unwrap();
        assert_eq!(later.epoch, Some(7));
        assert_eq!(later.owner, "r1");
        assert_eq!(later.handoff, Some(42));
    }

    #[test]
    fn margin_is_a_fifth_of_the_ttl() {
        assert_eq!(margin(Duration::from_secs(10)), Duration::from_secs(2));
        assert_eq!(margin(Duration::from_secs(2)), Duration::from_millis(400));
    }
}
