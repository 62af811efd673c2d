//! The streams and buckets Runner relies on, derived from config, and their idempotent
//! reconciliation: the streams of DESIGN §2, the effect claims bucket and the ownership
//! leases bucket (DESIGN §8.3; set up by [`ensure_leases_bucket`], not used by the worker yet).
//!
//! A missing stream or bucket is created (when `streams.create` is on) with the configured
//! storage type and replica count; an existing one is checked and never modified.

use std::time::Duration;

use async_nats::jetstream::{
    self, kv,
    stream::{Config as StreamConfig, DiscardPolicy, RetentionPolicy, StorageType},
};

use super::BrokerError;
use super::filter::covers;
use crate::config::{Config, StreamStorage, StreamsConfig};

/// What Runner needs of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    /// Stream name.
    pub name: String,
    /// Subjects it must capture.
    pub subjects: Vec<String>,
    /// Whether partitioned saga mode publishes into it through fenced atomic batches: it
    /// then also captures [`fence_subjects`] and allows atomic publishing.
    pub fenced: bool,
}

/// The fence subjects of stream `stream`: `runner.fence.<stream>.*`, one per partition (or
/// router source), captured by the stream itself because the broker checks an expected
/// subject sequence only against the stream that stores the message.
pub fn fence_subjects(stream: &str) -> String {
    format!("runner.fence.{stream}.*")
}

/// The streams Runner uses, with the subjects each must capture.
pub fn stream_specs(cfg: &StreamsConfig) -> Vec<StreamSpec> {
    let spec = |name: &str, subjects: &[&str], fenced: bool| StreamSpec {
        name: name.to_string(),
        subjects: subjects.iter().map(|s| s.to_string()).collect(),
        fenced,
    };
    vec![
        spec(&cfg.aggregate_events, &["tenant.*.aggregate.*.*"], false),
        spec(
            &cfg.workflow_commands,
            &["tenant.*.effect.*.*", "tenant.*.command.*.*"],
            true,
        ),
        spec(
            &cfg.workflow_events,
            &["tenant.*.effect_result.*.*", "tenant.*.workflow_event.*.*"],
            true,
        ),
        spec(&cfg.saga_inbox, &["runner.inbox.>"], true),
        spec(&cfg.dead_letter, &["tenant.*.deadletter.*"], true),
    ]
}

/// The stream among `specs` (from [`stream_specs`]) that captures `subject`, if any.
pub fn stream_for<'a>(specs: &'a [StreamSpec], subject: &str) -> Option<&'a StreamSpec> {
    specs
        .iter()
        .find(|s| s.subjects.iter().any(|f| covers(f, subject)))
}

fn storage_type(s: StreamStorage) -> StorageType {
    match s {
        StreamStorage::File => StorageType::File,
        StreamStorage::Memory => StorageType::Memory,
    }
}

/// Creates missing streams and checks existing ones. Never modifies an existing stream.
/// Streams it creates carry the fence subjects and allow atomic batches; an existing stream
/// must have them when `fenced` (this node runs sagas, whose partitions publish there
/// fenced).
pub async fn ensure_streams(
    js: &jetstream::Context,
    cfg: &StreamsConfig,
    fenced: bool,
) -> Result<(), BrokerError> {
    for spec in stream_specs(cfg) {
        ensure_one(js, cfg, &spec, fenced).await?;
    }
    Ok(())
}

/// Refusals to create a stream that no amount of waiting changes (the other codes a server
/// gives while a cluster forms — no leader, no peers for placement, temporarily
/// unavailable — are worth retrying).
const DEFINITE_REFUSALS: [jetstream::ErrorCode; 4] = [
    jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP,
    jetstream::ErrorCode::STREAM_NAME_EXIST,
    jetstream::ErrorCode::STREAM_INVALID_CONFIG,
    jetstream::ErrorCode::STREAM_LIMITS,
];

/// The config of stream `name`, or None when the server says it does not exist; any other
/// failure (no answer, no leader yet) is a transient [`BrokerError::JetStream`].
async fn existing_stream(
    js: &jetstream::Context,
    name: &str,
) -> Result<Option<StreamConfig>, BrokerError> {
    match js.get_stream(name).await {
        Ok(s) => Ok(Some(s.cached_info().config.clone())),
        Err(e) => match e.kind() {
            jetstream::context::GetStreamErrorKind::JetStream(inner)
                if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            _ => Err(BrokerError::JetStream {
                op: "stream info",
                stream: name.to_string(),
                reason: e.to_string(),
            }),
        },
    }
}

async fn ensure_one(
    js: &jetstream::Context,
    cfg: &StreamsConfig,
    spec: &StreamSpec,
    fenced: bool,
) -> Result<(), BrokerError> {
    let js_err = |op: &'static str, e: &dyn std::fmt::Display| BrokerError::JetStream {
        op,
        stream: spec.name.clone(),
        reason: e.to_string(),
    };
    let existing = match existing_stream(js, &spec.name).await? {
        Some(c) => c,
        None if !cfg.create => {
            return Err(BrokerError::Missing {
                stream: spec.name.clone(),
            });
        }
        None => {
            let mut subjects = spec.subjects.clone();
            // Always: a saga node may come to publish here fenced later.
            if spec.fenced {
                subjects.push(fence_subjects(&spec.name));
            }
            let (max_age, max_bytes, discard) = limits_of(cfg, spec);
            let want = StreamConfig {
                name: spec.name.clone(),
                subjects,
                allow_atomic_publish: spec.fenced,
                storage: storage_type(cfg.storage),
                num_replicas: cfg.replicas,
                duplicate_window: cfg.duplicate_window.get(),
                retention: RetentionPolicy::Limits,
                max_age,
                max_bytes,
                discard,
                ..StreamConfig::default()
            };
            match js.create_stream(want).await {
                Ok(_) => {
                    tracing::info!(message = "Created stream.", stream = %spec.name, subjects = ?spec.subjects);
                    return Ok(());
                }
                // Another replica may have created it meanwhile: check what is there.
                Err(e) => match js.get_stream(&spec.name).await {
                    Ok(s) => s.cached_info().config.clone(),
                    Err(_) => match e.kind() {
                        // The server answered, and waiting will not change its answer.
                        jetstream::context::CreateStreamErrorKind::JetStream(inner)
                            if DEFINITE_REFUSALS.contains(&inner.error_code()) =>
                        {
                            return Err(BrokerError::Refused {
                                op: "create stream",
                                stream: spec.name.clone(),
                                reason: e.to_string(),
                            });
                        }
                        _ => return Err(js_err("create stream", &e)),
                    },
                },
            }
        }
    };
    check_compatible(cfg, spec, &existing, fenced)
}

/// The limits a stream Runner creates gets: the dead-letter stream its own, and drops its
/// oldest entries when full; every other stream refuses new messages when full, so nothing
/// unconsumed is dropped to make room.
fn limits_of(cfg: &StreamsConfig, spec: &StreamSpec) -> (Duration, i64, DiscardPolicy) {
    // 0 configured: no byte limit (JetStream's -1).
    let bytes = |b: crate::config::ByteSize| match b.get() {
        0 => -1,
        n => i64::try_from(n).unwrap_or(i64::MAX),
    };
    if spec.name == cfg.dead_letter {
        (
            cfg.dead_letter_max_age.get(),
            bytes(cfg.dead_letter_max_bytes),
            DiscardPolicy::Old,
        )
    } else {
        (cfg.max_age.get(), bytes(cfg.max_bytes), DiscardPolicy::New)
    }
}

fn check_compatible(
    cfg: &StreamsConfig,
    spec: &StreamSpec,
    have: &StreamConfig,
    fenced: bool,
) -> Result<(), BrokerError> {
    // Limits are the operator's to change on an existing stream: a difference is reported,
    // never refused and never changed.
    let (max_age, max_bytes, _) = limits_of(cfg, spec);
    if have.max_age != max_age || have.max_bytes != max_bytes {
        tracing::info!(message = "Existing stream keeps its own limits.", stream = %spec.name, max_age = ?have.max_age, max_bytes = have.max_bytes, configured_max_age = ?max_age, configured_max_bytes = max_bytes);
    }
    let incompatible = |field: &'static str, existing: String, wanted: String| {
        Err(BrokerError::Incompatible {
            stream: spec.name.clone(),
            field,
            existing,
            wanted,
        })
    };
    for s in &spec.subjects {
        if !have.subjects.iter().any(|h| covers(h, s)) {
            return incompatible(
                "subjects",
                format!("{:?}", have.subjects),
                format!("a filter covering {s:?}"),
            );
        }
    }
    if fenced && spec.fenced {
        let fences = fence_subjects(&spec.name);
        if !have.subjects.iter().any(|h| covers(h, &fences)) {
            return incompatible(
                "subjects",
                format!("{:?}", have.subjects),
                format!("a filter covering {fences:?} (the partition fences)"),
            );
        }
        if !have.allow_atomic_publish {
            return incompatible("allow_atomic", "false".into(), "true".into());
        }
    }
    if have.storage != storage_type(cfg.storage) {
        return incompatible(
            "storage",
            format!("{:?}", have.storage),
            format!("{:?}", storage_type(cfg.storage)),
        );
    }
    if have.num_replicas.max(1) != cfg.replicas {
        return incompatible(
            "num_replicas",
            have.num_replicas.to_string(),
            cfg.replicas.to_string(),
        );
    }
    if have.duplicate_window < cfg.duplicate_window.get() {
        return incompatible(
            "duplicate_window",
            format!("{:?}", have.duplicate_window),
            format!("at least {}", cfg.duplicate_window),
        );
    }
    if have.retention != RetentionPolicy::Limits {
        return incompatible(
            "retention",
            format!("{:?}", have.retention),
            "Limits".into(),
        );
    }
    Ok(())
}

/// Opens the effect claims bucket (`effect.claims_bucket`), creating it when missing: one
/// key per command, `history 1` (a claim is only ever read at its latest revision, which is
/// the fencing token), entries kept `effect.claim_retention`.
pub async fn ensure_claims_bucket(
    js: &jetstream::Context,
    config: &Config,
) -> Result<kv::Store, BrokerError> {
    let bucket = &config.effect.claims_bucket;
    let err = |op: &'static str, e: &dyn std::fmt::Display| BrokerError::JetStream {
        op,
        stream: format!("KV_{bucket}"),
        reason: e.to_string(),
    };
    if existing_stream(js, &format!("KV_{bucket}"))
        .await?
        .is_some()
    {
        return js
            .get_key_value(bucket)
            .await
            .map_err(|e| err("open bucket", &e));
    }
    if !config.streams.create {
        return Err(BrokerError::Missing {
            stream: format!("KV_{bucket}"),
        });
    }
    match js
        .create_key_value(kv::Config {
            bucket: bucket.clone(),
            description: "Runner effect claims: one per command (owner, attempt, lease, result)"
                .into(),
            history: 1,
            max_age: config.effect.claim_retention.get(),
            storage: storage_type(config.streams.storage),
            num_replicas: config.streams.replicas,
            ..Default::default()
        })
        .await
    {
        Ok(s) => {
            tracing::info!(message = "Created effect claims bucket.", bucket = %bucket);
            Ok(s)
        }
        // Another replica may have created it meanwhile.
        Err(e) => js
            .get_key_value(bucket)
            .await
            .map_err(|_| err("create bucket", &e)),
    }
}

/// How long the server keeps the marker it writes when a lease entry ages out: the
/// smallest it accepts. Watchers see the marker when it is written; afterwards the key is
/// simply absent, which `create` treats the same way.
const LEASE_MARKER_TTL: Duration = Duration::from_secs(1);

/// Opens the ownership leases bucket `name`, creating it when missing (see
/// `worker/ownership/lease.rs`): `history 1`, `max_age = ttl` (an entry disappears `ttl` after its last
/// write, which is what expires a lease that is no longer renewed) and `limit_markers` (the
/// expiry is written as a marker, so watchers see it at once). Leases never use per-key TTL.
///
/// An existing bucket is checked, never modified: a different `max_age` would expire leases
/// earlier or later than their holders count on, so it stops the start
/// ([`BrokerError::Incompatible`]), as do a history other than 1 and missing limit markers.
pub async fn ensure_leases_bucket(
    js: &jetstream::Context,
    name: &str,
    ttl: Duration,
    replicas: usize,
    storage: StreamStorage,
) -> Result<kv::Store, BrokerError> {
    let stream = format!("KV_{name}");
    if let Some(have) = existing_stream(js, &stream).await? {
        return open_leases_bucket(js, name, ttl, have).await;
    }
    match js
        .create_key_value(kv::Config {
            bucket: name.to_string(),
            description: "Runner ownership leases: one key per partition (owner, epoch)".into(),
            history: 1,
            max_age: ttl,
            limit_markers: Some(LEASE_MARKER_TTL),
            storage: storage_type(storage),
            num_replicas: replicas,
            ..Default::default()
        })
        .await
    {
        Ok(s) => {
            tracing::info!(message = "Created leases bucket.", bucket = %name, ttl = ?ttl);
            Ok(s)
        }
        Err(e) => {
            if e.kind() == jetstream::context::CreateKeyValueErrorKind::LimitMarkersNotSupported {
                return Err(BrokerError::Refused {
                    op: "create bucket",
                    stream,
                    reason: e.to_string(),
                });
            }
            // Another replica may have created it meanwhile: check what is there.
            match existing_stream(js, &stream).await {
                Ok(Some(have)) => open_leases_bucket(js, name, ttl, have).await,
                _ => Err(BrokerError::JetStream {
                    op: "create bucket",
                    stream,
                    reason: e.to_string(),
                }),
            }
        }
    }
}

/// Opens the existing leases bucket `name` (whose stream config is `have`) once it is
/// checked.
async fn open_leases_bucket(
    js: &jetstream::Context,
    name: &str,
    ttl: Duration,
    have: StreamConfig,
) -> Result<kv::Store, BrokerError> {
    check_leases_bucket(&format!("KV_{name}"), ttl, &have)?;
    js.get_key_value(name)
        .await
        .map_err(|e| BrokerError::JetStream {
            op: "open bucket",
            stream: format!("KV_{name}"),
            reason: e.to_string(),
        })
}

/// Whether an existing leases bucket expires leases the way [`ensure_leases_bucket`] would.
fn check_leases_bucket(
    stream: &str,
    ttl: Duration,
    have: &StreamConfig,
) -> Result<(), BrokerError> {
    let incompatible = |field: &'static str, existing: String, wanted: String| {
        Err(BrokerError::Incompatible {
            stream: stream.to_string(),
            field,
            existing,
            wanted,
        })
    };
    if have.max_age != ttl {
        return incompatible(
            "max_age",
            format!("{:?}", have.max_age),
            format!("{ttl:?} (the lease TTL)"),
        );
    }
    if have.max_messages_per_subject != 1 {
        return incompatible(
            "max_msgs_per_subject",
            have.max_messages_per_subject.to_string(),
            "1".into(),
        );
    }
    if have.subject_delete_marker_ttl.is_none() {
        return incompatible(
            "subject_delete_marker_ttl",
            "none".into(),
            "set (limit markers)".into(),
        );
    }
    Ok(())
}
