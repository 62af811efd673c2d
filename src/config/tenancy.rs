//! `[tenancy]`: which tenants are served, and the limits that share the node between them
//! (fair turns, rate limits, caps on running instances, pending timers and outbox bytes). Guarantee: a loaded config's tenants and effect names are
//! subject tokens and its weights and rates are in range, each refusal naming its key
//! (`tenancy.rate_limits.acme`). The limits in force, and their reload, are `crate::quota`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::validate::{invalid, per_second, range};

/// `[tenancy]`: tenant handling.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TenancyConfig {
    /// Tenant token used by single-tenant deployments.
    pub default_tenant: String,
    /// When non-empty, only these tenants are served; others are dead-lettered
    /// (a list, or one comma-separated string).
    #[serde(deserialize_with = "super::types::string_or_list")]
    pub allowed: Vec<String>,
    /// Fair service: when several tenants' new inputs wait to enter the saga inbox, each
    /// takes turns of its weight in inputs (1 to 1000; a tenant not listed weighs 1).
    pub weights: BTreeMap<String, u32>,
    /// Per tenant, the most new inputs per second this node lets into the saga inbox (its
    /// routers of the aggregate stream; effect results and timers are never limited).
    /// Above it, the tenant's inputs wait in order, in the stream, and go in later; none is
    /// dropped. Each replica applies it to what it routes.
    pub rate_limits: BTreeMap<String, f64>,
    /// Per tenant, per effect, the most calls per second this node's effect worker starts
    /// (`[tenancy.effect_rate_limits.<tenant>]` with `<effect> = <calls/s>`). Above it, the
    /// tenant's commands of that effect wait in order, and other tenants' go first; none is
    /// dropped or failed. Each replica applies it to the calls it starts.
    pub effect_rate_limits: BTreeMap<String, BTreeMap<String, f64>>,
    /// Per tenant, the most saga instances it may have running (1 to 1e12). Each of the
    /// `partitions.count` partitions lets the tenant start instances while it runs fewer
    /// than its part, ⌈cap ÷ partitions⌉ (at least one), so the deployment runs at most
    /// partitions × that. An input that would start one more is held whole, with every later input of its
    /// key, and applied in order when one of the tenant's instances in that partition ends;
    /// none is dropped.
    pub live_instance_caps: BTreeMap<String, u64>,
    /// Per tenant, the most pending timers at which it may still start new saga instances
    /// (1 to 1e12), counted per partition like `live_instance_caps` (⌈cap ÷ partitions⌉
    /// each). While a partition holds the tenant's part of the cap in pending timers, an
    /// input that would start an instance there is held whole, with every later input of
    /// its key, and applied in order once one of those timers fires or is cancelled (or an
    /// instance ends). Running instances are never held for their own timers (holding them
    /// could stop the very timers that free room), so they may set timers past the cap.
    pub pending_timer_caps: BTreeMap<String, u64>,
    /// Per tenant, the most bytes of its saga outputs that may wait in the outboxes, not
    /// yet published to the broker (`"64MiB"`; 1 KiB to 1 PiB), over the whole deployment
    /// (what this node's relays count plus what the other saga nodes' heartbeats last
    /// said). At it, the routers let none of the tenant's new inputs into the saga inbox:
    /// they wait in order, as above a rate limit, until the relays have published enough.
    /// A soft bound: effect results and timers are never held, so its running sagas go on,
    /// and what they emit, what was in the inbox already and every input let in before its
    /// outputs were committed (as far as the partitions lag the routers) may pass it.
    pub outbox_byte_caps: BTreeMap<String, super::types::ByteSize>,
    /// How many inputs a router of the aggregate stream reads ahead of what it may copy yet
    /// (per share of the source, within `saga.max_pull_bytes`): the window in which a
    /// tenant's inputs pass another tenant's backlog.
    pub read_ahead: usize,
}

impl Default for TenancyConfig {
    fn default() -> Self {
        Self {
            default_tenant: "_".into(),
            allowed: Vec::new(),
            weights: BTreeMap::new(),
            rate_limits: BTreeMap::new(),
            effect_rate_limits: BTreeMap::new(),
            live_instance_caps: BTreeMap::new(),
            pending_timer_caps: BTreeMap::new(),
            outbox_byte_caps: BTreeMap::new(),
            read_ahead: 100_000,
        }
    }
}

impl TenancyConfig {
    /// `[tenancy]`: the default tenant and every tenant named are subject tokens; weights
    /// within 1 to 1000; rates above 0 to 1e9 a second; a read-ahead of at least one input.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        use crate::subject::{Rule, check};
        if let Err(e) = check(&self.default_tenant, Rule::TENANT) {
            return invalid(
                "tenancy.default_tenant",
                format!("is not a subject token: {e}"),
            );
        }
        for (i, t) in self.allowed.iter().enumerate() {
            if let Err(e) = check(t, Rule::TENANT) {
                return invalid(
                    "tenancy.allowed",
                    format!("entry {i} is not a subject token: {e}"),
                );
            }
        }
        for (t, w) in &self.weights {
            if let Err(e) = check(t, Rule::TENANT) {
                return invalid(
                    &format!("tenancy.weights.{t}"),
                    format!("is not a subject token: {e}"),
                );
            }
            range(&format!("tenancy.weights.{t}"), *w, 1, 1000)?;
        }
        for (t, r) in &self.rate_limits {
            if let Err(e) = check(t, Rule::TENANT) {
                return invalid(
                    &format!("tenancy.rate_limits.{t}"),
                    format!("is not a subject token: {e}"),
                );
            }
            per_second(&format!("tenancy.rate_limits.{t}"), *r, "inputs")?;
        }
        for (t, effects) in &self.effect_rate_limits {
            if let Err(e) = check(t, Rule::TENANT) {
                return invalid(
                    &format!("tenancy.effect_rate_limits.{t}"),
                    format!("is not a subject token: {e}"),
                );
            }
            for (effect, r) in effects {
                let key = format!("tenancy.effect_rate_limits.{t}.{effect}");
                if let Err(e) = check(effect, Rule::NAME) {
                    return invalid(&key, format!("is not an effect name: {e}"));
                }
                per_second(&key, *r, "calls")?;
            }
        }
        for (name, caps) in [
            ("live_instance_caps", &self.live_instance_caps),
            ("pending_timer_caps", &self.pending_timer_caps),
        ] {
            for (t, cap) in caps {
                let key = format!("tenancy.{name}.{t}");
                if let Err(e) = check(t, Rule::TENANT) {
                    return invalid(&key, format!("is not a subject token: {e}"));
                }
                range(&key, *cap, 1, 1_000_000_000_000)?;
            }
        }
        for (t, cap) in &self.outbox_byte_caps {
            let key = format!("tenancy.outbox_byte_caps.{t}");
            if let Err(e) = check(t, Rule::TENANT) {
                return invalid(&key, format!("is not a subject token: {e}"));
            }
            range(&key, cap.get(), 1 << 10, 1 << 50)?;
        }
        range("tenancy.read_ahead", self.read_ahead, 1, 10_000_000)?;
        Ok(())
    }
}
