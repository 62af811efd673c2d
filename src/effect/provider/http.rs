//! The `http` provider: one HTTP request per attempt (reqwest, rustls for TLS).
//!
//! Settings: `url` (required; what input may change in it is [`super::url`]'s rule),
//! `allowed_hosts` (list; needed when input may give the URL's scheme, host or port),
//! `method` (default `POST`), `headers` (map), `body` (default `${ event.payload }`),
//! `success_status` (list; default any 2xx), `success_when` (CEL over the response, `state` =
//! `{status, body}`), `result` (template; default the response body).
//!
//! Classification: timeouts, connection errors, 408, 429 (honouring `Retry-After`, seconds or an HTTP date)
//! and 5xx are retryable; any other non-success answer, a request that cannot be built, and
//! a false `success_when` are fatal.
//!
//! The answer is read as it arrives and refused (fatal) as soon as it passes the largest
//! result a command may have ([`super::CallEnv::max_answer_bytes`]): a large answer never
//! costs more memory than that.
//!
//! Guarantees: every request carries `Idempotency-Key: <command_id>`, on every attempt, and
//! the command's `traceparent` when it has a well-formed one; an
//! error never carries the URL or a header value (either may hold a secret), only the
//! effect, the status and the response body.

use std::time::Duration;

use serde_json::{Value as Json, json};

use super::error::{EffectError, SettingsError};
use super::input::{IDEMPOTENCY_KEY_HEADER, as_text, load_secrets, render, saga_vars};
use super::settings::{SecretSource, Settings, template_of};
use crate::expr::{Expr, Template, Vars};

/// Compiled HTTP settings.
#[derive(Debug, Clone)]
pub struct HttpSpec {
    method: reqwest::Method,
    url: super::url::UrlTemplate,
    headers: Vec<(String, Template)>,
    body: Template,
    success_status: Vec<u16>,
    success_when: Option<Expr>,
    result: Option<Template>,
    secrets: Vec<(String, SecretSource)>,
}

impl HttpSpec {
    /// Reads and checks the settings.
    pub(super) fn compile(c: &Settings<'_>) -> Result<Self, SettingsError> {
        let allowed_hosts = match c.get("allowed_hosts") {
            None => Vec::new(),
            Some(Json::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| c.err("allowed_hosts", "must list host names"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(c.err("allowed_hosts", "must be a list")),
        };
        let url = c
            .template("url")?
            .ok_or_else(|| c.err("url", "is required"))?;
        let url = super::url::UrlTemplate::compile(url, &allowed_hosts).map_err(|m| {
            let key = if m.starts_with("`allowed_hosts`") {
                "allowed_hosts"
            } else {
                "url"
            };
            c.err(key, m)
        })?;
        let method = match c.get("method") {
            None => reqwest::Method::POST,
            Some(Json::String(m)) => m
                .to_ascii_uppercase()
                .parse()
                .map_err(|_| c.err("method", format!("{m:?} is not an HTTP method")))?,
            Some(_) => return Err(c.err("method", "must be a string")),
        };
        let headers = match c.get("headers") {
            None => Vec::new(),
            Some(Json::Object(m)) => m
                .iter()
                .map(|(k, v)| {
                    reqwest::header::HeaderName::from_bytes(k.as_bytes())
                        .map_err(|_| c.err("headers", format!("{k:?} is not a header name")))?;
                    template_of(v)
                        .map(|t| (k.clone(), t))
                        .map_err(|e| c.err(&format!("headers.{k}"), e.to_string()))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(c.err("headers", "must be a map")),
        };
        let body = c.body_or_payload()?;
        let success_status = match c.get("success_status") {
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
        let success_when = c.condition("success_when")?;
        Ok(Self {
            method,
            url,
            headers,
            body,
            success_status,
            success_when,
            result: c.template("result")?,
            secrets: c.secrets()?,
        })
    }

    /// Sends the request for one attempt of `command` (the whole envelope); `timeout`
    /// bounds the whole exchange.
    pub(super) async fn call(
        &self,
        effect: &str,
        command: &Json,
        command_id: &str,
        env: &super::CallEnv<'_>,
    ) -> Result<Json, EffectError> {
        let (http, timeout) = (env.http, env.timeout);
        let secrets = load_secrets(&self.secrets)?;
        let saga = saga_vars(command, secrets);
        let empty = json!({});
        let vars = Vars::new(command, &empty, &saga);
        let url = self.url.render(&vars).map_err(|why| EffectError::Fatal {
            reason: format!("effect `{effect}`: url: {why}"),
            details: json!({}),
        })?;
        let mut req = http
            .request(self.method.clone(), &url)
            .timeout(timeout)
            .header(IDEMPOTENCY_KEY_HEADER, command_id);
        if let Some(tp) = super::forwarded_traceparent(env.traceparent) {
            req = req.header("traceparent", tp);
        }
        for (name, t) in &self.headers {
            req = req.header(name.as_str(), as_text(render(t, &vars, "headers")?));
        }
        if self.method != reqwest::Method::GET && self.method != reqwest::Method::HEAD {
            req = req.json(&render(&self.body, &vars, "body")?);
        }
        // Errors never carry the URL: it may hold a secret.
        let resp = req.send().await.map_err(|e| {
            if e.is_timeout() {
                EffectError::TimedOut(timeout)
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
        let bytes = read_capped(resp, env.max_answer_bytes)
            .await
            .map_err(|e| match e {
                Read::TooLarge(n) => EffectError::Fatal {
                    reason: format!(
                        "effect `{effect}`: the answer is larger than the {n} bytes a result may have"
                    ),
                    details: json!({ "status": status }),
                },
                Read::Failed(e) if e.is_timeout() => EffectError::TimedOut(timeout),
                Read::Failed(e) => EffectError::Retryable {
                    reason: format!(
                        "effect `{effect}`: reading the response failed: {}",
                        e.without_url()
                    ),
                    retry_after: None,
                    details: json!({ "status": status }),
                },
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

/// Why an answer was not read whole.
enum Read {
    /// It passes this many bytes.
    TooLarge(usize),
    /// The transfer failed.
    Failed(reqwest::Error),
}

/// The answer's body, read as it arrives, refused once it passes `cap` bytes (0: no cap);
/// an announced `Content-Length` over the cap is refused before anything is read.
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, Read> {
    let cap = if cap == 0 { usize::MAX } else { cap };
    if resp
        .content_length()
        .is_some_and(|n| n > u64::try_from(cap).unwrap_or(u64::MAX))
    {
        return Err(Read::TooLarge(cap));
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(Read::Failed)? {
        if out.len() + chunk.len() > cap {
            return Err(Read::TooLarge(cap));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// The upstream's `Retry-After`: a number of seconds, or an HTTP date (the wait until then;
/// a date already past means no wait).
fn retry_after(h: &reqwest::header::HeaderMap) -> Option<Duration> {
    let v = h.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod retry_after_tests {
    use super::*;

    fn header(v: &str) -> reqwest::header::HeaderMap {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(
            reqwest::header::RETRY_AFTER,
            v.parse().expect("header value"),
        );
        h
    }

    #[test]
    fn seconds_and_http_dates_are_both_read() {
        assert_eq!(retry_after(&header("7")), Some(Duration::from_secs(7)));
        let later = std::time::SystemTime::now() + Duration::from_secs(120);
        let got = retry_after(&header(&httpdate::fmt_http_date(later))).expect("a date");
        assert!(
            got > Duration::from_secs(110) && got <= Duration::from_secs(120),
            "{got:?}"
        );
        assert_eq!(
            retry_after(&header("Wed, 21 Oct 2015 07:28:00 GMT")),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&header("soon")), None);
    }
}
