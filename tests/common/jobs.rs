//! The `job` saga of the admission and tenant tests: one step that calls an HTTP upstream
//! with the job's id, then a `Finish` command; its triggers; an upstream that holds its
//! answers until released; and what the tests read back (finished jobs, upstream calls, a
//! tenant's row in `GET /admin/tenants`).

use std::sync::Arc;

use serde_json::json;

use super::upstream::{Latch, Reply, Upstream};
use super::{aggregate_event, publish_json};

/// The `job` saga calling `{upstream}/ping` with `{job}`.
pub fn manifest(upstream: &str) -> String {
    format!(
        r#"format: 1
effects:
  - name: ping
    provider: http
    settings: {{ url: "{upstream}/ping", method: POST }}
sagas:
  - name: job
    version: 1
    triggers:
      - {{ subject: aggregate.Job.*, event_type: JobStarted, correlation: event.aggregate_id, start: true }}
      - {{ subject: effect_result.ping.*, correlation: event.metadata.correlation_id }}
    data: {{ job: "${{ event.aggregate_id }}" }}
    initial_state: new
    states:
      new:
        on:
          JobStarted:
            emit: [{{ effect: {{ name: ping, payload: {{ job: "${{ state.job }}" }} }} }}]
            goto: pinging
      pinging:
        on:
          ping.Succeeded:
            emit: [{{ command: {{ aggregate_type: Job, command: Finish, aggregate_id: "${{ state.job }}", payload: {{}} }} }}]
            goto: done
      done: {{ terminal: true }}
"#
    )
}

/// Publishes `JobStarted` for jobs `<tenant>-<from>` … `<tenant>-<to - 1>` of `tenant`.
pub async fn start(js: &async_nats::jetstream::Context, tenant: &str, from: u64, to: u64) {
    for i in from..to {
        let id = format!("{tenant}-{i}");
        let ev = aggregate_event(
            tenant,
            "Job",
            &id,
            "JobStarted",
            1_800_000_000_000 + i,
            json!({}),
        );
        publish_json(js, &format!("tenant.{tenant}.aggregate.Job.{id}"), &ev).await;
    }
}

/// A manifest directory whose `job` saga calls `upstream`.
pub fn manifests(upstream: &Upstream) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("job.yaml"), manifest(&upstream.base)).unwrap();
    dir
}

/// An upstream whose answers wait for the returned latch, and a manifest directory whose
/// `job` saga calls it.
pub async fn held_upstream() -> (Latch, Upstream, tempfile::TempDir) {
    let hold = Latch::new();
    let upstream = {
        let hold = hold.clone();
        Upstream::start(Arc::new(move |_, _, _| Reply::ok(json!({})).until(&hold))).await
    };
    let manifests = manifests(&upstream);
    (hold, upstream, manifests)
}

/// The `Finish` commands of `tenant`'s jobs that completed.
pub async fn finished(js: &async_nats::jetstream::Context, tenant: &str) -> Vec<super::Seen> {
    super::read_stream(
        js,
        "WORKFLOW_COMMANDS",
        &format!("tenant.{tenant}.command.Job.*"),
    )
    .await
}

/// The jobs of `tenant` the upstream was called for, in the order the calls arrived.
pub fn called(upstream: &Upstream, tenant: &str) -> Vec<String> {
    let prefix = format!("{tenant}-");
    upstream
        .hits()
        .iter()
        .filter_map(|h| h.body["job"].as_str().map(str::to_string))
        .filter(|j| j.starts_with(&prefix))
        .collect()
}

/// `tenant`'s row in `GET /admin/tenants`.
pub async fn tenant_row(admin: &str, tenant: &str) -> serde_json::Value {
    let v = super::get_json(&format!("{admin}/admin/tenants")).await;
    v["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == tenant)
        .cloned()
        .unwrap_or_else(|| panic!("no {tenant} in {v}"))
}
