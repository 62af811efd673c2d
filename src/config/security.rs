//! `[security]`: the deployment key that seals snapshots and control inputs (`seal.rs` makes
//! and checks the seals). Guarantee: the key itself never appears in `Debug` output.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Shortest deployment key accepted, in bytes.
pub const MIN_DEPLOYMENT_KEY_BYTES: usize = 16;

/// `[security]`: the deployment key (`seal.rs`). Snapshots and control inputs travel
/// through buckets and subjects that anyone with write access to them could also write to;
/// with a key, Runner seals what it writes there and refuses what it did not seal.
#[derive(Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SecurityConfig {
    /// The key itself (at least 16 bytes). Prefer `RUNNER__SECURITY__DEPLOYMENT_KEY` or
    /// `deployment_key_file` to a committed file. Every saga node of a deployment needs the
    /// same key.
    pub deployment_key: Option<String>,
    /// File holding the key on its first line; further lines are earlier keys, still
    /// accepted but never used to seal (rotation).
    pub deployment_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for SecurityConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        f.debug_struct("SecurityConfig")
            .field(
                "deployment_key",
                &self.deployment_key.as_ref().map(|_| "<set>"),
            )
            .field("deployment_key_file", &self.deployment_key_file)
            .finish()
    }
}
