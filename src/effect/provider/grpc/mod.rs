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
//! Classification (see [`classify`]): `UNAVAILABLE`, `RESOURCE_EXHAUSTED` and `ABORTED` are
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

mod codec;
pub(crate) mod schema;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prost_reflect::{DeserializeOptions, DynamicMessage, SerializeOptions};
use serde_json::{Value as Json, json};
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Status};

pub use codec::DynamicCodec;
use schema::{Method, ReflectionError};

use super::error::{EffectError, SettingsError};
use super::input::{as_text, load_secrets, render, saga_vars};
use super::settings::{SecretSource, Settings, pem_certificates, template_of};
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

/// Where calls go: the endpoint and, once the first call made it, its channel (HTTP/2
/// connections shared by every call of this effect).
#[derive(Clone)]
struct Target {
    endpoint: Endpoint,
    channel: Arc<OnceLock<Channel>>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Target")
    }
}

impl Target {
    fn channel(&self) -> Channel {
        self.channel
            .get_or_init(|| self.endpoint.connect_lazy())
            .clone()
    }
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
            target: Target {
                endpoint: endpoint(c)?,
                channel: Arc::default(),
            },
            service,
            method_name,
            known,
            learnt: Arc::default(),
            request,
            ignore_unknown_fields,
            metadata: metadata(c)?,
            success_when: c.condition("success_when")?,
            result: c.template("result")?,
            secrets: c.secrets()?,
            also_retry: retryable_codes(c)?,
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
        let timeout = env.timeout;
        let secrets = load_secrets(&self.secrets)?;
        let saga = saga_vars(command, secrets);
        let empty = json!({});
        let vars = Vars::new(command, &empty, &saga);
        let body = render(&self.request, &vars, "request")?;
        let channel = self.target.channel();
        let method = self.method(effect, &channel).await?;
        let options = DeserializeOptions::new().deny_unknown_fields(!self.ignore_unknown_fields);
        let message =
            DynamicMessage::deserialize_with_options(method.input.clone(), &body, &options)
                .map_err(|e| EffectError::Fatal {
                    reason: format!(
                        "effect `{effect}`: the request does not fit message `{}`: {e}",
                        method.input.full_name()
                    ),
                    details: json!({}),
                })?;
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        let key = AsciiMetadataValue::try_from(command_id).map_err(|_| EffectError::Fatal {
            reason: format!("effect `{effect}`: the command id is not valid metadata"),
            details: json!({}),
        })?;
        let md = request.metadata_mut();
        md.insert(IDEMPOTENCY_KEY_METADATA, key);
        if let Some(tp) = super::forwarded_traceparent(env.traceparent)
            .and_then(|t| AsciiMetadataValue::try_from(t).ok())
        {
            md.insert("traceparent", tp);
        }
        for (name, t) in &self.metadata {
            let value = as_text(render(t, &vars, "metadata")?);
            let value = AsciiMetadataValue::try_from(value).map_err(|_| EffectError::Fatal {
                reason: format!("effect `{effect}`: metadata `{name}` is not printable ASCII text"),
                details: json!({}),
            })?;
            md.insert(name.clone(), value);
        }
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
            .map_err(|status| {
                if reply_too_large(&status) {
                    return EffectError::Fatal {
                        reason: format!(
                            "effect `{effect}`: the reply is larger than the {} bytes a result may have; it was not read",
                            env.max_answer_bytes
                        ),
                        details: json!({}),
                    };
                }
                // The channel enforces the deadline it sends: when it expires first, tonic
                // answers CANCELLED ("Timeout expired"). At the deadline that is a timeout.
                let at_deadline = started.elapsed() + DEADLINE_SLACK >= timeout;
                if at_deadline && status.code() == Code::Cancelled {
                    EffectError::TimedOut(timeout)
                } else {
                    classify(effect, &status, &self.also_retry, timeout)
                }
            })?;
        let body = reply
            .into_inner()
            .serialize_with_options(
                serde_json::value::Serializer,
                &SerializeOptions::new().skip_default_fields(false),
            )
            .map_err(|e| EffectError::Fatal {
                reason: format!("effect `{effect}`: the reply has no JSON form: {e}"),
                details: json!({}),
            })?;
        let response = json!({ "code": 0, "status": "OK", "body": body });
        let after = Vars::new(command, &response, &saga);
        if let Some(cond) = &self.success_when {
            let ok = cond.eval_bool(&after).map_err(|e| EffectError::Fatal {
                reason: format!("effect `{effect}`: success_when: {e}"),
                details: response.clone(),
            })?;
            if !ok {
                return Err(EffectError::Fatal {
                    reason: format!("effect `{effect}`: success_when is false for the reply"),
                    details: response.clone(),
                });
            }
        }
        match &self.result {
            Some(t) => render(t, &after, "result"),
            None => Ok(response["body"].clone()),
        }
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

/// The endpoint, with its TLS settings.
fn endpoint(c: &Settings<'_>) -> Result<Endpoint, SettingsError> {
    let url = match c.get("endpoint") {
        Some(Json::String(u)) => u,
        Some(_) => return Err(c.err("endpoint", "must be a URL string")),
        None => return Err(c.err("endpoint", "is required")),
    };
    if url.contains("${") {
        return Err(c.err(
            "endpoint",
            "is not a template: write the address itself (credentials belong in `metadata`)",
        ));
    }
    let uri: tonic::codegen::http::Uri = url
        .parse()
        .map_err(|_| c.err("endpoint", "is not a URL (`http://host:port`)"))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(c.err("endpoint", "must start with http:// or https://")),
    };
    if uri.host().is_none_or(str::is_empty) {
        return Err(c.err("endpoint", "has no host"));
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err(c.err(
            "endpoint",
            "has a path or query; gRPC calls go to `/package.Service/Method` on the host, \
             so write only `scheme://host:port`",
        ));
    }
    let endpoint = Endpoint::from_shared(url.clone())
        .map_err(|e| c.err("endpoint", e.to_string()))?
        .connect_timeout(Duration::from_secs(10));
    let ca = c.path("tls_ca_file")?;
    let cert = c.path("tls_cert_file")?;
    let key = c.path("tls_key_file")?;
    let name = match c.get("tls_server_name") {
        None => None,
        Some(Json::String(n)) => Some(n.clone()),
        Some(_) => return Err(c.err("tls_server_name", "must be a host name")),
    };
    if !https {
        for (k, set) in [
            ("tls_ca_file", ca.is_some()),
            ("tls_cert_file", cert.is_some()),
            ("tls_key_file", key.is_some()),
            ("tls_server_name", name.is_some()),
        ] {
            if set {
                return Err(c.err(k, "needs an https:// endpoint"));
            }
        }
        return Ok(endpoint);
    }
    let read = |key: &str, p: &std::path::Path| {
        std::fs::read(p).map_err(|e| c.err(key, format!("cannot read `{}`: {e}", p.display())))
    };
    let mut tls = ClientTlsConfig::new();
    tls = match &ca {
        Some(p) => {
            pem_certificates(p).map_err(|e| c.err("tls_ca_file", e))?;
            tls.ca_certificate(Certificate::from_pem(read("tls_ca_file", p)?))
        }
        None => tls.with_webpki_roots(),
    };
    match (&cert, &key) {
        (Some(cp), Some(kp)) => {
            pem_certificates(cp).map_err(|e| c.err("tls_cert_file", e))?;
            tls = tls.identity(Identity::from_pem(
                read("tls_cert_file", cp)?,
                read("tls_key_file", kp)?,
            ));
        }
        (None, None) => {}
        (Some(_), None) => {
            return Err(c.err(
                "tls_cert_file",
                "needs `tls_key_file` (its private key) too",
            ));
        }
        (None, Some(_)) => {
            return Err(c.err(
                "tls_key_file",
                "needs `tls_cert_file` (its certificate) too",
            ));
        }
    }
    if let Some(n) = name {
        tls = tls.domain_name(n);
    }
    endpoint
        .tls_config(tls)
        .map_err(|e| c.err("endpoint", format!("TLS set-up: {e}")))
}

/// The `metadata` setting.
fn metadata(c: &Settings<'_>) -> Result<Vec<(AsciiMetadataKey, Template)>, SettingsError> {
    let m = match c.get("metadata") {
        None => return Ok(Vec::new()),
        Some(Json::Object(m)) => m,
        Some(_) => return Err(c.err("metadata", "must be a map of names to values")),
    };
    m.iter()
        .map(|(k, v)| {
            let at = format!("metadata.{k}");
            let refused = if k.ends_with("-bin") {
                Some("binary (`-bin`) metadata is not supported")
            } else if k.starts_with("grpc-") {
                Some("`grpc-` names are reserved by gRPC")
            } else if k == IDEMPOTENCY_KEY_METADATA
                || k == "traceparent"
                || k == "content-type"
                || k == "te"
            {
                Some("this name is set by the runner")
            } else if *k != k.to_ascii_lowercase() {
                Some("metadata names are lowercase")
            } else {
                None
            };
            if let Some(why) = refused {
                return Err(c.err(&at, why));
            }
            let key = AsciiMetadataKey::from_bytes(k.as_bytes())
                .map_err(|_| c.err(&at, "is not a valid metadata name"))?;
            let t = template_of(v).map_err(|e| c.err(&at, e.to_string()))?;
            Ok((key, t))
        })
        .collect()
}

/// The `retryable_codes` setting: status names added to the retryable ones.
fn retryable_codes(c: &Settings<'_>) -> Result<Vec<Code>, SettingsError> {
    let list = match c.get("retryable_codes") {
        None => return Ok(Vec::new()),
        Some(Json::Array(a)) => a,
        Some(_) => return Err(c.err("retryable_codes", "must be a list of status names")),
    };
    list.iter()
        .map(|v| {
            let name = v.as_str().unwrap_or_default();
            code_named(name)
                .filter(|code| *code != Code::Ok)
                .ok_or_else(|| {
                    c.err(
                        "retryable_codes",
                        format!("{v} is not a gRPC status name (e.g. INTERNAL, UNKNOWN)"),
                    )
                })
        })
        .collect()
}

/// How close to the deadline a cancellation counts as the deadline's.
const DEADLINE_SLACK: Duration = Duration::from_millis(20);

/// The status codes retried whatever the settings.
const RETRYABLE: [Code; 3] = [Code::Unavailable, Code::ResourceExhausted, Code::Aborted];

/// The metadata key of the server's retry pushback.
const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// What a failed call means for the command: a timeout, worth retrying, or fatal.
/// Whether `status` is the client's own refusal of a reply over its decoding limit (tonic
/// answers it as OUT_OF_RANGE, with this message), not a status the upstream sent.
fn reply_too_large(status: &Status) -> bool {
    status.code() == Code::OutOfRange
        && status
            .message()
            .starts_with("Error, decoded message length too large")
}

pub(crate) fn classify(
    effect: &str,
    status: &Status,
    also_retry: &[Code],
    timeout: Duration,
) -> EffectError {
    let code = status.code();
    if code == Code::DeadlineExceeded {
        return EffectError::TimedOut(timeout);
    }
    let details = status_details(status);
    let reason = format!(
        "effect `{effect}`: upstream answered status {}",
        status_name(code)
    );
    if !(RETRYABLE.contains(&code) || also_retry.contains(&code)) {
        return EffectError::Fatal { reason, details };
    }
    let pushback = status
        .metadata()
        .get(PUSHBACK)
        .map(|v| v.to_str().ok().and_then(|s| s.trim().parse::<i64>().ok()));
    match pushback {
        None => EffectError::Retryable {
            reason,
            retry_after: None,
            details,
        },
        Some(Some(ms)) if ms >= 0 => EffectError::Retryable {
            reason,
            retry_after: Some(Duration::from_millis(ms.unsigned_abs())),
            details,
        },
        Some(_) => EffectError::Fatal {
            reason: format!("{reason}; the server asked not to retry ({PUSHBACK})"),
            details,
        },
    }
}

/// A status as a failure payload: `{code, status, message}`.
fn status_details(status: &Status) -> Json {
    json!({
        "code": status.code() as i32,
        "status": status_name(status.code()),
        "message": status.message(),
    })
}

/// The canonical name of a status code (`DEADLINE_EXCEEDED`).
pub fn status_name(code: Code) -> String {
    let mut out = String::new();
    for (i, ch) in format!("{code:?}").chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

/// The code of a canonical status name.
fn code_named(name: &str) -> Option<Code> {
    (0..=16)
        .map(Code::from_i32)
        .find(|c| status_name(*c) == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_canonical_name_and_back() {
        assert_eq!(status_name(Code::DeadlineExceeded), "DEADLINE_EXCEEDED");
        assert_eq!(status_name(Code::Ok), "OK");
        for i in 0..=16 {
            let c = Code::from_i32(i);
            assert_eq!(code_named(&status_name(c)), Some(c), "{c:?}");
        }
        assert_eq!(code_named("NOPE"), None);
    }

    #[test]
    fn statuses_are_classified_as_documented() {
        let t = Duration::from_secs(1);
        let class =
            |code: Code, also: &[Code]| match classify("e", &Status::new(code, "m"), also, t) {
                EffectError::Retryable { .. } => "retry",
                EffectError::TimedOut(_) => "timeout",
                EffectError::Fatal { .. } => "fatal",
                EffectError::CircuitOpen(_) => "open",
            };
        for c in [Code::Unavailable, Code::ResourceExhausted, Code::Aborted] {
            assert_eq!(class(c, &[]), "retry", "{c:?}");
        }
        assert_eq!(class(Code::DeadlineExceeded, &[]), "timeout");
        for c in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::FailedPrecondition,
            Code::Unimplemented,
            Code::Internal,
            Code::Unknown,
            Code::Cancelled,
            Code::OutOfRange,
            Code::DataLoss,
        ] {
            assert_eq!(class(c, &[]), "fatal", "{c:?}");
        }
        assert_eq!(class(Code::Internal, &[Code::Internal]), "retry");
    }

    #[test]
    fn pushback_is_a_wait_or_a_refusal() {
        let with = |v: &str| {
            let mut s = Status::new(Code::Unavailable, "busy");
            s.metadata_mut()
                .insert(PUSHBACK, v.parse().expect("ascii value"));
            classify("e", &s, &[], Duration::from_secs(1))
        };
        match with("250") {
            EffectError::Retryable { retry_after, .. } => {
                assert_eq!(retry_after, Some(Duration::from_millis(250)))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(with("-1"), EffectError::Fatal { .. }));
        assert!(matches!(with("soon"), EffectError::Fatal { .. }));
        let payload = with("5").to_payload();
        assert_eq!(payload["code"], 14);
        assert_eq!(payload["status"], "UNAVAILABLE");
        assert_eq!(payload["message"], "busy");
    }
}
