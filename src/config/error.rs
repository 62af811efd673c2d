//! Config errors: each names where the bad value came from and the key.

use std::path::PathBuf;

/// A config problem. The `Display` form is one line meant for an operator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The config file is not valid TOML, has an unknown key or a badly typed value.
    #[error("{}:{line}:{column}: {}{message}", path.display(), key_prefix(key))]
    File {
        /// The file.
        path: PathBuf,
        /// 1-based line (0 when unknown).
        line: usize,
        /// 1-based column (0 when unknown).
        column: usize,
        /// Dotted key path, when known.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// An environment variable override is bad.
    #[error("environment variable {var}: {}{message}", key_prefix(key))]
    Env {
        /// The variable.
        var: String,
        /// Dotted key path, when known.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// A value is outside its allowed range, or values contradict each other.
    #[error("config key `{key}`: {message}")]
    Invalid {
        /// Dotted key path.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
    },
}

fn key_prefix(key: &Option<String>) -> String {
    match key {
        Some(k) if !k.is_empty() && k != "." => format!("key `{k}`: "),
        _ => String::new(),
    }
}
