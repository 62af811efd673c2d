//! Validation: [`Config::validate`], the one pass that checks every value once all layers
//! are applied.
//!
//! Guarantee: a config that passes is usable as written. Every value is within its allowed
//! range, names that become JetStream names or subject tokens are valid as such, settings
//! that only make sense together are set together; the first problem found is a
//! [`ConfigError::Invalid`] naming the key, never a silent clamp.

use super::Config;
use super::error::ConfigError;
use super::types::{ByteSize, HumanDuration};

/// A NATS subject token: non-empty, no dots, wildcards, whitespace or control characters,
/// at most [`crate::subject::MAX_SUBJECT_BYTES`] (the one check, [`crate::subject::check`]).
pub fn is_subject_token(s: &str) -> bool {
    crate::subject::check(s, crate::subject::Rule::NAME).is_ok()
}

/// `v` within `lo..=hi`, else an error naming `key`.
fn range<T: PartialOrd + std::fmt::Display>(
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

/// A JetStream stream or consumer name.
fn is_js_name(s: &str) -> bool {
    is_subject_token(s) && !s.contains(['/', '\\'])
}

impl Config {
    /// Checks every value against its allowed range. Called once after all layers applied.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.to_string(),
                message,
            })
        };
        if self.nats.urls.is_empty() {
            return invalid("nats.urls", "at least one server URL is required".into());
        }
        for url in &self.nats.urls {
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
            ("nats.token", self.nats.token.is_some()),
            (
                "nats.user",
                self.nats.user.is_some() || self.nats.password.is_some(),
            ),
            ("nats.nkey_seed_file", self.nats.nkey_seed_file.is_some()),
            ("nats.creds_file", self.nats.creds_file.is_some()),
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
        if !self.node.id.is_empty() && !valid_node_id(&self.node.id) {
            return invalid(
                "node.id",
                format!(
                    "{:?} is not usable as a node id: use 1 to 64 letters, digits, `-` or `_`",
                    self.node.id.escape_default().to_string()
                ),
            );
        }
        range(
            "nats.connect_timeout",
            self.nats.connect_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range(
            "nats.setup_timeout",
            self.nats.setup_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range(
            "nats.request_timeout",
            self.nats.request_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(300),
        )?;
        range(
            "runner.drain_timeout",
            self.runner.drain_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range(
            "streams.duplicate_window",
            self.streams.duplicate_window,
            HumanDuration::secs(1),
            HumanDuration::secs(7 * 24 * 3600),
        )?;
        let year = HumanDuration::secs(366 * 24 * 3600);
        for (key, v) in [
            (
                "saga.dead_letter_retention",
                self.saga.dead_letter_retention,
            ),
            ("saga.finished_retention", self.saga.finished_retention),
        ] {
            range(key, v, HumanDuration::secs(60), year)?;
        }
        let floor = HumanDuration::secs(3600).max(self.streams.duplicate_window);
        range("streams.max_age", self.streams.max_age, floor, year)?;
        range(
            "streams.dead_letter_max_age",
            self.streams.dead_letter_max_age,
            floor,
            year,
        )?;
        for (key, v) in [
            ("streams.max_bytes", self.streams.max_bytes),
            (
                "streams.dead_letter_max_bytes",
                self.streams.dead_letter_max_bytes,
            ),
        ] {
            if v.get() != 0 && v.get() < 1024 * 1024 {
                return invalid(key, format!("{v} is below the least allowed, 1MiB (or 0)"));
            }
        }
        if self.nats.user.is_some() != self.nats.password.is_some() {
            return invalid(
                "nats.user",
                "`user` and `password` must be set together".into(),
            );
        }
        if self.nats.tls_cert_file.is_some() != self.nats.tls_key_file.is_some() {
            return invalid(
                "nats.tls_cert_file",
                "`tls_cert_file` and `tls_key_file` must be set together".into(),
            );
        }
        if !(1..=5).contains(&self.streams.replicas) {
            return invalid(
                "streams.replicas",
                format!("{} is out of range; allowed 1 to 5", self.streams.replicas),
            );
        }
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
        use crate::subject::{Rule, check};
        if let Err(e) = check(&self.tenancy.default_tenant, Rule::TENANT) {
            return invalid(
                "tenancy.default_tenant",
                format!("is not a subject token: {e}"),
            );
        }
        for (i, t) in self.tenancy.allowed.iter().enumerate() {
            if let Err(e) = check(t, Rule::TENANT) {
                return invalid(
                    "tenancy.allowed",
                    format!("entry {i} is not a subject token: {e}"),
                );
            }
        }
        if self.storage.max_size < ByteSize::mib(16) {
            return invalid(
                "storage.max_size",
                format!("{} is too small; at least 16MiB", self.storage.max_size),
            );
        }
        if self.storage.growth_step < ByteSize::mib(1)
            || self.storage.growth_step > self.storage.max_size
        {
            return invalid(
                "storage.growth_step",
                format!(
                    "{} is out of range; allowed 1MiB to storage.max_size",
                    self.storage.growth_step
                ),
            );
        }
        let page = self.storage.page_size;
        if !page.get().is_power_of_two() || page < ByteSize::kib(4) || page > ByteSize::kib(64) {
            return invalid(
                "storage.page_size",
                format!(
                    "{} is not a power of two from 4KiB to 64KiB",
                    self.storage.page_size
                ),
            );
        }
        if self.storage.data_dir.as_os_str().is_empty() {
            return invalid("storage.data_dir", "must not be empty".into());
        }
        range("saga.batch_size", self.saga.batch_size, 1, 10_000)?;
        range("saga.relay_window", self.saga.relay_window, 1, 10_000)?;
        range(
            "saga.max_message_bytes",
            self.saga.max_message_bytes,
            ByteSize(1024),
            ByteSize::mib(64),
        )?;
        range(
            "saga.max_batch_bytes",
            self.saga.max_batch_bytes,
            ByteSize(64 * 1024),
            ByteSize::gib(1),
        )?;
        range(
            "saga.max_pull_bytes",
            self.saga.max_pull_bytes,
            ByteSize::mib(1),
            ByteSize::gib(1),
        )?;
        if self.saga.max_outbox_depth == 0 {
            return invalid("saga.max_outbox_depth", "must be at least 1".into());
        }
        range(
            "saga.relay_poll",
            self.saga.relay_poll,
            HumanDuration::millis(10),
            HumanDuration::secs(60),
        )?;
        range(
            "saga.max_clock_skew",
            self.saga.max_clock_skew,
            HumanDuration::secs(0),
            HumanDuration::secs(30 * 24 * 3600),
        )?;
        range(
            "saga.timer_poll",
            self.saga.timer_poll,
            HumanDuration::millis(10),
            HumanDuration::secs(60),
        )?;
        range("effect.concurrency", self.effect.concurrency, 1, 10_000)?;
        range(
            "effect.max_inflight_bytes",
            self.effect.max_inflight_bytes,
            ByteSize::mib(1),
            ByteSize::gib(16),
        )?;
        range(
            "effect.max_ack_pending",
            self.effect.max_ack_pending,
            1,
            1_000_000,
        )?;
        range("effect.max_deliver", self.effect.max_deliver, 2, 10_000)?;
        range(
            "effect.ack_wait",
            self.effect.ack_wait,
            HumanDuration::secs(1),
            HumanDuration::secs(3600),
        )?;
        range(
            "effect.lease_ttl",
            self.effect.lease_ttl,
            HumanDuration::millis(300),
            HumanDuration::secs(600),
        )?;
        range(
            "effect.claim_retention",
            self.effect.claim_retention,
            HumanDuration::secs(60),
            HumanDuration::secs(365 * 24 * 3600),
        )?;
        if !(1..=1024).contains(&self.partitions.count) {
            return invalid(
                "partitions.count",
                format!("must be 1 to 1024, got {}", self.partitions.count),
            );
        }
        range(
            "partitions.snapshot_interval",
            self.partitions.snapshot_interval,
            HumanDuration::secs(1),
            HumanDuration::secs(24 * 3600),
        )?;
        if !(1..=100).contains(&self.partitions.snapshot_keep) {
            return invalid(
                "partitions.snapshot_keep",
                format!("must be 1 to 100, got {}", self.partitions.snapshot_keep),
            );
        }
        range(
            "partitions.lease_ttl",
            self.partitions.lease_ttl,
            HumanDuration::secs(1),
            HumanDuration::secs(300),
        )?;
        range(
            "effect.default_timeout",
            self.effect.default_timeout,
            HumanDuration::millis(10),
            HumanDuration::secs(3600),
        )?;
        if let Some(t) = &self.admin.token
            && t.len() < 16
        {
            return invalid("admin.token", "is shorter than 16 characters".into());
        }
        if self.admin.token.is_some() && self.admin.token_file.is_some() {
            return invalid(
                "admin.token",
                "set either `token` or `token_file`, not both".into(),
            );
        }
        if !self.admin.addr.ip().is_loopback()
            && self.admin.token.is_none()
            && self.admin.token_file.is_none()
        {
            return invalid(
                "admin.addr",
                format!(
                    "{} is reachable from other hosts, so `admin.token` (or `admin.token_file`) \
                     is required: without one anyone who reaches it could drain or reload this node",
                    self.admin.addr
                ),
            );
        }
        range(
            "admin.max_connections",
            self.admin.max_connections,
            1,
            10_000,
        )?;
        range(
            "admin.idle_timeout",
            self.admin.idle_timeout,
            HumanDuration::millis(100),
            HumanDuration::secs(3600),
        )?;
        range(
            "admin.connection_timeout",
            self.admin.connection_timeout,
            HumanDuration::secs(1),
            HumanDuration::secs(86_400),
        )?;
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
        )?;
        self.validate_tracing()
    }

    /// `[tracing]`: an http(s) endpoint without credentials, a ratio, sane intervals.
    fn validate_tracing(&self) -> Result<(), ConfigError> {
        let t = &self.tracing;
        let invalid = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.to_string(),
                message,
            })
        };
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
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().expect("defaults validate");
    }

    #[test]
    fn out_of_range_names_the_key() {
        let mut c = Config::default();
        c.streams.replicas = 7;
        match c.validate() {
            Err(ConfigError::Invalid { key, .. }) => assert_eq!(key, "streams.replicas"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn an_effect_byte_budget_out_of_range_names_the_key_and_the_range() {
        for bytes in [ByteSize(512 * 1024), ByteSize::gib(17)] {
            let mut c = Config::default();
            c.effect.max_inflight_bytes = bytes;
            match c.validate() {
                Err(ConfigError::Invalid { key, message }) => {
                    assert_eq!(key, "effect.max_inflight_bytes");
                    assert!(message.contains("1MiB to 16GiB"), "{message}");
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn a_page_size_not_a_power_of_two_from_4kib_to_64kib_names_the_key() {
        for bytes in [ByteSize(2048), ByteSize(12 * 1024), ByteSize::kib(128)] {
            let mut c = Config::default();
            c.storage.page_size = bytes;
            match c.validate() {
                Err(ConfigError::Invalid { key, message }) => {
                    assert_eq!(key, "storage.page_size");
                    assert!(message.contains(&bytes.to_string()), "{message}");
                    assert!(message.contains("4KiB to 64KiB"), "{message}");
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        for kib in [4, 8, 16, 32, 64] {
            let mut c = Config::default();
            c.storage.page_size = ByteSize::kib(kib);
            c.validate().expect("a power of two in range");
        }
    }
}
