//! `runner tenants` and `runner partitions`: what only a running node does, so these
//! commands need `--admin URL` and refuse without it.

use super::store::remote;
use crate::cli::{OutputFormat, PartitionsAction, StoreArgs, TenantsAction};

/// `runner tenants`: pause, resume, list, reload — through a running saga node only (the pause is
/// shared by every node through NATS, and a resume releases inside the node's commits).
pub fn tenants(args: &StoreArgs, action: TenantsAction) -> anyhow::Result<()> {
    use crate::admin::client::enc;
    let Some(api) = remote(args)? else {
        anyhow::bail!(
            "tenants are paused and resumed through a running saga node: add --admin URL"
        );
    };
    match action {
        TenantsAction::Pause { tenant } => {
            let v = api.post(
                &format!("/admin/tenants/{}/pause", enc(&tenant)),
                &serde_json::json!({}),
            )?;
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        }
        TenantsAction::Resume { tenant } => {
            let v = api.post(
                &format!("/admin/tenants/{}/resume", enc(&tenant)),
                &serde_json::json!({}),
            )?;
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        }
        TenantsAction::Reload => {
            let v = api.post("/admin/tenants/reload", &serde_json::json!({}))?;
            crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        }
        TenantsAction::List { output } => {
            let v = api.get("/admin/tenants")?;
            if output == OutputFormat::Json {
                crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                print_tenants(&v)?;
            }
        }
    }
    Ok(())
}

/// A line per tenant: its use of this node against its limits (`GET /admin/tenants`).
fn print_tenants(v: &serde_json::Value) -> anyhow::Result<()> {
    let tenants = v["tenants"].as_array().cloned().unwrap_or_default();
    crate::outln!(
        "{:<24} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10} {:>8} {:>8} {:>12} {:>12} {:>6} {:>10} {:>6}",
        "TENANT",
        "LIVE",
        "CAP",
        "TIMERS",
        "TIMER_CAP",
        "OUTBOX",
        "OUTBOX_CAP",
        "HELD",
        "WAITING",
        "OLDEST_WAIT",
        "LET_IN",
        "WEIGHT",
        "RATE/S",
        "PAUSED"
    )?;
    let cap = |v: &serde_json::Value| v.as_u64().map_or("-".to_string(), |c| c.to_string());
    for t in &tenants {
        let rate = t["rate_limit_per_s"]
            .as_f64()
            .map_or("-".to_string(), |r| format!("{r}"));
        crate::outln!(
            "{:<24} {:>8} {:>8} {:>8} {:>9} {:>10} {:>10} {:>8} {:>8} {:>11.1}s {:>12} {:>6} {:>10} {:>6}",
            crate::telemetry::escape_controls(t["tenant"].as_str().unwrap_or("-")),
            t["live_instances"].as_u64().unwrap_or(0),
            cap(&t["live_instance_cap"]),
            t["pending_timers"].as_u64().unwrap_or(0),
            cap(&t["pending_timer_cap"]),
            t["outbox_bytes"].as_u64().unwrap_or(0),
            cap(&t["outbox_byte_cap"]),
            t["held_at_cap"].as_u64().unwrap_or(0),
            t["waiting_inputs"].as_u64().unwrap_or(0),
            t["oldest_wait_s"].as_f64().unwrap_or(0.0),
            t["inputs_let_in"].as_u64().unwrap_or(0),
            t["weight"].as_u64().unwrap_or(1),
            rate,
            if t["paused"].as_bool().unwrap_or(false) {
                "yes"
            } else {
                "no"
            }
        )?;
    }
    let paused = v["paused"].as_array().map_or(0, Vec::len);
    crate::outln!("{} tenant(s), {paused} paused", tenants.len())?;
    Ok(())
}

/// `runner partitions replay`: asks the owner of a partition to read its inbox again.
pub fn partitions(args: &StoreArgs, action: PartitionsAction) -> anyhow::Result<()> {
    let Some(api) = remote(args)? else {
        anyhow::bail!("a partition is replayed by the node that owns it: add --admin URL");
    };
    match action {
        PartitionsAction::Replay {
            partition,
            from,
            confirm,
        } => {
            let body = serde_json::json!({ "from": from, "confirm": confirm });
            match api.post(&format!("/admin/partitions/{partition}/replay"), &body) {
                Ok(v) => crate::outln!("{}", serde_json::to_string_pretty(&v)?)?,
                Err(crate::admin::client::ClientError::Refused {
                    status: 400,
                    message,
                }) if !confirm => {
                    crate::outln!("{message}")?;
                    anyhow::bail!("nothing done: add --confirm to replay");
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}
