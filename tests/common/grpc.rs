//! A real gRPC upstream for the `grpc` provider's tests: a tonic server serving the
//! example's `payments.v1.Payments` service (from `manifests/grpc/payments.proto`, compiled
//! with protox), optionally over TLS or mutual TLS and with server reflection (v1, v1alpha,
//! or none).
//!
//! Messages are dynamic (prost-reflect), decoded with the provider's own codec, so the test
//! service and the runner read the same `.proto` and nothing is generated. Every call is
//! recorded (idempotency key, metadata, request as JSON, arrival) and answered as the test's
//! script says: a reply message (JSON), or a status with an optional
//! `grpc-retry-pushback-ms`, after an optional delay or once a [`Latch`] opens.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prost_reflect::{DescriptorPool, DynamicMessage, MethodDescriptor, SerializeOptions};
use runner::effect::provider::grpc::DynamicCodec;
use serde_json::{Value as Json, json};
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::{NamedService, UnaryService};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Code, Status};

use super::upstream::Latch;

/// The example's service.
pub const SERVICE: &str = "payments.v1.Payments";

/// The directory of the example `.proto` and its committed descriptor set.
pub fn proto_dir() -> PathBuf {
    super::repo_root().join("manifests/grpc")
}

/// The committed descriptor set of the example.
pub fn committed_descriptors() -> PathBuf {
    proto_dir().join("payments.binpb")
}

/// Compiles `payments.proto` (with its imports) into an encoded FileDescriptorSet.
pub fn compile_descriptor_set() -> Vec<u8> {
    let dir = proto_dir();
    let mut c = protox::Compiler::new([&dir]).expect("protox include path");
    c.include_imports(true).include_source_info(false);
    c.open_file(dir.join("payments.proto"))
        .expect("payments.proto compiles");
    c.encode_file_descriptor_set()
}

/// Compiles a `.proto` text written by a test (its own file in `dir`) into a descriptor-set
/// file beside it; returns that file.
pub fn compile_proto_text(dir: &Path, name: &str, text: &str) -> PathBuf {
    std::fs::write(dir.join(format!("{name}.proto")), text).unwrap();
    let mut c = protox::Compiler::new([dir]).expect("protox include path");
    c.include_imports(true);
    c.open_file(dir.join(format!("{name}.proto")))
        .expect("the test proto compiles");
    let out = dir.join(format!("{name}.binpb"));
    std::fs::write(&out, c.encode_file_descriptor_set()).unwrap();
    out
}

/// What the server answers.
#[derive(Debug, Clone)]
pub struct GrpcReply {
    /// The reply message as JSON, or a status.
    pub result: Result<Json, (Code, String)>,
    /// `grpc-retry-pushback-ms` on a status, as written.
    pub pushback: Option<String>,
    /// Wait before answering.
    pub delay: Duration,
    /// Answer only once this latch opens.
    pub hold: Option<Latch>,
}

impl GrpcReply {
    /// A reply message.
    pub fn ok(body: Json) -> Self {
        Self {
            result: Ok(body),
            pushback: None,
            delay: Duration::ZERO,
            hold: None,
        }
    }
    /// A status.
    pub fn status(code: Code, message: &str) -> Self {
        Self {
            result: Err((code, message.to_string())),
            ..Self::ok(Json::Null)
        }
    }
    /// With `grpc-retry-pushback-ms: <v>`.
    pub fn pushback(mut self, v: &str) -> Self {
        self.pushback = Some(v.to_string());
        self
    }
    /// Answers after `d`.
    pub fn after(mut self, d: Duration) -> Self {
        self.delay = d;
        self
    }
    /// Answers once `latch` opens.
    pub fn until(mut self, latch: &Latch) -> Self {
        self.hold = Some(latch.clone());
        self
    }
}

/// One call the server received.
#[derive(Debug, Clone)]
pub struct Call {
    /// The method's name (`Charge`).
    pub method: String,
    /// `idempotency-key` metadata.
    pub key: String,
    /// Every ASCII metadata entry.
    pub metadata: HashMap<String, String>,
    /// The request in the protobuf JSON mapping (defaults included).
    pub request: Json,
    /// Arrival.
    pub at: Instant,
    /// How many calls with this key (this one included).
    pub nth: usize,
}

/// Decides a reply from the call.
pub type GrpcScript = Arc<dyn Fn(&Call) -> GrpcReply + Send + Sync>;

/// How the server offers reflection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reflection {
    /// Not at all.
    None,
    /// `grpc.reflection.v1` (and v1alpha).
    V1,
    /// Only the older `grpc.reflection.v1alpha`.
    V1AlphaOnly,
}

/// TLS of the server: its certificate and, for mutual TLS, the CA its clients must have.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// Directory made by `postgres::make_test_ca` (`server.pem`, `server.key`, `ca.pem`).
    pub dir: PathBuf,
    /// Require a client certificate from that CA.
    pub mutual: bool,
}

/// The running server.
#[derive(Clone)]
pub struct GrpcUpstream {
    /// `http://127.0.0.1:<port>` or `https://…`.
    pub base: String,
    calls: Arc<Mutex<Vec<Call>>>,
    in_flight: Arc<AtomicUsize>,
    _stop: Arc<tokio_util::sync::DropGuard>,
}

impl GrpcUpstream {
    /// Starts on a free loopback port.
    pub async fn start(script: GrpcScript, reflection: Reflection, tls: Option<ServerTls>) -> Self {
        let fds = compile_descriptor_set();
        let pool = DescriptorPool::decode(fds.as_slice()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let stop = tokio_util::sync::CancellationToken::new();
        let up = Self {
            base: format!("{scheme}://{addr}"),
            calls: Arc::default(),
            in_flight: Arc::default(),
            _stop: Arc::new(stop.clone().drop_guard()),
        };
        let service = Payments {
            pool,
            script,
            calls: up.calls.clone(),
            in_flight: up.in_flight.clone(),
        };
        let mut builder = Server::builder();
        if let Some(t) = &tls {
            let read = |f: &str| std::fs::read(t.dir.join(f)).unwrap();
            let mut cfg = ServerTlsConfig::new()
                .identity(Identity::from_pem(read("server.pem"), read("server.key")));
            if t.mutual {
                cfg = cfg.client_ca_root(Certificate::from_pem(read("ca.pem")));
            }
            builder = builder.tls_config(cfg).unwrap();
        }
        let mut router = builder.add_service(service);
        let reflect = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(&fds);
        match reflection {
            Reflection::None => {}
            Reflection::V1 => {
                router = router.add_service(
                    tonic_reflection::server::Builder::configure()
                        .register_encoded_file_descriptor_set(&fds)
                        .build_v1()
                        .unwrap(),
                );
                router = router.add_service(reflect.build_v1alpha().unwrap());
            }
            Reflection::V1AlphaOnly => {
                router = router.add_service(reflect.build_v1alpha().unwrap());
            }
        }
        let incoming = tokio_stream_of(listener);
        tokio::spawn(async move {
            router
                .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                .await
                .unwrap();
        });
        up
    }

    /// Every call received so far.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Calls made with idempotency key `key`.
    pub fn count(&self, key: &str) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.key == key)
            .count()
    }

    /// Calls received and not answered yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// Accepted connections of `listener` as the stream tonic serves.
fn tokio_stream_of(
    listener: tokio::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(listener, |l| async move {
        let conn = l.accept().await.map(|(s, _)| s);
        Some((conn, l))
    })
}

/// The dynamic `payments.v1.Payments` service.
#[derive(Clone)]
struct Payments {
    pool: DescriptorPool,
    script: GrpcScript,
    calls: Arc<Mutex<Vec<Call>>>,
    in_flight: Arc<AtomicUsize>,
}

impl NamedService for Payments {
    const NAME: &'static str = SERVICE;
}

impl Service<http::Request<Body>> for Payments {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let svc = self.pool.get_service_by_name(SERVICE).unwrap();
        let path = req.uri().path().to_string();
        let method = svc
            .methods()
            .find(|m| path == format!("/{SERVICE}/{}", m.name()) && !m.is_server_streaming());
        let this = self.clone();
        Box::pin(async move {
            let Some(method) = method else {
                return Ok(Status::unimplemented(path).into_http());
            };
            let mut grpc = tonic::server::Grpc::new(DynamicCodec::new(method.input()));
            Ok(grpc.unary(Unary { svc: this, method }, req).await)
        })
    }
}

/// One unary method of the service.
struct Unary {
    svc: Payments,
    method: MethodDescriptor,
}

/// Counts a call in flight while it lives.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl UnaryService<DynamicMessage> for Unary {
    type Response = DynamicMessage;
    type Future = BoxFuture<tonic::Response<DynamicMessage>, Status>;

    fn call(&mut self, req: tonic::Request<DynamicMessage>) -> Self::Future {
        let svc = self.svc.clone();
        let method = self.method.clone();
        Box::pin(async move {
            svc.in_flight.fetch_add(1, Ordering::SeqCst);
            let _in_flight = InFlight(svc.in_flight.clone());
            let metadata: HashMap<String, String> = req
                .metadata()
                .iter()
                .filter_map(|kv| match kv {
                    tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                        Some((k.to_string(), v.to_str().ok()?.to_string()))
                    }
                    tonic::metadata::KeyAndValueRef::Binary(..) => None,
                })
                .collect();
            let key = metadata.get("idempotency-key").cloned().unwrap_or_default();
            let request = req
                .into_inner()
                .serialize_with_options(
                    serde_json::value::Serializer,
                    &SerializeOptions::new().skip_default_fields(false),
                )
                .unwrap();
            let reply = {
                let mut calls = svc.calls.lock().unwrap();
                let nth = 1 + calls.iter().filter(|c| c.key == key).count();
                let call = Call {
                    method: method.name().to_string(),
                    key,
                    metadata,
                    request,
                    at: Instant::now(),
                    nth,
                };
                let reply = (svc.script)(&call);
                calls.push(call);
                reply
            };
            if let Some(latch) = &reply.hold {
                latch.wait().await;
            }
            if !reply.delay.is_zero() {
                tokio::time::sleep(reply.delay).await;
            }
            match reply.result {
                Ok(body) => {
                    let msg = DynamicMessage::deserialize(method.output(), &body)
                        .map_err(|e| Status::internal(format!("test script reply: {e}")))?;
                    Ok(tonic::Response::new(msg))
                }
                Err((code, message)) => {
                    let mut status = Status::new(code, message);
                    if let Some(p) = reply.pushback {
                        status
                            .metadata_mut()
                            .insert("grpc-retry-pushback-ms", p.parse().unwrap());
                    }
                    Err(status)
                }
            }
        })
    }
}

/// A reply for `Charge` naming the call that made it.
pub fn charged(call: &Call) -> Json {
    json!({
        "paymentId": format!("pay-{}", call.key),
        "status": "CHARGE_STATUS_CAPTURED",
        "chargedAt": "2026-11-25T10:00:00Z",
        "attempt": call.nth.to_string(),
    })
}
