//! What every command handler of one effect worker shares.
//!
//! Owns [`Ctx`]: the claims store under this process's owner name, the HTTP client, the
//! circuit breakers, the compiled providers and the drain token; and the names of the claim events ([`event`]) it counts.
//!
//! Guarantee: a provider is compiled once per catalog generation — the cache keeps the
//! declaration it was compiled from, so a command that starts after a manifest reload runs
//! with the new settings. A command already executing keeps the settings it started with
//! for all its attempts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::kv;
use tokio_util::sync::CancellationToken;

use super::breaker::Breakers;
use super::claim::Claims;
use super::provider::Provider;
use crate::manifest::catalog::Effect;
use crate::runtime::AppState;

/// Claim events (a metric label and a log message each).
pub mod event {
    /// A first executor took a command.
    pub const ACQUIRED: &str = "acquired";
    /// A live executor holds it; nak'ed with a delay.
    pub const BUSY: &str = "busy";
    /// Taken over after the lease expired.
    pub const STEAL: &str = "steal";
    /// Lease extended.
    pub const RENEWED: &str = "renewed";
    /// A renewal was refused or the lease ran out: execution abandoned.
    pub const RENEW_FAILED: &str = "renew_failed";
    /// Outcome recorded and published.
    pub const COMPLETED: &str = "completed";
    /// Recording the outcome was refused (fenced out) or failed.
    pub const FAILED: &str = "failed";
    /// A finished command came again: its stored result was republished.
    pub const REPLAYED: &str = "replayed";

    /// Every event, so their metric series exist (at 0) from the start.
    pub const ALL: [&str; 8] = [
        ACQUIRED,
        BUSY,
        STEAL,
        RENEWED,
        RENEW_FAILED,
        COMPLETED,
        FAILED,
        REPLAYED,
    ];
}

/// Outcomes of `runner_effect_commands_total` (commands turned away before any claim).
pub mod outcome {
    /// Undecodable or not allowed: dead-lettered and terminated.
    pub const REFUSED: &str = "refused";
}

/// Everything a command handler shares.
pub(super) struct Ctx {
    pub(super) state: Arc<AppState>,
    pub(super) claims: Claims,
    pub(super) http: reqwest::Client,
    pub(super) breakers: Breakers,
    providers: Mutex<HashMap<String, CachedProvider>>,
    /// Cancelled when the drain begins.
    pub(super) drain: CancellationToken,
}

/// A compiled provider with the declaration it was compiled from (held, so a reloaded
/// catalog's declaration is never mistaken for it).
type CachedProvider = (Arc<Effect>, Result<Arc<Provider>, String>);

impl Ctx {
    /// The shared context of a new worker: claims are taken under a fresh owner name
    /// (`<node id>/<random>`), so no two workers share one, not even a restart of this one.
    pub(super) fn new(state: Arc<AppState>, kv: kv::Store, drain: CancellationToken) -> Self {
        let owner = format!("{}/{}", state.node_id, uuid::Uuid::new_v4().simple());
        let claims = Claims::new(kv, owner, state.config.effect.lease_ttl.get());
        let http = reqwest::Client::builder()
            .user_agent(concat!("runner/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_default();
        let breakers = Breakers::new(state.metrics.effect_circuit_state.clone());
        Self {
            state,
            claims,
            http,
            breakers,
            providers: Mutex::new(HashMap::new()),
            drain,
        }
    }

    /// Counts a claim event (one of [`event`]).
    pub(super) fn claim_event(&self, ev: &'static str) {
        self.state
            .metrics
            .effect_claims
            .with_label_values(&[ev])
            .inc();
    }

    /// The compiled provider of an effect, cached per catalog generation.
    pub(super) fn provider(&self, effect: &Arc<Effect>) -> Result<Arc<Provider>, String> {
        let mut g = match self.providers.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some((decl, p)) = g.get(&effect.name)
            && Arc::ptr_eq(decl, effect)
        {
            return p.clone();
        }
        let p = Provider::compile(effect)
            .map(Arc::new)
            .map_err(|e| e.to_string());
        g.insert(effect.name.clone(), (effect.clone(), p.clone()));
        p
    }

    /// The effect's name as a metric label: `undeclared` for a name the loaded catalog does
    /// not declare, so a stray command cannot add a series.
    pub(super) fn effect_label(&self, name: &str) -> String {
        if self.state.catalog().effect(name).is_some() {
            name.to_string()
        } else {
            "undeclared".to_string()
        }
    }
}
