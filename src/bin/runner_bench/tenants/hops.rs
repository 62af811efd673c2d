//! Where one tenant's orders waited, hop by hop, from the broker's stored times: the route
//! (an order event stored → its router's copy stored in the saga inbox), each saga step (an
//! input stored → the output it caused stored) and each effect (a command stored → its
//! result stored in the saga inbox).
//!
//! Read after a drive from the streams themselves (the order's event, its commands, the
//! results in the inbox, its end event), so it measures what the runner did, not what a
//! watcher saw. An order missing a hop is left out of that hop only.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use serde_json::Value as Json;

/// The order saga's path: (hop name, the stage it starts at, the stage it ends at).
const HOPS: [(&str, &str, &str); 8] = [
    ("route: placed → inbox", "placed", "routed"),
    ("saga: inbox → charge", "routed", "cmd:charge_card"),
    ("effect: charge", "cmd:charge_card", "res:charge_card"),
    ("saga: → reserve", "res:charge_card", "cmd:reserve_stock"),
    ("effect: reserve", "cmd:reserve_stock", "res:reserve_stock"),
    ("saga: → ship", "res:reserve_stock", "cmd:create_shipment"),
    ("effect: ship", "cmd:create_shipment", "res:create_shipment"),
    ("saga: → fulfilled", "res:create_shipment", "fulfilled"),
];

/// Per order of `tenant`, when each stage was stored (ns since the epoch).
type Stages = HashMap<String, HashMap<String, i128>>;

/// One line: each hop's p50/p95 in ms for `tenant`'s orders.
pub(crate) async fn line(js: &jetstream::Context, tenant: &str) -> Result<String> {
    let mut stages: Stages = HashMap::new();
    let mut note = |order: &str, stage: String, at: i128| {
        stages
            .entry(order.to_string())
            .or_default()
            .entry(stage)
            .or_insert(at);
    };
    for (subject, body, _, at) in read(
        js,
        "AGGREGATE_EVENTS",
        &format!("tenant.{tenant}.aggregate.Order.*"),
    )
    .await?
    {
        if let Some(id) = subject.rsplit('.').next() {
            note(id, "placed".into(), at);
        }
        let _ = body;
    }
    for (subject, body, _, at) in read(
        js,
        "WORKFLOW_COMMANDS",
        &format!("tenant.{tenant}.effect.>"),
    )
    .await?
    {
        let effect = subject.split('.').nth(3).unwrap_or_default();
        if let Some(order) = correlation(&body) {
            note(&order, format!("cmd:{effect}"), at);
        }
    }
    // The router's copy of each order event in the saga inbox.
    let placed = format!("tenant.{tenant}.aggregate.Order.");
    for (_, _, of, at) in read(js, "SAGA_INBOX", "runner.inbox.*.AGGREGATE_EVENTS").await? {
        if let Some(id) = of.strip_prefix(&placed) {
            note(id, "routed".into(), at);
        }
    }
    let prefix = format!("tenant.{tenant}.effect_result.");
    for (_, body, of, at) in read(js, "SAGA_INBOX", "runner.inbox.*.result").await? {
        let Some(effect) = of.strip_prefix(&prefix).and_then(|r| r.split('.').next()) else {
            continue;
        };
        if let Some(order) = correlation(&body) {
            note(&order, format!("res:{effect}"), at);
        }
    }
    for (subject, body, _, at) in read(
        js,
        "WORKFLOW_EVENTS",
        &format!("tenant.{tenant}.workflow_event.order.*"),
    )
    .await?
    {
        if body["event_type"] == "OrderFulfilled"
            && let Some(id) = subject.rsplit('.').next()
        {
            note(id, "fulfilled".into(), at);
        }
    }
    let mut parts = Vec::new();
    for (name, from, to) in HOPS {
        let mut ms: Vec<f64> = stages
            .values()
            .filter_map(|s| Some((s.get(to)? - s.get(from)?) as f64 / 1e6))
            .collect();
        ms.sort_by(f64::total_cmp);
        parts.push(format!(
            "{name} {:.0}/{:.0}",
            crate::percentile(&ms, 0.5),
            crate::percentile(&ms, 0.95)
        ));
    }
    // The route's worst wait per second of the drive: whether it waits throughout or only
    // while another tenant's burst is read.
    let start = stages
        .values()
        .filter_map(|s| s.get("placed"))
        .min()
        .copied();
    let mut by_second: std::collections::BTreeMap<i128, f64> = Default::default();
    for s in stages.values() {
        if let (Some(p), Some(r), Some(t0)) = (s.get("placed"), s.get("routed"), start) {
            let worst = by_second.entry((p - t0) / 1_000_000_000).or_insert(0.0);
            *worst = worst.max((r - p) as f64 / 1e6);
        }
    }
    let seconds: Vec<String> = by_second
        .iter()
        .map(|(s, ms)| format!("{s}s {ms:.0}"))
        .collect();
    parts.push(format!(
        "route's worst wait by second: {}",
        seconds.join(", ")
    ));
    Ok(parts.join(" | "))
}

/// The order an event, command or result belongs to.
fn correlation(body: &Json) -> Option<String> {
    body["metadata"]["correlation_id"]
        .as_str()
        .or_else(|| body["payload"]["order_id"].as_str())
        .map(str::to_owned)
}

/// Every message stored on `stream` under `filter`: its subject, body, `Runner-Subject`
/// header (where a routed or direct copy was published first) and stored time.
async fn read(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
) -> Result<Vec<(String, Json, String, i128)>> {
    let s = js.get_stream(stream).await?;
    let consumer = s
        .create_consumer(pull::OrderedConfig {
            filter_subject: filter.to_string(),
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut msgs = consumer.messages().await?;
    let mut out = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(2), msgs.next()).await;
        let Ok(Some(Ok(m))) = next else { break };
        let info = m.info().map_err(|e| anyhow::anyhow!("{e}"))?;
        let pending = info.pending;
        let at = info.published.unix_timestamp_nanos();
        let of = m
            .headers
            .as_ref()
            .and_then(|h| h.get("Runner-Subject"))
            .map(|v| v.as_str().to_string())
            .unwrap_or_default();
        let body = serde_json::from_slice(&m.payload).unwrap_or(Json::Null);
        out.push((m.subject.to_string(), body, of, at));
        if pending == 0 {
            break;
        }
    }
    Ok(out)
}
