//! The `grpc` provider: one unary gRPC call per attempt (tonic; rustls for TLS), with the
//! method's messages known at run time, from a descriptor set or from server reflection.
//!
//! Settings:
//! - `endpoint` (required): `http://host:port` or `https://host:port`, written as it is (not
//!   a template; credentials go in `metadata`).
//! - `method` (required): `package.Service/Method`. Only unary methods; a streaming method
//!   is refused when the manifest is loaded (or on the first call, under reflection).
//! - `descriptors`: a FileDescriptorSet file (`protoc --include_imports
//!   --descriptor_set_out=…` or `buf build -o …`), relative to the manifest's directory. When
//!   it is given, the method, its kind and the `request` template's static keys are checked
//!   at load time. Without it the server's reflection service is asked on the first call.
//! - `request`: template producing JSON, mapped onto the request message by the protobuf
//!   JSON mapping (default `${ event.payload }`). A key the message lacks fails the call
//!   fatally, unless `ignore_unknown_fields: true`.
//! - `metadata`: map of lowercase names to templates (ASCII values; `-bin`, `grpc-*` and
//!   `idempotency-key` names are refused).
//! - `success_when` (CEL) and `result` (template; default the reply) see `state` =
//!   `{code: 0, status: "OK", body: <the reply as JSON>}`. The reply's JSON has every field,
//!   defaults included, under its JSON (lowerCamelCase) name; 64-bit integers are strings and
//!   enums their names, as the protobuf JSON mapping says.
//! - `secrets`, as every provider.
//! - TLS (https only): `tls_ca_file` (PEM; default the public web roots), `tls_cert_file` +
//!   `tls_key_file` (a client certificate, for mTLS), `tls_server_name` (the name to verify
//!   when it differs from the endpoint's host). Files are read when the manifest is loaded.
//! - `retryable_codes`: status names to retry besides the defaults (e.g. `[INTERNAL]`).
//!
//! Each attempt's deadline is the effect's `timeout_ms`, sent as `grpc-timeout`.
//!
//! Classification (see [`status::classify`]): `UNAVAILABLE`, `RESOURCE_EXHAUSTED` and `ABORTED` are
//! retryable, honouring the server's `grpc-retry-pushback-ms` like HTTP's `Retry-After` (a
//! negative pushback means the server asks for no retry: fatal); `DEADLINE_EXCEEDED` (and the
//! channel cancelling the call at its deadline) is a
//! timeout; every other status is fatal unless listed in `retryable_codes`. A failure's
//! payload carries `code` (number), `status` (name) and `message`.
//!
//! A reply larger than a result may be (the broker's record limit) is refused from its
//! length prefix, before its bytes are read, and fails the command for good, named as too
//! large rather than as a status the upstream sent.
//!
//! Guarantees: every attempt carries `idempotency-key: <command_id>` (and the command's
//! `traceparent` when well formed); errors never carry the
//! endpoint or a metadata value, only the effect, the status and the server's message.
//!
//! This file owns the compiled settings ([`GrpcSpec`]) and the order of one call: render
//! the request, learn the method, build the request ([`request`]), call over the shared
//! channel ([`endpoint`]), then read the answer ([`answer`], failures by [`status`]). The
//! method's types come from [`schema`]; the wire codec is [`codec`].

mod answer;
mod codec;
mod endpoint;
mod request;
pub(crate) mod schema;
mod status;

use std::sync::Arc;

use serde_json::{Value as Json, json};
use tonic::Code;
use tonic::metadata::AsciiMetadataKey;
use tonic::transport::Channel;

pub use codec::DynamicCodec;
use endpoint::Target;
use schema::{Method, ReflectionError};
use status::status_details;
pub use status::status_name;

use super::error::{EffectError, SettingsError};
use super::input::{load_secrets, render, saga_vars};
use super::settings::{SecretSource, Settings, template_of};
use crate::expr::{Expr, Template, Vars};

/// The metadata name of the idempotency key (gRPC metadata names are lowercase).
pub const IDEMPOTENCY_KEY_METADATA: &str = "idempotency-key";

/// Compiled gRPC settings.
#[derive(Debug, Clone)]
pub struct GrpcSpec {
    target: Target,
    service: String,
    method_name: String,
    /// The method, when a descriptor set was given.
    known: Option<Method>,
    /// The method as reflection described it, once it did.
    learnt: Arc<tokio::sync::OnceCell<Method>>,
    request: Template,
    ignore_unknown_fields: bool,
    metadata: Vec<(AsciiMetadataKey, Template)>,
    success_when: Option<Expr>,
    result: Option<Template>,
    secrets: Vec<(String, SecretSource)>,
    also_retry: Vec<Code>,
}

impl GrpcSpec {
    /// Reads and checks the settings.
    pub(super) fn compile(c: &Settings<'_>) -> Result<Self, SettingsError> {
        let method = match c.get("method") {
            Some(Json::String(m)) => m,
            Some(_) => return Err(c.err("method", "must be a string")),
            None => return Err(c.err("method", "is required")),
        };
        let (service, method_name) =
            schema::parse_method(method).map_err(|e| c.err("method", e))?;
        let known = match c.path("descriptors")? {
            None => None,
            Some(path) => {
                let pool = schema::from_file(&path).map_err(|e| c.err("descriptors", e))?;
                Some(schema::find(&pool, &service, &method_name).map_err(|e| c.err("method", e))?)
            }
        };
        if let (Some(m), Some(req)) = (&known, c.get("request")) {
            schema::check_request(req, &m.input, "request").map_err(|(at, e)| c.err(&at, e))?;
        }
        let request = match c.template("request")? {
            Some(t) => t,
            None => template_of(&Json::String("${ event.payload }".into()))
                .map_err(|e| c.err("request", e.to_string()))?,
        };
        let ignore_unknown_fields = match c.get("ignore_unknown_fields") {
            None => false,
            Some(Json::Bool(b)) => *b,
            Some(_) => return Err(c.err("ignore_unknown_fields", "must be true or false")),
        };
        Ok(Self {
            target: Target::of(c)?,
            service,
            method_name,
            known,
            learnt: Arc::default(),
            request,
            ignore_unknown_fields,
            metadata: request::metadata(c)?,
            success_when: c.condition("success_when")?,
            result: c.template("result")?,
            secrets: c.secrets()?,
            also_retry: status::retryable_codes(c)?,
        })
    }

    /// Makes one call for one attempt of `command` (the whole envelope); `timeout` is the
    /// call's deadline (the caller bounds the whole attempt with it too).
    pub(super) async fn call(
        &self,
        effect: &str,
        command: &Json,
        command_id: &str,
        env: &super::CallEnv<'_>,
    ) -> Result<Json, EffectError> {
        let secrets = load_secrets(&self.secrets)?;
        let saga = saga_vars(command, secrets);
        let empty = json!({});
        let vars = Vars::new(command, &empty, &saga);
        let body = render(&self.request, &vars, "request")?;
        let channel = self.target.channel();
        let method = self.method(effect, &channel).await?;
        let request = self.build_request(effect, &method, &body, &vars, command_id, env)?;
        let mut grpc = tonic::client::Grpc::new(channel);
        // A reply is refused from its length prefix, before its bytes are read, when it is
        // larger than a result may be (as the HTTP provider cuts an answer off).
        if env.max_answer_bytes > 0 {
            grpc = grpc.max_decoding_message_size(env.max_answer_bytes);
        }
        grpc.ready().await.map_err(|e| EffectError::Retryable {
            reason: format!("effect `{effect}`: the endpoint is not reachable: {e}"),
            retry_after: None,
            details: json!({}),
        })?;
        let started = std::time::Instant::now();
        let reply = grpc
            .unary(
                request,
                method.path.clone(),
                DynamicCodec::new(method.output.clone()),
            )
            .await
            .map_err(|status| self.failure(effect, &status, started, env))?;
        self.answer(effect, reply.into_inner(), command, &saga)
    }

    /// The method's types: from the descriptor set, or asked of the server's reflection
    /// service (once; a failure to ask is retried on the next attempt).
    async fn method(&self, effect: &str, channel: &Channel) -> Result<Method, EffectError> {
        if let Some(m) = &self.known {
            return Ok(m.clone());
        }
        self.learnt
            .get_or_try_init(|| {
                schema::from_reflection(channel.clone(), &self.service, &self.method_name)
            })
            .await
            .cloned()
            .map_err(|e| match e {
                ReflectionError::Retry(status) => EffectError::Retryable {
                    reason: format!(
                        "effect `{effect}`: server reflection failed: {}",
                        status_name(status.code())
                    ),
                    retry_after: None,
                    details: status_details(&status),
                },
                ReflectionError::Fatal(why) => EffectError::Fatal {
                    reason: format!("effect `{effect}`: server reflection: {why}"),
                    details: json!({}),
                },
            })
    }
}
