//! Which durable consumers carry effect commands, and which commands each one covers.
//!
//! Owns the consumer names, their filters and configs, how each is opened (created, or
//! updated in place keeping its start position), and `Coverage`: from which stream
//! sequence this process has a consumer of its own for each effect name.
//!
//! - **One consumer per effect**: `<consumers.effect>-<effect>`, filter
//!   `tenant.*.effect.<effect>.*`, explicit acks, `effect.ack_wait`, `effect.max_ack_pending`
//!   of its own. Every replica opens the same durable name, so the replicas share it (the
//!   deliver group) and JetStream hands each command to one of them.
//! - **The catch-all**: `<consumers.effect>` itself, filter `tenant.*.effect.>`, headers
//!   only. It sees every command and acks at once the ones an effect consumer of this
//!   process covers; the others (an effect no loaded manifest declares, a name that cannot
//!   be a consumer name, a command older than its effect's consumer) it handles itself, so
//!   every command gets an answer. Its config is the one the single shared consumer of
//!   earlier versions had, except `headers_only` (which JetStream lets an update change),
//!   so that consumer turns into the catch-all in place, keeping its position.
//!
//! Where a new effect consumer starts: right after the catch-all's ack floor (from the
//! start of the stream when there is no catch-all yet). Every command at or below that
//! floor has been either acked by the catch-all as covered by an effect consumer — which
//! cannot be a consumer that does not exist yet — or answered by it. So adding an effect
//! (a reload, or an upgrade from the single shared consumer) neither replays its history
//! nor leaves a command without an owner. An existing consumer keeps its start position
//! (JetStream refuses to change it); only its editable settings follow the config.
//!
//! Guarantee: a command is covered by at least one consumer that answers it. When two do
//! (the catch-all of a replica that does not declare an effect, and that effect's
//! consumer on one that does), the command's claim decides: one executor, one result.

use std::collections::HashMap;
use std::sync::Mutex;

use async_nats::jetstream::{
    self,
    consumer::{self, DeliverPolicy, pull},
    context::ConsumerInfoErrorKind,
    stream::Stream,
};
use futures::TryStreamExt;

use crate::config::Config;

/// Subject filter of the catch-all consumer: every effect command.
pub const COMMAND_FILTER: &str = "tenant.*.effect.>";

/// Subject filter of one effect's consumer (`tenant.<t>.effect.<effect>.<command_id>`).
pub fn effect_filter(effect: &str) -> String {
    format!("tenant.*.effect.{effect}.*")
}

/// Durable name of one effect's consumer: `<base>-<effect>`, `base` being
/// `consumers.effect` (which itself names the catch-all).
pub fn consumer_name(base: &str, effect: &str) -> String {
    format!("{base}-{effect}")
}

/// Whether `effect` can have a consumer of its own: its durable name must be a valid
/// JetStream name of at most 255 bytes, and the name a single subject token.
pub fn has_own_consumer(base: &str, effect: &str) -> bool {
    let name = consumer_name(base, effect);
    !effect.is_empty()
        && name.len() <= 255
        && !name
            .chars()
            .any(|c| matches!(c, '.' | '*' | '>' | '/' | '\\') || c.is_whitespace())
}

/// One of the consumers an effect worker pulls from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Which {
    /// The consumer of one effect name.
    Effect(String),
    /// The catch-all.
    CatchAll,
}

impl Which {
    /// Its durable name.
    pub(super) fn name(&self, base: &str) -> String {
        match self {
            Which::Effect(e) => consumer_name(base, e),
            Which::CatchAll => base.to_string(),
        }
    }
}

/// From which stream sequence this process has a consumer of its own for each effect name.
/// The catch-all acks a command as covered only when its sequence is at or past that start.
#[derive(Debug, Default)]
pub(super) struct Coverage(Mutex<HashMap<String, u64>>);

impl Coverage {
    fn set(&self, effect: &str, from_seq: u64) {
        let mut g = match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.insert(effect.to_string(), from_seq);
    }

    /// Whether the command at `stream_seq` on `subject` is covered by an effect consumer of
    /// this process.
    pub(super) fn covers(&self, subject: &str, stream_seq: u64) -> bool {
        let Some(effect) = subject.split('.').nth(3) else {
            return false;
        };
        let g = match self.0.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.get(effect).is_some_and(|from| *from <= stream_seq)
    }
}

/// An opened consumer, with the stream it reads (for fetching a body by sequence).
pub(super) struct Opened {
    /// The command stream.
    pub(super) stream: Stream,
    /// The consumer.
    pub(super) consumer: consumer::PullConsumer,
}

/// The info of consumer `name` on `stream`, or None when it does not exist.
async fn existing(
    stream: &Stream,
    name: &str,
) -> Result<Option<consumer::Info>, async_nats::Error> {
    match stream.consumer_info(name).await {
        Ok(info) => Ok(Some(info)),
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Opens (creates or updates) a consumer and, for an effect consumer, records what it
/// covers in `coverage`.
pub(super) async fn open(
    config: &Config,
    js: &jetstream::Context,
    coverage: &Coverage,
    which: &Which,
) -> Result<Opened, async_nats::Error> {
    let base = &config.consumers.effect;
    let stream = js.get_stream(&config.streams.workflow_commands).await?;
    let name = which.name(base);
    let deliver_policy = match existing(&stream, &name).await? {
        // JetStream refuses to change where a consumer starts: keep its own.
        Some(info) => info.config.deliver_policy,
        None => match which {
            Which::CatchAll => DeliverPolicy::All,
            Which::Effect(_) => match existing(&stream, base).await? {
                Some(catch_all) if catch_all.ack_floor.stream_sequence > 0 => {
                    DeliverPolicy::ByStartSequence {
                        start_sequence: catch_all.ack_floor.stream_sequence + 1,
                    }
                }
                _ => DeliverPolicy::All,
            },
        },
    };
    let (filter, description, headers_only) = match which {
        Which::Effect(e) => (
            effect_filter(e),
            format!("Runner effect workers: commands of effect {e}"),
            false,
        ),
        Which::CatchAll => (
            COMMAND_FILTER.to_string(),
            "Runner effect workers: commands no effect consumer covers".to_string(),
            true,
        ),
    };
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(name),
            description: Some(description),
            filter_subject: filter,
            deliver_policy,
            headers_only,
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: config.effect.ack_wait.get(),
            max_ack_pending: config.effect.max_ack_pending,
            max_deliver: config.effect.max_deliver,
            ..Default::default()
        })
        .await?;
    if let Which::Effect(effect) = which {
        let info = consumer.cached_info();
        let from = match info.config.deliver_policy {
            DeliverPolicy::All => 1,
            DeliverPolicy::ByStartSequence { start_sequence } => start_sequence,
            // Not a start Runner sets: trust it only from what it delivered so far on.
            _ => info.delivered.stream_sequence + 1,
        };
        coverage.set(effect, from);
    }
    Ok(Opened { stream, consumer })
}

/// Effect names that already have a consumer of their own on the command stream (made by
/// this or another replica, for an effect a manifest declared then). A process serves
/// them too, so commands held there are answered even after the effect left the
/// manifests.
pub(super) async fn existing_effects(
    config: &Config,
    js: &jetstream::Context,
) -> Result<Vec<String>, async_nats::Error> {
    let base = &config.consumers.effect;
    let prefix = format!("{base}-");
    let stream = js.get_stream(&config.streams.workflow_commands).await?;
    let infos: Vec<consumer::Info> = stream.consumers().try_collect().await?;
    Ok(infos
        .into_iter()
        .filter_map(|info| {
            let effect = info.name.strip_prefix(&prefix)?;
            (info.config.filter_subject == effect_filter(effect)
                && info.config.ack_policy == consumer::AckPolicy::Explicit
                && !info.config.headers_only)
                .then(|| effect.to_string())
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_filters() {
        assert_eq!(consumer_name("runner-effect", "pay"), "runner-effect-pay");
        assert_eq!(effect_filter("pay"), "tenant.*.effect.pay.*");
        // The command stream captures `tenant.*.effect.*.*`: one token per part.
        let stream_subjects = crate::broker::stream_specs(&Default::default());
        assert!(
            stream_subjects
                .iter()
                .any(|s| s.subjects.contains(&"tenant.*.effect.*.*".to_string()))
        );
        assert_eq!(effect_filter("pay").split('.').count(), 5);
        assert!(has_own_consumer("runner-effect", "pay_v2-x"));
        for bad in ["", "a/b", "a\\b", "a b", "a*", "a>"] {
            assert!(!has_own_consumer("runner-effect", bad), "{bad:?}");
        }
        assert!(!has_own_consumer("runner-effect", &"x".repeat(250)));
    }

    #[test]
    fn coverage_starts_where_the_consumer_starts() {
        let c = Coverage::default();
        assert!(!c.covers("tenant._.effect.pay.c1", 5));
        c.set("pay", 10);
        assert!(!c.covers("tenant._.effect.pay.c1", 9));
        assert!(c.covers("tenant._.effect.pay.c1", 10));
        assert!(!c.covers("tenant._.effect.ship.c1", 10));
        assert!(!c.covers("nonsense", 10));
    }
}
