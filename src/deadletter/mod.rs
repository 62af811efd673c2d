//! Dead letters: every input Runner cannot process, kept with its reason until an operator
//! acts on it. This module owns the reason kinds, the recording of saga-side dead letters,
//! the message published for each one on the dead-letter stream (saga and effect side
//! alike), and listing, showing and redriving them.
//!
//! Guarantees:
//! - **Nothing is dropped silently.** A saga-side dead letter is written in the same write
//!   transaction as the batch that met it, with the original subject, body, trace context,
//!   source (`stream:seq`) and a reason for a person; the same transaction queues its
//!   message for the dead-letter stream (`tenant.<t>.deadletter.<kind>`) through the outbox.
//!   An effect command that can never run is published there too before it is terminated.
//! - **Order per key survives poison.** When the saga instance is known, the first dead
//!   letter parks its key: later inputs for the key are held as dead letters of kind
//!   [`kind::PARKED`], in arrival order, while every other key keeps flowing.
//! - **A redrive replays a key once, in order.** [`redrive`] runs in one write transaction:
//!   it unparks the key, re-applies the dead-lettered input and then every input held behind
//!   it, oldest first, and marks each entry redriven, so no entry is processed twice. If an
//!   input fails again it is dead-lettered anew and the rest of the key is held again behind
//!   it. A held entry cannot be redriven ahead of the entry that parked its key.
//! - **A listing costs its page.** [`page`] reads the stored letters in key order from a
//!   cursor, at most `limit` + 1 of them and never more than [`SCAN_ENTRIES`] letters or
//!   [`SCAN_BYTES`] bytes, applying its filters as it reads; it shows each letter cut
//!   ([`Listed`]: a body of at most [`SHOWN_BODY_BYTES`]) and stops before its answer passes
//!   [`ANSWER_BYTES`], answering `next` whenever more may follow.
//!
//! Layout, one submodule per concern: [`kind`] (the reason classes), `refusal` (what was
//! refused and the bounded letter kept for it), `record` (the saga side's recording of that
//! letter), `message` (its announcement on the dead-letter stream), `listing` (pages and
//! single letters for an operator), `purge` and `redrive`; `error` holds why an operator's
//! request was refused. Everything public is re-exported here, so callers name it
//! `crate::deadletter::…`.

pub mod kind;

mod error;
mod listing;
mod message;
mod purge;
mod record;
mod redrive;
mod refusal;

pub use crate::storage::tables::{DeadLetter, DeadLetterStatus};

pub use error::DeadLetterError;
pub use listing::{
    ANSWER_BYTES, ITEMS_BYTES, Listed, Listing, MAX_PAGE, Page, SCAN_BYTES, SCAN_ENTRIES,
    SHOWN_BODY_BYTES, SHOWN_FIELD_BYTES, cut_text, list, page, show, stopped,
};
pub use message::{Message, message, refused_command, subject};
pub use purge::{Purge, purge};
pub use record::{Poison, record, store};
pub use redrive::{Reapply, held_behind, is_effect_command, redrive, redrive_in, replay_key};
pub use refusal::{EXCERPT_BYTES, Refused, excerpt, letter_of};
