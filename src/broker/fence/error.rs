//! What can go wrong when raising a fence or publishing under one, and what each case
//! tells the caller (the protocol and what each failure costs: the module above).

/// Fencing errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// A raise lost: another marker was stored after the one this raiser read, or the last
    /// marker carries a greater epoch. A newer owner exists.
    #[error("fence {subject}: epoch {epoch} is superseded")]
    Superseded {
        /// The fence subject.
        subject: String,
        /// The epoch that tried to raise.
        epoch: u64,
    },
    /// The broker refused a fenced publish: the fence subject moved past this fence's
    /// sequence. Nothing was stored; the partition belongs to someone else.
    #[error("fence {subject} (sequence {fence_seq}) is fenced off: last sequence is now {now_seq}")]
    Fenced {
        /// The fence subject.
        subject: String,
        /// This fence's marker sequence.
        fence_seq: u64,
        /// The fence subject's last sequence as read after the refusal.
        now_seq: u64,
    },
    /// The broker answered "wrong last sequence" but the fence is still this one: the
    /// message may already be stored (a retried msg-id) or another fenced publish was in
    /// flight. The caller checks for its message and retries if it is missing.
    #[error(
        "publish to {subject} under fence {fence_seq} was refused while the fence still holds: maybe written"
    )]
    MaybeWritten {
        /// The subject published to.
        subject: String,
        /// This fence's marker sequence.
        fence_seq: u64,
    },
    /// The server did not answer or failed for another reason; the outcome is unknown.
    #[error("fence {subject}: {op} failed: {reason}")]
    Nats {
        /// The fence subject.
        subject: String,
        /// What was tried.
        op: &'static str,
        /// Why.
        reason: String,
    },
    /// The last message on a fence subject is not a marker.
    #[error("fence {subject} holds an unreadable marker: {reason}")]
    Corrupt {
        /// The fence subject.
        subject: String,
        /// Why.
        reason: String,
    },
}
