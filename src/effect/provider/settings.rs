//! Reading a provider's `settings` when an effect is compiled.
//!
//! Owns the reader every provider's `compile` uses (`Settings`): settings strings become
//! templates ([`template_of`]), and `secrets` become declarations of where each secret lives
//! ([`SecretSource`]) — the value itself is read only when an attempt is prepared (see
//! `input.rs`).
//!
//! Guarantee: every problem is a [`SettingsError`] naming the effect and the setting, found
//! at load or reload time, never during a call.

use std::collections::BTreeMap;

use serde_json::Value as Json;

use super::error::SettingsError;
use crate::expr::{ExprError, Template};

/// Where a secret comes from.
#[derive(Debug, Clone)]
pub enum SecretSource {
    /// An environment variable.
    Env(String),
    /// A file (its trimmed content).
    File(std::path::PathBuf),
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

/// The settings of one effect, with the effect's name for the errors.
pub(super) struct Settings<'a> {
    pub(super) effect: &'a str,
    pub(super) settings: &'a BTreeMap<String, Json>,
    /// The directory of the manifest file that declares the effect: relative paths in
    /// settings are read from there, so a manifest and the files it names move together.
    pub(super) base: Option<&'a std::path::Path>,
}

impl Settings<'_> {
    /// The raw value of a setting.
    pub(super) fn get(&self, key: &str) -> Option<&Json> {
        self.settings.get(key)
    }

    /// An error about `setting`.
    pub(super) fn err(&self, setting: &str, message: impl Into<String>) -> SettingsError {
        SettingsError {
            effect: self.effect.to_string(),
            setting: setting.to_string(),
            message: message.into(),
        }
    }

    /// An optional file path: a string, relative to the manifest's directory unless absolute.
    pub(super) fn path(&self, key: &str) -> Result<Option<std::path::PathBuf>, SettingsError> {
        match self.settings.get(key) {
            None => Ok(None),
            Some(Json::String(p)) if !p.is_empty() => {
                let p = std::path::Path::new(p);
                Ok(Some(match self.base {
                    Some(base) if p.is_relative() => base.join(p),
                    _ => p.to_path_buf(),
                }))
            }
            Some(_) => Err(self.err(key, "must be a file path (a string)")),
        }
    }

    /// An optional setting, compiled as a template.
    pub(super) fn template(&self, key: &str) -> Result<Option<Template>, SettingsError> {
        self.settings
            .get(key)
            .map(|v| template_of(v).map_err(|e| self.err(key, e.to_string())))
            .transpose()
    }

    /// The `body` setting, or `${ event.payload }` when it is absent.
    pub(super) fn body_or_payload(&self) -> Result<Template, SettingsError> {
        match self.template("body")? {
            Some(t) => Ok(t),
            None => template_of(&Json::String("${ event.payload }".into()))
                .map_err(|e| self.err("body", e.to_string())),
        }
    }

    /// An optional CEL condition.
    pub(super) fn condition(&self, key: &str) -> Result<Option<crate::expr::Expr>, SettingsError> {
        match self.settings.get(key) {
            None => Ok(None),
            Some(Json::String(s)) => Ok(Some(
                crate::expr::Expr::compile(s).map_err(|e| self.err(key, e.to_string()))?,
            )),
            Some(_) => Err(self.err(key, "must be a CEL string")),
        }
    }

    /// The `secrets` declarations: `name: {env: VAR} | {file: path}`.
    pub(super) fn secrets(&self) -> Result<Vec<(String, SecretSource)>, SettingsError> {
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

/// The certificates of a PEM bundle; an unreadable file, a malformed one or one holding no
/// certificate is an error naming the file.
pub(super) fn pem_certificates(
    path: &std::path::Path,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read `{shown}`: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("`{shown}` is not a PEM certificate bundle: {e}"))?;
    if certs.is_empty() {
        return Err(format!("`{shown}` holds no certificate"));
    }
    Ok(certs)
}
