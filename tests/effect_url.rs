//! Input never steers an HTTP effect's call, and an answer is never read past what a result
//! may hold (findings: `../../admin/purge?all=true#` in a customer id reached the upstream
//! as `POST /admin/purge?all=true`; a whole-URL template pointed at the node's own admin API
//! drained it; a 1.5 GiB answer was read whole before its size check). Real binary, real
//! nats-server, real HTTP servers.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::effects::{EffectBed, command_with};
use common::upstream::Reply;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn validate(manifest: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_runner"))
        .args(["validate", manifest.to_str().unwrap()])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_in_a_url_stays_inside_its_path_segment_and_query_value() {
    let bed = EffectBed::start(Arc::new(|_, _, _| Reply::ok(json!({"ok": true}))), |base| {
        format!(
            r#"format: 1
effects:
  - name: charge
    provider: http
    settings:
      url: "{base}/v1/customers/${{ event.payload.customer_id }}/charges?note=${{ event.payload.note }}"
"#
        )
    })
    .await;
    let _w = bed.runner(&[]);
    let hostile = "../../admin/purge?all=true#";
    bed.publish_one(command_with(
        "charge",
        json!({"customer_id": hostile, "note": "a&admin=1"}),
        1,
    ))
    .await;
    bed.publish_one(command_with(
        "charge",
        json!({"customer_id": "..", "note": ""}),
        2,
    ))
    .await;
    let results = bed.settle(2, Duration::from_secs(30)).await;
    let hits = bed.upstream.hits();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!(
        hits[0].path,
        "/v1/customers/..%2F..%2Fadmin%2Fpurge%3Fall%3Dtrue%23/charges"
    );
    let by = |c: &str| {
        results
            .iter()
            .find(|r| r.body["metadata"]["correlation_id"] == c)
            .unwrap()
    };
    assert_eq!(
        by("c-1").body["result_type"],
        "Succeeded",
        "{:?}",
        by("c-1")
    );
    // `..` alone would name the parent path: refused, nothing sent.
    let dots = by("c-2");
    assert_eq!(dots.body["result_type"], "Failed", "{dots:?}");
    let reason = dots.body["payload"]["error"].as_str().unwrap_or_default();
    assert!(reason.contains("another path"), "{}", dots.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_the_input_could_point_anywhere_needs_a_host_list_and_keeps_to_it() {
    let bed = EffectBed::start(Arc::new(|_, _, _| Reply::ok(json!({"ok": true}))), |_| {
        r#"format: 1
effects:
  - name: hook
    provider: http
    settings:
      url: "${ event.payload.callback }"
"#
        .to_string()
    })
    .await;
    let (ok, text) = validate(&bed.manifest);
    assert!(!ok, "refused: {text}");
    assert!(
        text.contains("url") && text.contains("allowed_hosts"),
        "{text}"
    );
    assert!(text.contains("effects.yaml:"), "names the file: {text}");

    let upstream_host = bed.upstream.base.trim_start_matches("http://").to_string();
    std::fs::write(
        &bed.manifest,
        format!(
            r#"format: 1
effects:
  - name: hook
    provider: http
    settings:
      url: "${{ event.payload.callback }}"
      allowed_hosts: ["{upstream_host}"]
"#
        ),
    )
    .unwrap();
    let (ok, text) = validate(&bed.manifest);
    assert!(ok, "{text}");
    let w = bed.runner(&[]);
    // The node's own admin API, another port of the same host, another scheme: refused.
    for (n, url) in [
        format!("{}/admin/drain", w.admin),
        "http://127.0.0.1:1/x".to_string(),
        format!("ftp://{upstream_host}/x"),
        format!("http://u:p@{upstream_host}/x"),
    ]
    .iter()
    .enumerate()
    {
        bed.publish_one(command_with("hook", json!({"callback": url}), n as u64))
            .await;
    }
    bed.publish_one(command_with(
        "hook",
        json!({"callback": format!("{}/listed", bed.upstream.base)}),
        9,
    ))
    .await;
    let results = bed.settle(5, Duration::from_secs(30)).await;
    for r in &results {
        let c = r.body["metadata"]["correlation_id"].as_str().unwrap();
        let expected = if c == "c-9" { "Succeeded" } else { "Failed" };
        assert_eq!(r.body["result_type"], expected, "{}", r.body);
    }
    let hits = bed.upstream.hits();
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!(hits[0].path, "/listed");
    let health = common::get_json(&format!("{}/ready", w.admin)).await;
    assert_eq!(health["ready"], true, "the node was not drained: {health}");
}

/// An upstream that answers 200 with a chunked body that never ends (it stops after 256 MiB
/// or when the client goes away); returns its base URL.
async fn endless_upstream() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let _ = sock.read(&mut buf).await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = format!("10000\r\n{}\r\n", "x".repeat(0x10000));
                for _ in 0..4096 {
                    if sock.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_is_cut_off_where_a_result_would_be_too_large() {
    let endless = endless_upstream().await;
    let bed = EffectBed::start(Arc::new(|_, _, _| Reply::ok(json!({"ok": true}))), |base| {
        format!(
            r#"format: 1
effects:
  - name: endless
    provider: http
    settings: {{ url: "{endless}/stream" }}
    timeout_ms: 600000
  - name: big
    provider: http
    settings: {{ url: "{base}/big" }}
"#
        )
    })
    .await;
    bed.upstream.set_script(Arc::new(|_, _, _| {
        Reply::ok(json!({"blob": "b".repeat(3 * 1024 * 1024)}))
    }));
    let _w = bed.runner(&[]);
    bed.publish_one(command_with("endless", json!({}), 1)).await;
    bed.publish_one(command_with("big", json!({}), 2)).await;
    let results = bed.settle(2, Duration::from_secs(60)).await;
    for r in &results {
        assert_eq!(r.body["result_type"], "Failed", "{}", r.body);
        let reason = r.body["payload"]["error"].as_str().unwrap_or_default();
        assert!(reason.contains("larger than"), "{}", r.body);
        // Fatal: one attempt, not retried.
        assert_eq!(r.body["attempts"], 1, "{}", r.body);
    }
}
