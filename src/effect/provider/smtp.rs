//! The `smtp` provider: one plain-text mail per command, through `lettre`.
//!
//! Settings (strings are templates, see [`super`]): `host` (required), `port`
//! (default 25), `tls` (`starttls` — the default —, `tls` for implicit TLS, or `none`),
//! `from`, `to` (a string or a list), `subject`, `body`, and optionally `username` and
//! `password` (usually `${ saga.secrets.… }`).
//!
//! SMTP has no idempotency key; the mail carries `Message-ID: <command_id@runner>` so a
//! receiver can drop a second copy. Classification: 4xx replies, timeouts and connection
//! errors are retryable; 5xx replies and invalid addresses are fatal.
//!
//! Guarantee: every copy of a command's mail carries the same `Message-ID`, whichever
//! executor or attempt sent it.

use std::time::Duration;

use lettre::message::{Mailbox, header::ContentType};
use lettre::transport::smtp::authentication::Credentials;
use lettre::{AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};
use serde_json::{Value as Json, json};

use super::error::{EffectError, SettingsError, ToEffectResult};
use super::input::{load_secrets, saga_vars};
use super::settings::{SecretSource, Settings};
use crate::expr::{Template, Vars};

/// How the connection is secured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpTls {
    /// Plain connection (local relays, tests).
    None,
    /// Upgrade with STARTTLS (required).
    StartTls,
    /// TLS from the first byte.
    Implicit,
}

/// Compiled SMTP settings.
#[derive(Debug, Clone)]
pub struct SmtpSpec {
    /// Server host.
    host: Template,
    /// Server port.
    port: u16,
    /// Connection security.
    tls: SmtpTls,
    /// Sender.
    from: Template,
    /// Recipients.
    to: Template,
    /// Subject.
    subject: Template,
    /// Text body.
    body: Template,
    /// User name.
    username: Option<Template>,
    /// Password.
    password: Option<Template>,
    /// Secrets the templates may read.
    secrets: Vec<(String, SecretSource)>,
}

fn text(t: &Template, vars: &Vars<'_>, what: &str) -> Result<String, EffectError> {
    match t.render(vars) {
        Ok(Json::String(s)) => Ok(s),
        Ok(other) => Ok(other.to_string()),
        Err(e) => Err(EffectError::Fatal {
            reason: format!("template `{what}`: {e}"),
            details: json!({}),
        }),
    }
}

fn mailbox(s: &str, what: &str) -> Result<Mailbox, EffectError> {
    s.parse().map_err(|e| EffectError::Fatal {
        reason: format!("`{what}` is not a mail address: {e}"),
        details: json!({}),
    })
}

impl SmtpSpec {
    /// Reads and checks the settings.
    pub(super) fn compile(c: &Settings<'_>) -> Result<Self, SettingsError> {
        let req = |k: &str| c.template(k)?.ok_or_else(|| c.err(k, "is required"));
        let port = match c.get("port") {
            None => 25,
            Some(v) => v
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| c.err("port", "must be a port number"))?,
        };
        let tls = match c.get("tls").and_then(Json::as_str) {
            None | Some("starttls") => SmtpTls::StartTls,
            Some("tls") => SmtpTls::Implicit,
            Some("none") => SmtpTls::None,
            Some(other) => {
                return Err(c.err(
                    "tls",
                    format!("{other:?} is not one of starttls, tls, none"),
                ));
            }
        };
        Ok(Self {
            host: req("host")?,
            port,
            tls,
            from: req("from")?,
            to: req("to")?,
            subject: req("subject")?,
            body: req("body")?,
            username: c.template("username")?,
            password: c.template("password")?,
            secrets: c.secrets()?,
        })
    }

    /// Sends the mail for one attempt of `command` (the whole envelope).
    pub(super) async fn call(
        &self,
        effect: &str,
        command: &Json,
        command_id: &str,
        timeout: Duration,
    ) -> Result<Json, EffectError> {
        let saga = saga_vars(command, load_secrets(&self.secrets)?);
        let empty = json!({});
        let vars = &Vars::new(command, &empty, &saga);
        let host = text(&self.host, vars, "host")?;
        let from = mailbox(&text(&self.from, vars, "from")?, "from")?;
        let recipients = match self.to.render(vars) {
            Ok(Json::Array(items)) => items
                .iter()
                .map(|v| mailbox(v.as_str().unwrap_or_default(), "to"))
                .collect::<Result<Vec<_>, _>>()?,
            Ok(Json::String(s)) => vec![mailbox(&s, "to")?],
            Ok(_) => {
                return Err(EffectError::Fatal {
                    reason: "`to` must be an address or a list of addresses".into(),
                    details: json!({}),
                });
            }
            Err(e) => {
                return Err(EffectError::Fatal {
                    reason: format!("template `to`: {e}"),
                    details: json!({}),
                });
            }
        };
        let mut builder = Message::builder()
            .from(from)
            .subject(text(&self.subject, vars, "subject")?)
            .message_id(Some(format!("<{command_id}@runner>")))
            .header(ContentType::TEXT_PLAIN);
        for r in recipients {
            builder = builder.to(r);
        }
        let mail = builder.body(text(&self.body, vars, "body")?).fatal()?;
        let mut transport = match self.tls {
            SmtpTls::None => AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(host.clone()),
            SmtpTls::StartTls => {
                AsyncSmtpTransport::<Tokio1Executor>::starttls_relay(&host).fatal()?
            }
            SmtpTls::Implicit => AsyncSmtpTransport::<Tokio1Executor>::relay(&host).fatal()?,
        }
        .port(self.port)
        .timeout(Some(timeout));
        if let (Some(u), Some(p)) = (&self.username, &self.password) {
            transport = transport.credentials(Credentials::new(
                text(u, vars, "username")?,
                text(p, vars, "password")?,
            ));
        }
        let reply = transport.build().send(mail).await.map_err(|e| {
            let code = e.status().map(|c| c.to_string());
            let reason = format!("effect `{effect}`: SMTP: {e}");
            let details = json!({ "code": code });
            if e.is_permanent() {
                EffectError::Fatal { reason, details }
            } else if e.is_timeout() {
                EffectError::TimedOut(timeout)
            } else {
                EffectError::Retryable {
                    reason,
                    retry_after: None,
                    details,
                }
            }
        })?;
        Ok(json!({
            "code": reply.code().to_string(),
            "message": reply.message().collect::<Vec<_>>(),
            "message_id": format!("<{command_id}@runner>"),
        }))
    }
}
