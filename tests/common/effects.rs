//! Helpers for effect tests: commands as the saga engine emits them, publishing them, and
//! reading their results and the workers' metrics.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{Value as Json, json};

use super::{Seen, read_stream};

/// An effect command as the saga engine emits it; returns (subject, body).
pub fn command(effect: &str, n: u64) -> (String, Json) {
    let id = uuid::Uuid::now_v7().to_string();
    let body = json!({
        "v": 1,
        "tenant_id": "_",
        "command_id": id,
        "effect_name": effect,
        "payload": { "n": n },
        "metadata": { "saga": "test", "correlation_id": format!("c-{n}"), "saga_version": 1 },
    });
    (format!("tenant._.effect.{effect}.{id}"), body)
}

/// Publishes commands, acks awaited in windows; returns their ids.
pub async fn publish_commands(
    js: &async_nats::jetstream::Context,
    cmds: &[(String, Json)],
) -> Vec<String> {
    let mut ids = Vec::new();
    for chunk in cmds.chunks(500) {
        let mut acks = Vec::new();
        for (subject, body) in chunk {
            let id = body["command_id"].as_str().unwrap().to_string();
            let mut h = async_nats::HeaderMap::new();
            h.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            h.insert(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            );
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

pub async fn results(js: &async_nats::jetstream::Context) -> Vec<Seen> {
    read_stream(js, "WORKFLOW_EVENTS", "tenant.*.effect_result.>").await
}

/// Waits until at least `n` results are on the stream, then a little longer so that any
/// duplicate would show; returns them all.
pub async fn settle_results(
    js: &async_nats::jetstream::Context,
    n: usize,
    timeout: Duration,
) -> Vec<Seen> {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = results(js).await;
        if seen.len() >= n {
            tokio::time::sleep(Duration::from_secs(2)).await;
            return results(js).await;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} results, found {} after {timeout:?}",
            seen.len()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
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

/// Reads one sample of a metric (name with labels as Prometheus prints them) from /metrics.
pub async fn metric(admin: &str, sample: &str) -> f64 {
    let text = reqwest::get(format!("{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}
