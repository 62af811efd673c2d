//! What the `grpc` provider sends: the `metadata` setting, and the request of one attempt
//! built from the rendered `request` template.
//!
//! Owns the mapping of the rendered JSON onto the method's request message (the protobuf
//! JSON mapping, unknown keys refused unless `ignore_unknown_fields`), the call's deadline,
//! and the metadata every attempt carries.
//!
//! Guarantees: every request carries `idempotency-key: <command_id>`, and the command's
//! `traceparent` when it is well formed; the names the runner sets itself, binary (`-bin`)
//! and `grpc-` names are refused in `metadata` when the manifest is loaded; an error names
//! a metadata entry, never its value.

use prost_reflect::{DeserializeOptions, DynamicMessage};
use serde_json::{Value as Json, json};
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};

use super::super::error::{EffectError, SettingsError};
use super::super::input::{as_text, render};
use super::super::settings::{Settings, template_of};
use super::schema::Method;
use super::{GrpcSpec, IDEMPOTENCY_KEY_METADATA};
use crate::expr::{Template, Vars};

impl GrpcSpec {
    /// The request of one attempt: `body` (the rendered `request` template) as a message
    /// of the method's input type, with the attempt's deadline and metadata.
    pub(super) fn build_request(
        &self,
        effect: &str,
        method: &Method,
        body: &Json,
        vars: &Vars<'_>,
        command_id: &str,
        env: &super::super::CallEnv<'_>,
    ) -> Result<tonic::Request<DynamicMessage>, EffectError> {
        let options = DeserializeOptions::new().deny_unknown_fields(!self.ignore_unknown_fields);
        let message =
            DynamicMessage::deserialize_with_options(method.input.clone(), body, &options)
                .map_err(|e| EffectError::Fatal {
                    reason: format!(
                        "effect `{effect}`: the request does not fit message `{}`: {e}",
                        method.input.full_name()
                    ),
                    details: json!({}),
                })?;
        let mut request = tonic::Request::new(message);
        request.set_timeout(env.timeout);
        let key = AsciiMetadataValue::try_from(command_id).map_err(|_| EffectError::Fatal {
            reason: format!("effect `{effect}`: the command id is not valid metadata"),
            details: json!({}),
        })?;
        let md = request.metadata_mut();
        md.insert(IDEMPOTENCY_KEY_METADATA, key);
        if let Some(tp) = super::super::forwarded_traceparent(env.traceparent)
            .and_then(|t| AsciiMetadataValue::try_from(t).ok())
        {
            md.insert("traceparent", tp);
        }
        for (name, t) in &self.metadata {
            let value = as_text(render(t, vars, "metadata")?);
            let value = AsciiMetadataValue::try_from(value).map_err(|_| EffectError::Fatal {
                reason: format!("effect `{effect}`: metadata `{name}` is not printable ASCII text"),
                details: json!({}),
            })?;
            md.insert(name.clone(), value);
        }
        Ok(request)
    }
}

/// The `metadata` setting.
pub(super) fn metadata(
    c: &Settings<'_>,
) -> Result<Vec<(AsciiMetadataKey, Template)>, SettingsError> {
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
