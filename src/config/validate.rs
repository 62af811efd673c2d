//! Validation: [`Config::validate`], the one pass that checks every value once all layers
//! are applied.
//!
//! Guarantee: a config that passes is usable as written. Every value is within its allowed
//! range, names that become JetStream names or subject tokens are valid as such, settings
//! that only make sense together are set together; the first problem found is a
//! [`ConfigError::Invalid`] naming the key, never a silent clamp.
//!
//! Inside: one check per config section (`[nats]`, `[node]`, `[runner]`, `[streams]`, …),
//! run in the order [`Config::validate`] lists them, plus one for the names that become
//! JetStream names, which several sections give. Each stops at its own first problem.

use super::Config;
use super::error::ConfigError;
use super::types::{ByteSize, HumanDuration};

/// A NATS subject token: non-empty, no dots, wildcards, whitespace or control characters,
/// at most [`crate::subject::MAX_SUBJECT_BYTES`] (the one check, [`crate::subject::check`]).
pub fn is_subject_token(s: &str) -> bool {
    crate::subject::check(s, crate::subject::Rule::NAME).is_ok()
}

/// `v` within `lo..=hi`, else an error naming `key`.
pub(super) fn range<T: PartialOrd + std::fmt::Display>(
    key: &str,
    v: T,
    lo: T,
    hi: T,
) -> Result<(), ConfigError> {
    if v < lo || v > hi {
        Err(ConfigError::Invalid {
            key: key.to_string(),
            message: format!("{v} is out of range; allowed {lo} to {hi}"),
        })
    } else {
        Ok(())
    }
}

/// A rate of `what` per second above 0 and at most 1e9, else an error naming `key`.
pub(super) fn per_second(key: &str, r: f64, what: &str) -> Result<(), ConfigError> {
    if r.is_finite() && r > 0.0 && r <= 1e9 {
        Ok(())
    } else {
        invalid(
            key,
            format!("{r} is out of range; allowed above 0 to 1e9 {what} per second"),
        )
    }
}

/// The refusal of `key`, saying why in `message`.
pub(super) fn invalid(key: &str, message: String) -> Result<(), ConfigError> {
    Err(ConfigError::Invalid {
        key: key.to_string(),
        message,
    })
}

/// A JetStream stream or consumer name.
fn is_js_name(s: &str) -> bool {
    is_subject_token(s) && !s.contains(['/', '\\'])
}

impl Config {
    /// Checks every value against its allowed range. Called once after all layers applied.
    ///
    /// The sections are checked in this order, and the first problem found is the answer.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_nats()?;
        self.validate_node()?;
        self.validate_runner()?;
        self.validate_streams()?;
        self.validate_jetstream_names()?;
        self.tenancy.validate()?;
        self.validate_storage()?;
        self.validate_saga()?;
        self.validate_effect()?;
        self.validate_partitions()?;
        self.validate_admin()?;
        self.validate_security()?;
        self.validate_consumers()?;
        self.validate_tracing()
    }

    /// `[nats]`: server URLs without credentials in them, at most one authentication
    /// scheme, credentials and TLS files given in pairs, sane timeouts.
    fn validate_nats(&self) -> Result<(), ConfigError> {
        let nats = &self.nats;
        if nats.urls.is_empty() {
            return invalid("nats.urls", "at least one server URL is required".into());
        }
        for url in &nats.urls {
            let addr = match url.parse::<async_nats::ServerAddr>() {
                Ok(a) => a,
                Err(e) => {
                    let shown = crate::config::redact_url(url);
                    return invalid("nats.urls", format!("{shown:?} is not a NATS URL: {e}"));
                }
            };
            if addr.has_user_pass() || addr.username().is_some() {
                return invalid(
                    "nats.urls",
                    format!(
                        "{:?} carries credentials; give them as nats.user and nats.password \
                         (or nats.token) so they are used and never logged",
                        crate::config::redact_url(url)
                    ),
                );
            }
        }
        let schemes: Vec<&str> = [
            ("nats.token", nats.token.is_some()),
            ("nats.user", nats.user.is_some() || nats.password.is_some()),
            ("nats.nkey_seed_file", nats.nkey_seed_file.is_some()),
            ("nats.creds_file", nats.creds_file.is_some()),
        ]
        .into_iter()
        .filter_map(|(k, set)| set.then_some(k))
        .collect();
        if schemes.len() > 1 {
            return invalid(
                schemes[0],
                format!(
                    "set one authentication scheme, not {}",
                    schemes.join(" and ")
                ),
            );
        }
        range(
            "nats.connect_timeout",
            nats.connect_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range(
            "nats.setup_timeout",
            nats.setup_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range(
            "nats.request_timeout",
            nats.request_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(300),
        )?;
        if nats.user.is_some() != nats.password.is_some() {
            return invalid(
                "nats.user",
                "`user` and `password` must be set together".into(),
            );
        }
        if nats.tls_cert_file.is_some() != nats.tls_key_file.is_some() {
            return invalid(
                "nats.tls_cert_file",
                "`tls_cert_file` and `tls_key_file` must be set together".into(),
            );
        }
        Ok(())
    }

    /// `[node]`: an id, when one is configured, usable in keys and subjects.
    fn validate_node(&self) -> Result<(), ConfigError> {
        if !self.node.id.is_empty() && !valid_node_id(&self.node.id) {
            return invalid(
                "node.id",
                format!(
                    "{:?} is not usable as a node id: use 1 to 64 letters, digits, `-` or `_`",
                    self.node.id.escape_default().to_string()
                ),
            );
        }
        Ok(())
    }

    /// `[runner]`: a drain timeout and a thread count in range.
    fn validate_runner(&self) -> Result<(), ConfigError> {
        range(
            "runner.drain_timeout",
            self.runner.drain_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range("runner.worker_threads", self.runner.worker_threads, 0, 1024)
    }

    /// `[streams]`: the duplicate window, ages no shorter than it (nor than an hour), byte
    /// caps of at least 1MiB (or none), a replica count JetStream accepts.
    fn validate_streams(&self) -> Result<(), ConfigError> {
        let streams = &self.streams;
        range(
            "streams.duplicate_window",
            streams.duplicate_window,
            HumanDuration::secs(1),
            HumanDuration::secs(7 * 24 * 3600),
        )?;
        let year = HumanDuration::secs(366 * 24 * 3600);
        let floor = HumanDuration::secs(3600).max(streams.duplicate_window);
        range("streams.max_age", streams.max_age, floor, year)?;
        range(
            "streams.dead_letter_max_age",
            streams.dead_letter_max_age,
            floor,
            year,
        )?;
        for (key, v) in [
            ("streams.max_bytes", streams.max_bytes),
            (
                "streams.dead_letter_max_bytes",
                streams.dead_letter_max_bytes,
            ),
        ] {
            if v.get() != 0 && v.get() < 1024 * 1024 {
                return invalid(key, format!("{v} is below the least allowed, 1MiB (or 0)"));
            }
        }
        if !(1..=5).contains(&streams.replicas) {
            return invalid(
                "streams.replicas",
                format!("{} is out of range; allowed 1 to 5", streams.replicas),
            );
        }
        Ok(())
    }

    /// Every name that becomes a JetStream stream, consumer or bucket name, whichever
    /// section gives it.
    fn validate_jetstream_names(&self) -> Result<(), ConfigError> {
        for (key, name) in [
            ("streams.aggregate_events", &self.streams.aggregate_events),
            ("streams.workflow_commands", &self.streams.workflow_commands),
            ("streams.workflow_events", &self.streams.workflow_events),
            ("streams.saga_inbox", &self.streams.saga_inbox),
            ("streams.dead_letter", &self.streams.dead_letter),
            ("consumers.saga", &self.consumers.saga),
            ("consumers.effect", &self.consumers.effect),
            ("effect.claims_bucket", &self.effect.claims_bucket),
            ("saga.control_bucket", &self.saga.control_bucket),
        ] {
            if !is_js_name(name) {
                return invalid(
                    key,
                    format!(
                        "{name:?} is not a valid JetStream name (no dots, wildcards, slashes or spaces)"
                    ),
                );
            }
        }
        Ok(())
    }

    /// `[storage]`: a size of at least 16MiB, a growth step within it, a page size the
    /// store supports, a data directory.
    fn validate_storage(&self) -> Result<(), ConfigError> {
        let storage = &self.storage;
        if storage.max_size < ByteSize::mib(16) {
            return invalid(
                "storage.max_size",
                format!("{} is too small; at least 16MiB", storage.max_size),
            );
        }
        if storage.growth_step < ByteSize::mib(1) || storage.growth_step > storage.max_size {
            return invalid(
                "storage.growth_step",
                format!(
                    "{} is out of range; allowed 1MiB to storage.max_size",
                    storage.growth_step
                ),
            );
        }
        let page = storage.page_size;
        if !page.get().is_power_of_two() || page < ByteSize::kib(4) || page > ByteSize::kib(64) {
            return invalid(
                "storage.page_size",
                format!(
                    "{} is not a power of two from 4KiB to 64KiB",
                    storage.page_size
                ),
            );
        }
        if storage.data_dir.as_os_str().is_empty() {
            return invalid("storage.data_dir", "must not be empty".into());
        }
        Ok(())
    }

    /// `[saga]`: retentions, batch and message sizes, outbox depth, poll intervals and the
    /// clock skew tolerated.
    fn validate_saga(&self) -> Result<(), ConfigError> {
        let saga = &self.saga;
        let year = HumanDuration::secs(366 * 24 * 3600);
        for (key, v) in [
            ("saga.dead_letter_retention", saga.dead_letter_retention),
            ("saga.finished_retention", saga.finished_retention),
        ] {
            range(key, v, HumanDuration::secs(60), year)?;
        }
        range("saga.batch_size", saga.batch_size, 1, 10_000)?;
        range("saga.relay_window", saga.relay_window, 1, 10_000)?;
        range(
            "saga.max_message_bytes",
            saga.max_message_bytes,
            ByteSize(1024),
            ByteSize::mib(64),
        )?;
        range(
            "saga.max_batch_bytes",
            saga.max_batch_bytes,
            ByteSize(64 * 1024),
            ByteSize::gib(1),
        )?;
        range(
            "saga.max_pull_bytes",
            saga.max_pull_bytes,
            ByteSize::mib(1),
            ByteSize::gib(1),
        )?;
        if saga.max_outbox_depth == 0 {
            return invalid("saga.max_outbox_depth", "must be at least 1".into());
        }
        range(
            "saga.relay_poll",
            saga.relay_poll,
            HumanDuration::millis(10),
            HumanDuration::secs(60),
        )?;
        range(
            "saga.max_clock_skew",
            saga.max_clock_skew,
            HumanDuration::secs(0),
            HumanDuration::secs(30 * 24 * 3600),
        )?;
        range(
            "saga.timer_poll",
            saga.timer_poll,
            HumanDuration::millis(10),
            HumanDuration::secs(60),
        )
    }

    /// `[effect]`: concurrency and in-flight budgets, delivery and lease timing, claim
    /// retention, the default call timeout.
    fn validate_effect(&self) -> Result<(), ConfigError> {
        let effect = &self.effect;
        range("effect.concurrency", effect.concurrency, 1, 10_000)?;
        range("effect.read_ahead", effect.read_ahead, 0, 100_000)?;
        range(
            "effect.max_inflight_bytes",
            effect.max_inflight_bytes,
            ByteSize::mib(1),
            ByteSize::gib(16),
        )?;
        range(
            "effect.max_ack_pending",
            effect.max_ack_pending,
            1,
            1_000_000,
        )?;
        range("effect.max_deliver", effect.max_deliver, 2, 10_000)?;
        range(
            "effect.ack_wait",
            effect.ack_wait,
            HumanDuration::secs(1),
            HumanDuration::secs(3600),
        )?;
        range(
            "effect.lease_ttl",
            effect.lease_ttl,
            HumanDuration::millis(300),
            HumanDuration::secs(600),
        )?;
        range(
            "effect.claim_retention",
            effect.claim_retention,
            HumanDuration::secs(60),
            HumanDuration::secs(365 * 24 * 3600),
        )?;
        range(
            "effect.default_timeout",
            effect.default_timeout,
            HumanDuration::millis(10),
            HumanDuration::secs(3600),
        )
    }

    /// `[partitions]`: a partition count, snapshot cadence and keep, a lease TTL.
    fn validate_partitions(&self) -> Result<(), ConfigError> {
        let partitions = &self.partitions;
        if !(1..=1024).contains(&partitions.count) {
            return invalid(
                "partitions.count",
                format!("must be 1 to 1024, got {}", partitions.count),
            );
        }
        range(
            "partitions.snapshot_interval",
            partitions.snapshot_interval,
            HumanDuration::secs(1),
            HumanDuration::secs(24 * 3600),
        )?;
        if !(1..=100).contains(&partitions.snapshot_keep) {
            return invalid(
                "partitions.snapshot_keep",
                format!("must be 1 to 100, got {}", partitions.snapshot_keep),
            );
        }
        range(
            "partitions.lease_ttl",
            partitions.lease_ttl,
            HumanDuration::secs(1),
            HumanDuration::secs(300),
        )
    }

    /// `[security]`: the deployment key given one way, and long enough when inline (a key
    /// file is read, and its keys checked, at start-up: `seal.rs`).
    fn validate_security(&self) -> Result<(), ConfigError> {
        let sec = &self.security;
        if sec.deployment_key.is_some() && sec.deployment_key_file.is_some() {
            return invalid(
                "security.deployment_key",
                "set either `deployment_key` or `deployment_key_file`, not both".into(),
            );
        }
        if let Some(k) = &sec.deployment_key
            && k.trim().len() < super::MIN_DEPLOYMENT_KEY_BYTES
        {
            return invalid(
                "security.deployment_key",
                format!("is shorter than {} bytes", super::MIN_DEPLOYMENT_KEY_BYTES),
            );
        }
        Ok(())
    }

    /// `[admin]`: a token long enough and given one way, required when the address is
    /// reachable from other hosts; connection limits and timeouts.
    fn validate_admin(&self) -> Result<(), ConfigError> {
        let admin = &self.admin;
        if let Some(t) = &admin.token
            && t.len() < 16
        {
            return invalid("admin.token", "is shorter than 16 characters".into());
        }
        if admin.token.is_some() && admin.token_file.is_some() {
            return invalid(
                "admin.token",
                "set either `token` or `token_file`, not both".into(),
            );
        }
        if !admin.addr.ip().is_loopback() && admin.token.is_none() && admin.token_file.is_none() {
            return invalid(
                "admin.addr",
                format!(
                    "{} is reachable from other hosts, so `admin.token` (or `admin.token_file`) \
                     is required: without one anyone who reaches it could drain or reload this node",
                    admin.addr
                ),
            );
        }
        if admin.tls_cert_file.is_some() != admin.tls_key_file.is_some() {
            return invalid(
                "admin.tls_cert_file",
                "set both `tls_cert_file` and `tls_key_file`, or neither".into(),
            );
        }
        range("admin.max_connections", admin.max_connections, 1, 10_000)?;
        range(
            "admin.idle_timeout",
            admin.idle_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range(
            "admin.connection_timeout",
            admin.connection_timeout,
            HumanDuration::secs(1),
            HumanDuration::secs(86_400),
        )
    }

    /// `[consumers]`: the stall check interval, and a reopen timeout no longer than one NATS
    /// request may take.
    fn validate_consumers(&self) -> Result<(), ConfigError> {
        range(
            "consumers.stall_check",
            self.consumers.stall_check,
            HumanDuration::millis(500),
            HumanDuration::secs(60),
        )?;
        range(
            "consumers.reopen_timeout",
            self.consumers.reopen_timeout,
            HumanDuration::millis(100),
            self.nats.request_timeout,
        )
    }

    /// `[tracing]`: an http(s) endpoint without credentials, a ratio, sane intervals.
    fn validate_tracing(&self) -> Result<(), ConfigError> {
        let t = &self.tracing;
        if let Some(url) = &t.otlp_endpoint {
            let rest = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"));
            match rest {
                None => {
                    return invalid(
                        "tracing.otlp_endpoint",
                        format!(
                            "{:?} is not an http:// or https:// URL (OTLP/HTTP, usually port 4318)",
                            crate::config::redact_url(url)
                        ),
                    );
                }
                Some(r) if r.is_empty() || r.starts_with('/') => {
                    return invalid("tracing.otlp_endpoint", format!("{url:?} names no host"));
                }
                Some(r) if r.split('/').next().is_some_and(|host| host.contains('@')) => {
                    return invalid(
                        "tracing.otlp_endpoint",
                        format!(
                            "{:?} carries credentials, which would be logged",
                            crate::config::redact_url(url)
                        ),
                    );
                }
                Some(_) => {}
            }
        }
        if t.service_name.trim().is_empty() {
            return invalid("tracing.service_name", "must not be empty".into());
        }
        if !(0.0..=1.0).contains(&t.sample_ratio) {
            return invalid(
                "tracing.sample_ratio",
                format!("{} is out of range; allowed 0.0 to 1.0", t.sample_ratio),
            );
        }
        range(
            "tracing.export_interval",
            t.export_interval,
            HumanDuration::millis(50),
            HumanDuration::secs(300),
        )?;
        range(
            "tracing.export_timeout",
            t.export_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(300),
        )
    }
}

/// A node id names this replica in lease values, heartbeat keys (`m.<node>`), claim owners
/// and logs: letters, digits, `-` and `_`, 1 to 64 of them.
pub(crate) fn valid_node_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests;
