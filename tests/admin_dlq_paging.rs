//! Dead-letter listings read one bounded page, never the whole table or stream (finding:
//! `GET /admin/dlq?limit=1` read every stored letter — 40 000 of them, 3.2 s a call, +641 MiB
//! for four at once — and `GET /admin/dlq/stream?limit=1000` over large letters built a
//! 1.16 GiB answer). A page reads at most `limit` + 1 letters in key order from its cursor,
//! at most 10 000 letters or 16 MiB whatever its filters, answers at most 4 MiB with each
//! letter's body shown to 4 KiB (its whole size given), and gives `next` while more follow;
//! walking `next` returns every letter once, in order. The same for `runner dlq list`
//! (`--after NEXT`), with and without `--admin`. Real binary, real nats-server, real
//! libmdbx; the stores are filled offline through the store API, the stream by publishing.
//! Sizes and counts are asserted, never times.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{NatsServer, RunnerProc, jetstream, open_store, run_to_exit};
use runner::deadletter::{
    ANSWER_BYTES, DeadLetter, DeadLetterStatus, SCAN_BYTES, SCAN_ENTRIES, SHOWN_BODY_BYTES,
    SHOWN_FIELD_BYTES,
};
use serde_json::Value as Json;

/// Letters in the big store: more than three full scans' worth.
const N: u64 = 30_000;
/// The first `REDRIVEN` ids are redriven: in key order `acme`'s first 16 000 letters, more
/// than one page may scan, match no pending-only listing.
const REDRIVEN: u64 = 24_000;

fn tenant_of(id: u64) -> &'static str {
    if id.is_multiple_of(3) { "beta" } else { "acme" }
}

fn letter(tenant: &str, id: u64, body: String, reason: String, redriven: bool) -> DeadLetter {
    DeadLetter {
        id: 0,
        tenant: tenant.to_string(),
        kind: "expression".into(),
        reason,
        subject: format!("tenant.{tenant}.aggregate.Order.o-{id}"),
        source: format!("AGGREGATE_EVENTS:{id}"),
        body,
        body_bytes: None,
        traceparent: None,
        saga: Some("order".into()),
        correlation_id: Some(format!("o-{id}")),
        attempts: 1,
        at_ms: runner::clock::now_ms(),
        stored_ms: None,
        live_cap: None,
        timer_cap: None,
        status: if redriven {
            DeadLetterStatus::Redriven
        } else {
            DeadLetterStatus::Pending
        },
    }
}

/// Writes `letters` (in this order: their ids are 1, 2, …) into the store of a fresh data
/// directory.
fn store_with(letters: impl Iterator<Item = DeadLetter>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    store
        .write_blocking(|t| {
            for l in letters {
                t.push_dead_letter(l)?;
            }
            Ok(())
        })
        .unwrap();
    drop(store);
    dir
}

/// GET `url`: status, the answer's size in bytes, and the answer.
async fn get(url: &str) -> (u16, usize, Json) {
    let r = reqwest::get(url).await.unwrap();
    let status = r.status().as_u16();
    let body = r.bytes().await.unwrap();
    (status, body.len(), serde_json::from_slice(&body).unwrap())
}

/// Walks every page of `url` (which has a query already) through `next`; the pages.
async fn walk(url: &str) -> Vec<Json> {
    let mut pages = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let u = match &after {
            Some(a) => format!("{url}&after={a}"),
            None => url.to_string(),
        };
        let (status, bytes, page) = get(&u).await;
        assert_eq!(status, 200, "{u}: {page}");
        assert!(bytes <= ANSWER_BYTES, "{u}: {bytes} bytes");
        after = page["next"].as_str().map(str::to_string);
        pages.push(page);
        if after.is_none() {
            return pages;
        }
        assert!(pages.len() < 1000, "{url} does not end");
    }
}

fn items(pages: &[Json]) -> Vec<&Json> {
    pages
        .iter()
        .flat_map(|p| p["items"].as_array().unwrap())
        .collect()
}

fn ids(items: &[&Json]) -> Vec<(String, u64)> {
    items
        .iter()
        .map(|i| {
            (
                i["tenant"].as_str().unwrap().to_string(),
                i["id"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// What a listing must return, in key order: tenant by name, then id.
fn expected(keep: impl Fn(u64) -> bool) -> Vec<(String, u64)> {
    let set: BTreeSet<(String, u64)> = (1..=N)
        .filter(|id| keep(*id))
        .map(|id| (tenant_of(id).to_string(), id))
        .collect();
    set.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tens_of_thousands_of_letters_are_listed_a_bounded_page_at_a_time() {
    let dir = store_with((1..=N).map(|id| {
        letter(
            tenant_of(id),
            id,
            format!("{{\"n\":{id}}}"),
            "a guard failed".into(),
            id <= REDRIVEN,
        )
    }));
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(dir, &nats.url(), "manifests", &[]);
    let admin = runner.admin.clone();

    // `limit=1`: one letter, the first in key order, read alone; a `next`; no total.
    let (status, _, one) = get(&format!("{admin}/admin/dlq?limit=1&all=true")).await;
    assert_eq!(status, 200, "{one}");
    assert_eq!(one["items"].as_array().unwrap().len(), 1, "{one}");
    assert_eq!(one["items"][0]["id"], 1, "acme's first: {one}");
    assert_eq!(one["scanned"], 1, "{one}");
    assert!(one["next"].is_string(), "{one}");
    assert!(one.get("total").is_none(), "{one}");
    // The next page goes on after it.
    let (_, _, two) = get(&format!(
        "{admin}/admin/dlq?limit=1&all=true&after={}",
        one["next"].as_str().unwrap()
    ))
    .await;
    assert_eq!(two["items"][0]["id"], 2, "{two}");

    // Walking every page returns every letter once, in key order; a page reads what it shows.
    let pages = walk(&format!("{admin}/admin/dlq?limit=1000&all=true")).await;
    assert_eq!(pages.len() as u64, N / 1000, "pages of 1000");
    for p in &pages {
        assert_eq!(
            p["scanned"],
            p["items"].as_array().unwrap().len(),
            "{}",
            p["next"]
        );
    }
    assert_eq!(ids(&items(&pages)), expected(|_| true));

    // A tenant's listing returns only its letters, and reads no other tenant's.
    let pages = walk(&format!(
        "{admin}/admin/dlq?tenant=beta&limit=1000&all=true"
    ))
    .await;
    let beta = items(&pages);
    assert_eq!(ids(&beta), expected(|id| tenant_of(id) == "beta"));
    assert_eq!(
        pages
            .iter()
            .map(|p| p["scanned"].as_u64().unwrap())
            .sum::<u64>(),
        N / 3
    );
    // A beta cursor given to acme's listing still lists acme's only.
    let (_, _, acme) = get(&format!(
        "{admin}/admin/dlq?tenant=acme&limit=1000&after={}",
        pages[0]["next"].as_str().unwrap()
    ))
    .await;
    assert!(
        acme["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["tenant"] == "acme"),
        "{}",
        acme["next"]
    );

    // Pending only (the default): acme's first 16 000 are redriven, so the first page stops
    // at its scan bound with nothing to show, and says where to go on.
    let (_, _, first) = get(&format!("{admin}/admin/dlq?limit=1")).await;
    assert_eq!(first["items"], serde_json::json!([]), "{}", first["next"]);
    assert_eq!(first["scanned"], SCAN_ENTRIES, "{}", first["next"]);
    assert_eq!(first["stopped_at"], "scan_limit");
    assert!(first["next"].is_string());
    let pages = walk(&format!("{admin}/admin/dlq?limit=1000")).await;
    for p in &pages {
        assert!(p["scanned"].as_u64().unwrap() <= SCAN_ENTRIES as u64);
    }
    let pending = items(&pages);
    assert!(pending.iter().all(|i| i["status"] == "pending"));
    assert_eq!(ids(&pending), expected(|id| id > REDRIVEN));

    // Wrong arguments are named.
    for q in ["limit=0", "limit=1001", "after=zz", "after=abc"] {
        let (status, _, body) = get(&format!("{admin}/admin/dlq?{q}")).await;
        assert_eq!(status, 400, "{q}: {body}");
    }

    // `runner dlq list` prints the same pages, against the data directory beside the live
    // node and through its admin API.
    let data = runner.data_dir.path().to_str().unwrap().to_string();
    for place in [["--data-dir", data.as_str()], ["--admin", admin.as_str()]] {
        let mut seen = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..2 {
            let mut argv = vec!["dlq", "list", "--all", "--limit", "2", place[0], place[1]];
            if let Some(a) = &after {
                argv.extend(["--after", a.as_str()]);
            }
            let (code, out) = run_to_exit(&argv, &[], Duration::from_secs(30));
            assert_eq!(code, Some(0), "{argv:?}: {out}");
            let lines: Vec<&str> = out.lines().filter(|l| l.contains('\t')).collect();
            assert_eq!(lines.len(), 2, "{out}");
            assert!(out.contains("2 dead letter(s)"), "{out}");
            seen.extend(
                lines
                    .iter()
                    .map(|l| l.split('\t').next().unwrap().to_string()),
            );
            after = out
                .lines()
                .find_map(|l| l.strip_prefix("next: "))
                .map(str::to_string);
            assert!(after.is_some(), "{out}");
        }
        assert_eq!(seen, ["1", "2", "4", "5"], "{place:?}");
        let (code, out) = run_to_exit(
            &[
                "dlq", "list", "--limit", "3", "--output", "json", place[0], place[1],
            ],
            &[],
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(0), "{out}");
        let page: Json = serde_json::from_str(&out).unwrap();
        assert_eq!(page["items"], serde_json::json!([]), "{place:?}");
        assert_eq!(page["stopped_at"], "scan_limit", "{place:?}");
    }
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "list",
            "--data-dir",
            &data,
            "--after",
            "not-a-cursor",
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("`after` is not the `next` of an earlier page"),
        "{out}"
    );
    drop(runner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_letters_are_shown_cut_and_a_page_stops_at_its_byte_caps() {
    // 300 letters whose stored body is 8 KiB of control bytes (each escapes to six in JSON)
    // and whose reason is 8 KiB; then 400 redriven 64 KiB letters of another tenant ahead of
    // one pending letter.
    const BODY: usize = 8 << 10;
    const HUGE: usize = 64 << 10;
    let big =
        (1..=300u64).map(|id| letter("big", id, "\u{1}".repeat(BODY), "r".repeat(8 << 10), false));
    let huge = (1..=401u64).map(|id| letter("huge", id, "h".repeat(HUGE), "old".into(), id <= 400));
    let dir = store_with(big.chain(huge));
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(dir, &nats.url(), "manifests", &[]);
    let admin = runner.admin.clone();

    let url = format!("{admin}/admin/dlq?tenant=big&limit=1000");
    let (status, bytes, page) = get(&url).await;
    assert_eq!(status, 200, "{}", page["next"]);
    assert!(bytes <= ANSWER_BYTES, "{bytes} bytes");
    let shown = page["items"].as_array().unwrap();
    assert!(
        !shown.is_empty() && shown.len() < 300,
        "{} items",
        shown.len()
    );
    assert_eq!(page["stopped_at"], "answer_bytes");
    assert!(page["next"].is_string());
    for i in shown {
        assert!(i["body"].as_str().unwrap().len() <= SHOWN_BODY_BYTES);
        assert_eq!(i["body_stored_bytes"], BODY, "the whole size is given");
        assert!(i["reason"].as_str().unwrap().len() <= SHOWN_FIELD_BYTES);
        assert_eq!(i["cut"], true);
        assert!(i["body_bytes"].is_null(), "the store keeps it whole");
    }
    // Walking on returns each of them once, each page under the cap.
    let pages = walk(&url).await;
    let all: Vec<u64> = items(&pages)
        .iter()
        .map(|i| i["id"].as_u64().unwrap())
        .collect();
    assert_eq!(all, (1..=300).collect::<Vec<_>>());
    // The letter itself is whole.
    let (status, _, whole) = get(&format!("{admin}/admin/dlq/big/7")).await;
    assert_eq!(status, 200);
    assert_eq!(whole["body"].as_str().unwrap().len(), BODY);
    assert_eq!(whole["reason"].as_str().unwrap().len(), 8 << 10);

    // A filter that matches none of 400 large letters stops at the scan's byte bound.
    let (_, _, page) = get(&format!("{admin}/admin/dlq?tenant=huge&limit=1")).await;
    assert_eq!(page["items"], serde_json::json!([]), "{}", page["next"]);
    assert_eq!(page["stopped_at"], "scan_limit");
    let scanned = page["scanned"].as_u64().unwrap();
    assert!(
        scanned <= (SCAN_BYTES / HUGE) as u64 + 1 && scanned >= (SCAN_BYTES / HUGE) as u64 / 2,
        "{scanned} letters of 64 KiB read"
    );
    let pages = walk(&format!("{admin}/admin/dlq?tenant=huge&limit=1")).await;
    let pending = items(&pages);
    assert_eq!(pending.len(), 1);
    assert_eq!(
        pending[0]["id"],
        300 + 401,
        "the one pending after 400 redriven"
    );

    // The CLI prints the same bounded page.
    let data = runner.data_dir.path().to_str().unwrap().to_string();
    let (code, out) = run_to_exit(
        &[
            "dlq",
            "list",
            "--data-dir",
            &data,
            "--tenant",
            "big",
            "--limit",
            "1000",
            "--output",
            "json",
        ],
        &[],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{}", &out[..out.len().min(400)]);
    assert!(
        out.len() <= ANSWER_BYTES + (ANSWER_BYTES / 4),
        "{} bytes",
        out.len()
    );
    let page: Json = serde_json::from_str(&out).unwrap();
    assert_eq!(page["items"].as_array().unwrap().len(), shown.len());
    assert!(page["next"].is_string());
    drop(runner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_stream_is_read_within_its_byte_caps() {
    let nats = NatsServer::start();
    let runner = RunnerProc::saga(tempfile::tempdir().unwrap(), &nats.url(), "manifests", &[]);
    let admin = runner.admin.clone();
    let js = jetstream(&nats.url()).await;
    // 24 letters of 900 KB each (a JSON letter with a huge body and reason, and a field no
    // letter has), 10 payloads of 900 KB that are not JSON, then 200 letters whose 4 KiB
    // body is control bytes (six bytes each once escaped) of another tenant.
    let mut sizes = std::collections::HashMap::new();
    let (mut acme_seqs, mut ctl_seqs) = (Vec::new(), Vec::new());
    let publish = |subject: String, payload: Vec<u8>| {
        let js = js.clone();
        async move {
            let n = payload.len();
            let ack = js
                .publish(subject, payload.into())
                .await
                .unwrap()
                .await
                .unwrap();
            (ack.sequence, n)
        }
    };
    for i in 0..34 {
        let payload = if i < 24 {
            serde_json::to_vec(&serde_json::json!({
                "v": 1, "tenant_id": "acme", "kind": "junk", "reason": "r".repeat(5000),
                "subject": format!("tenant.acme.effect.x.{i}"), "source": "X:1",
                "body": "y".repeat(900_000), "extra": "z",
            }))
            .unwrap()
        } else {
            vec![b'\x01'; 900_000]
        };
        let (seq, n) = publish("tenant.acme.deadletter.junk".into(), payload).await;
        sizes.insert(seq, n);
        acme_seqs.insert(0, seq);
    }
    for _ in 0..200 {
        let payload = serde_json::to_vec(&serde_json::json!({
            "v": 1, "tenant_id": "ctl", "kind": "junk", "reason": "r",
            "subject": "tenant.ctl.effect.x.1", "source": "X:1", "body": "\u{1}".repeat(4096),
        }))
        .unwrap();
        let (seq, n) = publish("tenant.ctl.deadletter.junk".into(), payload).await;
        sizes.insert(seq, n);
        ctl_seqs.insert(0, seq);
    }

    // Control-byte letters: the answer stops at its cap.
    let url = format!("{admin}/admin/dlq/stream?tenant=ctl&limit=1000");
    let (status, bytes, page) = get(&url).await;
    assert_eq!(status, 200, "{}", page["next"]);
    assert!(bytes <= ANSWER_BYTES, "{bytes} bytes");
    let n = page["items"].as_array().unwrap().len();
    assert!(n > 0 && n < 200, "{n} items");
    assert_eq!(page["stopped_at"], "answer_bytes");
    let pages = walk(&url).await;
    let seqs: Vec<u64> = items(&pages)
        .iter()
        .map(|i| i["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, ctl_seqs, "newest first, once each");

    // Large letters: a page reads at most 16 MiB of them, shows each cut with its size.
    let url = format!("{admin}/admin/dlq/stream?tenant=acme&limit=1000");
    let (status, bytes, page) = get(&url).await;
    assert_eq!(status, 200, "{}", page["next"]);
    assert!(bytes <= ANSWER_BYTES, "{bytes} bytes");
    assert!(
        page["scanned_bytes"].as_u64().unwrap() <= (SCAN_BYTES + 1_000_000) as u64,
        "{}",
        page["scanned_bytes"]
    );
    assert_eq!(page["stopped_at"], "scan_limit");
    let pages = walk(&url).await;
    let acme = items(&pages);
    let seqs: Vec<u64> = acme.iter().map(|i| i["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, acme_seqs, "newest first, once each");
    assert!(pages.len() >= 2, "{} pages", pages.len());
    for i in &acme {
        let seq = i["seq"].as_u64().unwrap();
        assert_eq!(i["bytes"].as_u64().unwrap() as usize, sizes[&seq]);
        assert_eq!(i["cut"], true, "seq {seq}");
        let l = &i["letter"];
        if acme_seqs.iter().position(|s| *s == seq).unwrap() >= 10 {
            assert!(l["body"].as_str().unwrap().len() <= SHOWN_BODY_BYTES);
            assert!(l["reason"].as_str().unwrap().len() <= SHOWN_FIELD_BYTES);
            assert_eq!(l["kind"], "junk");
            assert!(l.get("extra").is_none());
        } else {
            assert!(l.as_str().unwrap().len() <= SHOWN_BODY_BYTES);
        }
    }
    // The CLI through the node pages the same way.
    let (code, out) = run_to_exit(
        &[
            "dlq", "list", "--stream", "--tenant", "acme", "--admin", &admin,
        ],
        &[],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("page stopped at its scan_limit"), "{out}");
    let next = out
        .lines()
        .find_map(|l| l.strip_prefix("next: "))
        .unwrap()
        .to_string();
    let (code, out) = run_to_exit(
        &[
            "dlq", "list", "--stream", "--tenant", "acme", "--admin", &admin, "--after", &next,
        ],
        &[],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{out}");
    let first_seq: u64 = out
        .lines()
        .next()
        .unwrap()
        .split('\t')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(first_seq + 1, next.parse::<u64>().unwrap(), "{out}");
    let (status, _, body) = get(&format!("{admin}/admin/dlq/stream?after=x")).await;
    assert_eq!(status, 400, "{body}");
    drop(runner);
}
