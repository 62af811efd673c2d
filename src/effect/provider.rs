//! Providers: what one attempt of an effect does, configured by the effect's `settings`.
//!
//! | provider | does |
//! |---|---|
//! | `noop` | calls nothing: succeeds at once with `result` (default `{}`), or fails fatally when `fail_when` holds |
//! | `log` | logs the command (payload size, never its content) and succeeds |
//! | `http` | one HTTP request (rustls for TLS) |
//! | `nats_request` | NATS request/reply to a service subject |
//! | `nats_publish` | publishes the payload on a subject and succeeds |
//! | `smtp` | sends one plain-text mail (see [`super::smtp`]) |
//! | `postgres` | runs one parameterised statement (see [`super::postgres`]) |
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
//! **HTTP settings**: `url` (required), `method` (default `POST`), `headers` (map),
//! `body` (default `${ event.payload }`), `success_status` (list; default any 2xx),
//! `success_when` (CEL over the response), `result` (template; default the response body).
//! Every request carries `Idempotency-Key: <command_id>`, on every attempt.
//! Classification: timeouts, connection errors, 408, 429 (honouring `Retry-After` seconds)
//! and 5xx are retryable; any other non-success answer is fatal.
//!
//! **Noop settings** (both optional; they exist for demos, tests and benchmarks, which need
//! a stand-in service without running one): `result` (template over `event` and `saga`; the
//! success payload, default `{}`) and `fail_when` (CEL over `event` and `saga`; when true the
//! attempt fails fatally — no retry — so the result type is `Failed`). For example
//! `result: { booking_ref: "car-${ event.command_id }" }` with
//! `fail_when: has(event.payload.fail_car) && event.payload.fail_car`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value as Json, json};

use crate::expr::{ExprError, Template, Vars};
use crate::manifest::catalog::Effect;

/// Header carrying the idempotency key on every HTTP attempt.
pub const IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

/// Why one attempt failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EffectError {
    /// Worth retrying (transient upstream trouble).
    #[error("retryable: {reason}")]
    Retryable {
        /// What went wrong.
        reason: String,
        /// Upstream's `Retry-After`, when it sent one.
        retry_after: Option<Duration>,
        /// Details for the result payload (status, body).
        details: Json,
    },
    /// Retrying cannot help.
    #[error("fatal: {reason}")]
    Fatal {
        /// What went wrong.
        reason: String,
        /// Details for the result payload (status, body).
        details: Json,
    },
    /// The attempt outlasted its timeout.
    #[error("timed out after {0:?}")]
    TimedOut(Duration),
    /// The circuit breaker of the upstream is open: no call was made.
    #[error("circuit open for {0}")]
    CircuitOpen(String),
}

impl EffectError {
    /// Whether another attempt may succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, EffectError::Fatal { .. })
    }

    /// Whether this failure says something about the upstream's health.
    pub fn counts_for_breaker(&self) -> bool {
        matches!(
            self,
            EffectError::Retryable { .. } | EffectError::TimedOut(_)
        )
    }

    /// The result payload describing this failure.
    pub fn to_payload(&self) -> Json {
        let mut p = match self {
            EffectError::Retryable { details, .. } | EffectError::Fatal { details, .. } => {
                details.clone()
            }
            _ => json!({}),
        };
        if let Json::Object(m) = &mut p {
            m.insert("error".into(), Json::String(self.to_string()));
        } else {
            p = json!({ "error": self.to_string() });
        }
        p
    }
}

/// Marks an error retryable or fatal in one word.
pub trait ToEffectResult<T> {
    /// Maps the error to [`EffectError::Retryable`].
    fn retryable(self) -> Result<T, EffectError>;
    /// Maps the error to [`EffectError::Fatal`].
    fn fatal(self) -> Result<T, EffectError>;
}

impl<T, E: std::fmt::Display> ToEffectResult<T> for Result<T, E> {
    fn retryable(self) -> Result<T, EffectError> {
        self.map_err(|e| EffectError::Retryable {
            reason: e.to_string(),
            retry_after: None,
            details: json!({}),
        })
    }
    fn fatal(self) -> Result<T, EffectError> {
        self.map_err(|e| EffectError::Fatal {
            reason: e.to_string(),
            details: json!({}),
        })
    }
}

/// A provider's settings could not be understood.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("effect `{effect}`: setting `{setting}`: {message}")]
pub struct SettingsError {
    /// Effect name.
    pub effect: String,
    /// The setting.
    pub setting: String,
    /// What is wrong.
    pub message: String,
}

/// Where a secret comes from.
#[derive(Debug, Clone)]
pub enum SecretSource {
    /// An environment variable.
    Env(String),
    /// A file (its trimmed content).
    File(std::path::PathBuf),
}

/// A compiled provider.
#[derive(Debug, Clone)]
pub enum Provider {
    /// Calls nothing: succeeds with its `result`, or fails when `fail_when` holds.
    Noop(NoopSpec),
    /// Logs and succeeds.
    Log,
    /// HTTP request.
    Http(Box<HttpSpec>),
    /// NATS request/reply.
    NatsRequest(NatsSpec),
    /// NATS publish.
    NatsPublish(NatsSpec),
    /// One parameterised PostgreSQL statement.
    Postgres(
        Box<super::postgres::PostgresSpec>,
        Vec<(String, SecretSource)>,
    ),
    /// One mail through an SMTP server.
    Smtp(Box<super::smtp::SmtpSpec>, Vec<(String, SecretSource)>),
}

/// Compiled HTTP settings.
#[derive(Debug, Clone)]
pub struct HttpSpec {
    method: reqwest::Method,
    url: Template,
    headers: Vec<(String, Template)>,
    body: Template,
    success_status: Vec<u16>,
    success_when: Option<crate::expr::Expr>,
    result: Option<Template>,
    secrets: Vec<(String, SecretSource)>,
}

/// Compiled noop settings.
#[derive(Debug, Clone, Default)]
pub struct NoopSpec {
    result: Option<Template>,
    fail_when: Option<crate::expr::Expr>,
    /// What the two can read: only that is bound for an attempt.
    needs: crate::expr::Needs,
}

impl NoopSpec {
    /// The outcome of one attempt for `command` (the whole envelope).
    fn outcome(&self, effect: &str, command: &Json) -> Result<Json, EffectError> {
        if self.result.is_none() && self.fail_when.is_none() {
            return Ok(json!({}));
        }
        let saga = saga_vars(command, json!({}));
        let empty = json!({});
        let vars = Vars::pruned(command, &[], &empty, &saga, &self.needs);
        if let Some(cond) = &self.fail_when {
            let fail = cond.eval_bool(&vars).map_err(|e| EffectError::Fatal {
                reason: format!("effect `{effect}`: fail_when: {e}"),
                details: json!({}),
            })?;
            if fail {
                return Err(EffectError::Fatal {
                    reason: format!("effect `{effect}`: fail_when is true for the command"),
                    details: json!({}),
                });
            }
        }
        match &self.result {
            Some(t) => render(t, &vars, "result"),
            None => Ok(json!({})),
        }
    }
}

/// Compiled NATS settings.
#[derive(Debug, Clone)]
pub struct NatsSpec {
    subject: Template,
    body: Template,
    result: Option<Template>,
    secrets: Vec<(String, SecretSource)>,
}

/// Compiles a JSON settings value into a template (strings may hold `${ … }`).
pub fn template_of(v: &Json) -> Result<Template, ExprError> {
    Ok(match v {
        Json::String(s) => Template::compile_str(s)?,
        Json::Array(items) => {
            Template::List(items.iter().map(template_of).collect::<Result<_, _>>()?)
        }
        Json::Object(m) => Template::Object(
            m.iter()
                .map(|(k, v)| template_of(v).map(|t| (k.clone(), t)))
                .collect::<Result<_, _>>()?,
        ),
        other => Template::Literal(other.clone()),
    })
}

struct Ctx<'a> {
    effect: &'a str,
    settings: &'a BTreeMap<String, Json>,
}

impl Ctx<'_> {
    fn err(&self, setting: &str, message: impl Into<String>) -> SettingsError {
        SettingsError {
            effect: self.effect.to_string(),
            setting: setting.to_string(),
            message: message.into(),
        }
    }
    fn template(&self, key: &str) -> Result<Option<Template>, SettingsError> {
        self.settings
            .get(key)
            .map(|v| template_of(v).map_err(|e| self.err(key, e.to_string())))
            .transpose()
    }
    fn secrets(&self) -> Result<Vec<(String, SecretSource)>, SettingsError> {
        let Some(v) = self.settings.get("secrets") else {
            return Ok(Vec::new());
        };
        let Json::Object(m) = v else {
            return Err(self.err(
                "secrets",
                "must be a map of name to {env: VAR} or {file: path}",
            ));
        };
        m.iter()
            .map(|(name, src)| {
                let src = match (
                    src.get("env").and_then(Json::as_str),
                    src.get("file").and_then(Json::as_str),
                ) {
                    (Some(var), None) => SecretSource::Env(var.to_string()),
                    (None, Some(path)) => SecretSource::File(path.into()),
                    _ => {
                        return Err(self.err(
                            &format!("secrets.{name}"),
                            "give exactly one of `env` or `file`",
                        ));
                    }
                };
                Ok((name.clone(), src))
            })
            .collect()
    }
}

impl Provider {
    /// Compiles the provider of a declared effect.
    pub fn compile(effect: &Effect) -> Result<Self, SettingsError> {
        let c = Ctx {
            effect: &effect.name,
            settings: &effect.settings,
        };
        let default_body = || template_of(&Json::String("${ event.payload }".into()));
        match effect.provider.as_str() {
            "noop" => {
                let fail_when = match c.settings.get("fail_when") {
                    None => None,
                    Some(Json::String(s)) => Some(
                        crate::expr::Expr::compile(s)
                            .map_err(|e| c.err("fail_when", e.to_string()))?,
                    ),
                    Some(_) => return Err(c.err("fail_when", "must be a CEL string")),
                };
                let result = c.template("result")?;
                let mut needs = crate::expr::Needs::default();
                if let Some(e) = &fail_when {
                    needs.merge(e.needs());
                }
                if let Some(t) = &result {
                    t.add_needs(&mut needs);
                }
                Ok(Provider::Noop(NoopSpec {
                    result,
                    fail_when,
                    needs,
                }))
            }
            "log" => Ok(Provider::Log),
            "http" => {
                let url = c
                    .template("url")?
                    .ok_or_else(|| c.err("url", "is required"))?;
                let method = match c.settings.get("method") {
                    None => reqwest::Method::POST,
                    Some(Json::String(m)) => m
                        .to_ascii_uppercase()
                        .parse()
                        .map_err(|_| c.err("method", format!("{m:?} is not an HTTP method")))?,
                    Some(_) => return Err(c.err("method", "must be a string")),
                };
                let headers = match c.settings.get("headers") {
                    None => Vec::new(),
                    Some(Json::Object(m)) => m
                        .iter()
                        .map(|(k, v)| {
                            reqwest::header::HeaderName::from_bytes(k.as_bytes()).map_err(
                                |_| c.err("headers", format!("{k:?} is not a header name")),
                            )?;
                            template_of(v)
                                .map(|t| (k.clone(), t))
                                .map_err(|e| c.err(&format!("headers.{k}"), e.to_string()))
                        })
                        .collect::<Result<_, _>>()?,
                    Some(_) => return Err(c.err("headers", "must be a map")),
                };
                let body = match c.template("body")? {
                    Some(t) => t,
                    None => default_body().map_err(|e| c.err("body", e.to_string()))?,
                };
                let success_status = match c.settings.get("success_status") {
                    None => Vec::new(),
                    Some(Json::Array(a)) => a
                        .iter()
                        .map(|v| {
                            v.as_u64()
                                .and_then(|n| u16::try_from(n).ok())
                                .ok_or_else(|| c.err("success_status", "must list status codes"))
                        })
                        .collect::<Result<_, _>>()?,
                    Some(_) => return Err(c.err("success_status", "must be a list")),
                };
                let success_when = match c.settings.get("success_when") {
                    None => None,
                    Some(Json::String(s)) => Some(
                        crate::expr::Expr::compile(s)
                            .map_err(|e| c.err("success_when", e.to_string()))?,
                    ),
                    Some(_) => return Err(c.err("success_when", "must be a CEL string")),
                };
                Ok(Provider::Http(Box::new(HttpSpec {
                    method,
                    url,
                    headers,
                    body,
                    success_status,
                    success_when,
                    result: c.template("result")?,
                    secrets: c.secrets()?,
                })))
            }
            "nats_request" | "nats_publish" => {
                let spec = NatsSpec {
                    subject: c
                        .template("subject")?
                        .ok_or_else(|| c.err("subject", "is required"))?,
                    body: match c.template("body")? {
                        Some(t) => t,
                        None => default_body().map_err(|e| c.err("body", e.to_string()))?,
                    },
                    result: c.template("result")?,
                    secrets: c.secrets()?,
                };
                Ok(if effect.provider == "nats_request" {
                    Provider::NatsRequest(spec)
                } else {
                    Provider::NatsPublish(spec)
                })
            }
            "postgres" => {
                let statement = match c.settings.get("statement") {
                    Some(Json::String(s)) if !s.contains("${") => s.clone(),
                    Some(Json::String(_)) => {
                        return Err(c.err(
                            "statement",
                            "must not hold templates: pass values through `params`",
                        ));
                    }
                    _ => return Err(c.err("statement", "is required (a SQL string)")),
                };
                let params = match c.settings.get("params") {
                    None => Vec::new(),
                    Some(Json::Array(items)) => items
                        .iter()
                        .map(|v| template_of(v).map_err(|e| c.err("params", e.to_string())))
                        .collect::<Result<_, _>>()?,
                    Some(_) => return Err(c.err("params", "must be a list")),
                };
                Ok(Provider::Postgres(
                    Box::new(super::postgres::PostgresSpec {
                        url: c
                            .template("url")?
                            .ok_or_else(|| c.err("url", "is required"))?,
                        statement,
                        params,
                    }),
                    c.secrets()?,
                ))
            }
            "smtp" => {
                let req = |k: &str| c.template(k)?.ok_or_else(|| c.err(k, "is required"));
                let port = match c.settings.get("port") {
                    None => 25,
                    Some(v) => v
                        .as_u64()
                        .and_then(|p| u16::try_from(p).ok())
                        .ok_or_else(|| c.err("port", "must be a port number"))?,
                };
                let tls = match c.settings.get("tls").and_then(Json::as_str) {
                    None | Some("starttls") => super::smtp::SmtpTls::StartTls,
                    Some("tls") => super::smtp::SmtpTls::Implicit,
                    Some("none") => super::smtp::SmtpTls::None,
                    Some(other) => {
                        return Err(c.err(
                            "tls",
                            format!("{other:?} is not one of starttls, tls, none"),
                        ));
                    }
                };
                Ok(Provider::Smtp(
                    Box::new(super::smtp::SmtpSpec {
                        host: req("host")?,
                        port,
                        tls,
                        from: req("from")?,
                        to: req("to")?,
                        subject: req("subject")?,
                        body: req("body")?,
                        username: c.template("username")?,
                        password: c.template("password")?,
                    }),
                    c.secrets()?,
                ))
            }
            other => Err(c.err("provider", format!("unknown provider `{other}`"))),
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
}

fn load_secrets(secrets: &[(String, SecretSource)]) -> Result<Json, EffectError> {
    let mut m = serde_json::Map::new();
    for (name, src) in secrets {
        let v = match src {
            SecretSource::Env(var) => std::env::var(var).map_err(|_| EffectError::Fatal {
                reason: format!("secret `{name}`: environment variable {var} is not set"),
                details: json!({}),
            })?,
            SecretSource::File(p) => std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .map_err(|e| EffectError::Fatal {
                    reason: format!("secret `{name}`: cannot read {}: {}", p.display(), e.kind()),
                    details: json!({}),
                })?,
        };
        m.insert(name.clone(), Json::String(v));
    }
    Ok(Json::Object(m))
}

fn saga_vars(command: &Json, secrets: Json) -> Json {
    json!({
        "tenant": command.get("tenant_id").cloned().unwrap_or(Json::Null),
        "name": command.pointer("/metadata/saga").cloned().unwrap_or(Json::Null),
        "correlation_id": command.pointer("/metadata/correlation_id").cloned().unwrap_or(Json::Null),
        "secrets": secrets,
    })
}

fn render(t: &Template, vars: &Vars<'_>, what: &str) -> Result<Json, EffectError> {
    t.render(vars).map_err(|e| EffectError::Fatal {
        reason: format!("template `{what}`: {e}"),
        details: json!({}),
    })
}

fn as_text(v: Json) -> String {
    match v {
        Json::String(s) => s,
        other => other.to_string(),
    }
}

impl Provider {
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
            Provider::Noop(spec) => spec.outcome(effect, command),
            Provider::Log => {
                tracing::info!(
                    message = "Effect command (log provider).",
                    effect,
                    command_id,
                    payload_bytes = command
                        .get("payload")
                        .map(|p| p.to_string().len())
                        .unwrap_or(0)
                );
                Ok(json!({}))
            }
            Provider::Http(spec) => spec.call(effect, command, command_id, env).await,
            Provider::Postgres(spec, secrets) => {
                let saga = saga_vars(command, load_secrets(secrets)?);
                let empty = json!({});
                let vars = Vars::new(command, &empty, &saga);
                spec.call(effect, &vars).await
            }
            Provider::Smtp(spec, secrets) => {
                let saga = saga_vars(command, load_secrets(secrets)?);
                let empty = json!({});
                let vars = Vars::new(command, &empty, &saga);
                spec.call(effect, &vars, command_id, env.timeout).await
            }
            Provider::NatsRequest(spec) | Provider::NatsPublish(spec) => {
                let secrets = load_secrets(&spec.secrets)?;
                let saga = saga_vars(command, secrets);
                let empty = json!({});
                let vars = Vars::new(command, &empty, &saga);
                let subject = as_text(render(&spec.subject, &vars, "subject")?);
                let body = serde_json::to_vec(&render(&spec.body, &vars, "body")?).fatal()?;
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(IDEMPOTENCY_KEY_HEADER, command_id);
                if matches!(self, Provider::NatsPublish(_)) {
                    env.nats
                        .publish_with_headers(subject, headers, body.into())
                        .await
                        .retryable()?;
                    return Ok(json!({}));
                }
                let reply = env
                    .nats
                    .request_with_headers(subject, headers, body.into())
                    .await
                    .map_err(|e| match e.kind() {
                        async_nats::RequestErrorKind::TimedOut => {
                            EffectError::TimedOut(env.timeout)
                        }
                        _ => EffectError::Retryable {
                            reason: format!("request failed: {e}"),
                            retry_after: None,
                            details: json!({}),
                        },
                    })?;
                let body: Json = serde_json::from_slice(&reply.payload).unwrap_or_else(|_| {
                    Json::String(String::from_utf8_lossy(&reply.payload).into())
                });
                let status = reply.status.map(|s| s.as_u16());
                if let Some(s) = status.filter(|s| *s >= 400) {
                    return Err(EffectError::Retryable {
                        reason: format!("service answered status {s}"),
                        retry_after: None,
                        details: json!({ "status": s, "body": body }),
                    });
                }
                let response = json!({ "body": body });
                match &spec.result {
                    Some(t) => render(t, &Vars::new(command, &response, &saga), "result"),
                    None => Ok(response["body"].clone()),
                }
            }
        }
    }
}

fn retry_after(h: &reqwest::header::HeaderMap) -> Option<Duration> {
    h.get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

impl HttpSpec {
    async fn call(
        &self,
        effect: &str,
        command: &Json,
        command_id: &str,
        env: &CallEnv<'_>,
    ) -> Result<Json, EffectError> {
        let secrets = load_secrets(&self.secrets)?;
        let saga = saga_vars(command, secrets);
        let empty = json!({});
        let vars = Vars::new(command, &empty, &saga);
        let url = as_text(render(&self.url, &vars, "url")?);
        let mut req = env
            .http
            .request(self.method.clone(), &url)
            .timeout(env.timeout)
            .header(IDEMPOTENCY_KEY_HEADER, command_id);
        for (name, t) in &self.headers {
            req = req.header(name.as_str(), as_text(render(t, &vars, "headers")?));
        }
        if self.method != reqwest::Method::GET && self.method != reqwest::Method::HEAD {
            req = req.json(&render(&self.body, &vars, "body")?);
        }
        // Errors never carry the URL: it may hold a secret.
        let resp = req.send().await.map_err(|e| {
            if e.is_timeout() {
                EffectError::TimedOut(env.timeout)
            } else if e.is_builder() {
                EffectError::Fatal {
                    reason: format!(
                        "effect `{effect}`: cannot build the request: {}",
                        e.without_url()
                    ),
                    details: json!({}),
                }
            } else {
                EffectError::Retryable {
                    reason: format!("effect `{effect}`: request failed: {}", e.without_url()),
                    retry_after: None,
                    details: json!({}),
                }
            }
        })?;
        let status = resp.status().as_u16();
        let after = retry_after(resp.headers());
        let bytes = resp.bytes().await.map_err(|e| {
            if e.is_timeout() {
                EffectError::TimedOut(env.timeout)
            } else {
                EffectError::Retryable {
                    reason: format!(
                        "effect `{effect}`: reading the response failed: {}",
                        e.without_url()
                    ),
                    retry_after: None,
                    details: json!({ "status": status }),
                }
            }
        })?;
        let body: Json = if bytes.is_empty() {
            Json::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Json::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        let details = json!({ "status": status, "body": body });
        let status_ok = if self.success_status.is_empty() {
            (200..300).contains(&status)
        } else {
            self.success_status.contains(&status)
        };
        if !status_ok {
            let reason = format!("effect `{effect}`: upstream answered status {status}");
            return Err(if status == 408 || status == 429 || status >= 500 {
                EffectError::Retryable {
                    reason,
                    retry_after: after,
                    details,
                }
            } else {
                EffectError::Fatal { reason, details }
            });
        }
        let response = details;
        let after_vars = Vars::new(command, &response, &saga);
        if let Some(cond) = &self.success_when {
            let ok = cond
                .eval_bool(&after_vars)
                .map_err(|e| EffectError::Fatal {
                    reason: format!("effect `{effect}`: success_when: {e}"),
                    details: response.clone(),
                })?;
            if !ok {
                return Err(EffectError::Fatal {
                    reason: format!("effect `{effect}`: success_when is false for the response"),
                    details: response.clone(),
                });
            }
        }
        match &self.result {
            Some(t) => render(t, &after_vars, "result"),
            None => Ok(match &response["body"] {
                Json::Null => json!({}),
                b => b.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop(settings: Json) -> Result<Provider, SettingsError> {
        let settings = match settings {
            Json::Object(m) => m.into_iter().collect(),
            _ => BTreeMap::new(),
        };
        Provider::compile(&Effect {
            name: "reserve_car".into(),
            provider: "noop".into(),
            settings,
            timeout_ms: None,
            retry: None,
            circuit_breaker: None,
        })
    }

    fn outcome(p: &Provider, command: &Json) -> Result<Json, EffectError> {
        let Provider::Noop(spec) = p else {
            panic!("not a noop provider: {p:?}")
        };
        spec.outcome("reserve_car", command)
    }

    #[test]
    fn noop_settings_shape_the_outcome() {
        let cmd = |fail: bool| {
            json!({
                "command_id": "c1",
                "tenant_id": "acme",
                "payload": {"trip_id": "t7", "fail_car": fail},
                "metadata": {"saga": "travel", "correlation_id": "t7"},
            })
        };
        // No settings: an empty object, as before.
        let plain = noop(json!({})).expect("compiles");
        assert_eq!(outcome(&plain, &cmd(true)), Ok(json!({})));

        let p = noop(json!({
            "result": {"booking_ref": "car-${ event.payload.trip_id }", "by": "${ saga.name }"},
            "fail_when": "event.payload.fail_car",
        }))
        .expect("compiles");
        assert_eq!(
            outcome(&p, &cmd(false)),
            Ok(json!({"booking_ref": "car-t7", "by": "travel"}))
        );
        let err = outcome(&p, &cmd(true)).expect_err("fails when asked to");
        assert!(!err.is_retryable(), "a noop failure is final: {err}");

        // A condition that cannot be evaluated fails the attempt, fatally.
        let broken = noop(json!({"fail_when": "event.payload.missing.deeper"})).expect("compiles");
        assert!(
            !outcome(&broken, &cmd(false))
                .expect_err("fails")
                .is_retryable()
        );
    }

    #[test]
    fn noop_settings_are_checked() {
        let e = noop(json!({"fail_when": true})).expect_err("not a string");
        assert_eq!(e.setting, "fail_when");
        let e = noop(json!({"fail_when": "event.payload.("})).expect_err("not CEL");
        assert_eq!(e.setting, "fail_when");
        let e = noop(json!({"result": "${ event.( }"})).expect_err("bad template");
        assert_eq!(e.setting, "result");
    }
}
