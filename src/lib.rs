//! Runner: sagas and side-effect workflows on NATS JetStream.
#![warn(missing_docs)]

pub mod cli;
pub mod expr;
pub mod manifest;
pub mod saga;
