//! Per-tenant limits in force, and the allowances they give.
//!
//! **Guarantees.**
//! - **One view of the limits, swapped whole.** [`Limits`] holds the node's `[tenancy]`
//!   limits (weights, rate limits, effect rate limits, caps on running instances: those are
//!   stamped on each input routed, `worker/cap.rs`). A reload
//!   (`POST /admin/tenants/reload`, `runner tenants reload`, [`crate::runtime::AppState::reload_tenancy`])
//!   replaces them at once: a reader sees the old set or the new one, never a mix. An
//!   invalid file changes nothing. `tenancy.default_tenant`, `tenancy.allowed` and
//!   `tenancy.read_ahead` are read at start only; a reload that changes them says so.
//! - **Rates as token buckets** ([`Buckets`]): a key limited to `r` per second gets `r`
//!   tokens a second, at most one second's worth saved up (at least one token), so a
//!   limit of 2/s lets two in at once and then one every half second. Whole tokens are
//!   reserved before use and what was not used is refunded, so several readers sharing
//!   one bucket never spend the same allowance twice.
//! - **Nothing here drops work.** A key without tokens is told how long until its next
//!   one ([`Buckets::wait`]); the caller keeps the work waiting, in order.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use crate::config::TenancyConfig;

/// The `[tenancy]` limits in force on this node; swapped whole on reload.
#[derive(Debug)]
pub struct Limits {
    now: RwLock<Arc<TenancyConfig>>,
}

impl Limits {
    /// The limits of `tenancy`.
    pub fn new(tenancy: TenancyConfig) -> Self {
        Self {
            now: RwLock::new(Arc::new(tenancy)),
        }
    }

    /// The limits in force.
    pub fn get(&self) -> Arc<TenancyConfig> {
        self.now
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `next` in force; returns the keys it changed (`tenancy.rate_limits.a`, …) and
    /// those that change only at the next start (kept as they were).
    pub fn replace(&self, mut next: TenancyConfig) -> Changed {
        let mut guard = self.now.write().unwrap_or_else(PoisonError::into_inner);
        let old = guard.as_ref();
        let mut restart = Vec::new();
        if next.default_tenant != old.default_tenant {
            restart.push("tenancy.default_tenant".to_string());
            next.default_tenant.clone_from(&old.default_tenant);
        }
        if next.allowed != old.allowed {
            restart.push("tenancy.allowed".to_string());
            next.allowed.clone_from(&old.allowed);
        }
        if next.read_ahead != old.read_ahead {
            restart.push("tenancy.read_ahead".to_string());
            next.read_ahead = old.read_ahead;
        }
        let mut applied = Vec::new();
        diff("tenancy.weights", &old.weights, &next.weights, &mut applied);
        diff(
            "tenancy.rate_limits",
            &old.rate_limits,
            &next.rate_limits,
            &mut applied,
        );
        diff(
            "tenancy.live_instance_caps",
            &old.live_instance_caps,
            &next.live_instance_caps,
            &mut applied,
        );
        diff(
            "tenancy.pending_timer_caps",
            &old.pending_timer_caps,
            &next.pending_timer_caps,
            &mut applied,
        );
        diff(
            "tenancy.outbox_byte_caps",
            &old.outbox_byte_caps,
            &next.outbox_byte_caps,
            &mut applied,
        );
        let tenants: std::collections::BTreeSet<&String> = old
            .effect_rate_limits
            .keys()
            .chain(next.effect_rate_limits.keys())
            .collect();
        let none = BTreeMap::new();
        for t in tenants {
            diff(
                &format!("tenancy.effect_rate_limits.{t}"),
                old.effect_rate_limits.get(t).unwrap_or(&none),
                next.effect_rate_limits.get(t).unwrap_or(&none),
                &mut applied,
            );
        }
        *guard = Arc::new(next);
        Changed {
            applied,
            restart,
            warnings: Vec::new(),
        }
    }
}

/// What a reload changed.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Changed {
    /// Keys now in force with new values (or removed).
    pub applied: Vec<String>,
    /// Keys whose new values wait for the next start.
    pub restart: Vec<String>,
    /// What in force looks wrong, though valid ([`unknown_effects`]).
    pub warnings: Vec<String>,
}

/// The effect rate limits of `tenancy` that name an effect not in `effects` (the loaded
/// manifests' effects), one line each: such a limit holds nothing, and is most likely a
/// misspelt name.
pub fn unknown_effects(tenancy: &TenancyConfig, effects: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (tenant, limits) in &tenancy.effect_rate_limits {
        for effect in limits.keys() {
            if !effects.contains(effect) {
                out.push(format!(
                    "tenancy.effect_rate_limits.{tenant}.{effect}: no loaded manifest declares \
                     the effect {effect:?}, so this limit holds nothing"
                ));
            }
        }
    }
    out
}

/// Appends to `out` each key of `old` or `new` under `prefix` whose value differs.
fn diff<V: PartialEq>(
    prefix: &str,
    old: &BTreeMap<String, V>,
    new: &BTreeMap<String, V>,
    out: &mut Vec<String>,
) {
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for k in keys {
        if old.get(k) != new.get(k) {
            out.push(format!("{prefix}.{k}"));
        }
    }
}

/// Token buckets by key (a tenant, or a tenant and an effect).
#[derive(Debug, Default)]
pub struct Buckets {
    /// Per key: tokens now, when that was computed.
    tokens: Mutex<HashMap<String, (f64, Instant)>>,
}

impl Buckets {
    /// Reserves every whole token `key` has under a rate of `per_s` (a second's worth
    /// saved up at most, at least one) and returns how many; give back what is not used
    /// ([`Buckets::refund`]).
    pub fn reserve(&self, key: &str, per_s: f64) -> usize {
        let mut all = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        let burst = per_s.max(1.0);
        let now = Instant::now();
        let (tokens, at) = all.entry(key.to_string()).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * per_s).min(burst);
        *at = now;
        let whole = tokens.max(0.0).floor();
        *tokens -= whole;
        whole as usize
    }

    /// Gives back `n` of what [`Buckets::reserve`] gave `key` and was not used.
    pub fn refund(&self, key: &str, n: usize) {
        if n == 0 {
            return;
        }
        let mut all = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((tokens, _)) = all.get_mut(key) {
            *tokens += n as f64;
        }
    }

    /// How long until `key`, limited to `per_s`, has a whole token (zero when it has one).
    pub fn wait(&self, key: &str, per_s: f64) -> Duration {
        let all = self.tokens.lock().unwrap_or_else(PoisonError::into_inner);
        let Some((tokens, at)) = all.get(key) else {
            return Duration::ZERO;
        };
        let now = (*tokens + at.elapsed().as_secs_f64() * per_s).min(per_s.max(1.0));
        if now >= 1.0 || per_s <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((1.0 - now) / per_s)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_burst_then_its_rate_and_takes_refunds() {
        let b = Buckets::default();
        assert_eq!(b.reserve("a", 2.0), 2, "a second's worth at first");
        assert_eq!(b.reserve("a", 2.0), 0);
        assert!(b.wait("a", 2.0) > Duration::ZERO);
        assert!(b.wait("a", 2.0) <= Duration::from_millis(500));
        b.refund("a", 1);
        assert_eq!(b.wait("a", 2.0), Duration::ZERO);
        assert_eq!(b.reserve("a", 2.0), 1, "the refund is spent again");
        // A slow rate still lets one in at first.
        assert_eq!(b.reserve("slow", 0.1), 1);
        assert_eq!(b.reserve("slow", 0.1), 0);
        assert_eq!(
            b.wait("other", 1.0),
            Duration::ZERO,
            "an unseen key waits not"
        );
    }

    #[test]
    fn a_reload_names_what_changed_and_keeps_what_needs_a_restart() {
        let mut t = TenancyConfig::default();
        t.rate_limits.insert("a".into(), 2.0);
        let limits = Limits::new(t.clone());
        let mut next = t.clone();
        next.rate_limits.insert("a".into(), 5.0);
        next.weights.insert("b".into(), 3);
        next.effect_rate_limits
            .entry("a".into())
            .or_default()
            .insert("ping".into(), 1.5);
        next.read_ahead = 7;
        let changed = limits.replace(next);
        assert_eq!(
            changed.applied,
            vec![
                "tenancy.weights.b",
                "tenancy.rate_limits.a",
                "tenancy.effect_rate_limits.a.ping"
            ]
        );
        assert_eq!(changed.restart, vec!["tenancy.read_ahead"]);
        let now = limits.get();
        assert_eq!(now.rate_limits["a"], 5.0);
        assert_eq!(now.read_ahead, t.read_ahead, "kept until the next start");
        assert_eq!(limits.replace((*now).clone()), Changed::default());
        let unknown = unknown_effects(&now, &["pong".to_string()]);
        assert_eq!(unknown.len(), 1);
        assert!(unknown[0].starts_with("tenancy.effect_rate_limits.a.ping:"));
        assert!(unknown_effects(&now, &["ping".to_string()]).is_empty());
    }
}
