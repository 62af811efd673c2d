//! A result larger than the broker takes: an upstream answering megabytes (over HTTP, where
//! the answer is cut off at the limit, or gRPC, where the reply is refused from its length
//! prefix) ends its command with a small `Failed`
//! result that says so, the upstream is
//! called once, and nothing loops — the result could be neither stored in the claim nor
//! published as it was.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::effects::{EffectBed, command_with, one_per_command};
use common::grpc::{GrpcReply, GrpcUpstream, Reflection, charged, committed_descriptors};
use common::upstream::Reply;
use serde_json::json;

const BIG: usize = 2_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_reply_fails_its_command_once_instead_of_looping() {
    let grpc = GrpcUpstream::start(
        Arc::new(|call| {
            let mut reply = charged(call);
            if call.request["customerId"] == "big" {
                reply["paymentId"] = json!("p".repeat(BIG));
            }
            GrpcReply::ok(reply)
        }),
        Reflection::None,
        None,
    )
    .await;
    let grpc_base = grpc.base.clone();
    let fds = committed_descriptors();
    let bed = EffectBed::start(
        Arc::new(|path, _, _| {
            if path == "/big" {
                Reply::ok(json!({ "blob": "b".repeat(BIG) }))
            } else {
                Reply::ok(json!({ "ok": true }))
            }
        }),
        move |base| {
            format!(
                r#"format: 1
effects:
  - name: web
    provider: http
    settings: {{ url: "{base}/${{ event.payload.size }}" }}
    timeout_ms: 30000
    retry: {{ retry_limit: 2 }}
  - name: rpc
    provider: grpc
    settings:
      endpoint: {grpc_base}
      method: payments.v1.Payments/Charge
      descriptors: {}
      request: {{ customer_id: "${{ event.payload.size }}" }}
    timeout_ms: 30000
    retry: {{ retry_limit: 2 }}
"#,
                fds.display()
            )
        },
    )
    .await;
    let _w = bed.runner(&[("RUNNER__STORAGE__DURABILITY", "unsafe_no_sync")]);
    let ids = bed
        .publish(&[
            command_with("web", json!({ "size": "big" }), 1),
            command_with("web", json!({ "size": "small" }), 2),
            command_with("rpc", json!({ "size": "big" }), 3),
            command_with("rpc", json!({ "size": "small" }), 4),
        ])
        .await;
    let seen = bed.settle(4, Duration::from_secs(90)).await;
    let by_cmd = one_per_command(&seen);
    // Over HTTP the answer is not even read whole: the provider stops at the result limit.
    let web = &by_cmd[&ids[0]];
    assert_eq!(web["result_type"], "Failed", "{}", web["payload"]);
    let p = &web["payload"];
    assert_eq!(p["status"], 200, "{p}");
    assert!(p["error"].as_str().unwrap().contains("larger than"), "{p}");
    // Over gRPC the reply is refused from its length prefix, before it is read.
    let rpc = &by_cmd[&ids[2]];
    assert_eq!(rpc["result_type"], "Failed", "{}", rpc["payload"]);
    let p = &rpc["payload"];
    assert!(
        p["error"]
            .as_str()
            .unwrap()
            .contains("the reply is larger than"),
        "{p}"
    );
    for small in [&ids[1], &ids[3]] {
        assert_eq!(by_cmd[small]["result_type"], "Succeeded");
    }
    assert_eq!(
        bed.upstream.count(&ids[0]),
        1,
        "the HTTP upstream was called once"
    );
    assert_eq!(grpc.count(&ids[2]), 1, "the gRPC upstream was called once");
}
