//! Redriving effect dead letters (letters on the dead-letter stream) through a running
//! node: the command goes back on its subject once and runs once, the letter leaves the
//! stream, a second redrive finds nothing, another tenant cannot reach the letter, and a
//! letter that keeps only an excerpt of its command is refused with where the command is.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::effects::{EffectBed, command_with};
use common::upstream::Reply;
use common::{get_json, run_to_exit};
use serde_json::{Value as Json, json};

fn manifest(base: &str) -> String {
    format!(
        "format: 1\neffects:\n  - name: charge\n    provider: http\n    settings:\n      url: {base}/charge\n      method: POST\n"
    )
}

/// The letters on the dead-letter stream, through the node at `admin`.
async fn letters(admin: &str) -> Vec<Json> {
    get_json(&format!("{admin}/admin/dlq/stream?tenant=_")).await["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn redrive(admin: &str, tenant: &str, seq: u64) -> (u16, Json) {
    let url = format!("{admin}/admin/dlq/stream/{tenant}/{seq}/redrive");
    common::post_json(&url, &json!({})).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_dead_letter_is_redriven_once_through_the_admin_api_and_cli() {
    let bed = EffectBed::start(
        Arc::new(|_, _, _| Reply::ok(json!({ "charged": true }))),
        manifest,
    )
    .await;
    // First node: tenant `_` is not allowed, so its commands are refused to the stream.
    let strict = bed.runner(&[("RUNNER__TENANCY__ALLOWED", r#"["a"]"#)]);
    let small = bed
        .publish_one(command_with("charge", json!({ "amount": 5 }), 1))
        .await;
    let big = bed
        .publish_one(command_with(
            "charge",
            json!({ "note": "x".repeat(6000) }),
            2,
        ))
        .await;
    let found = common::eventually(Duration::from_secs(30), || async {
        letters(&strict.admin).await.len() == 2
    })
    .await;
    let listed = letters(&strict.admin).await;
    assert!(found, "letters: {listed:#?}");
    let seq_of = |id: &str| {
        listed
            .iter()
            .find(|l| l["letter"]["subject"].as_str().unwrap().ends_with(id))
            .unwrap()["seq"]
            .as_u64()
            .unwrap()
    };
    let (small_seq, big_seq) = (seq_of(&small), seq_of(&big));
    assert_eq!(bed.upstream.hits().len(), 0);
    strict.stop();

    // Second node allows every tenant: the letter's command can run now.
    let node = bed.runner(&[]);
    let (status, body) = redrive(&node.admin, "other", small_seq).await;
    assert_eq!(status, 404, "another tenant reached the letter: {body}");
    let (status, body) = redrive(&node.admin, "_", big_seq).await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("excerpt"),
        "{body}"
    );
    let (status, body) = redrive(&node.admin, "_", small_seq).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["duplicate"], false);
    assert!(body["subject"].as_str().unwrap().ends_with(&small));

    let results = bed.settle(1, Duration::from_secs(30)).await;
    let result = results
        .iter()
        .find(|r| r.body["command_id"] == small.as_str())
        .unwrap();
    assert_eq!(result.body["result_type"], "Succeeded", "{}", result.body);
    assert_eq!(bed.upstream.count(&small), 1);
    let left: Vec<u64> = letters(&node.admin)
        .await
        .iter()
        .map(|l| l["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(left, vec![big_seq], "the redriven letter is still listed");

    // The CLI through the node: the letter is gone, so a second redrive is refused.
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "redrive",
            "--stream",
            "--tenant",
            "_",
            &small_seq.to_string(),
            "--admin",
            &node.admin,
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("404") && out.contains("no dead letter"),
        "{out}"
    );
    // Without --admin the CLI says where the stream is read.
    let (code, out) = run_to_exit(
        &["dlq", "redrive", "--stream", "--tenant", "_", "1"],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("--admin"), "{out}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(bed.upstream.count(&small), 1, "the command ran twice");
    node.stop();
}
