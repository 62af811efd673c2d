//! Helpers for effect tests: the shared set-up ([`EffectBed`]: nats-server, HTTP upstream,
//! manifest, JetStream client, `runner --mode effect` processes), commands as the saga
//! engine emits them, their results, and the workers' metrics.
//!
//! Two rules keep these helpers honest on a slow machine:
//! - Nothing waits a fixed time for something *not* to happen. "No second result" is
//!   checked once the effect consumer is quiescent ([`settle_results`]), or once the
//!   process that could still publish has reported that it gave up.
//! - A metric that is not there is an error, not a zero ([`super::metrics::metric`]), so a renamed counter
//!   cannot make `busy == 0` pass.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_nats::jetstream::Context;
use serde_json::{Value as Json, json};

use super::upstream::{Script, Upstream};
use super::{NatsServer, RunnerProc, Seen, jetstream, read_stream};

/// The stream effect commands are published on (the runner's default).
pub const COMMAND_STREAM: &str = "WORKFLOW_COMMANDS";
/// The effect workers' catch-all consumer (the runner's default `consumers.effect`); each
/// effect's own consumer is named `<EFFECT_CONSUMER>-<effect>`.
pub const EFFECT_CONSUMER: &str = "runner-effect";

/// One effect test's world: its own nats-server, a local HTTP upstream answering with the
/// test's script, a manifest declaring the test's effects against that upstream, and a
/// JetStream client. Runners are started on it with [`EffectBed::runner`].
pub struct EffectBed {
    /// The test's nats-server.
    pub nats: NatsServer,
    /// The HTTP upstream the effects call.
    pub upstream: Upstream,
    /// A JetStream client of `nats` (renew it with [`EffectBed::reconnect`] after a restart).
    pub js: Context,
    /// The manifest file.
    pub manifest: PathBuf,
    /// Scratch directory holding the manifest (and anything else the test writes).
    pub dir: tempfile::TempDir,
}

impl EffectBed {
    /// Starts nats and the upstream, then writes the manifest `yaml(upstream_base_url)`.
    pub async fn start(script: Script, yaml: impl FnOnce(&str) -> String) -> Self {
        let nats = NatsServer::start();
        let upstream = Upstream::start(script).await;
        let dir = tempfile::tempdir().unwrap();
        let manifest = dir.path().join("effects.yaml");
        std::fs::write(&manifest, yaml(&upstream.base)).unwrap();
        let js = jetstream(&nats.url()).await;
        Self {
            nats,
            upstream,
            js,
            manifest,
            dir,
        }
    }

    /// Starts `runner run --mode effect` on the manifest with `envs`; returns once it is ready.
    pub fn runner(&self, envs: &[(&str, &str)]) -> RunnerProc {
        RunnerProc::start(
            &[
                "--mode",
                "effect",
                "--nats-url",
                &self.nats.url(),
                "--manifest",
                self.manifest.to_str().unwrap(),
            ],
            envs,
        )
    }

    /// Publishes commands (see [`publish_commands`]); returns their ids.
    pub async fn publish(&self, cmds: &[(String, Json)]) -> Vec<String> {
        publish_commands(&self.js, cmds).await
    }

    /// Publishes one command; returns its id.
    pub async fn publish_one(&self, cmd: (String, Json)) -> String {
        publish_commands(&self.js, std::slice::from_ref(&cmd))
            .await
            .remove(0)
    }

    /// See [`settle_results`].
    pub async fn settle(&self, n: usize, timeout: Duration) -> Vec<Seen> {
        settle_results(&self.js, n, timeout).await
    }

    /// Every result on the stream now.
    pub async fn results(&self) -> Vec<Seen> {
        results(&self.js).await
    }

    /// A fresh JetStream client (after the server restarted).
    pub async fn reconnect(&mut self) {
        self.js = jetstream(&self.nats.url()).await;
    }
}

/// An effect command as the saga engine emits it; returns (subject, body).
pub fn command(effect: &str, n: u64) -> (String, Json) {
    command_with(effect, json!({ "n": n }), n)
}

/// An effect command with its own `payload`; `n` names its correlation id `c-<n>`.
pub fn command_with(effect: &str, payload: Json, n: u64) -> (String, Json) {
    let id = uuid::Uuid::now_v7().to_string();
    let body = json!({
        "v": 1,
        "tenant_id": "_",
        "command_id": id,
        "effect_name": effect,
        "payload": payload,
        "metadata": { "saga": "test", "correlation_id": format!("c-{n}"), "saga_version": 1 },
    });
    (format!("tenant._.effect.{effect}.{id}"), body)
}

/// The `traceparent` every test command carries.
pub const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Publishes commands, acks awaited in windows; returns their ids.
pub async fn publish_commands(js: &Context, cmds: &[(String, Json)]) -> Vec<String> {
    let mut ids = Vec::new();
    for chunk in cmds.chunks(500) {
        let mut acks = Vec::new();
        for (subject, body) in chunk {
            let id = body["command_id"].as_str().unwrap().to_string();
            let mut h = async_nats::HeaderMap::new();
            h.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            h.insert("traceparent", TRACEPARENT);
            acks.push(
                js.publish_with_headers(
                    subject.clone(),
                    h,
                    serde_json::to_vec(body).unwrap().into(),
                )
                .await
                .unwrap(),
            );
            ids.push(id);
        }
        for a in acks {
            a.await.unwrap();
        }
    }
    ids
}

/// Every effect result on the stream now.
pub async fn results(js: &Context) -> Vec<Seen> {
    read_stream(js, "WORKFLOW_EVENTS", "tenant.*.effect_result.>").await
}

/// Whether the effect consumers hold nothing: on the catch-all and on every effect's own
/// consumer, every command delivered has been acked or terminated and none waits to be
/// delivered.
///
/// Why this is a barrier for "no further result": a handler publishes a command's result
/// (awaiting the PubAck) *before* it acks the command, and every path that does not ack
/// (busy, fenced out, handed back, a failed record or publish) naks it, which keeps it
/// pending. So with nothing pending and nothing unacked on any of them, no handler of a
/// live process is about to publish. The one exception is a handler whose delivery outlived
/// the ack wait and was redelivered and acked elsewhere — a stalled (SIGSTOP) or killed
/// process; tests with such a process wait for it to report giving up instead. Even then,
/// a result it published would carry the command's derived `Nats-Msg-Id`, and JetStream
/// would drop it as a duplicate.
///
/// A sentinel command published last is no barrier: the consumers are shared by replicas
/// that run many commands at once, so results do not come back in publication order.
pub async fn consumer_quiescent(js: &Context) -> bool {
    let infos = match effect_consumers(js).await {
        Some(i) if !i.is_empty() => i,
        _ => return false,
    };
    infos
        .iter()
        .all(|info| info.num_ack_pending == 0 && info.num_pending == 0)
}

/// The info of every effect consumer on the command stream (the catch-all and each
/// effect's own), or None when the stream cannot be read.
pub async fn effect_consumers(js: &Context) -> Option<Vec<async_nats::jetstream::consumer::Info>> {
    use futures::TryStreamExt;
    let stream = js.get_stream(COMMAND_STREAM).await.ok()?;
    let all: Vec<_> = stream.consumers().try_collect().await.ok()?;
    let own = format!("{EFFECT_CONSUMER}-");
    Some(
        all.into_iter()
            .filter(|i| i.name == EFFECT_CONSUMER || i.name.starts_with(&own))
            .collect(),
    )
}

/// The info of consumer `name` on the command stream, or None when it does not exist.
pub async fn consumer_info(
    js: &Context,
    name: &str,
) -> Option<async_nats::jetstream::consumer::Info> {
    let stream = js.get_stream(COMMAND_STREAM).await.ok()?;
    stream.consumer_info(name).await.ok()
}

/// The info of effect `effect`'s own consumer (`<EFFECT_CONSUMER>-<effect>`); panics when
/// it does not exist.
pub async fn own_consumer(js: &Context, effect: &str) -> async_nats::jetstream::consumer::Info {
    let name = format!("{EFFECT_CONSUMER}-{effect}");
    consumer_info(js, &name)
        .await
        .unwrap_or_else(|| panic!("no consumer {name}"))
}

/// Waits until at least `n` results are on the stream and the effect consumer is
/// quiescent ([`consumer_quiescent`]), then returns every result on the stream: a second
/// result for any command would be among them.
pub async fn settle_results(js: &Context, n: usize, timeout: Duration) -> Vec<Seen> {
    let deadline = Instant::now() + timeout;
    loop {
        let quiet = consumer_quiescent(js).await;
        let seen = results(js).await;
        if quiet && seen.len() >= n {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} results and a quiescent effect consumer, found {} results (quiescent: {quiet}) after {timeout:?}",
            seen.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the effect consumer is quiescent ([`consumer_quiescent`]).
pub async fn wait_quiescent(js: &Context, timeout: Duration) {
    assert!(
        super::eventually(timeout, || consumer_quiescent(js)).await,
        "the effect consumers still hold commands after {timeout:?}"
    );
}

/// Results by command id; panics on a command with two results.
pub fn one_per_command(seen: &[Seen]) -> HashMap<String, Json> {
    let mut m = HashMap::new();
    for s in seen {
        let id = s.body["command_id"].as_str().unwrap().to_string();
        assert_eq!(s.msg_id.as_deref(), s.body["event_id"].as_str());
        if m.insert(id.clone(), s.body.clone()).is_some() {
            panic!("command {id} has two results on the stream");
        }
    }
    m
}
