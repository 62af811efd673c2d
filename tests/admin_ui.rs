//! The admin page end to end in headless Chromium (WebDriver): a wrong token gets no data;
//! with the right one the page shows the node, finds an instance by id with its timeline,
//! lists instances, shows a dead letter, and redriving it (after the manifest bug that made
//! it was fixed by a reload) makes it leave the list. Also the operator routes it calls.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::browser::Browser;
use common::{NatsServer, RunnerProc, aggregate_event, jetstream, publish_json};
use serde_json::{Value as Json, json};

const TOKEN: &str = "ui-test-token-0123456789";

/// `bad` makes `${ event.payload.n + 1 }` a type error for a string `n`; `fixed` does not.
fn manifest(fixed: bool) -> String {
    let n = if fixed {
        "${ string(event.payload.n) }"
    } else {
        "${ event.payload.n + 1 }"
    };
    format!(
        r#"format: 1
sagas:
  - name: visit
    version: 1
    triggers: [{{ subject: aggregate.Door.*, correlation: event.aggregate_id, start: true }}]
    data: {{ n: "{n}" }}
    initial_state: closed
    states:
      closed:
        on:
          Opened: {{ goto: open }}
      open:
        on:
          Closed: {{ goto: shut }}
      shut: {{ terminal: true }}
"#
    )
}

async fn get(url: &str, token: Option<&str>) -> (u16, Json) {
    let mut req = reqwest::Client::new().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Json::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_page_finds_an_instance_and_redrives_a_dead_letter_in_a_real_browser() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    let file = manifests.path().join("visit.yaml");
    std::fs::write(&file, manifest(false)).unwrap();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[("RUNNER__ADMIN__TOKEN", TOKEN)],
    );
    let admin = runner.admin.clone();
    let js = jetstream(&nats.url()).await;
    let now = runner::clock::now_ms();
    // door-1 opens and moves on (a timeline of two steps); door-2's first input is poison.
    for (id, ty, n, at) in [
        ("door-1", "Opened", json!(1), now),
        ("door-1", "Closed", json!(1), now + 1),
        ("door-2", "Opened", json!("x"), now + 2),
    ] {
        let ev = aggregate_event("acme", "Door", id, ty, at, json!({ "n": n }));
        publish_json(&js, &format!("tenant.acme.aggregate.Door.{id}"), &ev).await;
    }
    let dlq_url = format!("{admin}/admin/dlq?tenant=acme");
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            get(&dlq_url, Some(TOKEN)).await.1["total"] == 1
        })
        .await,
        "door-2 was dead-lettered"
    );
    let (_, list) = get(&dlq_url, Some(TOKEN)).await;
    let letter_id = list["items"][0]["id"].as_u64().unwrap();
    assert_eq!(list["items"][0]["correlation_id"], "door-2");
    // The operator routes answer only with the token.
    let (status, body) = get(&dlq_url, Some("wrong")).await;
    assert_eq!(status, 401);
    assert!(body.get("items").is_none());
    let (status, view) = get(
        &format!("{admin}/admin/instance?tenant=acme&saga=visit&id=door-1"),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["instance"]["state"], "shut");
    let (status, _) = get(
        &format!("{admin}/admin/instance?tenant=acme&saga=visit&id=nope"),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 404);

    let browser = Browser::start().await;
    browser.goto(&format!("{admin}/admin/ui")).await;
    // A wrong token: an error, and no data anywhere on the page.
    browser.fill("#token", "not-the-token").await;
    browser.click("#connect").await;
    browser
        .wait_for("#status", "a wrong token is refused", |t| {
            t.first().is_some_and(|s| s.contains("401"))
        })
        .await;
    assert!(browser.texts("#node tr").await.is_empty());
    assert!(browser.texts("#dlq tr").await.is_empty());

    // The right token: node, partitions and effects sections, and the dead letter.
    browser.fill("#token", TOKEN).await;
    browser.click("#connect").await;
    browser
        .wait_for("#status", "connected", |t| {
            t.first().is_some_and(|s| s == "connected")
        })
        .await;
    // A token kept from before in this browser session connects the page by itself.
    browser.goto(&format!("{admin}/admin/ui")).await;
    browser
        .wait_for("#status", "connected again by itself", |t| {
            t.first().is_some_and(|s| s == "connected")
        })
        .await;
    let node = browser.texts("#node tr").await.join("\n");
    assert!(node.contains("mode") && node.contains("saga"), "{node}");
    assert!(node.contains("outbox depth"), "{node}");
    let rows = browser.texts("#dlq tr.dlq-row").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(rows[0].contains("door-2"), "{rows:?}");

    // Find door-1 by id: its timeline, start to finish.
    browser.fill("#q-tenant", "acme").await;
    browser.fill("#q-saga", "visit").await;
    browser.fill("#q-id", "door-1").await;
    browser.click("#lookup").await;
    let title = browser
        .wait_for("#instance-title", "the instance is shown", |t| {
            !t.is_empty()
        })
        .await;
    assert!(
        title[0].contains("shut") && title[0].contains("completed"),
        "{title:?}"
    );
    let steps = browser.texts("#timeline tr.step").await;
    assert_eq!(steps.len(), 2, "{steps:?}");
    assert!(
        steps[0].contains("Opened") && steps[0].contains("open"),
        "{steps:?}"
    );
    assert!(
        steps[1].contains("Closed") && steps[1].contains("shut"),
        "{steps:?}"
    );
    // The README's picture of the page is this moment: node, partitions, effects, dead
    // letters and one instance's timeline. It always lands in the target directory;
    // `UPDATE_SCREENSHOTS=1` also replaces docs/images/admin-ui.png.
    let png = browser.screenshot().await;
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(
        png.len() > 10_000,
        "a {}-byte screenshot shows nothing",
        png.len()
    );
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("admin-ui.png");
    std::fs::write(&target, &png).unwrap();
    if std::env::var_os("UPDATE_SCREENSHOTS").is_some() {
        let docs = common::repo_root().join("docs/images");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::write(docs.join("admin-ui.png"), &png).unwrap();
    }
    // The list of instances in a state.
    browser.fill("#q-state", "shut").await;
    browser.click("#list").await;
    browser
        .wait_for("#instances tr", "door-1 listed", |t| {
            t.len() == 1 && t[0].contains("door-1")
        })
        .await;

    // Show the letter, fix the manifest, redrive from the page: it leaves the list.
    browser
        .click(&format!("button.show[data-id=\"{letter_id}\"]"))
        .await;
    browser
        .wait_for("#letter-body", "the letter is shown", |t| {
            t.first().is_some_and(|b| b.contains("door-2"))
        })
        .await;
    std::fs::write(&file, manifest(true)).unwrap();
    let r = reqwest::Client::new()
        .post(format!("{admin}/admin/reload"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    browser
        .click(&format!("button.redrive[data-id=\"{letter_id}\"]"))
        .await;
    browser
        .wait_for(
            "#dlq tr.dlq-row",
            "the redriven letter leaves the list",
            |t| t.is_empty(),
        )
        .await;
    let (_, view) = get(
        &format!("{admin}/admin/instance?tenant=acme&saga=visit&id=door-2"),
        Some(TOKEN),
    )
    .await;
    assert_eq!(view["instance"]["state"], "open", "{view}");
    assert_eq!(view["instance"]["data"]["n"], "x");
    // A second redrive of the same letter is refused: it was applied once.
    let r = reqwest::Client::new()
        .post(format!("{admin}/admin/dlq/acme/{letter_id}/redrive"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
}

/// On an open loopback admin the page connects by itself and refreshes on its own: inputs
/// published after it loaded show in its charts and totals with nothing clicked. Looking an
/// instance up draws its saga with the path it took highlighted and its state marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_page_connects_by_itself_refreshes_and_draws_the_saga_path() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("visit.yaml"), manifest(true)).unwrap();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[],
    );
    let admin = runner.admin.clone();
    let js = jetstream(&nats.url()).await;
    let browser = Browser::start().await;
    browser.goto(&format!("{admin}/admin/ui")).await;
    browser
        .wait_for("#status", "connected with nothing clicked", |t| {
            t.first().is_some_and(|s| s == "connected")
        })
        .await;
    browser
        .wait_for("#applied-total", "a first sample", |t| {
            t.first().is_some_and(|s| s == "0")
        })
        .await;

    let now = runner::clock::now_ms();
    for (ty, at) in [("Opened", now), ("Closed", now + 1)] {
        let ev = aggregate_event("acme", "Door", "door-7", ty, at, json!({ "n": 1 }));
        publish_json(&js, "tenant.acme.aggregate.Door.door-7", &ev).await;
    }
    browser
        .wait_for("#applied-total", "the page refreshed by itself", |t| {
            t.first().is_some_and(|s| s == "2")
        })
        .await;
    let samples = browser
        .script(
            "return document.getElementById('chart-inputs').dataset.samples;",
            json!([]),
        )
        .await;
    assert!(
        samples.as_str().and_then(|s| s.parse::<u32>().ok()) >= Some(1),
        "the inputs chart has samples: {samples}"
    );
    let points = browser
        .script(
            "return document.querySelector('#chart-inputs polyline').getAttribute('points');",
            json!([]),
        )
        .await;
    assert!(points.as_str().is_some_and(|p| p.contains(',')), "{points}");

    browser.fill("#q-tenant", "acme").await;
    browser.fill("#q-saga", "visit").await;
    browser.fill("#q-id", "door-7").await;
    browser.click("#lookup").await;
    browser
        .wait_for("#diagram .state", "the saga is drawn", |t| t.len() == 3)
        .await;
    let names = |css: &str| {
        format!("return Array.from(document.querySelectorAll('{css}')).map(e => e.dataset.name);")
    };
    let taken = browser
        .script(&names("#diagram .state.taken"), json!([]))
        .await;
    assert_eq!(
        taken,
        json!(["closed", "open", "shut"]),
        "every state visited"
    );
    let current = browser
        .script(&names("#diagram .state.current"), json!([]))
        .await;
    assert_eq!(current, json!(["shut"]));
    let edges = browser
        .script(
            "return Array.from(document.querySelectorAll('#diagram .edge.taken')).map(e => e.dataset.from + '>' + e.dataset.to);",
            json!([]),
        )
        .await;
    assert_eq!(edges, json!(["closed>open", "open>shut"]));
    let (status, graph) = get(&format!("{admin}/admin/graph?saga=visit"), None).await;
    assert_eq!(status, 200, "{graph}");
    assert_eq!(graph["initial"], "closed");
    let (status, _) = get(&format!("{admin}/admin/graph?saga=nope"), None).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrives_are_rate_limited() {
    let nats = NatsServer::start();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("visit.yaml"), manifest(true)).unwrap();
    let runner = RunnerProc::saga(
        tempfile::tempdir().unwrap(),
        &nats.url(),
        manifests.path().to_str().unwrap(),
        &[("RUNNER__ADMIN__TOKEN", TOKEN)],
    );
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for _ in 0..30 {
        let r = client
            .post(format!("{}/admin/dlq/acme/999/redrive", runner.admin))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        statuses.push((
            r.status().as_u16(),
            r.headers().get("retry-after").is_some(),
        ));
    }
    // Five tokens a second: the first five reach the store (404: no such letter); thirty
    // requests in a row cannot all find a token, and those that do not are turned away
    // with a Retry-After.
    assert_eq!(&statuses[..5], &[(404, false); 5], "{statuses:?}");
    assert!(statuses[5..].contains(&(429, true)), "{statuses:?}");
    drop(nats);
}
