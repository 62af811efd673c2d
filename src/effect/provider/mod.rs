//! Providers: what one attempt of an effect does, configured by the effect's `settings`.
//!
//! This file owns the list of providers and the dispatch to them: [`Provider::compile`]
//! turns a declared effect into a compiled provider (once per catalog generation; every
//! settings problem is found then, not during a call), and [`Provider::call`] runs one
//! attempt. Each provider lives in its own file with its settings, its `compile` and its
//! `call`; what they share sits in files of its own (`error.rs`: how an attempt fails;
//! `settings.rs`: reading settings; `input.rs`: the variables, secrets and idempotency key
//! of an attempt), so no provider imports this file.
//!
//! | provider | does |
//! |---|---|
//! | `noop` | calls nothing: succeeds at once with `result` (default `{}`), or fails fatally when `fail_when` holds |
//! | `log` | logs the command (payload size, never its content) and succeeds |
//! | `http` | one HTTP request (rustls for TLS) |
//! | `grpc` | one unary gRPC call, messages from a descriptor set or server reflection (see [`grpc`]) |
//! | `nats_request` | NATS request/reply to a service subject |
//! | `nats_publish` | publishes the payload on a subject and succeeds |
//! | `smtp` | sends one plain-text mail (see [`smtp`]) |
//! | `postgres` | runs one parameterised statement (see [`postgres`]) |
//!
//! **Templates.** Settings strings may hold `${ expr }` templates (see [`crate::expr`]).
//! Before the call they see `event` = the command envelope (`event.payload`,
//! `event.command_id`, `event.metadata`…) and `saga` = `{tenant, name, correlation_id,
//! secrets}`; after the call (`success_when`, `result`) `state` = the response
//! (`{status, body}` for HTTP, `{body}` for NATS).
//!
//! **Secrets** are declared as `secrets: { name: { env: VAR } | { file: /path } }` and
//! read as `saga.secrets.name`. They are read when a call is prepared, never logged, never
//! part of an error message (errors name the effect and the status, never the URL or a
//! header value).
//!
//! Each provider's settings and its classification of failures (retryable or fatal) are
//! described in its file: [`noop`], [`log`], [`http`], [`grpc`], [`nats`], [`postgres`],
//! [`smtp`].
//!
//! Guarantee: whatever the provider, an attempt's failure is an [`EffectError`] that says
//! whether another attempt may help; the retry policy that acts on it is the manifest's.

pub mod error;
pub mod grpc;
pub mod http;
pub mod input;
pub mod log;
pub mod nats;
pub mod noop;
pub mod postgres;
pub mod settings;
pub mod smtp;
pub mod url;

use std::time::Duration;

use serde_json::Value as Json;

use crate::manifest::catalog::Effect;

pub use error::{EffectError, SettingsError, ToEffectResult};
pub use input::IDEMPOTENCY_KEY_HEADER;
pub use settings::{SecretSource, template_of};

/// A compiled provider.
#[derive(Debug, Clone)]
pub enum Provider {
    /// Calls nothing: succeeds with its `result`, or fails when `fail_when` holds.
    Noop(noop::NoopSpec),
    /// Logs and succeeds.
    Log,
    /// HTTP request.
    Http(Box<http::HttpSpec>),
    /// Unary gRPC call.
    Grpc(Box<grpc::GrpcSpec>),
    /// NATS request/reply.
    NatsRequest(nats::NatsSpec),
    /// NATS publish.
    NatsPublish(nats::NatsSpec),
    /// One parameterised PostgreSQL statement.
    Postgres(Box<postgres::PostgresSpec>),
    /// One mail through an SMTP server.
    Smtp(Box<smtp::SmtpSpec>),
}

/// Makes every manifest load check each effect's provider settings the way the effect
/// worker compiles them, so `runner validate`, start-up and reload report a wrong setting
/// at the effect's location instead of the first command meeting it.
pub fn check_settings_on_load() {
    crate::manifest::set_settings_check(|effect| {
        Provider::compile(effect)
            .map(|_| ())
            .map_err(|e| (e.setting, e.message))
    });
}

impl Provider {
    /// Compiles the provider of a declared effect.
    pub fn compile(effect: &Effect) -> Result<Self, SettingsError> {
        let s = settings::Settings {
            effect: &effect.name,
            settings: &effect.settings,
            base: effect.declared.file.parent(),
        };
        Ok(match effect.provider.as_str() {
            "noop" => Provider::Noop(noop::NoopSpec::compile(&s)?),
            "log" => Provider::Log,
            "http" => Provider::Http(Box::new(http::HttpSpec::compile(&s)?)),
            "grpc" => Provider::Grpc(Box::new(grpc::GrpcSpec::compile(&s)?)),
            "nats_request" => Provider::NatsRequest(nats::NatsSpec::compile(&s)?),
            "nats_publish" => Provider::NatsPublish(nats::NatsSpec::compile(&s)?),
            "postgres" => Provider::Postgres(Box::new(postgres::PostgresSpec::compile(&s)?)),
            "smtp" => Provider::Smtp(Box::new(smtp::SmtpSpec::compile(&s)?)),
            other => return Err(s.err("provider", format!("unknown provider `{other}`"))),
        })
    }

    /// Runs one attempt for `command` (the whole envelope); `command_id` is the idempotency
    /// key. The caller applies the timeout.
    pub async fn call(
        &self,
        effect: &str,
        command: &Json,
        command_id: &str,
        env: &CallEnv<'_>,
    ) -> Result<Json, EffectError> {
        match self {
            Provider::Noop(spec) => spec.call(effect, command),
            Provider::Log => log::call(effect, command, command_id),
            Provider::Http(spec) => spec.call(effect, command, command_id, env).await,
            Provider::Grpc(spec) => spec.call(effect, command, command_id, env).await,
            Provider::NatsRequest(spec) => {
                spec.request(command, command_id, env.nats, env.timeout)
                    .await
            }
            Provider::NatsPublish(spec) => spec.publish(command, command_id, env.nats).await,
            Provider::Postgres(spec) => spec.call(effect, command).await,
            Provider::Smtp(spec) => spec.call(effect, command, command_id, env.timeout).await,
        }
    }
}

/// What one call needs besides the command.
pub struct CallEnv<'a> {
    /// Shared HTTP client.
    pub http: &'a reqwest::Client,
    /// NATS client.
    pub nats: &'a async_nats::Client,
    /// Per-attempt timeout.
    pub timeout: Duration,
    /// The largest answer a provider reads from its upstream (0: no limit): past it the
    /// attempt fails for good, before reading more (a result must fit a message anyway).
    pub max_answer_bytes: usize,
    /// The command's W3C trace context, sent on to the upstream (`traceparent` header or
    /// metadata) when it is well formed, so the upstream's spans join the same trace.
    pub traceparent: Option<&'a str>,
}

/// `tp` when it is a well-formed W3C `traceparent` (`vv-<32 hex>-<16 hex>-<2 hex>`);
/// anything else is not forwarded (it came from a producer, and goes into a header).
pub fn forwarded_traceparent(tp: Option<&str>) -> Option<&str> {
    let tp = tp?;
    crate::telemetry::otel::fields(tp)
        .is_some_and(|f| !f.more)
        .then_some(tp)
}

#[cfg(test)]
mod tests {
    use super::forwarded_traceparent as fwd;

    #[test]
    fn only_well_formed_trace_contexts_are_forwarded() {
        let ok = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert_eq!(fwd(Some(ok)), Some(ok));
        assert_eq!(fwd(None), None);
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nX-Evil: 1",
            "00-zzf7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(fwd(Some(bad)), None, "{bad:?}");
        }
    }
}
