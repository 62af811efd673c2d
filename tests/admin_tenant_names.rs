//! Tenant names on the admin API (finding: `runner tenants pause --tenant` with a name the
//! control bucket refuses — NUL, ESC, non-ASCII — got a 503, as if NATS were down): every
//! tenant-scoped route answers a tenant that cannot be one (NUL, whitespace, `.`, `*`, `>`,
//! over 128 bytes) with 400 naming the rule; pause and resume also refuse, 400 naming their
//! rule, a tenant the control bucket cannot key; the CLI shows the rule; a valid tenant still
//! works, and a tenant admission accepts (non-ASCII, control characters) can still be read.
//! Real binary, real nats-server.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{NatsServer, RunnerProc, run_to_exit};
use runner::admin::client::enc;
use runner::worker::admission::TENANT_RULE;
use runner::worker::control::PAUSE_RULE;
use serde_json::{Value as Json, json};

async fn call(method: reqwest::Method, url: &str, body: Option<Json>) -> (u16, Json) {
    let mut req = reqwest::Client::new().request(method, url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Json::Null))
}

/// Every tenant-scoped route of the admin API, with `t` (percent-encoded) as its tenant.
fn routes(admin: &str, t: &str) -> Vec<(reqwest::Method, String, Option<Json>)> {
    use reqwest::Method;
    let e = enc(t);
    vec![
        (
            Method::POST,
            format!("{admin}/admin/tenants/{e}/pause"),
            None,
        ),
        (
            Method::POST,
            format!("{admin}/admin/tenants/{e}/resume"),
            None,
        ),
        (
            Method::GET,
            format!("{admin}/admin/instances?tenant={e}&saga=order"),
            None,
        ),
        (
            Method::GET,
            format!("{admin}/admin/instance?tenant={e}&saga=order&id=o-1"),
            None,
        ),
        (Method::GET, format!("{admin}/admin/dlq?tenant={e}"), None),
        (Method::GET, format!("{admin}/admin/dlq/{e}/1"), None),
        (
            Method::POST,
            format!("{admin}/admin/dlq/{e}/1/redrive"),
            None,
        ),
        (
            Method::GET,
            format!("{admin}/admin/dlq/stream?tenant={e}"),
            None,
        ),
        (
            Method::POST,
            format!("{admin}/admin/dlq/stream/{e}/1/redrive"),
            None,
        ),
        (
            Method::POST,
            format!("{admin}/admin/migrate"),
            Some(json!({"tenant": t, "saga": "order", "from": 1, "dry_run": true})),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tenant_names_are_refused_with_the_rule_and_valid_ones_work() {
    let nats = NatsServer::start();
    let runner = RunnerProc::combined(&nats.url(), "manifests", &[]);
    let admin = runner.admin.clone();

    // Not a tenant anywhere in Runner: every route refuses it, naming the rule.
    let long = "t".repeat(129);
    for t in [
        "a\0b",
        "a b",
        "a\tb",
        "a\u{1b}[31mb",
        "a.b",
        "*",
        ">",
        "a*b",
        long.as_str(),
    ] {
        for (method, url, body) in routes(&admin, t) {
            let (status, answer) = call(method.clone(), &url, body).await;
            let error = answer["error"].as_str().unwrap_or_default();
            assert_eq!(status, 400, "{method} {url}: {answer}");
            assert!(error.contains(TENANT_RULE), "{method} {url}: {answer}");
            assert!(!error.contains('\0'), "{method} {url}: {answer}");
            assert!(!error.contains('\u{1b}'), "escaped: {answer}");
        }
    }

    // Tenants admission takes (a subject token may hold them) but the control bucket cannot
    // key: pause and resume refuse them naming their rule; reads still answer.
    for t in ["müller", "a+b", "a@b"] {
        for verb in ["pause", "resume"] {
            let url = format!("{admin}/admin/tenants/{}/{verb}", enc(t));
            let (status, answer) = call(reqwest::Method::POST, &url, None).await;
            assert_eq!(status, 400, "{url}: {answer}");
            let error = answer["error"].as_str().unwrap();
            assert!(error.contains(PAUSE_RULE), "{url}: {answer}");
            assert!(!error.contains('\u{1b}'), "escaped: {answer}");
        }
        let url = format!("{admin}/admin/instances?tenant={}&saga=order", enc(t));
        let (status, answer) = call(reqwest::Method::GET, &url, None).await;
        assert_eq!(status, 200, "{url}: {answer}");
        let url = format!("{admin}/admin/dlq?tenant={}", enc(t));
        let (status, answer) = call(reqwest::Method::GET, &url, None).await;
        assert_eq!(status, 200, "{url}: {answer}");
    }

    // The CLI says what the node said: the status and the rule; exit 1.
    for t in ["a\u{1b}b", "müller", "a b", "a.b"] {
        let (code, out) = run_to_exit(
            &["tenants", "pause", "--tenant", t, "--admin", &admin],
            &[],
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(1), "{t:?}: {out}");
        assert!(out.contains("the node answered 400"), "{t:?}: {out}");
        assert!(out.contains("1 to 128 bytes"), "{t:?}: {out}");
        assert!(!out.contains("503"), "{t:?}: {out}");
    }

    // Valid tenants work: paused, listed, resumed; read routes answer as before.
    for t in ["acme", "eu-west_1=a/b"] {
        let (code, out) = run_to_exit(
            &["tenants", "pause", "--tenant", t, "--admin", &admin],
            &[],
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(0), "{t}: {out}");
        assert!(out.contains("\"paused\": true"), "{t}: {out}");
    }
    let (code, out) = run_to_exit(
        &["tenants", "list", "--admin", &admin],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("acme") && out.contains("eu-west_1=a/b"),
        "{out}"
    );
    for t in ["acme", "eu-west_1=a/b"] {
        let (code, out) = run_to_exit(
            &["tenants", "resume", "--tenant", t, "--admin", &admin],
            &[],
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(0), "{t}: {out}");
    }
    let (status, answer) = call(
        reqwest::Method::GET,
        &format!("{admin}/admin/instances?tenant=acme&saga=order"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = call(
        reqwest::Method::GET,
        &format!("{admin}/admin/instance?tenant=acme&saga=order&id=o-1"),
        None,
    )
    .await;
    assert_eq!(status, 404, "no such instance, a valid question: {answer}");
    let (status, answer) = call(
        reqwest::Method::GET,
        &format!("{admin}/admin/dlq/stream?tenant=acme"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
}
