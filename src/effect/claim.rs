//! Claims: at most one live executor per effect command.
//!
//! One record per command in a JetStream KV bucket, keyed `<tenant>.<command_id>`. Every
//! write is a compare-and-set on the key's revision, and the revision a worker last wrote
//! is its fencing token: whoever writes next with an older revision is refused.
//!
//! - **Acquire**: create-if-absent `{owner, attempt: 1, lease_expires_ms, state: running}`
//!   (tried before any read on a first delivery, the common case).
//! - **Renew**: every third of the lease, rewrite the record with a new expiry, CAS on the
//!   held revision. A refused renewal means someone else took the command over: the holder
//!   has lost the right to record or publish an outcome.
//! - **Steal**: a running claim whose lease expired (by the reader's clock) is rewritten with
//!   `attempt + 1`, CAS on the revision read; of several thieves exactly one wins.
//! - **Complete**: the outcome and the result event are written into the claim (CAS on the
//!   held revision) *before* the result is published, so a fenced-out zombie never
//!   publishes anything. A later delivery of a completed command republishes the stored
//!   result and executes nothing.
//!
//! The lease expiry lives in the value, not in a server-side per-key TTL: an expired key
//! that vanished would lose its attempt count and its stored result. Records are removed
//! by the bucket's `max_age` (`effect.claim_retention`) after their last write.

use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use serde_json::value::RawValue;

use crate::clock::now_ms;

/// Where a claim stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimState {
    /// An executor holds it (while its lease lasts).
    Running,
    /// Finished; the result is stored.
    Done,
}

/// The result event of a finished command, as stored in its claim.
///
/// The body is kept as the JSON text that is published: it is written once, embedded in
/// the claim record as it is and sent as it is, never parsed back on the way.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredResult {
    /// Full subject.
    pub subject: String,
    /// `Nats-Msg-Id`.
    pub msg_id: String,
    /// `traceparent` of the command, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// Body, as JSON text.
    pub body: Box<RawValue>,
    /// The saga inbox subject it is published on instead of `subject` (which it then
    /// carries as `Runner-Subject`), when its command named the partition waiting for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inbox: Option<String>,
}

impl StoredResult {
    /// The body as a JSON value (for reading a field; the hot path never needs it).
    pub fn body_json(&self) -> Json {
        serde_json::from_str(self.body.get()).unwrap_or(Json::Null)
    }
}

impl PartialEq for StoredResult {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.subject,
            &self.msg_id,
            &self.traceparent,
            self.body.get(),
            &self.inbox,
        ) == (
            &other.subject,
            &other.msg_id,
            &other.traceparent,
            other.body.get(),
            &other.inbox,
        )
    }
}

/// The value of one claim record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    /// Process that holds (or finished) it.
    pub owner: String,
    /// Executors that took it so far (1 for the first, +1 per steal).
    pub attempt: u32,
    /// Lease end, milliseconds since the epoch.
    pub lease_expires_ms: u64,
    /// Running or done.
    pub state: ClaimState,
    /// The result event, once done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<StoredResult>,
}

/// A held claim: the key, its fencing revision and the attempt number.
#[derive(Debug, Clone)]
pub struct Lease {
    /// KV key.
    pub key: String,
    /// The revision last written by this holder (the fence).
    pub revision: u64,
    /// Attempt number of this holder.
    pub attempt: u32,
    /// Lease end by the holder's clock (ms since the epoch).
    pub expires_ms: u64,
}

/// What the gate decided for a delivered command.
#[derive(Debug)]
pub enum Gate {
    /// First executor: run it.
    Acquired(Lease),
    /// The previous executor's lease expired: run it again under a new attempt.
    Stolen(Lease),
    /// Already finished: republish this result, execute nothing.
    Done(StoredResult),
    /// A live executor holds it: come back after this long.
    Busy(Duration),
}

/// Claim store errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// Someone else wrote the claim since we last did: we no longer hold it.
    #[error("claim {key} was taken over (held revision {revision} is stale)")]
    Fenced {
        /// KV key.
        key: String,
        /// The revision we held.
        revision: u64,
    },
    /// The KV bucket could not be reached or refused the request for another reason.
    #[error("claim {key}: KV {op} failed: {reason}")]
    Kv {
        /// KV key.
        key: String,
        /// What we tried.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// A claim record that is not a claim (corruption, or another program's key).
    #[error("claim {key} holds an unreadable value: {reason}")]
    Corrupt {
        /// KV key.
        key: String,
        /// Why.
        reason: String,
    },
}

/// The claims bucket, as one process sees it.
#[derive(Clone)]
pub struct Claims {
    kv: kv::Store,
    owner: String,
    ttl: Duration,
}

impl std::fmt::Debug for Claims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claims")
            .field("owner", &self.owner)
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// A claim key: `<tenant>.<command_id>`, or `None` when either part has characters a KV key
/// cannot hold or is longer than a subject token may be ([`crate::subject::Rule::TENANT`],
/// [`crate::subject::Rule::ID`]).
pub fn claim_key(tenant: &str, command_id: &str) -> Option<String> {
    use crate::subject::{Rule, check};
    let ok = |s: &str, rule: Rule| {
        check(s, rule).is_ok()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '=' | '/'))
    };
    (ok(tenant, Rule::TENANT) && ok(command_id, Rule::ID)).then(|| format!("{tenant}.{command_id}"))
}

impl Claims {
    /// Claims in `kv`, written by `owner`, with leases of `ttl`.
    pub fn new(kv: kv::Store, owner: String, ttl: Duration) -> Self {
        Self { kv, owner, ttl }
    }

    /// The lease length.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// This process's owner id.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    fn encode(&self, attempt: u32, expires_ms: u64) -> Result<Bytes, serde_json::Error> {
        let c = Claim {
            owner: self.owner.clone(),
            attempt,
            lease_expires_ms: expires_ms,
            state: ClaimState::Running,
            result: None,
        };
        serde_json::to_vec(&c).map(Bytes::from)
    }

    fn kv_err(key: &str, op: &'static str, e: impl std::fmt::Display) -> ClaimError {
        ClaimError::Kv {
            key: key.to_string(),
            op,
            reason: e.to_string(),
        }
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// Decides what to do with a delivered command: take it, take it over, replay its
    /// result, or wait.
    ///
    /// On a command's first delivery there is almost never a claim yet, so the gate tries
    /// to create one straight away (one round trip) and reads the record only when it
    /// already exists; a redelivery reads first. Either way the decision is the same.
    pub async fn gate(&self, key: &str, first_delivery: bool) -> Result<Gate, ClaimError> {
        let mut read = !first_delivery;
        // A lost create or steal race re-reads and decides again, then reports busy.
        for _ in 0..3 {
            let entry = if std::mem::replace(&mut read, true) {
                self.kv
                    .entry(key)
                    .await
                    .map_err(|e| Self::kv_err(key, "get", e))?
            } else {
                None
            };
            let now = now_ms();
            let expires = now.saturating_add(self.ttl_ms());
            let Some(entry) = entry else {
                let value = self
                    .encode(1, expires)
                    .map_err(|e| Self::kv_err(key, "encode", e))?;
                match self.kv.create(key, value).await {
                    Ok(revision) => {
                        return Ok(Gate::Acquired(Lease {
                            key: key.to_string(),
                            revision,
                            attempt: 1,
                            expires_ms: expires,
                        }));
                    }
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(Self::kv_err(key, "create", e)),
                }
            };
            let claim: Claim =
                serde_json::from_slice(&entry.value).map_err(|e| ClaimError::Corrupt {
                    key: key.to_string(),
                    reason: e.to_string(),
                })?;
            match claim.state {
                ClaimState::Done => {
                    return match claim.result {
                        Some(r) => Ok(Gate::Done(r)),
                        None => Err(ClaimError::Corrupt {
                            key: key.to_string(),
                            reason: "done without a stored result".into(),
                        }),
                    };
                }
                ClaimState::Running if claim.lease_expires_ms > now => {
                    let left = claim.lease_expires_ms - now;
                    return Ok(Gate::Busy(Duration::from_millis(left + 100)));
                }
                ClaimState::Running => {
                    let attempt = claim.attempt.saturating_add(1);
                    let value = self
                        .encode(attempt, expires)
                        .map_err(|e| Self::kv_err(key, "encode", e))?;
                    match self.kv.update(key, value, entry.revision).await {
                        Ok(revision) => {
                            return Ok(Gate::Stolen(Lease {
                                key: key.to_string(),
                                revision,
                                attempt,
                                expires_ms: expires,
                            }));
                        }
                        Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                        Err(e) => return Err(Self::kv_err(key, "steal", e)),
                    }
                }
            }
        }
        Ok(Gate::Busy(self.ttl / 3))
    }

    /// Extends the lease, CAS on the held revision. [`ClaimError::Fenced`] means the lease
    /// is lost for good.
    pub async fn renew(&self, lease: &mut Lease) -> Result<(), ClaimError> {
        let expires = now_ms().saturating_add(self.ttl_ms());
        let value = self
            .encode(lease.attempt, expires)
            .map_err(|e| Self::kv_err(&lease.key, "encode", e))?;
        self.cas(lease, value, "renew").await?;
        lease.expires_ms = expires;
        Ok(())
    }

    /// Gives the claim up: the lease is marked expired (CAS on the held revision), so the
    /// next delivery takes it over at once instead of waiting for the lease to run out.
    pub async fn release(&self, lease: &mut Lease) -> Result<(), ClaimError> {
        let value = self
            .encode(lease.attempt, 0)
            .map_err(|e| Self::kv_err(&lease.key, "encode", e))?;
        self.cas(lease, value, "release").await
    }

    /// Marks the command done with its result, CAS on the held revision.
    pub async fn complete(
        &self,
        lease: &mut Lease,
        result: StoredResult,
    ) -> Result<(), ClaimError> {
        let c = Claim {
            owner: self.owner.clone(),
            attempt: lease.attempt,
            lease_expires_ms: 0,
            state: ClaimState::Done,
            result: Some(result),
        };
        let value = serde_json::to_vec(&c)
            .map(Bytes::from)
            .map_err(|e| Self::kv_err(&lease.key, "encode", e))?;
        self.cas(lease, value, "complete").await
    }

    async fn cas(
        &self,
        lease: &mut Lease,
        value: Bytes,
        op: &'static str,
    ) -> Result<(), ClaimError> {
        match self.kv.update(&lease.key, value, lease.revision).await {
            Ok(rev) => {
                lease.revision = rev;
                Ok(())
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                Err(ClaimError::Fenced {
                    key: lease.key.clone(),
                    revision: lease.revision,
                })
            }
            Err(e) => Err(Self::kv_err(&lease.key, op, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_refuse_subject_breaking_characters() {
        assert_eq!(claim_key("_", "0192-ab").as_deref(), Some("_.0192-ab"));
        assert_eq!(claim_key("acme", "a.b"), None);
        assert_eq!(claim_key("", "x"), None);
        assert_eq!(claim_key("t", "x y"), None);
        // Bounded like every subject token built from input (`crate::subject`).
        let (t, id) = ("t".repeat(128), "i".repeat(512));
        assert!(claim_key(&t, &id).is_some());
        assert_eq!(claim_key(&"t".repeat(129), "x"), None);
        assert_eq!(claim_key("t", &"i".repeat(513)), None);
        assert_eq!(claim_key(&"t".repeat(5000), "x"), None);
    }
}
