//! Saga visibility end to end: a running saga node's instances listed by state and age —
//! `runner instances list` on its live store and `GET /admin/instances` — paged, scoped to
//! one tenant, behind the admin token; and the terminal workflow event each ended saga
//! publishes, which a caller waits for instead of polling.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{
    NatsServer, RunnerProc, aggregate_event, effect_result, jetstream, publish_json, run_to_exit,
    wait_for_messages,
};
use serde_json::{Value as Json, json};

const TOKEN: &str = "instances-test-token";

/// Lists through the CLI (JSON output), every page; returns the correlation ids in order.
fn cli_all(data_dir: &str, args: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut argv = vec![
            "instances",
            "list",
            "--data-dir",
            data_dir,
            "--output",
            "json",
            "--limit",
            "3",
        ];
        argv.extend_from_slice(args);
        if let Some(a) = &after {
            argv.extend_from_slice(&["--after", a]);
        }
        let (code, text) = run_to_exit(&argv, &[], Duration::from_secs(30));
        assert_eq!(code, Some(0), "{text}");
        let page: Json = serde_json::from_str(&text).unwrap();
        let items = page["items"].as_array().unwrap();
        assert!(items.len() <= 3);
        out.extend(
            items
                .iter()
                .map(|i| i["correlation_id"].as_str().unwrap().to_string()),
        );
        match page["next"].as_str() {
            Some(n) => after = Some(n.to_string()),
            None => return out,
        }
    }
}

async fn admin(base: &str, query: &str, token: Option<&str>) -> (u16, Json) {
    let mut req = reqwest::Client::new().get(format!("{base}/admin/instances?{query}"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Json::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_are_listed_by_state_and_age_per_tenant_and_ended_sagas_announce_it() {
    let nats = NatsServer::start();
    // Orders are backdated by ten minutes below: beyond the default `saga.max_clock_skew`
    // (5 minutes), so it is widened to keep their own timestamps.
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        "manifests",
        &[
            ("RUNNER__ADMIN__TOKEN", TOKEN),
            ("RUNNER__SAGA__MAX_CLOCK_SKEW", "1h"),
        ],
    );
    let js = jetstream(&nats.url()).await;
    let now = runner::clock::now_ms();
    // acme: o-0..o-7, the first four placed ten minutes ago (within the order saga's
    // 15-minute payment timeout, so no timer fires); globex: g-0..g-2.
    let ten_minutes = 600_000;
    for i in 0..8u64 {
        let at = if i < 4 {
            now - ten_minutes + i
        } else {
            now + i
        };
        let ev = aggregate_event(
            "acme",
            "Order",
            &format!("o-{i}"),
            "OrderPlaced",
            at,
            json!({ "customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}] }),
        );
        publish_json(&js, &format!("tenant.acme.aggregate.Order.o-{i}"), &ev).await;
    }
    for i in 0..3u64 {
        let ev = aggregate_event(
            "globex",
            "Order",
            &format!("g-{i}"),
            "OrderPlaced",
            now,
            json!({ "customer_id": "c", "amount_cents": 100, "items": [{"sku": "s", "qty": 1}] }),
        );
        publish_json(&js, &format!("tenant.globex.aggregate.Order.g-{i}"), &ev).await;
    }
    let charges = wait_for_messages(
        &js,
        "WORKFLOW_COMMANDS",
        "tenant.*.effect.charge_card.*",
        11,
        Duration::from_secs(60),
    )
    .await;
    // Decline the even acme orders: they end cancelled.
    for c in &charges {
        let order = c.body["payload"]["order_id"].as_str().unwrap();
        if c.body["tenant_id"] == "acme" && order[2..].parse::<u64>().unwrap() % 2 == 0 {
            let (subject, body) =
                effect_result(&c.body, "Failed", now + 10, json!({ "error": "declined" }));
            publish_json(&js, &subject, &body).await;
        }
    }
    let ended = wait_for_messages(
        &js,
        "WORKFLOW_EVENTS",
        "tenant.acme.workflow_event.order.*",
        4,
        Duration::from_secs(60),
    )
    .await;
    let ended_ids: BTreeSet<String> = ended
        .iter()
        .map(|e| {
            assert_eq!(e.body["event_type"], "SagaFailed", "{}", e.body);
            assert_eq!(e.body["payload"]["state"], "cancelled");
            e.body["correlation_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        ended_ids,
        ["o-0", "o-2", "o-4", "o-6"].map(String::from).into()
    );

    // The CLI on the live node's store, paged three at a time, oldest first.
    let dir = runner.data_dir.path().to_str().unwrap().to_string();
    let acme = ["--tenant", "acme", "--saga", "order"];
    let all = cli_all(&dir, &acme);
    assert_eq!(all, (0..8).map(|i| format!("o-{i}")).collect::<Vec<_>>());
    let waiting = cli_all(
        &dir,
        &[&acme[..], &["--state", "awaiting_payment"]].concat(),
    );
    assert_eq!(waiting, ["o-1", "o-3", "o-5", "o-7"]);
    let cancelled = cli_all(&dir, &[&acme[..], &["--state", "cancelled"]].concat());
    assert_eq!(cancelled, ["o-0", "o-2", "o-4", "o-6"]);
    let old = cli_all(&dir, &[&acme[..], &["--older-than", "5m"]].concat());
    assert_eq!(old, ["o-0", "o-1", "o-2", "o-3"]);
    let old_waiting = cli_all(
        &dir,
        &[
            &acme[..],
            &["--older-than", "5m", "--state", "awaiting_payment"],
        ]
        .concat(),
    );
    assert_eq!(old_waiting, ["o-1", "o-3"]);
    let globex = cli_all(&dir, &["--tenant", "globex", "--saga", "order"]);
    assert_eq!(globex, ["g-0", "g-1", "g-2"]);
    // Text output: a line per instance, then where to continue.
    let (code, text) = run_to_exit(
        &[
            "instances",
            "list",
            "--data-dir",
            &dir,
            "--tenant",
            "acme",
            "--saga",
            "order",
            "--limit",
            "2",
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{text}");
    assert!(text.starts_with("o-0\tcancelled\tfailed\tv1\t"), "{text}");
    assert!(text.lines().last().unwrap().starts_with("next: "), "{text}");
    // A bad continuation is refused, not read as a position.
    let (code, text) = run_to_exit(
        &[
            "instances",
            "list",
            "--data-dir",
            &dir,
            "--tenant",
            "acme",
            "--saga",
            "order",
            "--after",
            "xyz",
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("`after` is not the `next` of an earlier page"),
        "{text}"
    );

    // The same commands against the running node's admin API (--admin): the same answers.
    let remote = |args: &[&str], token: &str| {
        let mut argv: Vec<&str> = args.to_vec();
        argv.extend_from_slice(&["--admin", runner.admin.as_str()]);
        run_to_exit(
            &argv,
            &[("RUNNER_ADMIN_TOKEN", token)],
            Duration::from_secs(30),
        )
    };
    let listing = [
        "instances",
        "list",
        "--tenant",
        "acme",
        "--saga",
        "order",
        "--output",
        "json",
        "--limit",
        "1000",
    ];
    let (code, over_api) = remote(&listing, TOKEN);
    assert_eq!(code, Some(0), "{over_api}");
    let (code, local) = run_to_exit(
        &[&listing[..], &["--data-dir", &dir]].concat(),
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{local}");
    let (a, b): (Json, Json) = (
        serde_json::from_str(&over_api).unwrap(),
        serde_json::from_str(&local).unwrap(),
    );
    assert_eq!(a, b, "the API and the data directory list the same");
    let (code, out) = remote(
        &[
            "inspect", "--tenant", "acme", "--saga", "order", "--id", "o-1",
        ],
        TOKEN,
    );
    assert_eq!(code, Some(0), "{out}");
    let view: Json = serde_json::from_str(&out).unwrap();
    assert_eq!(view["instance"]["state"], "awaiting_payment");
    // The same instance as text: a summary line, then one line per transition.
    let (code, text) = remote(
        &[
            "inspect", "--tenant", "acme", "--saga", "order", "--id", "o-1", "--output", "text",
        ],
        TOKEN,
    );
    assert_eq!(code, Some(0), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("acme/order/o-1\tstate awaiting_payment\tstatus "),
        "{text}"
    );
    let steps = view["recent_transitions"].as_array().unwrap();
    assert!(!steps.is_empty());
    let transitions: Vec<&&str> = lines.iter().filter(|l| l.contains(" -> ")).collect();
    assert_eq!(transitions.len(), steps.len(), "{text}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("timer payment_timeout\tdue_ms ")),
        "{text}"
    );
    for (h, line) in steps.iter().zip(transitions) {
        let want = format!(
            "{} -> {}",
            h["from"].as_str().unwrap(),
            h["to"].as_str().unwrap()
        );
        assert!(line.contains(&want), "{line} lacks {want}");
    }
    let (code, out) = remote(&["dlq", "list", "--output", "json"], TOKEN);
    assert_eq!(code, Some(0), "{out}");
    let page = serde_json::from_str::<Json>(&out).unwrap();
    assert_eq!(page["items"], json!([]), "{page}");
    assert!(page.get("next").is_none(), "{page}");
    let (code, out) = remote(&["dlq", "list"], "wrong-token");
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("the node answered 401"), "{out}");
    assert!(
        !out.contains("wrong-token"),
        "the token is never printed: {out}"
    );

    // The admin API: the same listing, behind the token, one tenant at a time.
    let base = runner.admin.clone();
    for token in [None, Some("wrong")] {
        let (status, body) = admin(&base, "tenant=acme&saga=order", token).await;
        assert_eq!(status, 401, "{token:?}: no token, no data");
        assert!(body.get("items").is_none(), "{body}");
    }
    let (status, page) = admin(
        &base,
        "tenant=acme&saga=order&state=awaiting_payment&older_than=5m",
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{page}");
    let ids: Vec<&str> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["correlation_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["o-1", "o-3"]);
    assert_eq!(page["items"][0]["status"], "running");
    // A continuation taken from acme's listing, used for globex, stays in globex.
    let (_, first) = admin(&base, "tenant=acme&saga=order&limit=2", Some(TOKEN)).await;
    let next = first["next"].as_str().unwrap();
    let (status, page) = admin(
        &base,
        &format!("tenant=globex&saga=order&after={next}"),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200);
    for i in page["items"].as_array().unwrap() {
        assert!(
            i["correlation_id"].as_str().unwrap().starts_with("g-"),
            "{page}"
        );
    }
    for (query, says) in [
        ("saga=order", "`tenant` and `saga` are required"),
        (
            "tenant=acme&saga=order&older_than=soon",
            "`older_than` is not a duration",
        ),
        (
            "tenant=acme&saga=order&limit=0",
            "`limit` must be 1 to 1000",
        ),
        ("tenant=a.b&saga=order", "`tenant` must be a name"),
    ] {
        let (status, body) = admin(&base, query, Some(TOKEN)).await;
        assert_eq!(status, 400, "{query}");
        assert!(
            body["error"].as_str().unwrap().contains(says),
            "{query}: {body}"
        );
    }
}
