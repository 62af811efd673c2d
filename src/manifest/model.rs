//! The manifest file format, as written by operators (YAML, `format: 1`).
//!
//! These types are the single source of truth for the format: the loader deserializes them
//! (keeping line and column of every name and expression, so later checks can point at the
//! right place) and `schema/manifest.schema.json` is generated from them with `schemars`.
//! Nothing here is evaluated; [`super::load`] compiles it into the runnable [`super::Catalog`].

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_saphyr::Spanned;

/// A value with the place it was written (1-based line and column; 0 when unknown).
pub type Sp<T> = Spanned<T>;

/// One manifest file.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(
    title = "Runner manifest",
    description = "Sagas and effects, format 1."
)]
pub struct ManifestFile {
    /// Manifest format version; this build reads `1`.
    #[schemars(with = "u32")]
    pub format: Sp<u32>,
    /// Effects: side effects sagas may ask for (HTTP calls and the like).
    #[serde(default)]
    pub effects: Vec<EffectDecl>,
    /// Sagas: state machines, or orchestrations of steps.
    #[serde(default)]
    pub sagas: Vec<SagaDecl>,
}

/// An effect declaration. The saga engine only needs its name; the effect worker uses the rest.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EffectDecl {
    /// Unique effect name, used in subjects (`effect.<name>.<command_id>`).
    #[schemars(with = "String")]
    pub name: Sp<String>,
    /// Which provider runs it (its settings are described with each provider).
    #[schemars(with = "ProviderName")]
    pub provider: Sp<String>,
    /// Provider settings (URL, method, headers...), passed to the provider unchanged.
    #[serde(default)]
    #[schemars(with = "BTreeMap<String, serde_json::Value>", extend("default" = {}))]
    pub settings: SpannedMap<Sp<TemplateNode>>,
    /// Timeout of one attempt, in milliseconds.
    #[serde(default, deserialize_with = "super::millis::optional")]
    pub timeout_ms: Option<u64>,
    /// Retries applied by the effect worker. Absent (here and in the saga's call): one
    /// attempt, no retry.
    pub retry: Option<RetryPolicy>,
    /// Circuit breaker per upstream.
    pub circuit_breaker: Option<CircuitBreaker>,
}

// The compiler's own list is `crate::manifest::PROVIDERS`; a test keeps the two the same.
/// A provider: what executes an effect's commands.
#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
enum ProviderName {
    /// Calls nothing; succeeds with `result`, or fails when `fail_when` holds.
    Noop,
    /// Logs the command and succeeds.
    Log,
    /// One HTTP request.
    Http,
    /// One unary gRPC call (messages from `descriptors` or server reflection).
    Grpc,
    /// NATS request/reply.
    NatsRequest,
    /// Publishes on a NATS subject.
    NatsPublish,
    /// One plain-text mail through SMTP.
    Smtp,
    /// One parameterised PostgreSQL statement.
    Postgres,
}

/// Sage's retry options. Backoffs are in milliseconds.
///
/// The wait before retry number `attempt` (1-based) is
/// `min(max_backoff, (base_backoff * 2) ^ attempt)`; with jitter, a value in `[0, that]`
/// chosen deterministically from the instance and attempt. No `base_backoff` means no wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// How many retries after the first attempt (0 = never retry).
    pub retry_limit: u32,
    /// Base backoff in milliseconds.
    #[serde(default, deserialize_with = "super::millis::optional")]
    pub base_backoff: Option<u64>,
    /// Upper bound of a backoff in milliseconds (default 5000).
    #[serde(
        default = "default_max_backoff",
        deserialize_with = "super::millis::required"
    )]
    pub max_backoff: u64,
    /// Whether to draw the wait from `[0, backoff]` (default true).
    #[serde(default = "default_true")]
    pub enable_jitter: bool,
}

fn default_max_backoff() -> u64 {
    5_000
}
fn default_true() -> bool {
    true
}

/// Circuit breaker settings of an effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreaker {
    /// Consecutive failures that open the circuit.
    pub failure_threshold: u32,
    /// How long the circuit stays open, in milliseconds.
    #[serde(deserialize_with = "super::millis::required")]
    pub open_ms: u64,
}

/// A saga: either a state machine (`initial_state` + `states`) or an orchestration (`steps`).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SagaDecl {
    /// Saga name, used in subjects and storage keys.
    #[schemars(with = "String")]
    pub name: Sp<String>,
    /// Version; several versions of one saga may be loaded at once.
    #[schemars(with = "u32")]
    pub version: Sp<u32>,
    /// Free text for humans.
    #[serde(default)]
    pub description: Option<String>,
    /// The events this saga reacts to.
    #[serde(default)]
    pub triggers: Vec<TriggerDecl>,
    /// Initial instance data (a template over the starting event). Default `{}`.
    #[serde(default)]
    #[schemars(with = "Option<serde_json::Value>")]
    pub data: Option<Sp<TemplateNode>>,
    /// State-machine style: the state a new instance starts in.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub initial_state: Option<Sp<String>>,
    /// State-machine style: the states, by name.
    #[serde(default)]
    pub states: SpannedMap<StateDecl>,
    /// Orchestration style: the steps, in order.
    #[serde(default)]
    pub steps: Vec<StepDecl>,
    /// How to migrate instances of the previous version to this one.
    #[serde(default)]
    pub migration: Option<MigrationDecl>,
}

/// An event a saga reacts to.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TriggerDecl {
    /// Subject pattern relative to the tenant; `*` matches one token, `>` the rest.
    #[schemars(with = "String")]
    pub subject: Sp<String>,
    /// Only events of this type (aggregate and workflow events).
    #[serde(default)]
    pub event_type: Option<String>,
    /// CEL expression giving the correlation id (the saga instance key). Required: a trigger
    /// without one is refused.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub correlation: Option<Sp<String>>,
    /// Whether this event may start a new instance.
    #[serde(default)]
    pub start: bool,
}

/// A state of a state-machine saga.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StateDecl {
    /// Transitions by event name (`OrderPlaced`, `charge_card.Succeeded`,
    /// `timer.payment_timeout`); the first whose guard holds is taken.
    #[serde(default)]
    pub on: SpannedMap<OneOrMany<TransitionDecl>>,
    /// A terminal state ends the instance.
    #[serde(default)]
    pub terminal: bool,
    /// The status of an instance ending here (default `completed`).
    #[serde(default)]
    pub outcome: Option<Outcome>,
}

/// How a terminal state ends an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The saga did what it was for.
    Completed,
    /// The saga gave up.
    Failed,
    /// The saga undid its work.
    Compensated,
}

/// One transition.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TransitionDecl {
    /// Guard: a CEL boolean. Missing means always.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub when: Option<Sp<String>>,
    /// State updates: each key of this map replaces that top-level key of `state`.
    #[serde(default)]
    #[schemars(with = "BTreeMap<String, serde_json::Value>")]
    pub set: SpannedMap<TemplateNode>,
    /// Work to emit, in order.
    #[serde(default)]
    pub emit: Vec<EmitDecl>,
    /// Timers to set (a timer of the same name is replaced).
    #[serde(default)]
    pub timers: Vec<TimerDecl>,
    /// Timers to cancel, by name.
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub cancel_timers: Vec<Sp<String>>,
    /// Next state; missing means stay.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub goto: Option<Sp<String>>,
}

/// Work a transition emits.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum EmitDecl {
    /// An effect command.
    Effect(EffectCall),
    /// An aggregate command.
    Command(CommandCall),
    /// A workflow event.
    Event(EventCall),
}

/// An effect command to emit.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EffectCall {
    /// The declared effect's name.
    #[schemars(with = "String")]
    pub name: Sp<String>,
    /// Payload template.
    #[serde(default)]
    #[schemars(with = "Option<serde_json::Value>")]
    pub payload: Option<Sp<TemplateNode>>,
    /// Retry policy for this call (default: the effect's).
    #[serde(default)]
    pub retry: Option<RetryPolicy>,
}

/// An aggregate command to emit.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CommandCall {
    /// Aggregate type, e.g. `Order`.
    #[schemars(with = "String")]
    pub aggregate_type: Sp<String>,
    /// Command type, e.g. `Confirm`.
    #[schemars(with = "String")]
    pub command: Sp<String>,
    /// Aggregate id (a template string, e.g. `${event.aggregate_id}`).
    #[schemars(with = "String")]
    pub aggregate_id: Sp<TemplateNode>,
    /// Payload template.
    #[serde(default)]
    #[schemars(with = "Option<serde_json::Value>")]
    pub payload: Option<Sp<TemplateNode>>,
}

/// A workflow event to emit.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EventCall {
    /// Event type.
    #[schemars(with = "String")]
    pub event_type: Sp<String>,
    /// Payload template.
    #[serde(default)]
    #[schemars(with = "Option<serde_json::Value>")]
    pub payload: Option<Sp<TemplateNode>>,
}

/// A timer to set. Exactly one of `delay_ms` and `at` is given.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TimerDecl {
    /// Timer name; it fires as event `timer.<name>`.
    #[schemars(with = "String")]
    pub name: Sp<String>,
    /// Fire this long after the input event's timestamp.
    #[serde(default, deserialize_with = "super::millis::optional")]
    pub delay_ms: Option<u64>,
    /// CEL expression giving the absolute due time in ms since the epoch.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub at: Option<Sp<String>>,
}

/// One step of an orchestration. Exactly one of `effect` and `command` is given.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepDecl {
    /// Step name, unique in the saga.
    #[schemars(with = "String")]
    pub name: Sp<String>,
    /// Consecutive steps with the same group run in parallel.
    #[serde(default)]
    pub group: Option<String>,
    /// The step is an effect call; its retries travel in the effect command.
    #[serde(default)]
    pub effect: Option<EffectCall>,
    /// The step is an aggregate command; the saga waits for its result events and re-sends
    /// it after a backoff (through a timer) on failure or timeout.
    #[serde(default)]
    pub command: Option<CommandCall>,
    /// Event names meaning success (default for an effect step: `<effect>.Succeeded`; a
    /// command step must list its own, as it must `failure`).
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub success: Vec<Sp<String>>,
    /// Event names meaning failure (default for an effect step: `<effect>.Failed`,
    /// `.TimedOut`; a command step must list its own).
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub failure: Vec<Sp<String>>,
    /// Event names meaning an unrecoverable failure: compensate without retrying.
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub abort: Vec<Sp<String>>,
    /// Retry policy (command steps: retried by the saga; effect steps: by the effect worker).
    #[serde(default)]
    pub retry: Option<RetryPolicy>,
    /// Command steps: how long to wait for a result before counting a failure (default 30 s).
    #[serde(default, deserialize_with = "super::millis::optional")]
    pub timeout_ms: Option<u64>,
    /// What undoes this step once it has succeeded.
    #[serde(default)]
    pub compensation: Option<CompensationDecl>,
}

/// How to undo a completed step. Exactly one of `effect` and `command` is given.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompensationDecl {
    /// Undo through an effect call.
    #[serde(default)]
    pub effect: Option<EffectCall>,
    /// Undo through an aggregate command.
    #[serde(default)]
    pub command: Option<CommandCall>,
    /// Event names meaning the compensation succeeded.
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub success: Vec<Sp<String>>,
    /// Event names meaning it failed.
    #[serde(default)]
    #[schemars(with = "Vec<String>")]
    pub failure: Vec<Sp<String>>,
    /// Its own retry budget; when spent, the instance parks in `needs_operator`.
    #[serde(default)]
    pub retry: Option<RetryPolicy>,
    /// Command compensations: how long to wait for a result.
    #[serde(default, deserialize_with = "super::millis::optional")]
    pub timeout_ms: Option<u64>,
}

/// A migration from the previous version (`version - 1`) to this one.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrationDecl {
    /// The version migrated from; must be this version minus one.
    #[schemars(with = "u32")]
    pub from: Sp<u32>,
    /// CEL expression computing the new `state` data (sees the old `state` and `saga`).
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    pub data: Option<Sp<String>>,
    /// Old state name -> new state name; unlisted names are kept.
    #[serde(default)]
    pub states: BTreeMap<String, String>,
}

/// A map whose keys keep their location, in the order written.
#[derive(Debug)]
pub struct SpannedMap<V>(pub Vec<(Sp<String>, V)>);

impl<V> Default for SpannedMap<V> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for SpannedMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
            type Value = SpannedMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(SpannedMap(Vec::new()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<Sp<String>>()? {
                    let v = map.next_value::<V>()?;
                    out.push((k, v));
                }
                Ok(SpannedMap(out))
            }
        }
        d.deserialize_map(V2(PhantomData))
    }
}

impl<V: JsonSchema> JsonSchema for SpannedMap<V> {
    fn schema_name() -> Cow<'static, str> {
        format!("Map_of_{}", V::schema_name()).into()
    }
    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let inner = generator.subschema_for::<V>();
        json_schema!({ "type": "object", "additionalProperties": inner })
    }
}

/// One value or a list of them.
#[derive(Debug)]
pub struct OneOrMany<T>(pub Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V2<T> {
            type Value = OneOrMany<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping or a list of mappings")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(OneOrMany(Vec::new()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = seq.next_element::<T>()? {
                    out.push(v);
                }
                Ok(OneOrMany(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|v| OneOrMany(vec![v]))
            }
        }
        d.deserialize_any(V2(PhantomData))
    }
}

impl<T: JsonSchema> JsonSchema for OneOrMany<T> {
    fn schema_name() -> Cow<'static, str> {
        format!("OneOrMany_{}", T::schema_name()).into()
    }
    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        let inner = generator.subschema_for::<T>();
        json_schema!({ "anyOf": [inner, { "type": "array", "items": inner }] })
    }
}

/// A YAML value tree that keeps the location of every node, for payload templates.
#[derive(Debug, Clone)]
pub enum TemplateNode {
    /// `null`, `true`, numbers.
    Scalar(serde_json::Value),
    /// A string, possibly with `${ expr }`.
    Str(String),
    /// A list.
    List(Vec<Sp<TemplateNode>>),
    /// A mapping with string keys.
    Map(Vec<(Sp<String>, Sp<TemplateNode>)>),
}

impl<'de> Deserialize<'de> for TemplateNode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2;
        impl<'de> Visitor<'de> for V2 {
            type Value = TemplateNode;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any YAML value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(TemplateNode::Scalar(serde_json::Value::Null))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(TemplateNode::Scalar(serde_json::Value::Null))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(TemplateNode::Scalar(v.into()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(TemplateNode::Scalar(v.into()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(TemplateNode::Scalar(v.into()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                serde_json::Number::from_f64(v)
                    .map(|n| TemplateNode::Scalar(serde_json::Value::Number(n)))
                    .ok_or_else(|| E::custom("non-finite numbers are not allowed"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(TemplateNode::Str(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(TemplateNode::Str(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = seq.next_element::<Sp<TemplateNode>>()? {
                    out.push(v);
                }
                Ok(TemplateNode::List(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<Sp<String>>()? {
                    out.push((k, map.next_value::<Sp<TemplateNode>>()?));
                }
                Ok(TemplateNode::Map(out))
            }
        }
        d.deserialize_any(V2)
    }
}

impl TemplateNode {
    /// The value as plain JSON (templates stay strings; a repeated key keeps its last value).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            TemplateNode::Scalar(v) => v.clone(),
            TemplateNode::Str(s) => serde_json::Value::String(s.clone()),
            TemplateNode::List(items) => items.iter().map(|i| i.value.to_json()).collect(),
            TemplateNode::Map(fields) => serde_json::Value::Object(
                fields
                    .iter()
                    .map(|(k, v)| (k.value.clone(), v.value.to_json()))
                    .collect(),
            ),
        }
    }
}

impl JsonSchema for TemplateNode {
    fn schema_name() -> Cow<'static, str> {
        "Template".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "Any value; strings may contain `${ CEL expression }`."
        })
    }
}
