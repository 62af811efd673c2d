//! The `postgres` provider: one parameterised statement per command (`tokio-postgres`).
//!
//! Settings: `url` (required; a connection string, usually `${ saga.secrets.… }`),
//! `statement` (required; SQL with `$1`, `$2`… placeholders, never a template: values go in
//! `params` only, so a payload can never change the SQL), `params` (a list of templates).
//! Each rendered value is converted to the type the server inferred for its placeholder
//! (bool, int2/4/8, float4/8, text/varchar, json/jsonb); `null` binds SQL NULL. The result
//! is `{ "rows": <rows affected> }`.
//!
//! Idempotency is the statement's business (e.g. `INSERT … ON CONFLICT (command_id) DO
//! NOTHING` with `${ event.command_id }` as a parameter). Classification: connection
//! errors and SQLSTATE classes 08 (connection), 40 (rollback: serialization, deadlock),
//! 53 (insufficient resources) and 57 (operator intervention) are retryable; everything
//! else is fatal.
//!
//! TLS: a connection string with `sslmode=require` connects over TLS (rustls) and verifies
//! the server's certificate and name — against the PEM CA bundle in the `tls_ca_file`
//! setting when given, else against the public web roots — so it is stricter than libpq's
//! `require`. `sslmode=disable` and `prefer` (the default) connect in plain text: nothing is
//! encrypted without being verified. The CA file is read when the manifest is loaded, so a
//! missing or unreadable file is a manifest error.
//!
//! Guarantees: no value from a command is ever part of the SQL text; errors name the effect
//! and the SQLSTATE, never the connection string (it may hold a password).

use serde_json::{Value as Json, json};
use tokio_postgres::types::{ToSql, Type};

use super::error::{EffectError, SettingsError};
use super::input::{load_secrets, saga_vars};
use super::settings::{SecretSource, Settings, template_of};
use crate::expr::{Template, Vars};

/// Compiled PostgreSQL settings.
#[derive(Debug, Clone)]
pub struct PostgresSpec {
    /// Connection string.
    url: Template,
    /// The statement (literal SQL).
    statement: String,
    /// Parameter templates.
    params: Vec<Template>,
    /// Secrets the templates may read.
    secrets: Vec<(String, SecretSource)>,
    /// TLS for `sslmode=require`: the roots to verify servers against.
    tls: Tls,
}

/// The TLS connector (its roots are not worth printing).
#[derive(Clone)]
struct Tls(tokio_postgres_rustls::MakeRustlsConnect);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

/// The TLS set-up for `sslmode=require`: roots from `ca_file` (PEM), else the web roots.
fn tls_config(ca_file: Option<&std::path::Path>) -> Result<Tls, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for c in super::settings::pem_certificates(path)? {
                roots
                    .add(c)
                    .map_err(|e| format!("`{}`: unusable certificate: {e}", path.display()))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Tls(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
}

fn classify(effect: &str, e: &tokio_postgres::Error) -> EffectError {
    let code = e.code().map(|c| c.code().to_string());
    let reason = format!("effect `{effect}`: PostgreSQL: {e}");
    let details = json!({ "sqlstate": code });
    let retryable = match &code {
        Some(c) => ["08", "40", "53", "57"].iter().any(|p| c.starts_with(p)),
        None => true,
    };
    if retryable {
        EffectError::Retryable {
            reason,
            retry_after: None,
            details,
        }
    } else {
        EffectError::Fatal { reason, details }
    }
}

fn bind(v: &Json, ty: &Type, i: usize) -> Result<Box<dyn ToSql + Sync + Send>, String> {
    let bad = || format!("parameter ${} ({v}) does not fit type {ty}", i + 1);
    Ok(match *ty {
        Type::BOOL => Box::new(if v.is_null() {
            None
        } else {
            Some(v.as_bool().ok_or_else(bad)?)
        }),
        Type::INT2 => Box::new(if v.is_null() {
            None
        } else {
            Some(
                v.as_i64()
                    .and_then(|n| i16::try_from(n).ok())
                    .ok_or_else(bad)?,
            )
        }),
        Type::INT4 => Box::new(if v.is_null() {
            None
        } else {
            Some(
                v.as_i64()
                    .and_then(|n| i32::try_from(n).ok())
                    .ok_or_else(bad)?,
            )
        }),
        Type::INT8 => Box::new(if v.is_null() {
            None
        } else {
            Some(v.as_i64().ok_or_else(bad)?)
        }),
        Type::FLOAT4 => Box::new(if v.is_null() {
            None
        } else {
            Some(v.as_f64().ok_or_else(bad)? as f32)
        }),
        Type::FLOAT8 => Box::new(if v.is_null() {
            None
        } else {
            Some(v.as_f64().ok_or_else(bad)?)
        }),
        Type::JSON | Type::JSONB => Box::new(v.clone()),
        Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN => {
            Box::new(match v {
                Json::Null => None,
                Json::String(s) => Some(s.clone()),
                other => Some(other.to_string()),
            })
        }
        _ => return Err(format!("parameter ${}: type {ty} is not supported", i + 1)),
    })
}

impl PostgresSpec {
    /// Reads and checks the settings; a statement holding a template is refused.
    pub(super) fn compile(c: &Settings<'_>) -> Result<Self, SettingsError> {
        let statement = match c.get("statement") {
            Some(Json::String(s)) if !s.contains("${") => s.clone(),
            Some(Json::String(_)) => {
                return Err(c.err(
                    "statement",
                    "must not hold templates: pass values through `params`",
                ));
            }
            _ => return Err(c.err("statement", "is required (a SQL string)")),
        };
        let params = match c.get("params") {
            None => Vec::new(),
            Some(Json::Array(items)) => items
                .iter()
                .map(|v| template_of(v).map_err(|e| c.err("params", e.to_string())))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(c.err("params", "must be a list")),
        };
        Ok(Self {
            url: c
                .template("url")?
                .ok_or_else(|| c.err("url", "is required"))?,
            statement,
            params,
            secrets: c.secrets()?,
            tls: tls_config(c.path("tls_ca_file")?.as_deref())
                .map_err(|e| c.err("tls_ca_file", e))?,
        })
    }

    /// Runs the statement for one attempt of `command` (the whole envelope).
    pub(super) async fn call(&self, effect: &str, command: &Json) -> Result<Json, EffectError> {
        let saga = saga_vars(command, load_secrets(&self.secrets)?);
        let empty = json!({});
        let vars = &Vars::new(command, &empty, &saga);
        let fatal = |reason: String| EffectError::Fatal {
            reason,
            details: json!({}),
        };
        let url = match self.url.render(vars) {
            Ok(Json::String(s)) => s,
            Ok(_) => return Err(fatal("`url` must render to a string".into())),
            Err(e) => return Err(fatal(format!("template `url`: {e}"))),
        };
        let values = self
            .params
            .iter()
            .map(|t| t.render(vars))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| fatal(format!("template `params`: {e}")))?;
        // The connection string may hold a password: errors name the effect, not the URL.
        let cannot_connect = |e: tokio_postgres::Error| EffectError::Retryable {
            reason: format!(
                "effect `{effect}`: cannot connect to PostgreSQL: {}",
                e.code().map(|c| c.code()).unwrap_or("connection failed")
            ),
            retry_after: None,
            details: json!({}),
        };
        let config: tokio_postgres::Config = url.parse().map_err(|_| {
            fatal(format!(
                "effect `{effect}`: `url` is not a connection string"
            ))
        })?;
        let (client, conn) = if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
            let (client, connection) = config
                .connect(self.tls.0.clone())
                .await
                .map_err(cannot_connect)?;
            let conn = tokio::spawn(async move {
                let _ = connection.await;
            });
            (client, conn)
        } else {
            let (client, connection) = config
                .connect(tokio_postgres::NoTls)
                .await
                .map_err(cannot_connect)?;
            let conn = tokio::spawn(async move {
                let _ = connection.await;
            });
            (client, conn)
        };
        let result = async {
            let stmt = client
                .prepare(&self.statement)
                .await
                .map_err(|e| classify(effect, &e))?;
            if stmt.params().len() != values.len() {
                return Err(fatal(format!(
                    "the statement has {} placeholders but `params` has {} values",
                    stmt.params().len(),
                    values.len()
                )));
            }
            let bound = values
                .iter()
                .zip(stmt.params())
                .enumerate()
                .map(|(i, (v, ty))| bind(v, ty, i))
                .collect::<Result<Vec<_>, _>>()
                .map_err(fatal)?;
            let refs: Vec<&(dyn ToSql + Sync)> = bound
                .iter()
                .map(|b| b.as_ref() as &(dyn ToSql + Sync))
                .collect();
            let rows = client
                .execute(&stmt, &refs)
                .await
                .map_err(|e| classify(effect, &e))?;
            Ok(json!({ "rows": rows }))
        }
        .await;
        drop(client);
        let _ = conn.await;
        result
    }
}
