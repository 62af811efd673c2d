//! Why an operator's dead-letter operation (listing, showing, redriving) was refused.

use crate::storage::StorageError;

/// Why a dead-letter operation was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeadLetterError {
    /// Storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A listing's arguments are wrong.
    #[error("{0}")]
    BadQuery(String),
    /// No such dead letter.
    #[error("no dead letter {id} for tenant `{tenant}`")]
    NotFound {
        /// Tenant.
        tenant: String,
        /// Id.
        id: u64,
    },
    /// The entry was redriven already.
    #[error("dead letter {0} was already redriven")]
    AlreadyRedriven(u64),
    /// The entry keeps only an excerpt of its input: it cannot be applied again from here.
    #[error(
        "dead letter {id} keeps only an excerpt of its {bytes}-byte input; the input is at \
         {from} while that stream retains it: fix and republish it there instead"
    )]
    ExcerptOnly {
        /// The entry.
        id: u64,
        /// Where the whole input is (`stream:seq`).
        from: String,
        /// Its size.
        bytes: u64,
    },
    /// The entry is an effect command parked by an effect worker: it is not a saga input.
    #[error(
        "dead letter {0} is an effect command an effect worker could not run; a saga redrive \
         cannot apply it: republish the command once its cause is fixed"
    )]
    EffectCommand(u64),
    /// The entry is held behind another one; that one must be redriven first.
    #[error("dead letter {id} is held behind dead letter {first}; redrive {first} instead")]
    HeldBehind {
        /// This entry.
        id: u64,
        /// The entry that parked the key.
        first: u64,
    },
}
