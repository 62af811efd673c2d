//! The `grpc` provider's knowledge of the method it calls: its request and reply types.
//!
//! Owns the two ways a method's types are learnt and the checks made on them:
//! - a descriptor-set file (`descriptors`, as `protoc --descriptor_set_out` or `buf build
//!   -o` write it), read when the manifest is loaded ([`from_file`]);
//! - server reflection when no file is given ([`from_reflection`]): the `grpc.reflection.v1`
//!   service, then `v1alpha` for servers that only have the older one, asked on the first
//!   call and remembered once it answered.
//!
//! Either way [`find`] requires the service and method to exist and the method to be unary
//! (streaming methods are refused with their kind), and [`check_request`] checks the static
//! keys of the `request` template against the request message's fields, recursively through
//! nested messages, so a misspelt field is a manifest error rather than a failed command.
//!
//! Guarantee: no message type is ever guessed; a call is made only with types read from the
//! descriptors or from the server itself.

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;
use prost_reflect::prost_types::FileDescriptorProto;
use prost_reflect::{DescriptorPool, Kind, MessageDescriptor};
use serde_json::Value as Json;
use tonic::transport::Channel;

/// The method to call, with its message types.
#[derive(Debug, Clone)]
pub(crate) struct Method {
    /// `/package.Service/Method`.
    pub(crate) path: tonic::codegen::http::uri::PathAndQuery,
    /// The request message type.
    pub(crate) input: MessageDescriptor,
    /// The reply message type.
    pub(crate) output: MessageDescriptor,
}

/// Splits `package.Service/Method` into the service's full name and the method's name.
pub(crate) fn parse_method(s: &str) -> Result<(String, String), String> {
    let s = s.trim_start_matches('/');
    match s.split_once('/') {
        Some((svc, m))
            if !svc.is_empty()
                && !m.is_empty()
                && !m.contains('/')
                && svc.split('.').all(is_ident)
                && is_ident(m) =>
        {
            Ok((svc.to_string(), m.to_string()))
        }
        _ => Err(format!(
            "{s:?} is not `package.Service/Method` (for example `payments.v1.Payments/Charge`)"
        )),
    }
}

fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

/// Reads a descriptor-set file.
pub(crate) fn from_file(path: &std::path::Path) -> Result<DescriptorPool, String> {
    let bytes =
        std::fs::read(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    DescriptorPool::decode(bytes.as_slice()).map_err(|e| {
        format!(
            "`{}` is not a protobuf FileDescriptorSet: {e}",
            path.display()
        )
    })
}

/// Finds a unary method in `pool`.
pub(crate) fn find(pool: &DescriptorPool, service: &str, method: &str) -> Result<Method, String> {
    let Some(svc) = pool.get_service_by_name(service) else {
        let known: Vec<String> = pool.services().map(|s| s.full_name().to_string()).collect();
        return Err(format!(
            "service `{service}` is not in the descriptors (they have: {})",
            list(&known)
        ));
    };
    let Some(m) = svc.methods().find(|m| m.name() == method) else {
        let known: Vec<String> = svc.methods().map(|m| m.name().to_string()).collect();
        return Err(format!(
            "service `{service}` has no method `{method}` (it has: {})",
            list(&known)
        ));
    };
    let kind = match (m.is_client_streaming(), m.is_server_streaming()) {
        (false, false) => None,
        (true, false) => Some("client-streaming"),
        (false, true) => Some("server-streaming"),
        (true, true) => Some("bidirectional-streaming"),
    };
    if let Some(kind) = kind {
        return Err(format!(
            "method `{service}/{method}` is {kind}; only unary methods can be called"
        ));
    }
    let path = format!("/{service}/{method}")
        .parse()
        .map_err(|e| format!("`{service}/{method}` cannot be a request path: {e}"))?;
    Ok(Method {
        path,
        input: m.input(),
        output: m.output(),
    })
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// Checks the static keys of a `request` template against `msg`: every key written in the
/// manifest must be a field (by its JSON or its proto name). Values that are templates are
/// not checked (their shape is known only per command); map fields and the well-known types
/// (`google.protobuf.*`, whose JSON forms are free) are not descended into.
///
/// On failure, returns the dotted path of the offending key (under `request`) and why.
pub(crate) fn check_request(
    value: &Json,
    msg: &MessageDescriptor,
    at: &str,
) -> Result<(), (String, String)> {
    let Json::Object(m) = value else {
        return Ok(());
    };
    for (key, v) in m {
        let here = format!("{at}.{key}");
        let Some(field) = msg
            .get_field_by_json_name(key)
            .or_else(|| msg.get_field_by_name(key))
        else {
            let known: Vec<String> = msg.fields().map(|f| f.json_name().to_string()).collect();
            return Err((
                here,
                format!(
                    "message `{}` has no field `{key}` (its fields: {})",
                    msg.full_name(),
                    list(&known)
                ),
            ));
        };
        let Kind::Message(inner) = field.kind() else {
            continue;
        };
        if field.is_map() || inner.full_name().starts_with("google.protobuf.") {
            continue;
        }
        match v {
            Json::Array(items) if field.is_list() => {
                for (i, item) in items.iter().enumerate() {
                    check_request(item, &inner, &format!("{here}.{i}"))?;
                }
            }
            Json::Object(_) => check_request(v, &inner, &here)?,
            _ => {}
        }
    }
    Ok(())
}

/// Why reflection did not give the method: worth asking again later (`Retry`: the server
/// could not be reached or answered with a transient status) or not (`Fatal`: the server
/// does not know the service or method, or serves no reflection at all).
#[derive(Debug)]
pub(crate) enum ReflectionError {
    /// Ask again on a later attempt.
    Retry(tonic::Status),
    /// Asking again cannot help.
    Fatal(String),
}

/// Most files one reflection lookup follows (the service's file and its imports).
const MAX_FILES: usize = 256;

/// Learns `service`'s method `method` from the server's reflection service.
pub(crate) async fn from_reflection(
    channel: Channel,
    service: &str,
    method: &str,
) -> Result<Method, ReflectionError> {
    let unimplemented = |e: &ReflectionError| matches!(e, ReflectionError::Retry(s) if s.code() == tonic::Code::Unimplemented);
    let files = match v1::files(channel.clone(), service).await {
        Err(e) if unimplemented(&e) => match v1alpha::files(channel, service).await {
            Err(e) if unimplemented(&e) => {
                return Err(ReflectionError::Fatal(
                    "the server offers no reflection service (v1 or v1alpha); give the \
                     effect a `descriptors` file"
                        .into(),
                ));
            }
            other => other,
        },
        other => other,
    }?;
    let mut pool = DescriptorPool::new();
    pool.add_file_descriptor_protos(files.into_values())
        .map_err(|e| {
            ReflectionError::Fatal(format!("the server's descriptors do not build: {e}"))
        })?;
    find(&pool, service, method).map_err(ReflectionError::Fatal)
}

/// A reflection client for one protocol version: fetches the file defining a symbol and
/// every file it imports, transitively.
macro_rules! reflection_client {
    ($name:ident, $pb:path) => {
        mod $name {
            use super::*;
            use pb::server_reflection_client::ServerReflectionClient;
            use pb::server_reflection_request::MessageRequest;
            use pb::server_reflection_response::MessageResponse;
            use $pb as pb;

            async fn ask(
                client: &mut ServerReflectionClient<Channel>,
                request: MessageRequest,
            ) -> Result<Vec<Vec<u8>>, ReflectionError> {
                let req = pb::ServerReflectionRequest {
                    host: String::new(),
                    message_request: Some(request),
                };
                let mut replies = client
                    .server_reflection_info(futures::stream::iter([req]))
                    .await
                    .map_err(ReflectionError::Retry)?
                    .into_inner();
                let reply = replies
                    .message()
                    .await
                    .map_err(ReflectionError::Retry)?
                    .ok_or_else(|| {
                        ReflectionError::Retry(tonic::Status::unavailable(
                            "the reflection service closed without an answer",
                        ))
                    })?;
                match reply.message_response {
                    Some(MessageResponse::FileDescriptorResponse(f)) => Ok(f.file_descriptor_proto),
                    Some(MessageResponse::ErrorResponse(e)) => Err(ReflectionError::Fatal(
                        format!("reflection: {} (code {})", e.error_message, e.error_code),
                    )),
                    _ => Err(ReflectionError::Fatal(
                        "reflection answered something other than file descriptors".into(),
                    )),
                }
            }

            pub(super) async fn files(
                channel: Channel,
                service: &str,
            ) -> Result<BTreeMap<String, FileDescriptorProto>, ReflectionError> {
                let mut client = ServerReflectionClient::new(channel);
                let mut files = BTreeMap::new();
                let mut wanted: BTreeSet<String> = BTreeSet::new();
                let first = ask(
                    &mut client,
                    MessageRequest::FileContainingSymbol(service.to_string()),
                )
                .await?;
                add(&mut files, &mut wanted, first)?;
                let mut asked = BTreeSet::new();
                while let Some(name) = wanted.pop_first() {
                    if !asked.insert(name.clone()) {
                        return Err(ReflectionError::Fatal(format!(
                            "reflection does not send `{name}`, which the service imports"
                        )));
                    }
                    if asked.len() > MAX_FILES {
                        return Err(ReflectionError::Fatal(format!(
                            "the service imports more than {MAX_FILES} files"
                        )));
                    }
                    let got = ask(&mut client, MessageRequest::FileByFilename(name)).await?;
                    add(&mut files, &mut wanted, got)?;
                }
                Ok(files)
            }
        }
    };
}

reflection_client!(v1, tonic_reflection::pb::v1);
reflection_client!(v1alpha, tonic_reflection::pb::v1alpha);

/// Adds encoded files to `files` and notes the imports not fetched yet in `wanted`.
fn add(
    files: &mut BTreeMap<String, FileDescriptorProto>,
    wanted: &mut BTreeSet<String>,
    encoded: Vec<Vec<u8>>,
) -> Result<(), ReflectionError> {
    for bytes in encoded {
        let file = FileDescriptorProto::decode(bytes.as_slice()).map_err(|e| {
            ReflectionError::Fatal(format!("reflection sent an undecodable file: {e}"))
        })?;
        wanted.remove(file.name());
        files.insert(file.name().to_string(), file);
    }
    for f in files.values() {
        for dep in &f.dependency {
            if !files.contains_key(dep) {
                wanted.insert(dep.clone());
            }
        }
    }
    Ok(())
}
